"""Checks on a photo before the model sees it: too small, too dark, overexposed, blurred, leaf too small.

NumPy only (the packaged app has no OpenCV). Each check measures the decoded photo, not the model's
input, and has its own reason (lnn/runtime/gate.py words them):

    too_small   the shorter side is under min_side pixels
    too_dark    even the brightest pixels are dark: the 99th percentile of the grey levels (0-255) is
                under dark_below (PlantVillage has photos of a lit leaf on black, so the mean would not do)
    too_bright  even the darkest pixels are bright (1st percentile over bright_above), or more than
                bright_share_above of the pixels are blown out (grey >= 250)
    blurred     the variance of the Laplacian of a check_size x check_size grey copy is under blur_below
                (Pech-Pacheco et al. 2000: a sharp photo has strong second derivatives somewhere)
    too_small   (leaf) under leaf_fill_below of the grey copy's pixels look like leaf: coloured
                (HSV saturation >= 0.2 and value >= 0.12), a plain background is grey; with none at all
                the words say the photo has no colour (a black-and-white photo: "move closer" would not help)

The thresholds come from the model's metadata (gate.photo_checks, formats/gate.py), so a model for
other photos can change them; DEFAULTS were measured on the 3,839 PlantVillage tomato photos
(benchmarks/photo_checks.py: they flag under 1% of them) and on darkened, blurred, tiny and
leaf-small copies of them, which they catch.

`copy_statistics` here is the reference; the CPU backend computes the same measures of the grey copy in
one compiled pass (runtime/cpu/photo_measures.py), which Session.check_photo passes in as `statistics`.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

DEFAULTS = {
    "min_side": 128,
    "check_size": 256,
    "dark_below": 60.0,
    "bright_above": 160.0,
    "bright_share_above": 0.4,
    "blur_below": 8.0,
    "leaf_fill_below": 0.07,
}
GRAY_WEIGHTS_BGR = np.array((0.114, 0.587, 0.299), np.float32)
BLOWN_OUT = 250
LEAF_SATURATION = 0.2
LEAF_VALUE = 0.12
PERCENTILE_SHARES = (0.01, 0.99)     # grey_p1, grey_p99


@dataclass
class PhotoCheck:
    """The first failed check of a photo (reason None: every check passed), with its words and measures."""

    reason: str | None
    detail: str | None
    measures: dict


def _grey_copy(image: np.ndarray, size: int) -> tuple[np.ndarray, np.ndarray]:
    """(grey float32 [size, size] 0-255, BGR uint8 [size, size, 3]) of a uint8 HxWx3 BGR photo."""
    from lnn.runtime.preprocess import resize_image

    small = resize_image(image, size, size)
    return small.astype(np.float32) @ GRAY_WEIGHTS_BGR, small


def laplacian_variance(grey: np.ndarray) -> float:
    """Variance of the 4-neighbour Laplacian over the interior of a grey image."""
    g = np.asarray(grey, np.float32)
    laplacian = g[:-2, 1:-1] + g[2:, 1:-1] + g[1:-1, :-2] + g[1:-1, 2:] - 4 * g[1:-1, 1:-1]
    return float(laplacian.var())


def leaf_fill(bgr: np.ndarray) -> float:
    """Share of pixels that are coloured enough to be leaf (HSV saturation and value over a floor), for a
    HxWx3 BGR image of whole numbers 0-255 (uint8: the channels' extremes are found on a quarter of the bytes
    of float32, with the same float32 comparisons after)."""
    blue, green, red = bgr[:, :, 0], bgr[:, :, 1], bgr[:, :, 2]      # per channel: a reduction over the last,
    top = np.maximum(np.maximum(blue, green), red)                    # 3-long axis is 20x slower in NumPy
    bottom = np.minimum(np.minimum(blue, green), red)
    top_value = top.astype(np.float32)
    spread = top_value - bottom.astype(np.float32)
    return float(np.mean((spread >= LEAF_SATURATION * top_value) & (top_value >= LEAF_VALUE * 255)))


def grey_percentiles(grey: np.ndarray, shares=PERCENTILE_SHARES) -> list:
    """The grey levels (whole numbers, 0-255) under which these shares of the pixels lie: a histogram, not a sort."""
    counts = np.bincount(np.clip(np.rint(grey), 0, 255).astype(np.uint8).ravel(), minlength=256)
    return levels_under(counts, shares)


def levels_under(counts: np.ndarray, shares=PERCENTILE_SHARES) -> list:
    """From a histogram of the 256 grey levels: the levels under which these shares of the pixels lie."""
    cumulative = np.cumsum(counts) / counts.sum()
    return [float(np.searchsorted(cumulative, share)) for share in shares]


def copy_statistics(grey: np.ndarray, small: np.ndarray) -> dict:
    """The measures of the check-size copy (grey float32 0-255, and its uint8 BGR) that the checks compare."""
    low, high = grey_percentiles(grey)
    return {
        "grey_p1": low,
        "grey_p99": high,
        "blown_out_share": float(np.mean(grey >= BLOWN_OUT)),
        "laplacian_variance": laplacian_variance(grey),
        "leaf_fill": leaf_fill(small),
    }


def measure(image: np.ndarray, check_size: int = DEFAULTS["check_size"], statistics=copy_statistics) -> dict:
    """The measures the checks compare (for a uint8 HxWx3 BGR, HxWx4 or HxW photo); `statistics`: what
    measures the check-size copy (copy_statistics, or the CPU backend's compiled one)."""
    image = np.asarray(image)
    if image.ndim == 2:
        image = np.repeat(image[:, :, None], 3, axis=2)
    image = image[:, :, :3]
    grey, small = _grey_copy(image, int(check_size))
    return {"width": int(image.shape[1]), "height": int(image.shape[0]), **statistics(grey, small)}


def check_photo(image: np.ndarray, thresholds: dict | None = None, statistics=copy_statistics) -> PhotoCheck:
    """Run every check (thresholds: DEFAULTS, overridden by the given ones); the first failure wins.
    statistics: as for measure."""
    t = {**DEFAULTS, **(thresholds or {})}
    m = measure(image, t["check_size"], statistics)
    side = min(m["width"], m["height"])
    if side < t["min_side"]:
        return PhotoCheck("too_small", f"The photo is too small ({m['width']}x{m['height']} pixels). Take or send "
                                       f"one at least {int(t['min_side'])} pixels on each side, filling the frame "
                                       "with one leaf.", m)
    if m["grey_p99"] < t["dark_below"]:
        return PhotoCheck("too_dark", None, m)
    if m["grey_p1"] > t["bright_above"] or m["blown_out_share"] > t["bright_share_above"]:
        return PhotoCheck("too_bright", None, m)
    if m["laplacian_variance"] < t["blur_below"]:
        return PhotoCheck("blurred", None, m)
    if m["leaf_fill"] < t["leaf_fill_below"]:
        if m["leaf_fill"] == 0:                   # not one pixel coloured: a black-and-white photo, or no leaf at all
            return PhotoCheck("too_small", "The photo has no colour in it, so no leaf can be seen (a black-and-white "
                                           "photo?). Take a colour photo of one leaf, filling the frame.", m)
        return PhotoCheck("too_small", "The leaf fills too little of the photo. Move closer, so that one leaf "
                                       "fills the frame.", m)
    return PhotoCheck(None, None, m)
