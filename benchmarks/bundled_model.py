"""The bundled tomato model on this CPU: batch-1 latency and the README main job's cold start.

    python benchmarks/bundled_model.py [--runs 200] [--starts 7]

Latency: lnn's Numba backend and NumPy backend vs onnxruntime running the same weights exported
to ONNX (lnn.formats.onnx_export), one thread each, random-normal inputs, median of --runs calls
after warm-up, interleaved. Cold start: wall time from process start to the printed answer of
`lnn-infer examples/leaves/late_blight.jpg` (the README's main job), first run (empty bytecode and
kernel caches) and cached runs (median of --starts), beside a minimal one-image onnxruntime script.
Writes the `bundled_model` section of docs/BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "benchmarks"))
MODEL = REPO / "models" / "tomato_leaf.bin"
PHOTO = REPO / "examples" / "leaves" / "late_blight.jpg"

ORT_SCRIPT = """
import sys, json, numpy as np, cv2, onnxruntime as ort
meta = json.loads(sys.argv[3])
image = cv2.cvtColor(cv2.imread(sys.argv[2]), cv2.COLOR_BGR2RGB)
image = cv2.resize(image, (128, 128), interpolation=cv2.INTER_AREA).astype(np.float32) * meta["scale"]
x = ((image - meta["mean"]) / meta["std"]).transpose(2, 0, 1)[None].astype(np.float32)
options = ort.SessionOptions(); options.intra_op_num_threads = 1
session = ort.InferenceSession(sys.argv[1], options, providers=["CPUExecutionProvider"])
logits = session.run(None, {"input": x})[0][0]
print(meta["labels"][int(logits.argmax())])
"""


def timed_start(command, env) -> float:
    start = time.perf_counter()
    done = subprocess.run(command, env=env, capture_output=True, text=True)
    elapsed = time.perf_counter() - start
    if done.returncode != 0:
        raise SystemExit(f"{command} failed: {done.stderr}")
    return elapsed


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=200)
    parser.add_argument("--starts", type=int, default=7)
    args = parser.parse_args()

    import json

    import onnxruntime as ort

    import lnn
    from lnn.formats.binfile import read_bin
    from lnn.formats.onnx_export import export_bin_to_onnx
    from report import machine_line, markdown_table, update_section

    work = Path(tempfile.mkdtemp(prefix="lnn-bench-"))
    onnx_path = work / "tomato_leaf.onnx"
    export_bin_to_onnx(read_bin(MODEL), onnx_path)
    options = ort.SessionOptions()
    options.intra_op_num_threads, options.inter_op_num_threads = 1, 1
    peer = ort.InferenceSession(str(onnx_path), options, providers=["CPUExecutionProvider"])
    numba_session = lnn.load(MODEL, device="cpu", threads=1)
    numpy_session = lnn.load(MODEL, device="numpy")
    x = np.random.default_rng(0).standard_normal((1, 3, 128, 128)).astype(np.float32)
    np.testing.assert_allclose(numba_session.run(x), peer.run(None, {"input": x})[0], atol=1e-4)
    runners = {"lnn numba": lambda: numba_session.run(x), "lnn numpy": lambda: numpy_session.run(x),
               "onnxruntime": lambda: peer.run(None, {"input": x})}
    times = {name: [] for name in runners}
    for _ in range(10):
        for run in runners.values():
            run()
    for i in range(args.runs):
        for name, run in runners.items():
            if name == "lnn numpy" and i % 10:
                continue
            start = time.perf_counter()
            run()
            times[name].append(time.perf_counter() - start)
    latency = {name: statistics.median(t) * 1e3 for name, t in times.items()}

    # a fresh bytecode cache that the runs do write (a PYTHONDONTWRITEBYTECODE of this shell would leave every
    # "cached" start compiling every module again, which no user's machine does by default)
    env = {**{k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"},
           "PYTHONPYCACHEPREFIX": str(work / "pycache"), "LNN_CACHE_DIR": str(work / "cache")}
    infer = [sys.executable, "-m", "lnn.tools.infer", str(PHOTO)]
    first = timed_start(infer, env)
    cached = statistics.median(timed_start(infer, env) for _ in range(args.starts))
    meta = read_bin(MODEL).metadata
    peer_meta = json.dumps({**{k: meta["preprocess"][k] for k in ("scale", "mean", "std")},
                            "labels": [label["display"] for label in meta["labels"]]})
    peer_command = [sys.executable, "-c", ORT_SCRIPT, str(onnx_path), str(PHOTO), peer_meta]
    peer_start = statistics.median(timed_start(peer_command, env) for _ in range(args.starts))

    rows = [[name, f"{ms:.3f}", f"{ms / latency['onnxruntime']:.2f}"] for name, ms in latency.items()]
    starts = [["`lnn-infer examples/leaves/late_blight.jpg`, first run (empty caches)", f"{first:.3f}"],
              [f"`lnn-infer examples/leaves/late_blight.jpg`, cached (median of {args.starts})", f"{cached:.3f}"],
              [f"one-image onnxruntime script (median of {args.starts})", f"{peer_start:.3f}"]]
    body = f"""## The bundled tomato model on the CPU

Command: `python benchmarks/bundled_model.py`. Machine: {machine_line()}.
Model: models/tomato_leaf.bin (3x128x128, {lnn.load(MODEL, device='numpy').model.num_params:,} parameters).

Batch-1 latency, 1 thread, median of {args.runs} interleaved calls (NumPy: every 10th), random-normal input;
onnxruntime runs the same weights exported with `lnn-export --onnx`:

{markdown_table(["backend", "ms", "÷ onnxruntime"], rows)}

Cold start, process start to the printed answer (lnn-infer uses the NumPy backend for a few images, so
no Numba compile is paid; "first run" has empty bytecode and kernel caches):

{markdown_table(["command", "seconds"], starts)}
"""
    print(body)
    update_section("bundled_model", body)


if __name__ == "__main__":
    main()
