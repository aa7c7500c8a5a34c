"""Where training runs: NumPy on the CPU or CuPy on an NVIDIA GPU, chosen by name.

`select_device("auto" | "cuda" | "cpu")` -> (xp, "cpu" | "cuda"). CuPy is imported only here and
only when asked for ("auto" tries it and falls back to the CPU quietly).
"""

from __future__ import annotations

import numpy as np

from lnn.formats.errors import LnnError

DEVICES = ("auto", "cuda", "cpu")


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
    if name == "cpu":
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
    """Name, compute capability, memory and whether fp16 is fast (compute capability >= 7.0)."""
    device = cupy.cuda.Device()
    properties = cupy.cuda.runtime.getDeviceProperties(device.id)
    name = properties["name"]
    name = name.decode() if isinstance(name, bytes) else str(name)
    free, total = device.mem_info
    capability = int(device.compute_capability)
    return {"name": name, "compute_capability": f"{capability // 10}.{capability % 10}",
            "memory_total": int(total), "memory_free": int(free), "fast_fp16": capability >= 70}
