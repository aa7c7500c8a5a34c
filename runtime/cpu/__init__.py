"""The Numba CPU backend (`lnn.load(path, device="cpu")`).

Kernel files mirror the op names of formats/ops.py: conv2d.py, conv1d.py (conv2d's layer on [N, C, 1, T]
views), linear.py, pool.py (maxpool2d, avgpool2d,
global_avg_pool), batchnorm.py, activations.py, flatten.py; backend.py plans and runs them; jit.py
configures Numba (cache folder, threading layer) before importing it; cache.py answers "is this
model's compiled code cached?" without importing Numba.

`BACKEND` is resolved on first access, so `import lnn.runtime.cpu.cache` does not import Numba.
"""


def __getattr__(name):
    if name == "BACKEND":
        from lnn.runtime.cpu.backend import CpuBackend

        return CpuBackend
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
