"""Backward kernels of every op, beside the forward kernels they pair with (llm.c style, no autograd).

The forward kernels inference needs live in runtime/cuda/kernels.py (GPU inference and training share
one forward) and are imported here, so `K.<op>_forward` and `K.<op>_backward` sit side by side in this
namespace; the training-only forwards (batch norm with batch statistics, dropout, the losses) are here.
lstm and gru keep their forward and backward together in runtime/cuda/recurrent.py.
Every function takes the array namespace `xp` (numpy or cupy) first and uses only functions both
provide, so the same code runs on the CPU and the GPU.

Conventions (PyTorch's, and formats/ops.py's reference forward, which these must reproduce):
  images are NCHW, flat data NC; linear weight [O, I] with y = x @ W.T + b;
  conv weight [O, I/groups, KH, KW]; batch norm y = (x - mean) / sqrt(var + eps) * w + b.
Contract:
  `*_forward(xp, x, ..., out)` writes the result into the pre-allocated `out` and returns it.
  `*_backward(xp, dy, ...)` ADDS parameter gradients into the gradient views it is given (so
  gradient accumulation over micro-batches is free) and WRITES the input gradient into `dx`;
  `dx=None` skips it (nothing before the layer learns).
Window ops (col2im, pool backwards) loop over the KH*KW kernel offsets and move one strided slice
per offset: no np.add.at, no as_strided, and the same code on numpy and cupy.
"""

from __future__ import annotations

import math

import numpy as np

from lnn.runtime.cuda.blas import matmul
from lnn.runtime.cuda.kernels import (  # noqa: F401 - the forward half of each pair, used as K.*_forward
    activation_forward, avgpool2d_forward, avgpool_divisor, batchnorm_eval_forward, channel_affine, conv2d_forward,
    global_avg_pool_forward, global_max_pool_forward, gpu_kernels, grouped_weight, im2col,
    layernorm_forward, linear_forward, maxpool2d_forward, per_channel, sum_dtype, window_slices)

# --------------------------------------------------------------------------- window helpers

def unpad_into(xp, padded, padding: tuple, dx):
    """The middle of `padded` -> dx (the inverse of pad_into for gradients)."""
    ph, pw = padding
    dx[...] = padded[:, :, ph:ph + dx.shape[2], pw:pw + dx.shape[3]]
    return dx


# --------------------------------------------------------------------------- activations
# y = f(x) element-wise (softmax: over axis 1). Backward works from the OUTPUT y, so the
# activation can run in place on the layer's output buffer. leaky_relu needs negative_slope >= 0
# for that (the plan refuses a negative slope).

def activation_backward(xp, activation: dict, dy, y, dx):
    """dx = dL/dx from dy = dL/dy and the output y. dx may be dy itself (in place)."""
    kind = activation["type"]
    fused = gpu_kernels(xp, dy, y, dx)
    if fused is not None and kind != "softmax":
        return fused.activation_backward(activation, dy, y, dx)          # one launch, no mask array
    if kind == "relu":
        return xp.multiply(dy, y > 0, out=dx)
    if kind == "relu6":
        return xp.multiply(dy, (y > 0) & (y < 6), out=dx)
    if kind == "leaky_relu":
        slope = y.dtype.type(activation["negative_slope"])
        dx[...] = xp.where(y > 0, dy, dy * slope)
        return dx
    if kind == "sigmoid":
        dx[...] = dy * y * (1 - y)
        return dx
    if kind == "tanh":
        dx[...] = dy * (1 - y * y)
        return dx
    if kind == "softmax":
        dx[...] = y * (dy - (dy * y).sum(axis=1, keepdims=True, dtype=sum_dtype(y)))
        return dx
    raise ValueError(f"unknown activation {kind!r}")


# --------------------------------------------------------------------------- linear
# x [N, I], weight [O, I], bias [O] -> y [N, O];  y = x @ W.T + b

def linear_backward(xp, dy, x, weight, dweight, dbias, dx):
    matmul(xp, dy.T, x, dweight, accumulate=True)
    if dbias is not None:
        dbias += dy.sum(axis=0, dtype=sum_dtype(dy))
    if dx is not None:
        matmul(xp, dy, weight, dx)
    return dx


# --------------------------------------------------------------------------- conv2d (im2col + GEMM)
# x [N, C, H, W], weight [O, C/g, KH, KW], bias [O] -> y [N, O, OH, OW].
# cols [C, KH, KW, N, OH, OW] holds every input window (batch folded into the GEMM's columns), so
# y[g] = W[g] (O/g x C/g*KH*KW) @ cols[g] (C/g*KH*KW x N*OH*OW): one GEMM per group, whole batch.
# Workspaces: `padded` [N, C, H+2ph, W+2pw] (None without padding), `cols`, `gemm_out` [O, N, OH, OW].
# The backward recomputes cols from x (cheaper in memory than keeping them) and reuses `cols` for
# d(cols), then scatters it back (col2im) with one strided add per kernel offset.

def col2im(xp, cols, attrs, padded, dx):
    fused = gpu_kernels(xp, cols, dx)
    if fused is not None:
        return fused.col2im(cols, attrs, dx)
    target = padded if padded is not None else dx
    target.fill(0)
    for _, i, j, rows, columns in window_slices(attrs, cols.shape[4:]):
        target[:, :, rows, columns] += cols[:, i, j].transpose(1, 0, 2, 3)
    if padded is not None:
        unpad_into(xp, padded, attrs["padding"], dx)
    return dx


def conv2d_backward(xp, dy, x, weight, attrs, dweight, dbias, dx, padded, cols, gemm_out):
    groups = attrs["groups"]
    o = dy.shape[1]
    gemm_out[...] = dy.transpose(1, 0, 2, 3)                               # dy as [O, N, OH, OW]
    dy_grouped = gemm_out.reshape(groups, o // groups, -1)                 # [g, O/g, N*OH*OW]
    if dbias is not None:
        dbias += gemm_out.reshape(o, -1).sum(axis=1, dtype=sum_dtype(gemm_out))
    im2col(xp, x, attrs, padded, cols)
    columns = cols.reshape(groups, -1, cols[0, 0, 0].size)
    matmul(xp, dy_grouped, columns.transpose(0, 2, 1), dweight.reshape(dy_grouped.shape[:2] + (-1,)), accumulate=True)
    if dx is not None:
        matmul(xp, grouped_weight(weight, groups).transpose(0, 2, 1), dy_grouped, columns)     # d(cols)
        col2im(xp, cols, attrs, padded, dx)
    return dx


# --------------------------------------------------------------------------- max pool
# x [N, C, H, W] -> y [N, C, OH, OW], padding counts as -inf. `argmax` [N, C, OH, OW] (uint8 or
# int32) records which kernel offset won (the first on ties, as PyTorch): the forward writes it
# (runtime/cuda/kernels.py), the backward routes dy through it.

def maxpool2d_backward(xp, dy, attrs, argmax, dx, padded, relu_output=None):
    """relu_output: the pool's output y when the relu before the pool is undone here (dy counts where y > 0)."""
    fused = gpu_kernels(xp, dy, dx)
    if fused is not None:
        return fused.maxpool2d_backward(dy, argmax, dy if relu_output is None else relu_output,
                                        relu_output is not None, attrs, dx)
    if relu_output is not None:
        dy = dy * (relu_output > 0)
    target = padded if padded is not None else dx
    target.fill(0)
    for k, _, _, rows, columns in window_slices(attrs, dy.shape[2:]):
        target[:, :, rows, columns] += dy * (argmax == k)
    if padded is not None:
        unpad_into(xp, padded, attrs["padding"], dx)
    return dx


# --------------------------------------------------------------------------- average pool
# x [N, C, H, W] -> y [N, C, OH, OW]; `divisor` is KH*KW (count_include_pad) or an [OH, OW] array
# of the real (unpadded) cells per window.

def avgpool2d_backward(xp, dy, attrs, divisor, dx, padded):
    target = padded if padded is not None else dx
    target.fill(0)
    share = dy / divisor
    for _, _, _, rows, columns in window_slices(attrs, dy.shape[2:]):
        target[:, :, rows, columns] += share
    if padded is not None:
        unpad_into(xp, padded, attrs["padding"], dx)
    return dx


# --------------------------------------------------------------------------- global average / max pool
# x [N, C, T] or [N, C, H, W] -> y [N, C] (or keepdims). Average: dx = dy / P everywhere (P = T or H*W).
# Max: dx = dy at the saved winning position of each row, 0 elsewhere; `positions` is 0..P-1 (int32).

def global_avg_pool_backward(xp, dy, dx, relu_input=None):
    """relu_input: the pool's input x when the relu before the pool is undone here (dx is 0 where x <= 0)."""
    fused = gpu_kernels(xp, dy, dx, *([] if relu_input is None else [relu_input]))
    if fused is not None:
        return fused.global_avg_pool_backward(dy, dx if relu_input is None else relu_input, relu_input is not None, dx)
    n, c = dx.shape[:2]
    rows = dx.reshape(n, c, -1)
    rows[...] = dy.reshape(n, c, 1) / dx.dtype.type(rows.shape[2])
    if relu_input is not None:
        xp.multiply(dx, relu_input > 0, out=dx)
    return dx


def global_max_pool_backward(xp, dy, argmax, positions, dx):
    n, c = dx.shape[:2]
    xp.multiply(positions == argmax.reshape(n, c, 1), dy.reshape(n, c, 1), out=dx.reshape(n, c, -1))
    return dx


# --------------------------------------------------------------------------- batch norm
# x [N, C], [N, C, T] or [N, C, H, W]; statistics per channel over N (and T or H, W), m values each.
# Training: y = (x - mean) / sqrt(var + eps) * w + b with the batch's biased var; the running
# statistics move by `momentum` towards the batch's mean and UNBIASED var (PyTorch semantics).
# `saved` [2, C] float32 keeps mean and 1/sqrt(var + eps) for the backward, which recomputes
# x_hat from x. Statistics are computed in float32 even when x is float16 or bfloat16.

def _channel_axes(x):
    return (0,) + tuple(range(2, x.ndim))


def channel_sums(xp, a, b, shift_a, shift_b):
    """Per channel c of a, b [N, C] or [N, C, H, W]: s1[c] = sum a[:, c] and s2[c] = sum (a[:, c] - shift_a[c])
    * (b[:, c] - shift_b[c]), in float32 (float64 for float64 inputs). On CuPy, float32, float16 and bfloat16 run as
    runtime/cuda/reduce.py's two-pass kernel (CuPy's own reduction over axes 0, 2, 3 is 50x slower)."""
    if xp is not np:
        from lnn.runtime.cuda import reduce

        if reduce.supported(a) and reduce.supported(b):
            return reduce.channel_sums(a, b, shift_a.astype(np.float32), shift_b.astype(np.float32))
    axes = _channel_axes(a)
    stat_dtype = np.float64 if a.dtype == np.float64 else np.float32
    s1 = a.sum(axis=axes, dtype=stat_dtype)
    s2 = ((a.astype(stat_dtype) - per_channel(shift_a, a)) * (b.astype(stat_dtype) - per_channel(shift_b, b))).sum(axis=axes)
    return s1, s2


def batchnorm_train_forward(xp, x, weight, bias, running_mean, running_var, attrs, out, saved, relu: bool = False):
    stat_dtype = np.float64 if x.dtype == np.float64 else np.float32
    count = x.size // x.shape[1]
    zeros = xp.zeros(x.shape[1], stat_dtype)
    total, _ = channel_sums(xp, x, x, zeros, zeros)
    mean = total / count
    _, squares = channel_sums(xp, x, x, mean, mean)
    fused = gpu_kernels(xp, x, out, weight, bias, running_mean, running_var, saved)
    if fused is not None and saved.dtype == np.float32:
        scale, shift = xp.empty_like(mean), xp.empty_like(mean)
        fused.batchnorm_statistics(mean, squares, weight, bias, count, attrs["eps"], attrs["momentum"],
                                   saved[0], saved[1], running_mean, running_var, scale, shift)
        return channel_affine(xp, x, scale, shift, out, relu)
    var = squares / count
    inv_std = 1 / xp.sqrt(var + attrs["eps"])
    saved[0] = mean
    saved[1] = inv_std
    momentum = attrs["momentum"]
    running_mean *= 1 - momentum
    running_mean += momentum * mean
    running_var *= 1 - momentum
    running_var += (momentum * count / max(count - 1, 1)) * var
    return channel_affine(xp, x, weight * inv_std, bias - mean * weight * inv_std, out, relu)


def batchnorm_backward(xp, dy, x, weight, saved, dweight, dbias, dx):
    mean, inv_std = saved[0], saved[1]
    sum_dy, sum_dy_centered = channel_sums(xp, dy, x, xp.zeros_like(mean), mean)
    count = x.size // x.shape[1]
    fused = gpu_kernels(xp, dy, x, weight, saved, dweight, dbias, *([] if dx is None else [dx]))
    if fused is not None and saved.dtype == np.float32:
        k, mean_dy, mean_dy_xhat = (xp.empty_like(mean) for _ in range(3))
        fused.batchnorm_gradient_sums(sum_dy, sum_dy_centered, inv_std, weight, count, dweight, dbias,
                                      k, mean_dy, mean_dy_xhat)
        if dx is not None:
            fused.batchnorm_input_gradient(dy, x, mean, inv_std, k, mean_dy, mean_dy_xhat,
                                           x.size // (x.shape[0] * x.shape[1]), x.shape[1], dx)
        return dx
    sum_dy_xhat = sum_dy_centered * inv_std
    dweight += sum_dy_xhat.astype(dweight.dtype)
    dbias += sum_dy.astype(dbias.dtype)
    if dx is not None:
        # dx = w * inv_std / m * (m * dy - sum(dy) - x_hat * sum(dy * x_hat)),  x_hat = (x - mean) * inv_std
        k = weight * inv_std
        x_hat = (x - per_channel(mean, x).astype(x.dtype)) * per_channel(inv_std, x).astype(x.dtype)
        dx[...] = (per_channel(k, x) * (dy - per_channel(sum_dy / count, x)
                                        - x_hat * per_channel(sum_dy_xhat / count, x))).astype(dx.dtype)
    return dx


# --------------------------------------------------------------------------- layer norm
# Rows [R, M] as the forward (runtime/cuda/kernels.py layernorm_forward, which saved each row's mean and
# 1/sqrt(var + eps)); x_hat is recomputed from x. With g = dy * w (dy without affine):
#   dw += sum over rows of dy * x_hat,  db += sum over rows of dy,
#   dx = inv_std * (g - mean_M(g) - x_hat * mean_M(g * x_hat)).

def layernorm_backward(xp, dy, x, weight, saved, count: int, dweight, dbias, dx):
    rows, grads = x.reshape(-1, count), dy.reshape(-1, count)
    mean, inv_std = saved[0].reshape(-1, 1), saved[1].reshape(-1, 1)
    x_hat = (rows - mean) * inv_std
    if dweight is not None:
        dweight += (grads * x_hat).sum(axis=0).reshape(dweight.shape).astype(dweight.dtype)
    if dbias is not None:
        dbias += grads.sum(axis=0, dtype=sum_dtype(grads)).reshape(dbias.shape).astype(dbias.dtype)
    if dx is not None:
        g = grads * weight.reshape(1, -1) if weight is not None else grads
        dx.reshape(-1, count)[...] = inv_std * (g - g.mean(axis=1, keepdims=True, dtype=sum_dtype(g))
                                                - x_hat * (g * x_hat).mean(axis=1, keepdims=True))
    return dx


# --------------------------------------------------------------------------- dropout
# Training: y = x * keep / (1 - p), keep ~ Bernoulli(1 - p). The mask comes from a counter-based
# hash of (key, element index), so it is the same on numpy and cupy, needs no stored mask (the
# backward recomputes it) and its whole RNG state is the key the trainer derives from its seed
# and a call counter.

def _hash32(xp, h):
    """lowbias32 (C. Wellons): a well-mixing bijection on uint32, in place on h."""
    h ^= h >> xp.uint32(16)
    h *= xp.uint32(0x7FEB352D)
    h ^= h >> xp.uint32(15)
    h *= xp.uint32(0x846CA68B)
    h ^= h >> xp.uint32(16)
    return h


def _dropout_threshold(p: float) -> int:
    return min(int(p * 2.0 ** 32), 2 ** 32 - 1)


def _uint32_key(xp, key):
    return xp.asarray(key & 0xFFFFFFFF, np.uint32) if isinstance(key, int) else key


def dropout_keep_mask(xp, shape, p: float, key, index):
    """Boolean mask of `shape`; `index` is a preallocated uint32 arange of at least prod(shape); `key` a
    uint32 0-d array (a device array in the trainer: the step reads it, so a captured step replays
    with each step's key) or an int."""
    h = index[:math.prod(shape)] + _uint32_key(xp, key)
    return (_hash32(xp, h) >= xp.uint32(_dropout_threshold(p))).reshape(shape)


def _dropout(xp, x, p: float, key, index, out):
    """out = x * keep / (1 - p): the forward on x, the backward on dy (the same mask)."""
    scale = x.dtype.type(1 / (1 - p))
    fused = gpu_kernels(xp, x, out)
    if fused is not None:                           # one launch: no hash buffer, no mask
        return fused.dropout(x, _uint32_key(xp, key), _dropout_threshold(p), float(scale), out)
    index = xp.arange(x.size, dtype=np.uint32) if index is None else index     # None: a GPU plan (no index buffer)
    xp.multiply(x, dropout_keep_mask(xp, x.shape, p, key, index), out=out)
    out *= scale
    return out


def dropout_forward(xp, x, p: float, key, index, out):
    return _dropout(xp, x, p, key, index, out)


def dropout_backward(xp, dy, p: float, key, index, dx):
    return _dropout(xp, dy, p, key, index, dx)


# --------------------------------------------------------------------------- losses
# Cross-entropy over logits [N, K] with integer labels [N]: one fused, numerically stable
# softmax + CE (log-sum-exp with the max subtracted). d(logits) = (softmax - onehot) * scale,
# where scale = (loss scale) / (rows in the whole optimizer step): mean over the batch, and the
# same update for k accumulated micro-batches as for one k-times larger batch.
# Outlier exposure (Hendrycks et al. 2019): a row labelled -1 (any negative label) has the uniform
# posterior as its target: loss outlier_weight * mean_k(-log softmax_k) = outlier_weight * (lse -
# mean_k z_k), gradient (softmax - 1/K) * outlier_weight * scale. The returned loss sum is in the
# units of `scale` (objective = loss_sum * scale); such rows are never counted correct.
# Computed in float32 (float64 in a float64 plan) whatever the logits' dtype.

def _per_row_loss(xp, z, lse, labels, outlier_weight: float):
    outlier = labels < 0
    safe = labels * ~outlier                      # any valid index for outlier rows (arrays only: CuPy too)
    picked = xp.take_along_axis(z, safe.reshape(-1, 1), axis=1)[:, 0]
    return xp.where(outlier, outlier_weight * (lse - z.mean(axis=1)), lse - picked), outlier, safe


def softmax_cross_entropy_forward(xp, logits, labels, outlier_weight: float = 0.0):
    """-> (sum of per-row losses, number of rows whose argmax is the label), both 0-d arrays."""
    z = logits.astype(np.float64 if logits.dtype == np.float64 else np.float32)
    top = z.max(axis=1, keepdims=True)
    lse = xp.log(xp.exp(z - top).sum(axis=1)) + top[:, 0]
    losses, _, _ = _per_row_loss(xp, z, lse, labels, outlier_weight)
    correct = (z.argmax(axis=1) == labels).sum()
    return losses.sum(), correct


def softmax_cross_entropy_forward_backward(xp, logits, labels, scale: float, dlogits, outlier_weight: float = 0.0):
    z = logits.astype(np.float64 if logits.dtype == np.float64 else np.float32)
    top = z.max(axis=1, keepdims=True)
    e = xp.exp(z - top)
    total = e.sum(axis=1, keepdims=True)
    lse = xp.log(total[:, 0]) + top[:, 0]
    losses, outlier, safe = _per_row_loss(xp, z, lse, labels, outlier_weight)
    correct = (z.argmax(axis=1) == labels).sum()
    e /= total                                   # softmax
    e[xp.arange(z.shape[0]), safe] -= (~outlier).astype(e.dtype)
    e -= outlier.astype(e.dtype)[:, None] * e.dtype.type(1 / z.shape[1])
    e *= ((outlier * (outlier_weight - 1) + 1) * scale).astype(e.dtype)[:, None]       # per row: scale, or weight * scale
    dlogits[...] = e
    return losses.sum(), correct


# Mean squared error over predictions [N, ...] and targets of the same shape, mean over every
# element (PyTorch's reduction="mean"): d(pred) = 2 (pred - target) * scale, scale = (loss scale)
# / (elements in the whole optimizer step).

def mse_forward(xp, pred, target):
    diff = pred.astype(np.float64 if pred.dtype == np.float64 else np.float32) - target
    return (diff * diff).sum()


def mse_forward_backward(xp, pred, target, scale: float, dpred):
    diff = pred.astype(np.float64 if pred.dtype == np.float64 else np.float32) - target
    dpred[...] = diff * (2 * scale)
    return (diff * diff).sum()
