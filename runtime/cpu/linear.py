"""linear: x [N, in], weight [out, in], bias [out] -> y [N, out] = x @ weight.T + bias, then the activation.

Reference: formats/ops.py Linear.forward. The product is numpy's BLAS (`np.matmul` into the planned
output buffer, with a contiguous copy of weight.T made at plan time); bias + activation is
the epilogue of activations.py. Batch norm after a linear layer is folded into weight and bias at load.
"""

from __future__ import annotations

from functools import partial

import numpy as np

from lnn.formats.fold import fold_scale_and_shift
from lnn.runtime.cpu.activations import Epilogue, as_channels_positions


class LinearLayer:
    def __init__(self, node, weights):
        self.out_shape = node.out_shape
        self.weight = np.array(weights[node.param_key("weight")], dtype=np.float32)   # own copy: folding edits it
        self.epilogue = Epilogue.identity(node.attrs["out_features"])
        if node.attrs["bias"]:
            self.epilogue.shift = np.array(weights[node.param_key("bias")], dtype=np.float32)
        self.epilogue.set_activation(node.attrs["activation"])

    def fold(self, scale: np.ndarray, shift: np.ndarray) -> None:
        """Absorb y -> y * scale + shift per output feature (a batch norm) into weight and bias."""
        self.weight, self.epilogue.shift = fold_scale_and_shift(self.weight, self.epilogue.shift, scale, shift)

    def plan(self, src, new_buffer):
        dst = new_buffer((src.shape[0], *self.out_shape))
        weight_t = np.ascontiguousarray(self.weight.T)     # [in, out]: BLAS runs x @ it ~1.5x faster than x @ weight.T
        steps = [partial(np.matmul, src, weight_t, out=dst)]
        if not self.epilogue.is_identity:
            dst3 = as_channels_positions(dst)
            steps.append(partial(self.epilogue.run, dst3, dst3))
        return dst, steps
