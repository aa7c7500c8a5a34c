"""The one GEMM route of lnn on the GPU: cublasGemmStridedBatchedEx on cuBLAS handles of our own.

    matmul(xp, a, b, out, accumulate=False)      out (+)= a @ b

a [M, K] and b [K, N] (or [B, M, K] and [B, K, N], a 2-D operand shared by every batch entry), out [M, N]
(or [B, M, N]), row-major as NumPy. An operand may be a transposed view (`w.T`, `x.transpose(0, 2, 1)`)
of a C-contiguous array: it is passed to cuBLAS as op = T, never copied. out must be C-contiguous.
On NumPy this is np.matmul (the reference); on CuPy one cuBLAS call that CUDA-graph stream capture
accepts (CuPy's own cuBLAS calls refuse capture: "calling cuBLAS API during stream capture is
currently unsupported").

Types: float32 (compute fp32, or TF32 tensor cores inside `tf32()`), float16 and bfloat16 inputs and
outputs with fp32 accumulation (tensor cores), float64. Each calling thread has its own handle (cuBLAS
handles are not thread-safe), bound to the current CuPy stream at every call and given a pre-allocated
workspace (cuBLAS must not allocate during capture). Importing this module imports no CuPy.
"""

from __future__ import annotations

import ctypes
import threading
from contextlib import contextmanager

import numpy as np

from lnn.formats.errors import LnnError

WORKSPACE_BYTES = 32 * 2 ** 20            # NVIDIA's recommendation for Hopper
OP_N, OP_T = 0, 1
CUDA_TYPES = {np.dtype(np.float32): 0, np.dtype(np.float64): 1, np.dtype(np.float16): 2}
CUDA_R_16BF = 14
COMPUTE_32F, COMPUTE_32F_FAST_TF32, COMPUTE_64F = 68, 77, 70
GEMM_DEFAULT = -1


def matmul(xp, a, b, out, accumulate: bool = False):
    """out = a @ b, or out += a @ b (accumulate); returns out."""
    if xp is np:
        if accumulate:
            out += a @ b
        else:
            np.matmul(a, b, out=out)
        return out
    _handle().gemm(a, b, out, accumulate)
    return out


_local = threading.local()


@contextmanager
def tf32(enabled: bool = True):
    """float32 GEMMs of this thread inside the block use TF32 tensor cores (10-bit mantissa inputs)."""
    before = getattr(_local, "tf32", False)
    _local.tf32 = enabled
    try:
        yield
    finally:
        _local.tf32 = before


def _handle():
    import cupy

    device = cupy.cuda.runtime.getDevice()
    handles = getattr(_local, "handles", None)
    if handles is None:
        handles = _local.handles = {}
    if device not in handles:
        handles[device] = Handle(cupy)
    return handles[device]


def _loaded_cublas_path() -> str | None:
    """The libcublas this process has mapped (CuPy's), from /proc/self/maps."""
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                path = line.split()[-1]
                if path.rsplit("/", 1)[-1].startswith("libcublas.so"):
                    return path
    except OSError:
        return None
    return None


def _load_library(cupy):
    cupy.cuda.device.get_cublas_handle()               # makes CuPy load its libcublas
    path = _loaded_cublas_path()
    candidates = [path] if path else ["libcublas.so.13", "libcublas.so.12", "libcublas.so"]
    for candidate in candidates:
        try:
            lib = ctypes.CDLL(candidate)
            break
        except OSError:
            continue
    else:
        raise LnnError(f"cannot load libcublas (tried {', '.join(candidates)})")
    void, integer = ctypes.c_void_p, ctypes.c_int
    lib.cublasCreate_v2.argtypes = [ctypes.POINTER(void)]
    lib.cublasSetStream_v2.argtypes = [void, void]
    lib.cublasSetWorkspace_v2.argtypes = [void, void, ctypes.c_size_t]
    lib.cublasDestroy_v2.argtypes = [void]
    lib.cublasGemmStridedBatchedEx.argtypes = [
        void, integer, integer, integer, integer, integer, void,
        void, integer, integer, ctypes.c_longlong,
        void, integer, integer, ctypes.c_longlong, void,
        void, integer, integer, ctypes.c_longlong, integer, integer, integer]
    return lib


def _cuda_type(dtype) -> int:
    dtype = np.dtype(dtype)
    if dtype in CUDA_TYPES:
        return CUDA_TYPES[dtype]
    if dtype.name == "bfloat16":
        return CUDA_R_16BF
    raise LnnError(f"GEMM: no cuBLAS type for {dtype.name}")


def _operand(array):
    """(op, leading dimension, batch stride, item) of a row-major [.., R, C] operand as cuBLAS sees it."""
    item = array.itemsize
    rows, columns = array.shape[-2:]
    row_stride, column_stride = array.strides[-2:]
    if column_stride == item and (row_stride == columns * item or rows == 1):
        op, lead = OP_N, columns
    elif row_stride == item and (column_stride == rows * item or columns == 1):
        op, lead = OP_T, rows
    else:
        raise LnnError(f"GEMM operand of shape {array.shape} and strides {array.strides} is neither contiguous "
                       f"nor a transposed contiguous array")
    batch_stride = array.strides[0] // item if array.ndim == 3 else 0
    return op, max(lead, 1), batch_stride


class Handle:
    """A cuBLAS handle with its own workspace (one per thread and device)."""

    def __init__(self, cupy):
        self.cupy = cupy
        self.lib = _load_library(cupy)
        self.handle = ctypes.c_void_p()
        self._check(self.lib.cublasCreate_v2(ctypes.byref(self.handle)), "cublasCreate_v2")
        self.workspace = cupy.empty(WORKSPACE_BYTES, dtype=np.uint8)
        self._check(self.lib.cublasSetWorkspace_v2(self.handle, ctypes.c_void_p(self.workspace.data.ptr),
                                                   WORKSPACE_BYTES), "cublasSetWorkspace_v2")
        self._one32, self._zero32 = ctypes.c_float(1.0), ctypes.c_float(0.0)
        self._one64, self._zero64 = ctypes.c_double(1.0), ctypes.c_double(0.0)

    @staticmethod
    def _check(status: int, what: str):
        if status != 0:
            raise LnnError(f"{what} returned cuBLAS status {status}")

    def gemm(self, a, b, out, accumulate: bool):
        if out.ndim not in (2, 3) or not out.flags.c_contiguous:
            raise LnnError(f"GEMM output of shape {out.shape} must be a C-contiguous 2-D or 3-D array")
        m, n = out.shape[-2:]
        k = a.shape[-1]
        batch = out.shape[0] if out.ndim == 3 else 1
        if a.shape[-2] != m or b.shape[-2:] != (k, n) or any(
                x.ndim == 3 and x.shape[0] != batch for x in (a, b)) or (out.ndim == 2 and (a.ndim == 3 or b.ndim == 3)):
            raise LnnError(f"GEMM shapes do not agree: out {out.shape} = a {a.shape} @ b {b.shape}")
        if a.dtype != b.dtype:
            raise LnnError(f"GEMM operands differ in type: {a.dtype.name} and {b.dtype.name}")
        op_a, lda, stride_a = _operand(a)
        op_b, ldb, stride_b = _operand(b)
        if a.dtype == np.float64:
            compute, one, zero = COMPUTE_64F, self._one64, self._zero64
        else:
            fast = a.dtype == np.float32 and getattr(_local, "tf32", False)
            compute, one, zero = (COMPUTE_32F_FAST_TF32 if fast else COMPUTE_32F), self._one32, self._zero32
        beta = one if accumulate else zero
        self._check(self.lib.cublasSetStream_v2(self.handle, ctypes.c_void_p(self.cupy.cuda.get_current_stream().ptr)),
                    "cublasSetStream_v2")
        # row-major out [M, N] = a @ b is column-major out^T [N, M] = b^T @ a^T
        status = self.lib.cublasGemmStridedBatchedEx(
            self.handle, op_b, op_a, n, m, k, ctypes.byref(one),
            ctypes.c_void_p(b.data.ptr), _cuda_type(b.dtype), ldb, stride_b,
            ctypes.c_void_p(a.data.ptr), _cuda_type(a.dtype), lda, stride_a, ctypes.byref(beta),
            ctypes.c_void_p(out.data.ptr), _cuda_type(out.dtype), n, m * n if out.ndim == 3 else 0, batch,
            compute, GEMM_DEFAULT)
        self._check(status, "cublasGemmStridedBatchedEx")

    def __del__(self):
        try:
            if self.handle:
                self.lib.cublasDestroy_v2(self.handle)
        except Exception:               # noqa: BLE001 - interpreter shutdown
            pass
