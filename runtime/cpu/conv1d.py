"""conv1d: x [N, C, T], weight [O, C/groups, K], bias [O] -> y [N, O, OT], then the epilogue (and a fused
max-pool, as conv2d's).

Reference: formats/ops.py Conv1d.forward (PyTorch Conv1d: zero padding left and right, stride, dilation,
groups), which is the conv2d of height 1 that formats/ops.py conv1d_as_conv2d describes. So this layer is
conv2d.py's Conv2dLayer on views: the input [N, C, 1, T], the weight [O, C/g, 1, K], the output
[N, O, 1, OT]; every kernel, band, fold and epilogue is conv2d's. Padding alike on both sides is the
conv2d's own (padding.py); a right padding that differs from the left ("same" with an even kernel) is
written here, into a zero-bordered buffer of T + left + right, and the conv then pads nothing.
"""

from __future__ import annotations

import dataclasses
from functools import partial

import numpy as np

from lnn.formats.ops import conv1d_as_conv2d, conv1d_padded_length
from lnn.runtime.cpu.conv2d import Conv2dLayer


class Conv1dLayer(Conv2dLayer):
    ops = ("conv1d",)  # the registry ops this layer runs (backend.py LAYERS)

    def __init__(self, node, weights):
        left, right = self.sides = node.attrs["padding"]
        length = node.in_shape[1] if left == right else conv1d_padded_length(node.attrs, node.in_shape[1])
        rows = dataclasses.replace(node, attrs=conv1d_as_conv2d(node.attrs, None if left == right else (0, 0)),
                                   in_shape=(node.in_shape[0], 1, length),
                                   out_shape=(node.out_shape[0], 1, node.out_shape[1]))
        weight = node.param_key("weight")
        super().__init__(rows, {**weights, weight: np.asarray(weights[weight])[:, :, None]})

    @property
    def input_padding(self) -> tuple:
        return (0, 0)           # the layer before writes [N, C, T]; the padding is this layer's

    def plan(self, src, new_buffer, parts: int = 1):
        rows, steps = src[:, :, None], []
        left, right = self.sides
        if left != right:
            batch, channels, length = src.shape
            rows = new_buffer((batch, channels, 1, length + left + right))
            rows.fill(0.0)
            steps.append(partial(np.copyto, rows[:, :, 0, left:left + length], src))
        dst, conv_steps = super().plan(rows, new_buffer, parts)
        return dst[:, :, 0], steps + conv_steps
