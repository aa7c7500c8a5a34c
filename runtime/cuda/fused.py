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
channel_affine: batch norm's y = x * scale[c] + shift[c]; batchnorm_input_gradient: its dx;
    batchnorm_statistics / batchnorm_gradient_sums: its per-channel bookkeeping around them.
lstm_cell_forward / lstm_cell_backward: one lstm time step's gate arithmetic over [N, H] (runtime/cuda/recurrent.py
    holds the step loop, its GEMMs and the reference arithmetic these replace on the GPU).
The window, im2col and batch-norm kernels take float32, float16 or bfloat16 (amp), computing in float32 (CuPy's
own element-wise kernels take bfloat16 as CuPy 14's `bfloat16` type, the raw ones as float16.py's lnn_bf16); the
trainer's kernels (train/kernels.py) call them on CuPy when `fits`, so training and inference share them.
`i` and `n` are reserved names in ElementwiseKernel bodies. Importing this module imports CuPy; the
kernels compile on first use (CuPy caches them on disk).
"""

from __future__ import annotations

import cupy

from lnn.runtime.cuda.float16 import CONVERSIONS, HALF_TYPES, c_type

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

_WINDOW_MAX = r"""
// The max over one pooling window of plane `plane` and the kernel offset that won (the first on ties);
// cells outside the image are -inf, as the reference's padding.
template <typename T>
__device__ float lnn_window_max(const T* x, long long i, int height, int width, int out_h, int out_w,
                                int kernel_h, int kernel_w, int stride_h, int stride_w, int pad_h, int pad_w,
                                int* winner) {
    const int ow = (int)(i % out_w);
    const int oh = (int)((i / out_w) % out_h);
    const T* plane = x + (i / out_w / out_h) * (long long)height * width;
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
_maxpool2d_backward = cupy.ElementwiseKernel(
    "raw T dy, raw I argmax, raw T y, int32 relu_mask, int32 tiled, " + _POOL_ARGS, "T dx",
    "const int w = (int)(i % width);"
    "const int h = (int)((i / width) % height);"
    "const long long plane = (i / width / height) * (long long)out_h * out_w;"
    "float sum = 0.0f;"
    "if (tiled) {"          # kernel == stride, no padding, windows tile the image: one window per cell
    "    const int oh = h / kernel_h, ow = w / kernel_w;"
    "    const long long o = plane + (long long)oh * out_w + ow;"
    "    const bool wins = (int)argmax[o] == (h - oh * kernel_h) * kernel_w + (w - ow * kernel_w);"
    "    if (wins && (!relu_mask || (float)y[o] > 0.0f)) sum = (float)dy[o];"
    "} else {"
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
    "}"
    "dx = (T)sum;",
    "lnn_maxpool2d_backward")

# Batch norm's per-channel passes over x [N, C, P] (float32, or float16 or bfloat16 as its bits; float32 arithmetic), 16 bytes
# per load where P is a multiple of the vector and the arrays are 16-byte aligned (CuPy's own float16
# element-wise kernels ran these at a fifth of the card's bandwidth):
#   lnn_channel_affine:           y = act(x * scale[c] + shift[c]), act none or relu (batch norm's affine)
#   lnn_batchnorm_input_gradient: dx = k[c] * (dy - mean_dy[c] - x_hat * mean_dy_xhat[c]),
#                                 x_hat = (x - mean[c]) * inv_std[c]
_CHANNEL_SOURCE = CONVERSIONS + r"""
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
        const int c = (int)(g * VEC / positions % channels);
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
        const int c = (int)(g * VEC / positions % channels);
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

# lstm, one time step, element (row, j) of [N, H]; gates [N, 4H] in blocks i, f, g, o; sigmoid as 0.5 + 0.5 tanh(a / 2).
# forward: a = gates + hw (hw = h_prev @ W_hh^T; both 0 on a direction's first step) -> gates = the activated
#   i, f, g, o (saved for the backward); c = i g + f c_prev; h = o tanh(c)
_lstm_cell_forward = cupy.ElementwiseKernel(
    "raw T hw, raw T c_prev, int64 hidden, int32 first", "raw T gates, T c, T h",
    "const long long base = (i / hidden) * 4 * hidden + i % hidden;"
    "float a[4];"
    "for (int k = 0; k < 4; ++k) a[k] = (float)gates[base + k * hidden] + (first ? 0.0f : (float)hw[base + k * hidden]);"
    "const float in_gate = 0.5f + 0.5f * tanhf(0.5f * a[0]), forget = 0.5f + 0.5f * tanhf(0.5f * a[1]);"
    "const float cand = tanhf(a[2]), out_gate = 0.5f + 0.5f * tanhf(0.5f * a[3]);"
    "gates[base] = (T)in_gate; gates[base + hidden] = (T)forget;"
    "gates[base + 2 * hidden] = (T)cand; gates[base + 3 * hidden] = (T)out_gate;"
    "const float cell = in_gate * cand + (first ? 0.0f : forget * (float)c_prev[i]);"
    "c = (T)cell; h = (T)(out_gate * tanhf(cell));",
    "lnn_lstm_cell_forward")

# backward: dh (this step's total), dc carried from the step after -> dgates (pre-activation) and dc for the
# step before: dc += dh o (1 - tanh(c)^2); da_i = dc g i (1 - i); da_f = dc c_prev f (1 - f) (0 on the first
# step); da_g = dc i (1 - g^2); da_o = dh tanh(c) o (1 - o); dc = dc f
_lstm_cell_backward = cupy.ElementwiseKernel(
    "raw T gates, T c, raw T c_prev, T dh, int64 hidden, int32 first", "T dc, raw T dgates",
    "const long long base = (i / hidden) * 4 * hidden + i % hidden;"
    "const float in_gate = (float)gates[base], forget = (float)gates[base + hidden];"
    "const float cand = (float)gates[base + 2 * hidden], out_gate = (float)gates[base + 3 * hidden];"
    "const float tc = tanhf((float)c), grad_h = (float)dh;"
    "const float grad_c = (float)dc + grad_h * out_gate * (1.0f - tc * tc);"
    "dgates[base] = (T)(grad_c * cand * in_gate * (1.0f - in_gate));"
    "dgates[base + hidden] = first ? (T)0.0f : (T)(grad_c * (float)c_prev[i] * forget * (1.0f - forget));"
    "dgates[base + 2 * hidden] = (T)(grad_c * in_gate * (1.0f - cand * cand));"
    "dgates[base + 3 * hidden] = (T)(grad_h * tc * out_gate * (1.0f - out_gate));"
    "dc = (T)(grad_c * forget);",
    "lnn_lstm_cell_backward")


def lstm_cell_forward(gates, hw, c_prev, c, h):
    """gates [N, 4H] (input-side pre-activations, biases added) and hw [N, 4H] -> the activated gates in
    place, c and h [N, H]; c_prev None on a direction's first step (hw is then not read)."""
    first = c_prev is None
    return _lstm_cell_forward(hw, c if first else c_prev, c.shape[1], int(first), gates, c, h)


def lstm_cell_backward(gates, c, c_prev, dh, dc, dgates):
    """The step's activated gates, c and c_prev (None on the first step), dh -> dgates [N, 4H]; dc [N, H]
    carried in place."""
    first = c_prev is None
    return _lstm_cell_backward(gates, c, c if first else c_prev, dh, c.shape[1], int(first), dc, dgates)


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


def maxpool2d_backward(dy, argmax, y, relu_mask: bool, attrs, dx):
    """train/kernels.maxpool2d_backward in one launch (a gather: no atomics); relu_mask drops dy where y <= 0."""
    geometry = _pool_geometry(dx, dy, attrs)
    height, width, out_h, out_w, kh, kw, sh, sw, ph, pw = geometry
    tiled = (sh, sw) == (kh, kw) and (ph, pw) == (0, 0) and height == out_h * kh and width == out_w * kw
    return _maxpool2d_backward(dy, argmax, y, int(relu_mask), int(tiled), *geometry, dx)
