"""linear: x [N, in], weight [out, in], bias [out] -> y [N, out] = x @ weight.T + bias, then the activation.

Reference: formats/ops.py Linear.forward. The product is numpy's BLAS (`np.matmul` into the planned
output buffer): at batch 1 x @ weight.T as a transposed view (BLAS's dot-product gemv, about 2x faster
there on mnist_mlp's 784x256), for larger batches x @ a contiguous copy of weight.T made at plan time.
With parts > 1 (backend.py) the output features are cut into blocks, one product per block, run as
independent tasks (parallel.py). Bias + activation is the epilogue of activations.py, after all
blocks. Batch norm after a linear layer is folded into weight and bias at load.
"""

from __future__ import annotations

from functools import partial

import numpy as np

from lnn.formats.fold import fold_scale_and_shift
from lnn.runtime.cpu.activations import Epilogue, as_channels_positions
from lnn.runtime.cpu.parallel import parallel_steps, split_range


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

    @property
    def flops(self) -> int:
        """Per row, a multiply-add counted 2: what backend.py weighs before splitting the layer."""
        return 2 * self.weight.size

    def plan(self, src, new_buffer, parts: int = 1):
        dst = new_buffer((src.shape[0], *self.out_shape))
        # [in, out]: for batches BLAS runs x @ a contiguous weight.T ~1.5x faster than x @ the view weight.T
        weight_t = self.weight.T if src.shape[0] == 1 else np.ascontiguousarray(self.weight.T)
        blocks = split_range(0, weight_t.shape[1], parts, align=16)
        steps = parallel_steps([[partial(np.matmul, src, weight_t[:, first:end], out=dst[:, first:end])]
                                for first, end in blocks])
        if not self.epilogue.is_identity:
            dst3 = as_channels_positions(dst)
            steps.append(partial(self.epilogue.run, dst3, dst3))
        return dst, steps
