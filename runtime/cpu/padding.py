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


def padded_buffer(shape: tuple, pad_h: int, pad_w: int, new_buffer) -> tuple[np.ndarray, np.ndarray]:
    """A new zero-bordered [N, C, H+2PH, W+2PW] buffer and its [N, C, H, W] interior (the same buffer twice
    when there is no padding)."""
    if pad_h == 0 and pad_w == 0:
        full = new_buffer(shape)
        return full, full
    batch, channels, height, width = shape
    full = new_buffer((batch, channels, height + 2 * pad_h, width + 2 * pad_w))
    full.fill(0.0)
    return full, full[:, :, pad_h:pad_h + height, pad_w:pad_w + width]


def padded(src: np.ndarray, pad_h: int, pad_w: int, value: float, new_buffer) -> tuple[np.ndarray, list]:
    """The padded buffer and the step that refreshes its interior (no buffer, no step when no padding
    or when src is already the interior of such a buffer)."""
    if pad_h == 0 and pad_w == 0:
        return src, []
    batch, channels, height, width = src.shape
    full = _enclosing(src, pad_h, pad_w, value)
    if full is not None:
        return full, []
    dst = new_buffer((batch, channels, height + 2 * pad_h, width + 2 * pad_w))
    dst.fill(value)
    interior = dst[:, :, pad_h:pad_h + height, pad_w:pad_w + width]
    return dst, [partial(np.copyto, interior, src)]


def _enclosing(src: np.ndarray, pad_h: int, pad_w: int, value: float):
    """The [N, C, H+2PH, W+2PW] buffer whose [PH:-PH, PW:-PW] interior src is and whose border holds
    `value`, rebuilt as a view of the memory src.base owns; None when src is not such an interior."""
    owner = src.base
    batch, channels, height, width = src.shape
    shape = (batch, channels, height + 2 * pad_h, width + 2 * pad_w)
    if not isinstance(owner, np.ndarray) or owner.dtype != src.dtype or not owner.flags.c_contiguous:
        return None
    start = (src.ctypes.data - owner.ctypes.data) // src.itemsize - (pad_h * shape[3] + pad_w)
    if start < 0 or start + int(np.prod(shape)) > owner.size:
        return None
    full = owner.reshape(-1)[start:start + int(np.prod(shape))].reshape(shape)
    interior = full[:, :, pad_h:pad_h + height, pad_w:pad_w + width]
    if src.strides != interior.strides or src.ctypes.data != interior.ctypes.data:
        return None
    border = np.ones(shape[2:], bool)
    border[pad_h:pad_h + height, pad_w:pad_w + width] = False
    return full if bool((full[:, :, border] == value).all()) else None
