"""linear: x [N, in], weight [out, in], bias [out] -> y [N, out] = x @ weight.T + bias, then the activation.

Reference: formats/ops.py Linear.forward. The product is numpy's BLAS (`np.matmul` into the planned
output buffer): at batch 1 x @ weight.T as a transposed view (BLAS's dot-product gemv, about 2x faster
there on mnist_mlp's 784x256), for larger batches x @ a contiguous copy of weight.T made at plan time.
With parts > 1 (backend.py) the output features are cut into blocks, one product per block, run as
independent tasks (parallel.py). Bias + activation is the epilogue of activations.py, after all
blocks. A layer that is not split, on a small batch (FUSED_MAX_BATCH) and with at most
FUSED_MAX_WEIGHTS weights, is one kernel instead, `linear_rows` (product, bias and activation; no BLAS
call, so a plan of such layers does not touch BLAS's thread count either): in a one-off comparison
(thread CPU time, 2 busy cores) mnist_mlp at batch 1 took 30 us of CPU a call this way against 57
with BLAS (its 784 -> 256 layer 19 us against 18 for BLAS's gemv and the epilogue; the rest was
holding BLAS at one thread); BENCHMARKS "cpu_thread_share" has the current figure. Batch norm after a linear layer is folded into weight
and bias at load.
"""

from __future__ import annotations

from functools import partial

import numpy as np

from lnn.formats.fold import fold_scale_and_shift
from lnn.runtime.cpu.activations import SOFTMAX, Epilogue, activate, as_channels_positions
from lnn.runtime.cpu.aot import A1, A2, F, I
from lnn.runtime.cpu.jit import kernel
from lnn.runtime.cpu.parallel import parallel_steps, split_range

# Each kernel's ahead-of-time signature (aot.py): the argument types the backend passes; None: called
# only by other kernels, compiled into them.
AOT_SIGNATURES = {"linear_rows": (A2, A2, A1, A1, I, F, A2)}

FUSED_MAX_BATCH = 4           # linear_rows on batches this small ...
FUSED_MAX_WEIGHTS = 1 << 20   # ... for layers of at most this many weights (4 MiB; mnist_mlp's largest: 0.2 M)


@kernel
def linear_rows(x, weight_t, scale, shift, code, slope, dst):
    """x [N, K], weight_t [K, O] -> dst [N, O] = act((x @ weight_t) * scale + shift), the product summed
    in k order; act is not softmax. The loop over o is innermost (contiguous, vectorized)."""
    batch, inputs = x.shape
    outputs = dst.shape[1]
    for n in range(batch):
        row = dst[n]
        source = x[n]
        for o in range(outputs):
            row[o] = 0
        for k in range(inputs):
            v = source[k]
            w = weight_t[k]
            for o in range(outputs):
                row[o] += v * w[o]
        for o in range(outputs):
            row[o] = activate(row[o] * scale[o] + shift[o], code, slope)


class LinearLayer:
    ops = ("linear",)  # the registry ops this layer runs (backend.py LAYERS)

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
        e = self.epilogue
        if parts == 1 and src.shape[0] <= FUSED_MAX_BATCH and self.weight.size <= FUSED_MAX_WEIGHTS and e.code != SOFTMAX:
            weight_t = np.ascontiguousarray(self.weight.T)
            return dst, [partial(linear_rows, src, weight_t, e.scale, e.shift, e.code, e.slope, dst)]
        # [in, out]: for batches BLAS runs x @ a contiguous weight.T ~1.5x faster than x @ the view weight.T
        weight_t = self.weight.T if src.shape[0] == 1 else np.ascontiguousarray(self.weight.T)
        blocks = split_range(0, weight_t.shape[1], parts, align=16)
        steps = parallel_steps([[partial(np.matmul, src, weight_t[:, first:end], out=dst[:, first:end])]
                                for first, end in blocks])
        if not self.epilogue.is_identity:
            dst3 = as_channels_positions(dst)
            steps.append(partial(self.epilogue.run, dst3, dst3))
        return dst, steps
