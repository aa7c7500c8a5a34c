"""LSTM inference on the CPU: the Numba backend vs onnxruntime on the same exported model, side by side.

    python benchmarks/lstm_cpu.py [--repeats 5] [--note TEXT]      (about 1-2 minutes)

The model: one lstm layer, hidden 128, over a series of 4 features x 128 steps ([N, 4, 128] -> the
last step's [N, 128]; random weights, uniform in +-1/sqrt(128) as PyTorch initializes them), exported
by lnn-export's ONNX writer. For 1 and 2 threads and batch 1 and 32: lnn's cpu backend with threads=N
and onnxruntime with intra_op_num_threads=N on the exported .onnx, each timed as the median of many
calls after warm-up; the whole comparison is repeated --repeats times, the variants interleaved within
each repeat, and the table gives the median over repeats of each median, and the ratio lnn /
onnxruntime (below 1: lnn is faster). Writes the "lstm_cpu" section of docs/BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "benchmarks"))
from report import call_times, machine_line, markdown_table, update_section  # noqa: E402

from lnn.formats.model import parse_model  # noqa: E402

FEATURES, STEPS, HIDDEN = 4, 128, 128
THREADS = (1, 2)
BATCHES = (1, 32)
SECONDS_PER_MEASURE = 0.5
COMMAND = "python benchmarks/lstm_cpu.py"


def lstm_model(return_: str = "last"):
    model = parse_model({"name": "lstm128", "input_shape": [FEATURES, STEPS], "loss": "mse",
                         "layers": [{"type": "lstm", "name": "lstm", "hidden_size": HIDDEN, "return": return_}]})
    rng = np.random.default_rng(0)
    bound = 1 / np.sqrt(HIDDEN)
    weights = {node.param_key(p): rng.uniform(-bound, bound, shape).astype(np.float32)
               for node in model.nodes for p, shape in node.param_shapes.items()}
    return model, weights


def median_ms(function, x) -> float:
    """Median wall time of function(x) in ms: 3 warm-up calls, then at least 5 timed ones for ~0.5 s."""
    return float(np.median(call_times(lambda: function(x), 3, 5, SECONDS_PER_MEASURE, 2000))) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--note", default="", help="a remark on the machine's state, printed under the table")
    args = parser.parse_args()

    import onnxruntime

    from lnn.formats.onnx_export import export_onnx
    from lnn.runtime.cpu import BACKEND as CpuBackend

    model, weights = lstm_model()
    folder = tempfile.TemporaryDirectory()
    onnx_path = Path(folder.name) / "lstm128.onnx"
    export_onnx(model, weights, onnx_path)
    peers = {}
    for threads in THREADS:
        options = onnxruntime.SessionOptions()
        options.intra_op_num_threads = threads
        options.inter_op_num_threads = 1
        ort = onnxruntime.InferenceSession(str(onnx_path), options, providers=["CPUExecutionProvider"])
        peers[threads] = (CpuBackend(model, weights, threads=threads), ort)
    inputs = {batch: np.random.default_rng(batch).standard_normal((batch, FEATURES, STEPS)).astype(np.float32)
              for batch in BATCHES}
    for threads, (cpu, ort) in peers.items():                   # same answers before any timing
        for x in inputs.values():
            np.testing.assert_allclose(cpu.run(x), ort.run(None, {"input": x})[0], atol=1e-5, rtol=1e-4)

    figures = {}
    for repeat in range(args.repeats):
        for threads, (cpu, ort) in peers.items():
            for batch, x in inputs.items():
                lnn_ms = median_ms(cpu.run, x)
                ort_ms = median_ms(lambda batch_x: ort.run(None, {"input": batch_x}), x)
                figures.setdefault((threads, batch), []).append((lnn_ms, ort_ms))
                print(f"repeat {repeat + 1}: threads {threads} batch {batch}: lnn {lnn_ms:.3f} ms, "
                      f"onnxruntime {ort_ms:.3f} ms, {lnn_ms / ort_ms:.2f}x", flush=True)
    rows = []
    for (threads, batch), pairs in figures.items():
        lnn_ms = float(np.median([p[0] for p in pairs]))
        ort_ms = float(np.median([p[1] for p in pairs]))
        ratios = [p[0] / p[1] for p in pairs]
        rows.append([threads, batch, f"{lnn_ms:.3f}", f"{ort_ms:.3f}", f"{lnn_ms / ort_ms:.2f}",
                     f"{min(ratios):.2f}-{max(ratios):.2f}"])
    table = markdown_table(["threads", "batch", "lnn cpu (ms)", "onnxruntime (ms)", "lnn / ort", "range over repeats"],
                           rows)
    print(table)
    update_section("lstm_cpu", f"""
## LSTM inference on the CPU: lnn's Numba backend vs onnxruntime

`{COMMAND} --repeats {args.repeats}`: one lstm layer, hidden {HIDDEN}, over [N, {FEATURES}, {STEPS}]
(features x steps), returning the last step; onnxruntime runs lnn's ONNX export of the same model
(Transpose + LSTM + Transpose/Reshape). Medians of per-run medians over {args.repeats} repeats, the
variants interleaved in each repeat; the target is lnn / ort <= 1.0.
{machine_line()}. {args.note}

{table}
""")


if __name__ == "__main__":
    main()
