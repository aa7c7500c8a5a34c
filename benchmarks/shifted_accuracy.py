"""Accuracy on the tomato validation photos as they are, and on shifted copies of them (outside the lab).

    python benchmarks/shifted_accuracy.py                                   # the bundled model
    python benchmarks/shifted_accuracy.py --model before=/tmp/old.bin --model after=models/tomato_leaf.bin

The validation split (lnn.train.images.split_by_leaf, seed 0: the 768 photos no model was trained on),
decoded at the model's input size with its leaf masks (train/segment.py), and five shifted copies of it,
made deterministically from --seed by train/augment.py's own warp and compositing code:
    background   the leaf composited onto a procedural background of a HELD-OUT family (grass, bokeh,
                 concrete: train/backgrounds.py HELD_OUT_KINDS, which training never draws from), with a
                 soft drop shadow half the time
    darker       brightness x 0.35 .. 0.6
    blurred      Gaussian blur, sigma 1.5 .. 2.5 px at 128 x 128
    smaller      the leaf at 0.45 .. 0.65 of the frame, on its own background sheet extended
    all          all four together
Reports top-1 accuracy and the share of photos below the model's own "uncertain" threshold (metadata
thresholds.uncertain_below, when it has one) per copy and model, writes docs/images/shifted_copy.png
(six photos in each version) and the `shifted_accuracy` section of docs/BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import sys
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "benchmarks"))
from report import SHARED  # noqa: E402
PICTURE = REPO / "docs" / "images" / "shifted_copy.png"
SHIFTS = ("background", "darker", "blurred", "smaller", "all")
SEED = 20261201


def still_augmenter(color: str, **changes):
    """An Augmenter whose draws change nothing unless told (crop, flips, colour and blur off)."""
    from lnn.train.augment import Augmenter
    from lnn.train.backgrounds import HELD_OUT_KINDS

    settings = dict(color=color, crop_area=(1.0, 1.0), crop_ratio=(1.0, 1.0), rotation=0.0, flips=False,
                    brightness=0.0, contrast=0.0, saturation=0.0, blur_p=0.0, background_kinds=HELD_OUT_KINDS,
                    workers=1)
    settings.update(changes)
    return Augmenter(**settings)


def shifted_copy(images: np.ndarray, masks: np.ndarray, shift: str, color: str, seed: int = SEED) -> np.ndarray:
    """uint8 [N, C, H, W] -> the copy under `shift` (one of SHIFTS); row i depends on (seed, shift, i) only."""
    parts = SHIFTS[:-1] if shift == "all" else (shift,)
    augmenter = still_augmenter(color, background_p=1.0 if "background" in parts else 0.0, shadow_p=0.5)
    count, _, height, width = images.shape
    rng = np.random.default_rng([seed, SHIFTS.index(shift)])
    settings = augmenter.draw(rng, count, height, width)
    if "darker" in parts:
        settings["brightness"] = rng.uniform(0.35, 0.6, count)
    if "blurred" in parts:
        settings["blur"] = rng.uniform(1.5, 2.5, count)
    if "smaller" in parts:
        settings["scale"] = rng.uniform(0.45, 0.65, count)
    out = np.empty_like(images)
    for i in range(count):
        augmenter.augment_one(images[i], settings, i, out[i], masks[i])
    return out


def accuracy(session, images: np.ndarray, labels: np.ndarray, threshold) -> tuple:
    """(top-1 accuracy, share below the uncertain threshold or None), images already at the input size."""
    pre = session.model.preprocess
    scale, mean, std = pre["scale"], np.asarray(pre["mean"]), np.asarray(pre["std"])
    correct = uncertain = 0
    for start in range(0, len(images), 64):
        x = images[start:start + 64].astype(np.float32) * np.float32(scale)
        x = ((x - mean[None, :, None, None]) / std[None, :, None, None]).astype(np.float32)
        logits = session.run(x).astype(np.float64)
        probabilities = np.exp(logits - logits.max(axis=1, keepdims=True))
        probabilities /= probabilities.sum(axis=1, keepdims=True)
        correct += int((probabilities.argmax(axis=1) == labels[start:start + 64]).sum())
        if threshold is not None:
            uncertain += int((probabilities.max(axis=1) < threshold).sum())
    return correct / len(images), (uncertain / len(images) if threshold is not None else None)


def save_picture(copies: dict, path: Path, count: int = 6) -> None:
    import cv2

    rows = []
    for name in ("original", *SHIFTS):
        rows.append(np.hstack([tile.transpose(1, 2, 0)[:, :, ::-1] for tile in copies[name][:count]]))
    path.parent.mkdir(parents=True, exist_ok=True)
    cv2.imwrite(str(path), np.vstack(rows))


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", action="append", metavar="NAME=PATH",
                        help="a model to measure (repeatable); default: bundled=models/tomato_leaf.bin")
    parser.add_argument("--tomato", default=str(SHARED / "data" / "tomato"))
    parser.add_argument("--seed", type=int, default=SEED)
    parser.add_argument("--no-write", action="store_true", help="print only; leave docs/ alone")
    parser.add_argument("--note", default="", help="a sentence for the section (e.g. which model is which)")
    args = parser.parse_args()

    import lnn
    from lnn.train.images import ImageFolder
    from report import machine_line, markdown_table, update_section

    models = [spec.split("=", 1) for spec in (args.model or [f"bundled={REPO / 'models' / 'tomato_leaf.bin'}"])]
    if any(len(spec) != 2 for spec in models):
        raise SystemExit("--model takes NAME=PATH")
    sessions = {name: lnn.load(path, device="cpu", threads=os.cpu_count() or 1) for name, path in models}
    first = next(iter(sessions.values()))
    shape, color = first.model.input_shape, first.model.preprocess["color"]
    folder = ImageFolder.load(args.tomato, shape, color)
    _, val_rows = folder.split()
    images, masks = np.asarray(folder.data.images[val_rows]), np.asarray(folder.masks[val_rows])
    labels = folder.labels[val_rows]
    copies = {"original": images}
    for shift in SHIFTS:
        copies[shift] = shifted_copy(images, masks, shift, color, args.seed)
        print(f"made the {shift} copy of {len(images)} validation photos", flush=True)
    headers, table = ["copy of the validation split"], []
    for name, session in sessions.items():
        threshold = session.metadata.get("thresholds", {}).get("uncertain_below")
        headers += [f"{name}: accuracy", f"{name}: uncertain"]
        for row, (copy_name, pixels) in enumerate(copies.items()):
            top1, unsure = accuracy(session, pixels, labels, threshold)
            if len(table) <= row:
                table.append([copy_name])
            table[row] += [f"{100 * top1:.1f}%", "-" if unsure is None else f"{100 * unsure:.1f}%"]
            print(f"{name}: {copy_name}: accuracy {100 * top1:.2f}%"
                  + ("" if unsure is None else f", below the uncertain threshold {100 * unsure:.1f}%"), flush=True)
    if args.no_write:
        return
    save_picture(copies, PICTURE)
    def shown(path) -> str:
        path = Path(path).resolve()
        return str(path.relative_to(REPO)) if path.is_relative_to(REPO) else path.name

    digests = ", ".join(f"{name} = `{shown(path)}` (sha256 {hashlib.sha256(Path(path).read_bytes()).hexdigest()[:12]})"
                        for name, path in models)
    body = "\n".join([
        "## Accuracy outside the lab: the validation split and shifted copies of it",
        "",
        f"`python benchmarks/shifted_accuracy.py` — {machine_line(('numpy', 'opencv-python-headless'))}. "
        f"{len(images)} validation photos (split_by_leaf, seed 0) at the model's input size; copies made from "
        f"seed {args.seed}: *background* = leaf onto a held-out procedural background (grass, bokeh, concrete; "
        f"training draws soil, foliage, texture, clutter), *darker* = brightness x0.35-0.6, *blurred* = Gaussian "
        f"sigma 1.5-2.5 px, *smaller* = leaf at 0.45-0.65 of the frame on its own sheet, *all* = the four "
        f"together. \"Uncertain\" = below the model's own threshold. Models: {digests}."
        + (f" {args.note}" if args.note else ""),
        "",
        markdown_table(headers, table),
        "",
        f"![six validation photos, then each shifted copy of them, a row each](images/{PICTURE.name})",
        "",
        "(Photos: PlantVillage tomato leaves, Hughes & Salathé 2015, CC BY-SA 3.0; backgrounds drawn procedurally.)",
    ])
    update_section("shifted_accuracy", body)
    print(f"wrote {PICTURE} and the shifted_accuracy section of docs/BENCHMARKS.md")


if __name__ == "__main__":
    main()
