"""What the test vectors cost the bundled model, and whether lnn-bench's figures are the plain loop's.

    python benchmarks/vectors_cost.py          (about a minute)

1. The vectors in models/tomato_leaf.bin: their bytes beside the file's; the time to check them
   (runtime/vectors.py check_session, what lnn-doctor and the field app's first start run) on the numpy
   and cpu backends, warm, median of 5 checks; the cold first check on cpu includes the kernels' compile
   or cache load, which the first start pays anyway.
2. lnn-bench against a bare loop: `lnn-bench --json` (its own process per backend) and, in this process,
   a loop of Session.run on the same input; p50 of each, 3 runs of lnn-bench, the median shown, and
   their ratio (about 1 means the tool adds nothing of its own). The machine may be shared: figures are noisy.
Writes the "test_vectors" section of docs/BENCHMARKS.md.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "benchmarks"))
from report import machine_line, markdown_table, update_section  # noqa: E402

import lnn  # noqa: E402
from lnn.runtime.vectors import check_session  # noqa: E402

MODEL = REPO / "models" / "tomato_leaf.bin"
COMMAND = "python benchmarks/vectors_cost.py"
RUNS, BENCH_REPEATS, CHECKS = 200, 3, 5


def check_times(device: str) -> tuple:
    session = lnn.load(MODEL, device=device)
    start = time.perf_counter()
    first = check_session(session)
    cold = time.perf_counter() - start
    times = []
    for _ in range(CHECKS):
        start = time.perf_counter()
        check_session(session)
        times.append(time.perf_counter() - start)
    return first, cold * 1e3, float(np.median(times)) * 1e3


def bare_p50(device: str) -> float:
    session = lnn.load(MODEL, device=device, **({"threads": 1} if device == "cpu" else {}))
    x = session.bin.test_vectors[0][:1]
    for _ in range(10):
        session.run(x)
    times = []
    for _ in range(RUNS):
        start = time.perf_counter()
        session.run(x)
        times.append(time.perf_counter() - start)
    return float(np.median(times)) * 1e3


def bench_p50(device: str) -> float:
    figures = []
    for _ in range(BENCH_REPEATS):
        done = subprocess.run([sys.executable, "-m", "lnn.tools.bench", str(MODEL), "--device", device, "--threads", "1",
                               "--runs", str(RUNS), "--warmup", "10", "--json"], capture_output=True, text=True, check=True)
        figures.append(json.loads(done.stdout)["devices"][device]["p50_ms"])
    return float(np.median(figures))


def main() -> None:
    started = time.time()
    bin_model = lnn.load(MODEL, device="numpy").bin
    inputs, outputs = bin_model.test_vectors
    size, vector_bytes = MODEL.stat().st_size, inputs.nbytes + outputs.nbytes
    check_rows, bench_rows = [], []
    for device in ("numpy", "cpu"):
        first, cold, warm = check_times(device)
        check_rows.append([device, first.count, f"{first.difference:.2g}", f"{cold:.1f}", f"{warm:.2f}"])
        bare, tool = bare_p50(device), bench_p50(device)
        bench_rows.append([device, f"{bare:.3f}", f"{tool:.3f}", f"{tool / bare:.2f}"])
    body = f"""## Test vectors: their cost, and lnn-bench against a bare loop

`{COMMAND}` — {machine_line(("numpy", "numba"))}; load average {os.getloadavg()[0]:.1f} at the end
(a shared machine: the absolute times are noisy, the ratios less so).

The bundled model's {len(inputs)} test vectors (2 sample photos) take {vector_bytes:,} bytes of its {size:,}
({vector_bytes / size:.0%}). Checking them (check_session: each vector at batch 1, compared with the stored
outputs) on the backends' default threads, as lnn-doctor and the field app run them (on a busy 2-core machine
2 BLAS threads make a call far slower than 1, see the lnn-bench rows): the first check in a fresh process (cpu:
kernels compiled or loaded from the cache included), then warm, median of {CHECKS}.

{markdown_table(["device", "vectors", "max difference", "first check ms", "warm check ms"], check_rows)}

lnn-bench's warm p50 (batch 1, 1 thread, {RUNS} calls, its own process, median of {BENCH_REPEATS} runs)
against a bare loop of Session.run on the same input in this process:

{markdown_table(["device", "bare loop p50 ms", "lnn-bench p50 ms", "lnn-bench / bare"], bench_rows)}

Run time {time.time() - started:.0f} s."""
    update_section("test_vectors", body)
    print(body)


if __name__ == "__main__":
    main()
