"""Training augmentation throughput on this CPU, and a picture of what it makes.

    python benchmarks/augment_speed.py [--tomato ../shared/data/tomato] [--images 256] [--repeats 3]

Side by side in one run, on the real tomato photos of the image-folder cache (128 x 128, with their
leaf masks): the classic augmentation set (no "augment" block) and examples/tomato_leaf.json's
training.augment (background replacement and the rest), each with 1 worker thread, with one thread
per core, and (the recipe) with one spawned process per core (what lnn-train uses above 4 cores: the
Python between OpenCV calls holds the GIL), batches of 32 as the trainer asks for them; best of
--repeats passes over --images photos.
Reports images/s, images/s per core, and what the GPU recipe needs: on the H200, an epoch of ~4,000
rows (3,200 tomato + 800 outlier rows) in ~2.3 s of GPU time is ~1,750 images/s.
Writes docs/images/augmented_samples.png (48 recipe-augmented photos) and the `augment_speed`
section of docs/BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "benchmarks"))
from report import SHARED  # noqa: E402
RECIPE = REPO / "examples" / "tomato_leaf.json"
PICTURE = REPO / "docs" / "images" / "augmented_samples.png"
GPU_ROWS_PER_EPOCH, GPU_EPOCH_S = 4000, 2.3


def throughput(augmenter, images, masks, repeats: int, batch: int = 32) -> float:
    """Images per second, best of `repeats` passes, batches of `batch` rows each drawn from its own seed."""
    best = 0.0
    for repeat in range(repeats):
        started = time.perf_counter()
        for start in range(0, len(images), batch):
            augmenter(images[start:start + batch], np.random.default_rng([repeat, start]), masks[start:start + batch])
        best = max(best, len(images) / (time.perf_counter() - started))
    return best


def save_grid(augmenter, images, masks, path: Path, columns: int = 8, rows: int = 6) -> None:
    import cv2

    out = augmenter(images[:columns * rows], np.random.default_rng(2024), masks[:columns * rows])
    tiles = [tile.transpose(1, 2, 0)[:, :, ::-1] for tile in out]           # RGB -> BGR for imwrite
    grid = np.vstack([np.hstack(tiles[r * columns:(r + 1) * columns]) for r in range(rows)])
    path.parent.mkdir(parents=True, exist_ok=True)
    cv2.imwrite(str(path), grid)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tomato", default=str(SHARED / "data" / "tomato"))
    parser.add_argument("--images", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--no-write", action="store_true", help="print only; leave docs/ alone")
    parser.add_argument("--note", default="", help="a sentence for the section (e.g. that the machine was busy)")
    args = parser.parse_args()

    from lnn.train.augment import augmenter_from_block
    from lnn.train.images import ImageFolder
    from report import machine_line, markdown_table, update_section

    folder = ImageFolder.load(args.tomato, (3, 128, 128), "rgb")
    rows = np.sort(np.random.default_rng(0).choice(len(folder.files), min(args.images, len(folder.files)), replace=False))
    images, masks = np.asarray(folder.data.images[rows]), np.asarray(folder.masks[rows])
    recipe_block = json.loads(RECIPE.read_text())["training"]["augment"]
    cores = os.cpu_count() or 1
    table, rates = [], {}
    runs = [(name, block, workers, False) for name, block in (("classic set (no augment block)", None),
                                                               ("tomato_leaf.json recipe", recipe_block))
            for workers in sorted({1, cores})] + [("tomato_leaf.json recipe", recipe_block, cores, True)]
    for name, block, workers, processes in runs:
        augmenter = augmenter_from_block(block, "rgb", workers=workers, processes=processes)
        kind = "processes" if processes else "threads"
        if processes:
            augmenter(images[:workers], np.random.default_rng(0), masks[:workers])      # start the workers first
        rate = throughput(augmenter, images, masks, args.repeats)
        augmenter.close()
        rates[(name, workers, kind)] = rate
        table.append([name, f"{workers} {kind}", f"{rate:.0f}", f"{rate / workers:.0f}"])
        print(f"{name}, {workers} {kind}: {rate:.0f} images/s ({rate / workers:.0f} per worker)", flush=True)
    per_core = rates[("tomato_leaf.json recipe", 1, "threads")]
    best_all = max(rates[("tomato_leaf.json recipe", cores, kind)] for kind in ("threads", "processes"))
    needed = GPU_ROWS_PER_EPOCH / GPU_EPOCH_S
    cores_needed = needed / per_core
    summary = (f"The recipe needs about {needed:.0f} images/s to keep the H200 busy ({GPU_ROWS_PER_EPOCH} rows per "
               f"epoch in {GPU_EPOCH_S} s): at {per_core:.0f} images/s per core, {cores_needed:.1f} cores. "
               f"Measured on all {cores} cores: {best_all:.0f} images/s, an epoch's augmentation "
               f"{GPU_ROWS_PER_EPOCH / best_all:.1f} s.")
    print(summary)
    if args.no_write:
        return
    augmenter = augmenter_from_block(recipe_block, "rgb")
    save_grid(augmenter, images, masks, PICTURE)
    body = "\n".join([
        "## Training augmentation throughput (CPU worker threads and processes)",
        "",
        f"`python benchmarks/augment_speed.py` — {machine_line(('numpy', 'opencv-python-headless'))}. "
        f"{len(images)} tomato photos at 128x128 from the image-folder cache, batches of 32, best of "
        f"{args.repeats}." + (f" {args.note}" if args.note else ""),
        "",
        markdown_table(["augmentation", "workers", "images/s", "images/s per worker"], table),
        "",
        summary,
        "",
        f"![48 photos through the recipe's augmentation](images/{PICTURE.name})",
        "",
        "(Photos: PlantVillage tomato leaves, Hughes & Salathé 2015, CC BY-SA 3.0; backgrounds drawn procedurally.)",
    ])
    update_section("augment_speed", body)
    print(f"wrote {PICTURE} and the augment_speed section of docs/BENCHMARKS.md")


if __name__ == "__main__":
    main()
