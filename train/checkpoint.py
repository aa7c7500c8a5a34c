"""Training checkpoints: one .npz written atomically (temp file, fsync, rename), never half-written.

Contents:
  meta          uint8 bytes of a JSON object: format "lnn-checkpoint" version 1, the normalized
                model description, epoch (completed), optimizer step, learning rate, loss scale,
                RNG state (seed and dropout call counter: shuffling derives from seed and epoch),
                history (one entry per epoch), best epoch and score
  w/<key>       every weight of the model by its `.bin` name (float32/float64), running stats too
  opt/<name>    the optimizer state over the flat parameter layout (momentum, exp_avg, ...)

`load_checkpoint(path) -> (model, weights, state)` is what lnn-export uses; it imports nothing of
the training loop. `export_checkpoint(path, bin_path)` writes the .bin with the model's
preprocessing and labels.
"""

from __future__ import annotations

import io
import json

import numpy as np

from lnn.formats.binfile import build_metadata, write_atomic, write_bin
from lnn.formats.errors import LnnFormatError, ModelSpecError
from lnn.formats.npz import NPZ_READ_ERRORS, open_npz
from lnn.formats.model import Model, parse_model

FORMAT, VERSION = "lnn-checkpoint", 1


def encode_checkpoint(meta: dict, weights: dict, optimizer_state: dict) -> bytes:
    arrays = {"meta": np.frombuffer(json.dumps(meta, sort_keys=True).encode("utf-8"), np.uint8)}
    arrays.update({f"w/{key}": np.asarray(value) for key, value in weights.items()})
    arrays.update({f"opt/{key}": np.asarray(value) for key, value in optimizer_state.items()})
    buffer = io.BytesIO()
    np.savez(buffer, **arrays)
    return buffer.getvalue()


def save_checkpoint(path, meta: dict, weights: dict, optimizer_state: dict) -> None:
    meta = {"format": FORMAT, "version": VERSION, **meta}
    write_atomic(path, encode_checkpoint(meta, weights, optimizer_state))


def read_checkpoint(path) -> tuple[dict, dict, dict]:
    """-> (meta, weights, optimizer_state); a damaged or foreign file gives one LnnFormatError line."""
    archive = open_npz(path, "checkpoint file", "an lnn checkpoint", LnnFormatError)
    try:
        with archive:
            if "meta" not in archive.files:
                raise LnnFormatError(f"{path}: not an lnn checkpoint (no meta entry)")
            meta = json.loads(archive["meta"].tobytes().decode("utf-8"))
            weights = {k[2:]: archive[k] for k in archive.files if k.startswith("w/")}
            optimizer_state = {k[4:]: archive[k] for k in archive.files if k.startswith("opt/")}
    except (*NPZ_READ_ERRORS, UnicodeDecodeError):
        raise LnnFormatError(f"{path}: the checkpoint is damaged (an entry cannot be read)") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise LnnFormatError(f"{path}: not an lnn checkpoint (meta format is not {FORMAT!r})")
    if meta.get("version") != VERSION:
        raise LnnFormatError(f"{path}: checkpoint version {meta.get('version')} is not one this lnn reads ({VERSION})")
    return meta, weights, optimizer_state


def load_checkpoint(path) -> tuple[Model, dict, dict]:
    """-> (model, weights as float32 arrays keyed like the .bin, state: the meta JSON and optimizer arrays)."""
    meta, weights, optimizer_state = read_checkpoint(path)
    try:
        model = parse_model(meta["description"])
    except (KeyError, ModelSpecError) as err:
        raise LnnFormatError(f"{path}: the checkpoint's model description is unusable ({err})") from None
    expected = model.param_shapes()
    for key, shape in expected.items():
        if key not in weights or tuple(weights[key].shape) != tuple(shape):
            raise LnnFormatError(f"{path}: the checkpoint lacks weight {key!r} of shape {list(shape)}")
    weights = {key: np.asarray(weights[key], np.float32) for key in expected}
    return model, weights, {**meta, "optimizer": optimizer_state}


def export_checkpoint(path, bin_path, extra_metadata: dict | None = None) -> int:
    """Write the checkpoint's model as a .bin; returns its size in bytes."""
    model, weights, state = load_checkpoint(path)
    training = {"epoch": state.get("epoch"), "best": state.get("best")}
    metadata = build_metadata(model, {"training": training, **(extra_metadata or {})})
    return write_bin(bin_path, model, weights, metadata)
