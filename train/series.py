"""Series and table datasets for lnn-train and lnn-eval: `--data ucr:DIR` and `--data csv:FILE --target COLUMN`.

ucr:DIR is one dataset of the UCR/UEA archive: DIR holds NAME_TRAIN and NAME_TEST as .ts, .tsv or .arff
(lnn.runtime.series reads them). The training split trains, with no validation during training (the archive has none, and the
test split must not choose the epoch kept: the run keeps its last epoch's neighbourhood by the lowest
training loss, lnn.train.run); lnn-eval --split test measures. Series of unequal length are padded at
their end with their own mean (per channel) to the longest training series ("pad_mean", stated in the
model's preprocessing; time keeps its scale); a later series longer than that is resampled down. Training series of
one length: "linear" (a series of another length at inference is resampled to it).

csv:FILE --target COLUMN is one table: rows split per class into training and validation (seeded,
--val-fraction, the split lnn-eval --split val repeats; --split all evaluates every row).

Both fit the normalisation on the training rows only (per channel for series, per column for tables)
and store it as the model's preprocessing (metadata.preprocess), so a Session takes raw values. A
description may leave what the data decides to it: `"input_shape": "from_data"` and, on a linear
layer, `"out_features": "from_data"` (the number of classes); labels come from the data unless the
description names them. So examples/series/default.json trains any UCR/UEA dataset unchanged.
"""

from __future__ import annotations

import copy
import math
from pathlib import Path

import numpy as np

from lnn.formats.errors import LnnInputError, ModelSpecError
from lnn.runtime.series import (SERIES_SUFFIXES, fit_standardize, read_series_file, read_table, stack_series,
                                standardize)
from lnn.train.data import DEFAULT_SPLIT_SEED, DEFAULT_VAL_FRACTION, ArrayDataset

FROM_DATA = "from_data"


# --------------------------------------------------------------------------- the UCR/UEA archive layout

def ucr_files(folder) -> dict:
    """{"train": path, "test": path} of the dataset in `folder` (NAME_TRAIN.ts|.tsv|.arff, NAME_TEST.*;
    .ts is preferred when a dataset comes in several formats). A folder holding several datasets gives the one
    named like the folder, as the archive lays them out (JapaneseVowels/ beside JapaneseVowels_eq_TRAIN.ts)."""
    folder = Path(folder)
    if not folder.is_dir():
        raise LnnInputError(f"{folder}: no such folder (pass --data ucr:DIR, DIR holding NAME_TRAIN.ts and NAME_TEST.ts)")
    found = {}
    for split in ("train", "test"):
        candidates = sorted((p for p in folder.iterdir() if p.is_file() and p.suffix.lower() in SERIES_SUFFIXES
                             and p.stem.upper().endswith(f"_{split.upper()}")),
                            key=lambda p: (SERIES_SUFFIXES.index(p.suffix.lower()), p.name))
        names = {p.stem[:-len(split) - 1] for p in candidates}
        if not candidates:
            raise LnnInputError(f"{folder}: no NAME_{split.upper()} file ({', '.join(SERIES_SUFFIXES)}): not a dataset "
                                f"of the UCR/UEA archive layout")
        if len(names) > 1 and folder.name in names:
            candidates = [p for p in candidates if p.stem[:-len(split) - 1] == folder.name]
        elif len(names) > 1:
            raise LnnInputError(f"{folder}: holds several datasets ({', '.join(sorted(names))}) and none named like "
                                f"the folder; pass the folder of one")
        found[split] = candidates[0]
    return found


def class_order(labels: list, declared: list | None) -> list:
    """The classes in the declared order (.ts @classLabel, .arff nominal values), else sorted (numerically
    when every label is a number)."""
    present = set(labels)
    if declared:
        return [name for name in declared if name in present] + sorted(present - set(declared))
    try:
        return sorted(present, key=float)
    except ValueError:
        return sorted(present)


def ucr_datasets(folder, description: dict) -> tuple:
    """(training ArrayDataset [N, C, T] standardized, None, the description completed from the data)."""
    files = ucr_files(folder)
    train = read_series_file(files["train"])
    if train.labels is None:
        raise LnnInputError(f"{files['train']}: has no class labels (@classLabel false)")
    classes = class_order(train.labels, train.classes)
    lengths = {s.shape[1] for s in train.series}
    length, how = max(lengths), "pad_mean" if len(lengths) > 1 else "linear"
    raw = stack_series(train.series, length, how)
    mean, std = fit_standardize(raw)
    preprocess = {"kind": "series", "length": length, "resample": how, "mean": mean, "std": std}
    description = complete_description(description, [train.channels, length], classes, preprocess, files["train"])
    labels = label_indices(description, train.labels)
    return ArrayDataset(standardize(raw, preprocess), labels, f"{Path(folder).name} train"), None, description


def ucr_split(folder, split: str, preprocess: dict | None = None):
    """(series file, path) of one split of a ucr:DIR dataset, for lnn-eval; `preprocess`: the model's, whose
    standardisation must keep every value within float32's range (read_series_file)."""
    path = ucr_files(folder)[split]
    data = read_series_file(path, preprocess)
    if data.labels is None:
        raise LnnInputError(f"{path}: has no class labels (@classLabel false), so it cannot be evaluated")
    return data, path


# --------------------------------------------------------------------------- CSV tables

def check_val_fraction(val_fraction: float) -> None:
    if not 0 < val_fraction < 1:
        raise LnnInputError(f"--val-fraction must be between 0 and 1, not {val_fraction}")


def split_rows(labels: list, val_fraction: float, seed: int) -> tuple:
    """(training rows, validation rows): per class, a seeded shuffle, round(val_fraction x count) rows (at least
    one of a class with two or more) to validation; both sorted."""
    check_val_fraction(val_fraction)
    rng = np.random.default_rng(seed)
    train, val = [], []
    labels = np.asarray(labels, dtype=object)
    for name in sorted(set(labels.tolist())):
        rows = rng.permutation(np.flatnonzero(labels == name))
        take = min(len(rows) - 1, max(1, round(val_fraction * len(rows)))) if len(rows) > 1 else 0
        val += rows[:take].tolist()
        train += rows[take:].tolist()
    return np.array(sorted(train), np.int64), np.array(sorted(val), np.int64)


def read_target_table(spec_path: str, target: str | None, preprocess: dict | None = None,
                      given: str = "--data csv:FILE"):
    """The table of csv:FILE --target COLUMN; with a model's `preprocess` (lnn-eval, lnn-export), only its columns, in
    its order, each value within what its standardisation can take (read_table). given: the option that named the
    table, as the refusal without a target says it."""
    if not target:
        raise LnnInputError(f"{given} needs --target COLUMN (the column holding the class)")
    return read_table(spec_path, target, (preprocess or {}).get("columns"), preprocess)


def csv_datasets(path, target: str | None, description: dict, val_fraction: float = DEFAULT_VAL_FRACTION,
                 seed: int = DEFAULT_SPLIT_SEED) -> tuple:
    """(training ArrayDataset [N, F] standardized, validation ArrayDataset, the completed description)."""
    table = read_target_table(path, target)
    classes = class_order(table.labels, None)
    train_rows, val_rows = split_rows(table.labels, val_fraction, seed)
    if len(train_rows) == 0 or len(val_rows) == 0:
        raise LnnInputError(f"{path}: {len(table.values)} rows are too few to split into training and validation")
    mean, std = fit_standardize(table.values[train_rows])
    preprocess = {"kind": "table", "columns": table.columns, "mean": mean, "std": std}
    description = complete_description(description, [len(table.columns)], classes, preprocess, path)
    x = standardize(table.values, preprocess)
    y = label_indices(description, table.labels)
    name = Path(path).name
    return (ArrayDataset(x[train_rows], y[train_rows], f"{name} train"),
            ArrayDataset(x[val_rows], y[val_rows], f"{name} validation"), description)


# --------------------------------------------------------------------------- the description

def label_indices(description: dict, labels: list) -> np.ndarray:
    """Each row's class as the index of its label in the (completed) description."""
    names = [label if isinstance(label, str) else label.get("name") for label in description["labels"]]
    return np.array([names.index(label) for label in labels], np.int32)


def complete_description(description: dict, input_shape: list, classes: list, preprocess: dict, source) -> dict:
    """The description with what the data decides: input_shape and out_features "from_data" filled in, the
    labels (the data's classes, unless named), the fitted preprocessing."""
    if len(classes) < 2:        # a one-output "classifier" trains to a loss of 0 and answers that class for anything
        raise LnnInputError(f"{source}: holds one class only ({classes[0]!r}): a classifier learns from two or more")
    description = copy.deepcopy(description)
    if "preprocess" in description:
        raise ModelSpecError(f"preprocess: the preprocessing of a series or table model is fitted on the training "
                             f"data ({source}); leave the block out of the description")
    if description.get("input_shape", FROM_DATA) == FROM_DATA:
        description["input_shape"] = list(input_shape)
    layers = description.get("layers")
    for layer in layers if isinstance(layers, list) else []:
        if isinstance(layer, dict) and layer.get("out_features") == FROM_DATA:
            layer["out_features"] = len(classes)
    if "labels" not in description:
        description["labels"] = [{"name": name, "display": name} for name in classes]
    else:
        named = [label if isinstance(label, str) else (label or {}).get("name") for label in description["labels"]]
        missing = [name for name in classes if name not in named]
        if missing:
            raise LnnInputError(f"{source}: class {missing[0]!r} is not among the description's labels")
    if math.prod(input_shape) == 0:
        raise LnnInputError(f"{source}: the data has no values")
    description["preprocess"] = preprocess
    return description
