"""Sequence conv inference on the CPU: lnn's Numba backend vs onnxruntime on the same exported model.

    python benchmarks/series_conv.py [--note TEXT]       (about a minute)

The model is FCN (Wang et al. 2017, the UCR baseline): conv1d 128 (kernel 8, "same") + batch norm + relu,
conv1d 256 (5) + bn + relu, conv1d 128 (3) + bn + relu, global average pool over time, linear to 2 classes,
on a univariate series of 150 steps (GunPoint's length), the weights lnn-train starts from. lnn folds the batch norms
into the convs; the ONNX file is lnn-export's (folded the same way). For batch 1 and 32, one thread
each (lnn threads=1, onnxruntime intra_op_num_threads=1): the median of 5 rounds, each round the
median latency over ~0.5 s after warm-up, the two engines interleaved round by round, and the ratio
lnn / onnxruntime (below 1: lnn is faster). Writes the "series_conv" section of docs/BENCHMARKS.md.
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

from lnn.formats.binfile import build_metadata, encode_bin, parse_bin_bytes  # noqa: E402
from lnn.formats.model import parse_model  # noqa: E402
from lnn.formats.onnx_export import export_onnx  # noqa: E402
from lnn.runtime import Session  # noqa: E402
from lnn.train.trainer import initial_weights  # noqa: E402

LENGTH, CLASSES = 150, 2
FCN = {"name": "fcn", "input_shape": [1, LENGTH], "layers": [
    {"type": "conv1d", "out_channels": 128, "kernel_size": 8, "padding": "same"}, {"type": "batchnorm", "activation": "relu"},
    {"type": "conv1d", "out_channels": 256, "kernel_size": 5, "padding": "same"}, {"type": "batchnorm", "activation": "relu"},
    {"type": "conv1d", "out_channels": 128, "kernel_size": 3, "padding": "same"}, {"type": "batchnorm", "activation": "relu"},
    {"type": "global_avg_pool"}, {"type": "linear", "out_features": CLASSES}]}
BATCHES = (1, 32)
ROUNDS = 5
SECONDS_PER_ROUND = 0.5


def median_ms(function, x) -> float:
    for _ in range(3):
        function(x)
    times, spent = [], 0.0
    while len(times) < 5 or spent < SECONDS_PER_ROUND:
        start = time.perf_counter()
        function(x)
        times.append(time.perf_counter() - start)
        spent += times[-1]
    return 1000 * statistics.median(times)


def main() -> None:
    import onnxruntime

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--note", default="", help="a remark about the machine for the section (e.g. shared)")
    args = parser.parse_args()
    model = parse_model(FCN)
    weights = initial_weights(model, 0, np.float32)
    rng = np.random.default_rng(0)
    lnn_session = Session(parse_bin_bytes(encode_bin(model, weights, build_metadata(model))), device="cpu", threads=1)
    with tempfile.TemporaryDirectory() as folder:
        export_onnx(model, weights, Path(folder) / "fcn.onnx")
        options = onnxruntime.SessionOptions()
        options.intra_op_num_threads = 1
        ort = onnxruntime.InferenceSession(str(Path(folder) / "fcn.onnx"), options, providers=["CPUExecutionProvider"])
    rows = []
    for batch in BATCHES:
        x = rng.standard_normal((batch, 1, LENGTH)).astype(np.float32)
        lnn_run = lnn_session.run
        ort_run = lambda batch_x: ort.run(None, {"input": batch_x})[0]   # noqa: E731
        error = float(np.abs(lnn_run(x) - ort_run(x)).max())
        lnn_ms, ort_ms = [], []
        for _ in range(ROUNDS):
            lnn_ms.append(median_ms(lnn_run, x))
            ort_ms.append(median_ms(ort_run, x))
        ratios = [a / b for a, b in zip(lnn_ms, ort_ms)]
        rows.append((batch, f"{statistics.median(lnn_ms):.3f}", f"{statistics.median(ort_ms):.3f}",
                     f"{statistics.median(ratios):.2f}x ({min(ratios):.2f}-{max(ratios):.2f})", f"{error:.1e}"))
        print(*rows[-1])
    body = "\n".join([
        "## series_conv: FCN (conv1d) inference on the CPU, lnn vs onnxruntime",
        "",
        f"`python benchmarks/series_conv.py` — {machine_line()}{'; ' + args.note if args.note else ''}.",
        f"FCN on [1, {LENGTH}] ({model.num_params:,} parameters, {sum(n.flops for n in model.nodes) / 1e6:.1f} MFLOPs "
        "per series), batch norms folded, one thread each; median of 5 interleaved rounds (range of the ratio).",
        "",
        markdown_table(["batch", "lnn cpu (ms)", "onnxruntime (ms)", "lnn / onnxruntime", "largest difference"], rows)])
    update_section("series_conv", body)


if __name__ == "__main__":
    main()
