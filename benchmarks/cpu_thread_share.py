"""How evenly lnn splits one image over 2 threads: each thread's CPU time per call, 1 thread vs 2.

    python benchmarks/cpu_thread_share.py [--calls 30]    (about a minute)

On a shared machine the wall time of a 2-thread call says more about the neighbours than about lnn;
CPU time per thread does not (a thread's clock runs only while it runs). For each model at batch 1:
the calling thread's CPU ms per call with threads=1, then with threads=2 the calling thread's and
the helper's (time.pthread_getcpuclockid), their sum (the split's overhead shows as sum > 1 thread)
and "1 thread / larger share": the speed-up two free cores would give if neither ever waited for
the other (an upper bound, not a measurement of wall time). Writes the "cpu_thread_share" section of
docs/BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import sys
import threading
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "benchmarks"))
from cpu_peers import load_bin  # noqa: E402
from report import machine_line, markdown_table, update_section  # noqa: E402

MODELS = ["leaf_cnn224", "tomato", "leaf_cnn", "mnist_cnn"]


def cpu_ms(backend, x, calls: int) -> tuple[float, list]:
    """(calling thread's CPU ms per call, [each helper's CPU ms per call])."""
    clocks = [time.pthread_getcpuclockid(t.ident) for t in threading.enumerate()
              if t.name.startswith("lnn-cpu") and t.ident in backend_helpers(backend)]
    backend.run(x)
    backend.run(x)
    helpers = [time.clock_gettime(clock) for clock in clocks]
    start = time.thread_time()
    for _ in range(calls):
        backend.run(x)
    caller = (time.thread_time() - start) / calls * 1e3
    return caller, [(time.clock_gettime(clock) - h) / calls * 1e3 for clock, h in zip(clocks, helpers)]


def backend_helpers(backend) -> set:
    return {thread.ident for thread in backend._crew.threads} if backend._crew is not None else set()


def main() -> None:
    from lnn.runtime.cpu import BACKEND

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=30)
    parser.add_argument("--note", default="")
    args = parser.parse_args()
    rows = []
    for name in MODELS:
        bin_model = load_bin(name)
        model, weights = bin_model.model, bin_model.weights_fp32()
        x = np.random.default_rng(0).standard_normal((1, *model.input_shape)).astype(np.float32)
        one, _ = cpu_ms(BACKEND(model, weights, threads=1), x, args.calls)
        caller, helpers = cpu_ms(BACKEND(model, weights, threads=2), x, args.calls)
        larger = max(caller, *helpers)
        rows.append([name, f"{one:.2f}", f"{caller:.2f}", f"{helpers[0]:.2f}", f"{caller + sum(helpers):.2f}",
                     f"{one / larger:.2f}"])
        print(" | ".join(rows[-1]), flush=True)
    body = "\n\n".join([
        "## One image over 2 threads: each thread's CPU time (lnn cpu backend, batch 1)",
        f"Command: `python benchmarks/cpu_thread_share.py --calls {args.calls}`. Machine: {machine_line()}."
        + (f" {args.note}" if args.note else ""),
        "CPU ms per call of each thread (its own clock, so other processes on the machine do not count). "
        "The last column, 1 thread / the larger 2-thread share, is the wall speed-up two free cores would "
        "give if no thread ever waited for the other: an upper bound, not a wall-time measurement.",
        markdown_table(["model", "1 thread: CPU ms", "2 threads: caller ms", "helper ms", "sum ms",
                        "1 thread / larger share"], rows),
    ])
    update_section("cpu_thread_share", body)
    print("wrote the cpu_thread_share section of docs/BENCHMARKS.md")


if __name__ == "__main__":
    main()
