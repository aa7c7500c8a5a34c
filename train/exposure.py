"""Outlier exposure data: the "fit" outlier photos mixed into the training rows with label -1.

    outliers = outlier_images("../shared/data/outliers", (3, 128, 128), "rgb")    # MemmapDataset, labels -1
    train = OutlierMix(tomato_train, AugmentedDataset(outliers, rows, augmenter), ratio=0.25)

Only the "fit" part of lnn.train.outliers.split_outliers ever reaches training (its validation and
test parts are the gate's); the photos are decoded once into their own cache (train/images.py's
open_cache, keyed by exactly these files) at the model's input size, exactly as lnn-infer sees them.
OutlierMix appends round(ratio * len(inliers)) outlier rows to the inlier rows (outlier photo
j % count for appended row j, so every photo appears equally often, each time augmented anew); the
Trainer's per-epoch shuffle spreads them over the batches, so a batch holds `ratio` outliers per
inlier on average. Their label -1 means "uniform posterior" to the loss (train/kernels.py). A batch's
inlier and outlier rows are read (augmented) at the same time, from two threads, so one augmentation
pool gets all its rows at once.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from lnn.formats.errors import LnnInputError
from lnn.train.data import ArrayDataset, MemmapDataset

OUTLIER_LABEL = -1


def outlier_images(folder, input_shape: tuple, color: str, cache_root=None, log=None,
                   progress: bool = True) -> MemmapDataset:
    """The fit part of the outlier folder, decoded (cached) at the model's size; every label -1."""
    from lnn.train.images import open_cache
    from lnn.train.outliers import split_outliers

    folder = Path(folder)
    fit = split_outliers(folder)["fit"]
    if not fit:
        raise LnnInputError(f"{folder}: none of its photos falls in the outliers' fit part (lnn.train.outliers)")
    files = [path.relative_to(folder).as_posix() for path in fit]
    _, _, data, _ = open_cache(folder, files, [OUTLIER_LABEL] * len(files), tuple(input_shape[1:]), color,
                               cache_root, log=log, progress=progress, what="outlier photos (fit part)")
    return data


class OutlierMix(ArrayDataset):
    """Inlier training rows followed by outlier rows (label -1), read batch by batch (not in memory)."""

    in_memory = False
    has_outliers = True

    def __init__(self, inliers: ArrayDataset, outliers: ArrayDataset, ratio: float, name: str = "training"):
        if len(outliers) == 0:
            raise LnnInputError(f"{name}: no outlier photos to mix in")
        self.inliers, self.outliers, self.ratio, self.name = inliers, outliers, ratio, name
        self.outlier_rows = max(1, round(ratio * len(inliers)))
        self.labels = np.concatenate([np.asarray(inliers.labels), np.full(self.outlier_rows, OUTLIER_LABEL)])
        self.loads_at_once = max(inliers.loads_at_once, outliers.loads_at_once)
        self._readers = ThreadPoolExecutor(max_workers=2 * self.loads_at_once, thread_name_prefix="lnn-outlier-mix")

    def __len__(self) -> int:
        return len(self.inliers) + self.outlier_rows

    @property
    def sample_shape(self) -> tuple:
        return self.inliers.sample_shape

    def limit(self, count: int | None) -> "OutlierMix":
        """The first `count` inlier rows, with outliers at the same ratio."""
        if count is None or count >= len(self.inliers):
            return self
        return OutlierMix(self.inliers.limit(count), self.outliers, self.ratio, self.name)

    def batch(self, indices: np.ndarray):
        indices = np.asarray(indices, np.int64)
        inlier = indices < len(self.inliers)
        images = np.empty((len(indices),) + tuple(self.sample_shape), np.uint8)
        labels = np.empty(len(indices), np.int64)
        parts = [(chosen, self._readers.submit(source.batch, rows)) for chosen, source, rows in (
            (inlier, self.inliers, indices[inlier]),
            (~inlier, self.outliers, (indices[~inlier] - len(self.inliers)) % len(self.outliers))) if chosen.any()]
        for chosen, reading in parts:
            images[chosen], labels[chosen] = reading.result()
        labels[~inlier] = OUTLIER_LABEL
        return images, labels
