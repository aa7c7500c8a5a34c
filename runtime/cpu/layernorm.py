"""layernorm: x [N, *shape] -> y of the same shape, normalized over the trailing normalized_shape dims.

Reference: formats/ops.py LayerNorm.forward (PyTorch nn.LayerNorm): per row of M = prod(normalized_shape)
values, y = (x - mean) / sqrt(var + eps) * weight + bias, var biased. The batch is seen as rows
[R, M] (R = N * the values before the normalized dims); `layernorm_rows` makes two passes per row, the
sums in float64. Without elementwise_affine (or bias) the weight is ones (the bias zeros).
"""

from __future__ import annotations

import math
from functools import partial

import numpy as np

from lnn.runtime.cpu.aot import A1, A2, F
from lnn.runtime.cpu.jit import kernel

# Each kernel's ahead-of-time signature (aot.py): the argument types the backend passes; None: called
# only by other kernels, compiled into them.
AOT_SIGNATURES = {"layernorm_rows": (A2, A1, A1, F, A2)}


@kernel
def layernorm_rows(src, weight, bias, eps, dst):
    """src [R, M] -> dst [R, M]; weight and bias [M]."""
    rows, count = src.shape
    for r in range(rows):
        row = src[r]
        total = np.float64(0)
        for i in range(count):
            total += row[i]
        mean = total / count
        squares = np.float64(0)
        for i in range(count):
            d = row[i] - mean
            squares += d * d
        inv = 1.0 / np.sqrt(squares / count + eps)
        target = dst[r]
        for i in range(count):
            target[i] = (row[i] - mean) * inv * weight[i] + bias[i]


class LayerNormLayer:
    ops = ("layernorm",)  # the registry ops this layer runs (backend.py LAYERS)

    def __init__(self, node, weights):
        self.out_shape = node.out_shape
        self.count = math.prod(node.attrs["normalized_shape"])
        self.eps = node.attrs["eps"]
        ones, zeros = np.ones(self.count, np.float32), np.zeros(self.count, np.float32)
        self.weight = (np.array(weights[node.param_key("weight")], np.float32).reshape(-1)
                       if "weight" in node.param_shapes else ones)
        self.bias = (np.array(weights[node.param_key("bias")], np.float32).reshape(-1)
                     if "bias" in node.param_shapes else zeros)

    def plan(self, src, new_buffer):
        dst = new_buffer(src.shape)
        rows = np.reshape(src, (-1, self.count), copy=False)        # a view: the step must read what src holds
        return dst, [partial(layernorm_rows, rows, self.weight, self.bias, self.eps, dst.reshape(-1, self.count))]
