"""GPU inference latency: lnn's CUDA backend vs PyTorch eager (and onnxruntime's CUDA provider), one GPU.

    python benchmarks/gpu_infer.py [--repeats 50]

For each reference architecture (examples/reference/*.json) with the weights lnn-train starts from (PyTorch's
default initialization, seed 0; no ../shared needed) and random-normal inputs, at batch 1 and 256: median
milliseconds per call, host array in and host array out on every side (lnn: Session.run; PyTorch: tensor
upload, forward under no_grad with cuDNN defaults, .cpu(); onnxruntime: InferenceSession.run with
CUDAExecutionProvider), the GPU synchronized by each call's device-to-host copy. All sides run in this process
(inference only). Outputs are checked against each other (max abs difference) before timing. Writes the
`gpu_infer` section of docs/BENCHMARKS.md. PyTorch and onnxruntime are peers here only; lnn never depends on
them.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "benchmarks"))

from report import machine_line, markdown_table, update_section  # noqa: E402
from torch_peer import torch_sequential  # noqa: E402

NAMES = ["mnist_mlp", "mnist_cnn", "leaf_cnn", "leaf_cnn224"]
BATCHES = [1, 256]


def median_ms(function, x, repeats: int) -> float:
    for _ in range(3):
        function(x)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        function(x)                      # every side returns a host array: the call ends synchronized
        times.append((time.perf_counter() - start) * 1000)
    return statistics.median(times)


def onnx_session(model, weights, folder: Path):
    try:
        import onnxruntime
    except ImportError:
        return None
    if "CUDAExecutionProvider" not in onnxruntime.get_available_providers():
        return None
    from lnn.formats.onnx_export import export_onnx

    path = folder / f"{model.name}.onnx"
    export_onnx(model, weights, path)
    session = onnxruntime.InferenceSession(str(path), providers=["CUDAExecutionProvider"])
    if session.get_providers()[0] != "CUDAExecutionProvider":
        return None
    name = session.get_inputs()[0].name
    return lambda x: session.run(None, {name: x})[0]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=50)
    args = parser.parse_args(argv)

    import cupy
    import torch

    import lnn
    from lnn.formats.binfile import build_metadata, write_bin
    from lnn.formats.model import load_model
    from lnn.train.trainer import initial_weights

    torch.backends.cudnn.benchmark = False          # cuDNN's default algorithm choice
    # True fp32 on both sides: PyTorch would otherwise run convolutions in TF32 (its cuDNN default).
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cuda.matmul.allow_tf32 = False
    rows, folder = [], Path(tempfile.mkdtemp(prefix="lnn_gpu_infer_"))
    for name in NAMES:
        model = load_model(REPO / "examples" / "reference" / f"{name}.json")
        weights = initial_weights(model, 0, np.float32)
        rng = np.random.default_rng(0)
        write_bin(folder / f"{name}.bin", model, weights, build_metadata(model))
        session = lnn.load(folder / f"{name}.bin", device="cuda")
        net = torch_sequential(model, weights).eval()

        def torch_run(x, net=net):
            with torch.no_grad():
                return net(torch.from_numpy(x).cuda()).cpu().numpy()

        ort_run = onnx_session(model, weights, folder)
        for batch in BATCHES:
            x = rng.standard_normal((batch, *model.input_shape)).astype(np.float32)
            expected = torch_run(x)
            difference = float(np.abs(session.run(x) - expected).max())
            lnn_ms = median_ms(session.run, x, args.repeats)
            torch_ms = median_ms(torch_run, x, args.repeats)
            ort_ms = median_ms(ort_run, x, args.repeats) if ort_run else None
            row = [name, batch, f"{lnn_ms:.3f}", f"{torch_ms:.3f}", f"{lnn_ms / torch_ms:.2f}",
                   f"{ort_ms:.3f}" if ort_ms else "n/a", f"{lnn_ms / ort_ms:.2f}" if ort_ms else "n/a", f"{difference:.1e}"]
            rows.append(row)
            print(" | ".join(map(str, row)), flush=True)

    properties = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)
    gpu = properties["name"].decode() if isinstance(properties["name"], bytes) else properties["name"]
    headers = ["model", "batch", "lnn cuda ms", "PyTorch eager ms", "lnn / PyTorch", "onnxruntime CUDA ms",
               "lnn / onnxruntime", "max |lnn - PyTorch|"]
    body = (f"## GPU inference latency\n\nMachine: {machine_line(('numpy', 'cupy-cuda12x', 'cupy-cuda13x', 'torch', 'onnxruntime-gpu'))}, "
            f"GPU {gpu}. Script: `python3 benchmarks/gpu_infer.py`.\n\n"
            "Median ms per call over "
            f"{args.repeats} calls, host float32 in and out (upload, forward, download), lnn-train's initial weights (seed 0) "
            "and random-normal inputs; fp32 on both sides (PyTorch's TF32 switched off); PyTorch eager under no_grad; onnxruntime from "
            "lnn's ONNX export with the CUDA provider (n/a: not installed there). Lower ratio is better for lnn.\n\n"
            + markdown_table(headers, rows))
    update_section("gpu_infer", body)
    return 0


if __name__ == "__main__":
    sys.exit(main())
