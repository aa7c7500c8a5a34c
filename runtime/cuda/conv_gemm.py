"""Implicit-GEMM convolution on the GPU: no im2col buffer; the window gather happens while tiles are
loaded into shared memory. The trainer uses it (eager CuPy step and CUDA-graph step) for every conv2d
that `supported(attrs)` accepts; the others keep im2col + GEMM (kernels.py, fused.py).

Shapes and reference semantics (formats/ops.py conv2d, as PyTorch):
  forward  x [N, C, H, W], weight [O, C, KH, KW], bias [O] -> y [N, O, OH, OW]   (stride 1, dilation 1)
           y[n,o,oh,ow] = act(bias[o] + sum_{c,kh,kw} weight[o,c,kh,kw] * x[n, c, oh-ph+kh, ow-pw+kw]),
           x read as 0 outside the image. GEMM view: Y[o, q] = W[o, k] X[k, q] with q = (n, oh, ow) and
           k = (c, kh, kw); X is never stored.
  dx       the forward kernel applied to dy [N, O, OH, OW] with the flipped, transposed weight
           flipped[c, o, kh, kw] = weight[o, c, KH-1-kh, KW-1-kw] and padding (KH-1-ph, KW-1-pw).
  dweight  dW[o, k] = sum_q dy[o, q] X[k, q] and dbias[o] = sum_q dy[o, q] (X gets a row of ones): q is
           split into chunks, each block writes its chunk's partial sums, then a second kernel adds the
           chunks in a fixed order (deterministic, no atomics); `accumulate` adds to the gradient
           instead of writing it (the eager step's contract).
Tiles: forward <BM, BN, TN>: BM output channels x BN positions per block of 256 threads, each thread
4 x TN results, 16 reduction rows per shared-memory step. Weight gradient <BM, BN>: BM output channels
x BN columns of k (32 or 64), each thread 4 x 4 results, 32 positions per step shared by 256 / (BM*BN/16)
groups of threads. The offset of each k = (c, kh, kw) inside a window comes from a
table [3, K] (offset, kh, kw) built once per layer. float32 or float16 (amp) in and out, float32
accumulation (CUDA cores, not tensor cores).
CuPy is imported when a ConvKernels is made (the sizing functions here do not need it).
"""

from __future__ import annotations

import numpy as np

THREADS = 256
TARGET_BLOCKS = 4 * 132             # blocks of the weight-gradient pass: a few waves of a large GPU
WGRAD_STEP = 32                     # positions per weight-gradient shared-memory step
FORWARD_TILES = {16: (256, 4), 32: (128, 4), 64: (128, 8)}      # BM -> (BN, TN)

SOURCE = r"""
#define THREADS 256

// T is float or unsigned short (the bits of a float16, amp): loaded into and stored from float
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

// table [3, K]: for k = (c, kh, kw): c*H*W + kh*W + kw, then kh, then kw
template <typename T, int BM, int BN, int TN>
__global__ void __launch_bounds__(THREADS) lnn_conv_igemm(
        const T* __restrict__ x, const T* __restrict__ weight, const T* __restrict__ bias,
        const int* __restrict__ table, T* __restrict__ y,
        int batch, int channels, int height, int width, int out_channels, int out_h, int out_w,
        int pad_h, int pad_w, int reduction, int has_bias, int relu) {
    constexpr int BK = 16, TM = 4;
    constexpr int ROW_THREADS = BM / TM, COL_THREADS = BN / TN;
    static_assert(ROW_THREADS * COL_THREADS == THREADS, "256 threads per block");
    constexpr int B_ROWS_PER_PASS = THREADS / BN;
    __shared__ float a_tile[BK][BM + 1];
    __shared__ float b_tile[BK][BN];
    const int tx = threadIdx.x % COL_THREADS, ty = threadIdx.x / COL_THREADS;
    const int positions = out_h * out_w;
    const long long columns = (long long)batch * positions;
    const long long q0 = (long long)blockIdx.x * BN;
    const int o0 = blockIdx.y * BM;
    const int* k_offset = table;
    const int* k_h = table + reduction;
    const int* k_w = table + 2 * reduction;

    // the column (output position) this thread gathers into b_tile
    const int load_column = threadIdx.x % BN;
    const long long load_q = q0 + load_column;
    const bool column_valid = load_q < columns;
    int corner_h = 0, corner_w = 0;
    long long base = 0;
    if (column_valid) {
        const long long n = load_q / positions;
        const int p = (int)(load_q % positions);
        corner_h = p / out_w - pad_h;
        corner_w = p % out_w - pad_w;
        base = n * channels * (long long)height * width + (long long)corner_h * width + corner_w;
    }

    float acc[TM][TN];
    #pragma unroll
    for (int i = 0; i < TM; ++i)
        #pragma unroll
        for (int j = 0; j < TN; ++j) acc[i][j] = 0.0f;

    // the next step's tile entries are loaded into registers while the current step computes
    constexpr int A_LOADS = BM * BK / THREADS, B_LOADS = BK / B_ROWS_PER_PASS;
    static_assert(A_LOADS * THREADS == BM * BK, "whole weight tiles");
    float a_next[A_LOADS], b_next[B_LOADS];
    auto load = [&](int k0) {
        #pragma unroll
        for (int t = 0; t < A_LOADS; ++t) {
            const int e = threadIdx.x + t * THREADS;
            const int o = o0 + e / BK, k = k0 + e % BK;
            a_next[t] = (o < out_channels && k < reduction) ? lnn_load(weight[(long long)o * reduction + k]) : 0.0f;
        }
        #pragma unroll
        for (int t = 0; t < B_LOADS; ++t) {
            const int k = k0 + threadIdx.x / BN + t * B_ROWS_PER_PASS;
            float v = 0.0f;
            if (column_valid && k < reduction) {
                const int h = corner_h + k_h[k], w = corner_w + k_w[k];
                if (h >= 0 && h < height && w >= 0 && w < width) v = lnn_load(x[base + k_offset[k]]);
            }
            b_next[t] = v;
        }
    };

    load(0);
    for (int k0 = 0; k0 < reduction; k0 += BK) {
        #pragma unroll
        for (int t = 0; t < A_LOADS; ++t) {
            const int e = threadIdx.x + t * THREADS;
            a_tile[e % BK][e / BK] = a_next[t];
        }
        #pragma unroll
        for (int t = 0; t < B_LOADS; ++t) b_tile[threadIdx.x / BN + t * B_ROWS_PER_PASS][load_column] = b_next[t];
        __syncthreads();
        if (k0 + BK < reduction) load(k0 + BK);
        #pragma unroll
        for (int kk = 0; kk < BK; ++kk) {
            float a[TM], b[TN];
            #pragma unroll
            for (int i = 0; i < TM; ++i) a[i] = a_tile[kk][ty + ROW_THREADS * i];
            #pragma unroll
            for (int j = 0; j < TN; ++j) b[j] = b_tile[kk][tx + COL_THREADS * j];
            #pragma unroll
            for (int i = 0; i < TM; ++i)
                #pragma unroll
                for (int j = 0; j < TN; ++j) acc[i][j] = fmaf(a[i], b[j], acc[i][j]);
        }
        __syncthreads();
    }

    #pragma unroll
    for (int j = 0; j < TN; ++j) {
        const long long q = q0 + tx + COL_THREADS * j;
        if (q >= columns) continue;
        const long long n = q / positions;
        const int p = (int)(q % positions);
        #pragma unroll
        for (int i = 0; i < TM; ++i) {
            const int o = o0 + ty + ROW_THREADS * i;
            if (o >= out_channels) continue;
            float v = acc[i][j] + (has_bias ? lnn_load(bias[o]) : 0.0f);
            if (relu) v = fmaxf(v, 0.0f);
            lnn_store(&y[(n * out_channels + o) * positions + p], v);
        }
    }
}

// partial [chunks, O, K + has_bias]: this block's chunk of sum_q dy[o, q] * X[k, q] (X[K, q] = 1).
// The BM x BN tile is covered by (BM/4) x (BN/4) threads with 4 x 4 results each; the block's other
// threads form more such groups, each summing every GROUPS-th position; the groups add up at the end.
template <typename T, int BM, int BN>
__global__ void __launch_bounds__(THREADS) lnn_conv_wgrad(
        const T* __restrict__ dy, const T* __restrict__ x, const int* __restrict__ table,
        float* __restrict__ partial,
        int batch, int channels, int height, int width, int out_channels, int out_h, int out_w,
        int pad_h, int pad_w, int reduction, int has_bias, long long chunk) {
    constexpr int BR = 32, TM = 4, TN = 4;
    constexpr int ROW_THREADS = BM / TM, COL_THREADS = BN / TN;
    constexpr int TILE_THREADS = ROW_THREADS * COL_THREADS;
    constexpr int GROUPS = THREADS / TILE_THREADS;
    static_assert(TILE_THREADS * GROUPS == THREADS, "whole groups of threads");
    constexpr int LOAD_GROUPS = THREADS / BR;
    __shared__ float a_tile[BR][BM + 1];
    __shared__ float b_tile[BR][BN + 1];
    __shared__ float group_sums[GROUPS > 1 ? GROUPS * BM * BN : 1];
    const int in_tile = threadIdx.x % TILE_THREADS, group = threadIdx.x / TILE_THREADS;
    const int tx = in_tile % COL_THREADS, ty = in_tile / COL_THREADS;
    const int lane = threadIdx.x % BR, load_group = threadIdx.x / BR;
    const int columns_k = reduction + has_bias;
    const int k0 = blockIdx.x * BN, o0 = blockIdx.y * BM;
    const int positions = out_h * out_w;
    const long long q_end_all = (long long)batch * positions;
    const long long q_begin = (long long)blockIdx.z * chunk;
    const long long q_end = q_begin + chunk < q_end_all ? q_begin + chunk : q_end_all;
    const int* k_offset = table;
    const int* k_h = table + reduction;
    const int* k_w = table + 2 * reduction;

    float acc[TM][TN];
    #pragma unroll
    for (int i = 0; i < TM; ++i)
        #pragma unroll
        for (int j = 0; j < TN; ++j) acc[i][j] = 0.0f;

    // the next step's tile entries are loaded into registers while the current step computes
    constexpr int A_LOADS = BM / LOAD_GROUPS, B_LOADS = BN / LOAD_GROUPS;
    static_assert(A_LOADS * LOAD_GROUPS == BM && B_LOADS * LOAD_GROUPS == BN, "whole tiles");
    float a_next[A_LOADS], b_next[B_LOADS];
    auto load = [&](long long q_step) {
        const long long q = q_step + lane;
        const bool valid = q < q_end;
        long long n = 0, base = 0;
        int p = 0, corner_h = 0, corner_w = 0;
        if (valid) {
            n = q / positions;
            p = (int)(q % positions);
            corner_h = p / out_w - pad_h;
            corner_w = p % out_w - pad_w;
            base = n * channels * (long long)height * width + (long long)corner_h * width + corner_w;
        }
        #pragma unroll
        for (int t = 0; t < A_LOADS; ++t) {
            const int o = o0 + load_group + t * LOAD_GROUPS;
            a_next[t] = (valid && o < out_channels) ? lnn_load(dy[(n * out_channels + o) * positions + p]) : 0.0f;
        }
        #pragma unroll
        for (int t = 0; t < B_LOADS; ++t) {
            const int k = k0 + load_group + t * LOAD_GROUPS;
            float v = 0.0f;
            if (valid) {
                if (k < reduction) {
                    const int h = corner_h + k_h[k], w = corner_w + k_w[k];
                    if (h >= 0 && h < height && w >= 0 && w < width) v = lnn_load(x[base + k_offset[k]]);
                } else if (k < columns_k) {
                    v = 1.0f;
                }
            }
            b_next[t] = v;
        }
    };

    load(q_begin);
    for (long long q_step = q_begin; q_step < q_end; q_step += BR) {
        #pragma unroll
        for (int t = 0; t < A_LOADS; ++t) a_tile[lane][load_group + t * LOAD_GROUPS] = a_next[t];
        #pragma unroll
        for (int t = 0; t < B_LOADS; ++t) b_tile[lane][load_group + t * LOAD_GROUPS] = b_next[t];
        __syncthreads();
        if (q_step + BR < q_end) load(q_step + BR);
        #pragma unroll
        for (int r = group; r < BR; r += GROUPS) {
            float a[TM], b[TN];
            #pragma unroll
            for (int i = 0; i < TM; ++i) a[i] = a_tile[r][ty + ROW_THREADS * i];
            #pragma unroll
            for (int j = 0; j < TN; ++j) b[j] = b_tile[r][tx + COL_THREADS * j];
            #pragma unroll
            for (int i = 0; i < TM; ++i)
                #pragma unroll
                for (int j = 0; j < TN; ++j) acc[i][j] = fmaf(a[i], b[j], acc[i][j]);
        }
        __syncthreads();
    }

    if constexpr (GROUPS > 1) {
        #pragma unroll
        for (int i = 0; i < TM; ++i)
            #pragma unroll
            for (int j = 0; j < TN; ++j)
                group_sums[(group * BM + ty + ROW_THREADS * i) * BN + tx + COL_THREADS * j] = acc[i][j];
        __syncthreads();
        for (int e = threadIdx.x; e < BM * BN; e += THREADS) {
            const int o = o0 + e / BN, k = k0 + e % BN;
            if (o >= out_channels || k >= columns_k) continue;
            float sum = 0.0f;
            for (int g = 0; g < GROUPS; ++g) sum += group_sums[g * BM * BN + e];
            partial[((long long)blockIdx.z * out_channels + o) * columns_k + k] = sum;
        }
    } else {
        #pragma unroll
        for (int i = 0; i < TM; ++i) {
            const int o = o0 + ty + ROW_THREADS * i;
            if (o >= out_channels) continue;
            #pragma unroll
            for (int j = 0; j < TN; ++j) {
                const int k = k0 + tx + COL_THREADS * j;
                if (k < columns_k) partial[((long long)blockIdx.z * out_channels + o) * columns_k + k] = acc[i][j];
            }
        }
    }
}

// dweight [O, K] (and dbias [O]) = (or +=) the sum of partial [chunks, O, K + has_bias] over chunks
template <typename T>
__global__ void lnn_conv_wgrad_reduce(const float* __restrict__ partial, T* dweight, T* dbias, int chunks,
                                      int out_channels, int reduction, int has_bias, int accumulate) {
    const int columns_k = reduction + has_bias;
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= out_channels * columns_k) return;
    float sum = 0.0f;
    for (int s = 0; s < chunks; ++s) sum += partial[(long long)s * out_channels * columns_k + i];
    const int o = i / columns_k, k = i % columns_k;
    T* target = k < reduction ? dweight + (long long)o * reduction + k : dbias + o;
    lnn_store(target, accumulate ? lnn_load(*target) + sum : sum);
}

// weight [O, C, KH, KW] -> flipped [C, O, KH, KW], flipped[c, o, a, b] = weight[o, c, KH-1-a, KW-1-b]
template <typename T>
__global__ void lnn_conv_flip_weight(const T* __restrict__ weight, T* __restrict__ flipped,
                                     int out_channels, int channels, int window_h, int window_w) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= out_channels * channels * window_h * window_w) return;
    const int b = i % window_w;
    const int a = (i / window_w) % window_h;
    const int o = (i / window_w / window_h) % out_channels;
    const int c = i / (window_w * window_h * out_channels);
    flipped[i] = weight[(((long long)o * channels + c) * window_h + (window_h - 1 - a)) * window_w
                        + (window_w - 1 - b)];
}
"""


def supported(attrs: dict) -> bool:
    """Whether a conv2d runs as implicit GEMM (forward and backward): groups 1, stride 1, dilation 1
    and padding at most kernel - 1 (the input gradient is then a stride-1 convolution too)."""
    (kh, kw), (ph, pw) = attrs["kernel_size"], attrs["padding"]
    return (attrs["groups"] == 1 and tuple(attrs["stride"]) == (1, 1) and tuple(attrs["dilation"]) == (1, 1)
            and ph <= kh - 1 and pw <= kw - 1)


def rows_tile(channels: int) -> int:
    """BM: output channels per block (16, 32 or 64)."""
    return 16 if channels <= 16 else 32 if channels <= 32 else 64


def window_table(channels: int, height: int, width: int, kernel_h: int, kernel_w: int) -> np.ndarray:
    """[3, C*KH*KW] int32: each k = (c, kh, kw)'s offset c*H*W + kh*W + kw, then kh, then kw."""
    c, a, b = np.meshgrid(np.arange(channels), np.arange(kernel_h), np.arange(kernel_w), indexing="ij")
    return np.stack([c * height * width + a * width + b, a, b]).reshape(3, -1).astype(np.int32)


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def wgrad_columns(columns_k: int) -> int:
    """BN of the weight-gradient kernel: k columns per block (32 or 64)."""
    return 32 if columns_k <= 32 else 64


def max_chunks(out_channels: int, reduction: int, bias: bool) -> int:
    """Chunks of the weight-gradient pass: enough blocks for a few waves of the GPU."""
    columns_k = reduction + bias
    tiles = ceil_div(columns_k, wgrad_columns(columns_k)) * ceil_div(out_channels, rows_tile(out_channels))
    return max(1, ceil_div(TARGET_BLOCKS, tiles))


def partial_elements(out_channels: int, reduction: int, bias: bool) -> int:
    """Size of the weight gradient's partial sums [max_chunks, O, K + bias]."""
    return max_chunks(out_channels, reduction, bias) * out_channels * (reduction + bias)


def chunking(columns: int, limit: int) -> tuple:
    """(chunk length, chunks) covering `columns` positions with at most `limit` chunks of >= 256."""
    wanted = max(1, min(limit, ceil_div(columns, 256)))
    chunk = ceil_div(ceil_div(columns, wanted), WGRAD_STEP) * WGRAD_STEP
    return chunk, ceil_div(columns, chunk)


def scratch_bytes(attrs: dict, in_shape, out_shape) -> int:
    """Device bytes a ConvKernels holds besides the plan's pool (tables, flipped weight, partial sums)."""
    channels, out_channels = in_shape[0], out_shape[0]
    kh, kw = attrs["kernel_size"]
    reduction = channels * kh * kw
    tables = 4 * 3 * reduction + 4 * 3 * out_channels * kh * kw
    return tables + 4 * out_channels * reduction + 4 * partial_elements(out_channels, reduction, attrs["bias"])


_MODULE = None
KERNEL_TYPES = {np.dtype(np.float32): "float", np.dtype(np.float16): "unsigned short"}   # float16 as its bits


def _module():
    global _MODULE
    if _MODULE is None:
        import cupy

        names = []
        for kind in KERNEL_TYPES.values():
            names += [f"lnn_conv_igemm<{kind}, {bm}, {bn}, {tn}>" for bm, (bn, tn) in FORWARD_TILES.items()]
            names += [f"lnn_conv_wgrad<{kind}, {bm}, {bn}>" for bm in FORWARD_TILES for bn in (32, 64)]
            names += [f"lnn_conv_wgrad_reduce<{kind}>", f"lnn_conv_flip_weight<{kind}>"]
        _MODULE = cupy.RawModule(code=SOURCE, options=("-std=c++17",), name_expressions=names)
    return _MODULE


class ConvKernels:
    """One conv2d layer's implicit-GEMM launches (any batch). Allocates its tables, and with `backward`
    the flipped weight and partial sums, here, once: the launches allocate nothing (CUDA-graph safe)."""

    def __init__(self, attrs: dict, in_shape, out_shape, backward: bool = True, dtype=np.float32):
        import cupy

        dtype = np.dtype(dtype)
        kind = KERNEL_TYPES[dtype]
        self.channels, self.height, self.width = in_shape
        self.out_channels, self.out_h, self.out_w = out_shape
        self.kernel_h, self.kernel_w = attrs["kernel_size"]
        self.pad_h, self.pad_w = attrs["padding"]
        self.bias = bool(attrs["bias"])
        self.reduction = self.channels * self.kernel_h * self.kernel_w
        self.table = cupy.asarray(window_table(self.channels, self.height, self.width, self.kernel_h, self.kernel_w))
        self.no_bias = cupy.zeros(1, dtype)
        module = _module()
        self._forward_functions = {bm: module.get_function(f"lnn_conv_igemm<{kind}, {bm}, {bn}, {tn}>")
                                   for bm, (bn, tn) in FORWARD_TILES.items()}
        if backward:
            self.table_dx = cupy.asarray(window_table(self.out_channels, self.out_h, self.out_w, self.kernel_h,
                                                      self.kernel_w))
            self.flipped = cupy.empty((self.channels, self.out_channels, self.kernel_h, self.kernel_w), dtype)
            self.chunk_limit = max_chunks(self.out_channels, self.reduction, self.bias)
            self.partial = cupy.empty(partial_elements(self.out_channels, self.reduction, self.bias), np.float32)
            self._wgrad = {bn: module.get_function(f"lnn_conv_wgrad<{kind}, {rows_tile(self.out_channels)}, {bn}>")
                           for bn in (32, 64)}
            self._reduce = module.get_function(f"lnn_conv_wgrad_reduce<{kind}>")
            self._flip = module.get_function(f"lnn_conv_flip_weight<{kind}>")

    def _igemm(self, x, weight, bias, table, y, pad_h, pad_w, relu: bool):
        """y [N, O', H', W'] = act(conv(x [N, C', H', W'], weight [O', C'*KH*KW]) + bias), stride 1."""
        n, channels, height, width = x.shape
        out_channels, out_h, out_w = y.shape[1:]
        bm = rows_tile(out_channels)
        bn, _ = FORWARD_TILES[bm]
        grid = (ceil_div(n * out_h * out_w, bn), ceil_div(out_channels, bm))
        args = (x, weight, self.no_bias if bias is None else bias, table, y,
                *(np.int32(v) for v in (n, channels, height, width, out_channels, out_h, out_w, pad_h, pad_w,
                                        weight.size // out_channels, bias is not None, relu)))
        self._forward_functions[bm](grid, (THREADS,), args)

    def forward(self, x, weight, bias, y, relu: bool = False):
        """y = act(conv2d(x) + bias) with relu fused when asked; x [N, C, H, W] -> y [N, O, OH, OW]."""
        self._igemm(x, weight, bias, self.table, y, self.pad_h, self.pad_w, relu)

    def weight_gradient(self, dy, x, dweight, dbias, accumulate: bool):
        """dweight [O, C, KH, KW] and dbias [O] (None: no bias) from dy [N, O, OH, OW] and x: written, or
        added with accumulate."""
        n = dy.shape[0]
        chunk, chunks = chunking(n * self.out_h * self.out_w, self.chunk_limit)
        has_bias = dbias is not None
        columns_k = self.reduction + has_bias
        bm, bn = rows_tile(self.out_channels), wgrad_columns(columns_k)
        grid = (ceil_div(columns_k, bn), ceil_div(self.out_channels, bm), chunks)
        self._wgrad[bn](grid, (THREADS,), (dy, x, self.table, self.partial,
                                           *(np.int32(v) for v in (n, self.channels, self.height, self.width,
                                                                   self.out_channels, self.out_h, self.out_w,
                                                                   self.pad_h, self.pad_w, self.reduction, has_bias)),
                                           np.int64(chunk)))
        outputs = self.out_channels * columns_k
        self._reduce((ceil_div(outputs, THREADS),), (THREADS,),
                     (self.partial, dweight, self.no_bias if dbias is None else dbias,
                      *(np.int32(v) for v in (chunks, self.out_channels, self.reduction, has_bias, accumulate))))

    def input_gradient(self, dy, weight, dx):
        """dx [N, C, H, W] (written) from dy [N, O, OH, OW]: the forward with the flipped weight."""
        self._flip((ceil_div(self.flipped.size, THREADS),), (THREADS,),
                   (weight, self.flipped, *(np.int32(v) for v in (self.out_channels, self.channels,
                                                                  self.kernel_h, self.kernel_w))))
        self._igemm(dy, self.flipped, None, self.table_dx, dx, self.kernel_h - 1 - self.pad_h,
                    self.kernel_w - 1 - self.pad_w, relu=False)
