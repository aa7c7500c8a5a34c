"""One image on 2 threads beside a busy process: lnn and onnxruntime, each in its own process, same weights.

    python benchmarks/cpu_busy_neighbour.py [--rounds 2] [--seconds 4]   (about 3 minutes)

A station's box runs other things too. Each runtime's process may use the first two CPUs this script may
use and times batch-1 calls at 2 threads (the bundled tomato model and leaf_cnn, random-normal inputs) for
--seconds after warm-up: alone, and beside a busy loop (a Python `while True`) pinned to the second of those
CPUs at nice 0 and at nice 10. Median, mean and 90th percentile ms a call; each condition's median against
the same runtime's alone, and lnn's against onnxruntime's. lnn is `lnn.runtime.cpu` with threads=2 (its
split choice made before the timed calls, as in benchmarks/cpu_peers.py; it may keep one thread when the
split is not faster); onnxruntime `intra_op_num_threads=2`. The processes run --rounds times, interleaved;
each figure is the median of the rounds. Writes the "cpu_busy_neighbour" section of docs/BENCHMARKS.md.
Needs ../shared/reference_models (leaf_cnn) and onnxruntime (benchmark-only); Linux (CPU affinity).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "benchmarks"))
from cpu_peers import RUNNERS, peer_files  # noqa: E402
from report import call_times, machine_line, markdown_table, update_section  # noqa: E402

MODELS = ["tomato", "leaf_cnn"]
RUNTIMES = ["lnn", "onnxruntime"]
CONDITIONS = {"alone": None, "busy loop, nice 0": 0, "busy loop, nice 10": 10}
COMMAND = "python benchmarks/cpu_busy_neighbour.py"


def worker(runtime: str, name: str, files: dict, seconds: float) -> None:
    """In its own process: one line of JSON with the calls' median, mean and p90 ms, and lnn's split choice."""
    run = RUNNERS[runtime](name, 2, 1, files)
    times = np.array(call_times(run, 20, 50, seconds, 10**6)) * 1e3
    result = {"median": float(np.median(times)), "mean": float(times.mean()), "p90": float(np.percentile(times, 90))}
    if getattr(run, "choice", None):
        result["choice"] = run.choice()
    print(json.dumps(result))


def busy_loop(cpu: int, nice: int) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", f"import os\nos.sched_setaffinity(0, {{{cpu}}})\nos.nice({nice})\n"
                             "while True:\n    pass"])


def measure(runtime: str, name: str, files: dict, cpus: set, seconds: float) -> dict:
    command = [sys.executable, __file__, "--worker", runtime, name, json.dumps(files), str(seconds)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120 + 4 * seconds,
                          preexec_fn=lambda: os.sched_setaffinity(0, cpus))
    if done.returncode != 0:
        raise SystemExit(f"{runtime} {name} failed: {done.stderr.strip().splitlines()[-1:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--seconds", type=float, default=4.0, help="timed seconds per process")
    parser.add_argument("--worker", nargs=4, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        runtime, name, files, seconds = args.worker
        return worker(runtime, name, json.loads(files), float(seconds))
    if not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < 2:
        raise SystemExit("cpu_busy_neighbour: needs Linux and at least 2 CPUs")
    cpus = set(sorted(os.sched_getaffinity(0))[:2])
    busy_cpu = max(cpus)
    results = {}
    with tempfile.TemporaryDirectory() as folder:
        files = {name: peer_files(name, Path(folder)) for name in MODELS}
        for round_number in range(1, args.rounds + 1):
            for condition, nice in CONDITIONS.items():
                busy = None if nice is None else busy_loop(busy_cpu, nice)
                try:
                    for name in MODELS:
                        for runtime in RUNTIMES:
                            result = measure(runtime, name, files[name][runtime], cpus, args.seconds)
                            results.setdefault((name, runtime, condition), []).append(result)
                            print(f"round {round_number} {condition:18} {name:9} {runtime:12} {result}", flush=True)
                finally:
                    if busy is not None:
                        busy.kill()
                        busy.wait()
    rows = []
    for name in MODELS:
        for condition in CONDITIONS:
            cells = [name, condition]
            medians = {}
            for runtime in RUNTIMES:
                runs = results[(name, runtime, condition)]
                figures = {key: np.median([run[key] for run in runs]) for key in ("median", "mean", "p90")}
                medians[runtime] = figures["median"]
                alone = np.median([run["median"] for run in results[(name, runtime, "alone")]])
                cells.append(f"{figures['median']:.3f} / {figures['mean']:.3f} / {figures['p90']:.3f} "
                             f"({figures['median'] / alone:.2f}x)")
            choices = sorted({run.get("choice", "") for run in results[(name, "lnn", condition)]})
            cells += [f"{medians['lnn'] / medians['onnxruntime']:.2f}", "; ".join(choices)]
            rows.append(cells)
    headers = ["model", "second CPU", "lnn ms: median / mean / p90 (median / alone)",
               "onnxruntime ms: median / mean / p90 (median / alone)", "lnn / onnxruntime (medians)", "lnn's split choice"]
    table = markdown_table(headers, rows)
    print(table)
    update_section("cpu_busy_neighbour", "\n".join([
        "## One image on 2 threads beside a busy process",
        "",
        f"Command: `{COMMAND} --rounds {args.rounds} --seconds {args.seconds:g}`. Machine: "
        f"{machine_line()}. Load average {os.getloadavg()[0]:.2f} at the end.",
        "",
        f"Each runtime's process on CPUs {sorted(cpus)} at 2 threads, batch 1; \"busy loop\": a Python `while True` "
        f"pinned to CPU {busy_cpu} at that nice value, started before the runtime's process. Each figure is the "
        f"median of {args.rounds} interleaved rounds.",
        "",
        table,
    ]))


if __name__ == "__main__":
    main()
