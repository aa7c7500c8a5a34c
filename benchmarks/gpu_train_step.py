"""Training step time on one GPU: lnn (CUDA graph and eager) vs PyTorch (eager and CUDA-graph captured).

    python benchmarks/gpu_train_step.py

For mnist_mlp, mnist_cnn and leaf_cnn (examples/reference) at batch 256 and 64: random uint8 images
and labels already on the GPU (4 batches, cycled), normalized inside the step, SGD with the
description's momentum and weight decay, cross-entropy. Each side runs in a fresh process:
  lnn graph  Trainer(cuda_graph=True): the step replayed as a captured graph (train/cuda_graph.py)
  lnn eager  Trainer(cuda_graph=False): the eager CuPy step (it reads the gradient norm every step)
  torch eager / torch graph: the same network in PyTorch, true fp32 (TF32 off); the graph side is the
             standard whole-step capture (warmup on a side stream, static input tensors, replay).
Time: median over 7 blocks of K steps of (block time / K), synchronized at block ends only.
Peak memory: lnn, CuPy's pool total_bytes after the steps (plan, pool, workspaces, data); PyTorch,
max_memory_allocated (model, data, activations, workspaces). Writes the `gpu_train_step` section
of docs/BENCHMARKS.md. A failed side is shown as `failed: <reason>` and the others still run.
"""

from __future__ import annotations

import argparse
import gc
import json
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "benchmarks"))

MODELS = ("mnist_mlp", "mnist_cnn", "leaf_cnn")
BATCHES = (256, 64)
SIDES = ("lnn graph", "lnn eager", "torch eager", "torch graph")
BLOCKS = 7


def steps_per_block(model: str, batch: int) -> int:
    return 5 if model == "leaf_cnn" and batch == 256 else 10 if model == "leaf_cnn" else 20


def median_ms(run_block, steps: int, synchronize) -> float:
    times = []
    for _ in range(BLOCKS):
        synchronize()
        start = time.perf_counter()
        run_block(steps)
        synchronize()
        times.append((time.perf_counter() - start) * 1000 / steps)
    return sorted(times)[len(times) // 2]


def lnn_side(model_name: str, graph: bool) -> dict:
    import cupy

    from lnn.train.trainer import Trainer

    spec = REPO / "examples" / "reference" / f"{model_name}.json"
    pool = cupy.get_default_memory_pool()
    out = {}
    for batch in sorted(BATCHES):
        messages = []
        trainer = Trainer(str(spec), device="cuda", batch_size=batch, cuda_graph=graph, log=messages.append)
        shape = (batch,) + tuple(trainer.model.input_shape)
        classes = trainer.model.output_shape[0]
        data = [(cupy.random.randint(0, 256, shape, dtype=cupy.uint8), cupy.random.randint(0, classes, batch))
                for _ in range(4)]
        count = [0]

        def run_block(steps):
            for _ in range(steps):
                x, y = data[count[0] % 4]
                trainer.step(x, y)
                count[0] += 1

        run_block(5)                                            # warmup (graph: run, capture, replays)
        first = float(trainer.step(*data[0]).loss)
        row = {"ms": median_ms(run_block, steps_per_block(model_name, batch), cupy.cuda.Device().synchronize),
               "peak_bytes": int(pool.total_bytes()), "first_loss": first}
        if graph and not trainer.graph_mode:
            row["failed"] = "; ".join(messages)[:200] or "the graph path was not used"
        out[str(batch)] = row
        trainer = data = None
        gc.collect()                              # the graph step's launch list refers back to it
        pool.free_all_blocks()
    return out


def torch_side(model_name: str, graph: bool) -> dict:
    import torch
    from torch_peer import torch_sequential
    from torch import nn

    from lnn.formats.model import load_model

    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.manual_seed(0)
    model = load_model(REPO / "examples" / "reference" / f"{model_name}.json")
    pre, opt = model.preprocess, model.optimizer
    channels = model.input_shape[0]
    mean = torch.tensor(pre["mean"], device="cuda").reshape(1, channels, 1, 1)
    std = torch.tensor(pre["std"], device="cuda").reshape(1, channels, 1, 1)
    out = {}
    for batch in sorted(BATCHES):
        net = torch_sequential(model)                   # freshly initialized for each batch size
        optimizer = torch.optim.SGD(net.parameters(), lr=opt["lr"], momentum=opt["momentum"],
                                    nesterov=opt["nesterov"], weight_decay=opt["weight_decay"])
        shape = (batch,) + tuple(model.input_shape)
        classes = model.output_shape[0]
        data = [(torch.randint(0, 256, shape, dtype=torch.uint8, device="cuda"),
                 torch.randint(0, classes, (batch,), device="cuda")) for _ in range(4)]
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()

        def loss_of(x, y):
            return nn.functional.cross_entropy(net((x.float() * (1 / 255) - mean) / std), y)

        def eager_step(x, y):
            optimizer.zero_grad(set_to_none=True)
            loss = loss_of(x, y)
            loss.backward()
            optimizer.step()
            return loss

        count = [0]
        if graph:
            static_x, static_y = data[0][0].clone(), data[0][1].clone()
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(3):
                    eager_step(static_x, static_y)
            torch.cuda.current_stream().wait_stream(side)
            captured = torch.cuda.CUDAGraph()
            optimizer.zero_grad(set_to_none=True)
            with torch.cuda.graph(captured):
                static_loss = loss_of(static_x, static_y)
                static_loss.backward()
                optimizer.step()

            def step(x, y):
                static_x.copy_(x)
                static_y.copy_(y)
                captured.replay()
                return static_loss
        else:
            step = eager_step

        def run_block(steps):
            for _ in range(steps):
                x, y = data[count[0] % 4]
                step(x, y)
                count[0] += 1

        run_block(5)
        first = float(step(*data[0]))
        out[str(batch)] = {"ms": median_ms(run_block, steps_per_block(model_name, batch), torch.cuda.synchronize),
                           "peak_bytes": int(torch.cuda.max_memory_allocated()), "first_loss": first,
                           "torch": torch.__version__}
        net = optimizer = data = None
        torch.cuda.empty_cache()
    return out


def run_side(model: str, side: str) -> dict:
    command = [sys.executable, __file__, "--side", side, "--model", model]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=150)
    except subprocess.TimeoutExpired:
        return {"failed": "timed out after 150 s"}
    if done.returncode != 0:
        lines = [line for line in done.stderr.strip().splitlines() if line.strip()]
        return {"failed": (lines[-1] if lines else f"exit status {done.returncode}")[:200]}
    return json.loads(done.stdout.strip().splitlines()[-1])


def cell_ms(result: dict, batch: int) -> str:
    if "failed" in result:
        return f"failed: {result['failed']}"
    row = result[str(batch)]
    return f"{row['ms']:.3f}" + (f" (graph: failed: {row['failed']})" if "failed" in row else "")


def ratio(a: dict, b: dict, batch: int) -> str:
    if "failed" in a or "failed" in b:
        return "-"
    return f"{a[str(batch)]['ms'] / b[str(batch)]['ms']:.2f}"


def mib(result: dict, batch: int) -> str:
    return "-" if "failed" in result else f"{result[str(batch)]['peak_bytes'] / 2 ** 20:.0f}"


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=str(REPO / "runs" / "gpu_train_step"))
    parser.add_argument("--side", choices=SIDES, help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.side:
        library, mode = args.side.split()
        function = lnn_side if library == "lnn" else torch_side
        print(json.dumps(function(args.model, mode == "graph")))
        return

    from report import machine_line, markdown_table, update_section

    started = time.perf_counter()
    results = {}
    for model in MODELS:
        for side in SIDES:
            results[(model, side)] = run_side(model, side)
            print(f"{model} {side}: {json.dumps(results[(model, side)])}", file=sys.stderr, flush=True)
    rows = []
    for model in MODELS:
        for batch in BATCHES:
            r = {side: results[(model, side)] for side in SIDES}
            rows.append([model, batch] + [cell_ms(r[side], batch) for side in SIDES] +
                        [ratio(r["lnn graph"], r["torch eager"], batch), ratio(r["lnn graph"], r["torch graph"], batch),
                         ratio(r["lnn eager"], r["torch eager"], batch),
                         mib(r["lnn graph"], batch), mib(r["torch eager"], batch)])
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu_train_step.json").write_text(json.dumps({f"{m}/{s}": v for (m, s), v in results.items()}, indent=1))
    table = markdown_table(["model", "batch", "lnn graph ms", "lnn eager ms", "torch eager ms", "torch graph ms",
                            "lnn graph ÷ torch eager", "lnn graph ÷ torch graph", "lnn eager ÷ torch eager",
                            "lnn graph peak MiB", "torch eager peak MiB"], rows)
    print(table)
    print(f"total {time.perf_counter() - started:.0f} s", file=sys.stderr)
    gpu = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                         text=True).stdout.strip()
    update_section("gpu_train_step", f"""## Training step time on the GPU: lnn (CUDA graph, eager) vs PyTorch (eager, CUDA graph)

Command: `python benchmarks/gpu_train_step.py` (run by `benchmarks/gpu_check.sh`). Machine: {gpu};
{machine_line(("numpy", "cupy-cuda13x", "torch"))}.

Median ms per training step (forward, backward, SGD momentum update) on random uint8 data already on the
GPU, normalized inside the step; each side in a fresh process; PyTorch in true fp32 (TF32 off), its graph
side the standard whole-step capture. Peak memory: CuPy pool total_bytes (lnn) vs
torch.cuda.max_memory_allocated (PyTorch), each including the model, the data and all workspaces.

{table}
""")


if __name__ == "__main__":
    main()
