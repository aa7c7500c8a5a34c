"""The CPU backend's 3x3 convolutions: GFLOP/s per conv layer, and batch-1 latency beside onnxruntime and ncnn.

    python benchmarks/cpu_conv3x3.py [--before REV] [--rounds 3]      (needs ../shared/reference_models)

About 3 minutes on an idle 2-core machine with --before (10 on a loaded one, --rounds 5). Everything
runs at batch 1 on 1 thread, each runtime in its own process (one worker process per measurement,
started by this script), random-normal inputs, wall time after warm-up (median, and the best call):
  - gemm     numpy's 1-thread float32 GEMM rate on a [256 x 1152] x [1152 x 784] product (conv4 of
             leaf_cnn224 as im2col), the yardstick for the per-layer rates;
  - layers   each conv layer of leaf_cnn224 and of the bundled tomato model, timed alone inside the
             backend's plan (its fused epilogue and max-pool included), as GFLOP/s of the conv's
             2 * multiply-adds, with the algorithm the backend picks (conv2d.py's rule), over
             --rounds worker processes;
  - latency  lnn (threads=1), onnxruntime (intra_op_num_threads=1) and ncnn (num_threads=1, files in
             ../shared/reference_models/peer_formats; absent for the tomato model) on leaf_cnn,
             leaf_cnn224, mnist_cnn and models/tomato_leaf.bin (onnxruntime on its `lnn-export --onnx`).
Each latency is the median over --rounds rounds (the runtimes interleaved round by round) of each
worker's median, and the best call of all. --before REV also measures lnn's layers and latency at git revision REV (its tree
put in a temporary folder as the `lnn` package), so before/after come from the same run.
Writes the "cpu_conv3x3" section of docs/BENCHMARKS.md (not with --no-write).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "benchmarks"))
from report import SHARED, call_times, machine_line, markdown_table, update_section  # noqa: E402

REFERENCE_MODELS = SHARED / "reference_models"
PEERS = REFERENCE_MODELS / "peer_formats"
TOMATO = REPO / "models" / "tomato_leaf.bin"
MODELS = ["leaf_cnn", "leaf_cnn224", "mnist_cnn", "tomato_leaf"]
LAYER_MODELS = ["leaf_cnn224", "tomato_leaf"]
SECONDS_PER_MEASURE = 1.0


def times_ms(function) -> list:
    """[median, best] wall time of function() in ms: 5 warm-up calls, then at least 10 timed ones for ~1 s."""
    times = call_times(function, 5, 10, SECONDS_PER_MEASURE, 3000)
    return [float(np.median(times)) * 1e3, float(np.min(times)) * 1e3]


def lnn_model(name: str):
    """(model, float32 weights) of a reference model or of the bundled tomato model, through a .bin."""
    from lnn.formats.binfile import build_metadata, encode_bin, parse_bin_bytes, read_bin
    from lnn.formats.model import load_model

    if name == "tomato_leaf":
        bin_model = read_bin(TOMATO)
    else:
        model = load_model(REPO / "examples" / "reference" / f"{name}.json")
        weights = dict(np.load(REFERENCE_MODELS / f"{name}.weights.npz"))
        bin_model = parse_bin_bytes(encode_bin(model, weights, build_metadata(model)))
    return bin_model.model, bin_model.weights_fp32()


def random_input(shape) -> np.ndarray:
    return np.random.default_rng(0).standard_normal((1, *shape)).astype(np.float32)


# ---- workers: each prints one JSON value on its last line ----

def worker_gemm(_name, _extra) -> list:
    from threadpoolctl import threadpool_limits

    rng = np.random.default_rng(0)
    a, b = rng.standard_normal((256, 1152), np.float32), rng.standard_normal((1152, 784), np.float32)
    out = np.empty((256, 784), np.float32)
    with threadpool_limits(1, user_api="blas"):
        ms = times_ms(lambda: np.matmul(a, b, out=out))
    return [2 * 256 * 1152 * 784 / (value * 1e6) for value in ms]          # GFLOP/s at the median, at the best


def worker_layers(name, _extra) -> list:
    """[[conv input shape, output channels, algorithm, median ms, best ms, MFLOP]] for each conv layer, timed alone."""
    from threadpoolctl import threadpool_limits

    from lnn.runtime.cpu.backend import CpuBackend, Plan
    from lnn.runtime.cpu.conv2d import Conv2dLayer

    model, weights = lnn_model(name)
    backend = CpuBackend(model, weights, threads=1)
    convs = [node for node in model.nodes if node.op == "conv2d"]
    x = random_input(model.input_shape)
    plan = Plan(backend.layers, model.input_shape, 1, chains=False)
    rows = []
    np.copyto(plan.input, x)
    with threadpool_limits(1, user_api="blas"):
        for step in plan.steps:          # every layer's input holds real values
            step()
        for layer, (first, end) in zip(backend.layers, plan.layer_steps):
            run = lambda steps=plan.steps[first:end]: [step() for step in steps]  # noqa: E731
            ms = times_ms(run)
            if isinstance(layer, Conv2dLayer):
                node = convs[len(rows)]
                algorithm = ("direct" if getattr(layer, "small_direct", False) or layer.direct else
                             "winograd" if layer.winograd else "gemm")
                rows.append(["x".join(map(str, node.in_shape)), node.out_shape[0], algorithm, *ms, node.flops / 1e6])
    return rows


def worker_lnn(name, _extra) -> list:
    from lnn.runtime.cpu.backend import CpuBackend

    model, weights = lnn_model(name)
    backend = CpuBackend(model, weights, threads=1)
    x = random_input(model.input_shape)
    return times_ms(lambda: backend.run(x))


def worker_onnxruntime(name, onnx_path) -> list:
    import onnxruntime

    options = onnxruntime.SessionOptions()
    options.intra_op_num_threads, options.inter_op_num_threads = 1, 1
    session = onnxruntime.InferenceSession(onnx_path, options, providers=["CPUExecutionProvider"])
    shape = session.get_inputs()[0].shape[1:]
    x = random_input(shape)
    input_name = session.get_inputs()[0].name
    return times_ms(lambda: session.run(None, {input_name: x}))


def worker_ncnn(name, _extra) -> list:
    import ncnn

    net = ncnn.Net()
    net.opt.num_threads = 1
    net.opt.use_vulkan_compute = False
    net.load_param(str(PEERS / f"{name}.ncnn.param"))
    net.load_model(str(PEERS / f"{name}.ncnn.bin"))
    shape = json.loads((REFERENCE_MODELS / f"{name}.json").read_text())["input"]["shape"][1:]
    image = ncnn.Mat(random_input(shape)[0])

    def run():
        extractor = net.create_extractor()
        extractor.input("in0", image)
        return extractor.extract("out0")
    return times_ms(run)


WORKERS = {"gemm": worker_gemm, "layers": worker_layers, "lnn": worker_lnn, "onnxruntime": worker_onnxruntime,
           "ncnn": worker_ncnn}


# ---- driver ----

def in_process(kind: str, name: str = "", extra: str = "", lnn_root: str | None = None):
    env = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", MKL_NUM_THREADS="1")
    if lnn_root:
        env["PYTHONPATH"] = os.pathsep.join([lnn_root, env.get("PYTHONPATH", "")])
    done = subprocess.run([sys.executable, __file__, "--worker", kind, name, extra], env=env, capture_output=True,
                          text=True, timeout=600, cwd=lnn_root or REPO)
    if done.returncode != 0:
        raise SystemExit(f"worker {kind} {name} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def checkout(revision: str, folder: Path) -> str:
    """Revision's tree as the package folder/lnn; returns folder (for PYTHONPATH)."""
    archive = subprocess.run(["git", "-C", str(REPO), "archive", "--prefix=lnn/", revision], capture_output=True,
                             check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(folder)], input=archive, check=True)
    return str(folder)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--worker", nargs=3, help=argparse.SUPPRESS)
    parser.add_argument("--before", metavar="REV", help="also measure lnn at this git revision")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--no-write", action="store_true", help="print only; leave docs/BENCHMARKS.md alone")
    args = parser.parse_args()
    if args.worker:
        kind, name, extra = args.worker
        print(json.dumps(WORKERS[kind](name, extra)))
        return
    if not REFERENCE_MODELS.exists():
        raise SystemExit(f"{REFERENCE_MODELS} is absent; this benchmark needs the reference models")
    from lnn.formats.binfile import read_bin
    from lnn.formats.onnx_export import export_bin_to_onnx

    work = Path(tempfile.mkdtemp(prefix="lnn-conv3x3-"))
    tomato_onnx = work / "tomato_leaf.onnx"
    export_bin_to_onnx(read_bin(TOMATO), tomato_onnx)
    roots = {"lnn": None}
    if args.before:
        roots[f"lnn {args.before}"] = checkout(args.before, work)

    gemm_rounds = [in_process("gemm") for _ in range(args.rounds)]
    gemm, gemm_best = statistics.median(r[0] for r in gemm_rounds), max(r[1] for r in gemm_rounds)
    print(f"1-thread GEMM: {gemm:.1f} GFLOP/s (median), {gemm_best:.1f} (best)", flush=True)
    layer_rows = []
    for name in LAYER_MODELS:
        rounds = {label: [] for label in roots}
        for _ in range(args.rounds):
            for label, root in roots.items():
                rounds[label].append(in_process("layers", name, lnn_root=root))
        for index, row in enumerate(rounds["lnn"][0]):
            cells = [name, f"conv{index + 1}", f"{row[0]} -> {row[1]}"]
            for label in roots:
                algorithm = rounds[label][0][index][2]
                ms = statistics.median(measured[index][3] for measured in rounds[label])
                best = min(measured[index][4] for measured in rounds[label])
                rate = row[5] / best
                cells += [algorithm, f"{ms:.3f}", f"{best:.3f}", f"{rate:.1f}", f"{100 * rate / gemm_best:.0f}%"]
            print(" | ".join(cells), flush=True)
            layer_rows.append(cells)

    runtimes = {label: ("lnn", root) for label, root in roots.items()}
    runtimes.update({"onnxruntime": ("onnxruntime", None), "ncnn": ("ncnn", None)})
    latency_rows = []
    for name in MODELS:
        samples = {label: [] for label in runtimes}
        for _ in range(args.rounds):
            for label, (kind, root) in runtimes.items():
                if kind == "ncnn" and not (PEERS / f"{name}.ncnn.param").exists():
                    continue
                extra = str(tomato_onnx if name == "tomato_leaf" else REFERENCE_MODELS / f"{name}.onnx")
                samples[label].append(in_process(kind, name, extra, lnn_root=root))
        ms = {label: statistics.median(v[0] for v in values) for label, values in samples.items() if values}
        best = {label: min(v[1] for v in values) for label, values in samples.items() if values}
        peers = [label for label in ("onnxruntime", "ncnn") if label in ms]
        cells = [name] + [f"{ms[label]:.3f} ({best[label]:.3f})" if label in ms else "-" for label in runtimes]
        cells += [f"{ms['lnn'] / min(ms[label] for label in peers):.2f}",
                  f"{best['lnn'] / min(best[label] for label in peers):.2f}"]
        print(" | ".join(cells), flush=True)
        latency_rows.append(cells)

    before = f" Columns `lnn {args.before}`: lnn at git revision {args.before}, in the same run." if args.before else ""
    layer_headers = ["model", "layer", "input -> out channels"]
    for label in roots:
        layer_headers += [f"{label} algorithm", f"{label} ms", f"{label} best ms", f"{label} GFLOP/s (best)",
                          f"{label} ÷ GEMM (best)"]
    body = "\n\n".join([
        "## 3x3 convolutions on the CPU: per-layer GFLOP/s, lnn vs onnxruntime and ncnn (batch 1, 1 thread)",
        f"Command: `python benchmarks/cpu_conv3x3.py{' --before ' + args.before if args.before else ''}`. "
        f"Machine: {machine_line(('numpy', 'numba', 'onnxruntime', 'ncnn'))}; shared with other jobs, so timings "
        f"are noisy.{before}",
        f"1-thread float32 GEMM rate (numpy, [256x1152]x[1152x784]): **{gemm:.1f} GFLOP/s** median, "
        f"**{gemm_best:.1f}** best. Per conv layer, timed alone inside the plan (fused epilogue and max-pool "
        f"included): the median over {args.rounds} processes of each one's median, and the best call of all; "
        "GFLOP/s of the direct convolution's 2 x multiply-adds at the best call, beside the best GEMM rate (so "
        "Winograd can exceed 100%). On a loaded machine the best call is the steadier figure: a call longer "
        "than the scheduler's slice waits for the other jobs, which inflates medians unevenly.",
        markdown_table(layer_headers, layer_rows),
        f"Batch-1 latency, 1 thread, ms: median over {args.rounds} rounds of each process's median (best call "
        "in brackets); each runtime in its own process. The tomato model has no ncnn file.",
        markdown_table(["model", *runtimes, "lnn ÷ best peer (medians)", "lnn ÷ best peer (best calls)"],
                       latency_rows),
    ])
    if not args.no_write:
        update_section("cpu_conv3x3", body)
        print("wrote the cpu_conv3x3 section of docs/BENCHMARKS.md")


if __name__ == "__main__":
    main()
