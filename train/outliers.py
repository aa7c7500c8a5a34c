"""Photos that are not tomato leaves (../shared/data/outliers), split once for the whole project.

    parts = split_outliers("../shared/data/outliers")   # {"fit": [...], "validation": [...], "test": [...]}

The out-of-distribution gate (issue 11) uses them in three roles, and each photo has exactly one:
  fit         outlier exposure in training, and fitting any learned part of the gate;
  validation  choosing how the gate's scores are combined (never thresholds on tomato photos);
  test        only for the benchmark's reported figures (benchmarks/ood_gate.py); nothing is fitted
              or chosen on it.
The part of a photo is decided by a SHA-256 of its path relative to the folder (posix form), so it
is the same on every machine, for any subset of the folder, and a photo added later does not move
the others. About 50% / 20% / 30% of each sub-folder fall in fit / validation / test.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from lnn.formats.errors import LnnInputError
from lnn.runtime.preprocess import PHOTO_SUFFIXES

PARTS = (("fit", 50), ("validation", 70), ("test", 100))      # cumulative percent bounds


def outlier_part(relative_path: str) -> str:
    """'fit', 'validation' or 'test' for a photo's path relative to the outlier folder."""
    bucket = int.from_bytes(hashlib.sha256(relative_path.encode("utf-8")).digest()[:8], "big") % 100
    return next(name for name, bound in PARTS if bucket < bound)


def split_outliers(folder) -> dict:
    """Every image file under folder (recursively, hidden files skipped), sorted, by part."""
    folder = Path(folder)
    if not folder.is_dir():
        raise LnnInputError(f"{folder}: no such folder of outlier photos")
    parts = {name: [] for name, _ in PARTS}
    for path in sorted(folder.rglob("*")):
        relative = path.relative_to(folder).as_posix()
        if not path.is_dir() and path.suffix.lower() in PHOTO_SUFFIXES and not any(   # a pipe or broken link: skipped later, counted
                piece.startswith(".") for piece in relative.split("/")):
            parts[outlier_part(relative)].append(path)
    if not any(parts.values()):
        raise LnnInputError(f"{folder}: holds no image files")
    return parts
