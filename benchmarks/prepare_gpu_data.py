"""The photos the bundled model's retraining needs, small enough to carry to the GPU machine.

    python benchmarks/prepare_gpu_data.py [--shared ../shared/data] [--out .devdata/gpu] [--size 128]

The GPU machine receives at most 64 MiB per call and has no ../shared, so this writes (git-ignored)
    .devdata/gpu/tomato/<class>/<same file name>.jpg     every tomato photo, shorter side --size px
    .devdata/gpu/outliers/<sub-folder>/<same name>.jpg   the "fit" part of the outlier photos only, longer
                                                         side --outlier-size px (aspect kept)
re-encoded as JPEG quality --quality. The names stay the same, so split_by_leaf gives the same
validation photos and split_outliers the same part: both are checked here, and the validation and
test outlier photos are never written. Prints the total size; it must stay under ~50 MiB to travel
with the working tree (carry) beside the code. benchmarks/retrain_bundled.sh reads it (37.9 MiB with the defaults;
a model scores about 0.5 points lower on these copies than on the original files).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "benchmarks"))
from report import SHARED  # noqa: E402

LIMIT_MIB = 50


def shrink(source: Path, target: Path, side: int, quality: int, longer: bool) -> int:
    """Re-encode one photo with its shorter (or longer) side at most `side` px; returns the bytes written."""
    import cv2

    image = cv2.imread(str(source), cv2.IMREAD_COLOR)
    if image is None:
        raise SystemExit(f"{source}: not a readable image")
    height, width = image.shape[:2]
    scale = side / (max(height, width) if longer else min(height, width))
    if scale < 1:
        image = cv2.resize(image, (max(1, round(width * scale)), max(1, round(height * scale))),
                           interpolation=cv2.INTER_AREA)
    ok, data = cv2.imencode(".jpg", image, [cv2.IMWRITE_JPEG_QUALITY, quality])
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_bytes(data.tobytes())
    return len(data)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shared", default=str(SHARED / "data"))
    parser.add_argument("--out", default=str(REPO / ".devdata" / "gpu"))
    parser.add_argument("--size", type=int, default=128, help="tomato photos: shorter side in px (the model's input)")
    parser.add_argument("--outlier-size", type=int, default=160, help="outlier photos: longer side in px")
    parser.add_argument("--quality", type=int, default=95)
    args = parser.parse_args()

    from tqdm import tqdm

    from lnn.train.images import scan_folder, split_by_leaf
    from lnn.train.outliers import split_outliers

    shared, out = Path(args.shared), Path(args.out)
    tomato, outliers = shared / "tomato", shared / "outliers"
    classes, files, labels, _ = scan_folder(tomato)
    fit = split_outliers(outliers)["fit"]
    total = 0
    for name in tqdm(files, desc="tomato", unit="photo"):
        total += shrink(tomato / name, out / "tomato" / name, args.size, args.quality, longer=False)
    for path in tqdm(fit, desc="outliers (fit part)", unit="photo"):
        relative = path.relative_to(outliers)
        total += shrink(path, out / "outliers" / relative, args.outlier_size, args.quality, longer=True)

    copy_classes, copy_files, copy_labels, _ = scan_folder(out / "tomato")
    if (copy_classes, copy_files, list(copy_labels)) != (classes, files, list(labels)):
        raise SystemExit("the copied tomato folder does not list the same photos")
    original_val = split_by_leaf(files, labels)[1]
    if not (split_by_leaf(copy_files, copy_labels)[1] == original_val).all():
        raise SystemExit("the copy's validation split differs from the original's")
    copy_parts = split_outliers(out / "outliers")
    written = sorted(p.relative_to(out / "outliers").as_posix() for p in (out / "outliers").rglob("*.jpg"))
    if copy_parts["validation"] or copy_parts["test"] or \
            sorted(p.relative_to(out / "outliers").as_posix() for p in copy_parts["fit"]) != written:
        raise SystemExit("an outlier photo of the copy does not fall in the fit part")
    mib = total / 2 ** 20
    print(f"{out}: {len(files)} tomato photos ({len(original_val)} of them validation, the same as the originals') "
          f"and {len(fit)} outlier photos, all in split_outliers' fit part; {mib:.1f} MiB in all")
    if mib > LIMIT_MIB:
        print(f"over {LIMIT_MIB} MiB: lower --size or --quality", file=sys.stderr)
        raise SystemExit(1)


if __name__ == "__main__":
    main()
