"""The photo checks' measures of the check-size copy in one kernel call (no GIL), for the CPU backend.

    grey [S, S] float32 0-255, bgr [S, S, 3] uint8 ->
    counts[256] int64   histogram of the grey levels clip(rint(grey), 0, 255)
    out[0]              pixels with grey >= BLOWN_OUT
    out[1]              variance of the 4-neighbour Laplacian over the interior
    out[2]              leaf pixels: (max - min of B, G, R) >= LEAF_SATURATION * max and max >= LEAF_VALUE * 255
                        (in float32, as the reference; computed in whole numbers, the same for every uint8)

Reference: runtime/photo_checks.py copy_statistics (NumPy). The counts and the blown-out and leaf pixels are the
same integers; the Laplacian's variance differs by rounding (at most 1.7e-7 relative on 64 tomato photos and the
725 decodable outlier photos of ../shared/data/outliers, all with the same verdicts, by hand): each Laplacian
value is a float32 sum as there, its multiply-add maybe fused, and the variance's sums run in float64 (NumPy's
in float32, pairwise). The NumPy version makes about 20 passes over the copy, each dropping and taking back the
GIL, which lnn-serve's decode threads and its inference thread share. The check of a 256x256 photo: 0.39-0.42 ->
0.16 ms (by hand, one thread, 64 tomato photos); lnn-serve at 16 clients, 4 interleaved rounds by hand: 495-505
against 444-465 answers/s with batching, 449-504 against 409-424 without, server CPU per request 2.1 against 2.6
and 2.7 against 3.1 ms.
"""

from __future__ import annotations

import numpy as np

from lnn.runtime.cpu.aot import A2, D1, I1, U3
from lnn.runtime.cpu.jit import ieee_kernel
from lnn.runtime.photo_checks import BLOWN_OUT, LEAF_SATURATION, LEAF_VALUE, levels_under

AOT_SIGNATURES = {"grey_copy_statistics": (A2, U3, I1, D1)}

# The leaf test in whole numbers: for uint8 channels, (max - min) >= float32(LEAF_SATURATION) * max exactly when
# SATURATION_DIVISOR * (max - min) >= max, and max >= float32(LEAF_VALUE * 255) exactly when max >= VALUE_FLOOR
# (tests/runtime/test_photo_measures.py checks both over every pair of levels); integers, so the loop needs no
# conversions
SATURATION_DIVISOR = round(1 / LEAF_SATURATION)
VALUE_FLOOR = int(np.ceil(np.float32(LEAF_VALUE * 255)))
FOUR_32 = np.float32(4)


@ieee_kernel
def grey_copy_statistics(grey, bgr, counts, out):
    """See the header: counts and out are filled (counts added to: pass zeros). An @ieee_kernel: the sums
    over pixels vectorize (reassociated, in float64)."""
    height, width = grey.shape
    blown = 0
    for y in range(height):
        for x in range(width):
            value = grey[y, x]
            counts[int(min(max(np.rint(value), 0.0), 255.0))] += 1
            blown += value >= BLOWN_OUT
    total = squares = 0.0
    for y in range(1, height - 1):
        for x in range(1, width - 1):
            laplacian = np.float64(grey[y - 1, x] + grey[y + 1, x] + grey[y, x - 1] + grey[y, x + 1]
                                   - FOUR_32 * grey[y, x])
            total += laplacian
            squares += laplacian * laplacian
    interior = max((height - 2) * (width - 2), 1)
    mean = total / interior
    channels = bgr.reshape(-1)
    leaf = 0
    for at in range(0, channels.shape[0], 3):
        blue, green, red = np.int32(channels[at]), np.int32(channels[at + 1]), np.int32(channels[at + 2])
        top = max(blue, max(green, red))
        leaf += (SATURATION_DIVISOR * (top - min(blue, min(green, red))) >= top) & (top >= VALUE_FLOOR)
    out[0] = blown
    out[1] = squares / interior - mean * mean
    out[2] = leaf


def copy_statistics(grey: np.ndarray, small: np.ndarray) -> dict:
    """photo_checks.copy_statistics's measures, from grey_copy_statistics."""
    counts = np.zeros(256, np.int64)
    out = np.zeros(3, np.float64)
    grey_copy_statistics(np.ascontiguousarray(grey, np.float32), np.ascontiguousarray(small, np.uint8), counts, out)
    low, high = levels_under(counts)
    return {"grey_p1": low, "grey_p99": high, "blown_out_share": out[0] / grey.size,
            "laplacian_variance": float(out[1]), "leaf_fill": out[2] / grey.size}
