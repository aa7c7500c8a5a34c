"""batchnorm (1d [N, C] and 2d [N, C, H, W]) at inference: y = (x - mean) / sqrt(var + eps) * weight + bias.

Reference: formats/ops.py BatchNorm.forward. It is a per-channel y = x * scale + shift, computed once at
load in float64 (formats/fold.py, shared with the CUDA backend). After a conv2d or linear layer without
an activation the backend folds it into that layer's weight and bias (no pass at run time); anywhere
else it runs as the epilogue kernel of activations.py with this scale and shift (and the layer's own
activation, if any).
"""

from __future__ import annotations

from functools import partial

from lnn.runtime.cpu.activations import Epilogue, as_channels_positions
from lnn.formats.fold import scale_and_shift


class BatchNormLayer:
    """A batch norm that could not be folded into the layer before it."""
    ops = ("batchnorm",)  # the registry ops this layer runs (backend.py LAYERS)

    def __init__(self, node, weights):
        self.out_shape = node.out_shape
        self.epilogue = Epilogue(*scale_and_shift(node, weights))
        self.epilogue.set_activation(node.attrs["activation"])

    def plan(self, src, new_buffer):
        dst = new_buffer(src.shape)
        return dst, [partial(self.epilogue.run, as_channels_positions(src), as_channels_positions(dst))]
