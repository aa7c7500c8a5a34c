"""The training memory lnn-summary plans for series and table models, against what training holds on the GPU.

    python benchmarks/series_memory.py [--out runs/series_memory]

Issue 12 asks that the plan's figure (`lnn-summary MODEL --batch N [--length T]`, `plan_memory()["peak"]`:
parameters, gradients, optimizer state, the pooled activations and workspaces, convolution and GEMM scratch,
the staged batch) match what training measures on the GPU. For each case below, in a fresh process (as
lnn-train is: cuBLAS's handle and workspace are made once per process): a Trainer with the captured step (`cuda_graph=True`) trains 8 steps on random standard-normal
series and random labels (host arrays, staged by the trainer as lnn-train's are); then
  held      what CuPy's pools hold for lnn (`Trainer.memory_held()`: the default pool, which holds every
            buffer lnn allocates, plus the captured steps' private pools), the figure lnn-train prints
  device    the growth of the device's used memory (cudaMemGetInfo) from just after CuPy's first kernel:
            also what CUDA and cuBLAS take outside CuPy's pools (loaded kernels, the handle)
Writes the `series_memory` section of
docs/BENCHMARKS.md and runs/series_memory/series_memory.json.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "benchmarks"))
from gpu_train_step import run_side  # noqa: E402
STEPS = 8


def fcn(channels: int, length: int, classes: int) -> dict:
    """The default series recipe (examples/series/default.json) at a dataset's shape, as lnn-train makes it."""
    description = json.loads((REPO / "examples" / "series" / "default.json").read_text())
    description["input_shape"] = [channels, length]
    description["layers"][-1]["out_features"] = classes
    return description


def recurrent(kind: str, length: int, hidden: int, layers: int, bidirectional: bool, keep: str) -> dict:
    head = [{"type": "global_avg_pool", "name": "pool"}] if keep == "sequence" else []
    return {"name": f"conv1d_{kind}", "input_shape": [3, length], "loss": "cross_entropy",
            "optimizer": {"type": "adam", "lr": 1e-3},
            "layers": [{"type": "conv1d", "name": "conv", "out_channels": 64, "kernel_size": 7, "padding": "same",
                        "activation": "relu"},
                       {"type": kind, "name": kind, "hidden_size": hidden, "num_layers": layers,
                        "bidirectional": bidirectional, "return": keep}, *head,
                       {"type": "linear", "name": "fc", "out_features": 5}]}


def table_mlp(features: int, classes: int) -> dict:
    """examples/tabular/mlp.json at a table's width, as lnn-train --data csv: makes it."""
    description = json.loads((REPO / "examples" / "tabular" / "mlp.json").read_text())
    description["input_shape"] = [features]
    description["layers"][-1]["out_features"] = classes
    return description


# (case name, description, batch, amp)
CASES = [
    ("fcn GunPoint shape [1, 150]", fcn(1, 150, 2), 32, None),
    ("fcn [1, 150]", fcn(1, 150, 2), 256, None),
    ("fcn BasicMotions shape [6, 100]", fcn(6, 100, 4), 32, None),
    ("fcn [1, 1024]", fcn(1, 1024, 10), 256, None),
    ("fcn [1, 1024], amp", fcn(1, 1024, 10), 256, "fp16"),
    ("conv1d + lstm 128, last, T 128", recurrent("lstm", 128, 128, 1, False, "last"), 64, None),
    ("conv1d + lstm 128, last, T 512", recurrent("lstm", 512, 128, 1, False, "last"), 256, None),
    ("conv1d + lstm 128, last, T 512, amp", recurrent("lstm", 512, 128, 1, False, "last"), 256, "fp16"),
    ("conv1d + lstm 64 x2 bidirectional, sequence, T 256", recurrent("lstm", 256, 64, 2, True, "sequence"), 128,
     None),
    ("conv1d + gru 96 x2 bidirectional, sequence, T 256", recurrent("gru", 256, 96, 2, True, "sequence"), 128, None),
    ("conv1d + gru 96, last, T 256, bf16", recurrent("gru", 256, 96, 1, False, "last"), 128, "bf16"),
    ("table mlp, 5 columns", table_mlp(5, 3), 4096, None),
]


def device_used(cupy) -> int:
    free, total = cupy.cuda.runtime.memGetInfo()
    return int(total - free)


def measure(description: dict, batch: int, amp) -> dict:
    """One case, in this (fresh) process."""
    import cupy
    import numpy as np

    from lnn.train.plan import plan_memory
    from lnn.train.trainer import Trainer

    cupy.zeros(1).sum()                                   # the context and CuPy's first module
    before = device_used(cupy)
    messages = []
    trainer = Trainer(description, device="cuda", batch_size=batch, cuda_graph=True, amp=amp, log=messages.append)
    planned = plan_memory(trainer.model, batch, amp=amp)
    rng = np.random.default_rng(0)
    shape = (batch, *trainer.model.input_shape)
    classes = trainer.model.output_shape[-1]
    for _ in range(STEPS):
        trainer.step(rng.standard_normal(shape, dtype=np.float32), rng.integers(0, classes, batch))
    cupy.cuda.Device().synchronize()
    row = {"planned": int(planned["peak"]), "held": int(trainer.memory_held()),
           "graph_pools": int(trainer.graph_pool_bytes()), "device": device_used(cupy) - before,
           "graph_mode": bool(trainer.graph_mode), "parameters": int(trainer.model.num_params)}
    if not trainer.graph_mode:
        row["eager_reason"] = "; ".join(messages)[:200]
    return row


def run_case(index: int) -> dict:
    """One case in a fresh process (gpu_train_step's run_side: the worker is `--side INDEX`)."""
    row = run_side("-", str(index), script=__file__)
    if "failed" in row:
        raise SystemExit(f"series_memory: case {CASES[index][0]} failed: {row['failed']}")
    return row


def mib(n: int) -> str:
    return f"{n / 2**20:.1f}"


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=str(REPO / "runs" / "series_memory"))
    parser.add_argument("--side", type=int, help=argparse.SUPPRESS)         # run_case: one case, printed as JSON
    parser.add_argument("--model", help=argparse.SUPPRESS)                  # run_side passes it; not used here
    args = parser.parse_args()
    if args.side is not None:
        print(json.dumps(measure(*CASES[args.side][1:])))
        return

    from report import machine_line, markdown_table, update_section

    started = time.perf_counter()
    results, rows = {}, []
    for index, (name, description, batch, amp) in enumerate(CASES):
        row = results[name] = run_case(index)
        print(f"{name}, batch {batch}: {json.dumps(row)}", file=sys.stderr, flush=True)
        rows.append([name, batch, amp or "fp32", f"{row['parameters']:,}", mib(row["planned"]), mib(row["held"]),
                     f"{row['held'] / row['planned']:.3f}", mib(row["graph_pools"]), mib(row["device"]),
                     "graph" if row["graph_mode"] else f"eager: {row['eager_reason']}"])
    ratios = [r["held"] / r["planned"] for r in results.values()]
    table = markdown_table(["case", "batch", "precision", "parameters", "planned MiB", "held MiB", "held ÷ planned",
                            "of it graph pools MiB", "device used growth MiB", "step"], rows)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "series_memory.json").write_text(json.dumps(results, indent=1))
    print(table)
    print(f"held ÷ planned {min(ratios):.3f}-{max(ratios):.3f}; total {time.perf_counter() - started:.0f} s",
          file=sys.stderr)
    gpu = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                         text=True).stdout.strip()
    update_section("series_memory", f"""## Series and table models: the planned training memory against the GPU's

Command: `python benchmarks/series_memory.py`. Machine: {gpu}; {machine_line(("numpy", "cupy-cuda13x"))}.

"planned" is what `lnn-summary MODEL --batch N` reports (`plan_memory()["peak"]`); "held" is what CuPy's
pools hold after {STEPS} captured training steps on random series, each case in a fresh process (`Trainer.memory_held()`, the figure
lnn-train prints at the end), the captured steps' private pools included; "device used growth" is the
growth of the GPU's used memory over the same span (cudaMemGetInfo: also CUDA's and cuBLAS's own, outside
the pools). The fcn rows are the default recipe (examples/series/default.json) at the shapes named, the
table row examples/tabular/mlp.json. held ÷ planned over the cases: {min(ratios):.3f} to {max(ratios):.3f}.

{table}
""")


if __name__ == "__main__":
    main()
