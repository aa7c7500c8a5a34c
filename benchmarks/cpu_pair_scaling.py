"""Do this machine's two cores run two threads of arithmetic side by side at full speed? (a bound on any
one-image split, lnn's or a peer's)

    python benchmarks/cpu_pair_scaling.py [--rounds 5]          (about a minute)

Each workload runs alone on one thread, then as two copies at once on two threads pinned to different
CPUs, alternating, `--rounds` times. Pair scaling = 2 x (time alone) / (time of the pair): 2.0 where the
two CPUs are independent cores, about 1.0 where they share one core's arithmetic units (two hardware
threads of one core, as a VM's vCPUs can be without saying so). Workloads:
  - FMA-bound: 16 independent chains of 16-lane multiply-adds (throughput of the FMA units, as in lnn's
    register-tiled kernels),
  - add-latency: dependent adds (each waits for the one before: latency, not throughput),
  - lnn's conv tasks: each of the bundled model's split steps (its 2-thread plan at batch 1), its two tasks
    on plain threads without lnn's crew or hand-offs: one task alone, then both at once.
Before them, a cache line's round trip between the two CPUs (whether they share a last-level cache).
Writes the "cpu_pair_scaling" section of docs/BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "benchmarks"))
from cpu_peers import load_bin, random_input  # noqa: E402
from report import machine_line, markdown_table, update_section  # noqa: E402


def arithmetic_workloads() -> dict:
    import numba

    @numba.njit(nogil=True, fastmath=True)
    def fma_chains(a, b, repeats):
        acc = np.ones((16, 16), np.float32)
        for _ in range(repeats):
            for chain in range(16):
                for lane in range(16):
                    acc[chain, lane] = acc[chain, lane] * a[lane] + b[lane]
        return acc.sum()

    @numba.njit(nogil=True, fastmath=True)
    def dependent_adds(x, repeats):
        sums = np.zeros(16, np.float32)
        for _ in range(repeats):
            for i in range(x.shape[0]):
                sums[i % 16] += x[i] * np.float32(1.0001)
        return sums.sum()

    rng = np.random.default_rng(0)
    a, b = rng.uniform(0.99, 1.0, 16).astype(np.float32), rng.uniform(0, 0.01, 16).astype(np.float32)
    x = rng.standard_normal(4096).astype(np.float32)
    return {"FMA-bound (16 chains of 16 lanes)": lambda: fma_chains(a, b, 150_000),
            "add-latency (dependent adds)": lambda: dependent_adds(x, 6000)}


def lnn_tasks() -> dict:
    """{label: (task 0, task 1)} of the bundled model's 2-thread plan at batch 1 (each a function running its steps)."""
    from lnn.runtime.cpu import BACKEND
    from lnn.runtime.cpu.parallel import Parallel, run_steps

    bundled = load_bin("tomato")
    backend = BACKEND(bundled.model, bundled.weights_fp32(), threads=2)
    backend._chosen[1] = 2                      # the split plan, whatever the timed choice would be
    backend.run(random_input((1, *bundled.model.input_shape)))
    plan = backend._plan(1, 2)
    tasks = {}
    for index, step in enumerate(plan.steps):
        if type(step) is Parallel and len(step.tasks) == 2:
            names = "+".join(part.func.__name__ for part in step.tasks[0] if hasattr(part, "func"))
            tasks[f"tomato step {index}: {names}"] = tuple(lambda steps=steps: run_steps(steps) for steps in step.tasks)
    return tasks


def cache_line_round_trip(turns: int = 20_000) -> float:
    """Microseconds a cache line takes from one CPU to the other and back, the median of 3: two threads pinned to
    CPUs 0 and 1 take turns raising one counter. About 0.1 us where the two share their last-level cache, 0.4-0.5
    on the 2-core Zen 3 VM in the minutes when its vCPUs sat on different L3s; a one-image split moves each
    layer's data between the cores, so its speed-up follows this (docs/ARCHITECTURE.md, the scratch per thread)."""
    import numba

    from lnn.runtime.cpu.jit import load_acquire, store_release

    @numba.njit(nogil=True)
    def take_turns(counter, turns, second):
        for turn in range(turns):
            mine = 2 * turn + second
            while load_acquire(counter, 0) != mine:
                pass
            store_release(counter, 0, mine + 1)

    cpus = sorted(os.sched_getaffinity(0))[:2]

    def pinned(cpu, counter, second):
        os.sched_setaffinity(threading.get_native_id(), {cpu})
        take_turns(counter, turns, second)

    take_turns(np.zeros(1, np.int64), 0, 0)         # compiled
    trips = []
    for _ in range(3):
        counter = np.zeros(1, np.int64)
        threads = [threading.Thread(target=pinned, args=(cpu, counter, second)) for second, cpu in enumerate(cpus)]
        start = time.perf_counter()
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        trips.append((time.perf_counter() - start) / turns * 1e6)
    return float(np.median(trips))


def timed_loop(function, repeats: int, cpu: int | None, out: list) -> None:
    if cpu is not None:
        os.sched_setaffinity(threading.get_native_id(), {cpu})
    start = time.perf_counter()
    for _ in range(repeats):
        function()
    out.append(time.perf_counter() - start)


def alone_and_paired(first, second, repeats: int) -> tuple[float, float]:
    """(seconds of `first` alone, seconds of the pair: first and second at once on CPUs 0 and 1)."""
    cpus = sorted(os.sched_getaffinity(0))[:2]
    alone: list = []
    thread = threading.Thread(target=timed_loop, args=(first, repeats, cpus[0], alone))
    thread.start()
    thread.join()
    paired: list = []
    threads = [threading.Thread(target=timed_loop, args=(function, repeats, cpu, paired))
               for function, cpu in zip((first, second), cpus)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return alone[0], max(paired)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--note", default="")
    args = parser.parse_args()
    if len(os.sched_getaffinity(0)) < 2:
        sys.exit("cpu_pair_scaling: needs 2 CPUs")
    round_trips = [cache_line_round_trip() for _ in range(args.rounds)]
    print(f"a cache line's round trip between the two CPUs: {' '.join(f'{t:.2f}' for t in round_trips)} us", flush=True)
    workloads = {name: (function, function, 1) for name, function in arithmetic_workloads().items()}
    workloads.update({name: (first, second, 100) for name, (first, second) in lnn_tasks().items()})
    rows = []
    for name, (first, second, repeats) in workloads.items():
        alone_and_paired(first, second, 1)                  # compiled, caches warm
        pairs = [alone_and_paired(first, second, repeats) for _ in range(args.rounds)]
        scaling = [2 * alone / pair for alone, pair in pairs]
        alone_ms = np.median([alone for alone, _ in pairs]) * 1e3 / repeats
        pair_ms = np.median([pair for _, pair in pairs]) * 1e3 / repeats
        print(f"{name}: alone {alone_ms:.3f} ms, pair {pair_ms:.3f} ms, pair scaling median {np.median(scaling):.2f} "
              f"(rounds {' '.join(f'{s:.2f}' for s in scaling)})", flush=True)
        rows.append([name, f"{alone_ms:.3f}", f"{pair_ms:.3f}", f"{np.median(scaling):.2f}",
                     " ".join(f"{s:.2f}" for s in scaling)])
    update_section("cpu_pair_scaling", "\n\n".join([
        "## Two threads side by side: how far this machine's 2 cores scale (the bound on a one-image split)",
        f"Command: `python benchmarks/cpu_pair_scaling.py --rounds {args.rounds}`. Machine: {machine_line()}"
        f"{'; ' + args.note if args.note else ''}.",
        "Each workload alone on one thread, then two copies at once on two threads pinned to different CPUs, "
        "alternating; ms per repetition (medians of the rounds), pair scaling = 2 × alone / pair (2.0: independent "
        "cores). The lnn rows are the bundled model's split steps at batch 1: one step's two tasks (disjoint parts "
        "of one layer's output) repeated on plain threads, without lnn's crew or hand-offs.",
        markdown_table(["workload", "alone ms", "pair ms", "pair scaling", "per round"], rows),
        "A cache line's round trip between the two CPUs (`cache_line_round_trip`, before the workloads, "
        f"{args.rounds} times): {' / '.join(f'{t:.2f}' for t in round_trips)} µs (about 0.1 where they share a "
        "last-level cache)."]))


if __name__ == "__main__":
    main()
