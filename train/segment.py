"""Leaf masks for photos of one leaf on a plain background (PlantVillage), with OpenCV.

    mask = leaf_mask(image)        # image uint8 [3, H, W] (rgb or bgr order named), -> uint8 [H, W], 255 = leaf

PlantVillage backgrounds are a plain grey or purple-grey sheet, sometimes with the leaf's shadow on it.
What tells a leaf from that sheet is its colour, not its brightness (a shadow is darker sheet), so:
  1. the sheet's colour is the median of the image's border (a band of 1/16 of the side) in CIE Lab;
  2. every pixel's distance to it in chroma (a, b) plus a small share of the lightness difference;
  3. an Otsu threshold on that distance (at least MIN_DISTANCE, so a leaf-free photo stays empty),
     then closing and opening (elliptic, ~1/40 of the side), the largest connected component and every
     component at least 1/8 its size, holes filled;
  4. the edge softened by a one-pixel Gaussian, so composited leaves have no jagged rim.
Computed once per photo when an image-folder cache is built (train/images.py stores it beside the
pixels) and by benchmarks/shifted_accuracy.py; never per training step.
"""

from __future__ import annotations

import numpy as np

BORDER_SHARE = 1 / 16            # width of the border band whose median is the sheet's colour
LIGHTNESS_SHARE = 0.25           # weight of the lightness difference beside chroma
MIN_DISTANCE = 12.0              # Lab units: below this no pixel is leaf, whatever Otsu says
KEEP_SHARE = 1 / 8               # components at least this share of the largest are kept


def _opencv():
    import cv2

    return cv2


def border_pixels(hwc: np.ndarray) -> np.ndarray:
    """[K, C] pixels of the band of BORDER_SHARE of the side along the four edges of an [H, W, C] image."""
    height, width = hwc.shape[:2]
    channels = hwc.shape[2] if hwc.ndim == 3 else 1
    band = max(1, round(min(height, width) * BORDER_SHARE))
    return np.concatenate([hwc[:band].reshape(-1, channels), hwc[-band:].reshape(-1, channels),
                           hwc[:, :band].reshape(-1, channels), hwc[:, -band:].reshape(-1, channels)])


def sheet_colour(hwc: np.ndarray) -> np.ndarray:
    """The background sheet's colour of an [H, W, C] photo: the median of its border band, per channel."""
    return np.median(border_pixels(hwc), axis=0)


def leaf_mask(image: np.ndarray, color: str = "rgb") -> np.ndarray:
    """uint8 [H, W] soft mask (0 background .. 255 leaf) of image uint8 [3, H, W] in `color` order."""
    cv2 = _opencv()
    _, height, width = image.shape
    hwc = np.ascontiguousarray(image.transpose(1, 2, 0))
    lab = cv2.cvtColor(hwc, cv2.COLOR_RGB2LAB if color == "rgb" else cv2.COLOR_BGR2LAB).astype(np.float32)
    difference = lab - sheet_colour(lab)
    distance = np.sqrt(difference[..., 1] ** 2 + difference[..., 2] ** 2
                       + (LIGHTNESS_SHARE * difference[..., 0]) ** 2)
    scaled = np.clip(distance * 2, 0, 255).astype(np.uint8)          # Lab distance 0..127.5 -> 0..255
    otsu, _ = cv2.threshold(scaled, 0, 255, cv2.THRESH_BINARY + cv2.THRESH_OTSU)
    binary = (scaled > max(otsu, 2 * MIN_DISTANCE)).astype(np.uint8) * 255
    side = max(3, round(min(height, width) / 40) | 1)
    kernel = cv2.getStructuringElement(cv2.MORPH_ELLIPSE, (side, side))
    binary = cv2.morphologyEx(binary, cv2.MORPH_CLOSE, kernel)
    binary = cv2.morphologyEx(binary, cv2.MORPH_OPEN, kernel)
    count, components, stats, _ = cv2.connectedComponentsWithStats(binary, connectivity=8)
    if count <= 1:
        return np.zeros((height, width), np.uint8)
    areas = stats[1:, cv2.CC_STAT_AREA]
    keep = np.flatnonzero(areas >= KEEP_SHARE * areas.max()) + 1
    solid = np.isin(components, keep).astype(np.uint8) * 255
    contours, _ = cv2.findContours(solid, cv2.RETR_EXTERNAL, cv2.CHAIN_APPROX_SIMPLE)
    filled = np.zeros_like(solid)
    cv2.drawContours(filled, contours, -1, 255, thickness=cv2.FILLED)
    return cv2.GaussianBlur(filled, (0, 0), 1.0)
