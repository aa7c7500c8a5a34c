"""Pooling: maxpool2d, avgpool2d [N, C, H, W] -> [N, C, OH, OW]; maxpool1d, avgpool1d [N, C, T] -> [N, C, OT];
global_avg_pool, global_max_pool [N, C, T] or [N, C, H, W] -> [N, C] (keepdims: [N, C, 1] or [N, C, 1, 1]).

Reference: formats/ops.py MaxPool2d / AvgPool2d / MaxPool1d / AvgPool1d / GlobalAvgPool / GlobalMaxPool.forward.
  maxpool2d  max over the window (the input is padded with -inf, padding.py). A max-pool right after
             a conv with a monotone epilogue does not run here: the conv applies it (conv2d.py).
  avgpool2d  sum over the window (the input is padded with 0), divided by KH*KW (count_include_pad)
             or by the number of the window's cells inside the input (precomputed per output position).
  maxpool1d, avgpool1d  the 2-D layers above on [N, C, 1, T] views (formats/ops.py pool1d_as_2d); a
             max-pool after a conv1d runs inside it, as after a conv2d.
  global_avg_pool  mean over the positions (T, or H*W); global_max_pool their maximum.
"""

from __future__ import annotations

from functools import partial

import numpy as np

from lnn.formats.model import as_rows
from lnn.runtime.cpu.activations import as_channels_positions
from lnn.runtime.cpu.aot import A2, A3, A4, I
from lnn.runtime.cpu.jit import ieee_kernel, kernel
from lnn.runtime.cpu.padding import padded

# Each kernel's ahead-of-time signature (aot.py): the argument types the backend passes; None: called
# only by other kernels, compiled into them.
AOT_SIGNATURES = {
    "maxpool2d": (A4, I, I, I, I, A4),
    "avgpool2d": (A4, I, I, I, I, A2, A4),
    "global_avg_pool": (A3, A2),
    "global_max_pool": (A3, A2),
}


@kernel
def maxpool2d(src, kh, kw, sh, sw, dst):
    """src [N, C, H, W] (already padded with -inf) -> dst [N, C, OH, OW]."""
    batch, channels = src.shape[:2]
    out_h, out_w = dst.shape[2:]
    for n in range(batch):
        for c in range(channels):
            for oy in range(out_h):
                target = dst[n, c, oy]
                first = src[n, c, oy * sh]
                for ox in range(out_w):
                    target[ox] = first[ox * sw]
                for ky in range(kh):
                    source = src[n, c, oy * sh + ky]
                    for kx in range(kw):
                        for ox in range(out_w):
                            target[ox] = max(target[ox], source[ox * sw + kx])


@kernel
def avgpool2d(src, kh, kw, sh, sw, divisors, dst):
    """src [N, C, H, W] (already padded with 0) -> dst [N, C, OH, OW] = window sum / divisors [OH, OW]."""
    batch, channels = src.shape[:2]
    out_h, out_w = dst.shape[2:]
    for n in range(batch):
        for c in range(channels):
            for oy in range(out_h):
                target = dst[n, c, oy]
                target[:] = 0
                for ky in range(kh):
                    source = src[n, c, oy * sh + ky]
                    for kx in range(kw):
                        for ox in range(out_w):
                            target[ox] += source[ox * sw + kx]
                for ox in range(out_w):
                    target[ox] /= divisors[oy, ox]


def window_cells(size: int, kernel: int, stride: int, pad: int, out_size: int) -> np.ndarray:
    """How many cells of each output's window lie inside the unpadded input, along one axis."""
    starts = np.arange(out_size) * stride - pad
    return np.minimum(starts + kernel, size) - np.maximum(starts, 0)


@ieee_kernel
def global_avg_pool(src, dst):
    """src [N, C, P] -> dst [N, C]: the mean of each row, summed in float64 as 4 interleaved partial sums
    (positions p = 4i + j into sum j), so that 4 additions are in flight instead of one chain (leaf_cnn224's
    256 x 28 x 28: 0.18 ms as one chain), which the JIT may reassociate (ieee_kernel) into vectors of them:
    0.058 -> 0.019 ms there, 0.0075 -> 0.0040 on the bundled model's 384 x 8 x 8 (by hand, the same bytes;
    the ahead-of-time kernels keep the 4 sums)."""
    batch, channels, positions = src.shape
    whole = positions - positions % 4
    for n in range(batch):
        for c in range(channels):
            row = src[n, c]
            s0 = s1 = s2 = s3 = np.float64(0)
            for p in range(0, whole, 4):
                s0 += row[p]
                s1 += row[p + 1]
                s2 += row[p + 2]
                s3 += row[p + 3]
            for p in range(whole, positions):
                s0 += row[p]
            dst[n, c] = ((s0 + s1) + (s2 + s3)) / positions


@kernel
def global_max_pool(src, dst):
    """src [N, C, P] -> dst [N, C]: the maximum of each row."""
    batch, channels, positions = src.shape
    for n in range(batch):
        for c in range(channels):
            best = src[n, c, 0]
            for p in range(1, positions):
                best = max(best, src[n, c, p])
            dst[n, c] = best


class MaxPool2dLayer:
    ops = ("maxpool2d",)  # the registry ops this layer runs (backend.py LAYERS)

    def __init__(self, node, weights):
        self.attrs = node.attrs
        self.out_shape = node.out_shape

    def plan(self, src, new_buffer):
        a = self.attrs
        dst = new_buffer((src.shape[0], *self.out_shape))
        image, steps = padded(src, *a["padding"], -np.inf, new_buffer)
        steps.append(partial(maxpool2d, image, *a["kernel_size"], *a["stride"], dst))
        return dst, steps


class AvgPool2dLayer:
    ops = ("avgpool2d",)  # the registry ops this layer runs (backend.py LAYERS)

    def __init__(self, node, weights):
        a = self.attrs = node.attrs
        self.out_shape = node.out_shape
        (kh, kw), (sh, sw), (ph, pw) = a["kernel_size"], a["stride"], a["padding"]
        _, out_h, out_w = node.out_shape
        if a["count_include_pad"]:
            self.divisors = np.full((out_h, out_w), kh * kw, np.float32)
        else:
            rows = window_cells(node.in_shape[1], kh, sh, ph, out_h)
            cols = window_cells(node.in_shape[2], kw, sw, pw, out_w)
            self.divisors = np.outer(rows, cols).astype(np.float32)

    def plan(self, src, new_buffer):
        a = self.attrs
        dst = new_buffer((src.shape[0], *self.out_shape))
        image, steps = padded(src, *a["padding"], 0.0, new_buffer)
        steps.append(partial(avgpool2d, image, *a["kernel_size"], *a["stride"], self.divisors, dst))
        return dst, steps


class OnRows:
    """A 1-D pool: its 2-D layer (the class this is mixed into) on the node as_rows gives, [N, C, 1, T] views."""

    def __init__(self, node, weights):
        super().__init__(as_rows(node), weights)

    def plan(self, src, new_buffer):
        dst, steps = super().plan(src[:, :, None], new_buffer)
        return dst[:, :, 0], steps


class MaxPool1dLayer(OnRows, MaxPool2dLayer):
    ops = ("maxpool1d",)  # the registry ops this layer runs (backend.py LAYERS)


class AvgPool1dLayer(OnRows, AvgPool2dLayer):
    ops = ("avgpool1d",)  # the registry ops this layer runs (backend.py LAYERS)


class GlobalPoolLayer:
    kernel = None

    def __init__(self, node, weights):
        self.out_shape = node.out_shape

    def plan(self, src, new_buffer):
        dst = new_buffer((src.shape[0], *self.out_shape))
        return dst, [partial(self.kernel, as_channels_positions(src), dst.reshape(dst.shape[:2]))]


class GlobalAvgPoolLayer(GlobalPoolLayer):
    ops = ("global_avg_pool",)  # the registry ops this layer runs (backend.py LAYERS)
    kernel = staticmethod(global_avg_pool)


class GlobalMaxPoolLayer(GlobalPoolLayer):
    ops = ("global_max_pool",)  # the registry ops this layer runs (backend.py LAYERS)
    kernel = staticmethod(global_max_pool)
