"""One image over 2 threads: the helpers' tasks in a compiled program (programs.py) against the Python
hand-off

    python benchmarks/cpu_helper_programs.py [--rounds 9] [--calls 200] [--models tomato,leaf_cnn224,leaf_cnn]

In one process per model: the one-thread plan, the split plan with its helpers' tasks handed over through
Python (the plan's program set aside) and the split plan with its program, in interleaved rounds of `--calls`
back-to-back calls each (random-normal input), median ms per call of each round, then the median of the
rounds. Also checks that the three give the same bytes, and measures how far the machine's two CPUs run
two threads of arithmetic side by side before the first model and after each (cpu_peers.fma_pair_scaling). Then the same with calls 20 ms apart (a photo now and
then: the helpers have left the program and are lent it again at each call), fewer of them. Writes the
"cpu_helper_programs" section of docs/BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "benchmarks"))
from cpu_peers import fma_pair_scaling, load_bin, random_input  # noqa: E402
from report import call_times, machine_line, markdown_table, update_section  # noqa: E402

GAP_SECONDS = 0.02


def median_ms(function, calls: int, gap: float = 0.0) -> float:
    """Median ms of `calls` timed calls, `gap` seconds apart."""
    return float(np.median(call_times(function, 0, calls, 0.0, calls, gap))) * 1e3


def measure(name: str, rounds: int, calls: int) -> list:
    from lnn.runtime.cpu import BACKEND
    from lnn.runtime.cpu.backend import PROGRAM_AT_RUN

    bundled = load_bin(name)
    backend = BACKEND(bundled.model, bundled.weights_fp32(), threads=2)
    backend._chosen[1] = 2                          # the split plan, whatever the timed choice would be
    x = random_input((1, *bundled.model.input_shape))
    for _ in range(PROGRAM_AT_RUN):
        backend.run(x)
    split, one = backend._plan(1, 2), backend._plan(1, 1)
    program = split.program
    if program is None:
        sys.exit(f"cpu_helper_programs: {name}'s split plan has no program")

    def one_thread():
        return one.run(x)

    def handed_off():
        split.program = None
        return backend.run(x)

    def programmed():
        split.program = program
        return backend.run(x)

    answers = [function().copy() for function in (one_thread, handed_off, programmed)]
    same = all((answer == answers[0]).all() for answer in answers)
    rows = []
    for gap, count in ((0.0, calls), (GAP_SECONDS, max(20, calls // 5))):
        per_round = np.array([[median_ms(function, count, gap) for function in (one_thread, handed_off, programmed)]
                              for _ in range(rounds)])
        one_ms, handed_ms, program_ms = np.median(per_round, axis=0)
        print(f"{name} gap {gap * 1e3:.0f} ms: one thread {one_ms:.3f}, hand-off {handed_ms:.3f}, program "
              f"{program_ms:.3f} ms; program / hand-off per round "
              f"{' '.join(f'{r:.2f}' for r in per_round[:, 2] / per_round[:, 1])}", flush=True)
        rows.append([name, "back to back" if not gap else f"{gap * 1e3:.0f} ms apart", f"{one_ms:.3f}",
                     f"{handed_ms:.3f}", f"{program_ms:.3f}", f"{program_ms / handed_ms:.2f}",
                     f"{one_ms / handed_ms:.2f}", f"{one_ms / program_ms:.2f}", "yes" if same else "NO"])
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--models", default="tomato,leaf_cnn224,leaf_cnn")
    parser.add_argument("--note", default="")
    args = parser.parse_args()
    pairs = [fma_pair_scaling()]
    rows = []
    for name in args.models.split(","):
        rows += measure(name, args.rounds, args.calls)
        pairs.append(fma_pair_scaling())
    update_section("cpu_helper_programs", "\n\n".join([
        "## One image over 2 threads: the helpers' tasks in a compiled program against the Python hand-off",
        f"Command: `python benchmarks/cpu_helper_programs.py --rounds {args.rounds} --calls {args.calls} "
        f"--models {args.models}`. Machine: {machine_line()}{'; ' + args.note if args.note else ''}.",
        "One process per model, batch 1: the one-thread plan, the split plan with its helpers' tasks handed over "
        "through Python, and the split plan with its helper program (runtime/cpu/programs.py), in interleaved "
        "rounds; ms per call, medians of the rounds' medians. Back to back, then calls 20 ms apart (the helpers "
        "asleep or away between calls). Speed-up = one thread / split.",
        markdown_table(["model", "calls", "one thread ms", "hand-off ms", "program ms", "program / hand-off",
                        "speed-up, hand-off", "speed-up, program", "same bytes"], rows),
        "Two threads of FMA-bound arithmetic (benchmarks/cpu_pair_scaling.py's workload) ran at "
        f"{' / '.join(f'{p:.2f}' for p in pairs)}x one thread's rate before the first model and after each."]))


if __name__ == "__main__":
    main()
