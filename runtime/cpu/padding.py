"""Padding for the window ops (conv2d, maxpool2d, avgpool2d): src [N, C, H, W] -> [N, C, H+2PH, W+2PW].

The border is filled once, when the plan is made (0 for conv and average pooling, -inf for max
pooling, matching formats/ops.py `_pad_nchw`); each call only copies the interior. The window
kernels then read every cell of a window without bounds checks, which lets LLVM vectorize them.
"""

from __future__ import annotations

from functools import partial

import numpy as np


def padded(src: np.ndarray, pad_h: int, pad_w: int, value: float, new_buffer) -> tuple[np.ndarray, list]:
    """The padded buffer and the step that refreshes its interior (no buffer, no step when no padding)."""
    if pad_h == 0 and pad_w == 0:
        return src, []
    batch, channels, height, width = src.shape
    dst = new_buffer((batch, channels, height + 2 * pad_h, width + 2 * pad_w))
    dst.fill(value)
    interior = dst[:, :, pad_h:pad_h + height, pad_w:pad_w + width]
    return dst, [partial(np.copyto, interior, src)]
