"""The CUDA source every lnn kernel module starts with: float16 carried as its 16 bits (`unsigned short`, as
CuPy passes float16 arrays) and read into or written from float32, beside the float32 identity overloads,
so one kernel template serves both (`lnn_load(v)`, `lnn_store(pointer, v)`; round to nearest even).
No CuPy import: the kernel modules prepend this string to their own sources."""

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
"""
