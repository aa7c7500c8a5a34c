"""lnn's Numba backend beside onnxruntime, LiteRT and ncnn, each in its own process, same weights.

    python benchmarks/cpu_peers.py [--rounds 3] [--note "..."]   (about 5-10 minutes on 2 busy cores)

Needs ../shared/reference_models (the .onnx files, and peer_formats/ with the .tflite and ncnn
.param/.bin of the four reference models) and, for the peers, `pip install onnxruntime ai-edge-litert
ncnn` (benchmark-only: none is a dependency of lnn). The bundled tomato model (models/tomato_leaf.bin)
runs on lnn and on onnxruntime (through `lnn-export --onnx`); no LiteRT or ncnn file of it exists.

For each model and runtime, one fresh process measures batch 1 at 1 and 2 threads and batch 32 at 2
threads: median ms per call over at least 0.4 s after warm-up, on random-normal inputs. lnn is
`lnn.runtime.cpu` with threads=N (one image split over N threads; a large batch split by images);
onnxruntime `intra_op_num_threads`; LiteRT the XNNPACK interpreter with `num_threads`, its input
resized to the batch; ncnn `opt.num_threads`, one image per call (it has no batch axis: batch 32 is
32 calls). The processes run `--rounds` times, interleaved, and each figure is the median of the
rounds: the machine is shared. Other processes' CPU use during each process is read from /proc/stat;
a process is run again (up to --retries more times, the quietest kept) while they took more than
QUIET_CORES. Prints the table and, after a run of every model on every runtime, writes the "cpu_peers"
section of docs/BENCHMARKS.md (a run of fewer, --models or --runtimes, only prints: the section stays one
whole run).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "benchmarks"))
from report import SHARED, busy_seconds, call_times, machine_line, markdown_table, others_cores, update_section  # noqa: E402

REFERENCE_MODELS = SHARED / "reference_models"
PEER_FORMATS = REFERENCE_MODELS / "peer_formats"
BUNDLED = REPO / "models" / "tomato_leaf.bin"
MODELS = ["leaf_cnn", "leaf_cnn224", "tomato", "mnist_cnn", "mnist_mlp"]
RUNTIMES = ["lnn", "onnxruntime", "litert", "ncnn"]
CONFIGS = [(1, 1), (2, 1), (2, 32)]           # (threads, batch)
SECONDS = 0.4
WORKER_SECONDS = 90       # a runtime's process for one model (ncnn's spinning threads crawl on a busy machine)
COMMAND = "python benchmarks/cpu_peers.py"
PER_ROUND = "per round (others' cores; one thread: the 2-thread process ran the one-thread plan)"   # a column's head
QUIET_CORES = 0.25        # a runtime's process is run again (up to --retries more times) when others took more meanwhile


def median_ms(function) -> float:
    return float(np.median(call_times(function, 3, 5, SECONDS, 5000))) * 1e3


def input_shape(name: str) -> tuple:
    from lnn.formats.binfile import read_bin
    from lnn.formats.model import load_model

    if name == "tomato":
        return tuple(read_bin(BUNDLED).model.input_shape)
    return tuple(load_model(REPO / "examples" / "reference" / f"{name}.json").input_shape)


def lnn_runner(name: str, threads: int, batch: int, files: dict):
    from lnn.runtime.cpu import BACKEND

    bin_model = load_bin(name)
    backend = BACKEND(bin_model.model, bin_model.weights_fp32(), threads=threads)
    x = random_input((batch, *bin_model.model.input_shape))
    backend.warmup(batch)                 # its split choice made before the timed calls, as in a long-lived process

    def run():
        return backend.run(x)
    run.choice = backend.split_choice     # what the timed calls ran: the split plan or one thread's (read after them)
    return run


def load_bin(name: str):
    from lnn.formats.binfile import build_metadata, encode_bin, parse_bin_bytes, read_bin
    from lnn.formats.model import load_model

    if name == "tomato":
        return read_bin(BUNDLED)
    model = load_model(REPO / "examples" / "reference" / f"{name}.json")
    weights = dict(np.load(REFERENCE_MODELS / f"{name}.weights.npz"))
    return parse_bin_bytes(encode_bin(model, weights, build_metadata(model)))


def onnxruntime_runner(name: str, threads: int, batch: int, files: dict):
    import onnxruntime

    options = onnxruntime.SessionOptions()
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    session = onnxruntime.InferenceSession(files["onnx"], options, providers=["CPUExecutionProvider"])
    feed = {session.get_inputs()[0].name: random_input((batch, *input_shape(name)))}
    return lambda: session.run(None, feed)


def litert_runner(name: str, threads: int, batch: int, files: dict):
    from ai_edge_litert.interpreter import Interpreter

    interpreter = Interpreter(model_path=files["tflite"], num_threads=threads)
    detail = interpreter.get_input_details()[0]
    interpreter.resize_tensor_input(detail["index"], [batch, *detail["shape"][1:]])
    interpreter.allocate_tensors()
    index, output = detail["index"], interpreter.get_output_details()[0]["index"]
    x = random_input((batch, *detail["shape"][1:]))

    def run():
        interpreter.set_tensor(index, x)
        interpreter.invoke()
        return interpreter.get_tensor(output)
    return run


def ncnn_runner(name: str, threads: int, batch: int, files: dict):
    import ncnn

    net = ncnn.Net()
    net.opt.num_threads = threads
    net.opt.use_vulkan_compute = False
    net.load_param(files["param"])
    net.load_model(files["bin"])
    images = [ncnn.Mat(random_input(input_shape(name))) for _ in range(batch)]

    def run():
        for image in images:
            extractor = net.create_extractor()
            extractor.input("in0", image)
            extractor.extract("out0")
    return run


RUNNERS = {"lnn": lnn_runner, "onnxruntime": onnxruntime_runner, "litert": litert_runner, "ncnn": ncnn_runner}


def random_input(shape: tuple) -> np.ndarray:
    return np.random.default_rng(0).standard_normal(shape).astype(np.float32)


def worker(runtime: str, name: str, files: dict) -> None:
    """In its own process: one line of JSON, {"threads,batch": ms}."""
    results = {}
    for threads, batch in CONFIGS:
        runner = RUNNERS[runtime](name, threads, batch, files)
        results[f"{threads},{batch}"] = median_ms(runner)
        if threads > 1 and batch == 1 and getattr(runner, "choice", None):
            results["split choice"] = runner.choice()
    print(json.dumps(results))


def peer_files(name: str, folder: Path) -> dict:
    """The files each runtime reads for this model (absent: that runtime is skipped for it)."""
    if name == "tomato":
        onnx = folder / "tomato_leaf.onnx"
        subprocess.run([sys.executable, "-m", "lnn.tools.export", str(BUNDLED), "--onnx", str(onnx)],
                       check=True, capture_output=True)
        return {"lnn": {}, "onnxruntime": {"onnx": str(onnx)}}
    files = {"lnn": {}, "onnxruntime": {"onnx": str(REFERENCE_MODELS / f"{name}.onnx")}}
    if (PEER_FORMATS / f"{name}.tflite").exists():
        files["litert"] = {"tflite": str(PEER_FORMATS / f"{name}.tflite")}
    if (PEER_FORMATS / f"{name}.ncnn.param").exists():
        files["ncnn"] = {"param": str(PEER_FORMATS / f"{name}.ncnn.param"), "bin": str(PEER_FORMATS / f"{name}.ncnn.bin")}
    return files


def fma_pair_scaling() -> float:
    """2 x (time alone) / (time of the pair) of cpu_pair_scaling.py's FMA-bound workload, the median of 3: how
    far this machine's two CPUs run two threads of arithmetic side by side right now (2.0: two free cores)."""
    from cpu_pair_scaling import alone_and_paired, arithmetic_workloads

    fma = next(function for label, function in arithmetic_workloads().items() if label.startswith("FMA"))
    alone_and_paired(fma, fma, 1)                  # compiled, caches warm
    return float(np.median([2 * alone / pair for alone, pair in (alone_and_paired(fma, fma, 1) for _ in range(3))]))


def pair_state() -> tuple[float, float]:
    """(fma_pair_scaling(), cpu_pair_scaling.cache_line_round_trip()): the two CPUs right now."""
    from cpu_pair_scaling import cache_line_round_trip

    return fma_pair_scaling(), cache_line_round_trip()


def measure(rounds: int, models: list, runtimes: list, others_seen: list, retries: int, pair_states: list) -> dict:
    """{(model, runtime): [{"threads,batch": ms, ..., "others": cores}, ...] per round}, "others" the cores
    other processes used meanwhile; appends those to others_seen, and pair_state() at each round's start
    and after the last to pair_states."""
    results = {}
    with tempfile.TemporaryDirectory() as folder:
        files = {name: peer_files(name, Path(folder)) for name in models}
        for round_ in range(rounds):
            pair_states.append(pair_state())
            print(f"round {round_ + 1}: two threads of FMA arithmetic at {pair_states[-1][0]:.2f}x one thread's rate, "
                  f"a cache line's round trip between the CPUs {pair_states[-1][1]:.2f} us", flush=True)
            for name in models:
                for runtime in runtimes:
                    if runtime not in files[name]:
                        continue
                    done = quiet_run(name, runtime, files[name][runtime], retries)
                    if done is None:
                        print(f"round {round_ + 1} {name:12} {runtime:12} over {WORKER_SECONDS} s: left out", flush=True)
                        continue
                    done, others = done
                    others_seen.append(others)
                    result = json.loads(done.stdout.strip().splitlines()[-1])
                    result["others"] = others
                    results.setdefault((name, runtime), []).append(result)
                    print(f"round {round_ + 1} {name:12} {runtime:12} {results[(name, runtime)][-1]} "
                          f"(others: {others:.2f} cores)", flush=True)
        pair_states.append(pair_state())
    return results


def quiet_run(name: str, runtime: str, files: dict, retries: int):
    """(the worker's finished process, cores other processes used meanwhile): run again, up to `retries` more
    times, while others took more than QUIET_CORES (the quietest kept); None when it ran over WORKER_SECONDS."""
    best = None
    for _ in range(1 + retries):
        before, start = busy_seconds(), time.perf_counter()
        try:
            done = subprocess.run([sys.executable, __file__, "--worker", runtime, name, json.dumps(files)],
                                  capture_output=True, text=True, timeout=WORKER_SECONDS)
        except subprocess.TimeoutExpired:
            return best
        if done.returncode != 0:
            raise SystemExit(f"{runtime} on {name} failed:\n{done.stderr[-2000:]}")
        others = others_cores(before, busy_seconds(), time.perf_counter() - start)
        if best is None or others < best[1]:
            best = (done, others)
        if others <= QUIET_CORES:
            break
    return best


def quiet(rounds: list) -> list:
    """The rounds during which other processes took at most QUIET_CORES, or all of them when none was."""
    return [r for r in rounds if r["others"] <= QUIET_CORES] or rounds


def table(results: dict, models: list) -> list:
    rows = []
    for name in models:
        for threads, batch in CONFIGS:
            key = f"{threads},{batch}"
            ms = {runtime: float(np.median([r[key] for r in quiet(results[(name, runtime)])]))
                  for runtime in RUNTIMES if results.get((name, runtime))}
            peers = {runtime: v for runtime, v in ms.items() if runtime != "lnn"}
            cells = [f"{ms[runtime]:.3f}" if runtime in ms else "-" for runtime in RUNTIMES[1:]]
            best = min(peers, key=peers.get) if peers else None
            ratio = f"{ms['lnn'] / peers[best]:.2f} ({best})" if best else "-"
            rows.append([name, threads, batch, *cells, f"{ms['lnn']:.3f}", ratio])
    return rows


def scaling(results: dict, models: list) -> list:
    """lnn's 1-thread / 2-thread time at batch 1, per model (per quiet round, then the median; every round
    with the cores others took), and onnxruntime's beside it (the median of its quiet rounds)."""
    rows = []
    for name in models:
        speedups = [r["1,1"] / r["2,1"] for r in quiet(results[(name, "lnn")])]
        peer = [r["1,1"] / r["2,1"] for r in quiet(results.get((name, "onnxruntime"), []))]
        rows.append([name, f"{np.median(speedups):.2f}", f"{np.median(peer):.2f}" if peer else "-",
                     " ".join(f"{r['1,1'] / r['2,1']:.2f} ({r['others']:.2f}{one_thread_mark(r)})"
                              for r in results[(name, "lnn")])])
    return rows


def one_thread_mark(result: dict) -> str:
    """'; one thread' where the 2-thread process's backend had kept the one-thread plan (its split choice)."""
    return "; one thread" if "one thread" in result.get("split choice", "") else ""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--note", default="", help="a remark on the machine for the section")
    parser.add_argument("--models", default=",".join(MODELS), help=f"comma-separated, of {','.join(MODELS)}")
    parser.add_argument("--runtimes", default=",".join(RUNTIMES), help=f"comma-separated, of {','.join(RUNTIMES)} (lnn always)")
    parser.add_argument("--retries", type=int, default=2,
                        help=f"runs of a runtime's process more while other processes took over {QUIET_CORES} cores")
    parser.add_argument("--worker", nargs=3, metavar=("RUNTIME", "MODEL", "FILES"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        runtime, name, files = args.worker
        worker(runtime, name, json.loads(files))
        return
    if not PEER_FORMATS.exists():
        raise SystemExit(f"{PEER_FORMATS} is absent; this benchmark needs the reference models and their peer files")
    models = args.models.split(",")
    runtimes = ["lnn", *[r for r in args.runtimes.split(",") if r != "lnn"]]
    others_seen, pair_states = [], []
    results = measure(args.rounds, models, runtimes, others_seen, args.retries, pair_states)
    headers = ["model", "threads", "batch", "onnxruntime ms", "LiteRT ms", "ncnn ms", "lnn ms", "lnn / best peer"]
    rows = table(results, models)
    speed = scaling(results, models)
    speed_headers = ["model", "lnn speed-up (median of the quiet rounds)", "onnxruntime's", PER_ROUND]
    pairs = ("At the rounds' starts and after the last, two threads of FMA-bound arithmetic "
             "(benchmarks/cpu_pair_scaling.py's workload) ran at "
             f"{' / '.join(f'{scaling:.2f}' for scaling, _ in pair_states)}x one thread's rate (2.0: two free cores; "
             "on this VM from about 1.2, as if one core's two hardware threads, to 1.96, changing within seconds), "
             "and a cache line's round trip between the two CPUs took "
             f"{' / '.join(f'{trip:.2f}' for _, trip in pair_states)} µs (about 0.1 where they share a last-level "
             "cache; 0.4-0.5 on this VM in the minutes when they did not, and one-image splits ran slower then).")
    print(markdown_table(headers, rows))
    print(markdown_table(speed_headers, speed))
    print(pairs)
    if set(models) != set(MODELS) or set(runtimes) != set(RUNTIMES):
        print("a run of fewer models or runtimes: docs/BENCHMARKS.md left as it was", file=sys.stderr)
        return
    body = "\n\n".join([
        "## CPU runtimes side by side: lnn, onnxruntime, LiteRT, ncnn (one image over threads)",
        f"Command: `{COMMAND} --rounds {args.rounds} --models {args.models} --runtimes {','.join(runtimes)} --retries {args.retries}`. Machine: {machine_line(('numpy', 'numba', 'onnxruntime', 'ai-edge-litert', 'ncnn'))}."
        + (f" {args.note}" if args.note else ""),
        "Each runtime in its own process, median ms per call after warm-up, the median of "
        f"{args.rounds} interleaved rounds (of those during which other processes took at most {QUIET_CORES} "
        "of a core, where there are such rounds). lnn: `threads=N` splits one image's convs (by output channels "
        "or rows) and linear outputs over N threads (docs/ARCHITECTURE.md); ncnn has no batch axis (batch 32 = 32 calls); "
        "the tomato model has no LiteRT or ncnn file (onnxruntime runs its `lnn-export --onnx`). "
        f"Other processes' CPU during each process (/proc/stat): one is run again, up to {args.retries} more times, "
        f"while they took over {QUIET_CORES} of a core; during those kept, a median of "
        f"{np.median(others_seen):.2f} and at most {max(others_seen):.2f} cores.",
        markdown_table(headers, rows),
        "lnn at batch 1, 1 thread / 2 threads (the issue's target: >= 1.7 on leaf_cnn224 and tomato), onnxruntime's "
        "beside it:",
        markdown_table(speed_headers, speed),
        pairs,
    ])
    update_section("cpu_peers", body)
    print("wrote the cpu_peers section of docs/BENCHMARKS.md")


if __name__ == "__main__":
    main()
