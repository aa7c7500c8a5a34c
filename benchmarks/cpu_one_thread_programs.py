"""One thread's call: the plan's steps in one compiled program (programs.StepsProgram) against calling them one by
one from Python, alone and beside a thread running Python

    python benchmarks/cpu_one_thread_programs.py [--rounds 7] [--calls 100] [--models tomato,leaf_cnn224,leaf_cnn]

In one process per model, at one thread, batch 1 and batch 8: the plan's steps from Python (its program set aside)
and the same plan's program, in rounds of `--calls` back-to-back calls each (random-normal input; which goes
first alternates),
median ms per call of each round, then the median of the rounds; checks that the two give the same bytes. Then
the same beside a thread that runs Python all the time (as lnn-serve's event loop and photo decoding do beside its
inference): a call waits for the GIL each time it takes it back, up to the switch interval (5 ms), so fewer calls.
Writes the "cpu_one_thread_programs" section of docs/BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import threading
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "benchmarks"))
from cpu_peers import load_bin, random_input  # noqa: E402
from report import call_times, machine_line, markdown_table, update_section  # noqa: E402

BATCHES = (1, 8)
CALLS_BESIDE_PYTHON = 5


def median_ms(function, calls: int) -> float:
    return float(np.median(call_times(function, 1, calls, 0.0, calls))) * 1e3


class PythonLoop:
    """`with PythonLoop():` a thread running Python (no blocking call, no GIL release of its own) meanwhile."""

    def __enter__(self):
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._loop, daemon=True)
        self.thread.start()
        return self

    def _loop(self) -> None:
        while not self.stop.is_set():
            sum(range(1000))

    def __exit__(self, *exception) -> None:
        self.stop.set()
        self.thread.join()


def measure(name: str, rounds: int, calls: int) -> list:
    from lnn.runtime.cpu import BACKEND
    from lnn.runtime.cpu.backend import PROGRAM_AT_RUN

    bundled = load_bin(name)
    backend = BACKEND(bundled.model, bundled.weights_fp32(), threads=1)
    rows = []
    for batch in BATCHES:
        x = random_input((batch, *bundled.model.input_shape))
        for _ in range(PROGRAM_AT_RUN):
            backend.run(x)
        plan = backend._plan(batch, 1)
        program = plan.alone
        if program is None:
            sys.exit(f"cpu_one_thread_programs: {name}'s one-thread plan at batch {batch} has no program")

        def from_python():
            plan.alone = None
            return backend.run(x)

        def programmed():
            plan.alone = program
            return backend.run(x)

        same = bool((from_python().copy() == programmed()).all())
        for beside, count in (("nothing", calls), ("a Python thread", CALLS_BESIDE_PYTHON)):
            per_round = []
            for turn in range(rounds):
                order = (from_python, programmed) if turn % 2 == 0 else (programmed, from_python)
                with PythonLoop() if beside != "nothing" else contextlib.nullcontext():
                    times = {function: median_ms(function, count) for function in order}
                per_round.append([times[from_python], times[programmed]])
            python_ms, program_ms = np.median(np.array(per_round), axis=0)
            print(f"{name} batch {batch} beside {beside}: steps from Python {python_ms:.3f}, program "
                  f"{program_ms:.3f} ms", flush=True)
            rows.append([name, str(batch), str(len(plan.steps)), beside, f"{python_ms:.3f}", f"{program_ms:.3f}",
                         f"{program_ms / python_ms:.2f}", "yes" if same else "NO"])
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--calls", type=int, default=100)
    parser.add_argument("--models", default="tomato,leaf_cnn224,leaf_cnn")
    parser.add_argument("--note", default="")
    args = parser.parse_args()
    rows = []
    for name in args.models.split(","):
        rows += measure(name, args.rounds, args.calls)
    update_section("cpu_one_thread_programs", "\n\n".join([
        "## One thread's call: its steps in one compiled program against one by one from Python",
        f"Command: `python benchmarks/cpu_one_thread_programs.py --rounds {args.rounds} --calls {args.calls} "
        f"--models {args.models}`. Machine: {machine_line()}{'; ' + args.note if args.note else ''}.",
        "One process per model, one thread: the plan's steps called one by one from Python (each kernel takes the "
        "GIL back after it) and the same plan's one-thread program (runtime/cpu/programs.py StepsProgram: one "
        "compiled call, the GIL taken back once), in interleaved rounds; ms per call, medians of the rounds' "
        f"medians; beside nothing ({args.calls} calls a round), then beside a thread running Python all the time "
        f"({CALLS_BESIDE_PYTHON} calls a round; the switch interval 5 ms, Python's default).",
        markdown_table(["model", "batch", "steps", "beside", "steps from Python ms", "program ms",
                        "program / from Python", "same bytes"], rows)]))


if __name__ == "__main__":
    main()
