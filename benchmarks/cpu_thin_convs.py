"""3x3 convs too thin for Winograd (fewer than 16 input channels), one image, one thread: lnn as its rule picks
(conv3x3_direct_shifted where conv2d.narrow_tiles_pay, the columns GEMM elsewhere), lnn with the columns GEMM
forced ("algorithm": "im2col"), and onnxruntime, side by side.

    python benchmarks/cpu_thin_convs.py [--rounds 7]        (about a minute)

Each shape is one conv + ReLU (padding 1, random-normal weights and input), batch 1. The three run interleaved in
one process, round by round (lnn with threads=1, whose backend holds BLAS at one thread, onnxruntime with
intra_op_num_threads = 1); each figure is
the median over the rounds of each round's median us per call. Writes the "cpu_thin_convs" section of
docs/BENCHMARKS.md (not with --no-write). The rule's constants: conv2d.py SHIFTED_MAX_OUT_CHANNELS.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "benchmarks"))
from report import call_times, machine_line, markdown_table, update_section  # noqa: E402

# (input channels, output channels, height = width)
SHAPES = [(4, 16, 64), (8, 16, 64), (8, 32, 64), (12, 24, 32), (15, 32, 32), (8, 16, 128), (3, 48, 96),
          (3, 64, 128), (8, 64, 64), (15, 64, 32), (15, 128, 16)]
SECONDS = 0.2


def lnn_runner(channels: int, out_channels: int, size: int, algorithm: str, weight, bias, x):
    from lnn.formats.model import parse_model
    from lnn.runtime.cpu import BACKEND
    from lnn.runtime.cpu.conv2d import conv3x3_direct_shifted

    model = parse_model({"input_shape": [channels, size, size], "layers": [
        {"type": "conv2d", "out_channels": out_channels, "kernel_size": 3, "padding": 1, "activation": "relu",
         "algorithm": algorithm}]})
    node = model.nodes[0]
    backend = BACKEND(model, {node.param_key("weight"): weight, node.param_key("bias"): bias}, threads=1)
    kernels = {getattr(step, "func", None) for step in backend._plan(1).steps}
    kind = ("direct (shifted rows)" if conv3x3_direct_shifted in kernels
            else "direct" if backend.layers[0].small_direct else "columns GEMM")
    return (lambda: backend.run(x)), kind


def onnxruntime_runner(weight, bias, x):
    import onnxruntime
    from onnx import TensorProto, helper, numpy_helper

    graph = helper.make_graph(
        [helper.make_node("Conv", ["x", "w", "b"], ["c"], kernel_shape=[3, 3], pads=[1, 1, 1, 1]),
         helper.make_node("Relu", ["c"], ["y"])], "thin_conv",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, list(x.shape))],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        [numpy_helper.from_array(weight, "w"), numpy_helper.from_array(bias, "b")])
    options = onnxruntime.SessionOptions()
    options.intra_op_num_threads = 1
    options.inter_op_num_threads = 1
    session = onnxruntime.InferenceSession(helper.make_model(graph).SerializeToString(), options,
                                           providers=["CPUExecutionProvider"])
    return lambda: session.run(None, {"x": x})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args()
    from lnn.runtime.cpu.conv2d import narrow_tiles_pay

    rng = np.random.default_rng(0)
    rows = []
    for channels, out_channels, size in SHAPES:
        weight = (rng.standard_normal((out_channels, channels, 3, 3)) * np.sqrt(2 / (9 * channels))).astype(np.float32)
        bias = rng.uniform(-0.1, 0.1, out_channels).astype(np.float32)
        x = rng.standard_normal((1, channels, size, size)).astype(np.float32)
        auto, kind = lnn_runner(channels, out_channels, size, "auto", weight, bias, x)
        gemm, _ = lnn_runner(channels, out_channels, size, "im2col", weight, bias, x)
        peer = onnxruntime_runner(weight, bias, x)
        np.testing.assert_allclose(auto(), peer()[0], rtol=0, atol=1e-4)
        np.testing.assert_allclose(gemm(), peer()[0], rtol=0, atol=1e-4)
        medians = {name: [] for name in ("auto", "gemm", "peer")}
        for _ in range(args.rounds):
            for name, function in (("auto", auto), ("gemm", gemm), ("peer", peer)):
                medians[name].append(float(np.median(call_times(function, 3, 5, SECONDS, 5000))) * 1e6)
        auto_us, gemm_us, peer_us = (float(np.median(medians[name])) for name in ("auto", "gemm", "peer"))
        rows.append([f"{channels} -> {out_channels}, {size}x{size}", kind, f"{auto_us:.1f}", f"{gemm_us:.1f}",
                     f"{peer_us:.1f}", f"{auto_us / gemm_us:.2f}", f"{auto_us / peer_us:.2f}"])
        print(" | ".join(rows[-1]), flush=True)
    table = markdown_table(["conv (+ ReLU)", "lnn's choice", "lnn us", "lnn columns GEMM us", "onnxruntime us",
                            "lnn / its GEMM", "lnn / onnxruntime"], rows)
    print(table)
    if args.no_write:
        return
    update_section("cpu_thin_convs", "\n\n".join([
        "## 3x3 convs too thin for Winograd on the CPU: lnn's choice, its columns GEMM, onnxruntime (batch 1, 1 thread)",
        f"Command: `python benchmarks/cpu_thin_convs.py --rounds {args.rounds}`. Machine: {machine_line()}; the 8-lane "
        f"register tiles {'run' if narrow_tiles_pay() else 'do not run'} here (conv2d.narrow_tiles_pay).",
        "One conv + ReLU, padding 1, one image, one thread; median over the rounds of each round's median us per "
        "call, the three interleaved in one process.",
        table]))
    print("wrote the cpu_thin_convs section of docs/BENCHMARKS.md")


if __name__ == "__main__":
    main()
