"""The packaged lnn-field (PyInstaller onedir): size on disk, start of its --cli mode, and what its size
choices (kernels compiled ahead of time instead of Numba's JIT, Pillow instead of OpenCV) cost per photo.

    python benchmarks/field_bundle.py [--bundle packaging/dist/lnn-field] [--starts 5] [--repeats 20]

Builds the bundle with packaging/build.sh unless --bundle names one already built. Size: the folder's
bytes on disk, and its largest parts. Start: wall time from process start to the printed answer for
`lnn-field --cli [--device cpu] examples/leaves/late_blight.jpg`, run from another working directory with
an empty per-user cache (first run), then warm (median of --starts); the NumPy backend (what --cli picks
by itself for a few images); beside the same commands run from the Python install (`python -m
lnn.tools.field`, Numba's JIT and OpenCV) as the peer.
Per photo: in a fresh process per setup, the median over --repeats rounds of the 8 sample leaves of
decoding + preprocessing, and of the model's run at batch 1, for the app's setup (the bundle's compiled
kernels, Pillow) against the Python install's (Numba's JIT with a warm cache, OpenCV) and the NumPy
backend; plus decoding + preprocessing of one 12-megapixel photo (a sample leaf enlarged to 4000x3000
and saved as JPEG), as a station's camera takes them. Writes the `field_bundle` section of docs/BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "benchmarks"))
PHOTO = REPO / "examples" / "leaves" / "late_blight.jpg"
MIB = 1024 * 1024

PER_PHOTO = """
import json, statistics, sys, time
from pathlib import Path
import numpy as np
import lnn
from lnn.runtime.preprocess import image_library, read_image
from lnn.tools.infer import DEFAULT_MODEL

device, repeats, leaves, big = sys.argv[1], int(sys.argv[2]), sorted(Path(sys.argv[3]).glob("*.jpg")), sys.argv[4]
session = lnn.load(DEFAULT_MODEL, device=device)
session.run(session.prepare_image(leaves[0])[None])           # compile or load the kernels before timing
prepare, run, large = [], [], []
for _ in range(repeats):
    for leaf in leaves:
        start = time.perf_counter()
        x = session.prepare_image(read_image(leaf))[None]
        middle = time.perf_counter()
        session.run(x)
        prepare.append(middle - start)
        run.append(time.perf_counter() - middle)
for _ in range(max(3, repeats // 4)):
    start = time.perf_counter()
    session.prepare_image(read_image(big))
    large.append(time.perf_counter() - start)
print(json.dumps({"prepare": statistics.median(prepare), "run": statistics.median(run), "large": statistics.median(large),
                  "library": image_library(), "numba": "numba" in sys.modules}))
"""


def disk_bytes(path: Path) -> int:
    """Bytes the files take on disk (allocated blocks), links counted once and not followed."""
    seen, total = set(), 0
    for item in [path, *path.rglob("*")]:
        info = item.lstat()
        if (info.st_dev, info.st_ino) not in seen:
            seen.add((info.st_dev, info.st_ino))
            total += info.st_blocks * 512
    return total


def largest_parts(internal: Path, count: int = 6) -> list:
    parts = [(disk_bytes(p), p.name) for p in internal.iterdir() if not p.is_symlink()]
    return sorted(parts, reverse=True)[:count]


def timed(command, cwd, env) -> float:
    started = time.perf_counter()
    result = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
    elapsed = time.perf_counter() - started
    if result.returncode != 0 or "Late blight" not in result.stdout:
        sys.exit(f"field_bundle: {' '.join(map(str, command))} failed:\n{result.stdout}{result.stderr}")
    return elapsed


def start_times(prefix: list, starts: int) -> dict:
    """Seconds to the answer: --device cpu with an empty cache, --device cpu warm (median), default (median)."""
    with tempfile.TemporaryDirectory() as cache, tempfile.TemporaryDirectory() as elsewhere:
        env = {k: v for k, v in os.environ.items() if k not in ("NUMBA_CACHE_DIR", "LNN_CACHE_DIR")}
        env["XDG_CACHE_HOME"] = cache
        cpu_cli = [*prefix, "--cli", "--device", "cpu", str(PHOTO)]
        first = timed(cpu_cli, elsewhere, env)
        warm = statistics.median(timed(cpu_cli, elsewhere, env) for _ in range(starts))
        numpy = statistics.median(timed([*prefix, "--cli", str(PHOTO)], elsewhere, env) for _ in range(starts))
    return {"first": first, "warm": warm, "numpy": numpy}


def camera_photo(folder: Path) -> Path:
    """A 4000x3000 JPEG made from a sample leaf (real content, not zeros), like a station camera's photo."""
    import cv2

    path = folder / "camera.jpg"
    leaf = cv2.imread(str(PHOTO))
    cv2.imwrite(str(path), cv2.resize(leaf, (4000, 3000), interpolation=cv2.INTER_CUBIC), [cv2.IMWRITE_JPEG_QUALITY, 90])
    return path


def per_photo(bundle: Path, repeats: int) -> dict:
    """Per-photo seconds for each setup, each in a fresh process."""
    with tempfile.TemporaryDirectory() as folder:
        folder = Path(folder)
        kernels = next((bundle / "_internal").glob("lnn_cpu_kernels*"))
        shutil.copy(kernels, folder)                       # the bundle's own compiled kernels, and nothing else
        big = camera_photo(folder)
        setups = {"app": ("cpu", {"LNN_CPU_KERNELS": "aot", "LNN_IMAGE_LIBRARY": "pillow", "PYTHONPATH": str(folder)}),
                  "python": ("cpu", {"LNN_CPU_KERNELS": "jit", "LNN_IMAGE_LIBRARY": "opencv"}),
                  "numpy": ("numpy", {"LNN_IMAGE_LIBRARY": "pillow"})}
        results = {}
        for name, (device, extra) in setups.items():
            env = {k: v for k, v in os.environ.items() if k not in ("LNN_CPU_KERNELS", "LNN_IMAGE_LIBRARY", "PYTHONPATH")}
            result = subprocess.run([sys.executable, "-c", PER_PHOTO, device, str(repeats), str(PHOTO.parent), str(big)],
                                    env={**env, **extra}, capture_output=True, text=True, timeout=900)
            if result.returncode != 0:
                sys.exit(f"field_bundle: per-photo run {name} failed:\n{result.stderr}")
            results[name] = json.loads(result.stdout)
    return results


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--bundle", type=Path, help="an already built bundle folder (default: build one)")
    parser.add_argument("--starts", type=int, default=5, help="warm starts per command (median)")
    parser.add_argument("--repeats", type=int, default=20, help="rounds of the 8 sample leaves per setup (median)")
    args = parser.parse_args()
    from report import machine_line, markdown_table, update_section

    build_s = None
    if args.bundle is None:
        started = time.perf_counter()
        subprocess.run(["bash", str(REPO / "packaging" / "build.sh")], env={**os.environ, "PYTHON": sys.executable},
                       check=True)
        build_s = time.perf_counter() - started
        args.bundle = REPO / "packaging" / "dist" / "lnn-field"
    args.bundle = args.bundle.resolve()
    executable = args.bundle / ("lnn-field.exe" if os.name == "nt" else "lnn-field")

    size = disk_bytes(args.bundle)
    parts = largest_parts(args.bundle / "_internal")
    frozen = start_times([str(executable)], args.starts)
    python = start_times([sys.executable, "-m", "lnn.tools.field"], args.starts)
    photo = per_photo(args.bundle, args.repeats)
    app, peer, numpy = photo["app"], photo["python"], photo["numpy"]
    assert app["library"] == "pillow" and not app["numba"] and peer["library"] == "opencv" and peer["numba"]

    import PyInstaller

    def ms(seconds):
        return f"{seconds * 1000:.1f}"

    built = f", built in {build_s:.0f} s by packaging/build.sh" if build_s else ""
    body = f"""## The packaged field app (PyInstaller onedir)

Command: `python benchmarks/field_bundle.py{" --bundle " + str(args.bundle.relative_to(REPO)) if build_s is None else ""}`. Machine: {machine_line(("numpy", "numba", "opencv-python-headless", "pillow"))}, PyInstaller {PyInstaller.__version__}.

Bundle `{args.bundle.name}/` on disk: **{size / MIB:.0f} MiB** ({size / 1e6:.0f} MB){built}; it holds the CPU kernels
compiled ahead of time and Pillow, not Numba, llvmlite or OpenCV (the bundle with them was 413 MiB).
Largest parts of `_internal/`:

{markdown_table(["part", "MiB"], [[name, f"{n / MIB:.0f}"] for n, name in parts])}

Start to the printed answer, `--cli examples/leaves/late_blight.jpg` from another working directory with an
empty per-user cache at first (the frozen app from its folder, compiled kernels and Pillow; the peer from
the Python install, Numba's JIT and OpenCV; median of {args.starts} for warm runs):

{markdown_table(["run", "frozen app, s", "python -m lnn.tools.field, s", "frozen ÷ python"],
                [["`--device cpu`, first run (the peer compiles its kernels)", f"{frozen['first']:.2f}", f"{python['first']:.2f}", f"{frozen['first'] / python['first']:.2f}"],
                 ["`--device cpu`, again (the peer's kernel cache warm)", f"{frozen['warm']:.2f}", f"{python['warm']:.2f}", f"{frozen['warm'] / python['warm']:.2f}"],
                 ["default (NumPy for a few images)", f"{frozen['numpy']:.2f}", f"{python['numpy']:.2f}", f"{frozen['numpy'] / python['numpy']:.2f}"]])}

Per photo, warm, in one process per setup (median over {args.repeats} rounds of the 8 sample leaves, 256x256 JPEGs;
"12 MP photo": decoding and preprocessing a 4000x3000 JPEG made from a sample leaf):

{markdown_table(["setup", "decode + preprocess, ms", "model run (batch 1), ms", "12 MP photo: decode + preprocess, ms"],
                [["app: compiled kernels, Pillow + NumPy resize", ms(app["prepare"]), ms(app["run"]), ms(app["large"])],
                 ["Python install: Numba JIT, OpenCV", ms(peer["prepare"]), ms(peer["run"]), ms(peer["large"])],
                 ["NumPy backend, Pillow + NumPy resize", ms(numpy["prepare"]), ms(numpy["run"]), ms(numpy["large"])],
                 ["app ÷ Python install", f"{app['prepare'] / peer['prepare']:.2f}", f"{app['run'] / peer['run']:.2f}", f"{app['large'] / peer['large']:.2f}"]])}
"""
    update_section("field_bundle", body)
    print(body)


if __name__ == "__main__":
    main()
