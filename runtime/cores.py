"""How many threads `threads="auto"` runs one call on: the cores this process may use, one per physical core, the
big cores only, no more than its CPU quota.

Of the CPUs the process's affinity allows (which a container's cpuset or `taskset` narrows), a core's second
hardware thread does not count (it shares the core's arithmetic units, which lnn's conv kernels keep busy: a split
layer gains little from it and pays a hand-off per layer), nor, on a machine of big and little cores, the little
ones (a split layer waits for its slowest part: on an Apple M1 an efficiency core's part would take about three
times a performance core's). onnxruntime's default thread count is the physical cores too, ncnn's the big cores.
A CPU quota (`docker run --cpus 2`, a Kubernetes limit, a systemd CPUQuota) caps the count at the CPUs' worth of
time it grants, rounded up: the affinity still lists every CPU of the host there, and a split over all of them
would wait on threads the quota has parked.

Linux: /sys/devices/system/cpu/cpuN/topology (core_cpus_list, or thread_siblings_list on older kernels) and
cpuN/cpu_capacity (arm64 big.LITTLE; absent where all cores are alike); the quota from the process's cgroup
(/proc/self/cgroup) and each cgroup above it: cpu.max (v2) or cpu.cfs_quota_us / cpu.cfs_period_us (v1). macOS:
sysctl hw.perflevel0.physicalcpu (the performance cores; hw.physicalcpu on Intel Macs). Elsewhere, or where that
cannot be read, every allowed CPU counts. Nothing here imports more than the standard library (ctypes only on macOS).
"""

from __future__ import annotations

import math
import os
import sys
from pathlib import Path

SYSFS_CPUS = Path("/sys/devices/system/cpu")
CGROUP_ROOT = Path("/sys/fs/cgroup")
PROC_CGROUP = Path("/proc/self/cgroup")
SIBLINGS_FILES = ("core_cpus_list", "thread_siblings_list")      # the newer name first
MACOS_CORE_COUNTS = (b"hw.perflevel0.physicalcpu", b"hw.physicalcpu")
BIG_CORE_SHARE = 0.75     # of the highest cpu_capacity: a big core (Cortex-A55 little cores: 0.4 of an A76)


def usable_cores() -> int:
    """The thread count of threads="auto" (see the module's header); at least 1."""
    allowed = _affinity()
    if allowed is None:
        return macos_performance_cores() or os.cpu_count() or 1
    return within_quota(big_physical_cores(allowed) or len(allowed) or 1)


def allowed_cpus() -> int:
    """The logical CPUs this process may run on (all of them where there is no affinity call)."""
    allowed = _affinity()
    return len(allowed) if allowed is not None else os.cpu_count() or 1


def _affinity() -> set | None:
    """The CPUs this process may run on, or None where there is no affinity call (macOS, Windows)."""
    try:
        return os.sched_getaffinity(0)
    except AttributeError:
        return None


def usable_cpus() -> int:
    """The logical CPUs this process may keep busy: allowed_cpus() within the CPU quota. For work that a core's
    second hardware thread does speed up, such as lnn-serve's photo decoding."""
    return within_quota(allowed_cpus())


def within_quota(count: int) -> int:
    """count, or the CPU quota where that is smaller (cgroup_cpu_quota)."""
    quota = cgroup_cpu_quota()
    return min(count, quota) if quota else count


def big_physical_cores(cpus, root: Path = SYSFS_CPUS) -> int:
    """How many physical cores the logical CPUs `cpus` belong to, counting only the big ones: a cpu_capacity of at
    least BIG_CORE_SHARE of the highest among them (a phone-class SoC's one prime core and its big cores count
    together, as do an Intel hybrid's favoured and other performance cores; little cores, at about 0.4 of a big
    one, do not); 0 when the topology cannot be read."""
    capacity_of_core = {}
    for cpu in cpus:
        folder = root / f"cpu{cpu}"
        siblings = next((text for text in (_read(folder / "topology" / name) for name in SIBLINGS_FILES) if text),
                        None)
        if siblings is None:
            return 0
        try:
            capacity = int(_read(folder / "cpu_capacity") or 0)
        except ValueError:
            capacity = 0
        capacity_of_core[siblings] = max(capacity, capacity_of_core.get(siblings, 0))
    if not capacity_of_core:
        return 0
    biggest = max(capacity_of_core.values())
    return sum(capacity >= BIG_CORE_SHARE * biggest for capacity in capacity_of_core.values())


def cgroup_cpu_quota(proc_cgroup: Path = PROC_CGROUP, root: Path = CGROUP_ROOT) -> int | None:
    """The CPUs' worth of time the process's cgroups grant it, rounded up (the smallest along each one's path to
    the root; a container sees its own cgroup as the root, so missing folders are skipped); None without a quota
    or where it cannot be read."""
    try:
        lines = proc_cgroup.read_text().splitlines()
    except OSError:
        return None
    quotas = []
    for line in lines:
        fields = line.split(":", 2)
        if len(fields) != 3:
            continue
        _, controllers, path = fields
        if controllers == "":                           # v2: one hierarchy
            top, read = root, _cpu_max
        elif "cpu" in controllers.split(","):           # v1: the cpu controller's own hierarchy
            top, read = root / controllers, _cfs_quota
        else:
            continue
        folder = top / path.strip("/")
        while True:
            quota = read(folder)
            if quota:
                quotas.append(quota)
            if folder == top or top not in folder.parents:
                break
            folder = folder.parent
    return math.ceil(min(quotas) - 1e-9) if quotas else None


def _cpu_max(folder: Path) -> float | None:
    """cgroup v2's cpu.max, "<quota> <period>" or "max <period>", as CPUs."""
    fields = (_read(folder / "cpu.max") or "").split()
    if len(fields) != 2 or fields[0] == "max":
        return None
    try:
        return int(fields[0]) / int(fields[1])
    except (ValueError, ZeroDivisionError):
        return None


def _cfs_quota(folder: Path) -> float | None:
    """cgroup v1's cpu.cfs_quota_us / cpu.cfs_period_us as CPUs (a quota of -1: none)."""
    try:
        quota, period = int(_read(folder / "cpu.cfs_quota_us") or -1), int(_read(folder / "cpu.cfs_period_us") or 0)
    except ValueError:
        return None
    return quota / period if quota > 0 and period > 0 else None


def macos_performance_cores() -> int:
    """macOS's count of performance cores (all physical cores on an Intel Mac); 0 elsewhere or when unreadable."""
    if sys.platform != "darwin":
        return 0
    import ctypes            # here: importing ctypes.util took 4 ms, on every command's start
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c"))
        for name in MACOS_CORE_COUNTS:
            value, size = ctypes.c_int(0), ctypes.c_size_t(ctypes.sizeof(ctypes.c_int))
            if libc.sysctlbyname(name, ctypes.byref(value), ctypes.byref(size), None, ctypes.c_size_t(0)) == 0 \
                    and value.value > 0:
                return value.value
    except (OSError, AttributeError):
        pass
    return 0


def cores_in_words() -> str:
    """usable_cores() in words: '2 usable cores', or '4 usable cores of 8 CPUs (...)' where it counts fewer."""
    cores, cpus = usable_cores(), allowed_cpus()
    word = "core" if cores == 1 else "cores"
    if cores == cpus:
        return f"{cores} usable {word}"
    quota = cgroup_cpu_quota()
    why = "one thread per physical core, big cores only" + (f"; a CPU quota of {quota}" if quota == cores else "")
    return f"{cores} usable {word} of {cpus} CPUs ({why})"


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip() or None
    except OSError:
        return None
