"""Image augmentation on CPU worker threads, for uint8 [N, C, H, W] batches (C = 1 or 3).

Per image, in this order (each image draws its own settings):
  1. one affine warp (cv2.warpAffine, bilinear, reflected border) that does at once:
     random resized crop: a window of `crop_area` (fraction of the image area) and aspect ratio in
     `crop_ratio`, anywhere in the image, scaled back to the full size; a rotation by up to
     +-`rotation` degrees about the window's centre; a horizontal and a vertical flip, each with
     probability 1/2 (`flips`);
  2. brightness (x * b), contrast (blend with the image's mean grey level) and saturation (blend
     with each pixel's grey level), factors uniform in 1 +- `brightness` / `contrast` / `saturation`;
  3. with probability `blur_p`, a Gaussian blur of sigma uniform in `blur_sigma`.
Images stay uint8 (the trainer normalizes inside its step).

Reproducible: all random settings of a batch are drawn up front from one Generator, so the result
depends on the seed only, not on how the threads are scheduled. AugmentedDataset seeds each batch
from (seed, the batch's row indices); the Trainer's row order derives from (training seed, epoch),
so a resumed run augments exactly as the uninterrupted run would have.

Speed: OpenCV releases the GIL, so `workers` threads scale across cores. AugmentedDataset.batch is
what the Trainer's Prefetcher thread calls for a non-in-memory dataset, so augmentation of the next
batches overlaps the training step of the current one.
"""

from __future__ import annotations

import math
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

from lnn.formats.errors import LnnInputError
from lnn.train.data import ArrayDataset

_cv2 = None


def _opencv():
    global _cv2
    if _cv2 is None:
        import cv2

        _cv2 = cv2
    return _cv2


# grey level weights (ITU-R BT.601) in the image's channel order
GREY = {"rgb": (0.299, 0.587, 0.114), "bgr": (0.114, 0.587, 0.299), "gray": (1.0,)}


@dataclass
class Augmenter:
    color: str = "rgb"                   # channel order of the images: rgb, bgr or gray
    crop_area: tuple = (0.6, 1.0)
    crop_ratio: tuple = (3 / 4, 4 / 3)
    rotation: float = 30.0               # degrees, either way
    flips: bool = True
    brightness: float = 0.2
    contrast: float = 0.2
    saturation: float = 0.2
    blur_p: float = 0.2
    blur_sigma: tuple = (0.3, 1.2)
    workers: int | None = None           # threads (default: the CPU count, at most 8)

    def __post_init__(self):
        self._pool = None

    # ------------------------------------------------------------------ random settings

    def draw(self, rng: np.random.Generator, count: int, height: int, width: int) -> dict:
        """Every random setting of `count` images, as arrays (so threads only compute)."""
        area = rng.uniform(*self.crop_area, count)
        ratio = np.exp(rng.uniform(math.log(self.crop_ratio[0]), math.log(self.crop_ratio[1]), count))
        crop_w = np.minimum(np.sqrt(area * ratio), 1.0) * width
        crop_h = np.minimum(np.sqrt(area / ratio), 1.0) * height
        flip_x = rng.random(count) < 0.5 if self.flips else np.zeros(count, bool)
        flip_y = rng.random(count) < 0.5 if self.flips else np.zeros(count, bool)
        return {
            "crop_w": crop_w, "crop_h": crop_h,
            "centre_x": crop_w / 2 + rng.random(count) * (width - crop_w),
            "centre_y": crop_h / 2 + rng.random(count) * (height - crop_h),
            "angle": np.radians(rng.uniform(-self.rotation, self.rotation, count)),
            "flip_x": flip_x, "flip_y": flip_y,
            "brightness": rng.uniform(1 - self.brightness, 1 + self.brightness, count),
            "contrast": rng.uniform(1 - self.contrast, 1 + self.contrast, count),
            "saturation": rng.uniform(1 - self.saturation, 1 + self.saturation, count),
            "blur": np.where(rng.random(count) < self.blur_p, rng.uniform(*self.blur_sigma, count), 0.0),
        }

    # ------------------------------------------------------------------ one image

    @staticmethod
    def warp_matrix(settings: dict, i: int, height: int, width: int) -> np.ndarray:
        """2x3 map from output pixel (x, y) to source pixel: centre, flip, scale to the window, rotate, move."""
        scale_x = settings["crop_w"][i] / width * (-1 if settings["flip_x"][i] else 1)
        scale_y = settings["crop_h"][i] / height * (-1 if settings["flip_y"][i] else 1)
        cos, sin = math.cos(settings["angle"][i]), math.sin(settings["angle"][i])
        linear = np.array([[cos, -sin], [sin, cos]]) @ np.diag([scale_x, scale_y])
        out_centre = np.array([(width - 1) / 2, (height - 1) / 2])
        src_centre = np.array([settings["centre_x"][i] - 0.5, settings["centre_y"][i] - 0.5])
        return np.hstack([linear, (src_centre - linear @ out_centre)[:, None]])

    def colour_matrix(self, settings: dict, i: int, channel_means) -> np.ndarray:
        """[C, C+1] affine map of a pixel for brightness, contrast and saturation together (see the module doc):
        y = a * x + offset with a = brightness * contrast, offset = (1 - contrast) * brightness * mean grey;
        then y' = s * y + (1 - s) * grey(y), which is linear in x too."""
        grey = np.asarray(GREY[self.color])
        brightness, contrast = settings["brightness"][i], settings["contrast"][i]
        scale = brightness * contrast
        offset = (1 - contrast) * brightness * float(grey @ np.asarray(channel_means[:len(grey)]))
        saturation = settings["saturation"][i] if len(grey) == 3 else 1.0
        mix = saturation * np.eye(len(grey)) + (1 - saturation) * np.outer(np.ones(len(grey)), grey)
        return np.hstack([scale * mix, np.full((len(grey), 1), offset)])

    def augment_one(self, image: np.ndarray, settings: dict, i: int, out: np.ndarray) -> None:
        """image uint8 [C, H, W] -> out[...] (same shape), with settings row i. Only OpenCV calls, which
        release the GIL, do the pixel work."""
        cv2 = _opencv()
        channels, height, width = image.shape
        hwc = np.ascontiguousarray(image.transpose(1, 2, 0))
        x = cv2.warpAffine(hwc, self.warp_matrix(settings, i, height, width), (width, height),
                           flags=cv2.INTER_LINEAR | cv2.WARP_INVERSE_MAP, borderMode=cv2.BORDER_REFLECT_101)
        x = cv2.transform(x.reshape(height, width, channels), self.colour_matrix(settings, i, cv2.mean(x)))
        if settings["blur"][i] > 0:
            x = cv2.GaussianBlur(x, (0, 0), float(settings["blur"][i]), borderType=cv2.BORDER_REFLECT_101)
        out[...] = x.reshape(height, width, channels).transpose(2, 0, 1)

    # ------------------------------------------------------------------ a batch

    def __call__(self, images: np.ndarray, rng: np.random.Generator) -> np.ndarray:
        """uint8 [N, C, H, W] -> a new augmented uint8 [N, C, H, W]."""
        images = np.asarray(images)
        count, _, height, width = images.shape
        settings = self.draw(rng, count, height, width)
        out = np.empty_like(images)
        workers = self.workers or min(8, os.cpu_count() or 1)
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="lnn-augment")
        chunks = np.array_split(np.arange(count), min(workers, count))

        def run(rows):
            for i in rows:
                self.augment_one(images[i], settings, i, out[i])

        list(self._pool.map(run, chunks))
        return out


class AugmentedDataset(ArrayDataset):
    """Rows of a source dataset (repeats allowed), augmented as they are read (an ArrayDataset in
    interface: len, labels, sample_shape, limit, batch; the images are never held).

    `in_memory = False`, so the Trainer reads it through its Prefetcher thread (`batch` is the
    prefetch `load` function) instead of moving it to the GPU once: augmentation runs ahead on the
    CPU while the device trains."""

    in_memory = False

    def __init__(self, source: ArrayDataset, rows, augmenter: Augmenter, seed: int = 0, name: str = "augmented"):
        self.source, self.rows = source, np.asarray(rows, np.int64)
        if len(self.rows) == 0:
            raise LnnInputError(f"{name}: the dataset is empty")
        self.augmenter, self.seed, self.name = augmenter, seed, name
        self.labels = np.asarray(source.labels)[self.rows]

    def __len__(self) -> int:
        return len(self.rows)

    @property
    def sample_shape(self) -> tuple:
        return self.source.sample_shape

    def limit(self, count: int | None) -> "AugmentedDataset":
        if count is None or count >= len(self):
            return self
        return AugmentedDataset(self.source, self.rows[:count], self.augmenter, self.seed, self.name)

    def batch(self, indices: np.ndarray):
        indices = np.asarray(indices, np.int64)
        images, labels = self.source.batch(self.rows[indices])
        rng = np.random.default_rng([self.seed, *indices.tolist()])
        return self.augmenter(images, rng), labels
