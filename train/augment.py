"""Image augmentation on CPU worker threads, for uint8 [N, C, H, W] batches (C = 1 or 3).

Switched on and tuned in the description's training block (`augmenter_from_block`, checked when the
description is parsed; every error names its field):

    "training": {"augment": {
        "crop":        {"area": [0.6, 1.0], "ratio": [0.75, 1.333]},   random resized crop (zoom in)
        "flips":       true,                                            horizontal and vertical, each p 1/2
        "rotation":    30,                                              degrees, either way
        "scale":       {"p": 0.5, "range": [0.45, 1.0]},                leaf shrunk to this linear size
        "perspective": {"p": 0.3, "strength": 0.08},                    corners moved by up to this share
        "background":  {"p": 0.7, "kinds": ["soil", "foliage", "texture", "clutter"], "shadow": 0.5},
        "lighting":    {"brightness": 0.3, "contrast": 0.3, "saturation": 0.3, "hue": 8,
                        "white_balance": 0.1, "gamma": 0.3, "gradient": 0.3},
        "blur":        {"p": 0.3, "sigma": [0.3, 2.0]},
        "noise":       {"p": 0.3, "sigma": [2, 10]},
        "jpeg_quality": {"p": 0.4, "range": [30, 90]},
        "erasing":     {"p": 0.25, "area": [0.02, 0.12]}
    }}

`"augment": false` trains on the photos as they are (like --no-augment); no "augment" field, or `true`,
keeps the classic set (crop, flips, rotation 30, brightness/contrast/saturation 0.2, blur p 0.2) with
every newer transform off. Inside the block, a transform left out keeps that classic setting (off for
scale, perspective, background, noise, jpeg_quality, erasing and the lighting fields beyond the
classic three), `false` or null turns it off, `true` turns it on with the values shown above
(RECOMMENDED), and an object sets some fields, the others taking the values above.

Per image, in this order (each image draws its own settings; p is the probability of a transform):
  1. one warp (cv2.warpAffine, or warpPerspective with a perspective jitter) that does at once: the
     crop window, rotation by up to +-rotation degrees, the flips, the shrink to `scale` of the frame
     about its centre, and the perspective jitter (each corner moved by up to strength * side).
     The border is reflected;
  2. background: with its leaf mask (train/segment.py, computed when the dataset cache was built) warped
     the same way, the leaf is composited onto a procedural background (train/backgrounds.py) of a
     kind drawn from `kinds`, with probability `shadow` a soft drop shadow under it. A shrunk leaf
     that draws no new background is composited onto a plain sheet of its photo's own background
     colour (no mirrored copies of the leaf around it). Images without a mask (the outlier photos of
     outlier exposure), or whose mask found no leaf, keep theirs, reflected where shrunk (so no class
     label ever lands on a picture without its leaf);
  3. random erasing: a rectangle of `area` (share of the image, aspect 1/3..3) filled with noise;
  4. lighting as one affine colour map (cv2.transform): brightness (x * b), contrast (blend with the
     mean grey level), saturation (blend with each pixel's grey level), each factor uniform in 1 +-
     amount; a hue rotation by up to +-hue degrees; per-channel gains exp(+-white_balance); then a
     gamma exp(+-gamma) (a lookup table) and a linear illumination ramp of slope up to +-gradient across
     the frame in a random direction;
  5. Gaussian blur of sigma uniform in `sigma`;  6. Gaussian noise of sigma (grey levels) in `sigma`;
  7. JPEG re-encoding at a quality uniform in `range` (the chroma conversion in the right colour order).
Images stay uint8 (the trainer normalizes inside its step).

Reproducible: all random settings of a batch, including one seed per image for its pixel-level draws
(background, noise, erasing fill), are drawn up front from one Generator, so the result depends on the
seed only, not on how the threads are scheduled. AugmentedDataset seeds each batch from (seed, the
batch's row indices); the Trainer's row order derives from (training seed, epoch), so a resumed run
augments exactly as the uninterrupted run would have.

Speed: OpenCV and NumPy's array loops release the GIL, so `workers` threads scale across cores
(default: every core) as far as the Python between those calls (about a sixth of an image's time)
lets them; with `processes=True` the rows go to `workers` spawned processes instead (the settings are
still drawn here, so the images are identical either way), which lnn-train uses on machines of more
than PROCESSES_ABOVE cores. AugmentedDataset.batch is what the Trainer's Prefetcher thread calls for a
non-in-memory dataset, so augmentation of the next batches overlaps the training step of the current
one. benchmarks/augment_speed.py measures images/s.
"""

from __future__ import annotations

import math
import os
import threading
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor
from dataclasses import dataclass, fields

import numpy as np

from lnn.formats.errors import LnnInputError, ModelSpecError
from lnn.train.backgrounds import GENERATORS, TRAINING_KINDS, background
from lnn.train.data import ArrayDataset
from lnn.train.segment import sheet_colour

_cv2 = None


def _opencv():
    global _cv2
    if _cv2 is None:
        import cv2

        _cv2 = cv2
    return _cv2


# grey level weights (ITU-R BT.601) in the image's channel order
GREY = {"rgb": (0.299, 0.587, 0.114), "bgr": (0.114, 0.587, 0.299), "gray": (1.0,)}
ERASING_ASPECT = (1 / 3, 3.0)
PROCESSES_ABOVE = 4                     # cores; above this lnn-train augments in processes, not threads
PROCESS_TASK_ROWS = 8                   # rows per task of a worker process (each task is pickled both ways)
SHADOW_OFFSET = 0.04                    # drop shadow: shifted by up to this share of the side


def hue_rotation(degrees: float, color: str) -> np.ndarray:
    """3x3 map that turns the hue by `degrees` about the grey axis, keeping luminance (the W3C
    hue-rotate filter matrix), in the image's channel order."""
    c, s = math.cos(math.radians(degrees)), math.sin(math.radians(degrees))
    rgb = np.array([[0.213 + 0.787 * c - 0.213 * s, 0.715 - 0.715 * c - 0.715 * s, 0.072 - 0.072 * c + 0.928 * s],
                    [0.213 - 0.213 * c + 0.143 * s, 0.715 + 0.285 * c + 0.140 * s, 0.072 - 0.072 * c - 0.283 * s],
                    [0.213 - 0.213 * c - 0.787 * s, 0.715 - 0.715 * c + 0.715 * s, 0.072 + 0.928 * c + 0.072 * s]])
    return rgb[::-1, ::-1] if color == "bgr" else rgb


@dataclass
class Augmenter:
    color: str = "rgb"                   # channel order of the images: rgb, bgr or gray
    crop_area: tuple = (0.6, 1.0)
    crop_ratio: tuple = (3 / 4, 4 / 3)
    rotation: float = 30.0               # degrees, either way
    flips: bool = True
    scale_p: float = 0.0
    scale_range: tuple = (0.45, 1.0)
    perspective_p: float = 0.0
    perspective: float = 0.08
    background_p: float = 0.0
    background_kinds: tuple = TRAINING_KINDS
    shadow_p: float = 0.5
    erasing_p: float = 0.0
    erasing_area: tuple = (0.02, 0.12)
    brightness: float = 0.2
    contrast: float = 0.2
    saturation: float = 0.2
    hue: float = 0.0                     # degrees, either way
    white_balance: float = 0.0
    gamma: float = 0.0
    gradient: float = 0.0
    blur_p: float = 0.2
    blur_sigma: tuple = (0.3, 1.2)
    noise_p: float = 0.0
    noise_sigma: tuple = (2.0, 10.0)
    jpeg_p: float = 0.0
    jpeg_quality: tuple = (30, 90)
    workers: int | None = None           # threads or processes (default: the CPU count)
    processes: bool = False              # spawned worker processes instead of threads

    def __post_init__(self):
        self._pool = None
        self._pool_lock = threading.Lock()   # batches may be augmented from two threads at once

    def __getstate__(self):              # what a worker process receives: the settings, not the pool
        return {key: value for key, value in self.__dict__.items() if key not in ("_pool", "_pool_lock")}

    def __setstate__(self, state):
        self.__dict__.update(state)
        self.__post_init__()

    @property
    def batches_at_once(self) -> int:
        """How many batches lnn-train should augment at once (Prefetcher's `loaders`): one with threads;
        with processes, enough that tasks of PROCESS_TASK_ROWS rows keep every worker busy twice over
        (a 32-row batch alone is 4 tasks)."""
        if not self.processes:
            return 1
        return max(2, (self.workers or os.cpu_count() or 1) // 2)

    def close(self) -> None:
        """Stop the worker threads or processes (they start again when needed)."""
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None

    @property
    def uses_masks(self) -> bool:
        return self.background_p > 0 or self.scale_p > 0

    # ------------------------------------------------------------------ random settings

    def draw(self, rng: np.random.Generator, count: int, height: int, width: int) -> dict:
        """Every random setting of `count` images, as arrays (so threads only compute)."""
        area = rng.uniform(*self.crop_area, count)
        ratio = np.exp(rng.uniform(math.log(self.crop_ratio[0]), math.log(self.crop_ratio[1]), count))
        crop_w = np.minimum(np.sqrt(area * ratio), 1.0) * width
        crop_h = np.minimum(np.sqrt(area / ratio), 1.0) * height
        flip_x = rng.random(count) < 0.5 if self.flips else np.zeros(count, bool)
        flip_y = rng.random(count) < 0.5 if self.flips else np.zeros(count, bool)

        def sometimes(p, values):
            return np.where(rng.random(count) < p, values, 0.0)

        erase_area = rng.uniform(*self.erasing_area, count) * height * width
        erase_aspect = np.exp(rng.uniform(*np.log(ERASING_ASPECT), count))
        erase_w = np.minimum(np.sqrt(erase_area * erase_aspect), width)
        erase_h = np.minimum(np.sqrt(erase_area / erase_aspect), height)
        return {
            "crop_w": crop_w, "crop_h": crop_h,
            "centre_x": crop_w / 2 + rng.random(count) * (width - crop_w),
            "centre_y": crop_h / 2 + rng.random(count) * (height - crop_h),
            "angle": np.radians(rng.uniform(-self.rotation, self.rotation, count)),
            "flip_x": flip_x, "flip_y": flip_y,
            "scale": np.where(rng.random(count) < self.scale_p, rng.uniform(*self.scale_range, count), 1.0),
            "corners": sometimes(self.perspective_p, 1.0)[:, None, None]
            * rng.uniform(-self.perspective, self.perspective, (count, 4, 2)) * np.array([width, height]),
            "background": np.where(rng.random(count) < self.background_p,
                                   rng.integers(0, len(self.background_kinds), count), -1),
            "shadow": rng.random(count) < self.shadow_p,
            "erase": rng.random(count) < self.erasing_p,
            "erase_box": np.stack([rng.random(count) * (width - erase_w), rng.random(count) * (height - erase_h),
                                   erase_w, erase_h], 1),
            "brightness": rng.uniform(1 - self.brightness, 1 + self.brightness, count),
            "contrast": rng.uniform(1 - self.contrast, 1 + self.contrast, count),
            "saturation": rng.uniform(1 - self.saturation, 1 + self.saturation, count),
            "hue": rng.uniform(-self.hue, self.hue, count),
            "gains": np.exp(rng.uniform(-self.white_balance, self.white_balance, (count, 3))),
            "gamma": np.exp(rng.uniform(-self.gamma, self.gamma, count)),
            "gradient": rng.uniform(-self.gradient, self.gradient, count),
            "gradient_angle": rng.uniform(0, 2 * math.pi, count),
            "blur": sometimes(self.blur_p, rng.uniform(*self.blur_sigma, count)),
            "noise": sometimes(self.noise_p, rng.uniform(*self.noise_sigma, count)),
            "jpeg": sometimes(self.jpeg_p, rng.integers(self.jpeg_quality[0], self.jpeg_quality[1] + 1, count)),
            "seed": rng.integers(0, 2 ** 63, count),
        }

    # ------------------------------------------------------------------ one image

    @staticmethod
    def warp_matrix(settings: dict, i: int, height: int, width: int) -> np.ndarray:
        """2x3 map from output pixel (x, y) to source pixel: centre, shrink (scale), flip, scale to the
        window, rotate, move."""
        shrink = 1 / settings["scale"][i]
        scale_x = settings["crop_w"][i] / width * (-1 if settings["flip_x"][i] else 1) * shrink
        scale_y = settings["crop_h"][i] / height * (-1 if settings["flip_y"][i] else 1) * shrink
        cos, sin = math.cos(settings["angle"][i]), math.sin(settings["angle"][i])
        linear = np.array([[cos, -sin], [sin, cos]]) @ np.diag([scale_x, scale_y])
        out_centre = np.array([(width - 1) / 2, (height - 1) / 2])
        src_centre = np.array([settings["centre_x"][i] - 0.5, settings["centre_y"][i] - 0.5])
        return np.hstack([linear, (src_centre - linear @ out_centre)[:, None]])

    @staticmethod
    def perspective_matrix(settings: dict, i: int, height: int, width: int) -> np.ndarray | None:
        """3x3 map from output pixel to source pixel with the corner jitter, or None without one."""
        jitter = settings["corners"][i]
        if not np.any(jitter):
            return None
        cv2 = _opencv()
        corners = np.array([[0, 0], [width - 1, 0], [width - 1, height - 1], [0, height - 1]], np.float32)
        moved = cv2.getPerspectiveTransform(corners, (corners + jitter).astype(np.float32))
        affine = np.vstack([Augmenter.warp_matrix(settings, i, height, width), [0, 0, 1]])
        return affine @ moved

    def colour_matrix(self, settings: dict, i: int, channel_means) -> np.ndarray:
        """[C, C+1] affine map of a pixel for brightness, contrast, saturation, hue and white balance together
        (see the module doc): y = a * x + offset with a = brightness * contrast, offset = (1 - contrast) *
        brightness * mean grey; then y' = s * y + (1 - s) * grey(y), hue rotation and gains before it: all
        linear in x."""
        grey = np.asarray(GREY[self.color])
        brightness, contrast = settings["brightness"][i], settings["contrast"][i]
        scale = brightness * contrast
        offset = (1 - contrast) * brightness * float(grey @ np.asarray(channel_means[:len(grey)]))
        if len(grey) == 1:
            return np.array([[scale, offset]])
        saturation = settings["saturation"][i]
        mix = saturation * np.eye(3) + (1 - saturation) * np.outer(np.ones(3), grey)
        colour = mix @ hue_rotation(settings["hue"][i], self.color) @ np.diag(settings["gains"][i])
        return np.hstack([scale * colour, np.full((3, 1), offset)])

    def _background(self, settings, i, rng, height, width, mask, sheet):
        """The procedural background (in the image's colour order and channels) with its drop shadow; a plain
        `sheet` colour (the photo's own, in its channel order) when the image draws no new background."""
        cv2 = _opencv()
        kind = settings["background"][i]
        if kind < 0:                     # a shrunk leaf keeps its plain sheet, extended
            picture = np.empty((height, width, 3), np.uint8)
            picture[...] = np.rint(sheet).astype(np.uint8)
        else:
            picture = background(self.background_kinds[kind], rng, height, width)
        if self.color == "bgr" and kind >= 0:
            picture = np.ascontiguousarray(picture[:, :, ::-1])
        if self.color == "gray":
            picture = picture[:, :, 0] if kind < 0 else cv2.cvtColor(picture, cv2.COLOR_RGB2GRAY)
        if settings["shadow"][i]:
            dx, dy = rng.uniform(-SHADOW_OFFSET, SHADOW_OFFSET, 2) * (width, height) * 2
            shifted = cv2.warpAffine(mask, np.float32([[1, 0, dx], [0, 1, dy]]), (width, height))
            shade = cv2.GaussianBlur(shifted, (0, 0), rng.uniform(1, 4)).astype(np.float32)
            darkness = 1 - rng.uniform(0.25, 0.6) / 255 * shade
            picture = cv2.multiply(picture, cv2.merge([darkness] * picture.shape[2]) if picture.ndim == 3
                                   else darkness, dtype=cv2.CV_8U)
        return picture

    def augment_one(self, image: np.ndarray, settings: dict, i: int, out: np.ndarray, mask=None) -> None:
        """image uint8 [C, H, W] (mask uint8 [H, W] or None) -> out[...] (same shape), with settings row i.
        The pixel work is OpenCV calls and NumPy array loops, which release the GIL."""
        cv2 = _opencv()
        channels, height, width = image.shape
        rng = np.random.default_rng(int(settings["seed"][i]))
        hwc = np.ascontiguousarray(image.transpose(1, 2, 0))
        projective = self.perspective_matrix(settings, i, height, width)

        def warp(pixels, border_mode):
            flags = cv2.INTER_LINEAR | cv2.WARP_INVERSE_MAP
            if projective is None:
                return cv2.warpAffine(pixels, self.warp_matrix(settings, i, height, width), (width, height),
                                      flags=flags, borderMode=border_mode)
            return cv2.warpPerspective(pixels, projective, (width, height), flags=flags, borderMode=border_mode)

        x = warp(hwc, cv2.BORDER_REFLECT_101).reshape(height, width, channels)
        if mask is not None and mask.max() >= 128 and (settings["background"][i] >= 0 or settings["scale"][i] < 1):
            leaf = warp(np.ascontiguousarray(mask), cv2.BORDER_CONSTANT)
            sheet = sheet_colour(hwc) if settings["background"][i] < 0 else None
            picture = self._background(settings, i, rng, height, width, leaf, sheet).reshape(height, width, channels)
            weight = leaf.astype(np.float32) / 255
            x = cv2.blendLinear(x, picture, weight, 1 - weight).reshape(height, width, channels)
        if settings["erase"][i]:
            left, top, box_w, box_h = settings["erase_box"][i]
            rows = slice(int(top), int(top + max(box_h, 1)))
            columns = slice(int(left), int(left + max(box_w, 1)))
            patch = x[rows, columns]
            x[rows, columns] = rng.integers(0, 256, patch.shape, dtype=np.uint8) if rng.random() < 0.5 else \
                rng.integers(0, 256, channels, dtype=np.uint8)
        x = cv2.transform(x, self.colour_matrix(settings, i, cv2.mean(x))).reshape(height, width, channels)
        if settings["gamma"][i] != 1:
            table = np.clip(np.rint(255 * (np.arange(256) / 255) ** settings["gamma"][i]), 0, 255).astype(np.uint8)
            x = cv2.LUT(x, table).reshape(height, width, channels)
        if settings["gradient"][i] != 0:
            angle = settings["gradient_angle"][i]
            ys, xs = np.ogrid[-1:1:height * 1j, -1:1:width * 1j]
            ramp = (1 + settings["gradient"][i] * (xs * math.cos(angle) + ys * math.sin(angle))).astype(np.float32)
            x = cv2.multiply(x, cv2.merge([ramp] * channels), dtype=cv2.CV_8U).reshape(height, width, channels)
        if settings["blur"][i] > 0:
            x = cv2.GaussianBlur(x, (0, 0), float(settings["blur"][i]),
                                 borderType=cv2.BORDER_REFLECT_101).reshape(height, width, channels)
        if settings["noise"][i] > 0:
            noise = rng.standard_normal((height, width, channels), dtype=np.float32)
            noise *= np.float32(settings["noise"][i])
            x = cv2.add(x, noise, dtype=cv2.CV_8U).reshape(height, width, channels)
        if settings["jpeg"][i] > 0:
            x = self._jpeg(x, int(settings["jpeg"][i])).reshape(height, width, channels)
        out[...] = x.transpose(2, 0, 1)

    def _jpeg(self, x: np.ndarray, quality: int) -> np.ndarray:
        """Encode and decode as a JPEG of `quality` (OpenCV's codec takes BGR; rgb is swapped around it)."""
        cv2 = _opencv()
        swap = self.color == "rgb"
        ok, data = cv2.imencode(".jpg", np.ascontiguousarray(x[:, :, ::-1]) if swap else x,
                                [cv2.IMWRITE_JPEG_QUALITY, quality])
        decoded = cv2.imdecode(data, cv2.IMREAD_GRAYSCALE if x.shape[2] == 1 else cv2.IMREAD_COLOR)
        return np.ascontiguousarray(decoded[:, :, ::-1]) if swap else decoded

    # ------------------------------------------------------------------ a batch

    def __call__(self, images: np.ndarray, rng: np.random.Generator, masks=None) -> np.ndarray:
        """uint8 [N, C, H, W] (and masks uint8 [N, H, W] for background replacement) -> a new augmented
        uint8 [N, C, H, W]."""
        images = np.asarray(images)
        count, _, height, width = images.shape
        settings = self.draw(rng, count, height, width)
        workers = self.workers or os.cpu_count() or 1
        tasks = min(workers, -(-count // PROCESS_TASK_ROWS)) if self.processes else min(workers, count)
        chunks = np.array_split(np.arange(count), tasks)
        with self._pool_lock:
            if self._pool is None:
                if self.processes:
                    import multiprocessing

                    self._pool = ProcessPoolExecutor(max_workers=workers, initializer=_one_opencv_thread,
                                                     mp_context=multiprocessing.get_context("spawn"))
                else:
                    self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="lnn-augment")
        if self.processes:
            parts = self._pool.map(augment_rows, [self] * len(chunks), [images[rows] for rows in chunks],
                                   [None if masks is None else np.asarray(masks[rows]) for rows in chunks],
                                   [{key: value[rows] for key, value in settings.items()} for rows in chunks])
            return np.concatenate(list(parts))
        out = np.empty_like(images)

        def run(rows):
            for i in rows:
                self.augment_one(images[i], settings, i, out[i], None if masks is None else masks[i])

        list(self._pool.map(run, chunks))
        return out


def _one_opencv_thread() -> None:
    """A worker process's OpenCV runs on one thread (the processes already fill the cores)."""
    _opencv().setNumThreads(1)


def augment_rows(augmenter: Augmenter, images: np.ndarray, masks, settings: dict) -> np.ndarray:
    """Every row of `images` with its row of `settings` (what a worker process runs)."""
    out = np.empty_like(images)
    for i in range(len(images)):
        augmenter.augment_one(images[i], settings, i, out[i], None if masks is None else masks[i])
    return out


# --------------------------------------------------------------------------- the description's block

CLASSIC = {field.name: field.default for field in fields(Augmenter)}


def _probability(value):
    return isinstance(value, (int, float)) and not isinstance(value, bool) and 0 <= value <= 1


def _number_in(low, high):
    def check(value):
        return isinstance(value, (int, float)) and not isinstance(value, bool) and low <= value <= high
    check.wants = f"a number from {low} to {high}"
    return check


def _range_in(low, high, integers=False):
    def check(value):
        return (isinstance(value, (list, tuple)) and len(value) == 2
                and all(isinstance(v, int if integers else (int, float)) and not isinstance(v, bool) for v in value)
                and low <= value[0] <= value[1] <= high)
    check.wants = f"[low, high] with {low} <= low <= high <= {high}" + (" (integers)" if integers else "")
    return check


_probability.wants = "a probability from 0 to 1"

# block -> {field in the block: (Augmenter field, check, recommended value)}; "off" values per block
SCHEMA = {
    "crop": {"area": ("crop_area", _range_in(0.05, 1.0), (0.6, 1.0)),
             "ratio": ("crop_ratio", _range_in(0.2, 5.0), (3 / 4, 4 / 3))},
    "scale": {"p": ("scale_p", _probability, 0.5), "range": ("scale_range", _range_in(0.2, 1.0), (0.45, 1.0))},
    "perspective": {"p": ("perspective_p", _probability, 0.3),
                    "strength": ("perspective", _number_in(0.0, 0.3), 0.08)},
    "background": {"p": ("background_p", _probability, 0.7), "kinds": ("background_kinds", None, TRAINING_KINDS),
                   "shadow": ("shadow_p", _probability, 0.5)},
    "lighting": {"brightness": ("brightness", _number_in(0.0, 0.9), 0.3),
                 "contrast": ("contrast", _number_in(0.0, 0.9), 0.3),
                 "saturation": ("saturation", _number_in(0.0, 1.0), 0.3),
                 "hue": ("hue", _number_in(0.0, 180.0), 8.0),
                 "white_balance": ("white_balance", _number_in(0.0, 0.5), 0.1),
                 "gamma": ("gamma", _number_in(0.0, 1.0), 0.3),
                 "gradient": ("gradient", _number_in(0.0, 0.9), 0.3)},
    "blur": {"p": ("blur_p", _probability, 0.3), "sigma": ("blur_sigma", _range_in(0.05, 10.0), (0.3, 2.0))},
    "noise": {"p": ("noise_p", _probability, 0.3), "sigma": ("noise_sigma", _range_in(0.0, 60.0), (2.0, 10.0))},
    "jpeg_quality": {"p": ("jpeg_p", _probability, 0.4), "range": ("jpeg_quality", _range_in(1, 100, True), (30, 90))},
    "erasing": {"p": ("erasing_p", _probability, 0.25), "area": ("erasing_area", _range_in(0.001, 0.5), (0.02, 0.12))},
}
OFF = {"crop": {"crop_area": (1.0, 1.0), "crop_ratio": (1.0, 1.0)}, "scale": {"scale_p": 0.0},
       "perspective": {"perspective_p": 0.0}, "background": {"background_p": 0.0},
       "lighting": {name: 0.0 for name, _, _ in SCHEMA["lighting"].values()}, "blur": {"blur_p": 0.0},
       "noise": {"noise_p": 0.0}, "jpeg_quality": {"jpeg_p": 0.0}, "erasing": {"erasing_p": 0.0}}
RECOMMENDED = {block: {key: spec[2] for key, spec in entries.items()} for block, entries in SCHEMA.items()}
RECOMMENDED.update(flips=True, rotation=30)
KNOWN = ("crop", "flips", "rotation", *[key for key in SCHEMA if key != "crop"])


def _bad(where: str, wants: str, value) -> ModelSpecError:
    return ModelSpecError(f"training.augment.{where} must be {wants}, not {value!r}")


def _block(name: str, value) -> dict:
    """Augmenter fields for one transform's value: false/null (off), true (recommended) or an object."""
    if value is None or value is False:
        return dict(OFF[name])
    if value is True:
        value = {}
    if not isinstance(value, dict):
        raise _bad(name, "true, false or an object with " + ", ".join(SCHEMA[name]), value)
    unknown = sorted(set(value) - set(SCHEMA[name]))
    if unknown:
        raise ModelSpecError(f"training.augment.{name}: unknown field {unknown[0]!r}; known: {', '.join(SCHEMA[name])}")
    out = {}
    for key, (target, check, recommended) in SCHEMA[name].items():
        given = value.get(key, recommended)
        if key == "kinds":
            if (not isinstance(given, (list, tuple)) or not given
                    or any(kind not in TRAINING_KINDS for kind in given)):
                raise _bad(f"{name}.kinds", "a non-empty list of " + ", ".join(TRAINING_KINDS), given)
            given = tuple(given)
        elif not check(given):
            raise _bad(f"{name}.{key}", check.wants, given)
        out[target] = tuple(given) if isinstance(given, list) else given
    return out


def parse_augment(value) -> dict | None:
    """The description's training.augment -> Augmenter keyword arguments (None: no augmentation)."""
    if value is False:
        return None
    if value is None or value is True:
        return {}
    if not isinstance(value, dict):
        raise ModelSpecError(f"training.augment must be true, false or an object, not {value!r}")
    unknown = sorted(set(value) - set(KNOWN))
    if unknown:
        raise ModelSpecError(f"training.augment: unknown field {unknown[0]!r}; known: {', '.join(KNOWN)}")
    settings = {}
    for name, given in value.items():
        if name == "flips":
            if not isinstance(given, bool):
                raise _bad("flips", "true or false", given)
            settings["flips"] = given
        elif name == "rotation":
            given = 0 if given is False or given is None else (RECOMMENDED["rotation"] if given is True else given)
            if not _number_in(0, 180)(given):
                raise _bad("rotation", "degrees from 0 to 180 (or true/false)", given)
            settings["rotation"] = float(given)
        else:
            settings.update(_block(name, given))
    return settings


def augmenter_from_block(value, color: str, workers: int | None = None, processes: bool = False) -> Augmenter | None:
    """An Augmenter for the description's training.augment (None when it is false)."""
    settings = parse_augment(value)
    if settings is None:
        return None
    if color == "gray" and settings.get("background_p", 0) > 0:
        raise ModelSpecError("training.augment.background needs colour images (a gray model has no leaf masks)")
    return Augmenter(color=color, workers=workers, processes=processes, **settings)


# --------------------------------------------------------------------------- datasets

class AugmentedDataset(ArrayDataset):
    """Rows of a source dataset (repeats allowed), augmented as they are read (an ArrayDataset in
    interface: len, labels, sample_shape, limit, batch; the images are never held). `masks` (uint8
    [N, H, W] beside the source's images, e.g. an image-folder cache's leaf masks) feed background
    replacement; without them every image keeps its background.

    `in_memory = False`, so the Trainer reads it through its Prefetcher thread (`batch` is the
    prefetch `load` function) instead of moving it to the GPU once: augmentation runs ahead on the
    CPU while the device trains."""

    in_memory = False

    @property
    def loads_at_once(self) -> int:
        return self.augmenter.batches_at_once

    def __init__(self, source: ArrayDataset, rows, augmenter: Augmenter, seed: int = 0, name: str = "augmented",
                 masks=None):
        self.source, self.rows = source, np.asarray(rows, np.int64)
        if len(self.rows) == 0:
            raise LnnInputError(f"{name}: the dataset is empty")
        self.augmenter, self.seed, self.name, self.masks = augmenter, seed, name, masks
        self.labels = np.asarray(source.labels)[self.rows]

    def __len__(self) -> int:
        return len(self.rows)

    @property
    def sample_shape(self) -> tuple:
        return self.source.sample_shape

    def limit(self, count: int | None) -> "AugmentedDataset":
        if count is None or count >= len(self):
            return self
        return AugmentedDataset(self.source, self.rows[:count], self.augmenter, self.seed, self.name, self.masks)

    def batch(self, indices: np.ndarray):
        indices = np.asarray(indices, np.int64)
        rows = self.rows[indices]
        images, labels = self.source.batch(rows)
        masks = None
        if self.masks is not None and self.augmenter.uses_masks:
            order = np.argsort(rows, kind="stable")          # read the memory map forwards
            masks = np.empty((len(rows),) + self.masks.shape[1:], np.uint8)
            masks[order] = self.masks[rows[order]]
        rng = np.random.default_rng([self.seed, *indices.tolist()])
        return self.augmenter(images, rng, masks), labels
