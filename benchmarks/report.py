"""Shared by every benchmark script: machine/version facts and writing one section of docs/BENCHMARKS.md.

Each script owns one section, fenced by `<!-- begin NAME -->` / `<!-- end NAME -->`, and rewrites only
that section, so scripts run in any order and a figure is always the last one its script measured.
"""

from __future__ import annotations

import datetime
import importlib.metadata
import os
import platform
import re
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DOC = REPO / "docs" / "BENCHMARKS.md"
SHARED = Path(os.environ.get("LNN_SHARED") or REPO.parent / "shared")   # ../shared, or a copy named by $LNN_SHARED
HEADER = "# Benchmarks\n\nEvery figure below was written by the script named in its section; rerun it to refresh.\n"


def call_times(function, warmup: int, at_least: int, seconds: float, at_most: int, gap: float = 0.0) -> list:
    """Wall times (s) of function(): `warmup` untimed calls, then timed ones until at least `at_least` were
    made and, while fewer than `at_most`, until they add up to `seconds`; `gap` seconds of sleep after each
    timed call (untimed: calls now and then rather than back to back). Never on zeros: the callers pass
    real inputs."""
    import time

    for _ in range(warmup):
        function()
    times, spent = [], 0.0
    while len(times) < at_least or (spent < seconds and len(times) < at_most):
        start = time.perf_counter()
        function()
        times.append(time.perf_counter() - start)
        spent += times[-1]
        if gap:
            time.sleep(gap)
    return times


def cuda_event_ms(function, repeats: int) -> float:
    """Mean GPU ms of function() over `repeats` calls after one untimed call, between two CUDA events on the
    current stream (imports CuPy)."""
    import cupy

    function()
    start, end = cupy.cuda.Event(), cupy.cuda.Event()
    start.record()
    for _ in range(repeats):
        function()
    end.record()
    end.synchronize()
    return cupy.cuda.get_elapsed_time(start, end) / repeats


def busy_seconds() -> tuple[float, float]:
    """(CPU seconds every process on the machine has used since boot, from /proc/stat; this process's and its
    waited-for children's): their differences over a measurement give the CPU that other processes took
    meanwhile (Linux only)."""
    with open("/proc/stat") as stat:
        values = [int(v) for v in stat.readline().split()[1:]]
    times = os.times()
    return ((sum(values) - values[3] - values[4]) / os.sysconf("SC_CLK_TCK"),
            times.user + times.system + times.children_user + times.children_system)


def cpu_seconds(pid: int) -> float:
    """User + system CPU time a process has used (its threads included), from /proc/PID/stat."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def others_cores(before: tuple, after: tuple, seconds: float) -> float:
    """Cores other processes used between two busy_seconds() readings `seconds` apart."""
    return ((after[0] - before[0]) - (after[1] - before[1])) / max(seconds, 1e-9)


def cpu_words() -> str:
    """The CPU as /proc/cpuinfo names it, with its family / model and widest vectors where it says them (VMs of
    one name differ: "AMD EPYC" has been Zen 3 with AVX2 and Zen 4 with AVX-512)."""
    fields = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                if not line.strip():
                    break                                       # the first processor's block is enough
                fields.setdefault(key.strip(), value.strip())
    except OSError:
        pass
    name = fields.get("model name") or platform.processor() or platform.machine()
    flags = set(fields.get("flags", fields.get("Features", "")).split())
    vectors = next((words for flag, words in (("avx512f", "AVX-512"), ("avx2", "AVX2"), ("asimd", "NEON"))
                    if flag in flags), None)
    details = [f"family {fields['cpu family']} model {fields['model']}"] if "cpu family" in fields else []
    details += [vectors] if vectors else []
    return f"{name} ({', '.join(details)})" if details else name


def machine_line(packages=("numpy", "numba", "onnxruntime")) -> str:
    cpu = cpu_words()
    versions = []
    for name in packages:
        try:
            versions.append(f"{name} {importlib.metadata.version(name)}")
        except importlib.metadata.PackageNotFoundError:
            pass
    return (f"{datetime.date.today().isoformat()}, {cpu}, {os.cpu_count()} cores, "
            f"Python {platform.python_version()}, {', '.join(versions)}")


def markdown_table(headers: list, rows: list) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]
    return "\n".join(lines)


def update_section(name: str, body: str, doc: Path = DOC) -> None:
    """Replace (or append) the section called `name` in docs/BENCHMARKS.md."""
    text = doc.read_text() if doc.exists() else HEADER
    block = f"<!-- begin {name} -->\n{body.strip()}\n<!-- end {name} -->"
    pattern = re.compile(rf"<!-- begin {re.escape(name)} -->.*?<!-- end {re.escape(name)} -->", re.S)
    text = pattern.sub(lambda _: block, text) if pattern.search(text) else text.rstrip() + "\n\n" + block + "\n"
    doc.parent.mkdir(parents=True, exist_ok=True)
    doc.write_text(text)
