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
preprocessing and labels, and lnn-export's default test vectors.
"""

from __future__ import annotations

import io
import json
import math

import numpy as np

from lnn.formats.binfile import build_metadata, check_finite_weights, write_atomic, write_bin
from lnn.formats.errors import LnnFormatError, ModelSpecError
from lnn.formats.limits import MAX_JSON_BYTES
from lnn.formats.model import Model, parse_json_text, parse_model
from lnn.formats.npz import NPZ_READ_ERRORS, array_headers, check_array_fits, open_npz
from lnn.train.config import _number

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
    """-> (meta, weights, optimizer_state); a damaged or foreign file gives one LnnFormatError line.

    The .npy headers are checked first: the meta entry is bytes of at most MAX_JSON_BYTES, its
    description a valid model within formats/limits.py, every weight the shape that model gives it
    and every optimizer array no larger than the flat parameter buffer; only then is data read."""
    archive = open_npz(path, "checkpoint file", "an lnn checkpoint", LnnFormatError)
    with archive:
        headers = array_headers(archive, path, LnnFormatError)
        if "meta" not in headers:
            raise LnnFormatError(f"{path}: not an lnn checkpoint (no meta entry)")
        meta_shape, meta_dtype = headers["meta"]
        if meta_dtype != np.uint8 or len(meta_shape) != 1 or meta_shape[0] > MAX_JSON_BYTES:
            raise LnnFormatError(f"{path}: the checkpoint is damaged (its meta entry is not JSON bytes of at most "
                                 f"{MAX_JSON_BYTES:,} bytes)")
        try:
            text = archive["meta"].tobytes().decode("utf-8")
        except (*NPZ_READ_ERRORS, UnicodeDecodeError):
            raise LnnFormatError(f"{path}: the checkpoint is damaged (an entry cannot be read)") from None
        try:
            meta = parse_json_text(text, "its meta entry")
        except ModelSpecError as err:
            raise LnnFormatError(f"{path}: the checkpoint is damaged ({err})") from None
        if not isinstance(meta, dict) or meta.get("format") != FORMAT:
            raise LnnFormatError(f"{path}: not an lnn checkpoint (meta format is not {FORMAT!r})")
        if meta.get("version") != VERSION:
            raise LnnFormatError(f"{path}: checkpoint version {meta.get('version')} is not one this lnn reads ({VERSION})")
        model = _model_of(meta, path)
        _check_headers(path, model, headers)
        try:
            weights = {k[2:]: archive[k] for k in headers if k.startswith("w/")}
            optimizer_state = {k[4:]: archive[k] for k in headers if k.startswith("opt/")}
        except NPZ_READ_ERRORS:
            raise LnnFormatError(f"{path}: the checkpoint is damaged (an entry cannot be read)") from None
    return meta, weights, optimizer_state


def check_run_state(meta: dict, weights: dict) -> None:
    """The meta fields a resumed run continues from, each of the kind and in the range the trainer writes (the
    module's doc), and finite weights (binfile.check_finite_weights): a ValueError naming the first that is not (a
    KeyError for one missing)."""
    def count(value) -> bool:
        return isinstance(value, int) and not isinstance(value, bool) and value >= 0

    history, best, rng = meta["history"], meta.get("best"), meta["rng"]
    epochs = len(history) if isinstance(history, list) else None
    checks = [("step", count(meta["step"]), "a non-negative integer"),
              ("lr", _number(meta["lr"]) and meta["lr"] >= 0, "a non-negative number"),
              ("base_lr", _number(meta["base_lr"]) and meta["base_lr"] >= 0, "a non-negative number"),
              ("loss_scale", _number(meta["loss_scale"]) and meta["loss_scale"] > 0, "a positive number"),
              ("clean_steps", count(meta["clean_steps"]), "a non-negative integer"),
              ("overflow_steps", count(meta["overflow_steps"]), "a non-negative integer"),
              ("amp", meta["amp"] in (None, "fp16", "bf16"), "null, 'fp16' or 'bf16'"),
              ("device", meta["device"] in ("cpu", "cuda"), "'cpu' or 'cuda'"),
              ("rng", isinstance(rng, dict) and count(rng.get("seed")) and count(rng.get("dropout_calls")),
               "an object of a non-negative seed and dropout_calls"),
              ("history", epochs is not None and all(
                  isinstance(entry, dict) and entry.get("epoch") == epoch
                  and all(value is None or _number(value) for value in entry.values())
                  for epoch, entry in enumerate(history, 1)), "a list of epochs 1, 2, ... of numbers or null"),
              ("epoch", count(meta["epoch"]) and meta["epoch"] == epochs, "the number of epochs in history"),
              ("best", best is None or (isinstance(best, dict) and count(best.get("epoch"))
                                        and 1 <= best["epoch"] <= (epochs or 0)
                                        and (best.get("score") is None or _number(best.get("score")))),
               "null or the epoch and score of one epoch in history")]
    for name, good, kind in checks:
        if not good:
            text = json.dumps(meta[name])
            raise ValueError(f"{name} is {text if len(text) <= 60 else text[:56] + ' ...'}, not {kind}")
    try:
        check_finite_weights(weights)
    except ModelSpecError as err:
        raise ValueError(str(err)) from None


def _model_of(meta: dict, path) -> Model:
    try:
        return parse_model(meta["description"])
    except (KeyError, ModelSpecError) as err:
        raise LnnFormatError(f"{path}: the checkpoint's model description is unusable ({err})") from None


def _check_headers(path, model: Model, headers: dict) -> None:
    """Every weight has its layer's shape; an optimizer array holds at most the flat parameter buffer
    (each parameter padded to PARAM_ALIGN elements) plus its step counter."""
    from lnn.train.plan import PARAM_ALIGN

    shapes = model.param_shapes()
    flat = sum(-(-math.prod(shape) // PARAM_ALIGN) * PARAM_ALIGN for shape in shapes.values())
    for key, (shape, _dtype) in headers.items():
        if key.startswith("w/"):
            expected = shapes.get(key[2:])
            if expected is None:
                raise LnnFormatError(f"{path}: the checkpoint holds weight {key[2:]!r}, which no layer of its model has")
            if tuple(shape) != tuple(expected):
                raise LnnFormatError(f"{path}: weight {key[2:]!r} has shape {list(shape)} in the checkpoint's "
                                     f"header, its layer expects {list(expected)}")
        elif key.startswith("opt/"):
            check_array_fits(path, key, headers[key], max(flat, 1), LnnFormatError)


def load_checkpoint(path) -> tuple[Model, dict, dict]:
    """-> (model, weights as float32 arrays keyed like the .bin, state: the meta JSON and optimizer arrays)."""
    meta, weights, optimizer_state = read_checkpoint(path)
    model = _model_of(meta, path)
    expected = model.param_shapes()
    for key, shape in expected.items():
        if key not in weights:
            raise LnnFormatError(f"{path}: the checkpoint lacks weight {key!r} of shape {list(shape)}")
    weights = {key: np.asarray(weights[key], np.float32) for key in expected}
    return model, weights, {**meta, "optimizer": optimizer_state}


def export_checkpoint(path, bin_path, extra_metadata: dict | None = None) -> int:
    """Write the checkpoint's model as a .bin; returns its size in bytes."""
    model, weights, state = load_checkpoint(path)
    from lnn.runtime.vectors import normal_inputs, with_test_vectors

    training = {"epoch": state.get("epoch"), "best": state.get("best")}
    metadata = build_metadata(model, {"training": training, **(extra_metadata or {})})
    weights, metadata = with_test_vectors(model, weights, metadata, {}, *normal_inputs(model))  # as lnn-export's
    return write_bin(bin_path, model, weights, metadata)
