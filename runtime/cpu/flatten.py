"""flatten: [N, C, H, W] -> [N, C*H*W] in (C, H, W) order (formats/ops.py Flatten.forward).

Every planned buffer is C-contiguous, so this is a reshaped view: no kernel, no copy.
"""

from __future__ import annotations


class FlattenLayer:
    ops = ("flatten",)  # the registry ops this layer runs (backend.py LAYERS)

    def __init__(self, node, weights):
        self.out_shape = node.out_shape

    def plan(self, src, new_buffer):
        return src.reshape(src.shape[0], *self.out_shape), []
