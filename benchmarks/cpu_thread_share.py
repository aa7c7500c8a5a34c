"""How evenly lnn splits one image over 2 threads: each thread's CPU time per call, 1 thread vs 2.

    python benchmarks/cpu_thread_share.py [--calls 30]    (about a minute)

On a shared machine the wall time of a 2-thread call says more about the neighbours than about lnn;
CPU time per thread does not (a thread's clock runs only while it runs). For each model at batch 1:
the calling thread's CPU ms per call with threads=1, then with threads=2 the calling thread's and
the helper's (time.pthread_getcpuclockid), their sum (the split's overhead shows as sum > 1 thread)
and "1 thread / larger share": the speed-up two free cores would give if neither ever waited for
the other (an upper bound, not a measurement of wall time). Then the 2-thread plan's tasks each
timed alone on the calling thread, one after the other (no other thread's caches or waiting in the
figure): their sum (the split's extra work over 1 thread) and the critical path (per split step its
longest task, plus the steps not split), and 1 thread / critical path, the speed-up two free cores
would give but for the hand-offs. Beside it, how many cores the machine gave at that moment: one
Numba loop that releases the GIL, alone and then twice at once on two threads (1.0: two free
cores; 2.0: one). Writes the "cpu_thread_share" section of docs/BENCHMARKS.md.
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

MODELS = ["leaf_cnn224", "tomato", "leaf_cnn", "mnist_cnn", "mnist_mlp"]


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


def tasks_alone(backend, x, calls: int) -> tuple[float, float]:
    """(sum, critical path) in CPU ms per call of the 2-thread plan's steps, each task timed alone on the
    calling thread (median over the calls); BLAS held at one thread as in a real call."""
    from lnn.runtime.cpu.backend import BLAS_THREADS
    from lnn.runtime.cpu.parallel import Parallel

    backend.run(x)
    plan = backend._plan(x.shape[0], backend.threads)
    times = []
    with BLAS_THREADS:
        for _ in range(calls):
            np.copyto(plan.input, x)
            call = []
            for step in plan.steps:
                tasks = step.tasks if type(step) is Parallel else [[step]]
                call.append([])
                for task in tasks:
                    start = time.thread_time()
                    for part in task:
                        part()
                    call[-1].append(time.thread_time() - start)
            times.append(call)
    medians = [[float(np.median([call[index][task] for call in times])) for task in range(len(step))]
               for index, step in enumerate(times[0])]
    return sum(map(sum, medians)) * 1e3, sum(map(max, medians)) * 1e3


def free_cores_probe() -> float:
    """Wall time of two copies of a GIL-free loop on two threads / one copy alone (1: two free cores)."""
    import numba

    @numba.njit(nogil=True)
    def loop(n):
        total = 0.0
        for i in range(n):
            total += (i % 7) * 0.5
        return total

    loop(10)
    ratios = []
    for _ in range(3):
        start = time.perf_counter()
        loop(20_000_000)
        alone = time.perf_counter() - start
        pair = [threading.Thread(target=loop, args=(20_000_000,)) for _ in range(2)]
        start = time.perf_counter()
        for thread in pair:
            thread.start()
        for thread in pair:
            thread.join()
        ratios.append((time.perf_counter() - start) / alone)
    return float(np.median(ratios))


def backend_helpers(backend) -> set:
    return {thread.ident for thread in backend._crew.threads} if backend._crew is not None else set()


def main() -> None:
    from lnn.runtime.cpu import BACKEND

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=30)
    parser.add_argument("--note", default="")
    args = parser.parse_args()
    probe = free_cores_probe()
    print(f"two GIL-free loops on two threads / one alone: {probe:.2f}", flush=True)
    rows = []
    for name in MODELS:
        bin_model = load_bin(name)
        model, weights = bin_model.model, bin_model.weights_fp32()
        x = np.random.default_rng(0).standard_normal((1, *model.input_shape)).astype(np.float32)
        one, _ = cpu_ms(BACKEND(model, weights, threads=1), x, args.calls)
        caller, helpers = cpu_ms(BACKEND(model, weights, threads=2), x, args.calls)
        larger = max(caller, *helpers)
        alone, critical = tasks_alone(BACKEND(model, weights, threads=2), x, args.calls)
        rows.append([name, f"{one:.3f}", f"{caller:.3f}", f"{helpers[0]:.3f}", f"{caller + sum(helpers):.3f}",
                     f"{one / larger:.2f}", f"{alone:.3f}", f"{critical:.3f}", f"{one / critical:.2f}"])
        print(" | ".join(rows[-1]), flush=True)
    body = "\n\n".join([
        "## One image over 2 threads: each thread's CPU time (lnn cpu backend, batch 1)",
        f"Command: `python benchmarks/cpu_thread_share.py --calls {args.calls}`. Machine: {machine_line()}."
        + (f" {args.note}" if args.note else ""),
        "CPU ms per call of each thread (its own clock, so other processes on the machine do not count). "
        "The last column, 1 thread / the larger 2-thread share, is the wall speed-up two free cores would "
        "give if no thread ever waited for the other: an upper bound, not a wall-time measurement. "
        "\"Tasks alone\": the 2-thread plan's tasks each timed on the calling thread, one after the other "
        "(sum: the split's extra work without the other thread's effects on caches; critical path: per "
        "split step the longest task): 1 thread / critical path is what two free cores would give but "
        "for the hand-offs (about 20 us each).",
        markdown_table(["model", "1 thread: CPU ms", "2 threads: caller ms", "helper ms", "sum ms",
                        "1 thread / larger share", "tasks alone: sum ms", "critical path ms",
                        "1 thread / critical path"], rows),
        f"Free cores at the time: two GIL-free loops on two threads took {probe:.2f}x the time of one alone "
        "(1.0: two free cores, 2.0: one)"
        + (", so a 2-thread wall-time speed-up could not show on this machine then." if probe > 1.5 else "."),
    ])
    update_section("cpu_thread_share", body)
    print("wrote the cpu_thread_share section of docs/BENCHMARKS.md")


if __name__ == "__main__":
    main()
