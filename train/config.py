"""The "training" block of a model description, checked, with its defaults.

    "training": {
        "epochs": 10,                 # passes over the training data
        "min_steps": null,            # at least this many optimizer steps: a small dataset gets more
                                      #   epochs (null: epochs as given; --epochs overrides both;
                                      #   at most MAX_MIN_STEPS, formats/limits.py)
        "batch_size": 64,             # rows per forward/backward (a micro-batch when accumulating)
        "accumulate": 1,              # micro-batches per optimizer step: the same update as one
                                      #   batch of batch_size * accumulate rows
        "grad_clip": null,            # clip the global gradient norm to this (null: no clipping)
        "patience": null,             # stop after this many epochs without a better validation
                                      #   result (null: never stop early)
        "seed": 0,                    # weights, shuffling and dropout all derive from it
        "lr_schedule": {"type": "constant"},
        "augment": {...},             # image folders: the augmentation (lnn.train.augment's doc has the
                                      #   schema; false: none; absent: the classic crop/flip/colour set)
        "outliers": {"ratio": 0.25, "weight": 0.5}
                                      # outlier exposure, used when lnn-train gets --outliers DIR: the
                                      #   "fit" photos of DIR (lnn.train.outliers) are mixed in, `ratio`
                                      #   outlier rows per training row, with the uniform posterior as
                                      #   target; loss = mean CE over the labelled rows + weight * mean
                                      #   over the outlier rows of mean_k(-log softmax_k)
    }

lr_schedule types (the base learning rate is the optimizer block's "lr"):
    {"type": "constant", "warmup_epochs": 0}
    {"type": "cosine", "warmup_epochs": 1, "min_lr": 0.0}
        linear warmup from 0 over warmup_epochs (fractions allowed), then cosine from lr down to
        min_lr at the last step of the last epoch
    {"type": "step", "warmup_epochs": 0, "step_epochs": 10, "gamma": 0.1}
        lr * gamma ** (completed epochs // step_epochs) after the warmup
The learning rate is set per optimizer step. Every field is optional; command-line options
(--epochs, --batch, --lr, --patience, --seed) override the block.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from lnn.formats.errors import ModelSpecError
from lnn.formats.limits import MAX_MIN_STEPS, refusal

SCHEDULES = {
    "constant": {"warmup_epochs": 0.0},
    "cosine": {"warmup_epochs": 0.0, "min_lr": 0.0},
    "step": {"warmup_epochs": 0.0, "step_epochs": 10, "gamma": 0.1},
}
TRAINING_FIELDS = {"epochs": 10, "min_steps": None, "batch_size": 64, "accumulate": 1, "grad_clip": None, "patience": None,
                   "seed": 0, "lr_schedule": {"type": "constant"}, "augment": None, "outliers": None}
OUTLIER_FIELDS = {"ratio": 0.25, "weight": 0.5}       # Hendrycks et al. 2019 use weight 0.5


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _positive_int(where: str, value) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ModelSpecError(f"training: {where} must be a positive integer, not {value!r}")
    return value


@dataclass
class TrainingConfig:
    """The parsed "training" block (the module's doc)."""
    epochs: int = 10
    min_steps: int | None = None
    batch_size: int = 64
    accumulate: int = 1
    grad_clip: float | None = None
    patience: int | None = None
    seed: int = 0
    lr_schedule: dict = field(default_factory=lambda: {"type": "constant", "warmup_epochs": 0.0})
    augment: object = None            # the description's value, checked (lnn.train.augment.parse_augment)
    outliers: dict = field(default_factory=lambda: dict(OUTLIER_FIELDS))

    def epochs_for(self, steps_per_epoch: int) -> int:
        """The epochs to run with this many optimizer steps an epoch: `epochs`, raised to reach min_steps."""
        if self.min_steps is None:
            return self.epochs
        return max(self.epochs, math.ceil(self.min_steps / steps_per_epoch))

    @classmethod
    def parse(cls, block) -> "TrainingConfig":
        block = {} if block is None else block
        if not isinstance(block, dict):
            raise ModelSpecError(f"training must be an object, not {block!r}")
        unknown = set(block) - set(TRAINING_FIELDS)
        if unknown:
            raise ModelSpecError(f"training: unknown field {sorted(unknown)[0]!r}; known: {', '.join(TRAINING_FIELDS)}")
        config = cls()
        config.epochs = _positive_int("epochs", block.get("epochs", config.epochs))
        min_steps = block.get("min_steps")
        config.min_steps = None if min_steps is None else _positive_int("min_steps", min_steps)
        too_many = config.min_steps and refusal("training: min_steps", config.min_steps, MAX_MIN_STEPS,
                                                "MAX_MIN_STEPS", " steps")
        if too_many:
            raise ModelSpecError(too_many)
        config.batch_size = _positive_int("batch_size", block.get("batch_size", config.batch_size))
        config.accumulate = _positive_int("accumulate", block.get("accumulate", config.accumulate))
        clip = block.get("grad_clip")
        if clip is not None and (not _number(clip) or clip <= 0):
            raise ModelSpecError(f"training: grad_clip must be a positive number or null, not {clip!r}")
        config.grad_clip = None if clip is None else float(clip)
        patience = block.get("patience")
        config.patience = None if patience is None else _positive_int("patience", patience)
        seed = block.get("seed", 0)
        if not isinstance(seed, int) or isinstance(seed, bool) or seed < 0:
            raise ModelSpecError(f"training: seed must be a non-negative integer, not {seed!r}")
        config.seed = seed
        config.lr_schedule = parse_schedule(block.get("lr_schedule", {"type": "constant"}))
        from lnn.train.augment import parse_augment

        parse_augment(block.get("augment"))
        config.augment = block.get("augment")
        config.outliers = parse_outliers(block.get("outliers"))
        return config


def parse_outliers(value) -> dict:
    """training.outliers -> {"ratio", "weight"} with the defaults filled in."""
    if value is None:
        return dict(OUTLIER_FIELDS)
    if not isinstance(value, dict):
        raise ModelSpecError(f"training.outliers must be an object with {', '.join(OUTLIER_FIELDS)}, not {value!r}")
    unknown = sorted(set(value) - set(OUTLIER_FIELDS))
    if unknown:
        raise ModelSpecError(f"training.outliers: unknown field {unknown[0]!r}; known: {', '.join(OUTLIER_FIELDS)}")
    out = dict(OUTLIER_FIELDS, **value)
    for key in OUTLIER_FIELDS:
        if not _number(out[key]) or out[key] <= 0 or (key == "ratio" and out[key] > 4):
            raise ModelSpecError(f"training.outliers.{key} must be a positive number"
                                 f"{' up to 4' if key == 'ratio' else ''}, not {out[key]!r}")
        out[key] = float(out[key])
    return out


def parse_schedule(value) -> dict:
    if isinstance(value, str):
        value = {"type": value}
    if not isinstance(value, dict) or value.get("type") not in SCHEDULES:
        raise ModelSpecError(f"training: lr_schedule must be an object whose type is one of "
                             f"{', '.join(SCHEDULES)}, not {value!r}")
    defaults = SCHEDULES[value["type"]]
    unknown = set(value) - {"type"} - set(defaults)
    if unknown:
        raise ModelSpecError(f"training: lr_schedule ({value['type']}): unknown field {sorted(unknown)[0]!r}; "
                             f"known: {', '.join(defaults)}")
    out = {"type": value["type"]}
    for key, default in defaults.items():
        given = value.get(key, default)
        if not _number(given) or given < 0 or (key in ("step_epochs", "gamma") and given <= 0):
            raise ModelSpecError(f"training: lr_schedule ({value['type']}): {key} must be a "
                                 f"{'positive' if key in ('step_epochs', 'gamma') else 'non-negative'} number, not {given!r}")
        out[key] = given if isinstance(default, int) and isinstance(given, int) else float(given)
    return out


def learning_rate(base_lr: float, schedule: dict, step: int, steps_per_epoch: int, epochs: int) -> float:
    """The learning rate of optimizer step `step` (0-based, counted over the whole run)."""
    warmup = schedule.get("warmup_epochs", 0.0) * steps_per_epoch
    if step < warmup:
        return base_lr * (step + 1) / warmup
    kind = schedule["type"]
    if kind == "constant":
        return base_lr
    if kind == "step":
        return base_lr * schedule["gamma"] ** int(step // steps_per_epoch // schedule["step_epochs"])
    total = max(epochs * steps_per_epoch - warmup, 1)
    progress = min((step - warmup) / max(total - 1, 1), 1.0)
    return schedule["min_lr"] + 0.5 * (base_lr - schedule["min_lr"]) * (1 + math.cos(math.pi * progress))
