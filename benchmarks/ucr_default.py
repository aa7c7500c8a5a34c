"""The default series recipe (examples/series/default.json) on the UCR/UEA datasets in a folder, against the
published accuracies, with the training time; writes the "ucr_default" section of docs/BENCHMARKS.md.

    python benchmarks/ucr_default.py [--data ../shared/data/ucr] [--seeds 0,1,2,3,4] [--note "machine shared"]

Each dataset: `lnn-train examples/series/default.json --data ucr:DIR --out RUN` then `lnn-eval RUN/model.bin
--data ucr:DIR --split test --out RUN/eval`, each as its own process, exactly the commands of issue 12;
wall-clock and CPU time of the training process (its children included) are measured. With --seeds, the
recipe also trains with each further `--seed` (another machine's BLAS rounds differently, which moves a
small dataset's result about as much as a new seed): their lowest and mean test accuracy. The anchors are
published test accuracies on the same splits (ROCKET: Dempster et al. 2020; FCN: Wang et al. 2017 / Fawaz et
al. 2019; InceptionTime: Fawaz et al. 2020), not rerun here.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from report import SHARED, machine_line, markdown_table, update_section

REPO = Path(__file__).resolve().parent.parent
RECIPE = REPO / "examples" / "series" / "default.json"
PUBLISHED = {                    # test accuracy: ROCKET, InceptionTime, FCN (issue 12's table)
    "ItalyPowerDemand": (0.970, 0.965, 0.961), "GunPoint": (1.00, 1.00, 1.00), "BasicMotions": (1.00, 1.00, None),
}
TARGETS = {"ItalyPowerDemand": 0.96, "GunPoint": 0.98, "BasicMotions": 0.975}


def run(args: list, env: dict) -> tuple:
    """(wall s, CPU s of the child) for one command, which must succeed."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.perf_counter()
    result = subprocess.run([sys.executable, "-m", *args], capture_output=True, text=True, env=env, cwd=REPO.parent)
    wall = time.perf_counter() - started
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if result.returncode != 0:
        raise SystemExit(f"{' '.join(args)} failed:\n{result.stderr[-2000:]}")
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", default=str(SHARED / "data" / "ucr"))
    parser.add_argument("--seeds", default="0", help="comma-separated training seeds; the first is reported "
                                                        "with its times (0: the recipe's own)")
    parser.add_argument("--note", default="", help="a remark on the machine (e.g. shared, its load)")
    args = parser.parse_args()
    seeds = [int(seed) for seed in args.seeds.split(",")]
    env = dict(os.environ)
    rows = []
    with tempfile.TemporaryDirectory() as scratch:
        for folder in sorted(p for p in Path(args.data).iterdir() if p.is_dir()):
            results = []                     # (accuracy, wall, cpu, load) per seed
            for seed in seeds:
                out = Path(scratch) / f"{folder.name}_{seed}"
                load = os.getloadavg()[0]
                wall, cpu = run(["lnn.tools.train", str(RECIPE), "--data", f"ucr:{folder}", "--out", str(out),
                                 "--seed", str(seed), "--quiet"], env)
                run(["lnn.tools.eval", str(out / "model.bin"), "--data", f"ucr:{folder}", "--split", "test",
                     "--out", str(out / "eval")], env)
                results.append((json.loads((out / "eval" / "metrics.json").read_text())["accuracy"], wall, cpu, load))
            accuracy, wall, cpu, load = results[0]
            accuracies = [result[0] for result in results]
            rocket, inception, fcn = PUBLISHED.get(folder.name, (None, None, None))
            target = TARGETS.get(folder.name)
            rows.append([folder.name, f"{accuracy:.4f}", f"{min(accuracies):.4f} / {sum(accuracies) / len(accuracies):.4f}",
                         "-" if target is None else f">= {target}",
                         "-" if rocket is None else f"{rocket:.3f}", "-" if inception is None else f"{inception:.3f}",
                         "-" if fcn is None else f"{fcn:.3f}", f"{wall:.0f} s", f"{cpu:.0f} s", f"{load:.1f}"])
            print(" | ".join(rows[-1]), flush=True)
    body = (f"`python benchmarks/ucr_default.py` ({machine_line(('numpy',))}){': ' + args.note if args.note else ''}.\n"
            f"`lnn-train examples/series/default.json --data ucr:DIR` on the CPU (NumPy), then `lnn-eval --split "
            f"test`; seeds {args.seeds} (the first with its training wall-clock and CPU time, and the 1-minute "
            f"load average when it started; the lowest and mean test accuracy over all of them).\n\n"
            + markdown_table(["dataset", f"lnn test accuracy (seed {seeds[0]})", "lowest / mean over the seeds",
                              "target", "ROCKET", "InceptionTime", "FCN", "training wall", "training CPU", "load"],
                             rows) + "\n")
    update_section("ucr_default", body)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
