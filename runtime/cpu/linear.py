"""linear: x [N, in], weight [out, in], bias [out] -> y [N, out] = x @ weight.T + bias, then the activation.

Reference: formats/ops.py Linear.forward. On small batches (FUSED_MAX_BATCH) of a layer with at most
FUSED_MAX_WEIGHTS weights and no softmax, one kernel does it all, `linear_dots` (product, bias and
activation; no BLAS call, so a plan of such layers does not touch BLAS's thread count either): each
output is the dot product of x's row with the weight's row [in] (read in place, contiguous), four
outputs at a time, summed in vector lanes (reassociated, fused multiply-adds). With parts > 1
(backend.py) each task computes a block of the output features with it. mnist_mlp's 784 -> 256 layer at
batch 1, 1 thread (2-core AVX2 EPYC VM): 18-22 us, against 26-34 one output at a time and 27-37 for the
earlier k-outer loop that added each input's weight row into all 256 outputs (a load and a store of
each output per input). Larger batches: numpy's
BLAS (`np.matmul` into the planned output buffer) computes x @ a contiguous copy of weight.T made at
plan time (x @ the view weight.T at batch 1), one product per block of output features when split,
then the epilogue of activations.py. Batch norm after a linear layer is folded into weight and bias
at load.
"""

from __future__ import annotations

from functools import partial

import numpy as np

from lnn.formats.fold import fold_scale_and_shift
from lnn.runtime.cpu.activations import SOFTMAX, Epilogue, activate, as_channels_positions
from lnn.runtime.cpu.aot import A1, A2, F, I
from lnn.runtime.cpu.jit import ieee_kernel
from lnn.runtime.cpu.parallel import parallel_steps, split_range

# Each kernel's ahead-of-time signature (aot.py): the argument types the backend passes; None: called
# only by other kernels, compiled into them.
AOT_SIGNATURES = {"linear_dots": (A2, A2, A1, A1, I, F, I, I, A2)}

FUSED_MAX_BATCH = 4           # linear_dots on batches this small ...
FUSED_MAX_WEIGHTS = 1 << 20   # ... for layers of at most this many weights (4 MiB; mnist_mlp's largest: 0.2 M)


@ieee_kernel
def linear_dots(x, weight, scale, shift, code, slope, first, end, dst):
    """x [N, K], weight [O, K] -> dst[:, first:end] = act((x @ weight[first:end].T) * scale + shift); act is
    not softmax. Outputs four at a time: each value of x's row is loaded once for four dot products over
    k (one load per product was the limit), their sums reassociated into vector lanes (@ieee_kernel). A
    last group of fewer than four reads its last row again and stores only its own outputs."""
    batch, inputs = x.shape
    last = end - 1
    for o in range(first, end, 4):
        w0, w1, w2, w3 = weight[o], weight[min(o + 1, last)], weight[min(o + 2, last)], weight[min(o + 3, last)]
        for n in range(batch):
            source = x[n]
            t0 = t1 = t2 = t3 = np.float32(0)
            for k in range(inputs):
                v = source[k]
                t0 += w0[k] * v
                t1 += w1[k] * v
                t2 += w2[k] * v
                t3 += w3[k] * v
            for i, total in enumerate((t0, t1, t2, t3)):
                if o + i < end:
                    dst[n, o + i] = activate(total * scale[o + i] + shift[o + i], code, slope)


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
        blocks = split_range(0, self.weight.shape[0], parts, align=16)
        if src.shape[0] <= FUSED_MAX_BATCH and self.weight.size <= FUSED_MAX_WEIGHTS and e.code != SOFTMAX:
            return dst, parallel_steps([[partial(linear_dots, src, self.weight, e.scale, e.shift, e.code, e.slope,
                                                 first, end, dst)] for first, end in blocks])
        # [in, out]: for batches BLAS runs x @ a contiguous weight.T ~1.5x faster than x @ the view weight.T
        weight_t = self.weight.T if src.shape[0] == 1 else np.ascontiguousarray(self.weight.T)
        steps = parallel_steps([[partial(np.matmul, src, weight_t[:, first:end], out=dst[:, first:end])]
                                for first, end in blocks])
        if not self.epilogue.is_identity:
            dst3 = as_channels_positions(dst)
            steps.append(partial(self.epilogue.run, dst3, dst3))
        return dst, steps
