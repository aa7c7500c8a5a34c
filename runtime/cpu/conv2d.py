"""conv2d: x [N, C, H, W], weight [O, C/groups, KH, KW], bias [O] -> y [N, O, OH, OW], then the epilogue.

Reference: formats/ops.py Conv2d.forward (PyTorch semantics: zero padding, stride, dilation, groups).
    y[n, o, oy, ox] = bias[o] + sum over c in o's group, ky, kx of
                      weight[o, c, ky, kx] * x[n, c, oy*SH - PH + ky*DH, ox*SW - PW + kx*DW]   (0 outside x)

Two algorithms, chosen per layer at load:
  im2col + GEMM  the input is zero-padded (padding.py); per image, `im2col` copies every window
                 into cols [C*KH*KW, OH*OW]; per group numpy's BLAS computes
                 W2d[g] [O/g, C/g*KH*KW] @ cols[g] straight into y[n, g]. A 1x1, stride-1, unpadded conv uses the image itself as cols.
  direct         for grouped convs with few inputs per output (depthwise: C/groups = 1), `conv2d_direct`
                 accumulates each output plane from shifted rows of the padded input.
The epilogue (bias + activation, activations.py) is one pass over y, or is fused into a following max-pool.
Batch norm after a conv is folded into weight and bias at load (backend.py).
"""

from __future__ import annotations

from functools import partial

import numpy as np

from lnn.runtime.cpu.activations import Epilogue, as_channels_positions
from lnn.runtime.cpu.jit import kernel
from lnn.runtime.cpu.padding import padded

# Below this many multiply-adds per output element a grouped conv runs direct, not as tiny GEMMs.
DIRECT_MAX_TAPS = 32


@kernel
def im2col(image, kh, kw, sh, sw, dh, dw, out_h, out_w, cols):
    """image [C, H, W] (already padded) -> cols [C*KH*KW, OH*OW]; row (c, ky, kx), column (oy, ox)."""
    channels = image.shape[0]
    for c in range(channels):
        for ky in range(kh):
            for kx in range(kw):
                row = cols[(c * kh + ky) * kw + kx]
                for oy in range(out_h):
                    source = image[c, oy * sh + ky * dh]
                    base = oy * out_w
                    if sw == 1:     # a contiguous copy, which LLVM vectorizes
                        for ox in range(out_w):
                            row[base + ox] = source[ox + kx * dw]
                    else:
                        for ox in range(out_w):
                            row[base + ox] = source[ox * sw + kx * dw]


@kernel
def conv2d_direct(image, weight, groups, sh, sw, dh, dw, out):
    """image [C, H, W] (already padded), weight [O, C/groups, KH, KW] -> out [O, OH, OW] (no bias)."""
    out_channels, group_in, kh, kw = weight.shape
    _, out_h, out_w = out.shape
    group_out = out_channels // groups
    for o in range(out_channels):
        first_in = (o // group_out) * group_in
        plane = out[o]
        plane[:, :] = 0
        for ci in range(group_in):
            for ky in range(kh):
                for kx in range(kw):
                    tap = weight[o, ci, ky, kx]
                    for oy in range(out_h):
                        source = image[first_in + ci, oy * sh + ky * dh]
                        target = plane[oy]
                        for ox in range(out_w):
                            target[ox] += tap * source[ox * sw + kx * dw]


class Conv2dLayer:
    def __init__(self, node, weights):
        attrs = node.attrs
        self.attrs = attrs
        self.out_shape = node.out_shape
        self.weight = np.array(weights[node.param_key("weight")], dtype=np.float32)   # own copy: folding edits it
        out_channels = attrs["out_channels"]
        self.epilogue = Epilogue.identity(out_channels)
        if attrs["bias"]:
            self.epilogue.shift = np.array(weights[node.param_key("bias")], dtype=np.float32)
        self.epilogue.set_activation(attrs["activation"])
        self.epilogue_fused = False     # True once a following max-pool applies the epilogue

    def fold(self, scale: np.ndarray, shift: np.ndarray) -> None:
        """Absorb y -> y * scale + shift per output channel (a batch norm) into weight and bias."""
        self.weight = (self.weight * scale[:, None, None, None]).astype(np.float32)
        self.epilogue.shift = (self.epilogue.shift * scale + shift).astype(np.float32)

    @property
    def direct(self) -> bool:
        _, group_in, kh, kw = self.weight.shape
        return self.attrs["groups"] > 1 and group_in * kh * kw <= DIRECT_MAX_TAPS

    @property
    def pointwise(self) -> bool:
        a = self.attrs
        return (a["kernel_size"] == (1, 1) and a["stride"] == (1, 1) and a["padding"] == (0, 0))

    def plan(self, src, new_buffer):
        a = self.attrs
        batch = src.shape[0]
        out_channels, out_h, out_w = self.out_shape
        dst = new_buffer((batch, *self.out_shape))
        image, steps = padded(src, *a["padding"], 0.0, new_buffer)
        geometry = (*a["stride"], *a["dilation"])
        if self.direct:
            for n in range(batch):
                steps.append(partial(conv2d_direct, image[n], self.weight, a["groups"], *geometry, dst[n]))
        else:
            groups = a["groups"]
            w2d = self.weight.reshape(groups, out_channels // groups, -1)      # [G, O/G, C/G*KH*KW]
            positions = out_h * out_w
            if self.pointwise:
                cols_of = [image[n].reshape(groups, -1, positions) for n in range(batch)]
            else:
                cols = new_buffer((w2d.shape[2] * groups, positions))
                cols_of = [cols.reshape(groups, -1, positions)] * batch
            for n in range(batch):
                if not self.pointwise:
                    steps.append(partial(im2col, image[n], *a["kernel_size"], *geometry, out_h, out_w, cols))
                out = dst[n].reshape(groups, out_channels // groups, positions)
                for g in range(groups):
                    steps.append(partial(np.matmul, w2d[g], cols_of[n][g], out=out[g]))
        if not self.epilogue_fused and not self.epilogue.is_identity:
            dst3 = as_channels_positions(dst)
            steps.append(partial(self.epilogue.run, dst3, dst3))
        return dst, steps
