"""Per-channel sums on the GPU (batch norm's statistics and gradients), two deterministic passes.

    channel_sums(a, b, shift_a, shift_b) -> (s1 [C], s2 [C]) float32
        s1[c] = sum of a[:, c]            s2[c] = sum of (a[:, c] - shift_a[c]) * (b[:, c] - shift_b[c])
    over a, b [N, C] or [N, C, H, W] (float32, float16 or bfloat16, accumulated in float32); shift_a, shift_b [C]
    float32. The reference is train/kernels.py channel_sums on NumPy (the same sums along axes 0, 2, 3).

CuPy's own reduction over axes (0, 2, 3) gives each channel one block: on the tomato model's first
batch norm (256 x 16 x 128 x 128) that took 82 ms on an H200. Here each channel is split into up to
MAX_CHUNKS blocks of whole rows n (grid chunks x C; a row of H*W values is read contiguously, without
index division) that write partial sums, and one block per channel adds them in a fixed order: no
atomics, the same bits every run. Importing this module imports CuPy.
"""

from __future__ import annotations

import cupy
import numpy as np

from lnn.runtime.cuda.float16 import CONVERSIONS, INDEXING

THREADS = 256
CHUNK = 8192                  # elements of one channel per first-pass block, at least
MAX_CHUNKS = 256

_SOURCE = CONVERSIONS + INDEXING + r"""

__device__ __forceinline__ void block_sum2(float& s1, float& s2) {
    __shared__ float first[256], second[256];
    first[threadIdx.x] = s1;
    second[threadIdx.x] = s2;
    __syncthreads();
    for (int half = blockDim.x / 2; half > 0; half /= 2) {
        if (threadIdx.x < half) {
            first[threadIdx.x] += first[threadIdx.x + half];
            second[threadIdx.x] += second[threadIdx.x + half];
        }
        __syncthreads();
    }
    s1 = first[0];
    s2 = second[0];
}

template <typename T>
__device__ void partial_sums(const T* a, const T* b, const float* shift_a, const float* shift_b, float* partial,
                             long long outer, int channels, long long inner) {
    const int c = blockIdx.y;
    const float sa = shift_a[c], sb = shift_b[c];
    float s1 = 0.0f, s2 = 0.0f;
    // this block's rows [first, last) of channel c; long rows are walked without index division
    const long long rows = (outer + gridDim.x - 1) / gridDim.x;
    const long long first = blockIdx.x * rows;
    const long long last = first + rows < outer ? first + rows : outer;
    if (inner >= blockDim.x) {
        for (long long row = first; row < last; ++row) {
            const long long base = (row * channels + c) * inner;
            for (long long p = threadIdx.x; p < inner; p += blockDim.x) {
                const float va = lnn_load(a[base + p]), vb = lnn_load(b[base + p]);
                s1 += va;
                s2 += (va - sa) * (vb - sb);
            }
        }
    } else {
        const long long count = (last > first ? last - first : 0) * inner;
        for (long long e = threadIdx.x; e < count; e += blockDim.x) {
            int p;
            const long long row = first + lnn_divide(e, (int)inner, &p);
            const long long at = (row * channels + c) * inner + p;
            const float va = lnn_load(a[at]), vb = lnn_load(b[at]);
            s1 += va;
            s2 += (va - sa) * (vb - sb);
        }
    }
    block_sum2(s1, s2);
    if (threadIdx.x == 0) {
        const long long slot = ((long long)c * gridDim.x + blockIdx.x) * 2;
        partial[slot] = s1;
        partial[slot + 1] = s2;
    }
}

extern "C" {
__global__ void lnn_channel_sums_f32(const float* a, const float* b, const float* shift_a, const float* shift_b,
                                     float* partial, long long outer, int channels, long long inner) {
    partial_sums<float>(a, b, shift_a, shift_b, partial, outer, channels, inner);
}
__global__ void lnn_channel_sums_f16(const unsigned short* a, const unsigned short* b, const float* shift_a,
                                     const float* shift_b, float* partial, long long outer, int channels,
                                     long long inner) {
    partial_sums<unsigned short>(a, b, shift_a, shift_b, partial, outer, channels, inner);
}
__global__ void lnn_channel_sums_bf16(const lnn_bf16* a, const lnn_bf16* b, const float* shift_a,
                                      const float* shift_b, float* partial, long long outer, int channels,
                                      long long inner) {
    partial_sums<lnn_bf16>(a, b, shift_a, shift_b, partial, outer, channels, inner);
}
// one block per channel: the chunks' partial sums in a fixed order
__global__ void lnn_channel_sums_finish(const float* partial, float* s1, float* s2, int chunks) {
    float first = 0.0f, second = 0.0f;
    for (int k = threadIdx.x; k < chunks; k += blockDim.x) {
        const long long slot = ((long long)blockIdx.x * chunks + k) * 2;
        first += partial[slot];
        second += partial[slot + 1];
    }
    block_sum2(first, second);
    if (threadIdx.x == 0) { s1[blockIdx.x] = first; s2[blockIdx.x] = second; }
}
}
"""

_module = None
KERNEL_NAMES = {"float32": "lnn_channel_sums_f32", "float16": "lnn_channel_sums_f16", "bfloat16": "lnn_channel_sums_bf16"}


def supported(a) -> bool:
    return a.dtype.name in KERNEL_NAMES and a.flags.c_contiguous


def channel_sums(a, b, shift_a, shift_b):
    global _module
    if _module is None:
        _module = cupy.RawModule(code=_SOURCE, options=("--std=c++14",))
    outer, channels = a.shape[0], a.shape[1]
    inner = a.size // (outer * channels)
    chunks = max(1, min(MAX_CHUNKS, outer, -(-(outer * inner) // CHUNK)))     # blocks of whole rows
    partial = cupy.empty(channels * chunks * 2, np.float32)
    s1 = cupy.empty(channels, np.float32)
    s2 = cupy.empty(channels, np.float32)
    _module.get_function(KERNEL_NAMES[a.dtype.name])(
        (chunks, channels), (THREADS,),
        (a, b, shift_a, shift_b, partial, np.int64(outer), np.int32(channels), np.int64(inner)))
    _module.get_function("lnn_channel_sums_finish")((channels,), (THREADS,), (partial, s1, s2, np.int32(chunks)))
    return s1, s2
