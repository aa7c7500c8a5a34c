"""lnn-eval: accuracy, per-class precision, recall and F1, and a confusion matrix of a .bin model on an image folder.

    lnn-eval models/tomato_leaf.bin --data folder:data/tomato               # the validation side of lnn-train's split
    lnn-eval model.bin --data folder:field_photos --split all --out eval/   # every photo; files in eval/
    lnn-eval model.bin --data folder:data/tomato --choose-threshold --write-threshold model_with_threshold.bin
    lnn-eval model.bin --data ucr:data/ucr/GunPoint --split test --out eval/    # a UCR/UEA dataset's NAME_TEST
    lnn-eval model.bin --data csv:table.csv --target state                   # the validation rows of lnn-train's split

Series (ucr:DIR, --split test or train) and tables (csv:FILE --target COLUMN, --split val or all: the
same per-class split as lnn-train, seed 0, --val-fraction 0.2) go through the model's own preprocessing
(raw values in); --out writes the same files, predictions.csv by line (series) or row (tables).

The folder holds one sub-folder per class, named like the model's labels (their `name`). With
--split val (the default) only the validation side of the split lnn-train made is evaluated: the
same leaf-grouped, per-class split of the same files (--seed and --val-fraction must match the
training run; both default to lnn-train's). --split all evaluates every photo (a separate test folder).
Images come from the same decoded cache lnn-train uses, with the model's own preprocessing.

--out DIR writes confusion.csv and confusion.png (rows: true class, columns: predicted; counts),
predictions.csv (one row per photo) and metrics.json.

--choose-threshold picks the confidence below which lnn-infer answers "uncertain" instead of
guessing. Rule: the largest threshold that keeps at least --keep (default 99%) of the correctly
classified evaluated photos at or above it, i.e. at most 1% of right answers are turned into
"uncertain". Choose it on validation photos (the default split), never on training photos.
--write-threshold OUT.bin writes a copy of the model whose metadata carries it as
{"thresholds": {"uncertain_below": t, "rule": "..."}} (lnn-infer reads uncertain_below); when the
model has a model card, its "accuracy" becomes this evaluation (figure, photos, the command).

Calibration: the expected calibration error (ECE, 15 bins) is printed for the raw softmax and, when
the model carries a temperature (metadata.calibration), for the calibrated probabilities too (images,
series and tables alike); metrics.json (--out) holds the one of the probabilities the model gives.

--fit-gate fits the out-of-distribution gate and the calibration (lnn/train/gate_fit.py) and
--write-gate OUT.bin writes the model with them (metadata gate, calibration, thresholds; tensors
gate.*; formats/SPEC.md rules G1-G8):
    lnn-eval model.bin --data folder:DIR --outliers OUTLIER_DIR --fit-gate --write-gate gated.bin
Features of the training split give the statistics; on the validation split the temperature is fitted
(minimum NLL) and the thresholds chosen so that the whole decision keeps --gate-keep (97.5%) of the
photos, --confidence-share (1%) of them at most under the low-confidence threshold; the candidate
gates (max softmax, energy, Mahalanobis, kNN and pairs) are compared on the "validation" part of
the outlier folder (lnn.train.outliers.split_outliers) only. Its "test" part is left for
benchmarks/ood_gate.py. The photo checks' thresholds (lnn/runtime/photo_checks.py DEFAULTS) are
stored with the gate.
"""

from __future__ import annotations

import csv
import json
import math
import sys
from pathlib import Path

import numpy as np

from lnn.formats.binfile import atomic_output, refuse_writing_over_inputs, write_atomic
from lnn.formats.errors import LnnError, LnnInputError, one_line
from lnn.formats.gate import subject_problem
from lnn.tools.cli import command_parser, run_command

PROG = "lnn-eval"
DEFAULT_KEEP = 0.99


def build_parser():
    from lnn.train.gate_fit import DEFAULT_CONFIDENCE_SHARE, DEFAULT_GATE_KEEP

    parser = command_parser(PROG, __doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1])
    parser.add_argument("model", metavar="MODEL.bin", help="the model to evaluate")
    parser.add_argument("--data", required=True, metavar="KIND:PATH",
                        help="folder:DIR (an image folder, one sub-folder per class), ucr:DIR (a UCR/UEA dataset) "
                             "or csv:FILE (a table, with --target)")
    parser.add_argument("--split", choices=("val", "all", "test", "train"), default="val",
                        help="val: the validation side of lnn-train's split (default); all: every photo or row; "
                             "test, train: a ucr: dataset's NAME_TEST or NAME_TRAIN")
    parser.add_argument("--target", metavar="COLUMN", help="csv: the column holding the class")
    parser.add_argument("--seed", type=int, default=None, help="seed of the split (lnn-train's: 0)")
    parser.add_argument("--val-fraction", type=float, default=None, help="validation share per class (lnn-train's: 0.2)")
    parser.add_argument("--device", default="auto", choices=("auto", "cpu", "numpy", "cuda"),
                        help="backend: cpu (Numba), numpy, cuda; auto: cpu when Numba is installed")
    parser.add_argument("--batch", type=int, default=64, help="images per forward pass")
    parser.add_argument("--out", metavar="DIR", help="write confusion.csv, confusion.png, predictions.csv, metrics.json")
    parser.add_argument("--choose-threshold", action="store_true", help="choose the uncertainty threshold (see below)")
    parser.add_argument("--keep", type=float, default=DEFAULT_KEEP,
                        help="share of correct answers the threshold keeps (default 0.99)")
    parser.add_argument("--write-threshold", metavar="OUT.bin", help="write a copy of the model with the threshold")
    gate = parser.add_argument_group("out-of-distribution gate and calibration")
    gate.add_argument("--fit-gate", action="store_true", help="fit the gate and the temperature (see below)")
    gate.add_argument("--outliers", metavar="DIR", help="photos that are not the model's subject (their validation part "
                                                       "chooses the gate)")
    gate.add_argument("--write-gate", metavar="OUT.bin", help="write a copy of the model with the fitted gate")
    gate.add_argument("--gate-keep", type=float, default=DEFAULT_GATE_KEEP,
                      help=f"share of validation photos the whole decision keeps (default {DEFAULT_GATE_KEEP}: half "
                           f"a point of margin, so that new photos of the same kind stay under 3%% refused)")
    gate.add_argument("--confidence-share", type=float, default=DEFAULT_CONFIDENCE_SHARE,
                      help=f"at most this share of validation photos under the low-confidence threshold "
                           f"(default {DEFAULT_CONFIDENCE_SHARE})")
    gate.add_argument("--feature", metavar="NODE", help="the node whose output the gate uses (default: the "
                                                        "penultimate vector, e.g. the global average pool)")
    gate.add_argument("--subject", help="what the photos should show, for the answer's words (e.g. 'tomato leaf')")
    gate.add_argument("--no-knn", action="store_true", help="leave the kNN candidates out (they store training features)")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    return parser


# --------------------------------------------------------------------------- metrics

def confusion_matrix(true: np.ndarray, predicted: np.ndarray, classes: int) -> np.ndarray:
    """[classes, classes] counts: row = true class, column = predicted class."""
    matrix = np.zeros((classes, classes), np.int64)
    np.add.at(matrix, (true, predicted), 1)
    return matrix


def per_class_scores(matrix: np.ndarray) -> list:
    """[{precision, recall, f1, support}] per class; a ratio with nothing to count is None
    (F1 is 2 TP / (2 TP + FP + FN), so 0 for a class that was never predicted)."""
    scores = []
    for k in range(len(matrix)):
        hits, predicted, actual = matrix[k, k], matrix[:, k].sum(), matrix[k].sum()
        precision = hits / predicted if predicted else None
        recall = hits / actual if actual else None
        f1 = 2 * hits / (predicted + actual) if predicted + actual else None     # = 2PR / (P + R)
        scores.append({"precision": precision, "recall": recall, "f1": f1, "support": int(actual)})
    return scores


def choose_threshold(confidence: np.ndarray, correct: np.ndarray, keep: float = DEFAULT_KEEP) -> dict:
    """The largest t with at least `keep` of the correct answers at confidence >= t (see the module doc),
    and what it does on these photos: coverage, accuracy of the accepted, share of the wrong ones caught."""
    if not 0 < keep <= 1:
        raise LnnError(f"--keep must be in (0, 1], not {keep}")
    right = np.sort(confidence[correct])
    if len(right) == 0:
        raise LnnError("no photo was classified correctly, so no threshold can be chosen")
    must_keep = max(1, math.ceil(keep * len(right) - 1e-9))        # at least one, however small keep is
    may_drop = len(right) - must_keep
    threshold = math.floor(float(right[may_drop]) * 1e4) / 1e4       # rounded down: the kept ones stay kept
    accepted = confidence >= threshold
    wrong = ~correct
    return {
        "uncertain_below": threshold,
        "rule": f"largest threshold keeping >= {keep:.0%} of the correct validation answers",
        "correct_kept": float(np.mean(confidence[correct] >= threshold)),
        "coverage": float(np.mean(accepted)),
        "accuracy_of_accepted": float(np.mean(correct[accepted])) if accepted.any() else None,
        "wrong_flagged": float(np.mean(confidence[wrong] < threshold)) if wrong.any() else None,
        "photos": int(len(confidence)),
    }


# --------------------------------------------------------------------------- running the model

def class_columns(folder_classes: list, labels: list, folder) -> np.ndarray:
    """For each folder class, the model output index of the label with that name."""
    names = [label["name"] for label in labels]
    unknown = [c for c in folder_classes if c not in names]
    if unknown:
        raise LnnInputError(f"{folder}: class folders the model does not know: {', '.join(unknown)} "
                            f"(its labels: {', '.join(names)})")
    return np.array([names.index(c) for c in folder_classes])


def input_batches(session, images, batch: int):
    """uint8 [N, C, H, W] in the model's colour order and size -> preprocessed float32 batches."""
    color = session.model.preprocess["color"]
    for start in range(0, len(images), batch):
        part = np.asarray(images[start:start + batch])
        pixels = [image[0] if color == "gray" else image.transpose(1, 2, 0) for image in part]
        yield np.stack([session.prepare_image(p, color="bgr" if color == "gray" else color) for p in pixels])


def probabilities(session, images, batch: int, progress: bool) -> np.ndarray:
    """uint8 [N, C, H, W] in the model's colour order and size -> [N, K] class probabilities (calibrated)."""
    from lnn.train.gate_fit import extract

    outputs, _ = extract(session, input_batches(session, images, batch), len(images), "evaluating", progress)
    return session.judge_rules.probabilities(outputs)


def row_outputs(session, values, batch: int) -> np.ndarray:
    """Raw series or table rows (as lnn.runtime.series.model_inputs takes them) -> the model's outputs [N, K],
    through its own preprocessing, `batch` rows per run."""
    from lnn.runtime.series import model_inputs

    return np.concatenate([session.run(model_inputs(session.model, values[start:start + batch]))
                           for start in range(0, len(values), batch)])


def path_batches(session, paths: list, batch: int, skipped: list):
    """Image files -> preprocessed batches; a file that cannot be decoded is left out and noted in `skipped`."""
    for start in range(0, len(paths), batch):
        inputs = []
        for path in paths[start:start + batch]:
            try:
                inputs.append(session.prepare_image(path))
            except LnnInputError as err:
                skipped.append(str(err))
        if inputs:
            yield np.stack(inputs)


# --------------------------------------------------------------------------- output

def _percent(value) -> str:
    return "-" if value is None else f"{value:.1%}"


def report_lines(labels: list, matrix: np.ndarray, scores: list, accuracy: float, count: int, what: str) -> list:
    width = max(len(label["display"]) for label in labels)
    lines = [f"{what}: {count} photos, accuracy {accuracy:.2%}", "",
             f"{'class':<{width}}  precision  recall      F1  photos"]
    for label, score in zip(labels, scores):
        if score["support"] or matrix[:, labels.index(label)].any():
            lines.append(f"{label['display']:<{width}}  {_percent(score['precision']):>9}  {_percent(score['recall']):>6}"
                         f"  {_percent(score['f1']):>6}  {score['support']:>6}")
    return lines


def write_confusion_csv(path: Path, labels: list, matrix: np.ndarray) -> None:
    with atomic_output(path, "w", newline="", encoding="utf-8") as f:
        writer = csv.writer(f)
        writer.writerow(["true \\ predicted"] + [label["display"] for label in labels])
        for label, row in zip(labels, matrix):
            writer.writerow([label["display"]] + row.tolist())


def plot_confusion(path: Path, labels: list, matrix: np.ndarray, title: str) -> None:
    try:
        import matplotlib
    except ImportError:
        raise LnnError("the confusion-matrix PNG needs matplotlib (pip install matplotlib); "
                       "confusion.csv was written") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    k = len(labels)
    longest = max(len(label["display"]) for label in labels)
    figure, axes = plt.subplots(figsize=(2.5 + 0.7 * k + 0.06 * longest, 2.0 + 0.6 * k + 0.05 * longest))
    shares = matrix / np.maximum(matrix.sum(axis=1, keepdims=True), 1)
    axes.imshow(shares, cmap="Blues", vmin=0, vmax=1)
    names = [label["display"] for label in labels]
    axes.set_xticks(range(k), names, rotation=40, ha="right")
    axes.set_yticks(range(k), names)
    axes.set_xlabel("predicted")
    axes.set_ylabel("true")
    axes.set_title(title)
    for i in range(k):
        for j in range(k):
            if matrix[i, j]:
                axes.text(j, i, str(matrix[i, j]), ha="center", va="center",
                          color="white" if shares[i, j] > 0.5 else "black", fontsize=9)
    try:
        with atomic_output(path) as f:
            figure.savefig(f, format="png", dpi=110, bbox_inches="tight")
    finally:
        plt.close(figure)


# --------------------------------------------------------------------------- the command

def body(args) -> int:
    import lnn
    from lnn.train.data import DEFAULT_SPLIT_SEED, DEFAULT_VAL_FRACTION, validation_split_words
    from lnn.train.images import ImageFolder, check_split, scan_folder

    kind, sep, folder_path = args.data.partition(":")
    if kind not in ("folder", "ucr", "csv") or not sep or not folder_path:
        raise LnnInputError(f"--data must look like folder:DIR, ucr:DIR or csv:FILE, not {args.data!r}")
    if args.batch < 1:
        raise LnnError(f"--batch must be at least 1, not {args.batch}")
    if kind != "csv" and args.target:
        raise LnnError("--target COLUMN goes with --data csv:FILE")
    problem = subject_problem(args.subject or "")
    if problem:                                     # refused now, not when the .bin is written after fitting the gate
        raise LnnInputError(f"--subject {problem}")
    refuse_writing_over_inputs([args.write_threshold, args.write_gate], [args.model, folder_path, args.outliers])
    if kind != "folder":
        return evaluate_rows(args, kind, folder_path)
    if args.split in ("test", "train"):
        raise LnnError(f"--split {args.split} is for ucr: data; an image folder has val or all")
    if args.split == "all" and (args.seed is not None or args.val_fraction is not None):
        raise LnnError("--seed and --val-fraction choose the validation split; they mean nothing with --split all")
    seed = DEFAULT_SPLIT_SEED if args.seed is None else args.seed
    val_fraction = DEFAULT_VAL_FRACTION if args.val_fraction is None else args.val_fraction
    if args.split == "val":
        check_split(val_fraction, seed)                  # before decoding anything
    if (args.fit_gate or args.write_gate) and not (args.fit_gate and args.write_gate and args.outliers):
        raise LnnError("--fit-gate, --write-gate OUT.bin and --outliers DIR go together")
    if (args.fit_gate or args.write_gate) and args.split != "val":
        raise LnnError("--fit-gate chooses thresholds on the validation split: leave out --split all")
    session = lnn.load(args.model, device=args.device, features=gate_feature(args))
    preprocess = session.model.preprocess
    if not session.model.takes_images:
        raise LnnInputError(f"{args.model}: model {session.model.name!r} takes no images "
                            f"(input shape {list(session.model.input_shape)}; series and tables: --data ucr:DIR "
                            f"or csv:FILE)")
    scan = scan_folder(folder_path)
    columns = class_columns(scan.classes, session.labels, folder_path)     # before decoding
    folder = ImageFolder.load(folder_path, session.model.input_shape, preprocess["color"], progress=not args.quiet,
                              log=lambda message: print(message, file=sys.stderr, flush=True), scan=scan)
    rows = (folder.split(val_fraction, seed, "its classes have too few photos for it; evaluate every photo with "
                                             "--split all, or choose a larger --val-fraction")[1]
            if args.split == "val" else np.arange(len(folder.files)))
    what = (f"{folder.folder} ({validation_split_words(seed, val_fraction)})" if args.split == "val"
            else f"{folder.folder} (all photos)")

    from lnn.train.gate_fit import expected_calibration_error, extract

    outputs, features = extract(session, input_batches(session, folder.data.images[rows], args.batch), len(rows),
                                "evaluating", not args.quiet)
    probs = session.judge_rules.probabilities(outputs)
    true = columns[folder.labels[rows]]
    predicted = probs.argmax(axis=1)
    confidence = probs.max(axis=1)
    correct = predicted == true
    labels = session.labels
    matrix = confusion_matrix(true, predicted, len(labels))
    scores = per_class_scores(matrix)
    accuracy = float(correct.mean())
    print("\n".join(report_lines(labels, matrix, scores, accuracy, len(rows), what)))
    print("\n" + calibration_line(session, outputs, true, expected_calibration_error))
    gate = session.judge_rules.gate
    if (gate is None and session.judge_rules.uncertain_below is not None) or (
            gate is not None and session.feature == gate["feature"]):      # not when fitting on another node
        print(decision_line(session.judge_rules.judge(outputs, features).reasons, correct))
    if args.fit_gate or args.write_gate:
        fit_and_write_gate(args, session, folder, columns, (outputs, features, true), val_fraction, seed)

    threshold = None
    if args.choose_threshold or args.write_threshold:
        threshold = choose_threshold(confidence, correct, args.keep)
        print(f"\nuncertainty threshold: {threshold['uncertain_below']:.4f} ({threshold['rule']}): "
              f"{threshold['coverage']:.1%} of these photos answered, {_percent(threshold['accuracy_of_accepted'])} "
              f"of those right, {_percent(threshold['wrong_flagged'])} of the wrong answers turned into 'uncertain'")
    if args.write_threshold:
        write_with_threshold(session.bin, Path(args.write_threshold), threshold,
                             accuracy_summary(args, session.bin.metadata, accuracy, len(rows), what))
        print(f"wrote {args.write_threshold} with thresholds.uncertain_below = {threshold['uncertain_below']}")

    if args.out:
        metrics = {"model": str(args.model), "data": str(folder.folder), "split": args.split,
                   "seed": seed if args.split == "val" else None,
                   "val_fraction": val_fraction if args.split == "val" else None,
                   "photos": int(len(rows)), "accuracy": accuracy,
                   "expected_calibration_error": expected_calibration_error(probs, true),
                   "classes": {label["name"]: score for label, score in zip(labels, scores)},
                   "threshold": threshold}
        write_report(Path(args.out), session.model.name, labels, matrix, metrics,
                     ("file", [folder.files[row] for row in rows]), (true, predicted, confidence), "photos")
    return 0


def write_report(out: Path, name: str, labels: list, matrix: np.ndarray, metrics: dict, items: tuple,
                 answers: tuple, unit: str) -> None:
    """--out DIR: confusion.csv, confusion.png, predictions.csv (one row per item: `items` is (column name,
    values); `answers` (true, predicted, confidence)) and metrics.json."""
    out.mkdir(parents=True, exist_ok=True)
    write_confusion_csv(out / "confusion.csv", labels, matrix)
    plot_confusion(out / "confusion.png", labels, matrix, f"{name}\naccuracy {metrics['accuracy']:.2%} "
                                                          f"on {len(items[1])} {unit}")
    with atomic_output(out / "predictions.csv", "w", newline="", encoding="utf-8") as f:
        writer = csv.writer(f)
        writer.writerow([items[0], "true", "predicted", "confidence"])
        for item, t, p, c in zip(items[1], *answers):
            writer.writerow([item, labels[t]["name"], labels[p]["name"], f"{c:.6f}"])
    write_atomic(out / "metrics.json", (json.dumps(metrics, indent=2) + "\n").encode("utf-8"))
    print(f"wrote {out}/confusion.png, confusion.csv, predictions.csv, metrics.json")


def evaluate_rows(args, kind: str, path: str) -> int:
    """ucr:DIR (--split test or train) and csv:FILE --target COLUMN (--split val or all): series or table rows
    through the model's own preprocessing (lnn.runtime.series.model_inputs: raw values in)."""
    import lnn
    from lnn.train.data import DEFAULT_SPLIT_SEED, DEFAULT_VAL_FRACTION, validation_split_words
    from lnn.train.series import read_target_table, split_rows, ucr_split

    if args.fit_gate or args.write_gate or args.choose_threshold or args.write_threshold:
        raise LnnError(f"--fit-gate and the threshold options are for image folders, not {kind}: data")
    allowed = ("test", "train") if kind == "ucr" else ("val", "all")
    split = args.split if args.split != "val" or kind == "csv" else None
    if split not in allowed:
        raise LnnError(f"{kind}: data needs --split {' or '.join(allowed)}")
    if split != "val" and (args.seed is not None or args.val_fraction is not None):
        raise LnnError("--seed and --val-fraction choose the validation split of a csv: table (--split val)")
    session = lnn.load(args.model, device=args.device)
    rank = 2 if kind == "ucr" else 1
    if len(session.model.input_shape) != rank:
        raise LnnInputError(f"{args.model}: model {session.model.name!r} takes input {list(session.model.input_shape)}, "
                            f"not {'series [C, T]' if rank == 2 else 'table rows [F]'}")
    seed = DEFAULT_SPLIT_SEED if args.seed is None else args.seed
    val_fraction = DEFAULT_VAL_FRACTION if args.val_fraction is None else args.val_fraction
    if kind == "ucr":
        data, source = ucr_split(path, split, session.model.preprocess)
        values, names, unit = data.series, data.labels, "series"
        items = ("line", list(range(1, len(values) + 1)))
        what = f"{source} ({split} split)"
    else:
        table = read_target_table(path, args.target, session.model.preprocess)
        source, unit = table.path, "rows"
        values, names = table.values, table.labels          # the model's columns, in its order
        rows = split_rows(names, val_fraction, seed)[1] if split == "val" else np.arange(len(names))
        values, names = values[rows], [names[i] for i in rows]
        items = ("row", (rows + 1).tolist())
        what = (f"{source} ({validation_split_words(seed, val_fraction)})" if split == "val"
                else f"{source} (all rows)")
    labels = session.labels
    true = class_columns(names, labels, source)
    outputs = row_outputs(session, values, args.batch)
    probs = session.judge_rules.probabilities(outputs)
    predicted, confidence = probs.argmax(axis=1), probs.max(axis=1)
    matrix = confusion_matrix(true, predicted, len(labels))
    scores = per_class_scores(matrix)
    accuracy = float((predicted == true).mean())
    print("\n".join(report_lines(labels, matrix, scores, accuracy, len(true), what)).replace(" photos", f" {unit}"))
    from lnn.train.gate_fit import expected_calibration_error

    print("\n" + calibration_line(session, outputs, true, expected_calibration_error))
    if args.out:
        metrics = {"model": str(args.model), "data": str(source), "split": split,
                   "seed": seed if split == "val" else None, "val_fraction": val_fraction if split == "val" else None,
                   unit: int(len(true)), "accuracy": accuracy,
                   "expected_calibration_error": expected_calibration_error(probs, true),
                   "classes": {label["name"]: score for label, score in zip(labels, scores)}}
        write_report(Path(args.out), session.model.name, labels, matrix, metrics, items, (true, predicted, confidence),
                     unit)
    return 0


def accuracy_summary(args, metadata: dict, accuracy: float, count: int, what: str) -> str:
    """The model card's "accuracy" field: the figure, on what, and the command that measured it."""
    command = f"lnn-eval {args.model} --data {args.data}"
    command += " --split all" if args.split == "all" else "".join(
        f" --{name.replace('_', '-')} {getattr(args, name)}" for name in ("seed", "val_fraction")
        if getattr(args, name) is not None)
    text = f"{accuracy:.2%} on {count:,} photos, {what}: {command}."
    best = (metadata.get("training") or {}).get("best")
    if args.split == "val" and isinstance(best, dict) and "epoch" in best:
        text += f" The epoch kept ({best['epoch']}) was chosen on the same validation split."
    return text


def gate_feature(args) -> str | None:
    """The node the gate is fitted on: --feature, else the model's gate's, else the penultimate vector."""
    if not (args.fit_gate or args.write_gate):
        return None
    if args.feature:
        return args.feature
    from lnn.formats.binfile import read_bin
    from lnn.train.gate_fit import default_feature_node

    bin_model = read_bin(args.model)
    return (bin_model.metadata.get("gate") or {}).get("feature") or default_feature_node(bin_model.model)


def calibration_line(session, outputs, true, ece) -> str:
    if session.outputs_probabilities:
        return f"calibration: expected calibration error (15 bins) {ece(outputs, true):.2%} (the model ends in a softmax)"
    from lnn.runtime.gate import softmax

    line = f"calibration: expected calibration error (15 bins) {ece(softmax(outputs), true):.2%} at temperature 1"
    temperature = session.judge_rules.temperature
    if "calibration" in session.metadata:
        line += f", {ece(softmax(outputs, temperature), true):.2%} at the model's temperature {temperature:g}"
    return line


def decision_line(reasons: list, correct: np.ndarray) -> str:
    """How the model's own decision rules treat these (in-distribution) photos."""
    flagged = np.array([reason is not None for reason in reasons])
    counts = {reason: reasons.count(reason) for reason in sorted(set(reasons) - {None})}
    parts = ", ".join(f"{reason} {count / len(reasons):.1%}" for reason, count in counts.items())
    kept_right = f"{correct[~flagged].mean():.2%}" if (~flagged).any() else "-"
    return (f"the model's decision: {flagged.mean():.1%} of these photos not answered ({parts or 'none'}); "
            f"accuracy of the answered {kept_right}")


def fit_and_write_gate(args, session, folder, columns, validation: tuple, val_fraction: float, seed: int) -> None:
    """Features of the training split, the outlier validation part; fit (train/gate_fit.py) and write."""
    from lnn.formats.binfile import write_bin
    from lnn.runtime.photo_checks import DEFAULTS as PHOTO_CHECKS
    from lnn.train.gate_fit import extract, fit_gate, gated_metadata
    from lnn.train.outliers import split_outliers

    outlier_paths = split_outliers(args.outliers)["validation"]
    if not outlier_paths:
        raise LnnInputError(f"{args.outliers}: no photo falls in the outlier split's validation part")
    train_rows = folder.split(val_fraction, seed)[0]
    _, train_features = extract(session, input_batches(session, folder.data.images[train_rows], args.batch),
                                len(train_rows), "training features", not args.quiet)
    skipped: list = []
    outlier_outputs, outlier_features = extract(session, path_batches(session, outlier_paths, args.batch, skipped),
                                                len(outlier_paths), "outlier photos", not args.quiet)
    for message in skipped:
        print(f"{PROG}: skipped an outlier photo: {one_line(message)}", file=sys.stderr)
    if len(outlier_outputs) == 0:                   # not one of them could be decoded
        raise LnnInputError(f"{args.outliers}: none of the {len(outlier_paths)} photos of the outlier folder's "
                            f"validation part could be decoded (first: {skipped[0]})")
    val_outputs, val_features, true = validation
    logits = not session.outputs_probabilities
    fitted = fit_gate((train_features, columns[folder.labels[train_rows]]), (val_outputs, val_features, true),
                      (outlier_outputs, outlier_features), len(session.labels), args.gate_keep,
                      args.confidence_share, logits, with_knn=not args.no_knn)
    print(f"\ngate candidates (thresholds keeping {args.gate_keep:.1%} of the {len(true)} validation photos; "
          f"caught: share of the {len(outlier_outputs)} outlier validation photos flagged):")
    width = max(len(name) for name, _, _ in fitted.table)
    for name, caught, kept in fitted.table:
        print(f"  {name:<{width}}  caught {caught:6.1%}  kept {kept:6.1%}")
    report = fitted.report
    print(f"chosen: {fitted.candidate.name}, thresholds {fitted.thresholds}; low confidence under "
          f"{fitted.uncertain_below}; temperature {fitted.temperature:g}: expected calibration error "
          f"{report['ece_before']:.2%} -> {report['ece_after']:.2%}; validation photos kept "
          f"{report['validation_kept']:.1%}, accuracy of the kept {report['accuracy_of_kept']:.2%}")
    metadata = gated_metadata(session.metadata, session.feature, fitted, args.gate_keep, args.confidence_share,
                              args.subject or (session.metadata.get("gate") or {}).get("subject"), PHOTO_CHECKS, logits)
    tensors = {key: value for key, value in session.bin.tensors.items() if not key.startswith("gate.")}
    write_bin(args.write_gate, session.model, {**tensors, **fitted.candidate.tensors}, metadata,
              session.bin.stored_dtypes)
    print(f"wrote {args.write_gate} with the gate ({', '.join(fitted.candidate.scores)} on {session.feature}), "
          f"calibration and thresholds")


def write_with_threshold(bin_model, path: Path, threshold: dict, accuracy: str) -> None:
    """A copy of the model (same tensors, same stored dtypes) whose metadata carries the threshold and,
    when it has a model card, this evaluation as the card's "accuracy"."""
    from lnn.formats.binfile import write_bin

    metadata = dict(bin_model.metadata)
    metadata["thresholds"] = {"uncertain_below": threshold["uncertain_below"], "rule": threshold["rule"]}
    if isinstance(metadata.get("model_card"), dict):
        metadata["model_card"] = {**metadata["model_card"], "accuracy": accuracy}
    write_bin(path, bin_model.model, bin_model.tensors, metadata, bin_model.stored_dtypes)


def main(argv=None) -> int:
    return run_command(build_parser(), body, argv)


if __name__ == "__main__":
    raise SystemExit(main())
