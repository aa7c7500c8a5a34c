"""The Numba CPU backend (`lnn.load(path, device="cpu")`).

One file per op (or family of ops: pool.py, recurrent.py, activations.py) holds its layer, which names the
ops of formats/ops.py it runs, and its kernels with their ahead-of-time signatures; conv1d.py is conv2d's
layer on [N, C, 1, T] views. backend.py builds its table from the layers and plans and runs them; jit.py
configures Numba (cache folder, threading layer) before importing it; aot.py compiles the kernels ahead of
time; cache.py answers "is this model's compiled code cached?" without importing Numba.

`BACKEND` is resolved on first access, so `import lnn.runtime.cpu.cache` does not import Numba.
"""


def __getattr__(name):
    if name == "BACKEND":
        from lnn.runtime.cpu.backend import CpuBackend

        return CpuBackend
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
