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
table [3, K] (offset, kh, kw) built once per layer. float32, float16 or bfloat16 (amp) in and out, float32
accumulation: the kernels are templates over the element type (runtime/cuda/float16.py), but the float32-only
halo ones below. float16 and bfloat16 on a card with mma.m16n8k16 (compute capability 8.0+) run the
tensor-core twins (lnn_conv_igemm_mma, lnn_conv_wgrad_mma, and the halo-tile lnn_conv3x3_mma /
lnn_conv3x3_wgrad_mma for 3x3 windows): the same
gathers and contracts, 32-row steps, the products on mma.sync (.f16 or .bf16); older cards keep the
CUDA-core kernels for float16 (bfloat16 needs 8.0: the trainer refuses it below). float32 3x3 windows run on
halo tiles on CUDA cores on every card (lnn_conv3x3_cuda_cores for the forward and input gradient,
lnn_conv3x3_wgrad_cuda_cores for the weight gradient): the same contracts and spatial tiles.
Few input channels (direct_forward: C <= DIRECT_MAX_CHANNELS, C*KH*KW <= DIRECT_MAX_TAPS): the forward is
lnn_conv_direct on every card and type instead, one thread per output position (n, oh, ow) summing its
C*KH*KW window for DIRECT_OUTPUTS output channels, the same y as above.
CuPy is imported when a ConvKernels is made (the sizing functions here do not need it).
"""

from __future__ import annotations

import numpy as np

from lnn.runtime.cuda.float16 import CONVERSIONS, HALF_TYPES, INDEXING, c_type

THREADS = 256
TARGET_BLOCKS = 4 * 132             # blocks of the weight-gradient pass: a few waves of a large GPU
WGRAD_STEP = 32                     # positions per weight-gradient shared-memory step
FORWARD_TILES = {16: (256, 4), 32: (128, 4), 64: (128, 8)}      # BM -> (BN, TN)
TENSOR_CORE_COLUMNS = 128           # BN of the tensor-core forward kernel, for every BM
TENSOR_CORE_CAPABILITY = 80         # mma.sync.m16n8k16 with float16 or bfloat16: Ampere and newer
# The forward of a conv with at most this many input channels, and at most DIRECT_MAX_TAPS weights per output
# channel, runs as lnn_conv_direct (a network's first conv on RGB or gray), DIRECT_OUTPUTS channels a block.
DIRECT_MAX_CHANNELS = 4
DIRECT_MAX_TAPS = 100
DIRECT_OUTPUTS = 16
# lnn_conv3x3_wgrad_cuda_cores (float32), BM -> (CB input channels a block, GROUPS): its 256 threads are GROUPS
# groups of BM/4 x CB, each group summing every GROUPS-th run of positions; as many channels a block as keep
# its shared memory under the 48 KB of a static array
CUDA_CORE_WGRAD_BLOCKS = {64: (16, 1), 32: (32, 1), 16: (32, 2)}
FORWARD_CHANNELS = 8                # input channels per shared-memory step of lnn_conv3x3_cuda_cores (float32)
MAX_GRID_Z = 65535                  # CUDA's limit on a grid's third dimension

SOURCE = CONVERSIONS + INDEXING + f"""
#define THREADS {THREADS}
#define DIRECT_OUTPUTS {DIRECT_OUTPUTS}
#define DIRECT_MAX_TAPS {DIRECT_MAX_TAPS}
#define FORWARD_CHANNELS {FORWARD_CHANNELS}
""" + r"""

// T is float, unsigned short (the bits of a float16) or lnn_bf16 (amp), computed in float (lnn_load,
// lnn_store).
// the forward kernels' epilogue: *y = act(v + bias[o]), act relu or none
template <typename T>
__device__ __forceinline__ void lnn_store_output(T* y, float v, const T* bias, int o, int has_bias, int relu) {
    v += has_bias ? lnn_load(bias[o]) : 0.0f;
    lnn_store(y, relu ? fmaxf(v, 0.0f) : v);
}
// Where output position q (of `columns`) reads its window: the value of k = (c, kh, kw) is x[base +
// offset(k)] inside the image, 0 outside, from the table [3, K] (offset, kh, kw) of the layer.
struct LnnWindow {
    bool valid = false;
    long long n = 0, base = 0;
    int p = 0, corner_h = 0, corner_w = 0;
    __device__ LnnWindow(long long q, long long columns, int positions, int out_w, int pad_h, int pad_w,
                         int channels, int height, int width) {
        if (q >= columns) return;
        valid = true;
        n = lnn_divide(q, positions, &p);
        corner_h = p / out_w - pad_h;
        corner_w = p % out_w - pad_w;
        base = n * channels * (long long)height * width + (long long)corner_h * width + corner_w;
    }
    template <typename T>
    __device__ T at(const T* x, const int* table, int reduction, int k, int height, int width) const {
        if (!valid || k >= reduction) return T{};
        const int h = corner_h + table[reduction + k], w = corner_w + table[2 * reduction + k];
        return h >= 0 && h < height && w >= 0 && w < width ? x[base + table[k]] : T{};
    }
};

// Halo tile `tile` of an output map cut into tiles of IMGS images x TH rows x TW columns, numbered columns first,
// then rows, then groups of images: (image0, y0, x0) is where its outputs start
template <int IMGS, int TH, int TW>
struct LnnHaloTile {
    int image0, y0, x0;
    __device__ LnnHaloTile(int tile, int out_h, int out_w) {
        const int tiles_w = (out_w + TW - 1) / TW, tiles_h = (out_h + TH - 1) / TH;
        x0 = tile % tiles_w * TW, y0 = tile / tiles_w % tiles_h * TH, image0 = tile / (tiles_w * tiles_h) * IMGS;
    }
    // [*begin, *end): the tiles of a weight gradient's chunk blockIdx.z, tiles_per_chunk a chunk
    __device__ static void chunk(int batch, int out_h, int out_w, int tiles_per_chunk, int* begin, int* end) {
        const int tiles = (batch + IMGS - 1) / IMGS * ((out_h + TH - 1) / TH) * ((out_w + TW - 1) / TW);
        *begin = blockIdx.z * tiles_per_chunk;
        *end = *begin + tiles_per_chunk < tiles ? *begin + tiles_per_chunk : tiles;
    }
};

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
    // the column (output position) this thread gathers into b_tile
    const int load_column = threadIdx.x % BN;
    const LnnWindow window(q0 + load_column, columns, positions, out_w, pad_h, pad_w, channels, height, width);

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
            b_next[t] = lnn_load(window.at(x, table, reduction, k0 + threadIdx.x / BN + t * B_ROWS_PER_PASS,
                                           height, width));
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
        int p;
        const long long n = lnn_divide(q, positions, &p);
        #pragma unroll
        for (int i = 0; i < TM; ++i) {
            const int o = o0 + ty + ROW_THREADS * i;
            if (o >= out_channels) continue;
            lnn_store_output(&y[(n * out_channels + o) * positions + p], acc[i][j], bias, o, has_bias, relu);
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
        const LnnWindow window(q_step + lane, q_end, positions, out_w, pad_h, pad_w, channels, height, width);
        #pragma unroll
        for (int t = 0; t < A_LOADS; ++t) {
            const int o = o0 + load_group + t * LOAD_GROUPS;
            a_next[t] = window.valid && o < out_channels
                        ? lnn_load(dy[(window.n * out_channels + o) * positions + window.p]) : 0.0f;
        }
        #pragma unroll
        for (int t = 0; t < B_LOADS; ++t) {
            const int k = k0 + load_group + t * LOAD_GROUPS;        // k = reduction: the bias column of ones
            b_next[t] = k == reduction && k < columns_k && window.valid ? 1.0f
                        : lnn_load(window.at(x, table, reduction, k, height, width));
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

// The weight gradient of a 3x3 window on CUDA cores from halo tiles (float32): lnn_conv_wgrad's contract
// (partial [chunks, O, K + has_bias], k = 9c + tap) on lnn_conv3x3_wgrad_mma's spatial tiles. Block (CB input
// channels, BM output channels, chunk z of the tiles); per tile, dy's 128 positions [BM][128] (read VEC elements
// a load) and the CB channels' (TH+2) x (TW+2) windows go to shared memory. A thread owns 4 output channels (o,
// o + BM/4, ...) x 1 input channel x 9 taps and sums every GROUPS-th run of 4 positions (a run lies in one
// row: TW is a multiple of 4): per run 4 float4 reads of dy, 3 window rows of 6 values, 144 FMAs. The groups of
// threads add up at the end; the channel block 0 also sums dy for the bias. The window's channel pitch CP is
// 4 mod 8 so that 8 threads reading 8 channels' float4s hit 8 different banks.
template <int VEC> struct lnn_floats;                           // VEC floats: one load
template <> struct lnn_floats<4> { typedef float4 type; };
template <> struct lnn_floats<1> { typedef float type; };
template <int BM, int CB, int GROUPS, int IMGS, int TH, int TW, int VEC>
__global__ void __launch_bounds__(THREADS, 2) lnn_conv3x3_wgrad_cuda_cores(
        const float* __restrict__ dy, const float* __restrict__ x, float* __restrict__ partial,
        int batch, int channels, int height, int width, int out_channels, int out_h, int out_w,
        int pad_h, int pad_w, int has_bias, int tiles_per_chunk) {
    constexpr int OG = BM / 4, GROUP = OG * CB, BN = IMGS * TH * TW, PH = TH + 2, PW = TW + 2, ROWS = IMGS * PH;
    constexpr int XP = TW + 4, CP = ROWS * XP + (12 - ROWS * XP % 8) % 8, DP = BN;
    constexpr int SUMS = 4 * 9 + 4;                            // a thread's results: 36 weights, 4 bias sums
    constexpr int TILE = BM * DP + CB * CP, SUMS_SIZE = (GROUPS - 1) * SUMS * GROUP;
    constexpr int SHARED = TILE > SUMS_SIZE ? TILE : SUMS_SIZE;
    // staging batches: 4 float4s or 8 floats of dy, 8 floats of x (larger ones spill: the sums hold 40 registers)
    constexpr int DY_LOADS = BM * BN / VEC / THREADS, DY_BATCH = VEC == 4 ? (DY_LOADS < 4 ? DY_LOADS : 4) : 8;
    constexpr int X_ITEMS = CB * ROWS * PW, X_BATCH = 8;
    constexpr int X_LOADS = (X_ITEMS + THREADS * X_BATCH - 1) / (THREADS * X_BATCH) * X_BATCH;
    static_assert(GROUP * GROUPS == THREADS && BN == 128 && TW % 4 == 0 && TW % VEC == 0, "tile layout");
    static_assert(DY_LOADS * VEC * THREADS == BM * BN && DY_LOADS % DY_BATCH == 0, "whole passes over dy");
    typedef typename lnn_floats<VEC>::type Vec;
    __shared__ __align__(16) float shared[SHARED];
    float* dy_tile = shared;                                   // [o][position], pitch DP
    float* patch = shared + BM * DP;                           // [channel][window row][column], pitches CP, XP
    const int c_local = threadIdx.x % CB, og = threadIdx.x / CB % OG, group = threadIdx.x / GROUP;
    const int c0 = blockIdx.x * CB, o0 = blockIdx.y * BM;
    int tile_begin, tile_end;
    LnnHaloTile<IMGS, TH, TW>::chunk(batch, out_h, out_w, tiles_per_chunk, &tile_begin, &tile_end);
    const int columns_k = channels * 9 + has_bias;
    const bool bias_block = has_bias && blockIdx.x == 0;

    float acc[4][9], bias_sum[4];
    #pragma unroll
    for (int i = 0; i < 4; ++i) {
        bias_sum[i] = 0.0f;
        #pragma unroll
        for (int t = 0; t < 9; ++t) acc[i][t] = 0.0f;
    }
    for (int tile = tile_begin; tile < tile_end; ++tile) {
        const LnnHaloTile<IMGS, TH, TW> at(tile, out_h, out_w);
        const int y0 = at.y0, x0 = at.x0, image0 = at.image0;
        // the tile's items by batches: a batch's loads first (one wait for all of them), then its shared-memory stores
        auto dy_item = [&](int e) {                            // dy rows, zero outside
            const int n = e % (BN / VEC) * VEC, o = o0 + e / (BN / VEC);
            const int image = image0 + n / (TH * TW), oy = y0 + n / TW % TH, ox = x0 + n % TW;
            return o < out_channels && image < batch && oy < out_h && ox < out_w
                ? *reinterpret_cast<const Vec*>(dy + (((long long)image * out_channels + o) * out_h + oy) * out_w + ox)
                : Vec{};
        };
        auto x_item = [&](int e) {                             // the windows, zero outside x
            const int c = c0 + e / (ROWS * PW), r = e / PW % ROWS;
            const int image = image0 + r / PH, iy = y0 - pad_h + r % PH, ix = x0 - pad_w + e % PW;
            return e < X_ITEMS && c < channels && image < batch && iy >= 0 && iy < height && ix >= 0 && ix < width
                ? x[(((long long)image * channels + c) * height + iy) * width + ix] : 0.0f;
        };
        #pragma unroll 1
        for (int t0 = 0; t0 < DY_LOADS; t0 += DY_BATCH) {
            Vec items[DY_BATCH];
            #pragma unroll
            for (int t = 0; t < DY_BATCH; ++t) items[t] = dy_item(threadIdx.x + (t0 + t) * THREADS);
            #pragma unroll
            for (int t = 0; t < DY_BATCH; ++t) {
                const int e = threadIdx.x + (t0 + t) * THREADS;
                *reinterpret_cast<Vec*>(dy_tile + e / (BN / VEC) * DP + e % (BN / VEC) * VEC) = items[t];
            }
        }
        #pragma unroll 1
        for (int t0 = 0; t0 < X_LOADS; t0 += X_BATCH) {
            float items[X_BATCH];
            #pragma unroll
            for (int t = 0; t < X_BATCH; ++t) items[t] = x_item(threadIdx.x + (t0 + t) * THREADS);
            #pragma unroll
            for (int t = 0; t < X_BATCH; ++t) {
                const int e = threadIdx.x + (t0 + t) * THREADS;
                if (e < X_ITEMS) patch[e / (ROWS * PW) * CP + e / PW % ROWS * XP + e % PW] = items[t];
            }
        }
        __syncthreads();
        for (int run = group; run < BN / 4; run += GROUPS) {
            const int n0 = 4 * run, image = n0 / (TH * TW), row = n0 / TW % TH, column = n0 % TW;
            float d[4][4], v[3][6];
            #pragma unroll
            for (int i = 0; i < 4; ++i) {
                const float4 q = *reinterpret_cast<const float4*>(dy_tile + (og + OG * i) * DP + n0);
                d[i][0] = q.x, d[i][1] = q.y, d[i][2] = q.z, d[i][3] = q.w;
            }
            #pragma unroll
            for (int kh = 0; kh < 3; ++kh) {
                const float* p = patch + c_local * CP + (image * PH + row + kh) * XP + column;
                const float4 a = *reinterpret_cast<const float4*>(p);
                const float2 b = *reinterpret_cast<const float2*>(p + 4);
                v[kh][0] = a.x, v[kh][1] = a.y, v[kh][2] = a.z, v[kh][3] = a.w, v[kh][4] = b.x, v[kh][5] = b.y;
            }
            #pragma unroll
            for (int i = 0; i < 4; ++i)
                #pragma unroll
                for (int p = 0; p < 4; ++p) {
                    #pragma unroll
                    for (int t = 0; t < 9; ++t) acc[i][t] = fmaf(d[i][p], v[t / 3][p + t % 3], acc[i][t]);
                    if (bias_block) bias_sum[i] += d[i][p];
                }
        }
        __syncthreads();
    }

    // groups 1.. leave their sums in shared memory ([result][thread of the group]); group 0 adds them and writes
    if constexpr (GROUPS > 1) {
        const int slot = threadIdx.x % GROUP;
        if (group > 0) {
            float* mine = shared + (group - 1) * SUMS * GROUP + slot;
            #pragma unroll
            for (int i = 0; i < 4; ++i) {
                mine[(36 + i) * GROUP] = bias_sum[i];
                #pragma unroll
                for (int t = 0; t < 9; ++t) mine[(9 * i + t) * GROUP] = acc[i][t];
            }
        }
        __syncthreads();
        if (group > 0) return;
        for (int s = 1; s < GROUPS; ++s) {
            const float* theirs = shared + (s - 1) * SUMS * GROUP + slot;
            #pragma unroll
            for (int i = 0; i < 4; ++i) {
                bias_sum[i] += theirs[(36 + i) * GROUP];
                #pragma unroll
                for (int t = 0; t < 9; ++t) acc[i][t] += theirs[(9 * i + t) * GROUP];
            }
        }
    }
    const int c = c0 + c_local;
    #pragma unroll
    for (int i = 0; i < 4; ++i) {
        const int o = o0 + og + OG * i;
        if (o >= out_channels) continue;
        float* out = partial + ((long long)blockIdx.z * out_channels + o) * columns_k;
        if (c < channels)
            #pragma unroll
            for (int t = 0; t < 9; ++t) out[9 * c + t] = acc[i][t];
        if (bias_block && c_local == 0) out[channels * 9] = bias_sum[i];
    }
}

// 3x3 windows (forward, and the input gradient through the transposed flipped weight) on CUDA cores from halo tiles
// (float32): lnn_conv3x3_mma's tiles and contract. Block (spatial tile of 128 outputs, BM output channels); per step,
// CB input channels' (TH+2) x (TW+2) windows and their weights (lnn_conv3x3_transpose: [C][9][O], output channels
// fastest) go to shared memory. A thread owns BM/8 consecutive output channels x a run of 4 consecutive outputs of
// one row; a warp is 4 such channel groups x 8 runs, so a window read (6 values: the run and the 2 beside it) is
// shared by 4 threads and a weight read (BM/8 channels of one tap) by 8. Per input channel and kernel row: 2
// window reads, 3 x BM/32 weight reads and 3 x BM/2 FMAs.
template <int BM, int IMGS, int TH, int TW>
__global__ void __launch_bounds__(THREADS, 2) lnn_conv3x3_cuda_cores(
        const float* __restrict__ x, const float* __restrict__ transposed, const float* __restrict__ bias,
        float* __restrict__ y, int batch, int channels, int height, int width, int out_channels, int out_h, int out_w,
        int pad_h, int pad_w, int has_bias, int relu) {
    constexpr int CB = FORWARD_CHANNELS, TM = BM / 8, BN = IMGS * TH * TW, PH = TH + 2, PW = TW + 2, ROWS = IMGS * PH;
    constexpr int XP = TW + 4, CP = ROWS * XP, STEP = CB * 9;
    constexpr int W_ITEMS = STEP * BM, X_ITEMS = CB * ROWS * PW, BATCH = 4;    // staged per step, loads a batch
    constexpr int W_LOADS = (W_ITEMS + THREADS * BATCH - 1) / (THREADS * BATCH) * BATCH;
    constexpr int X_LOADS = (X_ITEMS + THREADS * BATCH - 1) / (THREADS * BATCH) * BATCH;
    static_assert(BN == 128 && TW % 4 == 0 && TM % 2 == 0, "tile layout");
    __shared__ __align__(16) float w_tile[STEP * BM];          // [c][tap][o]
    __shared__ __align__(16) float patch[CB * CP];             // [c][window row][column], pitch XP
    const LnnHaloTile<IMGS, TH, TW> tile(blockIdx.x, out_h, out_w);
    const int image0 = tile.image0, y0 = tile.y0, x0 = tile.x0, o0 = blockIdx.y * BM;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int group = warp / 4 * 4 + lane / 8, run = warp % 4 * 8 + lane % 8;      // output channels, positions
    const int n0 = 4 * run, image = n0 / (TH * TW), row = n0 / TW % TH, column = n0 % TW;

    auto w_item = [&](int e, int c0) {                         // [c][tap][o] of the step, zero outside
        const int k = e / BM, o = o0 + e % BM;
        return e < W_ITEMS && c0 + k / 9 < channels && o < out_channels
            ? transposed[((long long)c0 * 9 + k) * out_channels + o] : 0.0f;
    };
    auto x_item = [&](int e, int c0) {                         // the windows, zero outside x
        const int c = c0 + e / (ROWS * PW), r = e / PW % ROWS;
        const int n = image0 + r / PH, iy = y0 - pad_h + r % PH, ix = x0 - pad_w + e % PW;
        return e < X_ITEMS && c < channels && n < batch && iy >= 0 && iy < height && ix >= 0 && ix < width
            ? x[(((long long)n * channels + c) * height + iy) * width + ix] : 0.0f;
    };
    float acc[TM][4];
    #pragma unroll
    for (int i = 0; i < TM; ++i)
        #pragma unroll
        for (int p = 0; p < 4; ++p) acc[i][p] = 0.0f;

    for (int c0 = 0; c0 < channels; c0 += CB) {
        // the step's items by batches: a batch's loads first (one wait for all of them), then its stores
        #pragma unroll 1
        for (int t0 = 0; t0 < W_LOADS; t0 += BATCH) {
            float items[BATCH];
            #pragma unroll
            for (int t = 0; t < BATCH; ++t) items[t] = w_item(threadIdx.x + (t0 + t) * THREADS, c0);
            #pragma unroll
            for (int t = 0; t < BATCH; ++t) {
                const int e = threadIdx.x + (t0 + t) * THREADS;
                if (e < W_ITEMS) w_tile[e] = items[t];
            }
        }
        #pragma unroll 1
        for (int t0 = 0; t0 < X_LOADS; t0 += BATCH) {
            float items[BATCH];
            #pragma unroll
            for (int t = 0; t < BATCH; ++t) items[t] = x_item(threadIdx.x + (t0 + t) * THREADS, c0);
            #pragma unroll
            for (int t = 0; t < BATCH; ++t) {
                const int e = threadIdx.x + (t0 + t) * THREADS;
                if (e < X_ITEMS) patch[e / (ROWS * PW) * CP + e / PW % ROWS * XP + e % PW] = items[t];
            }
        }
        __syncthreads();
        #pragma unroll 2
        for (int c = 0; c < CB; ++c)
            #pragma unroll
            for (int kh = 0; kh < 3; ++kh) {
                const float* p = patch + c * CP + (image * PH + row + kh) * XP + column;
                const float4 a = *reinterpret_cast<const float4*>(p);
                const float2 b = *reinterpret_cast<const float2*>(p + 4);
                const float v[6] = {a.x, a.y, a.z, a.w, b.x, b.y};
                #pragma unroll
                for (int kw = 0; kw < 3; ++kw) {
                    const float* weights = w_tile + (c * 9 + kh * 3 + kw) * BM + group * TM;
                    float w[TM];
                    #pragma unroll
                    for (int i = 0; i < TM; i += TM % 4 == 0 ? 4 : 2) {
                        if constexpr (TM % 4 == 0) {
                            const float4 q = *reinterpret_cast<const float4*>(weights + i);
                            w[i] = q.x, w[i + 1] = q.y, w[i + 2] = q.z, w[i + 3] = q.w;
                        } else {
                            const float2 q = *reinterpret_cast<const float2*>(weights + i);
                            w[i] = q.x, w[i + 1] = q.y;
                        }
                    }
                    #pragma unroll
                    for (int i = 0; i < TM; ++i)
                        #pragma unroll
                        for (int q = 0; q < 4; ++q) acc[i][q] = fmaf(w[i], v[q + kw], acc[i][q]);
                }
            }
        __syncthreads();
    }

    const int at = image0 + image, oy = y0 + row;
    if (at >= batch || oy >= out_h) return;
    #pragma unroll
    for (int i = 0; i < TM; ++i) {
        const int o = o0 + group * TM + i;
        if (o >= out_channels) continue;
        float* out = y + (((long long)at * out_channels + o) * out_h + oy) * out_w + x0 + column;
        #pragma unroll
        for (int q = 0; q < 4; ++q)
            if (x0 + column + q < out_w) lnn_store_output(out + q, acc[i][q], bias, o, has_bias, relu);
    }
}

// weight [O, C, 3, 3] -> transposed [S, 9, R] (lnn_conv3x3_cuda_cores' weights): transposed[s, tap, r] =
// weight[r, s, tap] (R = O, S = C); with flip, the input gradient's (flipped[c, o, kh, kw] = weight[o, c, 2-kh, 2-kw]):
// transposed[o, tap, c] = weight[o, c, 8 - tap] (R = C, S = O)
template <typename T>
__global__ void lnn_conv3x3_transpose(const T* __restrict__ weight, T* __restrict__ transposed,
                                      int out_channels, int channels, int flip) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= out_channels * channels * 9) return;
    const int rows = flip ? channels : out_channels;
    const int r = i % rows, tap = i / rows % 9, s = i / (rows * 9);
    transposed[i] = flip ? weight[((long long)s * channels + r) * 9 + 8 - tap]
                         : weight[((long long)r * channels + s) * 9 + tap];
}

// Direct convolution for few input channels (direct_forward: a network's first conv on an RGB or gray image,
// whose reduction C*KH*KW is too short for the tiled kernels): one thread per output position of an image
// (blockIdx.z steps over the images), DIRECT_OUTPUTS output channels from blockIdx.y * DIRECT_OUTPUTS, whose
// weights sit in shared memory as [k][o] (four channels' weights one 16-byte broadcast read).
template <typename T>
__global__ void __launch_bounds__(THREADS) lnn_conv_direct(
        const T* __restrict__ x, const T* __restrict__ weight, const T* __restrict__ bias, T* __restrict__ y,
        int batch, int channels, int height, int width, int out_channels, int out_h, int out_w,
        int kernel_h, int kernel_w, int pad_h, int pad_w, int has_bias, int relu) {
    constexpr int OB = DIRECT_OUTPUTS;
    __shared__ float4 w_tile[DIRECT_MAX_TAPS * OB / 4];
    float* w_flat = reinterpret_cast<float*>(w_tile);
    const int taps = channels * kernel_h * kernel_w, o0 = blockIdx.y * OB;
    for (int e = threadIdx.x; e < taps * OB; e += THREADS) {
        const int o = o0 + e % OB;
        w_flat[e] = o < out_channels ? lnn_load(weight[o * taps + e / OB]) : 0.0f;
    }
    __syncthreads();
    const int positions = out_h * out_w, p = blockIdx.x * THREADS + threadIdx.x;
    if (p >= positions) return;
    const int oy = p / out_w, ox = p - oy * out_w;
    for (int image = blockIdx.z; image < batch; image += gridDim.z) {
        const T* plane = x + (long long)image * channels * height * width;
        float acc[OB];
        #pragma unroll
        for (int o = 0; o < OB; ++o) acc[o] = 0.0f;
        int k = 0;
        for (int c = 0; c < channels; ++c, plane += height * width)
            for (int a = 0; a < kernel_h; ++a) {
                const int h = oy - pad_h + a;
                for (int b = 0; b < kernel_w; ++b, ++k) {
                    const int w = ox - pad_w + b;
                    const float v = h >= 0 && h < height && w >= 0 && w < width ? lnn_load(plane[h * width + w]) : 0.0f;
                    #pragma unroll
                    for (int j = 0; j < OB / 4; ++j) {
                        const float4 q = w_tile[k * (OB / 4) + j];
                        acc[4 * j] += q.x * v;
                        acc[4 * j + 1] += q.y * v;
                        acc[4 * j + 2] += q.z * v;
                        acc[4 * j + 3] += q.w * v;
                    }
                }
            }
        T* out = y + ((long long)image * out_channels + o0) * positions + p;
        #pragma unroll
        for (int o = 0; o < OB; ++o)
            if (o0 + o < out_channels) lnn_store_output(out + (long long)o * positions, acc[o], bias, o0 + o, has_bias, relu);
    }
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

TENSOR_CORE_SOURCE = r"""
// ---- tensor cores (T: float16 as unsigned short, or lnn_bf16; float32 accumulation; sm_80 and newer) ----
// The same tiles and gathers as above, the block's products on mma.sync.m16n8k16 (.f16 or .bf16 inputs by T).
// Fragment layouts (PTX ISA, "Matrix fragments for mma.m16n8k16 with floating point type", the same for both
// types), lane = 4 * group + quad:
//   A 16x16 row-major: regs {A[g][2q..2q+1]}, {A[g+8][2q..]}, {A[g][2q+8..]}, {A[g+8][2q+8..]}
//   B 16x8  (k x n):   regs {B[2q..2q+1][g]}, {B[2q+8..2q+9][g]}
//   C 16x8  float:     C[g][2q], C[g][2q+1], C[g+8][2q], C[g+8][2q+1]
// (a register's lower 16 bits hold the element with the smaller index).
template <typename T> __device__ void lnn_mma_16x8x16(float* c, const unsigned* a, const unsigned* b);
template <> __device__ __forceinline__ void lnn_mma_16x8x16<unsigned short>(float* c, const unsigned* a,
                                                                            const unsigned* b) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
                 "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}
template <> __device__ __forceinline__ void lnn_mma_16x8x16<lnn_bf16>(float* c, const unsigned* a, const unsigned* b) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
                 "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}
__device__ __forceinline__ unsigned lnn_bits(unsigned short v) { return v; }
__device__ __forceinline__ unsigned lnn_bits(lnn_bf16 v) { return v.bits; }
template <typename T> __device__ __forceinline__ T lnn_one();           // 1.0 in T
template <> __device__ __forceinline__ unsigned short lnn_one<unsigned short>() { return 0x3C00; }
template <> __device__ __forceinline__ lnn_bf16 lnn_one<lnn_bf16>() { return lnn_bf16{0x3F80}; }
template <typename T>
__device__ __forceinline__ unsigned lnn_pair(const T* p) { return *(const unsigned*)p; }
template <typename T>
__device__ __forceinline__ unsigned lnn_pair(T lo, T hi) { return lnn_bits(lo) | (lnn_bits(hi) << 16); }
// acc[i][j] += a[i] b[j] for a warp's FM x FN fragments
template <typename T, int FM, int FN>
__device__ __forceinline__ void lnn_mma_tiles(float (&acc)[FM][FN][4], const unsigned (&a)[FM][4],
                                              const unsigned (&b)[FN][2]) {
    #pragma unroll
    for (int i = 0; i < FM; ++i)
        #pragma unroll
        for (int j = 0; j < FN; ++j) lnn_mma_16x8x16<T>(acc[i][j], a[i], b[j]);
}
// A fragment rows [row, row + 16) and columns [col, col + 16) of a row-major half tile with leading dimension ld
template <typename T>
__device__ __forceinline__ void lnn_load_a(unsigned* a, const T* tile, int ld, int row, int col) {
    const int lane = threadIdx.x % 32, g = lane >> 2, q = lane & 3;
    const T* p = tile + (row + g) * ld + col + 2 * q;
    a[0] = lnn_pair(p);
    a[1] = lnn_pair(p + 8 * ld);
    a[2] = lnn_pair(p + 8);
    a[3] = lnn_pair(p + 8 * ld + 8);
}

// the forward kernel's contract (lnn_conv_igemm) on tensor cores: BM output channels x BN positions per
// block, 32 reduction rows per shared-memory step; 8 warps of WM x WN results each
template <typename T, int BM, int BN>
__global__ void __launch_bounds__(THREADS, 2) lnn_conv_igemm_mma(
        const T* __restrict__ x, const T* __restrict__ weight,
        const T* __restrict__ bias, const int* __restrict__ table, T* __restrict__ y,
        int batch, int channels, int height, int width, int out_channels, int out_h, int out_w,
        int pad_h, int pad_w, int reduction, int has_bias, int relu) {
    constexpr int BK = 32, LDA = BK + 8, LDB = BN + 8;
    constexpr int WARPS_M = BM >= 32 ? 2 : 1, WARPS_N = 8 / WARPS_M;
    constexpr int WM = BM / WARPS_M, WN = BN / WARPS_N, FM = WM / 16, FN = WN / 8;
    static_assert(FM * 16 == WM && FN * 8 == WN, "whole fragments per warp");
    constexpr int B_ROWS_PER_PASS = THREADS / BN;
    constexpr int A_LOADS = BM * BK / THREADS, B_LOADS = BK / B_ROWS_PER_PASS;
    static_assert(A_LOADS * THREADS == BM * BK && B_LOADS * B_ROWS_PER_PASS == BK, "whole tiles");
    __shared__ __align__(16) T a_tile[BM * LDA];     // weight [o][k]
    __shared__ __align__(16) T b_tile[BK * LDB];     // gathered x [k][q]
    const int positions = out_h * out_w;
    const long long columns = (long long)batch * positions;
    const long long q0 = (long long)blockIdx.x * BN;
    const int o0 = blockIdx.y * BM;
    const int load_column = threadIdx.x % BN;
    const LnnWindow window(q0 + load_column, columns, positions, out_w, pad_h, pad_w, channels, height, width);

    T a_next[A_LOADS], b_next[B_LOADS];
    auto load = [&](int k0) {
        #pragma unroll
        for (int t = 0; t < A_LOADS; ++t) {
            const int e = threadIdx.x + t * THREADS;
            const int o = o0 + e / BK, k = k0 + e % BK;
            a_next[t] = (o < out_channels && k < reduction) ? weight[(long long)o * reduction + k] : T{};
        }
        #pragma unroll
        for (int t = 0; t < B_LOADS; ++t) {
            b_next[t] = window.at(x, table, reduction, k0 + threadIdx.x / BN + t * B_ROWS_PER_PASS, height, width);
        }
    };

    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane >> 2, quad = lane & 3;
    const int warp_m = (warp / WARPS_N) * WM, warp_n = (warp % WARPS_N) * WN;
    float acc[FM][FN][4];
    #pragma unroll
    for (int i = 0; i < FM; ++i)
        #pragma unroll
        for (int j = 0; j < FN; ++j)
            #pragma unroll
            for (int r = 0; r < 4; ++r) acc[i][j][r] = 0.0f;

    load(0);
    for (int k0 = 0; k0 < reduction; k0 += BK) {
        #pragma unroll
        for (int t = 0; t < A_LOADS; ++t) {
            const int e = threadIdx.x + t * THREADS;
            a_tile[(e / BK) * LDA + e % BK] = a_next[t];
        }
        #pragma unroll
        for (int t = 0; t < B_LOADS; ++t)
            b_tile[(threadIdx.x / BN + t * B_ROWS_PER_PASS) * LDB + load_column] = b_next[t];
        __syncthreads();
        if (k0 + BK < reduction) load(k0 + BK);
        #pragma unroll
        for (int kk = 0; kk < BK; kk += 16) {
            unsigned a[FM][4], b[FN][2];
            #pragma unroll
            for (int i = 0; i < FM; ++i) lnn_load_a(a[i], a_tile, LDA, warp_m + 16 * i, kk);
            #pragma unroll
            for (int j = 0; j < FN; ++j) {
                const T* p = b_tile + (kk + 2 * quad) * LDB + warp_n + 8 * j + g;
                b[j][0] = lnn_pair(p[0], p[LDB]);
                b[j][1] = lnn_pair(p[8 * LDB], p[9 * LDB]);
            }
            lnn_mma_tiles<T>(acc, a, b);
        }
        __syncthreads();
    }

    #pragma unroll
    for (int i = 0; i < FM; ++i)
        #pragma unroll
        for (int j = 0; j < FN; ++j)
            #pragma unroll
            for (int r = 0; r < 4; ++r) {
                const int o = o0 + warp_m + 16 * i + g + (r >= 2 ? 8 : 0);
                const long long column = q0 + warp_n + 8 * j + 2 * quad + (r & 1);
                if (o >= out_channels || column >= columns) continue;
                int p;
                const long long image = lnn_divide(column, positions, &p);
                lnn_store_output(y + (image * out_channels + o) * positions + p, acc[i][j][r], bias, o, has_bias, relu);
            }
}

// the weight-gradient kernel's contract (lnn_conv_wgrad) on tensor cores: partial [chunks, O, K + has_bias];
// 32 positions per step, dy [o][q] and the gathered x [k][q] both staged with q fastest; 8 warps of
// 16 x WN results, in GROUPS groups that take every GROUPS-th 16-position half of a step
template <typename T, int BM, int BN>
__global__ void __launch_bounds__(THREADS) lnn_conv_wgrad_mma(
        const T* __restrict__ dy, const T* __restrict__ x, const int* __restrict__ table,
        float* __restrict__ partial,
        int batch, int channels, int height, int width, int out_channels, int out_h, int out_w,
        int pad_h, int pad_w, int reduction, int has_bias, long long chunk) {
    constexpr int BR = 32, LD = BR + 8, LOAD_GROUPS = THREADS / BR;
    constexpr int WARPS_M = BM / 16, WARPS_N = BN / 8 < 8 / WARPS_M ? BN / 8 : 8 / WARPS_M;
    constexpr int GROUPS = 8 / (WARPS_M * WARPS_N), WN = BN / WARPS_N, FN = WN / 8;
    static_assert(WARPS_M * WARPS_N * GROUPS == 8 && GROUPS * 16 <= BR && FN * 8 == WN, "warp layout");
    constexpr int A_LOADS = BM / LOAD_GROUPS, B_LOADS = BN / LOAD_GROUPS;
    static_assert(A_LOADS * LOAD_GROUPS == BM && B_LOADS * LOAD_GROUPS == BN, "whole tiles");
    __shared__ __align__(16) T a_tile[BM * LD];     // dy [o][q]
    __shared__ __align__(16) T b_tile[BN * LD];     // gathered x [k][q]
    __shared__ float group_sums[GROUPS > 1 ? (GROUPS - 1) * BM * BN : 1];
    const int lane = threadIdx.x % BR, load_group = threadIdx.x / BR;
    const int columns_k = reduction + has_bias;
    const int k0 = blockIdx.x * BN, o0 = blockIdx.y * BM;
    const int positions = out_h * out_w;
    const long long q_end_all = (long long)batch * positions;
    const long long q_begin = (long long)blockIdx.z * chunk;
    const long long q_end = q_begin + chunk < q_end_all ? q_begin + chunk : q_end_all;

    T a_next[A_LOADS], b_next[B_LOADS];
    auto load = [&](long long q_step) {
        const LnnWindow window(q_step + lane, q_end, positions, out_w, pad_h, pad_w, channels, height, width);
        #pragma unroll
        for (int t = 0; t < A_LOADS; ++t) {
            const int o = o0 + load_group + t * LOAD_GROUPS;
            a_next[t] = window.valid && o < out_channels ? dy[(window.n * out_channels + o) * positions + window.p] : T{};
        }
        #pragma unroll
        for (int t = 0; t < B_LOADS; ++t) {
            const int k = k0 + load_group + t * LOAD_GROUPS;        // k = reduction: the bias column of ones
            b_next[t] = k == reduction && k < columns_k && window.valid ? lnn_one<T>()
                        : window.at(x, table, reduction, k, height, width);
        }
    };

    const int warp = threadIdx.x / 32, g = (threadIdx.x % 32) >> 2, quad = threadIdx.x & 3;
    const int group = warp / (WARPS_M * WARPS_N), in_tile = warp % (WARPS_M * WARPS_N);
    const int warp_m = (in_tile / WARPS_N) * 16, warp_n = (in_tile % WARPS_N) * WN;
    float acc[FN][4];
    #pragma unroll
    for (int j = 0; j < FN; ++j)
        #pragma unroll
        for (int r = 0; r < 4; ++r) acc[j][r] = 0.0f;

    load(q_begin);
    for (long long q_step = q_begin; q_step < q_end; q_step += BR) {
        #pragma unroll
        for (int t = 0; t < A_LOADS; ++t) a_tile[(load_group + t * LOAD_GROUPS) * LD + lane] = a_next[t];
        #pragma unroll
        for (int t = 0; t < B_LOADS; ++t) b_tile[(load_group + t * LOAD_GROUPS) * LD + lane] = b_next[t];
        __syncthreads();
        if (q_step + BR < q_end) load(q_step + BR);
        #pragma unroll
        for (int kk = 16 * group; kk < BR; kk += 16 * GROUPS) {
            unsigned a[4], b[FN][2];
            lnn_load_a(a, a_tile, LD, warp_m, kk);
            #pragma unroll
            for (int j = 0; j < FN; ++j) {
                const T* p = b_tile + (warp_n + 8 * j + g) * LD + kk + 2 * quad;
                b[j][0] = lnn_pair(p);
                b[j][1] = lnn_pair(p + 8);
            }
            #pragma unroll
            for (int j = 0; j < FN; ++j) lnn_mma_16x8x16<T>(acc[j], a, b[j]);
        }
        __syncthreads();
    }

    // groups 1.. leave their sums in shared memory; group 0 adds them and writes the block's partial sums
    if constexpr (GROUPS > 1) {
        if (group > 0)
            #pragma unroll
            for (int j = 0; j < FN; ++j)
                #pragma unroll
                for (int r = 0; r < 4; ++r)
                    group_sums[((group - 1) * BM + warp_m + g + (r >= 2 ? 8 : 0)) * BN
                               + warp_n + 8 * j + 2 * quad + (r & 1)] = acc[j][r];
        __syncthreads();
    }
    if (group > 0) return;
    #pragma unroll
    for (int j = 0; j < FN; ++j)
        #pragma unroll
        for (int r = 0; r < 4; ++r) {
            const int row = warp_m + g + (r >= 2 ? 8 : 0), col = warp_n + 8 * j + 2 * quad + (r & 1);
            float sum = acc[j][r];
            #pragma unroll
            for (int s = 1; s < GROUPS; ++s) sum += group_sums[((s - 1) * BM + row) * BN + col];
            const int o = o0 + row, k = k0 + col;
            if (o < out_channels && k < columns_k)
                partial[((long long)blockIdx.z * out_channels + o) * columns_k + k] = sum;
        }
}

// A register of BYTES bytes (the halo kernels' staging loads: VEC 8, 4 or 1), and its k-th 16-bit element.
template <int BYTES> struct lnn_register;
template <> struct lnn_register<16> { typedef uint4 type; };
template <> struct lnn_register<8> { typedef uint2 type; };
template <> struct lnn_register<2> { typedef unsigned short type; };
__device__ __forceinline__ unsigned short lnn_element(uint4 v, int k) {
    const unsigned word = k < 2 ? v.x : k < 4 ? v.y : k < 6 ? v.z : v.w;
    return (unsigned short)(k & 1 ? word >> 16 : word);
}
__device__ __forceinline__ unsigned short lnn_element(uint2 v, int k) {
    const unsigned word = k < 2 ? v.x : v.y;
    return (unsigned short)(k & 1 ? word >> 16 : word);
}
__device__ __forceinline__ unsigned short lnn_element(unsigned short v, int) { return v; }

// The input window of a halo tile (IMGS images x TH rows x TW columns of outputs from (image0, y0, x0), 16
// channels from c0), read by rows: row r = (channel, image, window row) of CB * IMGS * (TH + 2), each as
// TW / VEC vectors (the tile's own columns: VEC divides the width and where x starts) and 2 edge elements (the
// columns beside them, left or right by the padding). Items are zero outside x. A row's pixels start at
// pixel(r) = (image * (TH + 2) + window row) * (TW + 2) of its channel's (TH + 2) x (TW + 2) window.
template <typename T, int IMGS, int TH, int TW, int VEC>
struct LnnHaloRows {
    typedef typename lnn_register<VEC * sizeof(T)>::type Vec;
    static constexpr int CB = 16, PH = TH + 2, PW = TW + 2, ROWS = CB * IMGS * PH, ROW_VECTORS = TW / VEC;
    static constexpr int VECTORS = ROWS * ROW_VECTORS, EDGES = ROWS * 2;
    const T* x;
    int batch, channels, height, width, pad_h, pad_w, c0, image0, y0, x0;

    __device__ const T* row(int r, bool* inside) const {
        const int c = c0 + r / (IMGS * PH), image = image0 + r / PH % IMGS, iy = y0 - pad_h + r % PH;
        *inside = r < ROWS && c < channels && image < batch && iy >= 0 && iy < height;
        return x + (((long long)image * channels + c) * height + iy) * width;
    }
    __device__ Vec vector(int e) const {                      // vector e % ROW_VECTORS of row e / ROW_VECTORS
        bool inside;
        const T* source = row(e / ROW_VECTORS, &inside);
        const int ix = x0 + e % ROW_VECTORS * VEC;
        return inside && ix < width ? *reinterpret_cast<const Vec*>(source + ix) : Vec{};
    }
    __device__ unsigned short edge(int e) const {             // edge e % 2 of row e / 2
        bool inside;
        const T* source = row(e / 2, &inside);
        const int ix = x0 - pad_w + edge_column(e);
        return inside && ix >= 0 && ix < width ? (unsigned short)lnn_bits(source[ix]) : (unsigned short)0;
    }
    __device__ int vector_column(int e) const { return pad_w + e % ROW_VECTORS * VEC; }       // in the window
    __device__ int edge_column(int e) const { const int s = e % 2; return s < pad_w ? s : TW + s; }
    __device__ static int channel(int r) { return r / (IMGS * PH); }
    __device__ static int pixel(int r) { return r % (IMGS * PH) * PW; }
};

// 3x3 windows (forward, and the input gradient through the arranged flipped weight) on tensor cores from a
// halo tile: the block's 128 output positions are a spatial tile, IMGS images x TH rows x TW columns. Per
// step, 16 input channels of the tile's (TH+2) x (TW+2) input window go to shared memory once, channels
// fastest ([pixel][channel]; a pixel's value serves all 9 taps), and the weights come pre-arranged
// (lnn_conv3x3_arrange) as [O][ceil(C/16)][9][16]: the reduction order is (channel block, kh, kw, channel),
// so each 16-long k step is one tap and 16 channels, and a B register holds two channels of one pixel.
// The window is read by rows, VEC elements a load (LnnHaloRows); on 16-wide tiles with VEC >= 4 the next step's
// weights and window are read into registers while this step is on the tensor cores (the other tiles and VECs
// need more registers for that than the 128 that two blocks per SM leave: they spill).
template <typename T, int BM, int IMGS, int TH, int TW, int VEC>
__global__ void __launch_bounds__(THREADS, 2) lnn_conv3x3_mma(
        const T* __restrict__ x, const T* __restrict__ arranged,
        const T* __restrict__ bias, T* __restrict__ y,
        int batch, int channels, int height, int width, int out_channels, int out_h, int out_w,
        int pad_h, int pad_w, int has_bias, int relu) {
    typedef LnnHaloRows<T, IMGS, TH, TW, VEC> Rows;
    typedef typename Rows::Vec Vec;
    constexpr int CB = 16, TAPS = 9, STEP = TAPS * CB, VECTORS_PER_ROW = STEP / 8;
    constexpr int BN = IMGS * TH * TW, PH = TH + 2, PW = TW + 2, PIXELS = IMGS * PH * PW;
    constexpr int LDC = CB + 8, LDA = STEP + 8;            // padded: conflict-free fragment loads
    static_assert(BN == 128, "128 positions per block");
    constexpr int WARPS_M = BM >= 32 ? 2 : 1, WARPS_N = 8 / WARPS_M;
    constexpr int WM = BM / WARPS_M, WN = BN / WARPS_N, FM = WM / 16, FN = WN / 8;
    constexpr int A_VECTORS = BM * VECTORS_PER_ROW, A_LOADS = (A_VECTORS + THREADS - 1) / THREADS;
    constexpr int X_LOADS = (Rows::VECTORS + THREADS - 1) / THREADS, EDGE_LOADS = (Rows::EDGES + THREADS - 1) / THREADS;
    constexpr bool PREFETCH = VEC >= 4 && TW == 16;
    __shared__ __align__(16) unsigned short patch[PIXELS * LDC];      // the bits of x
    __shared__ __align__(16) T a_tile[BM * LDA];
    const LnnHaloTile<IMGS, TH, TW> tile(blockIdx.x, out_h, out_w);
    const int image0 = tile.image0, y0 = tile.y0, x0 = tile.x0, o0 = blockIdx.y * BM;
    const int chunks = (channels + CB - 1) / CB;
    Rows window{x, batch, channels, height, width, pad_h, pad_w, 0, image0, y0, x0};

    // a step's weights (16-byte vector v of the BM x 144 tile) and window items: read, then written to shared memory
    auto fetch_a = [&](int v, int chunk) {
        const int o = o0 + v / VECTORS_PER_ROW;
        return v < A_VECTORS && o < out_channels
            ? reinterpret_cast<const uint4*>(arranged + ((long long)o * chunks + chunk) * STEP)[v % VECTORS_PER_ROW]
            : make_uint4(0, 0, 0, 0);
    };
    auto put_a = [&](int v, uint4 value) {
        if (v < A_VECTORS)
            *reinterpret_cast<uint4*>(a_tile + v / VECTORS_PER_ROW * LDA + v % VECTORS_PER_ROW * 8) = value;
    };
    auto put_x = [&](int e, Vec value) {
        if (e >= Rows::VECTORS) return;
        const int r = e / Rows::ROW_VECTORS, at = (Rows::pixel(r) + window.vector_column(e)) * LDC + Rows::channel(r);
        #pragma unroll
        for (int k = 0; k < VEC; ++k) patch[at + k * LDC] = lnn_element(value, k);
    };
    auto put_edge = [&](int e, unsigned short bits) {
        if (e < Rows::EDGES) patch[(Rows::pixel(e / 2) + window.edge_column(e)) * LDC + Rows::channel(e / 2)] = bits;
    };
    uint4 a_next[PREFETCH ? A_LOADS : 1];
    Vec x_next[PREFETCH ? X_LOADS : 1];
    unsigned short edge_next[PREFETCH ? EDGE_LOADS : 1];
    auto prefetch = [&](int chunk) {
        window.c0 = chunk * CB;
        #pragma unroll
        for (int t = 0; t < A_LOADS; ++t) a_next[t] = fetch_a(threadIdx.x + t * THREADS, chunk);
        #pragma unroll
        for (int t = 0; t < X_LOADS; ++t) x_next[t] = window.vector(threadIdx.x + t * THREADS);
        #pragma unroll
        for (int t = 0; t < EDGE_LOADS; ++t) edge_next[t] = window.edge(threadIdx.x + t * THREADS);
    };
    auto stage = [&](int chunk) {                              // the step into shared memory
        if constexpr (PREFETCH) {
            #pragma unroll
            for (int t = 0; t < A_LOADS; ++t) put_a(threadIdx.x + t * THREADS, a_next[t]);
            #pragma unroll
            for (int t = 0; t < X_LOADS; ++t) put_x(threadIdx.x + t * THREADS, x_next[t]);
            #pragma unroll
            for (int t = 0; t < EDGE_LOADS; ++t) put_edge(threadIdx.x + t * THREADS, edge_next[t]);
        } else {
            window.c0 = chunk * CB;
            for (int v = threadIdx.x; v < A_VECTORS; v += THREADS) put_a(v, fetch_a(v, chunk));
            for (int e = threadIdx.x; e < Rows::VECTORS; e += THREADS) put_x(e, window.vector(e));
            for (int e = threadIdx.x; e < Rows::EDGES; e += THREADS) put_edge(e, window.edge(e));
        }
    };

    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane >> 2, quad = lane & 3;
    const int warp_m = (warp / WARPS_N) * WM, warp_n = (warp % WARPS_N) * WN;
    int pixel_of[FN];                                          // this lane's B column of fragment j, as a patch pixel
    #pragma unroll
    for (int j = 0; j < FN; ++j) {
        const int n = warp_n + 8 * j + g;
        pixel_of[j] = (n / (TH * TW) * PH + n / TW % TH) * PW + n % TW;
    }
    float acc[FM][FN][4];
    #pragma unroll
    for (int i = 0; i < FM; ++i)
        #pragma unroll
        for (int j = 0; j < FN; ++j)
            #pragma unroll
            for (int r = 0; r < 4; ++r) acc[i][j][r] = 0.0f;

    if constexpr (PREFETCH) prefetch(0);
    for (int chunk = 0; chunk < chunks; ++chunk) {
        stage(chunk);
        __syncthreads();
        if constexpr (PREFETCH) if (chunk + 1 < chunks) prefetch(chunk + 1);
        #pragma unroll
        for (int tap = 0; tap < TAPS; ++tap) {
            const int shift = tap / 3 * PW + tap % 3;
            unsigned a[FM][4], b[FN][2];
            #pragma unroll
            for (int i = 0; i < FM; ++i) lnn_load_a(a[i], a_tile, LDA, warp_m + 16 * i, tap * CB);
            #pragma unroll
            for (int j = 0; j < FN; ++j) {
                const unsigned short* p = patch + (pixel_of[j] + shift) * LDC + 2 * quad;
                b[j][0] = lnn_pair(p);
                b[j][1] = lnn_pair(p + 8);
            }
            lnn_mma_tiles<T>(acc, a, b);
        }
        __syncthreads();
    }

    #pragma unroll
    for (int i = 0; i < FM; ++i)
        #pragma unroll
        for (int j = 0; j < FN; ++j)
            #pragma unroll
            for (int r = 0; r < 4; ++r) {
                const int o = o0 + warp_m + 16 * i + g + (r >= 2 ? 8 : 0);
                const int n = warp_n + 8 * j + 2 * quad + (r & 1);
                const int image = image0 + n / (TH * TW), oy = y0 + n / TW % TH, ox = x0 + n % TW;
                if (o >= out_channels || image >= batch || oy >= out_h || ox >= out_w) continue;
                lnn_store_output(y + (((long long)image * out_channels + o) * out_h + oy) * out_w + ox, acc[i][j][r],
                                 bias, o, has_bias, relu);
            }
}

// The weight gradient of a 3x3 window on tensor cores from halo tiles. Block (channel block of 16, BM output
// channels, chunk z of the spatial tiles): BM x 144 columns (tap-major: column 16*tap + c) summed over its
// tiles' positions; per tile, dy's 128 positions [BM][128] and the 16 channels' (TH+2) x (TW+2) input window
// [16][pixel] go to shared memory and mma reduces over the positions (a B register: two adjacent positions
// of one channel and tap). Writes partial [chunks, O, K + has_bias] with k = 9c + tap (lnn_conv_wgrad's
// contract; lnn_conv_wgrad_reduce adds the chunks); the channel block 0 also sums dy for the bias.
// Staging: rows of dy and of x (LnnHaloRows) are read VEC elements a load (VEC divides both widths and both
// arrays' offsets). On 16-wide tiles with VEC >= 4 the next tile is read into registers while this one is on
// the tensor cores (with VEC 1 that spills; on the 8-wide tile it spilled and was slower: 0.234 ms against
// 0.214 for the bundled model's conv5 at batch 256, H200). The window is held twice, the second copy one
// element ahead, so that every B register is one aligned 32-bit read whatever the tap's column.
template <typename T, int BM, int IMGS, int TH, int TW, int VEC>
__global__ void __launch_bounds__(THREADS, 2) lnn_conv3x3_wgrad_mma(
        const T* __restrict__ dy, const T* __restrict__ x, float* __restrict__ partial,
        int batch, int channels, int height, int width, int out_channels, int out_h, int out_w,
        int pad_h, int pad_w, int has_bias, int tiles_per_chunk) {
    typedef LnnHaloRows<T, IMGS, TH, TW, VEC> Rows;
    typedef typename Rows::Vec Vec;
    constexpr int CB = 16, COLUMNS = 9 * CB, BN = IMGS * TH * TW, PH = TH + 2, PW = TW + 2, PIXELS = IMGS * PH * PW;
    constexpr int LDA = BN + 8;                                // dy [o][position]
    constexpr int LDP = PIXELS + (24 - PIXELS % 64 + 64) % 64; // = 24 mod 64: conflict-free B loads
    static_assert(BN == 128 && TW % 2 == 0 && TW % VEC == 0, "128 positions, pairs within a row, whole vectors");
    constexpr int WARPS_M = BM / 16, WARPS_N = 8 / WARPS_M, NF = (COLUMNS / 8 + WARPS_N - 1) / WARPS_N;
    constexpr int ROW_THREADS = THREADS / BM;                  // threads summing one dy row (bias)
    // staging items: dy rows (o, image, row) of TW / VEC vectors, and the input window's (LnnHaloRows)
    constexpr int DY_ROW = TW / VEC, DY_LOADS = BM * IMGS * TH * DY_ROW / THREADS;
    constexpr int DY_O_STEP = THREADS / (DY_ROW * IMGS * TH);
    static_assert(DY_LOADS * THREADS == BM * BN / VEC && DY_O_STEP * DY_ROW * IMGS * TH == THREADS, "whole passes");
    constexpr int X_LOADS = (Rows::VECTORS + THREADS - 1) / THREADS, EDGE_LOADS = (Rows::EDGES + THREADS - 1) / THREADS;
    constexpr bool PREFETCH = VEC >= 4 && TW == 16;
    __shared__ __align__(16) T a_tile[BM * LDA];
    __shared__ __align__(16) unsigned short patch[2][CB * LDP];      // the bits of x; [1][i] = [0][i + 1]
    const int c0 = blockIdx.x * CB, o0 = blockIdx.y * BM;
    int tile_begin, tile_end;
    LnnHaloTile<IMGS, TH, TW>::chunk(batch, out_h, out_w, tiles_per_chunk, &tile_begin, &tile_end);
    const int columns_k = channels * 9 + has_bias;
    const bool bias_block = has_bias && blockIdx.x == 0;
    Rows window{x, batch, channels, height, width, pad_h, pad_w, c0, 0, 0, 0};

    // a tile's items: read from global memory (zero outside the arrays), then written to shared memory. A
    // thread's dy items (e = threadIdx.x + t * THREADS) share image, row and columns; t steps the channel.
    const int dy_row = threadIdx.x / DY_ROW, dy_o = o0 + dy_row / (IMGS * TH);
    const T* dy_at = nullptr;                                  // the thread's item 0 of the tile, null outside dy
    auto fetch_dy = [&](int t) {
        return dy_at && dy_o + t * DY_O_STEP < out_channels
            ? *reinterpret_cast<const Vec*>(dy_at + (long long)t * DY_O_STEP * out_h * out_w) : Vec{};
    };
    auto put_dy = [&](int t, Vec v) {
        *reinterpret_cast<Vec*>(a_tile + (dy_o - o0 + t * DY_O_STEP) * LDA + dy_row % (IMGS * TH) * TW
                                + threadIdx.x % DY_ROW * VEC) = v;
    };
    auto put_patch = [&](int at, unsigned short bits) {        // both copies
        patch[0][at] = bits;
        if (at > 0) patch[1][at - 1] = bits;
    };
    auto put_x = [&](int e, Vec v) {
        if (e >= Rows::VECTORS) return;
        const int r = e / Rows::ROW_VECTORS, at = Rows::channel(r) * LDP + Rows::pixel(r) + window.vector_column(e);
        #pragma unroll
        for (int k = 0; k < VEC; ++k) put_patch(at + k, lnn_element(v, k));
    };
    auto put_edge = [&](int e, unsigned short bits) {
        if (e < Rows::EDGES) put_patch(Rows::channel(e / 2) * LDP + Rows::pixel(e / 2) + window.edge_column(e), bits);
    };
    Vec dy_next[PREFETCH ? DY_LOADS : 1], x_next[PREFETCH ? X_LOADS : 1];
    unsigned short edge_next[PREFETCH ? EDGE_LOADS : 1];
    auto at_tile = [&](int tile) {                             // where the tile's items are
        const LnnHaloTile<IMGS, TH, TW> at(tile, out_h, out_w);
        const int y0 = at.y0, x0 = at.x0, image0 = at.image0;
        window.y0 = y0, window.x0 = x0, window.image0 = image0;
        const int image = image0 + dy_row / TH % IMGS, oy = y0 + dy_row % TH, ox = x0 + threadIdx.x % DY_ROW * VEC;
        dy_at = image < batch && oy < out_h && ox < out_w
            ? dy + (((long long)image * out_channels + dy_o) * out_h + oy) * out_w + ox : nullptr;
    };
    auto prefetch = [&](int tile) {
        at_tile(tile);
        #pragma unroll
        for (int t = 0; t < DY_LOADS; ++t) dy_next[t] = fetch_dy(t);
        #pragma unroll
        for (int t = 0; t < X_LOADS; ++t) x_next[t] = window.vector(threadIdx.x + t * THREADS);
        #pragma unroll
        for (int t = 0; t < EDGE_LOADS; ++t) edge_next[t] = window.edge(threadIdx.x + t * THREADS);
    };
    auto stage = [&](int tile) {                               // the tile into shared memory
        if constexpr (PREFETCH) {
            #pragma unroll
            for (int t = 0; t < DY_LOADS; ++t) put_dy(t, dy_next[t]);
            #pragma unroll
            for (int t = 0; t < X_LOADS; ++t) put_x(threadIdx.x + t * THREADS, x_next[t]);
            #pragma unroll
            for (int t = 0; t < EDGE_LOADS; ++t) put_edge(threadIdx.x + t * THREADS, edge_next[t]);
        } else {
            at_tile(tile);
            for (int t = 0; t < DY_LOADS; ++t) put_dy(t, fetch_dy(t));
            for (int e = threadIdx.x; e < Rows::VECTORS; e += THREADS) put_x(e, window.vector(e));
            for (int e = threadIdx.x; e < Rows::EDGES; e += THREADS) put_edge(e, window.edge(e));
        }
    };

    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane >> 2, quad = lane & 3;
    const int warp_m = (warp / WARPS_N) * 16, warp_n = warp % WARPS_N;
    float acc[NF][4];
    #pragma unroll
    for (int j = 0; j < NF; ++j)
        #pragma unroll
        for (int r = 0; r < 4; ++r) acc[j][r] = 0.0f;
    float bias_sum = 0.0f;

    if constexpr (PREFETCH) prefetch(tile_begin);
    for (int tile = tile_begin; tile < tile_end; ++tile) {
        stage(tile);
        __syncthreads();
        if constexpr (PREFETCH) if (tile + 1 < tile_end) prefetch(tile + 1);
        if (bias_block)
            for (int n = threadIdx.x % ROW_THREADS; n < BN; n += ROW_THREADS)
                bias_sum += lnn_load(a_tile[threadIdx.x / ROW_THREADS * LDA + n]);
        #pragma unroll
        for (int k0 = 0; k0 < BN; k0 += 16) {
            unsigned a[4];
            lnn_load_a(a, a_tile, LDA, warp_m, k0);
            int pixel[2];                                      // positions k0 + 2 quad and k0 + 2 quad + 8 (even)
            #pragma unroll
            for (int h = 0; h < 2; ++h) {
                const int n = k0 + 2 * quad + 8 * h;
                pixel[h] = (n / (TH * TW) * PH + n / TW % TH) * PW + n % TW;
            }
            #pragma unroll
            for (int f = 0; f < NF; ++f) {
                const int j = warp_n + WARPS_N * f;            // columns 8j .. 8j + 7: tap j / 2, channels 8 (j % 2) + g
                if (j >= COLUMNS / 8) continue;
                const int tap = j / 2, shift = tap / 3 * PW + tap % 3, odd = shift & 1;
                const unsigned short* p = patch[odd] + (8 * (j % 2) + g) * LDP + shift - odd;
                unsigned b[2];
                b[0] = lnn_pair(p + pixel[0]);
                b[1] = lnn_pair(p + pixel[1]);
                lnn_mma_16x8x16<T>(acc[f], a, b);
            }
        }
        __syncthreads();
    }

    #pragma unroll
    for (int f = 0; f < NF; ++f) {
        const int j = warp_n + WARPS_N * f;
        if (j >= COLUMNS / 8) continue;
        #pragma unroll
        for (int r = 0; r < 4; ++r) {
            const int o = o0 + warp_m + g + (r >= 2 ? 8 : 0);
            const int column = 8 * j + 2 * quad + (r & 1), c = c0 + column % 16, tap = column / 16;
            if (o < out_channels && c < channels)
                partial[((long long)blockIdx.z * out_channels + o) * columns_k + 9 * c + tap] = acc[f][r];
        }
    }
    if (bias_block) {
        #pragma unroll
        for (int offset = ROW_THREADS / 2; offset > 0; offset /= 2) bias_sum += __shfl_down_sync(0xffffffffu, bias_sum, offset, ROW_THREADS);
        const int o = o0 + threadIdx.x / ROW_THREADS;
        if (threadIdx.x % ROW_THREADS == 0 && o < out_channels)
            partial[((long long)blockIdx.z * out_channels + o) * columns_k + channels * 9] = bias_sum;
    }
}

// weight [O, C, 3, 3] -> arranged [R, ceil(S/16), 9, 16], zeros past S: arranged[r, sb, 3*kh + kw, s % 16] =
// weight[r, 16*sb + s, kh, kw] (R = O, S = C); with flip, the input gradient's weight (the forward's
// flipped[c, o, kh, kw] = weight[o, c, 2-kh, 2-kw]): R = C, S = O
template <typename T>
__global__ void lnn_conv3x3_arrange(const T* __restrict__ weight, T* __restrict__ arranged,
                                    int out_channels, int channels, int flip) {
    const int rows = flip ? channels : out_channels, sums = flip ? out_channels : channels;
    const int chunks = (sums + 15) / 16;
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= rows * chunks * 144) return;
    const int row = i / (chunks * 144), rest = i % (chunks * 144);
    const int s = rest / 144 * 16 + rest % 16, tap = rest % 144 / 16, kh = tap / 3, kw = tap % 3;
    T v{};
    if (s < sums)
        v = flip ? weight[(((long long)s * channels + row) * 3 + 2 - kh) * 3 + 2 - kw]
                 : weight[(((long long)row * channels + s) * 3 + kh) * 3 + kw];
    arranged[i] = v;
}
"""


def supported(attrs: dict) -> bool:
    """Whether a conv2d runs as implicit GEMM (forward and backward): groups 1, stride 1, dilation 1
    and padding at most kernel - 1 (the input gradient is then a stride-1 convolution too)."""
    (kh, kw), (ph, pw) = attrs["kernel_size"], attrs["padding"]
    return (attrs["groups"] == 1 and tuple(attrs["stride"]) == (1, 1) and tuple(attrs["dilation"]) == (1, 1)
            and ph <= kh - 1 and pw <= kw - 1)


def direct_forward(attrs: dict, channels: int) -> bool:
    """Whether a supported conv2d's forward runs as lnn_conv_direct: at most DIRECT_MAX_CHANNELS input channels
    and DIRECT_MAX_TAPS weights per output channel (the tiled and tensor-core kernels would spend most of their
    reduction steps on padding)."""
    kh, kw = attrs["kernel_size"]
    return channels <= DIRECT_MAX_CHANNELS and channels * kh * kw <= DIRECT_MAX_TAPS


def halo_tile(out_w: int) -> tuple:
    """(IMGS, TH, TW) of lnn_conv3x3_mma: 128 output positions as IMGS images x TH rows x TW columns."""
    tw = 16 if out_w > 8 else 8 if out_w > 4 else 4
    th = 8 if tw >= 8 else 4
    return 128 // (th * tw), th, tw


HALO_TILES = [halo_tile(w) for w in (16, 8, 4)]
# The weight gradient runs on halo tiles on the 16- and 8-wide ones (outputs wider than 4; narrower maps keep
# the gather kernel's: a 4-wide halo tile was not measured). The bundled model's conv5 (192 x 8x8 -> 384, amp,
# H200), ms at batch 64 / 256: on the 8-wide tile 0.084 / 0.214, the gather kernel 0.186 / 0.692, and the
# 16-wide tile (half of it empty) 0.128 / 0.391 in an earlier state of this staging code.
WGRAD_HALO_TILES = [halo_tile(16), halo_tile(8)]
HALO_VECTORS = (8, 4, 1)            # VEC of the halo kernels: 16-bit elements per staging load (LnnHaloRows)
CUDA_CORE_VECTORS = (4, 1)          # VEC of lnn_conv3x3_wgrad_cuda_cores: float32 elements per dy load


def uses_halo(attrs: dict) -> bool:
    """Whether a conv2d runs forward and input gradient on halo tiles: lnn_conv3x3_mma (16-bit, amp, on
    tensor cores) or lnn_conv3x3_cuda_cores (float32, any card)."""
    return tuple(attrs["kernel_size"]) == (3, 3)


def uses_halo_weight_gradient(attrs: dict, channels: int, out_w: int) -> bool:
    """Whether a 3x3 conv2d's weight gradient runs on halo tiles (lnn_conv3x3_wgrad_mma for 16-bit types on
    tensor cores, lnn_conv3x3_wgrad_cuda_cores for float32 on any card): from 16 input channels (with fewer,
    most of a 16-channel block would idle) and outputs wider than 4 (WGRAD_HALO_TILES); else the gather
    kernel runs it."""
    return uses_halo(attrs) and channels >= 16 and halo_tile(out_w) in WGRAD_HALO_TILES


def arranged_elements(rows: int, sums: int) -> int:
    """Size of lnn_conv3x3_arrange's [rows, ceil(sums/16), 9, 16]."""
    return rows * ceil_div(sums, 16) * 144


def transposed_elements(rows: int, sums: int) -> int:
    """Size of lnn_conv3x3_transpose's [sums, 9, rows]."""
    return rows * sums * 9


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


def halo_max_chunks(channels: int, out_channels: int, cuda_cores: bool = False) -> int:
    """Chunks of lnn_conv3x3_wgrad_mma (blocks: 16 input x BM output channels x chunk), or with cuda_cores of
    lnn_conv3x3_wgrad_cuda_cores (CUDA_CORE_WGRAD_BLOCKS' input channels a block): half of the gather pass's
    blocks (two per SM fit; the partial sums stay about as large: with as many blocks as the gather pass,
    mnist_cnn's fp32 step at batch 64 took 0.61x PyTorch's memory against 0.52). The CUDA-core pass rounds
    down, to at most one wave (leaf_cnn224's 28x28 layer: 32 blocks a chunk, 9 chunks would be 1.09 waves)."""
    bm = rows_tile(out_channels)
    channel_block = CUDA_CORE_WGRAD_BLOCKS[bm][0] if cuda_cores else 16
    blocks = ceil_div(channels, channel_block) * ceil_div(out_channels, bm)
    return max(1, TARGET_BLOCKS // 2 // blocks if cuda_cores else ceil_div(TARGET_BLOCKS // 2, blocks))


def partial_elements(out_channels: int, reduction: int, bias: bool, chunks: int = 0) -> int:
    """Size of the weight gradient's partial sums [chunks, O, K + bias] (default: max_chunks)."""
    return (chunks or max_chunks(out_channels, reduction, bias)) * out_channels * (reduction + bias)


def chunking(columns: int, limit: int) -> tuple:
    """(chunk length, chunks) covering `columns` positions with at most `limit` chunks of >= 256."""
    wanted = max(1, min(limit, ceil_div(columns, 256)))
    chunk = ceil_div(ceil_div(columns, wanted), WGRAD_STEP) * WGRAD_STEP
    return chunk, ceil_div(columns, chunk)


def scratch_bytes(attrs: dict, in_shape, out_shape, dtype=np.float32) -> int:
    """Device bytes a training ConvKernels of `dtype` holds besides the plan's pool: the window tables and
    the flipped (or, for the halo kernels, arranged or transposed) weights. float16 and bfloat16 are counted
    alike, as on a card with tensor cores (compute capability 8.0+). The weight gradient's partial sums are a
    workspace of the plan's pool instead (partial_sums_elements)."""
    channels, out_channels = in_shape[0], out_shape[0]
    kh, kw = attrs["kernel_size"]
    reduction = channels * kh * kw
    itemsize = np.dtype(dtype).itemsize
    if uses_halo(attrs):                # the halo kernels' weights: arranged (16-bit) or transposed (float32)
        size = arranged_elements if np.dtype(dtype).name in HALF_TYPES else transposed_elements
        tables = 4 * 3 * reduction
        forward = 0 if direct_forward(attrs, channels) else size(out_channels, channels)
        weights = itemsize * (forward + size(channels, out_channels))
    else:
        tables = 4 * 3 * reduction + 4 * 3 * out_channels * kh * kw
        weights = itemsize * out_channels * reduction
    return tables + weights


def partial_sums_elements(attrs: dict, in_shape, out_shape, dtype=np.float32) -> int:
    """float32 elements of the weight gradient's partial sums [chunks, O, K + bias] of a ConvKernels of
    `dtype` on any card: the larger of the gather pass's and the halo pass's (for float16 and bfloat16 the
    halo pass runs on tensor cores only, and the trainer's plan does not ask the card). Alive only during the layer's
    weight gradient, so the plan pools it with the other layers' backward scratch (train/layers.py)."""
    channels, out_channels = in_shape[0], out_shape[0]
    kh, kw = attrs["kernel_size"]
    reduction = channels * kh * kw
    chunks = max_chunks(out_channels, reduction, attrs["bias"])
    if uses_halo_weight_gradient(attrs, channels, out_shape[2]):
        cuda_cores = np.dtype(dtype).name not in HALF_TYPES
        chunks = max(chunks, halo_max_chunks(channels, out_channels, cuda_cores))
    return partial_elements(out_channels, reduction, attrs["bias"], chunks)


_MODULES = {}


def element_start(array) -> int:
    """Where a CuPy array starts, in elements from address 0 (the alignment its vector loads can have)."""
    return array.data.ptr // array.itemsize


def tensor_cores() -> bool:
    """Whether this GPU runs the 16-bit convolutions on tensor cores (compute capability 8.0 or newer)."""
    import cupy

    return int(cupy.cuda.Device().compute_capability) >= TENSOR_CORE_CAPABILITY


def kernel_names(kind: str, tensor_core: bool) -> list:
    """The template instances a module for element type `kind` (a C type of float16.py) holds."""
    names = [f"lnn_conv_igemm<{kind}, {bm}, {bn}, {tn}>" for bm, (bn, tn) in FORWARD_TILES.items()]
    names += [f"lnn_conv_wgrad<{kind}, {bm}, {bn}>" for bm in FORWARD_TILES for bn in (32, 64)]
    names += [f"lnn_conv_wgrad_reduce<{kind}>", f"lnn_conv_flip_weight<{kind}>", f"lnn_conv_direct<{kind}>"]
    if tensor_core:
        names += [f"lnn_conv_igemm_mma<{kind}, {bm}, {TENSOR_CORE_COLUMNS}>" for bm in FORWARD_TILES]
        names += [f"lnn_conv_wgrad_mma<{kind}, {bm}, {bn}>" for bm in FORWARD_TILES for bn in (32, 64)]
        names += [halo_name(kind, bm, tile, vec) for bm in FORWARD_TILES for tile in HALO_TILES
                  for vec in halo_vectors(tile)]
        names += [wgrad_halo_name(kind, bm, tile, vec) for bm in FORWARD_TILES for tile in WGRAD_HALO_TILES
                  for vec in halo_vectors(tile)]
        names += [f"lnn_conv3x3_arrange<{kind}>"]
    if kind == "float":
        names += [cuda_core_halo_name(bm, tile) for bm in FORWARD_TILES for tile in HALO_TILES]
        names += [cuda_core_wgrad_name(bm, tile, vec) for bm in FORWARD_TILES for tile in WGRAD_HALO_TILES
                  for vec in halo_vectors(tile, CUDA_CORE_VECTORS)]
        names += ["lnn_conv3x3_transpose<float>"]
    return names


def halo_name(kind: str, bm: int, tile: tuple, vec: int) -> str:
    return f"lnn_conv3x3_mma<{kind}, {bm}, {tile[0]}, {tile[1]}, {tile[2]}, {vec}>"


def wgrad_halo_name(kind: str, bm: int, tile: tuple, vec: int) -> str:
    return f"lnn_conv3x3_wgrad_mma<{kind}, {bm}, {tile[0]}, {tile[1]}, {tile[2]}, {vec}>"


def cuda_core_halo_name(bm: int, tile: tuple) -> str:
    return f"lnn_conv3x3_cuda_cores<{bm}, {tile[0]}, {tile[1]}, {tile[2]}>"


def cuda_core_wgrad_name(bm: int, tile: tuple, vec: int) -> str:
    channels, groups = CUDA_CORE_WGRAD_BLOCKS[bm]
    return f"lnn_conv3x3_wgrad_cuda_cores<{bm}, {channels}, {groups}, {tile[0]}, {tile[1]}, {tile[2]}, {vec}>"


def halo_vectors(tile: tuple, choices=HALO_VECTORS) -> list:
    """The VECs a halo tile (IMGS, TH, TW) is compiled for: those of `choices` (HALO_VECTORS for the
    16-bit kernels, CUDA_CORE_VECTORS for the float32 one) that divide its width."""
    return [vec for vec in choices if tile[2] % vec == 0]


def halo_vector(tile: tuple, *elements: int, choices=HALO_VECTORS) -> int:
    """VEC of a halo kernel's launch: the largest of halo_vectors(tile, choices) that divides each of
    `elements` (the widths of the rows it reads and, in elements, where each array starts), so every row
    load is whole and aligned."""
    return next(vec for vec in halo_vectors(tile, choices) if all(count % vec == 0 for count in elements))


def _module(kind: str, tensor_core: bool):
    """One compiled module per element type (float32, float16, bfloat16) and kernel set, made on first use."""
    if (kind, tensor_core) not in _MODULES:
        import cupy

        code = SOURCE + (TENSOR_CORE_SOURCE if tensor_core else "")
        _MODULES[kind, tensor_core] = cupy.RawModule(code=code, options=("-std=c++17",),
                                                     name_expressions=kernel_names(kind, tensor_core))
    return _MODULES[kind, tensor_core]


class ConvKernels:
    """One conv2d layer's implicit-GEMM launches (any batch). Allocates its tables, and with `backward`
    the flipped weight, here, once: the launches allocate nothing (CUDA-graph safe). The weight gradient's
    partial sums are the caller's (the trainer's pooled workspace, partial_sums_elements), or, called
    without them (tests, benchmarks), a buffer of its own made on the first call."""

    def __init__(self, attrs: dict, in_shape, out_shape, backward: bool = True, dtype=np.float32):
        import cupy

        dtype = np.dtype(dtype)
        kind = c_type(dtype)
        self.channels, self.height, self.width = in_shape
        self.out_channels, self.out_h, self.out_w = out_shape
        self.kernel_h, self.kernel_w = attrs["kernel_size"]
        self.pad_h, self.pad_w = attrs["padding"]
        self.bias = bool(attrs["bias"])
        self.reduction = self.channels * self.kernel_h * self.kernel_w
        self.table = cupy.asarray(window_table(self.channels, self.height, self.width, self.kernel_h, self.kernel_w))
        self.no_bias = cupy.zeros(1, dtype)
        self.tensor_cores = dtype.name in HALF_TYPES and tensor_cores()
        module = _module(kind, self.tensor_cores)
        self.direct = direct_forward(attrs, self.channels)
        self.halo = self.tensor_cores and uses_halo(attrs)
        self.cuda_core_halo = kind == "float" and uses_halo(attrs)      # float32's halo kernels (CUDA cores)
        self.halo_tiles = self.halo or self.cuda_core_halo               # either: windows read from halo tiles
        self.halo_wgrad = self.halo_tiles and uses_halo_weight_gradient(attrs, self.channels, self.out_w)
        self._direct = module.get_function(f"lnn_conv_direct<{kind}>")
        if self.halo_wgrad:
            bm, self.wgrad_tile = rows_tile(self.out_channels), halo_tile(self.out_w)
            self.wgrad_channel_block = 16 if self.halo else CUDA_CORE_WGRAD_BLOCKS[bm][0]
            self.wgrad_vectors = HALO_VECTORS if self.halo else CUDA_CORE_VECTORS
            self._halo_wgrad = {vec: module.get_function(wgrad_halo_name(kind, bm, self.wgrad_tile, vec) if self.halo
                                                         else cuda_core_wgrad_name(bm, self.wgrad_tile, vec))
                                for vec in halo_vectors(self.wgrad_tile, self.wgrad_vectors)}
        if self.halo_tiles:     # the weights as the halo kernels read them: arranged, transposed
            if self.halo:
                self._halo = {(bm, tile, vec): module.get_function(halo_name(kind, bm, tile, vec))
                              for bm in FORWARD_TILES for tile in HALO_TILES for vec in halo_vectors(tile)}
                self._arrange = module.get_function(f"lnn_conv3x3_arrange<{kind}>")
                size = arranged_elements
            else:
                self._halo = {(bm, tile): module.get_function(cuda_core_halo_name(bm, tile))
                              for bm in FORWARD_TILES for tile in HALO_TILES}
                self._arrange = module.get_function("lnn_conv3x3_transpose<float>")
                size = transposed_elements
            if not self.direct:
                self.arranged = cupy.empty(size(self.out_channels, self.channels), dtype)
            if backward:
                self.arranged_dx = cupy.empty(size(self.channels, self.out_channels), dtype)
        if self.tensor_cores:
            self._forward_functions = {bm: (module.get_function(f"lnn_conv_igemm_mma<{kind}, {bm}, {TENSOR_CORE_COLUMNS}>"),
                                            TENSOR_CORE_COLUMNS) for bm in FORWARD_TILES}
        else:
            self._forward_functions = {bm: (module.get_function(f"lnn_conv_igemm<{kind}, {bm}, {bn}, {tn}>"), bn)
                                       for bm, (bn, tn) in FORWARD_TILES.items()}
        if backward:
            if not self.halo_tiles:
                self.table_dx = cupy.asarray(window_table(self.out_channels, self.out_h, self.out_w, self.kernel_h,
                                                          self.kernel_w))
                self.flipped = cupy.empty((self.channels, self.out_channels, self.kernel_h, self.kernel_w), dtype)
            self.chunk_limit = (halo_max_chunks(self.channels, self.out_channels, not self.halo) if self.halo_wgrad
                                else max_chunks(self.out_channels, self.reduction, self.bias))
            self.partial_size = partial_elements(self.out_channels, self.reduction, self.bias, self.chunk_limit)
            self._own_partial = None
            wgrad = (f"lnn_conv_wgrad_mma<{kind}, {rows_tile(self.out_channels)}, " if self.tensor_cores
                     else f"lnn_conv_wgrad<{kind}, {rows_tile(self.out_channels)}, ")
            self._wgrad = {bn: module.get_function(f"{wgrad}{bn}>") for bn in (32, 64)}
            self._reduce = module.get_function(f"lnn_conv_wgrad_reduce<{kind}>")
            self._flip = module.get_function(f"lnn_conv_flip_weight<{kind}>")

    def _igemm(self, x, weight, bias, table, y, pad_h, pad_w, relu: bool):
        """y [N, O', H', W'] = act(conv(x [N, C', H', W'], weight [O', C'*KH*KW]) + bias), stride 1."""
        n, channels, height, width = x.shape
        out_channels, out_h, out_w = y.shape[1:]
        bm = rows_tile(out_channels)
        function, bn = self._forward_functions[bm]
        grid = (ceil_div(n * out_h * out_w, bn), ceil_div(out_channels, bm))
        args = (x, weight, self.no_bias if bias is None else bias, table, y,
                *(np.int32(v) for v in (n, channels, height, width, out_channels, out_h, out_w, pad_h, pad_w,
                                        weight.size // out_channels, bias is not None, relu)))
        function(grid, (THREADS,), args)

    def _halo_conv(self, x, weight, flip: bool, arranged, bias, y, pad_h, pad_w, relu: bool):
        """y [N, O', H', W'] = act(conv3x3(x [N, C', H', W'], weight arranged or transposed (flipped with
        flip)) + bias): lnn_conv3x3_mma or lnn_conv3x3_cuda_cores."""
        self._arrange((ceil_div(arranged.size, THREADS),), (THREADS,),
                      (weight, arranged, np.int32(self.out_channels), np.int32(self.channels), np.int32(flip)))
        n, channels, height, width = x.shape
        out_channels, out_h, out_w = y.shape[1:]
        bm, tile = rows_tile(out_channels), halo_tile(out_w)
        images, th, tw = tile
        grid = (ceil_div(n, images) * ceil_div(out_h, th) * ceil_div(out_w, tw), ceil_div(out_channels, bm))
        kernel = self._halo[bm, tile, halo_vector(tile, width, element_start(x))] if self.halo else self._halo[bm, tile]
        kernel(grid, (THREADS,), (x, arranged, self.no_bias if bias is None else bias, y,
                                  *(np.int32(v) for v in (n, channels, height, width, out_channels, out_h, out_w,
                                                          pad_h, pad_w, bias is not None, relu))))

    def _direct_conv(self, x, weight, bias, y, relu: bool):
        """lnn_conv_direct: y [N, O, OH, OW] = act(conv(x [N, C, H, W], weight) + bias)."""
        n = x.shape[0]
        grid = (ceil_div(self.out_h * self.out_w, THREADS), ceil_div(self.out_channels, DIRECT_OUTPUTS), min(n, MAX_GRID_Z))
        self._direct(grid, (THREADS,), (x, weight, self.no_bias if bias is None else bias, y,
                                        *(np.int32(v) for v in (n, self.channels, self.height, self.width,
                                                                self.out_channels, self.out_h, self.out_w, self.kernel_h,
                                                                self.kernel_w, self.pad_h, self.pad_w, bias is not None,
                                                                relu))))

    def forward(self, x, weight, bias, y, relu: bool = False):
        """y = act(conv2d(x) + bias) with relu fused when asked; x [N, C, H, W] -> y [N, O, OH, OW]."""
        if self.direct:
            self._direct_conv(x, weight, bias, y, relu)
        elif self.halo_tiles:
            self._halo_conv(x, weight, False, self.arranged, bias, y, self.pad_h, self.pad_w, relu)
        else:
            self._igemm(x, weight, bias, self.table, y, self.pad_h, self.pad_w, relu)

    def weight_gradient(self, dy, x, dweight, dbias, accumulate: bool, partial=None):
        """dweight [O, C, KH, KW] and dbias [O] (None: no bias) from dy [N, O, OH, OW] and x: written, or
        added with accumulate. partial: float32 scratch of at least partial_sums_elements (None: our own)."""
        if partial is None:
            if self._own_partial is None:
                import cupy

                self._own_partial = cupy.empty(self.partial_size, np.float32)
            partial = self._own_partial
        if partial.size < self.partial_size or partial.dtype != np.float32:
            raise ValueError(f"the weight gradient's partial sums need {self.partial_size} float32, "
                             f"not {partial.size} {partial.dtype}")
        n = dy.shape[0]
        has_bias = dbias is not None
        columns_k = self.reduction + has_bias
        bm = rows_tile(self.out_channels)
        sizes = (n, self.channels, self.height, self.width, self.out_channels, self.out_h, self.out_w,
                 self.pad_h, self.pad_w)
        if self.halo_wgrad:
            images, th, tw = self.wgrad_tile
            tiles = ceil_div(n, images) * ceil_div(self.out_h, th) * ceil_div(self.out_w, tw)
            per_chunk = ceil_div(tiles, min(self.chunk_limit, tiles))
            chunks = ceil_div(tiles, per_chunk)
            grid = (ceil_div(self.channels, self.wgrad_channel_block), ceil_div(self.out_channels, bm), chunks)
            # the rows read by vectors: dy's and (on tensor cores) x's
            rows = (dy, x) if self.halo else (dy,)
            vec = halo_vector(self.wgrad_tile, *(a.shape[3] for a in rows), *(element_start(a) for a in rows),
                              choices=self.wgrad_vectors)
            self._halo_wgrad[vec](grid, (THREADS,), (dy, x, partial, *(np.int32(v) for v in
                                                                       (*sizes, has_bias, per_chunk))))
        else:
            chunk, chunks = chunking(n * self.out_h * self.out_w, self.chunk_limit)
            bn = wgrad_columns(columns_k)
            grid = (ceil_div(columns_k, bn), ceil_div(self.out_channels, bm), chunks)
            self._wgrad[bn](grid, (THREADS,), (dy, x, self.table, partial,
                                               *(np.int32(v) for v in (*sizes, self.reduction, has_bias)),
                                               np.int64(chunk)))
        outputs = self.out_channels * columns_k
        self._reduce((ceil_div(outputs, THREADS),), (THREADS,),
                     (partial, dweight, self.no_bias if dbias is None else dbias,
                      *(np.int32(v) for v in (chunks, self.out_channels, self.reduction, has_bias, accumulate))))

    def input_gradient(self, dy, weight, dx):
        """dx [N, C, H, W] (written) from dy [N, O, OH, OW]: the forward with the flipped weight."""
        if self.halo_tiles:
            self._halo_conv(dy, weight, True, self.arranged_dx, None, dx, 2 - self.pad_h, 2 - self.pad_w, False)
            return
        self._flip((ceil_div(self.flipped.size, THREADS),), (THREADS,),
                   (weight, self.flipped, *(np.int32(v) for v in (self.out_channels, self.channels,
                                                                  self.kernel_h, self.kernel_w))))
        self._igemm(dy, self.flipped, None, self.table_dx, dx, self.kernel_h - 1 - self.pad_h,
                    self.kernel_w - 1 - self.pad_w, relu=False)
