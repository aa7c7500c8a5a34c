"""Training step time and memory on one GPU for a conv1d + LSTM series classifier: lnn's captured step vs PyTorch's cuDNN LSTM.

    python benchmarks/gpu_lstm_step.py [--batches 64] [--sides ...]

The model (issue 12's speed target): [N, 1, 128] series -> conv1d 1 -> 64 channels, kernel 7, "same"
padding, relu -> lstm hidden 128 over the 128 steps, the last step -> linear to 5 classes; Adam (lr 1e-3),
cross-entropy, no clipping; random float32 series (standard normal) and labels already on the GPU (4
batches, cycled). Parameters: 100,485 on both sides (checked at start); it is the same function on
both (lnn's weights load into the torch module by state-dict name and give the same logits, within
1.5e-8 on the CPU). Sides, each in a fresh process:
  lnn fp32          Trainer(cuda_graph=True): the whole step (forward, backpropagation through time, Adam)
                    captured once and replayed (train/cuda_graph.py), float32
  lnn tf32          the same with tf32=True (TF32 tensor cores in the GEMMs)
  torch fp32        nn.Conv1d + nn.LSTM (cuDNN's LSTM), eager, TF32 off in cuDNN and matmul (true fp32)
  torch defaults    the same with PyTorch's defaults (cuDNN may use TF32, so its LSTM GEMMs too)
  torch fp32 graph  torch fp32 with the whole step (forward, backward, Adam(capturable=True)) captured
                    as one CUDA graph (torch.cuda.graph) and replayed
Time: median over 7 blocks of K steps of (block time / K), synchronized at block ends only (gpu_train_step's
median_ms). Peak memory: lnn, CuPy's default pool plus the graph's private pool (total bytes held, a
conservative figure); PyTorch, torch.cuda.max_memory_allocated. Writes the `gpu_lstm_step` section of
docs/BENCHMARKS.md and runs/gpu_lstm_step/gpu_lstm_step.json. A failed side is shown as
`failed: <reason>`; the others still run.
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
from gpu_train_step import cell, median_ms, memory_ratio, ratio, run_side, steps_per_block  # noqa: E402

MODEL = "conv1d_lstm"
STEPS, CHANNELS, HIDDEN, KERNEL, CLASSES = 128, 64, 128, 7, 5
LR = 1e-3
PARAMETERS = (CHANNELS * KERNEL + CHANNELS) + 4 * (CHANNELS * HIDDEN + HIDDEN * HIDDEN + 2 * HIDDEN) + (HIDDEN * CLASSES + CLASSES)
DEFAULT_BATCHES = (64,)
SIDES = ("lnn fp32", "lnn tf32", "torch fp32", "torch defaults", "torch fp32 graph")
DESCRIPTION = {
    "name": MODEL, "input_shape": [1, STEPS], "loss": "cross_entropy",
    "optimizer": {"type": "adam", "lr": LR},
    "layers": [{"type": "conv1d", "name": "conv", "out_channels": CHANNELS, "kernel_size": KERNEL, "padding": "same",
                "activation": "relu"},
               {"type": "lstm", "name": "lstm", "hidden_size": HIDDEN, "return": "last"},
               {"type": "linear", "name": "fc", "out_features": CLASSES}],
}


def lnn_side(batches: list, mode: str) -> dict:
    import cupy

    from lnn.train.trainer import Trainer

    pool = cupy.get_default_memory_pool()
    out = {}
    for batch in batches:
        messages = []
        trainer = Trainer(DESCRIPTION, device="cuda", batch_size=batch, cuda_graph=True, tf32=mode == "tf32",
                          log=messages.append)
        if trainer.model.num_params != PARAMETERS:
            raise RuntimeError(f"lnn's model has {trainer.model.num_params} parameters, expected {PARAMETERS}")
        data = [(cupy.random.standard_normal((batch, 1, STEPS), dtype=cupy.float32),
                 cupy.random.randint(0, CLASSES, batch)) for _ in range(4)]
        count = [0]

        def run_block(steps):
            for _ in range(steps):
                x, y = data[count[0] % 4]
                trainer.step(x, y)
                count[0] += 1

        run_block(5)                                            # warm-up, capture, replays
        first = trainer.step(*data[0]).loss
        ms = median_ms(run_block, steps_per_block(batch, STEPS), cupy.cuda.Device().synchronize)
        row = {"ms": ms, "peak_bytes": trainer.memory_held(), "first_loss": first}
        if not trainer.graph_mode:
            row["failed"] = "; ".join(messages)[:200] or "the graph path was not used"
        out[str(batch)] = row
        trainer = data = None
        gc.collect()
        pool.free_all_blocks()
    return out


def torch_net():
    import torch
    from torch import nn

    class ConvLstm(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv1d(1, CHANNELS, KERNEL, padding=KERNEL // 2)
            self.lstm = nn.LSTM(CHANNELS, HIDDEN, batch_first=True)
            self.fc = nn.Linear(HIDDEN, CLASSES)

        def forward(self, x):                                   # x [N, 1, T]
            features = torch.relu(self.conv(x)).transpose(1, 2)  # [N, T, 64]
            _, (h_n, _) = self.lstm(features)
            return self.fc(h_n[-1])                             # the last step's hidden state

    return ConvLstm().cuda()


def torch_side(batches: list, mode: str) -> dict:
    import torch
    from torch import nn

    if mode != "defaults":                                      # true fp32: no TF32 anywhere
        torch.backends.cudnn.allow_tf32 = False
        torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.benchmark = True
    graph = mode == "fp32 graph"
    torch.manual_seed(0)
    out = {}
    for batch in batches:
        net = torch_net()
        net.train()
        count = sum(p.numel() for p in net.parameters())
        if count != PARAMETERS:
            raise RuntimeError(f"the torch model has {count} parameters, expected {PARAMETERS}")
        optimizer = torch.optim.Adam(net.parameters(), lr=LR, capturable=graph)
        data = [(torch.randn(batch, 1, STEPS, device="cuda"), torch.randint(0, CLASSES, (batch,), device="cuda"))
                for _ in range(4)]
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()

        def loss_step(x, y):
            loss = nn.functional.cross_entropy(net(x), y)
            loss.backward()
            optimizer.step()
            return loss

        def eager_step(x, y):
            optimizer.zero_grad(set_to_none=True)
            return loss_step(x, y)

        if graph:                                               # PyTorch's whole-network capture recipe
            static_x, static_y = data[0][0].clone(), data[0][1].clone()
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):                       # warm-up on a side stream before capture
                for _ in range(3):
                    eager_step(static_x, static_y)
            torch.cuda.current_stream().wait_stream(side)
            captured = torch.cuda.CUDAGraph()
            optimizer.zero_grad(set_to_none=True)               # backward then writes .grad from the graph's pool
            with torch.cuda.graph(captured):
                static_loss = loss_step(static_x, static_y)

            def step(x, y):
                static_x.copy_(x)
                static_y.copy_(y)
                captured.replay()
                return static_loss
        else:
            step = eager_step
        done = [0]

        def run_block(steps):
            for _ in range(steps):
                x, y = data[done[0] % 4]
                step(x, y)
                done[0] += 1

        run_block(5)
        first = float(step(*data[0]))
        ms = median_ms(run_block, steps_per_block(batch, STEPS), torch.cuda.synchronize)
        out[str(batch)] = {"ms": ms, "peak_bytes": int(torch.cuda.max_memory_allocated()), "first_loss": first,
                           "torch": torch.__version__, "cudnn": torch.backends.cudnn.version()}
        net = optimizer = data = None
        torch.cuda.empty_cache()
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=str(REPO / "runs" / "gpu_lstm_step"))
    parser.add_argument("--batches", nargs="+", type=int, default=list(DEFAULT_BATCHES))
    parser.add_argument("--sides", nargs="+", default=list(SIDES), choices=SIDES)
    parser.add_argument("--side", choices=SIDES, help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)          # run_side passes it; there is one model
    args = parser.parse_args()
    if args.side:
        library, mode = args.side.split(" ", 1)
        print(json.dumps((lnn_side if library == "lnn" else torch_side)(args.batches, mode)))
        return

    from report import machine_line, markdown_table, update_section

    started = time.perf_counter()
    results = {}
    for side in args.sides:
        results[side] = run_side(MODEL, side, script=__file__, extra=("--batches", *map(str, args.batches)))
        print(f"{side}: {json.dumps(results[side])}", file=sys.stderr, flush=True)
    comparisons = [(a, b) for a, b in (("lnn fp32", "torch fp32"), ("lnn fp32", "torch fp32 graph"),
                                       ("lnn tf32", "torch defaults")) if a in args.sides and b in args.sides]
    memory = [(a, b) for a, b in comparisons[:1]]
    headers = (["batch"] + [f"{side} ms" for side in args.sides] + [f"{a} ÷ {b}" for a, b in comparisons]
               + [f"memory {a} ÷ {b}" for a, b in memory]
               + [f"{side} peak MB" for side in args.sides])
    rows = []
    for batch in args.batches:
        rows.append([batch] + [cell(results[side], batch) for side in args.sides]
                    + [ratio(results, a, b, batch) for a, b in comparisons]
                    + [memory_ratio(results, a, b, batch) for a, b in memory]
                    + ["-" if "failed" in results[side] else f"{results[side][str(batch)]['peak_bytes'] / 2**20:.0f}"
                       for side in args.sides])
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu_lstm_step.json").write_text(json.dumps(results, indent=1))
    table = markdown_table(headers, rows)
    print(table)
    print(f"total {time.perf_counter() - started:.0f} s", file=sys.stderr)
    gpu = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                         text=True).stdout.strip()
    update_section("gpu_lstm_step", f"""## conv1d + LSTM training step on the GPU: lnn's captured step vs PyTorch with cuDNN's LSTM

Command: `python benchmarks/gpu_lstm_step.py --batches {' '.join(map(str, args.batches))}`. Machine: {gpu};
{machine_line(("numpy", "cupy-cuda13x", "torch"))}.

[N, 1, {STEPS}] series -> conv1d 1->{CHANNELS} k{KERNEL} "same" + relu -> lstm hidden {HIDDEN}, last step -> linear
to {CLASSES} classes ({PARAMETERS:,} parameters on both sides); Adam lr {LR}, cross-entropy, random data on the GPU. Median
ms per training step (forward, backpropagation through time, optimizer), each side in a fresh process.
lnn replays its whole step as a CUDA graph; "torch fp32" is eager with TF32 off (cuDNN's LSTM in true
fp32), "torch defaults" lets cuDNN use TF32, "torch fp32 graph" is the fp32 step captured with
torch.cuda.graph. The target (issue 12) is lnn fp32 ÷ torch fp32 <= 1.0. Memory: lnn's CuPy pools
(total held, counting cached blocks) vs torch.cuda.max_memory_allocated.

{table}
""")


if __name__ == "__main__":
    main()
