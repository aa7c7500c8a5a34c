"""Where the time of one image on 2 threads goes, layer by layer (lnn cpu backend, batch 1).

    python benchmarks/cpu_thread_layers.py [--calls 60] [--models tomato,leaf_cnn224,leaf_cnn]   (about a minute)

For each model, the plan of threads=1 and the split plan of threads=2 (kept split: the backend's timed
choice is set aside) run `--calls` times each, every step of the plan timed as it runs (in whichever
thread runs it). Per fused layer: the 1-thread time (its steps' sum), and at 2 threads the layer's
wall time (its first step's start to its last step's end), each thread's busy time in it (the sum
of its steps there) and the rest, wall minus the busier thread: the hand-offs, waiting for the
slower task and the GIL. Medians over the calls. Other processes on the machine would distort the
figures: the CPU they used during each measurement is read from /proc/stat (busy CPU time less this
process's), and a measurement is repeated (up to 6 times) until they used under 0.1 of a core. A timed
step costs about a microsecond more than an untimed one. Writes the "cpu_thread_layers" section of
docs/BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "benchmarks"))
from cpu_peers import load_bin, random_input  # noqa: E402
from report import busy_seconds, machine_line, markdown_table, others_cores, update_section  # noqa: E402

MODELS = ["tomato", "leaf_cnn224", "leaf_cnn"]
QUIET = 0.1          # cores other processes may use during a kept measurement
ATTEMPTS = 6


def timed_plan(model, weights, threads: int, x):
    """(backend, log): the backend's batch-1 plan with each step wrapped to append (layer, task, start, end)
    to log; task -1 for a step not split, else its task's index."""
    from lnn.runtime.cpu import BACKEND
    from lnn.runtime.cpu.parallel import Parallel

    backend = BACKEND(model, weights, threads=threads)
    backend._chosen[1] = threads                        # this plan, whatever the timed choice would be
    backend.run(x)
    plan = backend._plan(1, threads)
    log = []

    def timed(step, layer, task):
        def run():
            start = time.perf_counter()
            step()
            log.append((layer, task, start, time.perf_counter()))
        return run

    layer_of = {index: layer for layer, (first, end) in enumerate(plan.layer_steps) for index in range(first, end)}
    for index, step in enumerate(plan.steps):
        if type(step) is Parallel:
            step.tasks = [[timed(part, layer_of.get(index, -1), task) for part in steps]
                          for task, steps in enumerate(step.tasks)]
        else:
            plan.steps[index] = timed(step, layer_of.get(index, -1), -1)
    return backend, log


def measure(backend, log: list, x, calls: int) -> tuple[list, float, float]:
    """([per call: its log], median wall s, cores other processes used), repeated until quiet."""
    for _ in range(5):
        backend.run(x)
    for _ in range(ATTEMPTS):
        calls_log, walls = [], []
        before = busy_seconds()
        start = time.perf_counter()
        for _ in range(calls):
            log.clear()
            begin = time.perf_counter()
            backend.run(x)
            walls.append(time.perf_counter() - begin)
            calls_log.append(list(log))
        others = others_cores(before, busy_seconds(), time.perf_counter() - start)
        if others < QUIET:
            break
        time.sleep(2)
    return calls_log, float(np.median(walls)), others


def layer_rows(name: str, nodes: list, one: list, two: list) -> list:
    rows = []
    for layer, label in enumerate(nodes):
        alone = np.median([sum(end - start for index, _, start, end in call if index == layer) for call in one])
        wall, busy = [], [[], []]
        for call in two:
            entries = [(task, start, end) for index, task, start, end in call if index == layer]
            if not entries:
                continue
            wall.append(max(end for *_, end in entries) - min(start for _, start, _ in entries))
            for thread in (0, 1):          # task 0 and the steps not split run in the calling thread
                busy[thread].append(sum(end - start for task, start, end in entries
                                        if (task in (-1, 0)) == (thread == 0)))
        if not wall:
            continue
        wall_ms, caller_ms, helper_ms = (float(np.median(v)) * 1e3 for v in (wall, *busy))
        rows.append([name, label, f"{alone * 1e3:.3f}", f"{wall_ms:.3f}", f"{caller_ms:.3f}", f"{helper_ms:.3f}",
                     f"{wall_ms - max(caller_ms, helper_ms):.3f}",
                     f"{alone * 1e3 / wall_ms:.2f}" if wall_ms else "-"])
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=60)
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--note", default="")
    args = parser.parse_args()
    rows, totals = [], []
    for name in args.models.split(","):
        bin_model = load_bin(name)
        model, weights = bin_model.model, bin_model.weights_fp32()
        x = random_input((1, *model.input_shape))
        results = {}
        for threads in (1, 2):
            backend, log = timed_plan(model, weights, threads, x)
            results[threads] = measure(backend, log, x, args.calls)
        nodes = ["+".join(members) for members in backend.layer_nodes]
        rows += layer_rows(name, nodes, results[1][0], results[2][0])
        one_ms, two_ms = results[1][1] * 1e3, results[2][1] * 1e3
        totals.append([name, f"{one_ms:.3f}", f"{two_ms:.3f}", f"{one_ms / two_ms:.2f}",
                       f"{results[1][2]:.2f} / {results[2][2]:.2f}"])
        print(" | ".join(totals[-1]), flush=True)
    headers = ["model", "layer", "1 thread ms", "2 threads: wall ms", "caller busy ms", "helper busy ms",
               "rest ms (wall - busier)", "1 thread / 2 threads"]
    print(markdown_table(headers, rows))
    body = "\n\n".join([
        "## One image over 2 threads, layer by layer (lnn cpu backend, batch 1)",
        f"Command: `python benchmarks/cpu_thread_layers.py --calls {args.calls} --models {args.models}`. "
        f"Machine: {machine_line()}." + (f" {args.note}" if args.note else ""),
        "Each step of the plan timed as it runs, medians over the calls. Per fused layer: the 1-thread "
        "time; at 2 threads the layer's wall time, each thread's busy time in it, and the rest (wall "
        "minus the busier thread: hand-offs, waiting for the slower task, the GIL). A thread's busy time "
        "above half the 1-thread time is work the split adds or both threads running slower side by "
        "side. Whole calls (timed steps, so slightly slower than untimed), and the cores other "
        "processes used meanwhile (1 thread / 2 threads):",
        markdown_table(["model", "1 thread ms", "2 threads ms", "1 thread / 2 threads", "others' cores"], totals),
        markdown_table(headers, rows),
    ])
    update_section("cpu_thread_layers", body)


if __name__ == "__main__":
    main()
