"""CPU inference latency: the Numba backend vs the NumPy backend vs onnxruntime, and cold start.

    python benchmarks/cpu_latency.py            (about 2-4 minutes; needs ../shared/reference_models)

For each reference model, at 1 and 2 threads, batch 1 and batch 32: the median latency over many
runs after warm-up, on random-normal inputs, of
  - lnn numba   lnn.runtime.cpu with threads=N (one image's layers, or a large batch, split over N threads),
  - lnn numpy   lnn.runtime.reference, with BLAS limited to N threads (threadpoolctl),
  - onnxruntime the reference .onnx, intra_op_num_threads=N,
and the ratio numba / onnxruntime (below 1: lnn is faster).
Cold start: wall time from process start to the printed answer of `python -m lnn.tools.infer` on one
image with leaf_cnn, for the Numba backend with an empty kernel cache, then with the cache filled,
and for the NumPy backend; plus the compile (or cache-load) seconds the Numba backend reports apart.
Writes the "cpu_latency" section of docs/BENCHMARKS.md.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "benchmarks"))
from report import SHARED, call_times, machine_line, markdown_table, update_section  # noqa: E402

from lnn.formats.binfile import build_metadata, encode_bin, parse_bin_bytes  # noqa: E402
from lnn.formats.model import load_model  # noqa: E402

REFERENCE_MODELS = SHARED / "reference_models"
MODELS = ["mnist_mlp", "mnist_cnn", "leaf_cnn", "leaf_cnn224"]
THREADS = (1, 2)
BATCHES = (1, 32)
SECONDS_PER_MEASURE = 0.6
IMAGE = REFERENCE_MODELS / "leaf_256.jpg"
COMMAND = "python benchmarks/cpu_latency.py"


def median_ms(function, x, seconds: float = SECONDS_PER_MEASURE) -> float:
    """Median wall time of function(x) in ms: 3 warm-up calls, then at least 5 timed ones for ~`seconds`."""
    return float(np.median(call_times(lambda: function(x), 3, 5, seconds, 2000))) * 1e3


def load_bin(name: str):
    model = load_model(REPO / "examples" / "reference" / f"{name}.json")
    weights = dict(np.load(REFERENCE_MODELS / f"{name}.weights.npz"))
    return parse_bin_bytes(encode_bin(model, weights, build_metadata(model)))


def latency_rows() -> list:
    import onnxruntime
    from threadpoolctl import threadpool_limits

    from lnn.runtime.cpu import BACKEND as CpuBackend
    from lnn.runtime.reference import NumpyBackend

    rows = []
    for name in MODELS:
        bin_model = load_bin(name)
        model, weights = bin_model.model, bin_model.weights_fp32()
        numpy_backend = NumpyBackend(model, weights)
        for threads in THREADS:
            cpu = CpuBackend(model, weights, threads=threads)
            options = onnxruntime.SessionOptions()
            options.intra_op_num_threads = threads
            options.inter_op_num_threads = 1
            ort = onnxruntime.InferenceSession(str(REFERENCE_MODELS / f"{name}.onnx"), options,
                                               providers=["CPUExecutionProvider"])
            for batch in BATCHES:
                x = np.random.default_rng(batch).standard_normal((batch, *model.input_shape)).astype(np.float32)
                numba_ms = median_ms(cpu.run, x)
                with threadpool_limits(threads, user_api="blas"):
                    numpy_ms = median_ms(numpy_backend.run, x)
                ort_ms = median_ms(lambda batch_x: ort.run(None, {"input": batch_x}), x)
                row = [name, threads, batch, f"{numba_ms:.3f}", f"{numpy_ms:.3f}", f"{ort_ms:.3f}",
                       f"{numba_ms / ort_ms:.2f}"]
                print(" | ".join(map(str, row)), flush=True)
                rows.append(row)
    return rows


COMPILE_PROBE = """
import sys, time
import numpy as np
from lnn.runtime import load
session = load(sys.argv[1], device="cpu")
print(f"{session.backend.warmup():.3f}")
"""


def timed_process(args: list, env: dict) -> tuple[float, str]:
    start = time.perf_counter()
    result = subprocess.run([sys.executable, *args], capture_output=True, text=True, env=env, timeout=300)
    elapsed = time.perf_counter() - start
    if result.returncode != 0:
        raise SystemExit(f"{' '.join(args)} failed:\n{result.stderr}")
    return elapsed, result.stdout.strip()


def cold_start_rows() -> list:
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        model_path = Path(folder) / "leaf_cnn.bin"
        model_path.write_bytes(encode_bin(*_model_and_weights("leaf_cnn")))
        env = {k: v for k, v in os.environ.items() if k != "NUMBA_CACHE_DIR"}
        env["LNN_CACHE_DIR"] = str(Path(folder) / "cache")
        infer = ["-m", "lnn.tools.infer", "--model", str(model_path), "--top-k", "1", str(IMAGE)]
        for label, device in (("numba, empty cache", "cpu"), ("numba, cached", "cpu"), ("numpy", "numpy")):
            seconds, answer = timed_process([*infer, "--device", device], env)
            print(f"cold start {label}: {seconds:.2f} s  ({answer.splitlines()[-1] if answer else ''})", flush=True)
            rows.append([f"`lnn.tools.infer --device {device}` ({label})", f"{seconds:.2f}"])
        env["LNN_CACHE_DIR"] = str(Path(folder) / "cache2")
        for label in ("compile, empty cache", "cache load"):
            _, compile_seconds = timed_process(["-c", COMPILE_PROBE, str(model_path)], env)
            print(f"numba {label} (in-process, reported by warmup()): {compile_seconds} s", flush=True)
            rows.append([f"numba kernels of leaf_cnn: {label} (`warmup()`)", compile_seconds])
        import_seconds, _ = timed_process(["-c", "import numpy, cv2"], env)
        rows.append(["`python -c 'import numpy, cv2'` (for scale)", f"{import_seconds:.2f}"])
    return rows


def _model_and_weights(name: str):
    model = load_model(REPO / "examples" / "reference" / f"{name}.json")
    weights = dict(np.load(REFERENCE_MODELS / f"{name}.weights.npz"))
    return model, weights, build_metadata(model)


def main() -> None:
    if not REFERENCE_MODELS.exists():
        raise SystemExit(f"{REFERENCE_MODELS} is absent; this benchmark needs the reference models")
    print("model | threads | batch | numba ms | numpy ms | onnxruntime ms | numba/ort", flush=True)
    latency = latency_rows()
    cold = cold_start_rows()
    body = "\n\n".join([
        "## CPU inference latency (Numba backend vs NumPy backend vs onnxruntime)",
        f"Command: `{COMMAND}`. Machine: {machine_line()}.",
        "Median wall time per call after warm-up, random-normal inputs. `threads` is the Numba backend's "
        "`threads=N`: a call of at least 250 MFLOPs is split into N parts of the batch, each run on its own thread "
        "with one BLAS thread, and a smaller one has each conv's rows and linear's outputs split over N threads "
        "(docs/ARCHITECTURE.md); for "
        "the NumPy backend it is the BLAS thread count, for onnxruntime `intra_op_num_threads`. "
        "numba/ort below 1 means lnn is faster. The issue's first target: numba/ort <= 2 for leaf_cnn, batch 1, 1 thread.",
        markdown_table(["model", "threads", "batch", "lnn numba ms", "lnn numpy ms", "onnxruntime ms", "numba / ort"],
                       latency),
        "### Cold start, one image (leaf_cnn, process start to printed answer)",
        markdown_table(["what", "seconds"], cold),
    ])
    update_section("cpu_latency", body)
    print(f"wrote the cpu_latency section of {Path('docs/BENCHMARKS.md')}")


if __name__ == "__main__":
    main()
