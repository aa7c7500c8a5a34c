"""Train on MNIST with lnn (CuPy) and with PyTorch eager, side by side, on one GPU.

    python benchmarks/gpu_train.py --mnist DIR [--out DIR]

For each model (mnist_mlp, mnist_cnn from examples/reference) and each side, in a fresh process:
the same architecture, optimizer settings, learning-rate schedule, batch size and epochs (the
description's "training" block; and mnist_cnn once more at batch 256 for 3 epochs) and data (uint8 on the GPU, normalized inside the step, shuffled
per epoch). Reported: median epoch time (60,000 images, data handling
included), peak device memory (lnn: CuPy's pool high-water mark; PyTorch: max_memory_allocated),
and test accuracy. lnn's accuracy is measured by loading the exported model.bin with the CPU
runtime on the 10,000 test images. Writes the `gpu_train` section of docs/BENCHMARKS.md.
PyTorch is the peer here only; lnn never depends on it.
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


def lnn_side(args) -> dict:
    import cupy

    from lnn.train.data import load_mnist
    from lnn.train.trainer import Trainer

    train, test = load_mnist(args.mnist)
    spec = REPO / "examples" / "reference" / f"{args.model}.json"
    trainer = Trainer(str(spec), device="cuda", seed=0, batch_size=args.batch, log=lambda m: print(m, file=sys.stderr))
    out_dir = Path(args.run_dir)
    history = trainer.fit(train, test, epochs=args.epochs, out_dir=out_dir, progress=False)
    cupy.cuda.Device().synchronize()
    pool = cupy.get_default_memory_pool()
    report = trainer.plan.memory_report()

    import numpy as np
    import lnn
    session = lnn.load(out_dir / "model.bin", device="cpu")
    scale = np.float32(1 / 255)
    pre = session.model.preprocess
    x = ((test.images.astype(np.float32) * scale - pre["mean"][0]) / pre["std"][0]).astype(np.float32)
    predictions = np.concatenate([session.run(x[i:i + 500]).argmax(1) for i in range(0, len(x), 500)])
    accuracy = float((predictions == test.labels).mean())
    times = [entry["epoch_s"] for entry in history]
    return {"epoch_seconds": sorted(times)[len(times) // 2] if times else None, "epoch_times": times,
            "peak_bytes": int(pool.total_bytes()), "planned": report, "accuracy": accuracy,
            "history": history}


def torch_side(args) -> dict:
    import numpy as np
    import torch
    from torch_peer import torch_sequential
    from torch import nn

    from lnn.formats.model import load_model
    from lnn.train.config import TrainingConfig, learning_rate
    from lnn.train.data import load_mnist

    torch.backends.cudnn.allow_tf32 = False             # true fp32, as lnn
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.manual_seed(0)
    model = load_model(REPO / "examples" / "reference" / f"{args.model}.json")
    config = TrainingConfig.parse(model.extra.get("training"))
    config.batch_size, config.epochs = args.batch, args.epochs
    net = torch_sequential(model)
    opt = model.optimizer
    optimizer = torch.optim.SGD(net.parameters(), lr=opt["lr"], momentum=opt["momentum"], nesterov=opt["nesterov"],
                                weight_decay=opt["weight_decay"])
    train, test = load_mnist(args.mnist)
    pre = model.preprocess
    x_train = torch.from_numpy(np.ascontiguousarray(train.images)).cuda()
    y_train = torch.from_numpy(train.labels.astype(np.int64)).cuda()
    x_test = torch.from_numpy(np.ascontiguousarray(test.images)).cuda()
    y_test = torch.from_numpy(test.labels.astype(np.int64)).cuda()
    torch.cuda.reset_peak_memory_stats()

    def normalize(images):
        return (images.float() * (1 / 255) - pre["mean"][0]) / pre["std"][0]

    times, generator, step = [], torch.Generator(device="cuda").manual_seed(0), 0
    steps_per_epoch = -(-len(x_train) // config.batch_size)
    for epoch in range(config.epochs):
        torch.cuda.synchronize()
        start = time.perf_counter()
        order = torch.randperm(len(x_train), device="cuda", generator=generator)
        net.train()
        for i in range(0, len(order), config.batch_size):
            for group in optimizer.param_groups:
                group["lr"] = learning_rate(opt["lr"], config.lr_schedule, step, steps_per_epoch, config.epochs)
            step += 1
            index = order[i:i + config.batch_size]
            loss = nn.functional.cross_entropy(net(normalize(x_train[index])), y_train[index])
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    net.eval()
    with torch.no_grad():
        correct = sum(int((net(normalize(x_test[i:i + 1000])).argmax(1) == y_test[i:i + 1000]).sum())
                      for i in range(0, len(x_test), 1000))
    return {"epoch_seconds": sorted(times)[len(times) // 2], "epoch_times": times,
            "peak_bytes": int(torch.cuda.max_memory_allocated()), "accuracy": correct / len(x_test),
            "torch": torch.__version__}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mnist", required=True)
    parser.add_argument("--out", default=str(REPO / "runs" / "gpu_train"))
    parser.add_argument("--side", choices=("lnn", "torch"), help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    parser.add_argument("--run-dir", help=argparse.SUPPRESS)
    parser.add_argument("--batch", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--epochs", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.side:
        print(json.dumps(lnn_side(args) if args.side == "lnn" else torch_side(args), default=str))
        return

    from report import machine_line, markdown_table, update_section

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results, rows = {}, []
    from lnn.formats.model import load_model
    from lnn.train.config import TrainingConfig

    runs = []
    for model in ("mnist_mlp", "mnist_cnn"):
        config = TrainingConfig.parse(load_model(REPO / "examples" / "reference" / f"{model}.json").extra["training"])
        runs.append((model, config.batch_size, config.epochs))
    runs.append(("mnist_cnn", 256, 3))
    for model, batch, epochs in runs:
        for side in ("lnn", "torch"):
            command = [sys.executable, __file__, "--mnist", args.mnist, "--side", side, "--model", model,
                       "--run-dir", str(out / f"{model}_b{batch}"), "--batch", str(batch), "--epochs", str(epochs)]
            done = subprocess.run(command, capture_output=True, text=True)
            sys.stderr.write(done.stderr[-3000:])
            if done.returncode != 0:
                raise SystemExit(f"{side} {model} failed")
            results[(model, batch, side)] = json.loads(done.stdout.strip().splitlines()[-1])
        lnn_r, torch_r = results[(model, batch, "lnn")], results[(model, batch, "torch")]
        rows.append([model, batch, epochs,
                     f"{lnn_r['epoch_seconds']:.2f}", f"{torch_r['epoch_seconds']:.2f}",
                     f"{lnn_r['epoch_seconds'] / torch_r['epoch_seconds']:.2f}",
                     f"{lnn_r['peak_bytes'] / 2**20:.0f}", f"{torch_r['peak_bytes'] / 2**20:.0f}",
                     f"{100 * lnn_r['accuracy']:.2f}", f"{100 * torch_r['accuracy']:.2f}"])
    (out / "gpu_train.json").write_text(json.dumps({f"{m}/b{b}/{s}": r for (m, b, s), r in results.items()}, indent=1, default=str))
    table = markdown_table(["model", "batch", "epochs", "lnn s/epoch", "torch eager s/epoch", "lnn ÷ torch",
                            "lnn peak MiB", "torch peak MiB", "lnn test acc %", "torch test acc %"], rows)
    print(table)
    gpu = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True, text=True).stdout.strip()
    update_section("gpu_train", f"""## MNIST training on the GPU: lnn (CuPy) vs PyTorch eager

Command: `python benchmarks/gpu_train.py --mnist DIR`
(run by `benchmarks/gpu_check.sh`). Machine: {gpu}; {machine_line(("numpy", "cupy-cuda13x", "torch"))}.

Each side in a fresh process, same architecture, SGD settings, learning-rate schedule, batch and epochs
(the descriptions in examples/reference; the batch-256 row runs the same schedule over 3 epochs),
both in true fp32 (PyTorch's TF32 switched off);
data as uint8 on the GPU, normalized in the step. Epoch time is the median over epochs of a full
60,000-image pass including shuffling and batching. Peak memory: CuPy pool high-water mark vs
torch.cuda.max_memory_allocated. lnn's accuracy is of its exported model.bin run by the CPU runtime
on the 10,000 test images; PyTorch's is its own eval.

{table}
""")


if __name__ == "__main__":
    main()
