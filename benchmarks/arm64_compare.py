"""The outputs benchmarks/arm64_emulation.sh compares between x86-64 (the host) and arm64 (the emulated root).

    python benchmarks/arm64_compare.py outputs OUT.npz           # on each side: every output, saved
    python benchmarks/arm64_compare.py compare X86.npz ARM64.npz  # on the host: the differences, the verdict
    python benchmarks/arm64_compare.py section LOG                # on the host: LOG into docs/BENCHMARKS.md

`outputs` runs the four reference models (examples/reference/<name>.json with the PyTorch weights and
sample inputs from ../shared/reference_models, or $LNN_SHARED/reference_models) and the bundled
models/tomato_leaf.bin on the sample leaves (examples/leaves/*.jpg, decoded and preprocessed on that side)
on the `numpy` and `cpu` backends. `compare` prints, per model and backend, max |arm64 - x86-64|, whether
they are bit-identical and max |output - PyTorch| on each side, and exits 1 when a reference model is
further than TARGET from x86-64.
"""

from __future__ import annotations

import platform
import sys
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "benchmarks"))
from cpu_latency import MODELS, load_bin  # noqa: E402  (the reference models, built the same way there)
from report import SHARED, update_section  # noqa: E402

REFERENCE_MODELS = SHARED / "reference_models"
BACKENDS = ("numpy", "cpu")
TOMATO = "tomato_leaf"
TARGET = 1e-5          # issue 16: every reference model within 1e-5 of x86-64 on both backends
SECTION = "arm64_emulation"


def outputs(path: Path) -> None:
    from lnn.runtime import Session, load

    leaves = sorted((REPO / "examples" / "leaves").glob("*.jpg"))
    results = {"machine": np.array(f"{platform.machine()}, Python {platform.python_version()}, "
                                   f"NumPy {np.__version__}, Numba {__import__('numba').__version__}")}
    for name in MODELS:
        x = np.load(REFERENCE_MODELS / f"{name}.samples.npz")["input"]
        for backend in BACKENDS:
            results[f"{name}/{backend}"] = Session(load_bin(name), device=backend).run(x)
    for backend in BACKENDS:
        session = load(REPO / "models" / f"{TOMATO}.bin", device=backend)
        x = np.stack([session.prepare_image(leaf) for leaf in leaves])
        results[f"{TOMATO}/input"] = x
        results[f"{TOMATO}/{backend}"] = session.run(x)
    np.savez(path, **results)
    print(f"{len(results) - 1} arrays from {results['machine']} in {path}")


def compare(x86_path: Path, arm_path: Path) -> int:
    x86, arm = np.load(x86_path), np.load(arm_path)
    print(f"x86-64: {x86['machine']}\narm64:  {arm['machine']}")
    print(f"{'model':<12} {'backend':<7} {'max |arm64 - x86-64|':>21} {'max |x86-64|':>13} {'bit-identical':>14} "
          f"{'x86-64 vs PyTorch':>18} {'arm64 vs PyTorch':>17}")
    failed = []
    for name in [*MODELS, TOMATO]:
        expected = np.load(REFERENCE_MODELS / f"{name}.samples.npz")["expected"] if name in MODELS else None
        keys = [*BACKENDS, "input"] if name == TOMATO else BACKENDS
        for key in keys:
            a, b = x86[f"{name}/{key}"], arm[f"{name}/{key}"]
            difference = float(np.max(np.abs(a - b)))
            torch = ([f"{float(np.max(np.abs(side - expected))):.2e}" for side in (a, b)]
                     if expected is not None else ["-", "-"])
            print(f"{name:<12} {key:<7} {difference:>21.2e} {float(np.max(np.abs(a))):>13.3g} "
                  f"{str(np.array_equal(a, b)):>14} "
                  f"{torch[0]:>18} {torch[1]:>17}")
            if name in MODELS and not difference <= TARGET:
                failed.append(f"{name} on {key}")
        if name == TOMATO:
            print(f"{'':<12} (input: the {len(a)} sample leaves as each side decodes and preprocesses them)")
            top = [x86[f"{name}/{b}"].argmax(1) for b in BACKENDS] + [arm[f"{name}/{b}"].argmax(1) for b in BACKENDS]
            same = all(np.array_equal(top[0], t) for t in top)
            print(f"{name}: top-1 label of the {len(top[0])} leaves {'the same' if same else 'DIFFERENT'} "
                  f"on both machines and backends")
    if failed:
        print(f"target missed (max |arm64 - x86-64| <= {TARGET:g}): {', '.join(failed)}")
        return 1
    print(f"target met: every reference model within {TARGET:g} of x86-64 on {' and '.join(BACKENDS)}")
    return 0


def section(log: Path) -> None:
    body = (f"## arm64 (the Raspberry Pi's architecture) under emulation\n\n"
            f"`sudo benchmarks/arm64_emulation.sh` (not in CI): a Debian bookworm arm64 root made with "
            f"debootstrap and run under qemu-user-static on this x86-64 host, lnn and its dependencies "
            f"installed there from PyPI as aarch64 wheels. What the script printed, the stage times "
            f"included (emulated arm64 runs far slower than a real Pi; the times say what the check "
            f"costs, not how fast a Pi is):\n\n```\n{log.read_text().strip()}\n```")
    update_section(SECTION, body)
    print(f"wrote section {SECTION} of docs/BENCHMARKS.md")


if __name__ == "__main__":
    command, *paths = sys.argv[1:] or [""]
    if command == "outputs" and len(paths) == 1:
        outputs(Path(paths[0]))
    elif command == "compare" and len(paths) == 2:
        sys.exit(compare(Path(paths[0]), Path(paths[1])))
    elif command == "section" and len(paths) == 1:
        section(Path(paths[0]))
    else:
        sys.exit("usage: arm64_compare.py outputs OUT.npz | compare X86.npz ARM64.npz | section LOG")
