"""Where an lnn training step spends its GPU time, layer by layer, next to PyTorch's kernels.

    python benchmarks/gpu_step_profile.py [--models leaf_cnn tomato_leaf] [--batches 256 64] [--amp [bf16]] [--algorithm winograd]

lnn: each layer's forward and backward of the step (train/layers.py, the code the captured graph
replays) run on their own between two CUDA events, median of `reps` repetitions, plus the optimizer.
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


def description_of(model_name: str) -> dict:
    path = REPO / "examples" / (f"{model_name}.json" if model_name == "tomato_leaf" else f"reference/{model_name}.json")
    return json.loads(path.read_text())


def lnn_profile(model_name: str, batch: int, algorithm: str, amp, reps: int = 10):
    import cupy
    from report import cuda_event_ms

    from lnn.train.layers import Call
    from lnn.train.trainer import Trainer

    description = description_of(model_name)
    for layer in description["layers"]:
        if layer["type"] == "conv2d" and algorithm != "auto":
            layer["algorithm"] = algorithm
    trainer = Trainer(description, device="cuda", batch_size=batch, amp=amp, cuda_graph=False, log=lambda m: None)
    plan = trainer.plan
    shape = (batch,) + tuple(trainer.model.input_shape)
    x = cupy.random.randint(0, 256, shape, dtype=cupy.uint8)
    y = cupy.random.randint(0, trainer.model.output_shape[0], batch)
    for _ in range(3):
        trainer.step(x, y)

    views = plan.views(batch)
    rows = []
    for i, layer in enumerate(plan.layers):
        if plan.trains_alias[i]:
            continue
        call = Call(cupy, key=0, index=plan.dropout_index, **views["calls"][i])
        label = f"{i}:{plan.model.nodes[i].op}"
        rows.append((f"fwd {label}", cuda_event_ms(lambda: layer.run_forward(call, True), reps)))
        if plan.runs_backward[i]:
            rows.append((f"bwd {label}", cuda_event_ms(lambda: layer.run_backward(call), reps)))
    rows.append(("optimizer", cuda_event_ms(lambda: trainer.optimizer.update(plan.grads, 0.0), reps)))
    total = sum(ms for _, ms in rows)
    print(f"\n== lnn {model_name} batch {batch}{f' amp {amp}' if amp else ''} ({algorithm}): sum {total:.3f} ms; "
          f"pool {cupy.get_default_memory_pool().total_bytes() / 2**20:.0f} MiB")
    for label, ms in rows:
        print(f"  {label:28s} {ms:8.3f} ms")


def torch_profile(model_name: str, batch: int):
    import torch
    from torch import nn
    from torch.profiler import ProfilerActivity, profile
    from torch_peer import torch_sequential

    from lnn.formats.model import parse_model

    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cuda.matmul.allow_tf32 = False
    model = parse_model(description_of(model_name))
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
    from lnn.runtime.cuda.float16 import AMP_PRECISIONS

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["leaf_cnn", "mnist_cnn"])
    parser.add_argument("--batches", nargs="+", type=int, default=[256, 64])
    parser.add_argument("--side", choices=["lnn", "torch", "both"], default="both")
    parser.add_argument("--algorithm", choices=["auto", "im2col", "winograd"], default="auto",
                        help="the conv layers' algorithm field for the lnn side")
    parser.add_argument("--amp", nargs="?", const="fp16", choices=tuple(AMP_PRECISIONS),
                        help="the lnn side in mixed precision (--amp alone: fp16)")
    args = parser.parse_args()
    for model_name in args.models:
        for batch in args.batches:
            if args.side in ("lnn", "both"):
                lnn_profile(model_name, batch, args.algorithm, args.amp)
            if args.side in ("torch", "both"):
                torch_profile(model_name, batch)


if __name__ == "__main__":
    main()
