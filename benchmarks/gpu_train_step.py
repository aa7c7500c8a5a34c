"""Training step time and memory on one GPU: lnn (fp32, TF32, amp fp16 and bf16; captured graphs) vs what a PyTorch user picks.

    python benchmarks/gpu_train_step.py [--models mnist_cnn leaf_cnn leaf_cnn224 tomato_leaf] [--sides ...]

Models: examples/reference/{mnist_cnn, leaf_cnn, leaf_cnn224}.json and the bundled examples/tomato_leaf.json
(batch norm), at batch 64 and 256, and tomato_leaf at its recipe's batch 32. Each model's own optimizer
and gradient clipping (tomato_leaf: SGD nesterov, clip 5) on both sides, cross-entropy, random uint8
images and labels already on the GPU (4 batches, cycled), normalized inside the step. Sides, each in a
fresh process:
  lnn fp32     Trainer(cuda_graph=True): the step captured and replayed (train/cuda_graph.py), float32
  lnn tf32     the same with tf32=True (TF32 tensor cores in the GEMMs; named as such)
  lnn amp      the same with amp=True: fp16 activations, fp32 master weights, dynamic loss scale
  lnn bf16     the same with amp="bf16": bfloat16 activations, fp32 master weights, no loss scaling
  torch fp32   eager, TF32 off (true fp32)
  torch defaults  eager with PyTorch's defaults (cuDNN convolutions in TF32)
  torch amp cl    eager autocast fp16 + GradScaler, channels_last
  torch amp cl graph  the same step captured as a CUDA graph (static loss scale 1024: GradScaler syncs)
  torch compile amp   torch.compile(model) with autocast fp16 + GradScaler, channels_last
  torch bf16 amp cl   eager autocast bfloat16 (no GradScaler), channels_last
Time: median over 7 blocks of K steps of (block time / K), synchronized at block ends only.
Peak memory: lnn, CuPy's default pool plus the graphs' private pools (total bytes held: a conservative
figure, it counts cached blocks); PyTorch, torch.cuda.max_memory_allocated. Writes the `gpu_train_step`
section of docs/BENCHMARKS.md. A failed side is shown as `failed: <reason>`; the others still run.
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

MODELS = ("mnist_cnn", "leaf_cnn", "leaf_cnn224", "tomato_leaf")
BATCHES = {"tomato_leaf": (32, 64, 256)}
DEFAULT_BATCHES = (64, 256)
SIDES = ("lnn fp32", "lnn tf32", "lnn amp", "lnn bf16", "torch fp32", "torch defaults", "torch amp cl",
         "torch amp cl graph", "torch compile amp", "torch bf16 amp cl")
LNN_AMP = {"amp": "fp16", "bf16": "bf16"}          # lnn side mode -> Trainer(amp=...)
BLOCKS = 7
SIDE_TIMEOUT_S = 240


def description_path(model: str) -> Path:
    return REPO / "examples" / (f"{model}.json" if model == "tomato_leaf" else f"reference/{model}.json")


def batches_of(model: str) -> tuple:
    return BATCHES.get(model, DEFAULT_BATCHES)


def steps_per_block(batch: int, images: int) -> int:
    work = batch * images
    return 5 if work > 2e7 else 10 if work > 2e6 else 20


def median_ms(run_block, steps: int, synchronize) -> float:
    times = []
    for _ in range(BLOCKS):
        synchronize()
        start = time.perf_counter()
        run_block(steps)
        synchronize()
        times.append((time.perf_counter() - start) * 1000 / steps)
    return sorted(times)[len(times) // 2]


def lnn_side(model_name: str, mode: str) -> dict:
    import math

    import cupy

    from lnn.train.trainer import Trainer

    pool = cupy.get_default_memory_pool()
    out = {}
    for batch in batches_of(model_name):
        messages = []
        trainer = Trainer(str(description_path(model_name)), device="cuda", batch_size=batch, cuda_graph=True,
                          amp=LNN_AMP.get(mode, False), tf32=mode == "tf32", log=messages.append)
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

        run_block(5)                                            # warm-up, capture, replays
        first = trainer.step(*data[0]).loss
        ms = median_ms(run_block, steps_per_block(batch, math.prod(shape[1:])), cupy.cuda.Device().synchronize)
        row = {"ms": ms, "peak_bytes": trainer.memory_held(), "first_loss": first}
        if not trainer.graph_mode:
            row["failed"] = "; ".join(messages)[:200] or "the graph path was not used"
        out[str(batch)] = row
        trainer = data = None
        gc.collect()
        pool.free_all_blocks()
    return out


def torch_side(model_name: str, mode: str) -> dict:
    import math

    import torch
    from torch import nn
    from torch_peer import torch_sequential

    from lnn.formats.model import load_model

    true_fp32 = mode == "fp32"
    torch.backends.cudnn.allow_tf32 = not true_fp32            # PyTorch's default is True (convolutions)
    torch.backends.cuda.matmul.allow_tf32 = False               # PyTorch's default
    torch.backends.cudnn.benchmark = True
    bf16 = mode.startswith("bf16")
    amp = mode.startswith("amp") or mode == "compile amp" or bf16
    channels_last = amp
    torch.manual_seed(0)
    model = load_model(description_path(model_name))
    pre, opt = model.preprocess, model.optimizer
    clip = (model.extra.get("training") or {}).get("grad_clip")
    channels = model.input_shape[0]
    mean = torch.tensor(pre["mean"], device="cuda").reshape(1, channels, 1, 1)
    std = torch.tensor(pre["std"], device="cuda").reshape(1, channels, 1, 1)
    memory_format = torch.channels_last if channels_last else torch.contiguous_format
    out = {}
    for batch in batches_of(model_name):
        net = torch_sequential(model).to(memory_format=memory_format)
        net.train()
        capturable = mode == "amp cl graph"
        if opt["type"] == "sgd":
            optimizer = torch.optim.SGD(net.parameters(), lr=opt["lr"], momentum=opt["momentum"],
                                        nesterov=opt["nesterov"], weight_decay=opt["weight_decay"])
        else:
            optimizer = (torch.optim.AdamW if opt["type"] == "adamw" else torch.optim.Adam)(
                net.parameters(), lr=opt["lr"], betas=tuple(opt["betas"]), eps=opt["eps"],
                weight_decay=opt["weight_decay"], capturable=capturable)
        forward = torch.compile(net) if mode == "compile amp" else net
        scaler = torch.amp.GradScaler("cuda", enabled=amp and not capturable and not bf16)   # disabled: a pass-through
        shape = (batch,) + tuple(model.input_shape)
        classes = model.output_shape[0]
        data = [(torch.randint(0, 256, shape, dtype=torch.uint8, device="cuda"),
                 torch.randint(0, classes, (batch,), device="cuda")) for _ in range(4)]
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()

        def loss_of(x, y):
            x = ((x.float() * (1 / 255) - mean) / std).contiguous(memory_format=memory_format)
            with torch.autocast("cuda", dtype=torch.bfloat16 if bf16 else torch.float16, enabled=amp):
                return nn.functional.cross_entropy(forward(x), y)

        def eager_step(x, y):
            optimizer.zero_grad(set_to_none=True)
            loss = loss_of(x, y)
            scaler.scale(loss).backward()
            if clip:
                scaler.unscale_(optimizer)
                torch.nn.utils.clip_grad_norm_(net.parameters(), clip)
            scaler.step(optimizer)
            scaler.update()
            return loss

        def static_scale_step(x, y):                 # capturable: no GradScaler (it reads inf flags on the host)
            loss = loss_of(x, y)
            (loss * 1024.0).backward()
            grads = [p.grad for p in net.parameters()]
            torch._foreach_mul_(grads, 1 / 1024.0)
            if clip:
                torch.nn.utils.clip_grad_norm_(net.parameters(), clip, foreach=True)
            optimizer.step()
            return loss

        count = [0]
        if capturable:
            static_x, static_y = data[0][0].clone(), data[0][1].clone()
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(3):
                    optimizer.zero_grad(set_to_none=False)
                    static_scale_step(static_x, static_y)
            torch.cuda.current_stream().wait_stream(side)
            captured = torch.cuda.CUDAGraph()
            optimizer.zero_grad(set_to_none=False)
            with torch.cuda.graph(captured):
                static_loss = static_scale_step(static_x, static_y)

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
        ms = median_ms(run_block, steps_per_block(batch, math.prod(shape[1:])), torch.cuda.synchronize)
        out[str(batch)] = {"ms": ms, "peak_bytes": int(torch.cuda.max_memory_allocated()), "first_loss": first,
                           "torch": torch.__version__}
        net = optimizer = data = forward = None
        torch.cuda.empty_cache()
    return out


def run_side(model: str, side: str, script: str = __file__, extra: tuple = ()) -> dict:
    """One side in a fresh process: `script --side SIDE --model MODEL *extra` prints its result as JSON
    (gpu_lstm_step.py runs its own sides through this too)."""
    command = [sys.executable, script, "--side", side, "--model", model, *extra]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=SIDE_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return {"failed": f"timed out after {SIDE_TIMEOUT_S} s"}
    if done.returncode != 0:
        lines = [line for line in done.stderr.strip().splitlines() if line.strip()]
        return {"failed": (lines[-1] if lines else f"exit status {done.returncode}")[:200]}
    return json.loads(done.stdout.strip().splitlines()[-1])


def ms_of(result: dict, batch: int):
    row = result.get(str(batch)) if "failed" not in result else None
    return None if row is None or "failed" in row else row["ms"]


def cell(result: dict, batch: int) -> str:
    if "failed" in result:
        return f"failed: {result['failed']}"
    row = result[str(batch)]
    return f"{row['ms']:.2f}" + (f" (failed: {row['failed']})" if "failed" in row else "")


def ratio(results: dict, a: str, b: str, batch: int) -> str:
    x, y = ms_of(results[a], batch), ms_of(results[b], batch)
    return "-" if x is None or y is None else f"{x / y:.2f}"


def memory_ratio(results: dict, a: str, b: str, batch: int) -> str:
    if "failed" in results[a] or "failed" in results[b]:
        return "-"
    return f"{results[a][str(batch)]['peak_bytes'] / results[b][str(batch)]['peak_bytes']:.2f}"


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=str(REPO / "runs" / "gpu_train_step"))
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=MODELS)
    parser.add_argument("--sides", nargs="+", default=list(SIDES), choices=SIDES)
    parser.add_argument("--side", choices=SIDES, help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.side:
        library, mode = args.side.split(" ", 1)
        print(json.dumps((lnn_side if library == "lnn" else torch_side)(args.model, mode)))
        return

    from report import machine_line, markdown_table, update_section

    started = time.perf_counter()
    results = {}
    for model in args.models:
        for side in args.sides:
            results[(model, side)] = run_side(model, side)
            print(f"{model} {side}: {json.dumps(results[(model, side)])}", file=sys.stderr, flush=True)
    headers = ["model", "batch"] + [f"{side} ms" for side in args.sides]
    comparisons = [("lnn fp32", "torch fp32"), ("lnn amp", "lnn fp32"), ("lnn amp", "torch amp cl"),
                   ("lnn amp", "torch compile amp"), ("lnn bf16", "lnn fp32"), ("lnn bf16", "torch bf16 amp cl")]
    comparisons = [(a, b) for a, b in comparisons if a in args.sides and b in args.sides]
    headers += [f"{a} ÷ {b}" for a, b in comparisons]
    memory = [(a, b) for a, b in (("lnn fp32", "torch fp32"), ("lnn amp", "torch amp cl"), ("lnn amp", "lnn fp32"),
                                  ("lnn bf16", "torch bf16 amp cl"))
              if a in args.sides and b in args.sides]
    headers += [f"memory {a} ÷ {b}" for a, b in memory]
    rows = []
    for model in args.models:
        r = {side: results[(model, side)] for side in args.sides}
        for batch in batches_of(model):
            rows.append([model, batch] + [cell(r[side], batch) for side in args.sides]
                        + [ratio(r, a, b, batch) for a, b in comparisons]
                        + [memory_ratio(r, a, b, batch) for a, b in memory])
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu_train_step.json").write_text(json.dumps({f"{m}/{s}": v for (m, s), v in results.items()}, indent=1))
    table = markdown_table(headers, rows)
    print(table)
    print(f"total {time.perf_counter() - started:.0f} s", file=sys.stderr)
    gpu = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                         text=True).stdout.strip()
    update_section("gpu_train_step", f"""## Training step time on the GPU: lnn (captured graphs: fp32, TF32, amp fp16 and bf16) vs PyTorch

Command: `python benchmarks/gpu_train_step.py` (run by `benchmarks/gpu_check.sh`). Machine: {gpu};
{machine_line(("numpy", "cupy-cuda13x", "torch"))}.

Median ms per training step (forward, backward, the model's own optimizer and clipping) on random uint8
data already on the GPU, normalized inside the step; each side in a fresh process. lnn runs every step
as a replayed CUDA graph of its one training path. "torch fp32" is true fp32 (TF32 off); "torch
defaults" lets cuDNN use TF32 (PyTorch's default); "amp cl" is autocast fp16 with channels_last and a
GradScaler; its graph side uses a static loss scale; "compile" is torch.compile; "bf16 amp cl" is autocast
bfloat16 with channels_last, no scaler ("lnn bf16": amp="bf16", no loss scaling either). Memory: lnn's CuPy
pools (total held, counting cached blocks) vs torch.cuda.max_memory_allocated.

{table}
""")


if __name__ == "__main__":
    main()
