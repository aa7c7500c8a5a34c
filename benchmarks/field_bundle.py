"""The packaged lnn-field (PyInstaller onedir): size on disk and cold start of its --cli mode.

    python benchmarks/field_bundle.py [--bundle packaging/dist/lnn-field] [--starts 5]

Builds the bundle with packaging/build.sh unless --bundle names one already built. Size: the folder's
bytes on disk, and its largest parts. Start: wall time from process start to the printed answer for
`lnn-field --cli [--device cpu] examples/leaves/late_blight.jpg`, run from another working directory:
the Numba backend with an empty per-user cache (first run: compiles), then warm (median of --starts);
the NumPy backend (what --cli picks by itself for a few images); beside the same commands run from the
Python install (`python -m lnn.tools.field`) as the peer. Writes the `field_bundle` section of
docs/BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import os
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
    """Seconds to the answer: Numba with an empty cache, Numba warm (median), NumPy warm (median)."""
    with tempfile.TemporaryDirectory() as cache, tempfile.TemporaryDirectory() as elsewhere:
        env = {k: v for k, v in os.environ.items() if k not in ("NUMBA_CACHE_DIR", "LNN_CACHE_DIR")}
        env["XDG_CACHE_HOME"] = cache
        numba_cli = [*prefix, "--cli", "--device", "cpu", str(PHOTO)]
        first = timed(numba_cli, elsewhere, env)
        warm = statistics.median(timed(numba_cli, elsewhere, env) for _ in range(starts))
        numpy = statistics.median(timed([*prefix, "--cli", str(PHOTO)], elsewhere, env) for _ in range(starts))
    return {"first": first, "warm": warm, "numpy": numpy}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--bundle", type=Path, help="an already built bundle folder (default: build one)")
    parser.add_argument("--starts", type=int, default=5, help="warm starts per command (median)")
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

    import PyInstaller

    built = f", built in {build_s:.0f} s by packaging/build.sh" if build_s else ""
    body = f"""## The packaged field app (PyInstaller onedir)

Command: `python benchmarks/field_bundle.py{" --bundle " + str(args.bundle.relative_to(REPO)) if build_s is None else ""}`. Machine: {machine_line(("numpy", "numba", "opencv-python-headless"))}, PyInstaller {PyInstaller.__version__}.

Bundle `{args.bundle.name}/` on disk: **{size / MIB:.0f} MiB** ({size / 1e6:.0f} MB){built}. Largest parts of `_internal/`:

{markdown_table(["part", "MiB"], [[name, f"{n / MIB:.0f}"] for n, name in parts])}

Start to the printed answer, `--cli examples/leaves/late_blight.jpg` from another working directory
(the frozen app from its folder, the peer from the Python install; median of {args.starts} for warm runs):

{markdown_table(["run", "frozen app, s", "python -m lnn.tools.field, s", "frozen ÷ python"],
                [["`--device cpu` (Numba), empty kernel cache: compiles", f"{frozen['first']:.2f}", f"{python['first']:.2f}", f"{frozen['first'] / python['first']:.2f}"],
                 ["`--device cpu` (Numba), warm cache", f"{frozen['warm']:.2f}", f"{python['warm']:.2f}", f"{frozen['warm'] / python['warm']:.2f}"],
                 ["default (NumPy for a few images)", f"{frozen['numpy']:.2f}", f"{python['numpy']:.2f}", f"{frozen['numpy'] / python['numpy']:.2f}"]])}
"""
    update_section("field_bundle", body)
    print(body)


if __name__ == "__main__":
    main()
