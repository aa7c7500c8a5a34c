"""Forward kernels shared by GPU inference (runtime/cuda) and the trainer (train/kernels.py adds the backward;
lstm and gru have both halves in recurrent.py).

Every function takes the array namespace `xp` (numpy or cupy) first and uses only functions both
provide, so the same code runs on the CPU and the GPU (and is tested on NumPy where there is no GPU).
Every GEMM goes through blas.matmul (np.matmul, or cuBLAS in a form CUDA-graph capture accepts).
runtime/cuda/fused.py holds CuPy-only kernels that replace some of these on the GPU (same results).

Conventions (PyTorch's, and formats/ops.py's reference forward, which these must reproduce):
  images are NCHW, flat data NC; linear weight [O, I] with y = x @ W.T + b;
  conv weight [O, I/groups, KH, KW]; batch norm y = (x - mean) / sqrt(var + eps) * w + b.
Contract: `*_forward(xp, x, ..., out)` writes the result into the pre-allocated `out` and returns it.
Window ops (conv im2col, pools) loop over the KH*KW kernel offsets and move one strided slice per
offset: no as_strided, and the same code on numpy and cupy.
"""

from __future__ import annotations

import numpy as np

from lnn.runtime.cuda.blas import matmul

def gpu_kernels(xp, *arrays):
    """runtime/cuda/fused.py (one launch per op) when xp is CuPy and its kernels take these arrays
    (C-contiguous float32, float16 or bfloat16), else None: the generic code below runs."""
    if xp is np:
        return None
    from lnn.runtime.cuda import fused

    return fused if fused.fits(*arrays) else None


def sum_dtype(x):
    """The dtype to sum x in: float32 for bfloat16 (CuPy sums float16 in float32 by itself, but may sum bfloat16
    in bfloat16, whose 8-bit mantissa stalls a long sum), else None: x's own."""
    return np.float32 if x.dtype.name == "bfloat16" else None


# --------------------------------------------------------------------------- window helpers


def offset_slice(offset: int, dilation: int, stride: int, count: int) -> slice:
    """Rows (or columns) of the padded input that kernel offset `offset` reads for `count` outputs."""
    start = offset * dilation
    return slice(start, start + stride * (count - 1) + 1, stride)


def window_slices(attrs: dict, out_hw: tuple):
    """Yield (k, kh_index, kw_index, row slice, column slice) for every kernel offset."""
    kh, kw = attrs["kernel_size"]
    sh, sw = attrs["stride"]
    dh, dw = attrs.get("dilation", (1, 1))
    oh, ow = out_hw
    for i in range(kh):
        for j in range(kw):
            yield i * kw + j, i, j, offset_slice(i, dh, sh, oh), offset_slice(j, dw, sw, ow)


def pad_into(xp, x, padding: tuple, value, padded):
    """Copy x [N, C, H, W] into the middle of `padded` [N, C, H+2ph, W+2pw], border = value."""
    ph, pw = padding
    if ph == 0 and pw == 0:
        return x
    padded.fill(value)
    padded[:, :, ph:ph + x.shape[2], pw:pw + x.shape[3]] = x
    return padded


def per_channel(values, x):
    """A per-channel vector [C] shaped to broadcast against x [N, C] or [N, C, H, W]."""
    return values.reshape((1, -1) + (1,) * (x.ndim - 2))


# --------------------------------------------------------------------------- activations
# y = f(x) element-wise (softmax: over axis 1, as the reference). `out` may be x (in place).

def activation_forward(xp, activation: dict, x, out):
    kind = activation["type"]
    fused = gpu_kernels(xp, x, out)
    if fused is not None and kind != "softmax":
        return fused.activation_forward(activation, x, out)            # one launch, no temporaries
    if kind == "relu":
        return xp.maximum(x, 0, out=out)
    if kind == "relu6":
        return xp.clip(x, 0, 6, out=out)
    if kind == "leaky_relu":
        slope = activation["negative_slope"]
        out[...] = xp.where(x >= 0, x, x * x.dtype.type(slope))
        return out
    if kind == "sigmoid":
        e = xp.exp(-xp.abs(x))
        out[...] = xp.where(x >= 0, 1 / (1 + e), e / (1 + e))
        return out
    if kind == "tanh":
        return xp.tanh(x, out=out)
    if kind == "softmax":
        shifted = x - x.max(axis=1, keepdims=True)
        xp.exp(shifted, out=out)
        out /= out.sum(axis=1, keepdims=True, dtype=sum_dtype(out))
        return out
    raise ValueError(f"unknown activation {kind!r}")


# --------------------------------------------------------------------------- linear
# x [N, I], weight [O, I], bias [O] -> y [N, O];  y = x @ W.T + b

def linear_forward(xp, x, weight, bias, out):
    matmul(xp, x, weight.T, out)
    if bias is not None:
        out += bias
    return out


# --------------------------------------------------------------------------- conv2d (im2col + GEMM)
# x [N, C, H, W], weight [O, C/g, KH, KW], bias [O] -> y [N, O, OH, OW].
# cols [C, KH, KW, N, OH, OW] holds every input window (batch folded into the GEMM's columns), so
# y[g] = W[g] (O/g x C/g*KH*KW) @ cols[g] (C/g*KH*KW x N*OH*OW): one GEMM per group, whole batch.
# Workspaces: `padded` [N, C, H+2ph, W+2pw] (None without padding), `cols`, `gemm_out` [O, N, OH, OW].

def im2col(xp, x, attrs, padded, cols):
    fused = gpu_kernels(xp, x, cols)
    if fused is not None:
        return fused.im2col(x, attrs, cols)
    source = pad_into(xp, x, attrs["padding"], 0, padded)
    for _, i, j, rows, columns in window_slices(attrs, cols.shape[4:]):
        cols[:, i, j] = source[:, :, rows, columns].transpose(1, 0, 2, 3)
    return cols


def grouped_weight(weight, groups):
    """[O, C/g, KH, KW] -> [g, O/g, C/g*KH*KW]."""
    return weight.reshape(groups, weight.shape[0] // groups, -1)


def conv2d_gemm(xp, weight, groups, cols, gemm_out):
    """gemm_out [O, N, OH, OW] = the grouped product of the weight with cols (no bias)."""
    columns = cols.reshape(groups, -1, cols[0, 0, 0].size)                 # [g, C/g*KH*KW, N*OH*OW]
    matmul(xp, grouped_weight(weight, groups), columns, gemm_out.reshape(groups, weight.shape[0] // groups, -1))
    return gemm_out


def conv2d_forward(xp, x, weight, bias, attrs, out, padded, cols, gemm_out):
    im2col(xp, x, attrs, padded, cols)
    conv2d_gemm(xp, weight, attrs["groups"], cols, gemm_out)
    out[...] = gemm_out.transpose(1, 0, 2, 3)
    if bias is not None:
        out += bias.reshape(1, -1, 1, 1)
    return out


# --------------------------------------------------------------------------- max pool
# x [N, C, H, W] -> y [N, C, OH, OW], padding counts as -inf. `argmax` [N, C, OH, OW] (uint8 or
# int32), when given, records which kernel offset won (the first on ties, as PyTorch) for the
# trainer's backward; inference passes None.

def maxpool2d_forward(xp, x, attrs, out, padded, argmax=None):
    fused = gpu_kernels(xp, x, out)
    if fused is not None:
        return fused.maxpool2d(x, attrs, out, argmax)
    source = pad_into(xp, x, attrs["padding"], -np.inf, padded)
    for k, _, _, rows, columns in window_slices(attrs, out.shape[2:]):
        window = source[:, :, rows, columns]
        if k == 0:
            out[...] = window
            if argmax is not None:
                argmax.fill(0)
            continue
        better = window > out
        xp.copyto(out, window, where=better)
        if argmax is not None:
            xp.copyto(argmax, xp.asarray(k, dtype=argmax.dtype), where=better)
    return out


# --------------------------------------------------------------------------- average pool
# x [N, C, H, W] -> y [N, C, OH, OW]; `divisor` is KH*KW (count_include_pad) or an [OH, OW] array
# of the real (unpadded) cells per window.

def avgpool_divisor(xp, attrs, in_hw: tuple, out_hw: tuple, dtype):
    kh, kw = attrs["kernel_size"]
    if attrs["count_include_pad"]:
        return dtype.type(kh * kw)
    ph, pw = attrs["padding"]
    ones = np.zeros((1, 1, in_hw[0] + 2 * ph, in_hw[1] + 2 * pw), dtype)
    ones[:, :, ph:ph + in_hw[0], pw:pw + in_hw[1]] = 1
    counts = np.zeros((1, 1) + tuple(out_hw), dtype)
    for _, _, _, rows, columns in window_slices(attrs, out_hw):
        counts += ones[:, :, rows, columns]
    return xp.asarray(counts)


def avgpool2d_forward(xp, x, attrs, divisor, out, padded):
    source = pad_into(xp, x, attrs["padding"], 0, padded)
    out.fill(0)
    for _, _, _, rows, columns in window_slices(attrs, out.shape[2:]):
        out += source[:, :, rows, columns]
    out /= divisor
    return out


# --------------------------------------------------------------------------- global average / max pool
# x [N, C, T] or [N, C, H, W] -> y [N, C] (or keepdims: [N, C, 1] / [N, C, 1, 1]). The max pool's `argmax`
# [N, C] (int32), when given, records which position won (the trainer's backward routes dy through it).

def global_avg_pool_forward(xp, x, out):
    out[...] = x.mean(axis=tuple(range(2, x.ndim)), dtype=sum_dtype(x)).reshape(out.shape)
    return out


def global_max_pool_forward(xp, x, out, argmax=None):
    rows = x.reshape(x.shape[0], x.shape[1], -1)
    out[...] = rows.max(axis=2).reshape(out.shape)
    if argmax is not None:
        argmax[...] = rows.argmax(axis=2)
    return out


# --------------------------------------------------------------------------- batch norm (inference)
# x [N, C] or [N, C, H, W]: y = x * scale + shift per channel, from the running statistics.
# (The training forward, with batch statistics, is the trainer's: train/kernels.py.)

def batchnorm_eval_forward(xp, x, weight, bias, running_mean, running_var, attrs, out, relu: bool = False):
    scale = weight / xp.sqrt(running_var + attrs["eps"])
    return channel_affine(xp, x, scale, bias - running_mean * scale, out, relu)


def channel_affine(xp, x, scale, shift, out, relu: bool = False):
    """out = x * scale[c] + shift[c] for x [N, C] or [N, C, H, W], then max(out, 0) with relu."""
    fused = gpu_kernels(xp, x, out)
    if fused is not None:
        return fused.channel_affine(x, scale.astype(np.float32), shift.astype(np.float32),
                                    x.size // (x.shape[0] * x.shape[1]), x.shape[1], out, relu)
    out[...] = x * per_channel(scale.astype(x.dtype), x) + per_channel(shift.astype(x.dtype), x)
    if relu:
        xp.maximum(out, 0, out=out)
    return out


# --------------------------------------------------------------------------- layer norm
# x [N, ...] seen as rows [R, M] (M = prod(normalized_shape)): y = (x - mean) / sqrt(var + eps) * w + b per
# row, var biased; weight and bias [M] (None without elementwise_affine / bias). `saved` [2, R] (float32,
# float64 in a float64 plan), when given, keeps each row's mean and 1/sqrt(var + eps) for the trainer's
# backward. Statistics are computed in float32 even when x is float16.

def layernorm_forward(xp, x, weight, bias, eps: float, count: int, out, saved=None):
    rows = x.reshape(-1, count)
    stat_dtype = np.float64 if x.dtype == np.float64 else np.float32
    mean = rows.mean(axis=1, keepdims=True, dtype=stat_dtype)
    centered = rows - mean
    inv_std = 1 / xp.sqrt((centered * centered).mean(axis=1, keepdims=True) + eps)
    y = centered * inv_std
    if weight is not None:
        y = y * weight.reshape(1, -1)
    if bias is not None:
        y = y + bias.reshape(1, -1)
    out.reshape(-1, count)[...] = y
    if saved is not None:
        saved[0] = mean[:, 0]
        saved[1] = inv_std[:, 0]
