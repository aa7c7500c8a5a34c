"""The answer a model gives a photo: calibrated probabilities, the out-of-distribution gate, the reason.

One NumPy function, `Judge.judge(logits, features)`, turns any backend's outputs (and the gate's feature
node's values, which every backend returns next to them: runtime/features.py) into probabilities and a
reason per photo, so numpy, cpu, cuda and the app's compiled kernels decide alike. The gate lives in
the model's metadata and `gate.*` tensors (formats/gate.py, SPEC rules G1-G8).

Outlier scores (larger = less like the training photos; flagged when above the gate's threshold):
    msp          1 - the largest calibrated probability (the old confidence rule, as a score)
    energy       -logsumexp(logits)                     (Liu et al. 2020)
    mahalanobis  min over classes k of (f - mean_k)^T precision (f - mean_k), shared covariance
                 (Lee et al. 2018) on the feature vector f
    knn          distance from f / |f| to its knn_k-th nearest unit-length training feature (Sun et al. 2022)
Calibration: probabilities = softmax(logits / temperature) (metadata.calibration; Guo et al. 2017).

Reasons, in the order they win: a photo check's (runtime/photo_checks.py: too_small, too_dark,
too_bright, blurred), then "not_a_leaf" (a gate score above its threshold), then "low_confidence"
(the best probability under metadata.thresholds.uncertain_below). No reason: a diagnosis.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from lnn.formats.errors import LnnInputError
from lnn.formats.gate import model_outputs_probabilities

REASONS = ("not_a_leaf", "blurred", "too_dark", "too_bright", "too_small", "low_confidence")
DEFAULT_SUBJECT = "leaf this model knows"


INSTRUCTIONS = {
    "not_a_leaf": "This does not look like a {subject}. Take a photo of one leaf, filling the frame.",
    "low_confidence": "Please take a clearer photo of a single leaf, close up and in good light.",
    "blurred": "The photo is blurred. Hold the camera still, let it focus on the leaf, and take it again.",
    "too_dark": "The photo is too dark. Take it again in daylight or brighter light.",
    "too_bright": "The photo is overexposed. Take it again out of direct sun and glare.",
    "too_small": "The photo is too small. Take a photo of one leaf, filling the frame.",
}


def instruction(reason: str | None, subject: str = DEFAULT_SUBJECT, detail: str | None = None) -> str | None:
    """The plain words a person gets for a reason (None for a diagnosis); `detail` replaces a photo check's."""
    if reason is None:
        return None
    return detail if detail is not None else INSTRUCTIONS[reason].format(subject=subject)


# --------------------------------------------------------------------------- the scores

def softmax(logits: np.ndarray, temperature: float = 1.0) -> np.ndarray:
    """Rows with an infinite or NaN logit come out NaN (Judge.judge gives them no answer), without a warning."""
    z = np.asarray(logits, np.float64) / temperature
    with np.errstate(invalid="ignore"):
        z = np.exp(z - z.max(axis=1, keepdims=True))
        return z / z.sum(axis=1, keepdims=True)


def energy_score(logits: np.ndarray) -> np.ndarray:
    z = np.asarray(logits, np.float64)
    top = z.max(axis=1)
    return -(top + np.log(np.exp(z - top[:, None]).sum(axis=1)))


def mahalanobis_score(features: np.ndarray, class_means: np.ndarray, precision: np.ndarray,
                      prepared: tuple | None = None) -> np.ndarray:
    """min_k (f - mu_k)^T P (f - mu_k) for each row f: [N] float64, as f P f - 2 f P mu_k + mu_k P mu_k.
    `prepared` = prepare_mahalanobis(class_means, precision), computed once per model (the per-photo cost is
    then one D x D product)."""
    means, precision, means_precision, means_term = prepared or prepare_mahalanobis(class_means, precision)
    f = np.asarray(features, np.float64)
    fp = f @ precision                                   # [N, D]
    distances = (fp * f).sum(axis=1)[:, None] - 2 * fp @ means.T + means_term[None, :]
    return np.maximum(distances.min(axis=1), 0.0)


def prepare_mahalanobis(class_means: np.ndarray, precision: np.ndarray) -> tuple:
    """(means, precision, means @ precision, mu_k P mu_k per class), float64."""
    means = np.asarray(class_means, np.float64)
    precision = np.asarray(precision, np.float64)
    means_precision = means @ precision
    return means, precision, means_precision, (means_precision * means).sum(axis=1)


def unit_rows(features: np.ndarray) -> np.ndarray:
    f = np.asarray(features, np.float64)
    return f / np.maximum(np.linalg.norm(f, axis=1, keepdims=True), 1e-12)


def knn_score(features: np.ndarray, train_features: np.ndarray, k: int) -> np.ndarray:
    """Euclidean distance from each unit-length row to its k-th nearest unit-length training row."""
    similarity = unit_rows(features) @ np.asarray(train_features, np.float64).T      # [N, M]
    k = min(k, similarity.shape[1])
    kth = -np.partition(-similarity, k - 1, axis=1)[:, k - 1]
    return np.sqrt(np.maximum(2.0 - 2.0 * kth, 0.0))


def all_scores(names, logits, features, tensors: dict, temperature: float = 1.0, knn_k: int = 1,
               probabilities=None, prepared: tuple | None = None) -> dict:
    """{score name: [N] float64} for the named scores (formats/gate.py SCORES); `prepared`: the
    Mahalanobis terms that depend on the model only (prepare_mahalanobis)."""
    out = {}
    for name in names:
        if name == "msp":
            p = softmax(logits, temperature) if probabilities is None else probabilities
            out[name] = 1.0 - p.max(axis=1)
        elif name == "energy":
            out[name] = energy_score(logits)
        elif name == "mahalanobis":
            out[name] = mahalanobis_score(features, tensors["gate.class_means"], tensors["gate.precision"], prepared)
        elif name == "knn":
            out[name] = knn_score(features, tensors["gate.train_features"], knn_k)
        else:
            raise ValueError(f"unknown gate score {name!r}")
    return out


# --------------------------------------------------------------------------- the decision

@dataclass
class Judgement:
    """A batch's verdicts: probabilities [N, K], each gate score [N], and a reason (or None) per photo."""

    probabilities: np.ndarray
    scores: dict
    reasons: list


class Judge:
    """The decision rules of one model (its metadata and gate tensors); the same for every backend."""

    def __init__(self, model, metadata: dict, gate_tensors: dict):
        self.outputs_probabilities = model_outputs_probabilities(model)
        self.temperature = float((metadata.get("calibration") or {}).get("temperature", 1.0))
        self.uncertain_below = (metadata.get("thresholds") or {}).get("uncertain_below")
        gate = metadata.get("gate")
        self.gate = gate
        self.feature = gate["feature"] if gate else None
        self.subject = (gate or {}).get("subject", DEFAULT_SUBJECT)
        self.photo_checks = (gate or {}).get("photo_checks")
        self.tensors = {key: np.asarray(value, np.float64) for key, value in gate_tensors.items()}
        self.prepared = (prepare_mahalanobis(self.tensors["gate.class_means"], self.tensors["gate.precision"])
                         if "gate.class_means" in self.tensors else None)

    def probabilities(self, outputs: np.ndarray) -> np.ndarray:
        """Class probabilities: the outputs themselves when the model ends in a softmax, else
        softmax(outputs / temperature)."""
        if self.outputs_probabilities:
            return np.asarray(outputs)
        return softmax(outputs, self.temperature).astype(np.float32)

    def judge(self, outputs: np.ndarray, features: np.ndarray | None = None, photo_reasons=None) -> Judgement:
        """outputs [N, K] (logits, or probabilities for a softmax model), the gate's features [N, D],
        and optionally each photo's photo-check reason (None = passed) -> a Judgement."""
        if photo_reasons is not None and len(photo_reasons) != len(outputs):
            raise LnnInputError(f"photo_reasons has {len(photo_reasons)} reasons for {len(outputs)} photos")
        probabilities = self.probabilities(outputs)
        scores, flagged = {}, np.zeros(len(outputs), bool)
        if self.gate:
            scores = all_scores(self.gate["scores"], outputs, features, self.tensors, self.temperature,
                                self.gate.get("knn_k", 1), probabilities, self.prepared)
            for name, values in scores.items():      # a score that is not a number: no sign the photo is a leaf
                flagged |= (values > self.gate["thresholds"][name]) | np.isnan(values)
        # outputs that overflowed (inputs far beyond the training data's): no answer to give
        unsure = ~np.isfinite(probabilities).all(axis=1)
        if self.uncertain_below is not None:
            unsure |= probabilities.max(axis=1) < self.uncertain_below
        photo_reasons = photo_reasons or [None] * len(outputs)
        reasons = [photo or ("not_a_leaf" if gated else "low_confidence" if low else None)
                   for photo, gated, low in zip(photo_reasons, flagged, unsure)]
        return Judgement(probabilities, scores, reasons)


@dataclass
class Prediction:
    """One photo's answer: labels ranked best first, and whether (and why) it is not a diagnosis.

    It behaves as the ranked list [(display, probability), ...] that predict_image returned before
    (iterating, indexing, len, ==), so old callers keep working."""

    ranked: list
    reason: str | None = None
    instruction: str | None = None
    scores: dict = field(default_factory=dict)

    @property
    def uncertain(self) -> bool:
        return self.reason is not None

    def __iter__(self):
        return iter(self.ranked)

    def __len__(self) -> int:
        return len(self.ranked)

    def __getitem__(self, index):
        return self.ranked[index]

    def __eq__(self, other):
        if isinstance(other, Prediction):
            return (self.ranked, self.reason) == (other.ranked, other.reason)
        return self.ranked == other
