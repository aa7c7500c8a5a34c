"""A photo's cost before the model, by its size: what lnn-serve and lnn-infer spend on decoding, preprocessing
and the photo checks of one upload, against the plain way and against lnn at full size.

    python benchmarks/photo_sizes.py [--rounds 7]

Photos: the sample leaves (examples/leaves) enlarged to 256x256 (serve_load's uploads), 1600x1200 (what
lnn-serve's page sent until 2026-12-07, a phone's photo shrunk to 1600 pixels on its long side; now it sends
683x512: benchmarks/page_shrink.py) and 4000x3000 (a 12 MP phone photo sent whole), with a little noise so that they compress like photos, as baseline JPEGs (quality
92). For each, CPU ms per photo on one thread (time.thread_time; medians of --rounds interleaved rounds):

    lnn                lnn-serve's prepare_upload (Session.prepare_and_check): a baseline JPEG larger than the
                       model needs is decoded reduced by libjpeg (Session.decode_side: 256 pixels a side for
                       the bundled model, its photo checks' copy), then preprocessing and the photo checks
    lnn, full size     the same with the photo decoded at full size (decode_side 0, as before 2026-12-05)
    plain              cv2.imdecode at full size and one cv2.resize (INTER_AREA) to the model's input: what a
                       user of onnxruntime writes (bundled_model.py's one-image script), without photo checks

and how far lnn's model input moves from the full-size decoding's (mean absolute difference, normalized units:
one grey level is about 0.017). Writes the `photo_sizes` section of docs/BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "benchmarks"))
MODEL = REPO / "models" / "tomato_leaf.bin"
SIZES = ((256, 256), (1600, 1200), (4000, 3000))


def photos_of_size(width: int, height: int) -> list:
    """The sample leaves enlarged to width x height, with noise of up to 8 grey levels, as baseline JPEG bytes."""
    import cv2

    rng = np.random.default_rng(0)
    photos = []
    for path in sorted((REPO / "examples" / "leaves").glob("*.jpg")):
        image = cv2.resize(cv2.imread(str(path)), (width, height), interpolation=cv2.INTER_CUBIC)
        image = cv2.add(image, rng.integers(0, 8, image.shape, dtype=np.uint8))
        photos.append(cv2.imencode(".jpg", image, [cv2.IMWRITE_JPEG_QUALITY, 92])[1].tobytes())
    return photos


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()

    import cv2

    import lnn
    from lnn.tools.serve_app import prepare_upload
    from report import machine_line, markdown_table, update_section

    session = lnn.load(MODEL, device="cpu", threads=1)
    full_size = lnn.load(MODEL, device="cpu", threads=1)
    full_size.decode_side = lambda: 0
    height, width = session.model.preprocess["resize"]

    def plain(data):
        image = cv2.imdecode(np.frombuffer(data, np.uint8), cv2.IMREAD_COLOR)
        return cv2.resize(image, (width, height), interpolation=cv2.INTER_AREA)

    ways = {"lnn": lambda data: prepare_upload(session, data, 50_000_000),
            "lnn, full size": lambda data: prepare_upload(full_size, data, 50_000_000),
            "plain": plain}
    rows = []
    for size in SIZES:
        photos = photos_of_size(*size)
        times = {name: [] for name in ways}
        for name, way in ways.items():                      # warm: the decoders, the compiled photo measures
            way(photos[0])
        for _ in range(args.rounds):
            for name, way in ways.items():
                started = time.thread_time()
                for data in photos:
                    way(data)
                times[name].append(1000 * (time.thread_time() - started) / len(photos))
        ms = {name: float(np.median(values)) for name, values in times.items()}
        moved = np.mean([np.abs(prepare_upload(session, data, 50_000_000)[0]
                                - prepare_upload(full_size, data, 50_000_000)[0]).mean() for data in photos])
        kilobytes = np.mean([len(data) for data in photos]) / 1000
        rows.append([f"{size[0]}×{size[1]} ({kilobytes:.0f} KB)", f"{ms['lnn']:.2f}", f"{ms['lnn, full size']:.2f}",
                     f"{ms['plain']:.2f}", f"{ms['lnn'] / ms['plain']:.2f}", f"{ms['lnn'] / ms['lnn, full size']:.2f}",
                     f"{moved:.4f}"])
        print(" | ".join(rows[-1]), flush=True)
    table = markdown_table(["photo", "lnn ms", "lnn at full size ms", "plain ms", "lnn / plain",
                            "lnn / lnn at full size", "model input moved"], rows)
    update_section("photo_sizes", "\n\n".join([
        "## A photo's cost before the model, by its size (decoding, preprocessing, photo checks)",
        f"Command: `python benchmarks/photo_sizes.py --rounds {args.rounds}`. Machine: {machine_line()}.",
        f"The bundled model (input {height}×{width}, photo checks on a 256×256 copy). CPU ms per photo on one thread, "
        "medians of interleaved rounds over the sample leaves enlarged to each size (baseline JPEGs, quality 92). "
        "lnn: lnn-serve's prepare_upload, as lnn-infer (a baseline JPEG larger than the model needs decoded reduced "
        "by libjpeg, to no less than 256 pixels a side); lnn at full size: the same decoded whole; plain: "
        "cv2.imdecode and one cv2.resize to the input, no photo checks (what an onnxruntime user writes). "
        "Model input moved: the mean absolute difference of lnn's model input from the full-size decoding's "
        "(normalized units; one grey level is about 0.017).",
        table]))
    print("wrote the photo_sizes section of docs/BENCHMARKS.md")


if __name__ == "__main__":
    main()
