"""The photo checks (lnn/runtime/photo_checks.py) on every PlantVillage tomato photo and on spoiled copies.

    python benchmarks/photo_checks.py                      # all 3,839 photos, spoiled copies of every 10th
    python benchmarks/photo_checks.py --every 50 --no-report

Good photos: the share of the tomato folder's photos each check flags (each check on its own, and the
checks together as Session.predict_image applies them: the first failure wins); the target is at most
1% in total. Spoiled copies (`spoiled_copies`: darkened to 20%, overexposed, box-blurred, shrunk to
64x64, the leaf in the middle of a 4x larger plain frame): the share caught with the right reason.
Writes the "photo_checks" section of docs/BENCHMARKS.md unless --no-report.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "benchmarks"))
from report import SHARED, machine_line, markdown_table, update_section  # noqa: E402

SHARED_DATA = SHARED / "data"


def box_blur(image: np.ndarray, radius: int, times: int = 3) -> np.ndarray:
    """A box blur repeated `times` times (about a Gaussian of sigma radius * 1.4 for 3 passes)."""
    x = image.astype(np.float32)
    for _ in range(times):
        for axis in (0, 1):
            padded = np.pad(x, [(radius + 1, radius) if a == axis else (0, 0) for a in range(3)], mode="edge")
            total = np.cumsum(padded, axis=axis)
            n = x.shape[axis]
            x = (np.take(total, np.arange(2 * radius + 1, 2 * radius + 1 + n), axis)
                 - np.take(total, np.arange(n), axis)) / (2 * radius + 1)
    return np.clip(x, 0, 255).astype(np.uint8)


def spoiled_copies(image: np.ndarray) -> list:
    """[(the reason a check should give, name, spoiled copy)] of a uint8 HxWx3 BGR leaf photo."""
    from lnn.runtime.preprocess import resize_image

    frame = np.full((1024, 1024, 3), (120, 125, 130), np.uint8)
    frame[384:640, 384:640] = resize_image(image, 256, 256)
    return [("too_dark", "darkened to 20%", (image * 0.2).astype(np.uint8)),
            ("too_bright", "overexposed (x2.2 + 70)", np.clip(image.astype(np.float32) * 2.2 + 70, 0, 255).astype(np.uint8)),
            ("blurred", "box blur radius 2, 3 passes", box_blur(image, 2)),
            ("too_small", "shrunk to 64x64", resize_image(image, 64, 64)),
            ("too_small", "leaf 256 px in a 1024 px plain frame", frame)]


def flagged_by_each(measures: dict, thresholds: dict) -> dict:
    """Which checks fail for these measures, each on its own (the order of check_photo)."""
    t = thresholds
    return {
        "too_small (pixels)": min(measures["width"], measures["height"]) < t["min_side"],
        "too_dark": measures["grey_p99"] < t["dark_below"],
        "too_bright": measures["grey_p1"] > t["bright_above"] or measures["blown_out_share"] > t["bright_share_above"],
        "blurred": measures["laplacian_variance"] < t["blur_below"],
        "too_small (leaf fills too little)": measures["leaf_fill"] < t["leaf_fill_below"],
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tomato-dir", default=str(SHARED_DATA / "tomato"))
    parser.add_argument("--every", type=int, default=10, help="spoil every N-th photo (default 10)")
    parser.add_argument("--no-report", action="store_true", help="print only, do not touch docs/BENCHMARKS.md")
    args = parser.parse_args(argv)
    from tqdm import tqdm

    from lnn.runtime.photo_checks import DEFAULTS, check_photo, measure
    from lnn.runtime.preprocess import read_image
    from lnn.train.images import scan_folder

    started = time.perf_counter()
    folder = Path(args.tomato_dir)
    files = scan_folder(folder).files
    each, total, caught = {}, 0, {}
    for index, name in enumerate(tqdm(files, desc="tomato photos", unit="img", disable=None)):
        image = read_image(folder / name)
        for check, failed in flagged_by_each(measure(image, DEFAULTS["check_size"]), DEFAULTS).items():
            each[check] = each.get(check, 0) + int(failed)
        total += check_photo(image).reason is not None
        if index % args.every == 0:
            for reason, what, copy in spoiled_copies(image):
                hits, count = caught.get(what, (0, 0))
                caught[what] = (hits + (check_photo(copy).reason == reason), count + 1)
    good = markdown_table(["check", "tomato photos flagged"],
                          [[check, f"{count / len(files):.2%} ({count})"] for check, count in each.items()]
                          + [["**all checks (first failure)**", f"{total / len(files):.2%} ({total})"]])
    spoiled = markdown_table(["spoiled copy", "copies", "caught with the right reason"],
                             [[what, count, f"{hits / count:.1%}"] for what, (hits, count) in caught.items()])
    print(good + "\n\n" + spoiled)
    if not args.no_report:
        body = (f"## Photo checks before the model\n\n`python benchmarks/photo_checks.py --every {args.every}`; "
                f"{machine_line(('numpy',))}; {time.perf_counter() - started:.0f} s.\n\n"
                f"Thresholds: `{DEFAULTS}` (lnn/runtime/photo_checks.py DEFAULTS, stored in a gated model's "
                f"metadata). On all {len(files)} PlantVillage tomato photos (target: at most 1% flagged in total):\n\n"
                f"{good}\n\nSpoiled copies of every {args.every}th photo:\n\n{spoiled}")
        update_section("photo_checks", body)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
