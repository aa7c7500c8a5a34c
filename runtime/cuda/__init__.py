"""The CuPy GPU backend (`lnn.load(path, device="cuda")`).

kernels.py holds the forward kernels written against an array namespace (numpy or cupy), shared with
the trainer (train/kernels.py adds the backward); fused.py holds CuPy-only kernels (bias + activation
epilogue, im2col, max pool) that replace some of them on the GPU; backend.py plans and runs a model.

`BACKEND` is resolved on first access (importing CuPy then), so `import lnn.runtime.cuda.kernels` and
`import lnn.runtime.cuda.backend` do not import CuPy.
"""


def __getattr__(name):
    if name == "BACKEND":
        import cupy  # noqa: F401 - here, so that lnn.runtime.backend_class reports a missing CuPy in one line

        from lnn.runtime.cuda.backend import CudaBackend

        return CudaBackend
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
