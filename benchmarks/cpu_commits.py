"""lnn's Numba backend at other commits beside this tree and onnxruntime: is a change a regression?

    python benchmarks/cpu_commits.py --commits 8ad3066,d198238 [--rounds 5] [--models leaf_cnn,tomato]
                                                         (about 2 minutes per round for 4 models)

Each commit is checked out into a temporary git worktree (removed afterwards) and imported from there
as `lnn`; "this tree" is the working tree the script runs from. For each model, round and runtime one
fresh process measures batch 1 at 1 and 2 threads (median ms per call after warm-up, on random-normal
inputs, as benchmarks/cpu_peers.py does); the rounds interleave every commit and onnxruntime, so a
busy machine slows them alike, and each figure is the median of the rounds, with their range and the
ratio to onnxruntime's median. The reference models are built from each tree's own
examples/reference/*.json and ../shared/reference_models weights; the bundled tomato model is this
tree's models/tomato_leaf.bin (a commit that cannot read it is left out of that row). Writes the
"cpu_commits" section of docs/BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "benchmarks"))
from cpu_peers import BUNDLED, REFERENCE_MODELS, median_ms, onnxruntime_runner, peer_files, random_input  # noqa: E402
from report import machine_line, markdown_table, update_section  # noqa: E402

MODELS = ["leaf_cnn", "mnist_cnn", "tomato", "leaf_cnn224"]
THREADS = [1, 2]
THIS_TREE = "this tree"
COMMAND = "python benchmarks/cpu_commits.py"


def lnn_worker(parent: str, name: str) -> dict:
    """In its own process, with `parent` first on sys.path (it holds `lnn`, a tree): {threads: ms}."""
    sys.path.insert(0, parent)
    from lnn.formats.model import load_model
    from lnn.runtime.cpu import BACKEND

    if name == "tomato":
        from lnn.formats.binfile import read_bin

        bin_model = read_bin(BUNDLED)
        model, weights = bin_model.model, bin_model.weights_fp32()
    else:
        model = load_model(Path(parent) / "lnn" / "examples" / "reference" / f"{name}.json")
        weights = dict(np.load(REFERENCE_MODELS / f"{name}.weights.npz"))
    x = random_input((1, *model.input_shape))
    results = {}
    for threads in THREADS:
        backend = BACKEND(model, weights, threads=threads)
        results[threads] = median_ms(lambda: backend.run(x))
    return results


def onnxruntime_worker(name: str, files: dict) -> dict:
    return {threads: median_ms(onnxruntime_runner(name, threads, 1, files)) for threads in THREADS}


def trees(commits: list, folder: Path) -> dict:
    """{label: a folder holding `lnn`}: each commit's worktree, and this tree."""
    parents = {}
    for commit in commits:
        worktree = folder / f"tree-{commit}"
        subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", str(worktree), commit],
                       check=True, capture_output=True)
        parent = folder / f"import-{commit}"
        parent.mkdir()
        (parent / "lnn").symlink_to(worktree)
        parents[commit] = str(parent)
    parent = folder / "import-this"
    parent.mkdir()
    (parent / "lnn").symlink_to(REPO)
    parents[THIS_TREE] = str(parent)
    return parents


def measure(parents: dict, models: list, rounds: int, folder: Path) -> dict:
    """{(model, label): [{threads: ms}, ...] per round}; label "onnxruntime" for the peer."""
    files = {name: peer_files(name, folder)["onnxruntime"] for name in models}
    results = {}
    for round_ in range(rounds):
        for name in models:
            for label, argument in [*parents.items(), ("onnxruntime", json.dumps(files[name]))]:
                done = subprocess.run([sys.executable, __file__, "--worker", label, argument, name],
                                      capture_output=True, text=True, timeout=300)
                if done.returncode != 0:
                    print(f"round {round_ + 1} {name:12} {label:12} failed: {done.stderr.strip().splitlines()[-1:]}")
                    continue
                result = {int(k): v for k, v in json.loads(done.stdout.strip().splitlines()[-1]).items()}
                results.setdefault((name, label), []).append(result)
                print(f"round {round_ + 1} {name:12} {label:12} {result}", flush=True)
    return results


def table(results: dict, labels: list, models: list) -> list:
    rows = []
    for name in models:
        for threads in THREADS:
            peer = results.get((name, "onnxruntime"))
            peer_ms = float(np.median([r[threads] for r in peer])) if peer else None
            for label in [*labels, "onnxruntime"]:
                runs = [r[threads] for r in results.get((name, label), [])]
                if not runs:
                    continue
                ms = float(np.median(runs))
                ratio = f"{ms / peer_ms:.2f}" if peer_ms and label != "onnxruntime" else "-"
                rows.append([name, threads, label, f"{ms:.3f}", f"{min(runs):.3f}-{max(runs):.3f}", ratio])
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--commits", help="comma-separated git revisions to set beside this tree (required)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--models", default=",".join(MODELS), help=f"comma-separated, of {','.join(MODELS)}")
    parser.add_argument("--note", default="", help="a remark on the machine for the section")
    parser.add_argument("--worker", nargs=3, metavar=("LABEL", "ARGUMENT", "MODEL"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        label, argument, name = args.worker
        result = onnxruntime_worker(name, json.loads(argument)) if label == "onnxruntime" else lnn_worker(argument, name)
        print(json.dumps(result))
        return
    if not args.commits:
        parser.error("--commits is required: the git revisions to set beside this tree")
    if not REFERENCE_MODELS.exists():
        raise SystemExit(f"{REFERENCE_MODELS} is absent; this benchmark needs the reference models")
    commits, models = args.commits.split(","), args.models.split(",")
    with tempfile.TemporaryDirectory(prefix="lnn-commits-") as folder:
        try:
            parents = trees(commits, Path(folder))
            results = measure(parents, models, args.rounds, Path(folder))
        finally:
            for commit in commits:
                subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(Path(folder) / f"tree-{commit}")],
                               capture_output=True)
    if not any(label == THIS_TREE for _, label in results):
        raise SystemExit("cpu_commits: this tree ran no model; nothing written (see the failures above)")
    labels = [*commits, THIS_TREE]
    headers = ["model", "threads", "lnn at", "median ms", "range over rounds", "/ onnxruntime"]
    rows = table(results, labels, models)
    print(markdown_table(headers, rows))
    body = "\n\n".join([
        "## lnn's CPU backend at earlier commits, beside onnxruntime (batch 1)",
        f"Command: `{COMMAND} --commits {args.commits} --rounds {args.rounds} --models {args.models}`. "
        f"Machine: {machine_line(('numpy', 'numba', 'onnxruntime'))}." + (f" {args.note}" if args.note else ""),
        "Each commit imported from its own worktree, each (model, commit) and onnxruntime in its own process, "
        f"{args.rounds} interleaved rounds; median ms per call at batch 1 after warm-up, the median of the "
        "rounds and their range; the last column is lnn's median over onnxruntime's in the same rounds.",
        markdown_table(headers, rows),
    ])
    update_section("cpu_commits", body)
    print("wrote the cpu_commits section of docs/BENCHMARKS.md")


if __name__ == "__main__":
    main()
