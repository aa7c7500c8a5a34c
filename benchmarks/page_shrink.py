"""What lnn-serve's phone page sends: it shrinks a phone's photo before sending it (tools/serve_page.html). This
judges the photo the page sends, in Debian's Chromium, against the original, and measures what each costs the
server, for the page's size and two others.

    python benchmarks/page_shrink.py [--rounds 5]

Photos: 4032x3024 baseline JPEGs (quality 92) made from the sample leaves (examples/leaves): every leaf enlarged,
smooth (noise of up to 8 grey levels) and with grain (noise of 12 grey levels); three of them blurred at four
strengths and darkened at three gains, around the photo checks' thresholds, and one small in a plain frame. Each
goes through the page three ways: as the server asks (/v1/model's upload_side on the short side: twice
Session.decode_side), at decode_side itself, and with no upload_side (1600 pixels on the long side, as the page
sent until 2026-12-07); the last two by a routed /v1/model answer. The photo the page sends is caught before the
server (a routed /v1/classify) and judged with its original by one Session: photo checks, gate and model.
Reported per way: the photos whose reason (a diagnosis, blurred, too_dark, not_a_leaf, ...) or top label differs
from the original's, the largest change of any probability, the bytes sent, and the server's CPU for decoding,
preprocessing and checking a photo (lnn-serve's prepare_upload on one thread, medians of --rounds rounds). Needs
Debian's chromium and Playwright (the dev extra). Writes the `page_shrink` section of docs/BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "benchmarks"))
MODEL = REPO / "models" / "tomato_leaf.bin"
PHONE_PHOTO = (4032, 3024)                 # a 12 MP phone photo, 4:3
BLURS = (1.0, 1.5, 2.0, 3.0)               # Gaussian sigma at the sample's 256 pixels: around blur_below
DARK_GAINS = (0.25, 0.3, 0.35)             # around dark_below
EDGE_CASE_LEAVES = 3
WAIT_S = 60


def phone_photos() -> dict:
    """name -> 4032x3024 JPEG bytes (the module's docstring says which)."""
    import cv2

    rng = np.random.default_rng(0)

    def encoded(image):
        return cv2.imencode(".jpg", image, [cv2.IMWRITE_JPEG_QUALITY, 92])[1].tobytes()

    def enlarged(image):
        return cv2.resize(image, PHONE_PHOTO, interpolation=cv2.INTER_CUBIC)

    photos = {}
    leaves = sorted((REPO / "examples" / "leaves").glob("*.jpg"))
    for path in leaves:
        big = enlarged(cv2.imread(str(path)))
        photos[f"{path.stem}, smooth"] = encoded(cv2.add(big, rng.integers(0, 8, big.shape, dtype=np.uint8)))
        photos[f"{path.stem}, grain"] = encoded(np.clip(big + rng.normal(0, 12, big.shape), 0, 255).astype(np.uint8))
    for path in leaves[:EDGE_CASE_LEAVES]:
        leaf = cv2.imread(str(path))
        for sigma in BLURS:
            big = enlarged(cv2.GaussianBlur(leaf, (0, 0), sigma))
            photos[f"{path.stem}, blurred {sigma:g}"] = encoded(
                np.clip(big + rng.normal(0, 3, big.shape), 0, 255).astype(np.uint8))
        for gain in DARK_GAINS:
            photos[f"{path.stem}, dark {gain:g}"] = encoded(enlarged((leaf * gain).astype(np.uint8)))
        frame = np.full((PHONE_PHOTO[1], PHONE_PHOTO[0], 3), (90, 110, 120), np.uint8)
        frame[1200:1900, 1700:2400] = cv2.resize(leaf, (700, 700))
        photos[f"{path.stem}, small in the frame"] = encoded(frame)
    return photos


def sent_by_the_page(url: str, photos: dict, upload_side: int | None) -> dict:
    """name -> the JPEG the page sends for each photo; upload_side None: the server's own /v1/model, else a
    routed /v1/model answer with that upload_side (0: none)."""
    from playwright.sync_api import sync_playwright

    sent = []
    with sync_playwright() as playwright, tempfile.TemporaryDirectory() as folder:
        browser = playwright.chromium.launch(executable_path=shutil.which("chromium"), args=["--no-sandbox"])
        page = browser.new_page()
        if upload_side is not None:
            page.route("**/v1/model", lambda route: route.fulfill(json={"upload_side": upload_side}))
        page.route("**/v1/classify", lambda route: (sent.append(route.request.post_data_buffer),
                                                    route.fulfill(status=400, json={"error": "-", "status": 400})))
        page.goto(url)
        photo = Path(folder) / "photo.jpg"
        for count, data in enumerate(photos.values(), start=1):
            photo.write_bytes(data)
            page.locator("#photo").set_input_files(str(photo))
            deadline = time.monotonic() + WAIT_S
            while len(sent) < count:
                if time.monotonic() > deadline:
                    raise SystemExit(f"page_shrink: the page sent nothing within {WAIT_S} s")
                page.wait_for_timeout(20)
        browser.close()
    return {name: body[body.index(b"\xff\xd8\xff"):] for name, body in zip(photos, sent)}   # the form's file part


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    if shutil.which("chromium") is None:
        raise SystemExit("page_shrink: needs Debian's chromium (apt-get install chromium)")

    import cv2

    import lnn
    from lnn.tools.infer import judge_images
    from lnn.tools.serve import DEFAULTS, launch_process
    from lnn.tools.serve_app import prepare_upload, upload_side
    from report import machine_line, markdown_table, update_section

    session = lnn.load(MODEL, device="cpu", threads=1)

    def prepared(data: bytes) -> tuple:
        return prepare_upload(session, data, DEFAULTS.max_pixels)

    def judged(data: bytes) -> tuple:
        """(probabilities, reason) of one photo, as lnn-serve judges an upload."""
        x, check, _ = prepared(data)
        probabilities, reasons = judge_images(session, [x], [check])
        return probabilities[0], reasons[0]

    def server_ms(photos: list) -> float:
        prepared(photos[0])                                             # warm: the decoders, the photo measures
        rounds = []
        for _ in range(args.rounds):
            started = time.thread_time()
            for data in photos:
                prepared(data)
            rounds.append(1000 * (time.thread_time() - started) / len(photos))
        return float(np.median(rounds))

    photos = phone_photos()
    originals = {name: judged(data) for name, data in photos.items()}
    side = upload_side(session)
    ways = {f"as the server asks: upload_side {side} on the short side": None,
            f"decode_side, {session.decode_side()}, on the short side": session.decode_side(),
            "no upload_side: 1600 on the long side (the page until 2026-12-07)": 0}
    process, url = launch_process("--model", MODEL, "--port", "0", "--device", "numpy")
    try:
        sent = {way: sent_by_the_page(url, photos, value) for way, value in ways.items()}
    finally:
        process.terminate()
        process.wait(timeout=30)

    rows = []
    for way, jpegs in sent.items():
        results = {name: judged(data) for name, data in jpegs.items()}
        reasons = [name for name in photos if results[name][1] != originals[name][1]]
        labels = [name for name in photos if results[name][0].argmax() != originals[name][0].argmax()]
        differing = "; ".join([f"{name}: reason {originals[name][1] or 'a diagnosis'} → {results[name][1] or 'a diagnosis'}"
                               for name in reasons] +
                              [f"{name}: top label {session.labels[originals[name][0].argmax()]['name']} → "
                               f"{session.labels[results[name][0].argmax()]['name']} (reason "
                               f"{results[name][1] or 'a diagnosis'})" for name in labels])
        change = max(float(np.abs(results[name][0] - originals[name][0]).max()) for name in photos)
        height, width = cv2.imdecode(np.frombuffer(jpegs[next(iter(photos))], np.uint8), cv2.IMREAD_COLOR).shape[:2]
        rows.append([way, f"{width}×{height}", f"{np.mean([len(data) for data in jpegs.values()]) / 1000:.0f}",
                     f"{len(reasons)} of {len(photos)}", f"{len(labels)} of {len(photos)}", f"{change:.4f}",
                     f"{server_ms(list(jpegs.values())):.2f}", differing or "—"])
        print(" | ".join(rows[-1]), flush=True)
    rows.append(["the original, sent whole (another client)", f"{PHONE_PHOTO[0]}×{PHONE_PHOTO[1]}",
                 f"{np.mean([len(data) for data in photos.values()]) / 1000:.0f}", "—", "—", "—",
                 f"{server_ms(list(photos.values())):.2f}", "—"])
    counts = {}
    for _, reason in originals.values():
        counts[reason or "a diagnosis"] = counts.get(reason or "a diagnosis", 0) + 1
    update_section("page_shrink", "\n\n".join([
        "## What the phone page sends: its shrunk photo judged against the original",
        f"Command: `python benchmarks/page_shrink.py --rounds {args.rounds}`. Machine: {machine_line()}.",
        f"{len(photos)} photos of {PHONE_PHOTO[0]}×{PHONE_PHOTO[1]} (baseline JPEGs, quality 92) made from the sample "
        f"leaves: each leaf smooth and with grain; {EDGE_CASE_LEAVES} of them blurred at {len(BLURS)} strengths, "
        f"darkened at {len(DARK_GAINS)} gains and small in a plain frame. What the bundled model and its checks say "
        f"of the originals: {', '.join(f'{count} {reason}' for reason, count in sorted(counts.items()))}. Each photo "
        "through lnn-serve's page in Debian's headless Chromium (tools/serve_page.html: halved 2×2 at a time, then "
        "resized, as JPEG at 0.92), the photo it sends caught before the server and judged with the original by one "
        "Session (photo checks, gate, model). The server's ms: lnn-serve's decoding, preprocessing and photo "
        f"checks of a photo (prepare_upload, CPU on one thread, medians of {args.rounds} rounds; a photo larger "
        "than the model needs is decoded reduced by libjpeg).",
        markdown_table(["the page's way", "a 4:3 photo sent as", "KB sent", "reason ≠ the original's",
                        "top label ≠", "largest probability change", "server ms a photo", "which differ"], rows)]))
    print("wrote the page_shrink section of docs/BENCHMARKS.md")


if __name__ == "__main__":
    main()
