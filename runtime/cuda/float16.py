"""The CUDA source every lnn kernel module starts with: the 16-bit floats of amp read into or written from
float32, beside the float32 identity overloads, so one kernel template serves all three (`lnn_load(v)`,
`lnn_store(pointer, v)`; round to nearest even):
  float16   carried as its 16 bits, `unsigned short` (as CuPy passes float16 arrays);
  bfloat16  carried as its 16 bits in a struct of its own, `lnn_bf16`, so no overload can take one for the
            other. On the host a bfloat16 array is ml_dtypes' bfloat16 (NumPy has none), which CuPy 14 takes.
`c_type(dtype)` names the C type of an array's dtype (the kernels' template argument). No CuPy import: the
kernel modules prepend CONVERSIONS to their own sources, and INDEXING where they split flat indices.
"""

import numpy as np

CONVERSIONS = r"""
__device__ __forceinline__ float lnn_load(float v) { return v; }
__device__ __forceinline__ float lnn_load(unsigned short h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}
__device__ __forceinline__ void lnn_store(float* p, float v) { *p = v; }
__device__ __forceinline__ void lnn_store(unsigned short* p, float v) {
    unsigned short h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(v));
    *p = h;
}
// bfloat16: the upper half of a float32
struct lnn_bf16 { unsigned short bits; };
__device__ __forceinline__ float lnn_load(lnn_bf16 h) { return __uint_as_float((unsigned)h.bits << 16); }
__device__ __forceinline__ void lnn_store(lnn_bf16* p, float v) {
#if __CUDA_ARCH__ >= 800
    unsigned short h;
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h) : "f"(v));
    p->bits = h;
#else
    const unsigned u = __float_as_uint(v);           // the same rounding in integers; a NaN stays a quiet NaN
    p->bits = (u & 0x7fffffffu) > 0x7f800000u ? (unsigned short)((u >> 16) | 0x40u)
                                                : (unsigned short)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
#endif
}
"""

INDEXING = r"""
// q = quotient * divisor + remainder (q >= 0, divisor > 0), in 32-bit arithmetic while q fits: a 64-bit
// division costs several times a 32-bit one, and element-wise kernels that split every flat index pay it per
// element (H200, the 2x2 pool backward of a [256, 16, 128, 128] float16 map: 0.52 ms with 64-bit divisions and
// one thread per cell, 0.13 with these and one thread per window; its forward took 0.15 ms either way).
__device__ __forceinline__ long long lnn_divide(long long q, int divisor, int* remainder) {
    if (q <= 0x7fffffffLL) {
        const unsigned u = (unsigned)q, m = u / (unsigned)divisor;
        *remainder = (int)(u - m * (unsigned)divisor);
        return m;
    }
    const long long m = q / divisor;
    *remainder = (int)(q - m * divisor);
    return m;
}
// Element i of an [planes, rows, columns] array as (plane, row, column)
__device__ __forceinline__ long long lnn_plane_of(long long i, int rows, int columns, int* row, int* column) {
    return lnn_divide(lnn_divide(i, columns, column), rows, row);
}
"""

C_TYPES = {"float32": "float", "float16": "unsigned short", "bfloat16": "lnn_bf16"}     # by dtype name
HALF_TYPES = ("float16", "bfloat16")                 # amp's 16-bit floats, computed in float32
AMP_PRECISIONS = {"fp16": "float16", "bf16": "bfloat16"}   # the trainer's names for them (amp=, --amp)


def c_type(dtype) -> str:
    """The kernels' C type for arrays of `dtype` (float32, float16 or bfloat16: a dtype or its name)."""
    return C_TYPES[dtype if isinstance(dtype, str) else np.dtype(dtype).name]


def bfloat16():
    """NumPy's dtype of bfloat16 arrays (ml_dtypes'; CuPy 14 takes it), or None when ml_dtypes is not installed."""
    try:
        import ml_dtypes
    except ImportError:
        return None
    return np.dtype(ml_dtypes.bfloat16)
