"""Out-of-distribution gates side by side, and what the gate costs (issue 11).

    python benchmarks/ood_gate.py models/tomato_leaf.bin                      # the bundled model
    python benchmarks/ood_gate.py models/tomato_leaf.bin run_oe/model.bin     # and an outlier-exposure one

For each model: features of the tomato training split (statistics), the tomato validation split
(thresholds: each method keeps 97% of these photos) and the outlier folder's "test" part
(lnn.train.outliers.split_outliers; nothing is fitted or chosen on it), through the model's own
preprocessing on the Numba backend. Methods, each on that model's own outputs and penultimate
features: max softmax probability (msp), energy, class-conditional Mahalanobis with a shared
covariance (the shrinkages lnn-eval --fit-gate tries), kNN on unit-length features (k 1 and 5,
the bank is the training features), and, when the model carries a gate (lnn-eval --fit-gate
--write-gate), the model's whole decision as lnn-infer applies it (its gate and low-confidence
threshold, without the photo checks), and its whole answer as lnn-infer gives it (photo checks on the
decoded photo first; benchmarks/photo_checks.py measures those on the tomato photos). Reported per outlier
sub-folder and overall: AUROC (outliers against tomato validation photos) and the share of outliers
caught at the threshold keeping 97% of tomato validation photos; and the share of tomato validation
photos flagged.

Cost: batch-1 CPU time (Numba backend, one thread, median of --repeat round-robin runs on a real photo) of the
model alone (Session.run), with its gate (Session.judge: the feature copy + the gate's NumPy), and
the whole photo path (decode, preprocessing, model, gate: Session.predict_image) without and with the
photo checks.
Writes the "ood_gate" section of docs/BENCHMARKS.md unless --no-report.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "benchmarks"))
from report import SHARED, machine_line, markdown_table, update_section  # noqa: E402

SHARED_DATA = SHARED / "data"
KEEP = 0.97
FOLDERS = ("everyday", "plants_not_tomato", "textures_and_ground")


def auroc(inliers: np.ndarray, outliers: np.ndarray) -> float:
    """P(outlier score > inlier score), ties counted half (Mann-Whitney U)."""
    scores = np.concatenate([inliers, outliers])
    order = scores.argsort(kind="stable")
    ranks = np.empty(len(scores))
    ranks[order] = np.arange(1, len(scores) + 1)
    _, inverse, counts = np.unique(scores, return_inverse=True, return_counts=True)
    sums = np.bincount(inverse, ranks)
    ranks = (sums / counts)[inverse]                   # average ranks of ties
    n_out = len(outliers)
    return float((ranks[len(inliers):].sum() - n_out * (n_out + 1) / 2) / (n_out * len(inliers)))


def photo_sources(outlier_dir: Path, paths: list) -> list:
    """Each photo's source repository from the folder's manifest.csv ("?" without one)."""
    import csv

    manifest = outlier_dir / "manifest.csv"
    sources = {}
    if manifest.exists():
        with open(manifest, newline="", encoding="utf-8") as f:
            sources = {row["path"]: row["source_repo"] for row in csv.DictReader(f)}
    return [sources.get(p.relative_to(outlier_dir).as_posix(), "?") for p in paths]


def by_source(path: str, data: dict) -> list:
    """[model, sub-folder, source, photos, caught as lnn-infer answers] for a gated model."""
    session = data["session"]
    if "test_photo_reasons" not in data:
        return []
    test_logits, test_features, groups = data["test"]
    reasons = session.judge_rules.judge(test_logits, test_features, data["test_photo_reasons"]).reasons
    answered = np.array([r is not None for r in reasons])
    sources = np.array(data["test_sources"])
    rows = []
    for group in FOLDERS:
        for source in sorted(set(sources[groups == group])):
            chosen = (groups == group) & (sources == source)
            rows.append([Path(path).name, group, source, int(chosen.sum()), f"{answered[chosen].mean():.1%}"])
    return rows


def model_features(path: str, tomato_dir: Path, outlier_dir: Path, batch: int) -> dict:
    from lnn.runtime import Session
    from lnn.formats.binfile import read_bin
    from lnn.tools.eval import input_batches, path_batches
    from lnn.train.gate_fit import default_feature_node, extract
    from lnn.train.images import ImageFolder
    from lnn.train.outliers import split_outliers

    bin_model = read_bin(path)
    feature = (bin_model.metadata.get("gate") or {}).get("feature") or default_feature_node(bin_model.model)
    session = Session(bin_model, "cpu", features=feature)
    folder = ImageFolder.load(tomato_dir, session.model.input_shape, session.model.preprocess["color"],
                              log=lambda message: print(message, file=sys.stderr))
    names = [label["name"] for label in session.labels]
    columns = np.array([names.index(c) for c in folder.classes])
    train_rows, val_rows = folder.split()
    out = {"session": session, "feature": feature}
    for name, rows in (("train", train_rows), ("val", val_rows)):
        logits, features = extract(session, input_batches(session, folder.data.images[rows], batch), len(rows), name)
        out[name] = (logits, features, columns[folder.labels[rows]])
    test = split_outliers(outlier_dir)["test"]
    skipped: list = []
    logits, features = extract(session, path_batches(session, test, batch, skipped), len(test), "outlier test")
    kept_paths = [p for p in test if not any(str(p) in message for message in skipped)]
    out["test"] = (logits, features, np.array([p.relative_to(outlier_dir).parts[0] for p in kept_paths]))
    out["test_sources"] = photo_sources(outlier_dir, kept_paths)
    if session.judge_rules.photo_checks is not None:       # as lnn-infer sees them: on the decoded photo
        from lnn.runtime.preprocess import read_image

        out["test_photo_reasons"] = [session.check_photo(read_image(p)).reason for p in kept_paths]
    return out


def compare(path: str, data: dict) -> list:
    """Rows: [model, method, AUROC per folder and overall, caught per folder and overall, tomato flagged]."""
    from lnn.train.gate_fit import candidates, common_thresholds, flags

    session = data["session"]
    train_logits, train_features, train_labels = data["train"]
    val_logits, val_features, val_labels = data["val"]
    test_logits, test_features, groups = data["test"]
    logits_available = not session.outputs_probabilities
    temperature = session.judge_rules.temperature
    rows = []
    for candidate in candidates(train_features, train_labels, len(session.labels), logits_available):
        val = candidate.compute(val_logits, val_features, temperature, not logits_available)
        test = candidate.compute(test_logits, test_features, temperature, not logits_available)
        thresholds = common_thresholds(val, KEEP)
        caught = flags(test, thresholds)
        single = len(candidate.scores) == 1
        aurocs = [auroc(val[candidate.scores[0]], test[candidate.scores[0]][groups == g]) if single else None
                  for g in FOLDERS] + ([auroc(val[candidate.scores[0]], test[candidate.scores[0]])] if single else [None])
        rows.append([Path(path).name, candidate.name, *aurocs, *[caught[groups == g].mean() for g in FOLDERS],
                     caught.mean(), flags(val, thresholds).mean()])
    if session.judge_rules.gate is not None:
        judge = session.judge_rules
        test_flagged = np.array([r is not None for r in judge.judge(test_logits, test_features).reasons])
        val_flagged = np.array([r is not None for r in judge.judge(val_logits, val_features).reasons])
        name = f"**the model's own decision** ({' + '.join(judge.gate['scores'])}, low confidence)"
        rows.append([Path(path).name, name, None, None, None, None,
                     *[test_flagged[groups == g].mean() for g in FOLDERS], test_flagged.mean(), val_flagged.mean()])
    if "test_photo_reasons" in data:
        reasons = session.judge_rules.judge(test_logits, test_features, data["test_photo_reasons"]).reasons
        answered = np.array([r is not None for r in reasons])
        checks = np.array([r is not None for r in data["test_photo_reasons"]])
        rows.append([Path(path).name, f"**as lnn-infer answers** (photo checks: {checks.mean():.1%} of these; "
                                      "then the gate and low confidence)", None, None, None, None,
                     *[answered[groups == g].mean() for g in FOLDERS], answered.mean(), None])
    return rows


def calibration_row(path: str, data: dict) -> list:
    """[model, temperature, ECE at T = 1, ECE at the model's T, accuracy] on the tomato validation photos."""
    from lnn.runtime.gate import softmax
    from lnn.train.gate_fit import expected_calibration_error

    logits, _, labels = data["val"]
    judge = data["session"].judge_rules
    if judge.outputs_probabilities:
        return [Path(path).name, "-", f"{expected_calibration_error(logits, labels):.2%}", "-",
                f"{(logits.argmax(1) == labels).mean():.2%}"]
    return [Path(path).name, f"{judge.temperature:g}", f"{expected_calibration_error(softmax(logits), labels):.2%}",
            f"{expected_calibration_error(softmax(logits, judge.temperature), labels):.2%}",
            f"{(logits.argmax(1) == labels).mean():.2%}"]


def batch1_cost(path: str, photo: Path, repeat: int) -> list:
    """[(what, median ms)] at batch 1 on the cpu backend with one BLAS thread."""
    from lnn.formats.binfile import read_bin
    from lnn.runtime import Session
    from lnn.train.gate_fit import default_feature_node

    bin_model = read_bin(path)
    metadata = bin_model.metadata
    without_gate = {key: value for key, value in metadata.items() if key != "gate"}
    without_checks = ({**metadata, "gate": {k: v for k, v in metadata["gate"].items() if k != "photo_checks"}}
                      if "gate" in metadata else metadata)
    feature = (metadata.get("gate") or {}).get("feature") or default_feature_node(bin_model.model)
    plain = Session(dataclasses.replace(bin_model, metadata=without_gate), "cpu", threads=1)   # no feature kept
    gated = Session(bin_model, "cpu", threads=1, features=feature)
    unchecked = Session(dataclasses.replace(bin_model, metadata=without_checks), "cpu", threads=1, features=feature)
    x = plain.prepare_image(photo)[None]
    variants = [("model alone (Session.run)", lambda: plain.run(x)),
                ("model + gate (Session.judge)", lambda: gated.judge(x)),
                ("photo file -> answer without photo checks (decode, preprocessing, model, gate)",
                 lambda: unchecked.predict_image(photo)),
                ("photo file -> answer with photo checks (Session.predict_image)", lambda: gated.predict_image(photo))]
    for _, call in variants:                  # compile, warm up
        call()
        call()
    times = [[] for _ in variants]
    for _ in range(repeat):                   # round robin: a busy moment of the machine hits every variant alike
        for column, (_, call) in zip(times, variants):
            call()                            # untimed: the caches hold this variant's data, not the last one's
            start = time.perf_counter()
            call()
            column.append(time.perf_counter() - start)
    return [(what, 1e3 * float(np.median(column))) for (what, _), column in zip(variants, times)]


def percent(value) -> str:
    return "-" if value is None else f"{value:.1%}"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("models", nargs="+", help="image models (.bin): the bundled one, an outlier-exposure one, ...")
    parser.add_argument("--tomato-dir", default=str(SHARED_DATA / "tomato"))
    parser.add_argument("--outliers-dir", default=str(SHARED_DATA / "outliers"))
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--repeat", type=int, default=200, help="timed batch-1 runs per variant")
    parser.add_argument("--no-report", action="store_true", help="print only, do not touch docs/BENCHMARKS.md")
    parser.add_argument("--note", default="", help="a sentence for the section (which model is which, how busy the machine was)")
    args = parser.parse_args(argv)
    started = time.perf_counter()
    rows, costs, knn_sizes, calibration, sources = [], [], [], [], []
    photo = REPO / "examples" / "leaves" / "late_blight.jpg"
    for path in args.models:
        data = model_features(path, Path(args.tomato_dir), Path(args.outliers_dir), args.batch)
        rows += compare(path, data)
        calibration.append(calibration_row(path, data))
        sources += by_source(path, data)
        train_features = data["train"][1]
        knn_sizes.append(f"{Path(path).name}: {len(train_features)} x {train_features.shape[1]} float32 = "
                         f"{train_features.nbytes / 2 ** 20:.1f} MiB of training features in the .bin "
                         f"(Mahalanobis: {(10 + train_features.shape[1]) * train_features.shape[1] * 4 / 2 ** 20:.2f} MiB)")
        cost = batch1_cost(path, photo, args.repeat)
        base = cost[0][1]
        costs += [[Path(path).name, what, f"{ms:.2f}", f"{ms / base - 1:+.1%}" if i else "-"]
                  for i, (what, ms) in enumerate(cost)]
        costs.append([Path(path).name, "the photo checks alone (difference of the last two)",
                      f"{cost[3][1] - cost[2][1]:.2f}", ""])
    headers = ["model", "method", *[f"AUROC {g}" for g in FOLDERS], "AUROC all",
               *[f"caught {g}" for g in FOLDERS], "caught all", "tomato val flagged"]
    table = markdown_table(headers, [[row[0], row[1], *[("-" if v is None else f"{v:.3f}") for v in row[2:6]],
                                      *[percent(v) for v in row[6:]]] for row in rows])
    cost_table = markdown_table(["model", "batch 1, cpu backend, 1 thread", "median ms", "vs model alone"], costs)
    calibration_table = markdown_table(["model", "temperature (metadata.calibration)", "ECE, 15 bins, T = 1",
                                        "ECE at the model's T", "top-1 accuracy"], calibration)
    source_table = markdown_table(["model", "sub-folder", "source (manifest.csv)", "test photos",
                                   "uncertain as lnn-infer answers"], sources)
    print(table + "\n\n" + source_table + "\n\n" + cost_table + "\n\n" + calibration_table + "\n\n"
          + "\n".join(knn_sizes))
    if not args.no_report:
        from lnn.train.outliers import split_outliers

        test = split_outliers(args.outliers_dir)["test"]
        counts = ", ".join(f"{g} {sum(1 for p in test if p.relative_to(args.outliers_dir).parts[0] == g)}"
                           for g in FOLDERS)
        body = (f"## Out-of-distribution gate: methods side by side, and its cost\n\n"
                f"`python benchmarks/ood_gate.py {' '.join(args.models)}`; {machine_line(('numpy', 'numba'))}; "
                f"{time.perf_counter() - started:.0f} s. {args.note}\n\n"
                f"Thresholds keep {KEEP:.0%} of the tomato validation photos (split_by_leaf, seed 0); statistics from "
                f"the tomato training split; figures on the outlier test part only ({len(test)} photos: {counts}). "
                f"\"caught\" = share of outlier test photos flagged at that threshold.\n\n{table}\n\n"
                f"By source (PlantVillage lab leaves of other plants are the hardest):\n\n{source_table}\n\n"
                f"kNN's bank: {'; '.join(knn_sizes)}.\n\nGate cost (real photo, "
                f"`examples/leaves/late_blight.jpg`; medians of {args.repeat} round-robin runs of each variant, each timed right after an untimed run of itself):\n\n"
                f"{cost_table}\n\nCalibration on the {len(data['val'][2])} tomato validation photos (the temperature "
                f"was fitted on them by lnn-eval --fit-gate; lnn-eval prints the same figures):\n\n{calibration_table}")
        update_section("ood_gate", body)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
