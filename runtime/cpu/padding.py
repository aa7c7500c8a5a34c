"""Padding for the window ops (conv2d, maxpool2d, avgpool2d): src [N, C, H, W] -> [N, C, H+2PH, W+2PW].

The border is filled once, when the plan is made (0 for conv and average pooling, -inf for max
pooling, matching formats/ops.py `_pad_nchw`); each call only copies the interior. The window
kernels then read every cell of a window without bounds checks, which lets LLVM vectorize them.
No copy at all when the layer before wrote straight into the interior of a zero-padded buffer
(`padded_buffer`: a conv feeding a padded conv, and the plan's input buffer when the first layer pads).
"""

from __future__ import annotations

from functools import partial

import numpy as np


def padded_buffer(shape: tuple, pad_h: int, pad_w: int, new_buffer) -> np.ndarray:
    """A new [N, C, H, W] buffer that is the interior of a zero-bordered [N, C, H+2PH, W+2PW] one (its .base)."""
    if pad_h == 0 and pad_w == 0:
        return new_buffer(shape)
    batch, channels, height, width = shape
    full = new_buffer((batch, channels, height + 2 * pad_h, width + 2 * pad_w))
    full.fill(0.0)
    return full[:, :, pad_h:pad_h + height, pad_w:pad_w + width]


def padded(src: np.ndarray, pad_h: int, pad_w: int, value: float, new_buffer) -> tuple[np.ndarray, list]:
    """The padded buffer and the step that refreshes its interior (no buffer, no step when no padding
    or when src is already the interior of such a buffer)."""
    if pad_h == 0 and pad_w == 0:
        return src, []
    batch, channels, height, width = src.shape
    if _is_interior(src, pad_h, pad_w, value):
        return src.base, []
    dst = new_buffer((batch, channels, height + 2 * pad_h, width + 2 * pad_w))
    dst.fill(value)
    interior = dst[:, :, pad_h:pad_h + height, pad_w:pad_w + width]
    return dst, [partial(np.copyto, interior, src)]


def _is_interior(src: np.ndarray, pad_h: int, pad_w: int, value: float) -> bool:
    """src is exactly the [PH:-PH, PW:-PW] interior of src.base, whose border holds `value`."""
    full = src.base
    batch, channels, height, width = src.shape
    if (not isinstance(full, np.ndarray) or not full.flags.c_contiguous
            or full.shape != (batch, channels, height + 2 * pad_h, width + 2 * pad_w)):
        return False
    interior = full[:, :, pad_h:pad_h + height, pad_w:pad_w + width]
    if src.strides != interior.strides or src.ctypes.data != interior.ctypes.data:
        return False
    border = np.ones(full.shape[2:], bool)
    border[pad_h:pad_h + height, pad_w:pad_w + width] = False
    return bool((full[:, :, border] == value).all())
