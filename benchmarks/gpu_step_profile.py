"""Where the lnn graph training step spends its time, launch by launch, next to PyTorch's kernels.

    python benchmarks/gpu_step_profile.py [--models leaf_cnn mnist_cnn] [--batches 256 64] [--algorithm winograd]

lnn: the graph step's launch list (train/cuda_graph.py) run eagerly on its stream, each launch between
two CUDA events, median of 20 repetitions; labelled by layer, phase and the source line that queued it.
PyTorch: torch.profiler over 10 eager fp32 steps (TF32 off), CUDA kernel time per kernel name.
Prints tables (a diagnostic; it writes nothing to docs/).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "benchmarks"))


def lnn_profile(model_name: str, batch: int, algorithm: str, reps: int = 20):
    import cupy

    from lnn.train import cuda_graph
    from lnn.train.trainer import Trainer

    labels = []
    original_forward, original_backward = cuda_graph.GraphStep._forward, cuda_graph.GraphStep._backward

    def tagged(phase, method):
        def wrapper(self, node, *args):
            start = len(self.launches)
            method(self, node, *args)
            labels.extend([(start, len(self.launches), f"{phase} {node.index}:{node.op}")])
        return wrapper

    cuda_graph.GraphStep._forward = tagged("fwd", original_forward)
    cuda_graph.GraphStep._backward = tagged("bwd", original_backward)
    description = json.loads((REPO / "examples" / "reference" / f"{model_name}.json").read_text())
    for layer in description["layers"]:
        if layer["type"] == "conv2d":
            layer["algorithm"] = algorithm
    trainer = Trainer(description, device="cuda", batch_size=batch, cuda_graph=True, log=lambda m: None)
    shape = (batch,) + tuple(trainer.model.input_shape)
    x = cupy.random.randint(0, 256, shape, dtype=cupy.uint8)
    y = cupy.random.randint(0, trainer.model.output_shape[0], batch)
    for _ in range(3):
        trainer.step(x, y)
    step = trainer._graph
    cuda_graph.GraphStep._forward, cuda_graph.GraphStep._backward = original_forward, original_backward
    where = {}
    for start, end, label in labels:
        for k in range(start, end):
            where[k] = label
    rows = []
    with step.stream:
        for k, launch in enumerate(step.launches):
            times = []
            for _ in range(reps):
                a, b = cupy.cuda.Event(), cupy.cuda.Event()
                a.record(step.stream)
                launch()
                b.record(step.stream)
                b.synchronize()
                times.append(cupy.cuda.get_elapsed_time(a, b))
            code = launch.__code__
            rows.append((where.get(k, "other"), f"line {code.co_firstlineno}", sorted(times)[reps // 2]))
    total = sum(r[2] for r in rows)
    print(f"\n== lnn {model_name} batch {batch} ({algorithm}): {len(rows)} launches, sum of medians {total:.3f} ms; "
          f"peak pool {cupy.get_default_memory_pool().total_bytes() / 2**20:.0f} MiB")
    for label, line, ms in rows:
        if ms >= 0.005:
            print(f"  {label:22s} {line:10s} {ms:8.3f} ms")


def torch_profile(model_name: str, batch: int):
    import torch
    from torch import nn
    from torch.profiler import ProfilerActivity, profile
    from torch_peer import torch_sequential

    from lnn.formats.model import load_model

    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cuda.matmul.allow_tf32 = False
    model = load_model(REPO / "examples" / "reference" / f"{model_name}.json")
    net = torch_sequential(model)
    opt = model.optimizer
    optimizer = torch.optim.SGD(net.parameters(), lr=opt["lr"], momentum=opt["momentum"])
    x = torch.randint(0, 256, (batch,) + tuple(model.input_shape), dtype=torch.uint8, device="cuda")
    y = torch.randint(0, model.output_shape[0], (batch,), device="cuda")

    def step():
        optimizer.zero_grad(set_to_none=True)
        loss = nn.functional.cross_entropy(net(x.float() / 255), y)
        loss.backward()
        optimizer.step()

    for _ in range(5):
        step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(10):
            step()
        torch.cuda.synchronize()
    per_kernel = defaultdict(float)
    for event in prof.events():
        if event.device_type.name == "CUDA":
            per_kernel[event.name[:90]] += event.device_time_total / 1000 / 10
    total = sum(per_kernel.values())
    print(f"\n== torch {model_name} batch {batch}: kernel time per step {total:.3f} ms; "
          f"peak {torch.cuda.max_memory_allocated() / 2**20:.0f} MiB")
    for name, ms in sorted(per_kernel.items(), key=lambda kv: -kv[1])[:25]:
        print(f"  {ms:8.3f} ms  {name}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["leaf_cnn", "mnist_cnn"])
    parser.add_argument("--batches", nargs="+", type=int, default=[256, 64])
    parser.add_argument("--side", choices=["lnn", "torch", "both"], default="both")
    parser.add_argument("--algorithm", choices=["auto", "im2col", "winograd"], default="auto",
                        help="the conv layers' algorithm field for the lnn side")
    args = parser.parse_args()
    for model_name in args.models:
        for batch in args.batches:
            if args.side in ("lnn", "both"):
                lnn_profile(model_name, batch, args.algorithm)
            if args.side in ("torch", "both"):
                torch_profile(model_name, batch)


if __name__ == "__main__":
    main()
