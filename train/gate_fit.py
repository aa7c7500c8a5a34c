"""Fitting a model's out-of-distribution gate and calibration (lnn-eval --fit-gate; issue 11).

Roles of the data (fixed project-wide):
  tomato training split   feature statistics: class means and shared covariance (Mahalanobis), the
                          unit-length feature bank (kNN);
  tomato validation split the temperature (minimum NLL) and every threshold: the whole decision (gate
                          scores and the low-confidence threshold together) keeps a fixed share
                          (default 97%) of these photos;
  outlier "validation"    only to choose between candidate gates (which scores, shrinkage, k);
  outlier "test"          never here: only benchmarks/ood_gate.py reports figures on it.
The outlier "fit" part is for training with outlier exposure (lnn-train --outliers); nothing in this
gate is learned from outlier photos.

Everything here is NumPy on arrays of logits and features; `extract` gets those from a Session (the
Numba backend in batches, with a progress bar).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from lnn.formats.errors import LnnError
from lnn.formats.gate import feature_node
from lnn.runtime.gate import all_scores, softmax, unit_rows

ECE_BINS = 15
SHRINKAGES = (1e-3, 1e-2, 1e-1)     # ridge added to the shared covariance, times its mean variance
KNN_KS = (1, 5)
KNN_MAX_ROWS = 4096                  # training features kept for kNN (the .bin grows by rows x D x 4 bytes)


def default_feature_node(model) -> str:
    """The penultimate features: the last node before the output layer with a vector output (dropout skipped)."""
    for node in reversed(model.nodes[:-1]):
        if len(node.out_shape) == 1 and node.op != "dropout":
            return node.name
    raise LnnError(f"model {model.name!r} has no node with a vector output before its last layer to fit a gate on")


def extract(session, batches, total: int, what: str, progress: bool = True) -> tuple:
    """(outputs [N, K], features [N, D], or None when the session keeps no features) of preprocessed
    input batches, with a progress bar; no batches at all give N = 0 (arrays of no rows)."""
    from tqdm import tqdm

    outputs, features = [], []
    with tqdm(total=total, desc=what, unit="img", disable=None if progress else True, leave=False) as bar:
        for batch in batches:
            out, feat = session.run_with_features(batch)
            outputs.append(out)
            features.append(feat)
            bar.update(len(batch))
    if not outputs:
        feature = None if session.feature is None else feature_node(session.model, session.feature)
        return (np.zeros((0, *session.model.output_shape), np.float32),
                None if feature is None else np.zeros((0, *feature.out_shape), np.float32))
    return np.concatenate(outputs), None if features[0] is None else np.concatenate(features)


DEFAULT_GATE_KEEP = 0.975          # share of the validation photos the whole decision answers: half a point of
                                   # margin, so new photos of the same kind stay under 3% refused (issue 11)
DEFAULT_CONFIDENCE_SHARE = 0.01    # of those, at most this share refused for low confidence

# --------------------------------------------------------------------------- calibration

def nll(logits: np.ndarray, labels: np.ndarray, temperature: float) -> float:
    z = np.asarray(logits, np.float64) / temperature
    top = z.max(axis=1, keepdims=True)
    log_sum = np.log(np.exp(z - top).sum(axis=1)) + top[:, 0]
    return float(np.mean(log_sum - z[np.arange(len(z)), labels]))


def fit_temperature(logits: np.ndarray, labels: np.ndarray) -> float:
    """The temperature minimizing the validation NLL (it is convex in 1/T): golden-section search on log T."""
    low, high = math.log(0.05), math.log(20.0)
    ratio = (math.sqrt(5) - 1) / 2
    a, b = high - ratio * (high - low), low + ratio * (high - low)
    fa, fb = nll(logits, labels, math.exp(a)), nll(logits, labels, math.exp(b))
    for _ in range(60):
        if fa < fb:
            high, b, fb = b, a, fa
            a = high - ratio * (high - low)
            fa = nll(logits, labels, math.exp(a))
        else:
            low, a, fa = a, b, fb
            b = low + ratio * (high - low)
            fb = nll(logits, labels, math.exp(b))
    return round(math.exp((low + high) / 2), 4)


def expected_calibration_error(probabilities: np.ndarray, labels: np.ndarray, bins: int = ECE_BINS) -> float:
    """ECE: the mean over equal-width confidence bins of |accuracy - confidence|, weighted by the bin's share."""
    confidence = probabilities.max(axis=1)
    correct = probabilities.argmax(axis=1) == labels
    edges = np.linspace(0, 1, bins + 1)
    which = np.clip(np.searchsorted(edges, confidence, side="left") - 1, 0, bins - 1)
    error = 0.0
    for b in range(bins):
        inside = which == b
        if inside.any():
            error += inside.mean() * abs(correct[inside].mean() - confidence[inside].mean())
    return float(error)


# --------------------------------------------------------------------------- statistics and thresholds

def class_statistics(features: np.ndarray, labels: np.ndarray, classes: int, shrinkage: float) -> tuple:
    """(class means [K, D], precision [D, D]): the inverse of the shared within-class covariance plus
    `shrinkage` x its mean variance on the diagonal (a class without training photos gets the overall mean)."""
    f = np.asarray(features, np.float64)
    overall = f.mean(axis=0)
    means = np.stack([f[labels == k].mean(axis=0) if (labels == k).any() else overall for k in range(classes)])
    centred = f - means[labels]
    covariance = centred.T @ centred / len(f)
    ridge = shrinkage * max(float(np.trace(covariance)) / len(covariance), 1e-12)
    precision = np.linalg.inv(covariance + ridge * np.eye(len(covariance)))
    precision = (precision + precision.T) / 2
    return means.astype(np.float32), precision.astype(np.float32)


def feature_bank(features: np.ndarray, max_rows: int = KNN_MAX_ROWS, seed: int = 0) -> np.ndarray:
    """Unit-length training features for kNN, at most max_rows (a seeded sample)."""
    rows = np.arange(len(features))
    if len(rows) > max_rows:
        rows = np.sort(np.random.default_rng(seed).choice(rows, max_rows, replace=False))
    return unit_rows(features[rows]).astype(np.float32)


def threshold_at(scores: np.ndarray, level: float) -> float:
    """A threshold flagging (score > t) at most 1 - level of these scores: midway between their `level`
    quantile and the next larger score, so that rounding noise (another backend, another batch size) does
    not flip the photo at the boundary."""
    ordered = np.sort(scores)
    index = min(len(ordered) - 1, max(0, math.ceil(level * len(ordered)) - 1))
    if index + 1 < len(ordered):
        return float((ordered[index] + ordered[index + 1]) / 2)
    return float(ordered[index])


def common_thresholds(scores: dict, keep: float, also_flagged: np.ndarray | None = None) -> dict:
    """One threshold per score, all at the same quantile of the validation scores, as low as possible while
    the union of their flags (and `also_flagged`) keeps at least `keep` of the photos."""
    n = len(next(iter(scores.values())))
    also = np.zeros(n, bool) if also_flagged is None else also_flagged

    def kept(level):
        thresholds = {name: threshold_at(values, level) for name, values in scores.items()}
        flagged = also.copy()
        for name, values in scores.items():
            flagged |= values > thresholds[name]
        return 1 - flagged.mean(), thresholds

    low, high = keep, 1.0
    if kept(high)[0] < keep:
        raise LnnError(f"the low-confidence threshold alone flags more than {1 - keep:.1%} of the validation photos")
    for _ in range(40):
        middle = (low + high) / 2
        if kept(middle)[0] >= keep:
            high = middle
        else:
            low = middle
    return kept(high)[1]


def flags(scores: dict, thresholds: dict) -> np.ndarray:
    flagged = np.zeros(len(next(iter(scores.values()))), bool)
    for name, values in scores.items():
        flagged |= values > thresholds[name]
    return flagged


# --------------------------------------------------------------------------- candidates and the choice

@dataclass
class Candidate:
    """One way to gate: which scores, with which fitted parameters."""

    scores: tuple
    shrinkage: float | None = None
    knn_k: int | None = None
    tensors: dict = field(default_factory=dict)

    @property
    def name(self) -> str:
        parts = []
        for score in self.scores:
            if score == "mahalanobis":
                parts.append(f"mahalanobis (shrinkage {self.shrinkage:g})")
            elif score == "knn":
                parts.append(f"knn (k={self.knn_k})")
            else:
                parts.append(score)
        return " + ".join(parts)

    def compute(self, outputs, features, temperature: float, outputs_probabilities: bool = False) -> dict:
        """The scores of these outputs (logits, or probabilities for a model ending in a softmax)."""
        return all_scores(self.scores, outputs, features, self.tensors, temperature, self.knn_k or 1,
                          outputs if outputs_probabilities else None)


def candidates(train_features, train_labels, classes: int, logits_available: bool, with_knn: bool = True) -> list:
    stats = {s: dict(zip(("gate.class_means", "gate.precision"),
                         class_statistics(train_features, train_labels, classes, s))) for s in SHRINKAGES}
    bank = {"gate.train_features": feature_bank(train_features)} if with_knn else None
    out = [Candidate(("msp",))]
    if logits_available:
        out.append(Candidate(("energy",)))
    for s in SHRINKAGES:
        out.append(Candidate(("mahalanobis",), shrinkage=s, tensors=stats[s]))
        if logits_available:
            out.append(Candidate(("energy", "mahalanobis"), shrinkage=s, tensors=stats[s]))
    if with_knn:
        for k in KNN_KS:
            out.append(Candidate(("knn",), knn_k=k, tensors=bank))
            out.append(Candidate(("mahalanobis", "knn"), shrinkage=SHRINKAGES[0], knn_k=k,
                                 tensors={**stats[SHRINKAGES[0]], **bank}))
    return out


@dataclass
class FittedGate:
    temperature: float
    uncertain_below: float
    candidate: Candidate
    thresholds: dict
    report: dict
    table: list            # (candidate name, outliers caught on the outlier validation part, tomato kept)


def low_confidence_threshold(probabilities: np.ndarray, share: float) -> float:
    """The largest threshold t (4 decimals, rounded down) with at most `share` of the photos below it."""
    best = np.sort(probabilities.max(axis=1))
    index = math.floor(share * len(best) + 1e-9)
    if index == 0:
        return 0.0
    return math.floor(float(best[index - 1]) * 1e4) / 1e4


def fit_gate(train: tuple, validation: tuple, outliers: tuple, classes: int, keep: float = DEFAULT_GATE_KEEP,
             confidence_share: float = DEFAULT_CONFIDENCE_SHARE, logits_available: bool = True,
             with_knn: bool = True) -> FittedGate:
    """train: (features, labels); validation: (logits, features, labels); outliers: (logits, features) of the
    outlier validation part. Temperature and thresholds from `validation`, the choice on `outliers`."""
    train_features, train_labels = train
    val_logits, val_features, val_labels = validation
    out_logits, out_features = outliers
    if not 0 < keep < 1 or not 0 <= confidence_share < 1 - keep + 1e-12:
        raise LnnError(f"keep ({keep}) must be in (0, 1) and the low-confidence share ({confidence_share}) "
                       f"at most 1 - keep")
    temperature = fit_temperature(val_logits, val_labels) if logits_available else 1.0
    val_probabilities = softmax(val_logits, temperature) if logits_available else val_logits
    uncertain_below = low_confidence_threshold(val_probabilities, confidence_share)
    low_confidence = val_probabilities.max(axis=1) < uncertain_below
    out_probabilities = softmax(out_logits, temperature) if logits_available else out_logits
    out_low = out_probabilities.max(axis=1) < uncertain_below
    table, best = [], None
    probabilities_given = not logits_available
    for candidate in candidates(train_features, train_labels, classes, logits_available, with_knn):
        val_scores = candidate.compute(val_logits, val_features, temperature, probabilities_given)
        thresholds = common_thresholds(val_scores, keep, low_confidence)
        kept = 1 - (flags(val_scores, thresholds) | low_confidence).mean()
        caught = (flags(candidate.compute(out_logits, out_features, temperature, probabilities_given), thresholds)
                  | out_low).mean()
        table.append((candidate.name, float(caught), float(kept)))
        size = sum(value.size for value in candidate.tensors.values())
        if best is None or (caught, -size) > (best[0], -best[1]):
            best = (caught, size, candidate, thresholds)
    caught, _, chosen, thresholds = best
    accepted = ~(flags(chosen.compute(val_logits, val_features, temperature, probabilities_given), thresholds)
                 | low_confidence)
    correct = val_probabilities.argmax(axis=1) == val_labels
    report = {
        "temperature": temperature,
        "ece_before": expected_calibration_error(softmax(val_logits) if logits_available else val_logits, val_labels),
        "ece_after": expected_calibration_error(val_probabilities, val_labels),
        "validation_photos": int(len(val_labels)),
        "validation_kept": float(accepted.mean()),
        "validation_low_confidence": float(low_confidence.mean()),
        "accuracy": float(correct.mean()),
        "accuracy_of_kept": float(correct[accepted].mean()) if accepted.any() else None,
        "outlier_validation_photos": int(len(out_logits)),
        "outlier_validation_caught": float(caught),
    }
    return FittedGate(temperature, uncertain_below, chosen, thresholds, report, table)


def gated_metadata(metadata: dict, feature: str, fitted: FittedGate, keep: float, confidence_share: float,
                   subject: str | None, photo_checks: dict | None, logits_available: bool) -> dict:
    """A copy of the model's metadata with gate, calibration and thresholds set from a FittedGate."""
    out = dict(metadata)
    candidate = fitted.candidate
    gate = {
        "feature": feature,
        "scores": list(candidate.scores),
        "thresholds": {name: float(value) for name, value in fitted.thresholds.items()},
        "rule": (f"uncertain (not_a_leaf) when any score is above its threshold; thresholds at one common quantile "
                 f"of the tomato validation photos so that, with the low-confidence threshold, "
                 f"{keep:.0%} of them are kept; method chosen on the outlier validation part: {candidate.name}"),
        "fitted": {key: (round(value, 6) if isinstance(value, float) else value)
                   for key, value in fitted.report.items()},
    }
    if candidate.knn_k is not None:
        gate["knn_k"] = candidate.knn_k
    if subject:
        gate["subject"] = subject
    if photo_checks is not None:
        gate["photo_checks"] = photo_checks
    out["gate"] = gate
    out["thresholds"] = {"uncertain_below": fitted.uncertain_below,
                         "rule": f"largest threshold with at most {confidence_share:.0%} of the tomato validation "
                                 "photos below it (calibrated probabilities)"}
    if logits_available:
        out["calibration"] = {"temperature": fitted.temperature,
                              "rule": "temperature scaling: minimum NLL on the validation split"}
    else:
        out.pop("calibration", None)
    return out
