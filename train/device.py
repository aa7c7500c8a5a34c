"""Where training runs: NumPy on the CPU or CuPy on an NVIDIA GPU, chosen by name.

`select_device("auto" | "cuda" | "numpy")` -> (xp, "cpu" | "cuda"). CuPy is imported only here and
only when asked for ("auto" tries it and falls back to the CPU quietly). Training on the CPU is
NumPy ("cpu" is accepted as another name for it; the trainer has no Numba path).

`check_memory_fits` compares a plan's memory with what the device has free before anything is
allocated, and `out_of_memory` is the one-line error for an allocation that fails anyway.
"""

from __future__ import annotations

import os

import numpy as np

from lnn.formats.errors import LnnError

DEVICES = ("auto", "cuda", "numpy", "cpu")          # cpu: another name for numpy


def _cupy_with_gpu():
    """CuPy when it imports and sees a GPU, else (None, reason)."""
    try:
        import cupy
    except Exception as err:                          # ImportError, or a broken CUDA install
        return None, f"CuPy is not installed ({type(err).__name__}: {err}); pip install 'lnn[cuda]'"
    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except Exception as err:
        return None, f"CuPy finds no usable CUDA device ({err})"
    if count < 1:
        return None, "CuPy finds no CUDA device"
    return cupy, ""


def select_device(name: str = "auto"):
    if name not in DEVICES:
        raise LnnError(f"device must be one of {', '.join(DEVICES)}, not {name!r}")
    if name in ("numpy", "cpu"):
        return np, "cpu"
    cupy, reason = _cupy_with_gpu()
    if cupy is not None:
        return cupy, "cuda"
    if name == "cuda":
        raise LnnError(f"--device cuda: {reason}")
    return np, "cpu"


def is_cupy(xp) -> bool:
    return xp is not np


def device_bytes_held(xp) -> int | None:
    """Bytes CuPy's memory pool holds on the GPU (everything lnn allocated there: plan, parameters,
    optimizer state, workspaces, data kept on the device); None on the CPU."""
    if not is_cupy(xp):
        return None
    return int(xp.get_default_memory_pool().total_bytes())


def to_numpy(array) -> np.ndarray:
    return array.get() if hasattr(array, "get") and not isinstance(array, np.ndarray) else np.asarray(array)


def cuda_info(cupy) -> dict:
    """Name, compute capability, memory, whether fp16 is fast (compute capability >= 7.0) and whether the card
    has bfloat16 tensor cores (8.0, Ampere, or newer)."""
    device = cupy.cuda.Device()
    properties = cupy.cuda.runtime.getDeviceProperties(device.id)
    name = properties["name"]
    name = name.decode() if isinstance(name, bytes) else str(name)
    free, total = device.mem_info
    capability = int(device.compute_capability)
    return {"name": name, "compute_capability": f"{capability // 10}.{capability % 10}",
            "memory_total": int(total), "memory_free": int(free), "fast_fp16": capability >= 70,
            "bfloat16": capability >= 80}


def free_bytes(xp) -> int | None:
    """Memory the device can still give: the GPU's free memory plus what CuPy's pool holds unused; on
    the CPU, the kernel's MemAvailable (Linux) or the free physical pages; None when unknown."""
    if is_cupy(xp):
        return int(xp.cuda.runtime.memGetInfo()[0] + xp.get_default_memory_pool().free_bytes())
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, ValueError, OSError):
        return None


def _size(n: int) -> str:
    return f"{n / 2**30:.1f} GiB ({n:,} bytes)" if n >= 2**30 else f"{n / 2**20:.1f} MiB ({n:,} bytes)"


def check_memory_fits(xp, planned: int, batch: int, device: str) -> None:
    """Refuse (one line) a training plan of `planned` bytes that the device has no room for."""
    free = free_bytes(xp)
    if free is not None and planned > free:
        raise LnnError(f"training at batch {batch:,} plans {_size(planned)} of memory, but the {device} has "
                       f"{_size(free)} free: choose a smaller --batch")


def out_of_memory(planned: int, batch: int, device: str) -> LnnError:
    """The one-line error for a MemoryError (CuPy's OutOfMemoryError is one) while training."""
    return LnnError(f"out of memory on the {device} while training at batch {batch:,} (the plan needs "
                    f"{_size(planned)}, plus the data and the library's workspaces): choose a smaller --batch")
