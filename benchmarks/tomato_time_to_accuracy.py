"""The bundled tomato model's recipe trained on the GPU: lnn (captured graph, fp32 and amp) vs the same recipe in PyTorch AMP.

    python benchmarks/tomato_time_to_accuracy.py [--data .devdata/gpu/tomato] [--epochs 60] [--sides ...]

Each side in a fresh process trains examples/tomato_leaf.json's recipe (its augmentation, batch 32, SGD nesterov 0.03,
momentum 0.9, weight decay 5e-4, clip 5, cosine with 2 warm-up epochs, its epochs) on the same
training rows and validation split as `lnn-train --data folder:DIR` (train/images.py folder_datasets:
classes balanced, leaves kept on one side), from each library's own initialization, and evaluates the
validation split after every epoch. PyTorch: autocast fp16 + GradScaler, channels_last, the same lr per
step (lnn.train.config.learning_rate), batches from lnn's own augmentation workers (train/data.py Prefetcher). Prints per
side: the best validation accuracy, the wall time from the first step until the validation accuracy
first reached 97% (training and evaluation; photos decoded before), and the mean epoch time; writes
the `tomato_time_to_accuracy` section of docs/BENCHMARKS.md. On .devdata/gpu (benchmarks/
prepare_gpu_data.py) the photos are re-encoded copies: accuracies are on those.
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
DESCRIPTION = REPO / "examples" / "tomato_leaf.json"
SIDES = ("lnn fp32", "lnn amp", "torch amp")
TARGET = 0.97


def datasets(data: str):
    from lnn.formats.model import load_description
    from lnn.train.images import folder_datasets

    description = load_description(DESCRIPTION)
    train, val, described = folder_datasets(data, description, log=lambda m: print(m, file=sys.stderr),
                                            progress=False)
    return train, val, described


def summary(history: list, started: float) -> dict:
    reached = next((h["wall_s"] for h in history if h["val_accuracy"] >= TARGET), None)
    return {"best_val_accuracy": max(h["val_accuracy"] for h in history), "seconds_to_target": reached,
            "epochs_to_target": next((h["epoch"] for h in history if h["val_accuracy"] >= TARGET), None),
            "mean_epoch_s": sum(h["epoch_s"] for h in history) / len(history), "epochs": len(history),
            "total_s": time.perf_counter() - started, "history": history}


def lnn_side(data: str, amp: bool, epochs: int | None) -> dict:
    from lnn.train.trainer import Trainer

    train, val, described = datasets(data)
    trainer = Trainer(described, device="cuda", amp=amp, log=lambda m: print(m, file=sys.stderr))
    ends = []
    evaluate = trainer.evaluate

    def timed_evaluate(dataset):
        result = evaluate(dataset)
        ends.append(time.perf_counter())
        return result

    trainer.evaluate = timed_evaluate
    started = time.perf_counter()
    history = trainer.fit(train, val, epochs=epochs, progress=False, export=False)
    rows = [{"epoch": h["epoch"], "val_accuracy": h["val_accuracy"], "epoch_s": h["epoch_s"], "wall_s": end - started}
            for h, end in zip(history, ends)]
    out = summary(rows, started)
    out["graph"] = trainer.graph_mode
    return out


def torch_side(data: str, epochs: int | None) -> dict:
    import math

    import numpy as np
    import torch
    from torch import nn
    from torch_peer import torch_sequential

    from lnn.formats.model import parse_model
    from lnn.train.config import TrainingConfig, learning_rate
    from lnn.train.data import Prefetcher, epoch_order

    train, val, described = datasets(data)
    model = parse_model(described)
    config = TrainingConfig.parse(model.extra.get("training"))
    epochs = epochs or config.epochs
    opt = model.optimizer
    torch.manual_seed(config.seed)
    torch.backends.cudnn.benchmark = True
    net = torch_sequential(model).to(memory_format=torch.channels_last)
    optimizer = torch.optim.SGD(net.parameters(), lr=opt["lr"], momentum=opt["momentum"], nesterov=opt["nesterov"],
                                weight_decay=opt["weight_decay"])
    scaler = torch.amp.GradScaler("cuda")
    pre = model.preprocess
    mean = torch.tensor(pre["mean"], device="cuda").reshape(1, 3, 1, 1)
    std = torch.tensor(pre["std"], device="cuda").reshape(1, 3, 1, 1)

    images, labels = val.batch(np.arange(len(val)))
    val_x, val_y = torch.from_numpy(np.ascontiguousarray(images)).cuda(), torch.from_numpy(labels).long().cuda()

    def prepared(x):
        return ((x.float() * pre["scale"] - mean) / std).contiguous(memory_format=torch.channels_last)

    batch = config.batch_size
    steps_per_epoch = math.ceil(len(train) / batch)
    step, rows = 0, []
    started = time.perf_counter()
    for epoch in range(1, epochs + 1):
        epoch_start = time.perf_counter()
        net.train()
        order = epoch_order(len(train), config.seed, epoch)
        slices = [order[i:i + batch] for i in range(0, len(order), batch)]
        with Prefetcher(slices, train.batch) as prefetcher:          # lnn's augmentation workers, as lnn-train
            for host_x, host_y in prefetcher:
                x = torch.from_numpy(np.ascontiguousarray(host_x)).cuda(non_blocking=True)
                y = torch.from_numpy(np.asarray(host_y)).long().cuda(non_blocking=True)
                for group in optimizer.param_groups:
                    group["lr"] = learning_rate(opt["lr"], config.lr_schedule, step, steps_per_epoch, epochs)
                optimizer.zero_grad(set_to_none=True)
                with torch.autocast("cuda", dtype=torch.float16):
                    loss = nn.functional.cross_entropy(net(prepared(x)), y)
                scaler.scale(loss).backward()
                if config.grad_clip:
                    scaler.unscale_(optimizer)
                    torch.nn.utils.clip_grad_norm_(net.parameters(), config.grad_clip)
                scaler.step(optimizer)
                scaler.update()
                step += 1
        torch.cuda.synchronize()
        epoch_s = time.perf_counter() - epoch_start
        net.eval()
        correct = 0
        with torch.no_grad(), torch.autocast("cuda", dtype=torch.float16):
            for start in range(0, len(val_y), 256):
                correct += int((net(prepared(val_x[start:start + 256])).argmax(1) == val_y[start:start + 256]).sum())
        rows.append({"epoch": epoch, "val_accuracy": correct / len(val_y), "epoch_s": epoch_s,
                     "wall_s": time.perf_counter() - started})
    out = summary(rows, started)
    out["torch"] = torch.__version__
    return out


def run_side(side: str, data: str, epochs) -> dict:
    command = [sys.executable, __file__, "--side", side, "--data", data] + (["--epochs", str(epochs)] if epochs else [])
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        lines = [line for line in done.stderr.strip().splitlines() if line.strip()]
        return {"failed": (lines[-1] if lines else f"exit status {done.returncode}")[:300]}
    return json.loads(done.stdout.strip().splitlines()[-1])


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", default=str(REPO / ".devdata" / "gpu" / "tomato"))
    parser.add_argument("--epochs", type=int, help="default: the recipe's")
    parser.add_argument("--sides", nargs="+", default=list(SIDES), choices=SIDES)
    parser.add_argument("--side", choices=SIDES, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.side:
        result = torch_side(args.data, args.epochs) if args.side == "torch amp" else \
            lnn_side(args.data, args.side == "lnn amp", args.epochs)
        print(json.dumps(result))
        return

    from report import machine_line, markdown_table, update_section

    results = {side: run_side(side, args.data, args.epochs) for side in args.sides}
    rows = []
    for side, r in results.items():
        print(f"{side}: {json.dumps({k: v for k, v in r.items() if k != 'history'})}", file=sys.stderr)
        if "failed" in r:
            rows.append([side, f"failed: {r['failed']}", "-", "-", "-", "-"])
            continue
        rows.append([side, f"{r['best_val_accuracy']:.4f}", r["epochs_to_target"] or "not reached",
                     f"{r['seconds_to_target']:.1f}" if r["seconds_to_target"] else "-", f"{r['mean_epoch_s']:.2f}",
                     f"{r['total_s']:.1f}"])
    table = markdown_table(["side", "best val accuracy", "epochs to 97%", "s to 97%", "mean epoch s", "total s"], rows)
    print(table)
    gpu = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                         text=True).stdout.strip()
    update_section("tomato_time_to_accuracy", f"""## The tomato recipe on the GPU: time to 97% validation accuracy, lnn vs PyTorch AMP

Command: `python benchmarks/tomato_time_to_accuracy.py` (data: `benchmarks/prepare_gpu_data.py`'s re-encoded
copies). Machine: {gpu}; {machine_line(("numpy", "cupy-cuda13x", "torch"))}.

examples/tomato_leaf.json's recipe on the same training rows and validation split, each side from its own
initialization, evaluated after every epoch; wall time from the first step (photos decoded once before;
batches augmented by lnn's workers on both sides, as lnn-train does). lnn runs every full step as a
captured CUDA graph; PyTorch AMP is eager autocast fp16 with channels_last.

{table}
""")


if __name__ == "__main__":
    main()
