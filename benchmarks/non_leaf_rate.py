"""How often photos that are NOT tomato leaves fall under a leaf model's uncertainty threshold.

    python benchmarks/non_leaf_rate.py models/tomato_leaf.bin
    python benchmarks/non_leaf_rate.py run/model.bin --threshold 0.9 --mnist 500 --no-report

Sets, each through the model's own preprocessing (Session.prepare_image, as lnn-infer does):
  - scikit-image's bundled sample photos (astronaut, coffee, the cat "chelsea", rocket, camera,
    coins, ...: those that load offline from the installed package; scikit-image is needed for this
    script only: pip install scikit-image);
  - MNIST test digits (../shared/data/mnist, the first --mnist of them);
  - control: the validation photos of the tomato folder (lnn-train's split, seed 0), which should
    mostly stay ABOVE the threshold.
"Uncertain" means top-1 probability < thresholds.uncertain_below from the model's metadata (or
--threshold). Writes the "non_leaf_rate" section of docs/BENCHMARKS.md unless --no-report.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "benchmarks"))
from report import machine_line, markdown_table, update_section  # noqa: E402

SHARED_DATA = REPO.parent / "shared" / "data"
# scikit-image sample images: real photographs (and the horse silhouette), as RGB or grey arrays
SKIMAGE_PHOTOS = ("astronaut", "coffee", "chelsea", "rocket", "camera", "coins", "horse", "moon", "clock", "page",
                  "text", "brick", "grass", "gravel", "hubble_deep_field", "immunohistochemistry", "retina")


def skimage_photos() -> list:
    """[(name, uint8 HxW or HxWx3 RGB)] for every listed sample that loads offline."""
    import skimage.data

    photos = []
    for name in SKIMAGE_PHOTOS:
        try:
            image = getattr(skimage.data, name)()
        except Exception as err:                       # not shipped in this version, or needs a download
            print(f"skipped skimage.data.{name}: {type(err).__name__}", file=sys.stderr)
            continue
        if image.dtype == bool:
            image = image.astype(np.uint8) * 255
        photos.append((name, np.ascontiguousarray(image[..., :3] if image.ndim == 3 else image)))
    return photos


def confidences(session, images, color: str, batch: int = 64) -> tuple[np.ndarray, np.ndarray]:
    """(top-1 probability, top-1 index) for arrays (in `color` order) or file paths."""
    best, index = [], []
    for start in range(0, len(images), batch):
        inputs = np.stack([session.prepare_image(image, color=color) for image in images[start:start + batch]])
        probabilities = session.predict(inputs)
        best.append(probabilities.max(axis=1))
        index.append(probabilities.argmax(axis=1))
    return np.concatenate(best), np.concatenate(index)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model", help="a leaf model .bin (with thresholds.uncertain_below, or pass --threshold)")
    parser.add_argument("--threshold", type=float, help="use this threshold instead of the model's")
    parser.add_argument("--mnist", type=int, default=300, help="MNIST test digits to try (default 300)")
    parser.add_argument("--mnist-dir", default=str(SHARED_DATA / "mnist"))
    parser.add_argument("--tomato-dir", default=str(SHARED_DATA / "tomato"), help="control: its validation photos")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--no-report", action="store_true", help="print only, do not touch docs/BENCHMARKS.md")
    args = parser.parse_args(argv)

    import lnn
    from lnn.train.data import load_mnist
    from lnn.train.images import scan_folder, split_by_leaf

    session = lnn.load(args.model, device=args.device)
    threshold = args.threshold
    if threshold is None:
        threshold = (session.metadata.get("thresholds") or {}).get("uncertain_below")
    if threshold is None:
        parser.error(f"{args.model} has no thresholds.uncertain_below in its metadata; pass --threshold")
    displays = [label["display"] for label in session.labels]
    started = time.perf_counter()

    rows, per_photo = [], []
    photos = skimage_photos()
    best, index = confidences(session, [image for _, image in photos], "rgb")
    for (name, image), p, k in zip(photos, best, index):
        per_photo.append([name, "x".join(map(str, image.shape)), displays[k], f"{p:.3f}",
                          "uncertain" if p < threshold else "**answered**"])
    rows.append(["scikit-image sample photos", len(photos), f"{np.mean(best < threshold):.1%}",
                 f"{np.median(best):.3f}"])

    mnist_dir = Path(args.mnist_dir)
    if mnist_dir.is_dir() and args.mnist > 0:
        _, test = load_mnist(mnist_dir)
        digits = [image[0] for image in test.images[:args.mnist]]          # HxW grey
        best, _ = confidences(session, digits, "bgr")
        rows.append([f"MNIST test digits (first {len(digits)})", len(digits), f"{np.mean(best < threshold):.1%}",
                     f"{np.median(best):.3f}"])

    tomato_dir = Path(args.tomato_dir)
    if tomato_dir.is_dir():
        _, files, labels = scan_folder(tomato_dir)
        validation = split_by_leaf(files, labels)[1]
        best, index = confidences(session, [tomato_dir / files[i] for i in validation], "bgr")
        names = [label["name"] for label in session.labels]
        right = np.array([names[k] == files[i].split("/")[0] for k, i in zip(index, validation)])
        rows.append(["control: tomato validation photos", len(validation), f"{np.mean(best < threshold):.1%}",
                     f"{np.median(best):.3f}"])
        rows.append(["control: of those, the correctly classified", int(right.sum()),
                     f"{np.mean(best[right] < threshold):.1%}", f"{np.median(best[right]):.3f}"])

    table = markdown_table(["set", "photos", "under the threshold (uncertain)", "median top-1 probability"], rows)
    detail = markdown_table(["scikit-image photo", "size", "top-1 answer", "probability", "result"], per_photo)
    print(table + "\n\n" + detail)
    if not args.no_report:
        body = (f"## Non-leaf photos under the uncertainty threshold\n\n"
                f"`python benchmarks/non_leaf_rate.py {args.model}`: model `{args.model}` "
                f"({session.model.name}), threshold {threshold:.4f}, device {session.device}; "
                f"{machine_line(('numpy', 'numba', 'scikit-image'))}; {time.perf_counter() - started:.0f} s.\n\n"
                f"{table}\n\n{detail}\n\nA photo that is not a tomato leaf but is answered (at or above the "
                f"threshold) gets a confident wrong diagnosis; the first two rows are the share that is caught.")
        update_section("non_leaf_rate", body)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
