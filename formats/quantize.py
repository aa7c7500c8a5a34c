"""int8 weights: symmetric, one scale per output channel (formats/SPEC.md, "int8 weights").

For a weight W of shape [O, ...] (a conv kernel [O, C/groups, kH, kW] or a linear matrix [O, I]):

    scale[o] = max |W[o]| / 127          float32, [O]; a row of zeros gets scale 1
    q[o]     = clip(round(W[o] / scale[o]), -127, 127)      int8, the shape of W
    W[o]    ~= q[o] * scale[o]           (error at most scale[o] / 2 per value)

-128 is never used, so the range is symmetric and negating a value never overflows. A `.bin`
stores q as an int8 tensor and scale as the float32 tensor `<key>.scale` right after it.
"""

from __future__ import annotations

import numpy as np

QMAX = 127
SCALE_SUFFIX = ".scale"


def scale_key(key: str) -> str:
    """The name of the scale tensor of the int8 tensor `key`."""
    return key + SCALE_SUFFIX


def quantize_per_channel(weight) -> tuple:
    """float weight [O, ...] -> (int8 q [O, ...], float32 scale [O]), as the module doc says."""
    weight = np.asarray(weight, np.float32)
    rows = weight.reshape(len(weight), -1)
    scale = (np.abs(rows).max(axis=1) / np.float32(QMAX)).astype(np.float32)
    scale = np.where(scale > 0, scale, np.float32(1))          # zero (or underflowed) rows: any scale is exact
    q = np.clip(np.rint(rows / scale[:, None]), -QMAX, QMAX).astype(np.int8)
    return q.reshape(weight.shape), scale


def dequantize(q, scale) -> np.ndarray:
    """int8 q [O, ...] and float32 scale [O] -> float32 q * scale (broadcast over each output channel)."""
    q = np.asarray(q)
    return q.astype(np.float32) * np.asarray(scale, np.float32).reshape((len(q),) + (1,) * (q.ndim - 1))
