"""lnn-bench: how fast a model runs here, per backend (in the manner of LiteRT's benchmark_model).

    lnn-bench models/tomato_leaf.bin
    lnn-bench model.bin --device numpy,cpu --batch 8 --threads 2 --runs 200
    lnn-bench model.bin --profile              # also the time of each layer (numpy: each node; cpu: each fused layer)
    lnn-bench model.bin --cold --json          # first call with an empty kernel cache; one JSON object

Each backend runs in a process of its own (so its load time, first call and peak memory are its own):
  load     reading and checking the .bin and preparing the backend (importing it included: Numba's ~0.5 s)
  first    the first call, which on the cpu backend compiles its kernels or loads them from the per-user
           cache (said as "not cached yet", "from the cache", or "ahead of time" for the packaged kernels);
           --cold gives that process an empty cache, so the first call compiles everything
  warm     --runs calls after --warmup calls, at --batch and --threads: median (p50), p90, p99 and mean
           (on the cpu backend with threads, the warm-up lasts at least until it has timed its split plan
           against one thread and chosen: its first dozen calls of a batch size)
  peak RSS the process's peak resident memory at the end
  threads  what the backend ran on, read after the timed calls: its thread count and, on the cpu backend
           with threads, its choice for this batch size (split over the threads, or one thread), which it
           times again at growing intervals: the timed calls include those turns, and may have run both
The inputs are real: the model's own test vectors (lnn-export stores them), repeated to fill the batch,
or --images (photos or a folder, preprocessed as the model says); never zeros. A model with neither is
refused. A backend that cannot load here is reported as an error for that backend (exit status 1).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from lnn.formats.errors import LnnInputError
from lnn.tools.cli import command_parser, error_line, human_bytes, run_command

PROG = "lnn-bench"
DEVICES = ("numpy", "cpu", "cuda")
MAX_BATCH = 4096
MAX_RUNS = 1_000_000
PROFILE_REPEATS = 20                      # whole runs whose per-layer times are taken (the median is shown)


def build_parser():
    parser = command_parser(PROG, __doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1])
    parser.add_argument("model", metavar="MODEL.bin", help="the model to measure")
    parser.add_argument("--device", default="numpy,cpu", help="backends to compare, comma-separated: numpy, cpu, cuda "
                                                             "(default numpy,cpu)")
    parser.add_argument("--batch", type=int, default=1, help="inputs per call (default 1)")
    parser.add_argument("--threads", type=int, help="the cpu backend's threads (default: its own choice)")
    parser.add_argument("--runs", type=int, default=100, help="timed calls (default 100)")
    parser.add_argument("--warmup", type=int, default=5, help="untimed calls after the first (default 5)")
    parser.add_argument("--images", nargs="+", metavar="PHOTO|DIR", help="photos to use as inputs instead of the test vectors")
    parser.add_argument("--profile", action="store_true", help="also time each layer (numpy and cpu)")
    parser.add_argument("--cold", action="store_true", help="run the first call with an empty kernel cache")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    parser.add_argument("--measure", metavar="DEVICE", help=argparse.SUPPRESS)   # one backend, in this process
    return parser


def check_args(args) -> list:
    """The backends asked for; one LnnInputError line for any bad option."""
    devices = [name.strip() for name in args.device.split(",")]
    unknown = [name for name in devices if name not in DEVICES]
    if unknown or len(set(devices)) != len(devices):
        raise LnnInputError(f"--device takes distinct names out of {', '.join(DEVICES)}, comma-separated; "
                            f"not {args.device!r}")
    for name, value, low, high in (("--batch", args.batch, 1, MAX_BATCH), ("--runs", args.runs, 1, MAX_RUNS),
                                   ("--warmup", args.warmup, 0, MAX_RUNS)):
        if not low <= value <= high:
            raise LnnInputError(f"{name} must be {low} to {high:,}, not {value}")
    if args.threads is not None and args.threads < 1:
        raise LnnInputError(f"--threads must be a positive whole number, not {args.threads}")
    if args.profile and "cuda" in devices:
        raise LnnInputError("--profile times layers on numpy and cpu only (not cuda)")
    return devices


def model_inputs(bin_model, images, batch: int) -> tuple:
    """(a batch of real inputs [batch, *input_shape] float32, what they are in words)."""
    import numpy as np

    if images:
        from lnn.runtime.vectors import photo_inputs
        from lnn.tools.export import photo_paths

        inputs, what = photo_inputs(bin_model.model, photo_paths(images))
    elif bin_model.test_vectors is not None:
        inputs = bin_model.test_vectors[0]
        what = f"the model's {len(inputs)} test vector(s) ({bin_model.metadata['test_vectors']['inputs']})"
    else:
        raise LnnInputError(f"{bin_model.path} has no test vectors to run: give photos with --images, or re-export "
                            f"it with lnn-export to add them")
    rows = np.arange(batch) % len(inputs)
    return np.ascontiguousarray(inputs[rows], np.float32), what


def percentiles(seconds: list) -> dict:
    import numpy as np

    ms = np.asarray(seconds) * 1e3
    return {"p50_ms": float(np.percentile(ms, 50)), "p90_ms": float(np.percentile(ms, 90)),
            "p99_ms": float(np.percentile(ms, 99)), "mean_ms": float(ms.mean()), "min_ms": float(ms.min())}


def peak_rss_bytes() -> int | None:
    """This process's peak resident memory. On Linux, VmHWM of its own address space: getrusage's ru_maxrss also
    takes in the address space it was started from (the kernel records the parent's peak at exec), so a process
    started by a big one (a test runner) would report its parent's peak."""
    try:
        with open("/proc/self/status", encoding="ascii") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        import resource
    except ImportError:                   # Windows
        return None
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)     # bytes on macOS, KiB elsewhere


def kernel_state(session) -> str | None:
    """How the cpu backend's first call gets its kernels, asked before it is made."""
    if session.device != "cpu":
        return None
    from lnn.runtime.cpu import cache, jit

    if jit.KERNELS == "aot":
        return "ahead of time"
    if not jit.CACHE_ENABLED:
        return "compiled (no cache)"
    return "from the cache" if cache.kernels_cached(session.model) else "not cached yet"


def measure(args) -> dict:
    """One backend in this process: load, first call, warm percentiles, peak RSS, and the profile."""
    from lnn.formats.binfile import read_bin
    from lnn.runtime import Session

    start = time.perf_counter()
    bin_model = read_bin(args.model)
    options = {"threads": args.threads} if args.threads is not None and args.measure == "cpu" else {}
    session = Session(bin_model, args.measure, **options)
    load = time.perf_counter() - start
    x, _ = model_inputs(bin_model, args.images, args.batch)
    kernels = kernel_state(session)
    start = time.perf_counter()
    session.run(x)
    first = time.perf_counter() - start
    for _ in range(args.warmup):
        session.run(x)
    session.warm_up(len(x))               # the cpu backend's program and split choice made before the timed calls
    seconds = []
    for _ in range(args.runs):
        start = time.perf_counter()
        session.run(x)
        seconds.append(time.perf_counter() - start)
    result = {"load_ms": load * 1e3, "first_ms": first * 1e3, "kernels": kernels, **percentiles(seconds),
              "peak_rss_bytes": peak_rss_bytes(), "threads": session.describe_threads()}
    if args.profile:
        layers = session.backend.profile(x, min(PROFILE_REPEATS, args.runs))
        result["profile"] = [{"layer": name, "kind": kind, "ms": seconds * 1e3, "threads": threads}
                             for name, kind, seconds, threads in layers]
    return result


def measure_in_child(args, device: str) -> dict:
    """Run `measure` for one backend in a fresh process: its result, or {"error": its one line}."""
    argv = [sys.executable, "-m", "lnn.tools.bench", args.model, "--measure", device, "--batch", str(args.batch),
            "--runs", str(args.runs), "--warmup", str(args.warmup)]
    argv += (["--threads", str(args.threads)] if args.threads else []) + (["--profile"] if args.profile else [])
    argv += ["--images", *args.images] if args.images else []
    env = dict(os.environ)
    with tempfile.TemporaryDirectory(prefix="lnn-bench-") as empty:
        if args.cold:
            env.update(LNN_CACHE_DIR=empty, NUMBA_CACHE_DIR=str(Path(empty) / "numba"))
        done = subprocess.run(argv, capture_output=True, text=True, env=env)
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or [f"exit status {done.returncode}"])[-1]
        return {"error": last.removeprefix(f"{PROG}: error: ")}
    return json.loads(done.stdout.strip().splitlines()[-1])


def print_table(report: dict) -> None:
    print(f"{report['model']}: batch {report['batch']}, threads {report['threads'] or 'default'}, "
          f"{report['runs']} timed calls after {report['warmup']}; inputs: {report['inputs']}")
    print(f"{'device':7} {'load ms':>8} {'first ms':>9}  {'kernels':15} {'p50 ms':>8} {'p90 ms':>8} {'p99 ms':>8} "
          f"{'mean ms':>8} {'peak RSS':>10}")
    for device, row in report["devices"].items():
        if "error" in row:
            print(f"{device:7} error: {row['error']}")
            continue
        rss = human_bytes(row["peak_rss_bytes"]) if row["peak_rss_bytes"] else "?"
        print(f"{device:7} {row['load_ms']:8.1f} {row['first_ms']:9.1f}  {row['kernels'] or '-':15} "
              f"{row['p50_ms']:8.3f} {row['p90_ms']:8.3f} {row['p99_ms']:8.3f} {row['mean_ms']:8.3f} {rss:>10}")
    for device, row in report["devices"].items():
        if "threads" in row:
            print(f"{device:7} {row['threads']}")
    for device, row in report["devices"].items():
        if "profile" not in row:
            continue
        total = sum(layer["ms"] for layer in row["profile"]) or 1.0
        split = any((layer["threads"] or 1) > 1 for layer in row["profile"])
        print(f"\n{device}: time per layer (median of {min(PROFILE_REPEATS, report['runs'])} runs"
              + ("; threads: the layer's work split over that many, as in the timed calls)" if split else ")"))
        for layer in row["profile"]:
            threads = f"{layer['threads']:>3}" if split else ""
            print(f"  {layer['ms']:9.3f} ms {layer['ms'] / total:6.1%} {threads} {layer['kind']:15} {layer['layer']}")


def body(args) -> int:
    devices = check_args(args)
    if args.measure:
        print(json.dumps(measure(args), allow_nan=False))
        return 0
    from lnn.formats.binfile import read_bin

    _, what = model_inputs(read_bin(args.model), args.images, args.batch)     # a bad file or input: one line, now
    report = {"model": args.model, "batch": args.batch, "threads": args.threads, "runs": args.runs,
              "warmup": args.warmup, "cold": args.cold, "inputs": what,
              "devices": {device: measure_in_child(args, device) for device in devices}}
    errors = [f"{device}: {row['error']}" for device, row in report["devices"].items() if "error" in row]
    if args.json:
        print(json.dumps(report, allow_nan=False))
    else:
        print_table(report)
    for line in errors:
        error_line(PROG, line)
    return 1 if errors else 0


def main(argv=None) -> int:
    return run_command(build_parser(), body, argv)


if __name__ == "__main__":
    sys.exit(main())
