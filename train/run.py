"""A training run's folder: checkpoints, metrics, curves, the best model and the exported .bin.

    RUN_DIR/checkpoint.npz   the last completed epoch (weights, optimizer, epoch, lr, RNG), atomic
    RUN_DIR/best.npz         the epoch with the best validation result so far (same format)
    RUN_DIR/metrics.jsonl    one JSON object per epoch (rewritten from the checkpoint on resume)
    RUN_DIR/run.json         the options the run was started with (lnn-train's RUN_OPTIONS), which --resume
                             takes again
    RUN_DIR/curves.png       loss and accuracy per epoch (matplotlib; redrawn every CURVES_EVERY_S and at the end)
    RUN_DIR/model.bin        at the end: the best epoch's model, with preprocessing and labels; when
                             the description has a model_card, its "trained" field says how this
                             run trained it (date, device, epochs, batch, optimizer, epoch time)
"Best" is the highest validation accuracy (cross_entropy), else the lowest validation loss, else
the lowest training loss. Killing the process at any moment leaves every file either the old or
the new version (binfile.write_atomic): --resume restarts after the last checkpointed epoch and,
since shuffling derives from (seed, epoch) and dropout from (seed, call counter), repeats
exactly what the uninterrupted run would have done.
"""

from __future__ import annotations

import datetime
import json
import math
import time
from pathlib import Path

from lnn.formats.binfile import atomic_output, write_atomic
from lnn.formats.errors import LnnError, LnnFormatError
from lnn.train.checkpoint import check_run_state, export_checkpoint, read_checkpoint, save_checkpoint
from lnn.version import __version__

CHECKPOINT, BEST, METRICS, CURVES, MODEL = "checkpoint.npz", "best.npz", "metrics.jsonl", "curves.png", "model.bin"
OPTIONS = "run.json"
RUN_FILES = (CHECKPOINT, BEST, METRICS, OPTIONS, CURVES, MODEL)      # every file a run writes into its folder
# curves.png is redrawn after an epoch only when this many seconds passed since the last drawing (and at
# the end): matplotlib takes about 1 s a drawing on a busy 2-core machine, 10x a series dataset's epoch.
CURVES_EVERY_S = 30.0


def _score(entry: dict) -> float:
    """Higher is better; a figure recorded as null (not finite) scores lowest."""
    for key, sign in (("val_accuracy", 1), ("val_loss", -1), ("train_loss", -1)):
        if key in entry:
            return -math.inf if entry[key] is None else sign * entry[key]
    return -math.inf


def _same_network(a: dict, b: dict) -> bool:
    keys = ("input_shape", "layers", "loss")
    return all(a.get(k) == b.get(k) for k in keys)


def saved_options(folder) -> dict | None:
    """The options a run in `folder` was started with (RUN_DIR/run.json): None when the folder holds no run yet
    (no checkpoint), {} for a run started before lnn-train kept them."""
    folder = Path(folder)
    if not (folder / CHECKPOINT).is_file():
        return None
    path = folder / OPTIONS
    if not path.exists():
        return {}
    try:
        options = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as err:
        raise LnnFormatError(f"{path}: unreadable ({err}); start a new run in another --out folder") from None
    if not isinstance(options, dict):
        raise LnnFormatError(f"{path}: not a JSON object of options; start a new run in another --out folder")
    return options


class RunDirectory:
    def __init__(self, folder, trainer, resume: bool, options: dict | None = None):
        """options: what the run computes from (lnn-train's options), kept in run.json when the run starts, or
        when a run without it is resumed."""
        self.folder = Path(folder)
        self.trainer = trainer
        self.history, self.best = [], None
        self.checkpointed = 0           # the epochs CHECKPOINT holds
        self._plotted_at, self._plotted_epochs = None, 0
        checkpoint = self.folder / CHECKPOINT
        if self.folder.exists() and not self.folder.is_dir():
            raise LnnError(f"{self.folder}: exists and is not a folder")
        self.folder.mkdir(parents=True, exist_ok=True)
        for stale in self.folder.glob(".*.tmp"):       # a temp file left by a run killed mid-write
            stale.unlink()
        if checkpoint.exists():
            if not resume:
                raise LnnError(f"{self.folder} already holds a run ({CHECKPOINT}); pass --resume to continue it "
                               f"or choose another --out folder")
            self._resume(checkpoint)
        elif resume:
            trainer.log(f"--resume: {checkpoint} does not exist yet; starting a new run")
        if options is not None and not (checkpoint.exists() and (self.folder / OPTIONS).exists()):
            write_atomic(self.folder / OPTIONS, (json.dumps(options, indent=1) + "\n").encode("utf-8"))

    def _resume(self, checkpoint: Path):
        meta, weights, optimizer_state = read_checkpoint(checkpoint)
        mine = self.trainer.model.to_description()
        if not _same_network(meta.get("description", {}), mine):
            raise LnnError(f"{checkpoint} was trained from a different model than this description; "
                           f"use another --out folder")
        try:
            check_run_state(meta, weights)
            self.trainer.load_state(meta, weights, optimizer_state)
            self.history = list(meta["history"])
            self.best = meta.get("best")
            self.checkpointed = len(self.history)
        except (KeyError, TypeError, ValueError) as err:       # a field missing or of the wrong kind
            what = f"no {err}" if isinstance(err, KeyError) else str(err)
            raise LnnFormatError(f"{checkpoint}: the checkpoint is damaged ({what}); start a new run in "
                                 f"another --out folder") from None
        self._write_metrics()
        self.trainer.log(f"resumed {self.folder} after epoch {len(self.history)} (step {meta['step']})")

    def _meta(self) -> dict:
        return {**self.trainer.state_meta(), "epoch": len(self.history), "history": self.history, "best": self.best}

    def end_epoch(self, entry: dict):
        """Record a finished epoch. A non-finite figure (an inf validation loss from overflowed logits, say)
        is recorded as null: JSON has no Infinity, and the files must read back (--resume, lnn-export)."""
        for key, value in entry.items():
            if isinstance(value, float) and not math.isfinite(value):
                self.trainer.log(f"epoch {entry.get('epoch')}: {key} is {value}; recorded as null")
                entry[key] = None
        score = _score(entry)
        if self.best is None or score > (-math.inf if self.best["score"] is None else self.best["score"]):
            self.best = {"epoch": entry["epoch"], "score": score if math.isfinite(score) else None}  # JSON has no -inf
            self._save(BEST)
        self._save(CHECKPOINT)
        self.checkpointed = len(self.history)
        with open(self.folder / METRICS, "a", encoding="utf-8") as f:
            f.write(json.dumps(entry) + "\n")
        if self._plotted_at is None or time.monotonic() - self._plotted_at >= CURVES_EVERY_S:
            self._plot()

    def interrupted_line(self) -> str:
        """What an interrupted run keeps and how to go on: one line for the person who stopped it."""
        if not self.checkpointed:
            return f"interrupted before an epoch ended: {self.folder} holds no checkpoint yet"
        return (f"interrupted: {self.folder / CHECKPOINT} keeps the run as it was after epoch {self.checkpointed}; "
                f"continue it with --resume (the same --out folder)")

    def _save(self, name: str):
        save_checkpoint(self.folder / name, self._meta(), self.trainer.weights(), self.trainer.optimizer_arrays())

    def _write_metrics(self):
        text = "".join(json.dumps(entry) + "\n" for entry in self.history)
        write_atomic(self.folder / METRICS, text.encode("utf-8"))

    def stopped_early(self, patience: int | None) -> bool:
        if patience is None or self.best is None or not self.history:
            return False
        return self.history[-1]["epoch"] - self.best["epoch"] >= patience

    def _plot(self):
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        self._plotted_at, self._plotted_epochs = time.monotonic(), len(self.history)
        epochs = [e["epoch"] for e in self.history]
        accuracy_keys = [k for k in ("train_accuracy", "val_accuracy") if k in self.history[-1]]
        figure, axes = plt.subplots(1, 2 if accuracy_keys else 1, figsize=(10 if accuracy_keys else 5, 3.8),
                                    squeeze=False)
        for key in ("train_loss", "val_loss"):
            if key in self.history[-1]:
                axes[0][0].plot(epochs, [e.get(key) for e in self.history], marker="o", label=key.replace("_", " "))
        axes[0][0].set(xlabel="epoch", ylabel="loss", title=f"{self.trainer.model.name}: loss")
        axes[0][0].legend()
        for key in accuracy_keys:
            axes[0][1].plot(epochs, [e.get(key) for e in self.history], marker="o", label=key.replace("_", " "))
        if accuracy_keys:
            axes[0][1].set(xlabel="epoch", ylabel="accuracy", title="accuracy")
            axes[0][1].legend()
        figure.tight_layout()
        try:
            with atomic_output(self.folder / CURVES) as f:
                figure.savefig(f, format="png", dpi=100)
        finally:
            plt.close(figure)

    def trained_summary(self) -> str:
        """The model card's "trained" field, from this run: date, device, epochs, batch, optimizer and
        schedule, median epoch time (the card of a description that has one gets it in model.bin)."""
        trainer, config = self.trainer, self.trainer.config
        if trainer.device == "cuda":
            from lnn.train.device import cuda_info

            device = f"one {cuda_info(trainer.xp)['name']} (CuPy)"
        else:
            device = "the CPU (NumPy)"
        optimizer = trainer.optimizer_config
        settings = [optimizer["type"].upper() if optimizer["type"] == "sgd" else optimizer["type"].capitalize()]
        if optimizer.get("momentum"):
            settings.append(f"{'nesterov ' if optimizer.get('nesterov') else ''}momentum {optimizer['momentum']:g}")
        settings.append(f"lr {trainer.base_lr:g} {config.lr_schedule['type']}")
        seconds = sorted(entry["epoch_s"] for entry in self.history if "epoch_s" in entry)
        batch = f"batch {trainer.plan.batch_size}" + (f" x {config.accumulate}" if config.accumulate > 1 else "")
        epoch_time = f", about {seconds[len(seconds) // 2]:.1f} s per epoch" if seconds else ""
        return (f"{datetime.date.today().isoformat()} with lnn-train {__version__} on {device}, "
                f"{len(self.history)} epochs, {batch}, {' '.join(settings)}{epoch_time}")

    def finish(self, export: bool):
        if self.history and self._plotted_epochs != len(self.history):
            self._plot()
        if not export or not self.history:
            return
        source = self.folder / (BEST if (self.folder / BEST).exists() else CHECKPOINT)
        card = self.trainer.model.extra.get("model_card")
        extra = {"model_card": {**card, "trained": self.trained_summary()}} if isinstance(card, dict) else None
        size = export_checkpoint(source, self.folder / MODEL, extra)
        best = f" (epoch {self.best['epoch']})" if self.best else ""
        self.trainer.log(f"wrote {self.folder / MODEL} ({size} bytes) from {source.name}{best}")
