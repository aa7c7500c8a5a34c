"""CuPy-only kernels that replace generic ones of kernels.py on the GPU, one launch each (same results).

epilogue_in_place:  y [N, C, P] float32, in place:  y = act(y * scale[c] + shift[c])
epilogue_from_gemm: src [C, N, P] (a conv's GEMM output) -> y [N, C, P]:  y = act(src * scale[c] + shift[c])
    act: none, relu, relu6, leaky_relu (slope), sigmoid, tanh, as formats/ops.py ACTIVATIONS (softmax is
    not element-wise: the backend runs kernels.activation_forward after an epilogue without activation).
    This is a conv's or linear's bias + activation (scale 1), a batch norm's affine, an activation layer.
im2col: x [N, C, H, W] -> cols [C, KH, KW, N, OH, OW] with zero padding read in place (no padded copy);
    the same cols as kernels.im2col.
maxpool2d: x [N, C, H, W] -> y [N, C, OH, OW], max over the window's cells inside the image (the
    reference pads with -inf, and padding <= half the kernel keeps every window non-empty), and for
    training the winning offset; maxpool2d_backward routes dy back through it (the one max pool of the GPU).
global_avg_pool_backward: dy [N, C] -> dx [N, C, ...] = dy / positions, 0 where the relu it undoes let nothing
    through (its input x <= 0).
channel_affine: batch norm's y = x * scale[c] + shift[c]; batchnorm_input_gradient: its dx;
    batchnorm_statistics / batchnorm_gradient_sums: its per-channel bookkeeping around them.
activation_forward / activation_backward (any shape, element-wise, from the output), dropout (any shape: the
    element index hashed with the step's key), sgd / adam over the flat parameters, global_norm: the training
    step's element-wise work without temporaries (so a captured step holds only its plan).
lstm_step_forward / lstm_step_backward, gru_step_forward / gru_step_backward: one time step, its recurrent product
    and gate arithmetic over [N, H] (runtime/cuda/recurrent.py holds the step loop, the input-projection GEMMs
    and the reference these replace).
The window, im2col and batch-norm kernels take float32, float16 or bfloat16 (amp), computing in float32 (CuPy's
own element-wise kernels take bfloat16 as CuPy 14's `bfloat16` type, the raw ones as float16.py's lnn_bf16); the
trainer's kernels (train/kernels.py) call them on CuPy when `fits`, so training and inference share them.
`i` and `n` are reserved names in ElementwiseKernel bodies. Importing this module imports CuPy; the
kernels compile on first use (CuPy caches them on disk).
"""

from __future__ import annotations

import cupy

from lnn.runtime.cuda.float16 import CONVERSIONS, HALF_TYPES, INDEXING, c_type

# Activation codes passed to the epilogue kernels; softmax has none (see above).
ACTIVATION_CODES = {None: 0, "relu": 1, "relu6": 2, "leaky_relu": 3, "sigmoid": 4, "tanh": 5}

_ACTIVATE = r"""
__device__ __forceinline__ float lnn_activate(float v, int code, float slope) {
    switch (code) {
        case 1: return fmaxf(v, 0.0f);
        case 2: return fminf(fmaxf(v, 0.0f), 6.0f);
        case 3: return v >= 0.0f ? v : v * slope;
        case 4: { const float e = expf(-fabsf(v)); return v >= 0.0f ? 1.0f / (1.0f + e) : e / (1.0f + e); }
        case 5: return tanhf(v);
        default: return v;
    }
}
"""

epilogue_in_place = cupy.ElementwiseKernel(
    "raw float32 scale, raw float32 shift, int32 channels, int32 positions, int32 code, float32 slope",
    "float32 y",
    "const int c = (int)((i / positions) % channels);"
    "y = lnn_activate(y * scale[c] + shift[c], code, slope);",
    "lnn_epilogue_in_place", preamble=_ACTIVATE)

epilogue_from_gemm = cupy.ElementwiseKernel(
    "raw float32 src, raw float32 scale, raw float32 shift, int32 batch, int32 channels, int32 positions, "
    "int32 code, float32 slope",
    "float32 y",
    "const long long p = i % positions;"
    "const long long image_channel = i / positions;"
    "const int c = (int)(image_channel % channels);"
    "const long long image = image_channel / channels;"
    "y = lnn_activate(src[((long long)c * batch + image) * positions + p] * scale[c] + shift[c], code, slope);",
    "lnn_epilogue_from_gemm", preamble=_ACTIVATE)

# T: float32, float16 or bfloat16 (amp), computed in float32. Window kernels index planes [N*C, H, W].
_im2col = cupy.ElementwiseKernel(
    "raw T x, int32 batch, int32 channels, int32 height, int32 width, int32 out_h, int32 out_w, "
    "int32 kernel_h, int32 kernel_w, int32 stride_h, int32 stride_w, int32 pad_h, int32 pad_w, "
    "int32 dilation_h, int32 dilation_w",
    "T cols",
    "long long t = i;"
    "const int ow = (int)(t % out_w); t /= out_w;"
    "const int oh = (int)(t % out_h); t /= out_h;"
    "const int image = (int)(t % batch); t /= batch;"
    "const int kw = (int)(t % kernel_w); t /= kernel_w;"
    "const int kh = (int)(t % kernel_h);"
    "const int c = (int)(t / kernel_h);"
    "const int h = oh * stride_h - pad_h + kh * dilation_h;"
    "const int w = ow * stride_w - pad_w + kw * dilation_w;"
    "cols = (h >= 0 && h < height && w >= 0 && w < width)"
    "    ? x[(((long long)image * channels + c) * height + h) * width + w] : (T)0.0f;",
    "lnn_im2col")

# the inverse of im2col for gradients: dx [N, C, H, W] gathers the cols entries that read each cell
_col2im = cupy.ElementwiseKernel(
    "raw T cols, int32 batch, int32 channels, int32 height, int32 width, int32 out_h, int32 out_w, "
    "int32 kernel_h, int32 kernel_w, int32 stride_h, int32 stride_w, int32 pad_h, int32 pad_w, "
    "int32 dilation_h, int32 dilation_w",
    "T dx",
    "const int w = (int)(i % width);"
    "const int h = (int)((i / width) % height);"
    "const int c = (int)((i / width / height) % channels);"
    "const int image = (int)(i / width / height / channels);"
    "float sum = 0.0f;"
    "for (int a = 0; a < kernel_h; ++a) {"
    "    const int hs = h + pad_h - a * dilation_h;"
    "    if (hs < 0 || hs % stride_h) continue;"
    "    const int oh = hs / stride_h;"
    "    if (oh >= out_h) continue;"
    "    for (int b = 0; b < kernel_w; ++b) {"
    "        const int ws = w + pad_w - b * dilation_w;"
    "        if (ws < 0 || ws % stride_w) continue;"
    "        const int ow = ws / stride_w;"
    "        if (ow >= out_w) continue;"
    "        const long long row = ((long long)c * kernel_h + a) * kernel_w + b;"
    "        sum += (float)cols[((row * batch + image) * out_h + oh) * out_w + ow];"
    "    }"
    "}"
    "dx = (T)sum;",
    "lnn_col2im")

_WINDOW_MAX = INDEXING + r"""
// The max over one pooling window of plane `plane` and the kernel offset that won (the first on ties);
// cells outside the image are -inf, as the reference's padding.
template <typename T>
__device__ float lnn_window_max(const T* x, long long i, int height, int width, int out_h, int out_w,
                                int kernel_h, int kernel_w, int stride_h, int stride_w, int pad_h, int pad_w,
                                int* winner) {
    int oh, ow;
    const T* plane = x + lnn_plane_of(i, out_h, out_w, &oh, &ow) * (long long)height * width;
    float best = __int_as_float(0xff800000);
    *winner = 0;
    for (int a = 0; a < kernel_h; ++a) {
        const int h = oh * stride_h - pad_h + a;
        if (h < 0 || h >= height) continue;
        for (int b = 0; b < kernel_w; ++b) {
            const int w = ow * stride_w - pad_w + b;
            if (w < 0 || w >= width) continue;
            const float v = (float)plane[h * width + w];
            if (v > best) { best = v; *winner = a * kernel_w + b; }
        }
    }
    return best;
}
"""

_POOL_ARGS = ("int32 height, int32 width, int32 out_h, int32 out_w, int32 kernel_h, int32 kernel_w, "
              "int32 stride_h, int32 stride_w, int32 pad_h, int32 pad_w")
_POOL_CALL = "height, width, out_h, out_w, kernel_h, kernel_w, stride_h, stride_w, pad_h, pad_w"

_maxpool2d = cupy.ElementwiseKernel(
    "raw T x, " + _POOL_ARGS, "T y",
    f"int winner; y = (T)lnn_window_max(&x[0], i, {_POOL_CALL}, &winner);",
    "lnn_maxpool2d", preamble=_WINDOW_MAX)

_maxpool2d_argmax = cupy.ElementwiseKernel(
    "raw T x, " + _POOL_ARGS, "T y, I argmax",
    f"int winner; y = (T)lnn_window_max(&x[0], i, {_POOL_CALL}, &winner); argmax = (I)winner;",
    "lnn_maxpool2d_argmax", preamble=_WINDOW_MAX)

# dx [planes, H, W] = the sum of dy over the windows whose argmax is this cell; relu_mask: the layer
# before ends in relu, undone here (train/layers.py PoolUndoingRelu): dy counts only where the pool's y > 0.
# Windows that tile the image (kernel == stride, no padding, H = OH * KH, W = OW * KW): one thread per window
# writes its KH x KW cells (dy to the winner, 0 to the others), every cell once. Otherwise one thread per
# cell gathers from the windows that hold it.
_maxpool2d_backward_tiled = cupy.ElementwiseKernel(
    "T dy, I argmax, T y, int32 relu_mask, int32 height, int32 width, int32 out_h, int32 out_w, "
    "int32 kernel_h, int32 kernel_w", "raw T dx",
    "int oh, ow;"
    "const long long plane = lnn_plane_of(i, out_h, out_w, &oh, &ow);"
    "T* cell = &dx[0] + (plane * height + (long long)oh * kernel_h) * width + (long long)ow * kernel_w;"
    "const int winner = (int)argmax;"
    "const T zero = (T)0.0f;"
    "const T g = (!relu_mask || (float)y > 0.0f) ? dy : zero;"
    "for (int a = 0; a < kernel_h; ++a)"
    "    for (int b = 0; b < kernel_w; ++b) cell[a * width + b] = a * kernel_w + b == winner ? g : zero;",
    "lnn_maxpool2d_backward_tiled", preamble=_WINDOW_MAX)

_maxpool2d_backward = cupy.ElementwiseKernel(
    "raw T dy, raw I argmax, raw T y, int32 relu_mask, " + _POOL_ARGS, "T dx",
    "int h, w;"
    "const long long plane = lnn_plane_of(i, height, width, &h, &w) * (long long)out_h * out_w;"
    "float sum = 0.0f;"
    "for (int a = 0; a < kernel_h; ++a) {"
    "    const int hs = h + pad_h - a;"
    "    if (hs < 0 || hs % stride_h) continue;"
    "    const int oh = hs / stride_h;"
    "    if (oh >= out_h) continue;"
    "    for (int b = 0; b < kernel_w; ++b) {"
    "        const int ws = w + pad_w - b;"
    "        if (ws < 0 || ws % stride_w) continue;"
    "        const int ow = ws / stride_w;"
    "        if (ow >= out_w) continue;"
    "        const long long o = plane + (long long)oh * out_w + ow;"
    "        if ((int)argmax[o] == a * kernel_w + b && (!relu_mask || (float)y[o] > 0.0f)) sum += (float)dy[o];"
    "    }"
    "}"
    "dx = (T)sum;",
    "lnn_maxpool2d_backward", preamble=_WINDOW_MAX)

# global average pool backward: dx [planes, P] = dy[plane] / P; relu_mask: the layer before ends in relu, undone
# here (train/layers.py PoolUndoingRelu): 0 where its output x <= 0. One pass (CuPy's broadcast copy and a relu
# pass took 0.49 ms for leaf_cnn224's [256, 128, 28, 28] on an H200).
_global_avg_pool_backward = cupy.ElementwiseKernel(
    "raw T dy, T x, int32 positions, int32 relu_mask, float32 scale", "T dx",
    "int p;"
    "const long long plane = lnn_divide(i, positions, &p);"
    "dx = relu_mask && (float)x <= 0.0f ? (T)0.0f : (T)((float)dy[plane] * scale);",
    "lnn_global_avg_pool_backward", preamble=INDEXING)

# Batch norm's per-channel passes over x [N, C, P] (float32, or float16 or bfloat16 as its bits; float32 arithmetic), 16 bytes
# per load where P is a multiple of the vector and the arrays are 16-byte aligned (CuPy's own float16
# element-wise kernels ran these at a fifth of the card's bandwidth):
#   lnn_channel_affine:           y = act(x * scale[c] + shift[c]), act none or relu (batch norm's affine)
#   lnn_batchnorm_input_gradient: dx = k[c] * (dy - mean_dy[c] - x_hat * mean_dy_xhat[c]),
#                                 x_hat = (x - mean[c]) * inv_std[c]
_CHANNEL_SOURCE = CONVERSIONS + INDEXING + r"""
// VEC consecutive elements of one (n, c) row: one 16-byte access when VEC > 1
template <typename T, int VEC>
__device__ __forceinline__ void lnn_read(const T* base, long long group, T* e) {
    if constexpr (VEC > 1) *reinterpret_cast<uint4*>(e) = reinterpret_cast<const uint4*>(base)[group];
    else e[0] = base[group];
}
template <typename T, int VEC>
__device__ __forceinline__ void lnn_write(T* base, long long group, const T* e) {
    if constexpr (VEC > 1) reinterpret_cast<uint4*>(base)[group] = *reinterpret_cast<const uint4*>(e);
    else base[group] = e[0];
}

template <typename T, int VEC>
__global__ void lnn_channel_affine(const T* __restrict__ x, const float* __restrict__ scale,
                                   const float* __restrict__ shift, T* __restrict__ y, long long groups,
                                   long long positions, int channels, int relu) {
    for (long long g = blockIdx.x * (long long)blockDim.x + threadIdx.x; g < groups; g += (long long)gridDim.x * blockDim.x) {
        int p, c;
        lnn_plane_of(g * VEC, channels, (int)positions, &c, &p);
        const float s = scale[c], t = shift[c];
        __align__(16) T e[VEC];
        lnn_read<T, VEC>(x, g, e);
        #pragma unroll
        for (int k = 0; k < VEC; ++k) {
            const float v = lnn_load(e[k]) * s + t;
            lnn_store(&e[k], relu ? fmaxf(v, 0.0f) : v);
        }
        lnn_write<T, VEC>(y, g, e);
    }
}

template <typename T, int VEC>
__global__ void lnn_batchnorm_input_gradient(const T* __restrict__ dy, const T* __restrict__ x,
        const float* __restrict__ mean, const float* __restrict__ inv_std, const float* __restrict__ k,
        const float* __restrict__ mean_dy, const float* __restrict__ mean_dy_xhat, T* __restrict__ dx,
        long long groups, long long positions, int channels) {
    for (long long g = blockIdx.x * (long long)blockDim.x + threadIdx.x; g < groups; g += (long long)gridDim.x * blockDim.x) {
        int p, c;
        lnn_plane_of(g * VEC, channels, (int)positions, &c, &p);
        const float m = mean[c], is = inv_std[c], kc = k[c], md = mean_dy[c], mdx = mean_dy_xhat[c];
        __align__(16) T a[VEC], b[VEC];
        lnn_read<T, VEC>(dy, g, a);
        lnn_read<T, VEC>(x, g, b);
        #pragma unroll
        for (int e = 0; e < VEC; ++e) {
            const float x_hat = (lnn_load(b[e]) - m) * is;
            lnn_store(&a[e], kc * (lnn_load(a[e]) - md - x_hat * mdx));
        }
        lnn_write<T, VEC>(dx, g, a);
    }
}
"""
_CHANNEL_VECTORS = {"float32": 4, "float16": 8, "bfloat16": 8}        # elements per 16-byte access
_channel_module = None


def _channel_pass(name: str, arrays: tuple, positions: int, channels: int, leading: tuple, trailing: tuple = ()):
    """Launch `name` (arguments: leading, groups, P, C, trailing) over arrays[0]'s elements: 16-byte groups
    where P and every array allow, else one by one."""
    global _channel_module
    if _channel_module is None:
        names = [f"{kernel}<{c_type(name)}, {vec}>" for kernel in ("lnn_channel_affine", "lnn_batchnorm_input_gradient")
                 for name, wide in _CHANNEL_VECTORS.items() for vec in (1, wide)]
        _channel_module = cupy.RawModule(code=_CHANNEL_SOURCE, options=("-std=c++17",), name_expressions=names)
    kind, vec = c_type(arrays[0].dtype), _CHANNEL_VECTORS[arrays[0].dtype.name]
    if positions % vec or any(a.data.ptr % 16 for a in arrays):
        vec = 1
    groups = arrays[0].size // vec
    blocks = max(1, min(-(-groups // 256), 132 * 16))
    _channel_module.get_function(f"{name}<{kind}, {vec}>")(
        (blocks,), (256,), (*leading, cupy.int64(groups), cupy.int64(positions), cupy.int32(channels), *trailing))


def channel_affine(x, scale, shift, positions: int, channels: int, y, relu: bool = False):
    """y [N, C, P] = x * scale[c] + shift[c] (then relu with `relu`); scale, shift float32 [C]."""
    _channel_pass("lnn_channel_affine", (x, y), positions, channels, (x, scale, shift, y), (cupy.int32(relu),))
    return y


def batchnorm_input_gradient(dy, x, mean, inv_std, k, mean_dy, mean_dy_xhat, positions: int, channels: int, dx):
    """batch norm's dx [N, C, P] (the formula above); the per-channel vectors float32 [C]."""
    _channel_pass("lnn_batchnorm_input_gradient", (dy, x, dx), positions, channels,
                  (dy, x, mean, inv_std, k, mean_dy, mean_dy_xhat, dx))
    return dx

# batch norm's per-channel bookkeeping over [C], one launch each (instead of about 20 tiny ones); the
# statistics and sums float32, parameters (W), running averages (R) and gradients (G) float32, float16 or bfloat16:
# batchnorm_statistics, from the batch mean and the centered sum of squares: saved mean and
#   1/sqrt(var + eps), the running averages (the unbiased variance), scale = w * inv_std, shift = b - mean * scale
# batchnorm_gradient_sums, from sum(dy) and sum(dy * (x - mean)): dweight += sum(dy * x_hat), dbias += sum(dy),
#   and batchnorm_input_gradient's k = w * inv_std, mean_dy = sum(dy) / m, mean_dy_xhat = sum(dy * x_hat) / m
batchnorm_statistics = cupy.ElementwiseKernel(
    "float32 mean, float32 squares, W weight, W bias, float64 count, float64 eps, float64 momentum",
    "float32 saved_mean, float32 saved_inv_std, R running_mean, R running_var, float32 scale, float32 shift",
    "const float var = squares / (float)count;"
    "const float inv_std = 1.0f / sqrtf(var + (float)eps);"
    "saved_mean = mean;"
    "saved_inv_std = inv_std;"
    "running_mean = (R)((float)running_mean * (float)(1.0 - momentum) + (float)momentum * mean);"
    "running_var = (R)((float)running_var * (float)(1.0 - momentum)"
    "                  + (float)(momentum * count / (count > 1.0 ? count - 1.0 : 1.0)) * var);"
    "scale = (float)weight * inv_std;"
    "shift = (float)bias - mean * scale;",
    "lnn_batchnorm_statistics")

batchnorm_gradient_sums = cupy.ElementwiseKernel(
    "float32 sum_dy, float32 sum_dy_centered, float32 inv_std, W weight, float64 count",
    "G dweight, G dbias, float32 k, float32 mean_dy, float32 mean_dy_xhat",
    "const float sum_dy_xhat = sum_dy_centered * inv_std;"
    "dweight = (G)((float)dweight + sum_dy_xhat);"
    "dbias = (G)((float)dbias + sum_dy);"
    "k = (float)weight * inv_std;"
    "mean_dy = sum_dy / (float)count;"
    "mean_dy_xhat = sum_dy_xhat / (float)count;",
    "lnn_batchnorm_gradient_sums")

# lstm and gru, one time step with its recurrent product, in one launch each way; gates [N, G*H] in blocks (lstm
# i, f, g, o; gru r, z, n), W_hh [G*H, H]; sigmoid as 0.5 + 0.5 tanh(a / 2). A block of 256 threads owns 8 rows x
# 8 hidden units; 4 threads share each (row, unit), each summing every 4th term of the product (float32),
# joined by warp shuffles; the product's inner dimension passes through shared memory in chunks (the 4-float
# pad keeps the 32 banks apart), read 4 values an access where H is a multiple of 4 and the arrays aligned. No product on a direction's first step (h_prev = 0) or, backward, on the first
# step walked (no step after it).
# lstm forward: a = gates + h_prev @ W_hh^T (gates hold the input projection and both biases) -> gates = the
#   activated i, f, g, o (saved for the backward); c = i g + f c_prev; h = o tanh(c)
# lstm backward: dh = dh_out[:, offset:offset + H] (the step's output gradient, [N, D*H]) + dgates_after @ W_hh
#   (the step after in time), dc carried from the step after -> dgates (pre-activation) and dc for the step
#   before: dc += dh o (1 - tanh(c)^2); da_i = dc g i (1 - i); da_f = dc c_prev f (1 - f) (0 on a direction's
#   first step); da_g = dc i (1 - g^2); da_o = dh tanh(c) o (1 - o); dc = dc f
# gru forward: a = h_prev @ W_hh^T + b_hh; r = sig(gates_r + a_r), z = sig(gates_z + a_z), ghn = a_n (saved),
#   n = tanh(gates_n + r ghn), h = n + z (h_prev - n) -> gates = r, z, n
# gru backward: dh = dh_out[:, offset:] + dh_carry (dh z of the step after) + dgh_after @ W_hh; dn = dh (1 - z);
#   da_n = dn (1 - n^2); da_z = dh (h_prev - n) z (1 - z); da_r = da_n ghn r (1 - r) -> dgates = (da_r, da_z,
#   da_n), dgh = (da_r, da_z, da_n r), dh_carry = dh z
_RECURRENT_SOURCE = CONVERSIONS + r"""
constexpr int STEP_ROWS = 8, STEP_UNITS = 8, STEP_SPLIT = 4, STEP_THREADS = STEP_ROWS * STEP_UNITS * STEP_SPLIT;

struct LnnStepThread {          // this thread's place: row r, unit u, split s of its block's tile
    int r, u, s, row0, unit0, n, j;
    __device__ LnnStepThread()
        : r(threadIdx.x / 32), u(threadIdx.x / STEP_SPLIT % STEP_UNITS), s(threadIdx.x % STEP_SPLIT),
          row0(blockIdx.y * STEP_ROWS), unit0(blockIdx.x * STEP_UNITS), n(row0 + r), j(unit0 + u) {}
    __device__ bool owns() const { return s == 0; }
};

__device__ __forceinline__ float lnn_split_sum(float v) {          // the 4 lanes of one (row, unit)
    v += __shfl_down_sync(0xffffffffu, v, 2);
    return v + __shfl_down_sync(0xffffffffu, v, 1);
}

template <typename T> struct LnnQuad;                                // four T in one access
template <> struct LnnQuad<float> { using type = float4; };
template <> struct LnnQuad<unsigned short> { using type = ushort4; };
template <> struct LnnQuad<lnn_bf16> { using type = ushort4; };

// v[0..VEC) = p[0..VEC) as float32: one access when VEC is 4 (p aligned to it), else one value
template <int VEC, typename T>
__device__ __forceinline__ void lnn_load_run(const T* p, bool inside, float* v) {
    if (!inside) {
        #pragma unroll
        for (int q = 0; q < VEC; ++q) v[q] = 0.0f;
    } else if constexpr (VEC == 4) {
        const typename LnnQuad<T>::type quad = *reinterpret_cast<const typename LnnQuad<T>::type*>(p);
        const T* e = reinterpret_cast<const T*>(&quad);
        #pragma unroll
        for (int q = 0; q < 4; ++q) v[q] = lnn_load(e[q]);
    } else {
        v[0] = lnn_load(p[0]);
    }
}

// rows x CHUNK of a row-major matrix (row stride `stride`, `width` valid columns) into tile[row][m]
template <int VEC, int CHUNK, int TILE_STRIDE, typename T>
__device__ __forceinline__ void lnn_load_rows(float* tile, const T* __restrict__ a, long long stride, int row0,
                                              int rows, int tile_rows, int m0, int width) {
    #pragma unroll 4
    for (int e = threadIdx.x; e < tile_rows * CHUNK / VEC; e += STEP_THREADS) {
        const int row = e / (CHUNK / VEC), m = e % (CHUNK / VEC) * VEC;
        float v[VEC];
        lnn_load_run<VEC>(&a[(row0 + row) * stride + m0 + m], row0 + row < rows && m0 + m < width, v);
        #pragma unroll
        for (int q = 0; q < VEC; ++q) tile[row * TILE_STRIDE + m + q] = v[q];
    }
}

// a[k] = sum over m < H of h_prev[n, m] W_hh[k H + j, m], k < GATES; every lane of the block calls it
template <typename T, int GATES, int VEC>
__device__ void lnn_forward_product(const LnnStepThread& at, const T* __restrict__ h_prev, const T* __restrict__ w_hh,
                                    int rows, int hidden, float* a) {
    constexpr int CHUNK = 128, STRIDE = CHUNK + 4;
    __shared__ float h_tile[STEP_ROWS][CHUNK];
    __shared__ float w_tile[GATES][STEP_UNITS][STRIDE];            // [k][unit]: gate k's W_hh row for that unit
    for (int k = 0; k < GATES; ++k) a[k] = 0.0f;
    for (int m0 = 0; m0 < hidden; m0 += CHUNK) {
        #pragma unroll
        for (int k = 0; k < GATES; ++k)
            lnn_load_rows<VEC, CHUNK, STRIDE>(&w_tile[k][0][0], w_hh + (long long)k * hidden * hidden, hidden, at.unit0,
                                              hidden, STEP_UNITS, m0, hidden);
        lnn_load_rows<VEC, CHUNK, CHUNK>(&h_tile[0][0], h_prev, hidden, at.row0, rows, STEP_ROWS, m0, hidden);
        __syncthreads();
        #pragma unroll 8
        for (int m = at.s; m < CHUNK; m += STEP_SPLIT) {
            const float v = h_tile[at.r][m];
            #pragma unroll
            for (int k = 0; k < GATES; ++k) a[k] += v * w_tile[k][at.u][m];
        }
        __syncthreads();
    }
    #pragma unroll
    for (int k = 0; k < GATES; ++k) a[k] = lnn_split_sum(a[k]);
}

// sum over m < GATES H of d_after[n, m] W_hh[m, j]; every lane of the block calls it
template <typename T, int GATES, int VEC>
__device__ float lnn_backward_product(const LnnStepThread& at, const T* __restrict__ d_after,
                                      const T* __restrict__ w_hh, int rows, int hidden) {
    constexpr int CHUNK = 256, STRIDE = CHUNK + 4;
    __shared__ float g_tile[STEP_ROWS][CHUNK];
    __shared__ float w_tile[STEP_UNITS][STRIDE];                    // [unit][m] = W_hh[m0 + m, unit0 + unit]
    const int width = GATES * hidden;
    float sum = 0.0f;
    for (int m0 = 0; m0 < width; m0 += CHUNK) {
        #pragma unroll 4
        for (int e = threadIdx.x; e < CHUNK * STEP_UNITS / VEC; e += STEP_THREADS) {
            const int m = e / (STEP_UNITS / VEC), u = e % (STEP_UNITS / VEC) * VEC;
            float v[VEC];
            lnn_load_run<VEC>(&w_hh[(long long)(m0 + m) * hidden + at.unit0 + u], m0 + m < width && at.unit0 + u < hidden, v);
            #pragma unroll
            for (int q = 0; q < VEC; ++q) w_tile[u + q][m] = v[q];
        }
        lnn_load_rows<VEC, CHUNK, CHUNK>(&g_tile[0][0], d_after, width, at.row0, rows, STEP_ROWS, m0, width);
        __syncthreads();
        #pragma unroll 8
        for (int m = at.s; m < CHUNK; m += STEP_SPLIT) sum += g_tile[at.r][m] * w_tile[at.u][m];
        __syncthreads();
    }
    return lnn_split_sum(sum);
}

__device__ __forceinline__ float lnn_sigmoid(float a) { return 0.5f + 0.5f * tanhf(0.5f * a); }

template <typename T, int VEC>
__global__ void __launch_bounds__(STEP_THREADS) lnn_lstm_step_forward(
        T* __restrict__ gates, const T* __restrict__ h_prev, const T* __restrict__ w_hh, const T* __restrict__ c_prev,
        T* __restrict__ c, T* __restrict__ h, int rows, int hidden, int first) {
    const LnnStepThread at;
    float a[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    if (!first) lnn_forward_product<T, 4, VEC>(at, h_prev, w_hh, rows, hidden, a);
    if (!at.owns() || at.n >= rows || at.j >= hidden) return;
    const long long base = (long long)at.n * 4 * hidden + at.j, e = (long long)at.n * hidden + at.j;
    #pragma unroll
    for (int k = 0; k < 4; ++k) a[k] += lnn_load(gates[base + k * hidden]);
    const float in_gate = lnn_sigmoid(a[0]), forget = lnn_sigmoid(a[1]), cand = tanhf(a[2]), out_gate = lnn_sigmoid(a[3]);
    lnn_store(&gates[base], in_gate);
    lnn_store(&gates[base + hidden], forget);
    lnn_store(&gates[base + 2 * hidden], cand);
    lnn_store(&gates[base + 3 * hidden], out_gate);
    const float cell = in_gate * cand + (first ? 0.0f : forget * lnn_load(c_prev[e]));
    lnn_store(&c[e], cell);
    lnn_store(&h[e], out_gate * tanhf(cell));
}

template <typename T, int VEC>
__global__ void __launch_bounds__(STEP_THREADS) lnn_lstm_step_backward(
        const T* __restrict__ gates, const T* __restrict__ c, const T* __restrict__ c_prev,
        const T* __restrict__ dgates_after, const T* __restrict__ w_hh, const T* __restrict__ dh_out,
        long long out_width, int out_offset, T* __restrict__ dc, T* __restrict__ dgates,
        int rows, int hidden, int first, int has_after) {
    const LnnStepThread at;
    float grad_h = has_after ? lnn_backward_product<T, 4, VEC>(at, dgates_after, w_hh, rows, hidden) : 0.0f;
    if (!at.owns() || at.n >= rows || at.j >= hidden) return;
    const long long base = (long long)at.n * 4 * hidden + at.j, e = (long long)at.n * hidden + at.j;
    grad_h += lnn_load(dh_out[(long long)at.n * out_width + out_offset + at.j]);
    const float in_gate = lnn_load(gates[base]), forget = lnn_load(gates[base + hidden]);
    const float cand = lnn_load(gates[base + 2 * hidden]), out_gate = lnn_load(gates[base + 3 * hidden]);
    const float tc = tanhf(lnn_load(c[e]));
    const float grad_c = lnn_load(dc[e]) + grad_h * out_gate * (1.0f - tc * tc);
    lnn_store(&dgates[base], grad_c * cand * in_gate * (1.0f - in_gate));
    lnn_store(&dgates[base + hidden], first ? 0.0f : grad_c * lnn_load(c_prev[e]) * forget * (1.0f - forget));
    lnn_store(&dgates[base + 2 * hidden], grad_c * in_gate * (1.0f - cand * cand));
    lnn_store(&dgates[base + 3 * hidden], grad_h * tc * out_gate * (1.0f - out_gate));
    lnn_store(&dc[e], grad_c * forget);
}

template <typename T, int VEC>
__global__ void __launch_bounds__(STEP_THREADS) lnn_gru_step_forward(
        T* __restrict__ gates, const T* __restrict__ h_prev, const T* __restrict__ w_hh, const T* __restrict__ b_hh,
        T* __restrict__ ghn, T* __restrict__ h, int rows, int hidden, int first, int has_bias) {
    const LnnStepThread at;
    float a[3] = {0.0f, 0.0f, 0.0f};
    if (!first) lnn_forward_product<T, 3, VEC>(at, h_prev, w_hh, rows, hidden, a);
    if (!at.owns() || at.n >= rows || at.j >= hidden) return;
    const long long base = (long long)at.n * 3 * hidden + at.j, e = (long long)at.n * hidden + at.j;
    #pragma unroll
    for (int k = 0; k < 3; ++k) a[k] += has_bias ? lnn_load(b_hh[k * hidden + at.j]) : 0.0f;
    const float reset = lnn_sigmoid(lnn_load(gates[base]) + a[0]);
    const float update = lnn_sigmoid(lnn_load(gates[base + hidden]) + a[1]);
    const float cand = tanhf(lnn_load(gates[base + 2 * hidden]) + reset * a[2]);
    const float before = first ? 0.0f : lnn_load(h_prev[e]);
    lnn_store(&gates[base], reset);
    lnn_store(&gates[base + hidden], update);
    lnn_store(&gates[base + 2 * hidden], cand);
    lnn_store(&ghn[e], a[2]);
    lnn_store(&h[e], cand + update * (before - cand));
}

template <typename T, int VEC>
__global__ void __launch_bounds__(STEP_THREADS) lnn_gru_step_backward(
        const T* __restrict__ gates, const T* __restrict__ ghn, const T* __restrict__ h_prev,
        const T* __restrict__ dgh_after, const T* __restrict__ w_hh, const T* __restrict__ dh_out,
        long long out_width, int out_offset, T* __restrict__ dh_carry, T* __restrict__ dgates, T* __restrict__ dgh,
        int rows, int hidden, int first, int has_after) {
    const LnnStepThread at;
    float grad_h = has_after ? lnn_backward_product<T, 3, VEC>(at, dgh_after, w_hh, rows, hidden) : 0.0f;
    if (!at.owns() || at.n >= rows || at.j >= hidden) return;
    const long long base = (long long)at.n * 3 * hidden + at.j, e = (long long)at.n * hidden + at.j;
    grad_h += lnn_load(dh_out[(long long)at.n * out_width + out_offset + at.j]) + lnn_load(dh_carry[e]);
    const float reset = lnn_load(gates[base]), update = lnn_load(gates[base + hidden]);
    const float cand = lnn_load(gates[base + 2 * hidden]), before = first ? 0.0f : lnn_load(h_prev[e]);
    const float grad_n = grad_h * (1.0f - update) * (1.0f - cand * cand);
    const float grad_z = grad_h * (before - cand) * update * (1.0f - update);
    const float grad_r = grad_n * lnn_load(ghn[e]) * reset * (1.0f - reset);
    lnn_store(&dgates[base], grad_r);
    lnn_store(&dgates[base + hidden], grad_z);
    lnn_store(&dgates[base + 2 * hidden], grad_n);
    lnn_store(&dgh[base], grad_r);
    lnn_store(&dgh[base + hidden], grad_z);
    lnn_store(&dgh[base + 2 * hidden], grad_n * reset);
    lnn_store(&dh_carry[e], grad_h * update);
}
"""
_recurrent_module = None


def _step_launch(name: str, like, rows: int, hidden: int, arguments: tuple, flags: tuple):
    """Launch a step kernel over [rows, hidden]: its arrays and sizes (`arguments`), then rows, hidden, flags."""
    global _recurrent_module
    if any(isinstance(a, cupy.ndarray) and a.dtype != like.dtype for a in arguments):
        raise TypeError(f"{name}: every array must be {like.dtype}, got "
                        f"{[a.dtype.name for a in arguments if isinstance(a, cupy.ndarray)]}")
    if _recurrent_module is None:
        names = [f"lnn_{cell}_step_{way}<{kind}, {vec}>" for cell in ("lstm", "gru") for way in ("forward", "backward")
                 for kind in map(c_type, ("float32",) + HALF_TYPES) for vec in (1, 4)]
        _recurrent_module = cupy.RawModule(code=_RECURRENT_SOURCE, options=("-std=c++17",), name_expressions=names)
    arrays = [a for a in arguments if isinstance(a, cupy.ndarray)]
    vec = 4 if hidden % 4 == 0 and all(a.data.ptr % (4 * a.itemsize) == 0 for a in arrays) else 1   # 4-value runs
    grid = (-(-hidden // 8), -(-rows // 8))                   # STEP_UNITS, STEP_ROWS
    _recurrent_module.get_function(f"{name}<{c_type(like.dtype)}, {vec}>")(
        grid, (256,), (*arguments, cupy.int32(rows), cupy.int32(hidden), *(cupy.int32(flag) for flag in flags)))


def lstm_step_forward(gates, h_prev, w_hh, c_prev, c, h):
    """One step: gates [N, 4H] (the input projection, then in place the activated gates), h_prev and c_prev
    [N, H] (None on a direction's first step), w_hh [4H, H] -> c, h [N, H]."""
    first = c_prev is None
    _step_launch("lnn_lstm_step_forward", c, *c.shape,
                 (gates, h if first else h_prev, w_hh, c if first else c_prev, c, h), (first,))
    return h


def lstm_step_backward(gates, c, c_prev, dgates_after, w_hh, dh_out, out_offset: int, dc, dgates):
    """One step back: its activated gates, c and c_prev (None on a direction's first step), dgates_after [N, 4H]
    (the step after in time; None on the first step walked back), w_hh [4H, H], dh_out [N, D*H] (the step's
    output gradient, this direction's columns from out_offset) -> dgates [N, 4H]; dc [N, H] carried in place."""
    first, has_after = c_prev is None, dgates_after is not None
    _step_launch("lnn_lstm_step_backward", c, *c.shape,
                 (gates, c, c if first else c_prev, dgates_after if has_after else dgates, w_hh, dh_out,
                  cupy.int64(dh_out.shape[1]), cupy.int32(out_offset), dc, dgates), (first, has_after))
    return dgates


def gru_step_forward(gates, h_prev, w_hh, b_hh, ghn, h):
    """One step: gates [N, 3H] (the input projection with b_ih, then in place the activated r, z, n), h_prev
    [N, H] (None on a direction's first step), w_hh [3H, H], b_hh [3H] or None -> ghn (W_hn h_prev + b_hn), h."""
    first = h_prev is None
    _step_launch("lnn_gru_step_forward", h, *h.shape,
                 (gates, h if first else h_prev, w_hh, w_hh if b_hh is None else b_hh, ghn, h), (first, b_hh is not None))
    return h


def gru_step_backward(gates, ghn, h_prev, dgh_after, w_hh, dh_out, out_offset: int, dh_carry, dgates, dgh):
    """One step back: its activated gates, ghn and h_prev (None on a direction's first step), dgh_after [N, 3H]
    (None on the first step walked back), dh_out as lstm_step_backward's -> dgates, dgh [N, 3H]; dh_carry [N, H]
    (dh z, the direct part of the step before's dh) carried in place, zero before the first step walked."""
    first, has_after = h_prev is None, dgh_after is not None
    _step_launch("lnn_gru_step_backward", ghn, *ghn.shape,
                 (gates, ghn, ghn if first else h_prev, dgh_after if has_after else dgh, w_hh, dh_out,
                  cupy.int64(dh_out.shape[1]), cupy.int32(out_offset), dh_carry, dgates, dgh), (first, has_after))
    return dgates


# The step's element-wise work that the generic NumPy-style code does with temporaries (a boolean mask, a hash
# buffer, the optimizer's intermediate arrays), in one launch and no allocation each, so a captured step holds
# only what its plan (train/plan.py) counts.
# activation_forward: y = f(x); activation_backward: dx = dy * f'(y) from the output y; T float32, float16 or bfloat16,
#   computed in float32; code as ACTIVATION_CODES (softmax is not element-wise); y may be x, dx may be dy.
_ACTIVATION_GRADIENT = r"""
__device__ __forceinline__ float lnn_activation_gradient(float dy, float y, int code, float slope) {
    switch (code) {
        case 1: return y > 0.0f ? dy : 0.0f;
        case 2: return (y > 0.0f && y < 6.0f) ? dy : 0.0f;
        case 3: return y > 0.0f ? dy : dy * slope;
        case 4: return dy * y * (1.0f - y);
        case 5: return dy * (1.0f - y * y);
        default: return dy;
    }
}
"""

_activation_forward = cupy.ElementwiseKernel(
    "T x, int32 code, float32 slope", "T y", "y = (T)lnn_activate((float)x, code, slope);",
    "lnn_activation_forward", preamble=_ACTIVATE)

_activation_backward = cupy.ElementwiseKernel(
    "T dy, T y, int32 code, float32 slope", "T dx",
    "dx = (T)lnn_activation_gradient((float)dy, (float)y, code, slope);",
    "lnn_activation_backward", preamble=_ACTIVATION_GRADIENT)

# dropout: y = x * scale where lowbias32(element index + key) >= threshold, else 0 (train/kernels.py's mask, the
# same bits); key a one-element uint32 array (the step's, read on the device), scale 1 / (1 - p) rounded to T.
_dropout = cupy.ElementwiseKernel(
    "T x, raw uint32 key, uint32 threshold, float32 scale", "T y",
    "unsigned int h = (unsigned int)i + key[0];"
    "h ^= h >> 16; h *= 0x7FEB352Du; h ^= h >> 15; h *= 0x846CA68Bu; h ^= h >> 16;"
    "y = h >= threshold ? (T)((float)x * scale) : (T)0.0f;",
    "lnn_dropout")

# optimizers over the flat float32 (or float64) parameters P, gradients G and state, as train/optim.py's NumPy
# code; lr and step are one-element device arrays, keep a one-element bool array (false: amp's skipped step,
# nothing written). Adam: decoupled is AdamW's weight decay; the bias corrections use max(step, 1).
_sgd = cupy.ElementwiseKernel(
    "T g, raw T lr, raw bool keep, T weight_decay", "T p",
    "if (keep[0]) p = p - lr[0] * (g + weight_decay * p);",
    "lnn_sgd")

_sgd_momentum = cupy.ElementwiseKernel(
    "T g, raw T lr, raw bool keep, T weight_decay, T momentum, int32 nesterov", "T p, T buf",
    "if (keep[0]) {"
    "    const T grad = g + weight_decay * p;"
    "    const T b = momentum * buf + grad;"
    "    buf = b;"
    "    p = p - lr[0] * (nesterov ? grad + momentum * b : b);"
    "}",
    "lnn_sgd_momentum")

_adam = cupy.ElementwiseKernel(
    "T g, raw T lr, raw T step, raw bool keep, T weight_decay, int32 decoupled, T beta1, T one_minus_beta1, "
    "T beta2, T one_minus_beta2, T eps", "T p, T m, T v",
    "if (keep[0]) {"
    "    const T rate = lr[0];"
    "    const T grad = decoupled ? g : g + weight_decay * p;"
    "    const T param = decoupled ? p * ((T)1 - rate * weight_decay) : p;"
    "    const T m1 = beta1 * m + one_minus_beta1 * grad;"
    "    const T v1 = beta2 * v + one_minus_beta2 * grad * grad;"
    "    const T s = step[0] > (T)1 ? step[0] : (T)1;"
    "    const T bias1 = (T)1 - pow(beta1, s), bias2 = (T)1 - pow(beta2, s);"
    "    m = m1;"
    "    v = v1;"
    "    p = param - (rate / bias1) * m1 / (sqrt(v1 / bias2) + eps);"
    "}",
    "lnn_adam")

# ||g||_2 over the flat gradients, a 0-d array (no squared copy)
_global_norm = cupy.ReductionKernel("T g", "T norm", "g * g", "a + b", "norm = sqrt(a)", "0", "lnn_global_norm")


def activation_forward(activation: dict, x, y):
    return _activation_forward(x, ACTIVATION_CODES[activation["type"]], float(activation.get("negative_slope", 0.0)), y)


def activation_backward(activation: dict, dy, y, dx):
    return _activation_backward(dy, y, ACTIVATION_CODES[activation["type"]],
                                float(activation.get("negative_slope", 0.0)), dx)


def dropout(x, key, threshold: int, scale: float, y):
    return _dropout(x, key.reshape(1), cupy.uint32(threshold), cupy.float32(scale), y)


def optimizer_fits(*arrays) -> bool:
    """The optimizer kernels take C-contiguous float32 or float64 arrays of one dtype."""
    return len({a.dtype for a in arrays}) == 1 and all(a.dtype.name in ("float32", "float64")
                                                        and a.flags.c_contiguous for a in arrays)


def sgd(p, g, lr, keep, weight_decay: float, momentum: float, nesterov: bool, buf=None):
    t = p.dtype.type
    if buf is None:
        return _sgd(g, lr.reshape(1), keep.reshape(1), t(weight_decay), p)
    return _sgd_momentum(g, lr.reshape(1), keep.reshape(1), t(weight_decay), t(momentum), int(nesterov), p, buf)


def adam(p, g, m, v, lr, step, keep, weight_decay: float, decoupled: bool, betas, eps: float):
    t = p.dtype.type
    beta1, beta2 = betas
    return _adam(g, lr.reshape(1), step.reshape(1), keep.reshape(1), t(weight_decay), int(decoupled), t(beta1),
                 t(1 - beta1), t(beta2), t(1 - beta2), t(eps), p, m, v)


def global_norm(g):
    return _global_norm(g)


FAST_TYPES = ("float32",) + HALF_TYPES


def fits(*arrays) -> bool:
    """These kernels take C-contiguous float32, float16 or bfloat16 arrays."""
    return all(a.dtype.name in FAST_TYPES and a.flags.c_contiguous for a in arrays)


def im2col(x, attrs, cols):
    """kernels.im2col without the padded copy: x [N, C, H, W] -> cols [C, KH, KW, N, OH, OW]."""
    n, c, h, w = x.shape
    oh, ow = cols.shape[4:]
    (kh, kw), (sh, sw), (ph, pw), (dh, dw) = attrs["kernel_size"], attrs["stride"], attrs["padding"], attrs["dilation"]
    return _im2col(x, n, c, h, w, oh, ow, kh, kw, sh, sw, ph, pw, dh, dw, cols)


def col2im(cols, attrs, dx):
    """train/kernels.col2im in one launch (a gather: no atomics): cols [C, KH, KW, N, OH, OW] -> dx [N, C, H, W]."""
    n, c, h, w = dx.shape
    oh, ow = cols.shape[4:]
    (kh, kw), (sh, sw), (ph, pw), (dh, dw) = attrs["kernel_size"], attrs["stride"], attrs["padding"], attrs["dilation"]
    return _col2im(cols, n, c, h, w, oh, ow, kh, kw, sh, sw, ph, pw, dh, dw, dx)


def _pool_geometry(x, out, attrs):
    (kh, kw), (sh, sw), (ph, pw) = attrs["kernel_size"], attrs["stride"], attrs["padding"]
    return x.shape[2], x.shape[3], out.shape[2], out.shape[3], kh, kw, sh, sw, ph, pw


def maxpool2d(x, attrs, out, argmax=None):
    """kernels.maxpool2d_forward in one launch: x [N, C, H, W] -> out [N, C, OH, OW] (and the winning
    kernel offset per output into `argmax`, for the trainer's backward)."""
    if argmax is None:
        return _maxpool2d(x, *_pool_geometry(x, out, attrs), out)
    _maxpool2d_argmax(x, *_pool_geometry(x, out, attrs), out, argmax)
    return out


def global_avg_pool_backward(dy, x, relu_mask: bool, dx):
    """train/kernels.global_avg_pool_backward in one launch: dx [N, C, ...] = dy [N, C] / positions, 0 where
    relu_mask and x <= 0."""
    positions = dx.size // max(1, dy.size)
    return _global_avg_pool_backward(dy, x, positions, int(relu_mask), 1.0 / positions, dx)


def maxpool2d_backward(dy, argmax, y, relu_mask: bool, attrs, dx):
    """train/kernels.maxpool2d_backward in one launch (no atomics); relu_mask drops dy where y <= 0."""
    geometry = _pool_geometry(dx, dy, attrs)
    height, width, out_h, out_w, kh, kw, sh, sw, ph, pw = geometry
    if (sh, sw) == (kh, kw) and (ph, pw) == (0, 0) and height == out_h * kh and width == out_w * kw:
        _maxpool2d_backward_tiled(dy, argmax, y, int(relu_mask), height, width, out_h, out_w, kh, kw, dx)
        return dx
    return _maxpool2d_backward(dy, argmax, y, int(relu_mask), *geometry, dx)
