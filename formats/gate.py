"""The out-of-distribution gate and the calibration a `.bin` may carry: their metadata and tensors, checked.

formats/SPEC.md rules G1-G8 (group "Gate and calibration") are enforced here; binfile.py calls
`check_gate_metadata` after the graph and metadata rules and matches the file's `gate.*` tensors against
`gate_tensor_shapes`. The gate's arithmetic is in lnn/runtime/gate.py (NumPy); this module only knows
what a well-formed gate is:

    metadata["gate"] = {
        "feature": "<node name>",            # a node with a vector output: the features the scores use
        "scores": ["energy", "mahalanobis"], # outlier scores, larger = less like the training photos
        "thresholds": {"energy": -4.2, "mahalanobis": 310.0},   # flagged when score > threshold
        "rule": "...",                       # how they were chosen, in words
        "subject": "tomato leaf",            # optional: what the model expects to see (for the answer's words)
        "knn_k": 5,                          # only with the "knn" score
        "photo_checks": {...},               # optional: thresholds of lnn/runtime/photo_checks.py
        "fitted": {...},                     # optional: any JSON, what the fitting tool measured
    }
    metadata["calibration"] = {"temperature": 1.4, "rule": "..."}   # probabilities = softmax(logits / T)

Tensors (float32, stored after the graph's parameters, in this order): `gate.class_means` [K, D] and
`gate.precision` [D, D] for "mahalanobis"; `gate.train_features` [M, D] (unit-length rows) for "knn";
K = the model's outputs, D = the feature node's size.
"""

from __future__ import annotations

import math

from lnn.formats.errors import LnnFormatError, control_character

SCORES = ("msp", "energy", "mahalanobis", "knn")
SCORE_TENSORS = {"mahalanobis": ("gate.class_means", "gate.precision"), "knn": ("gate.train_features",)}
LOGIT_SCORES = ("energy",)                 # meaningless on a model whose last layer is a softmax
GATE_KEYS = {"feature", "scores", "thresholds", "rule"}
GATE_OPTIONAL_KEYS = {"subject", "knn_k", "photo_checks", "fitted"}
TENSOR_PREFIX = "gate."
# photo check thresholds: name -> (lowest, highest) allowed value; see lnn/runtime/photo_checks.py
PHOTO_CHECKS = {
    "min_side": (1, 1 << 20),             # pixels: a shorter side below this is too small
    "check_size": (16, 4096),             # pixels: side of the grey copy the checks measure
    "dark_below": (0, 255),               # 99th percentile grey level (0-255) below this: too dark
    "bright_above": (0, 255),             # 1st percentile grey level above this: overexposed
    "bright_share_above": (0, 1),         # share of blown-out pixels (grey >= 250) above this: overexposed
    "blur_below": (0, 1e9),               # variance of the Laplacian below this: blurred
    "leaf_fill_below": (0, 1),            # share of leaf-coloured pixels below this: leaf too small
}


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def model_outputs_probabilities(model) -> bool:
    """True when the last layer already ends in a softmax or sigmoid (the outputs are not logits)."""
    last = model.nodes[-1]
    activation = last.attrs if last.op in ("softmax", "sigmoid") else last.attrs.get("activation")
    return bool(activation) and activation.get("type") in ("softmax", "sigmoid")


def feature_node(model, name):
    return next((node for node in model.nodes if node.name == name), None)


def subject_problem(subject: str) -> str | None:
    """What is wrong with a gate's subject (the answer's words: "take a photo of a tomato leaf"), or None: it may
    hold no control character. The reader's rule, and lnn-eval's for --subject before it fits a gate."""
    character = control_character(subject)
    return (f"holds a control character ({character}), which would break or rewrite the lines an answer is "
            f"printed in") if character else None


def check_gate_metadata(metadata: dict, model) -> None:
    """Rules G1-G5, G7, G8: the gate's and calibration's metadata are well formed for this model."""
    gate = metadata.get("gate")
    if gate is not None:
        _check_gate(gate, model)
    _check_calibration(metadata.get("calibration", None), "calibration" in metadata, model)
    thresholds = metadata.get("thresholds")
    if thresholds is not None and not isinstance(thresholds, dict):                    # rule G8
        raise LnnFormatError(f"metadata: thresholds must be an object such as {{\"uncertain_below\": 0.5}}, "
                             f"not {type(thresholds).__name__}")
    if thresholds and "uncertain_below" in thresholds:
        value = thresholds["uncertain_below"]
        if not _number(value) or not 0 <= value <= 1:                                    # rule G8
            raise LnnFormatError(f"metadata: thresholds.uncertain_below must be a probability in [0, 1], not {value!r}")


def _check_gate(gate, model) -> None:
    if not isinstance(gate, dict) or not GATE_KEYS <= set(gate) or set(gate) - GATE_KEYS - GATE_OPTIONAL_KEYS:  # rule G1
        keys = sorted(gate) if isinstance(gate, dict) else type(gate).__name__
        raise LnnFormatError(f"metadata: gate must be an object with {', '.join(sorted(GATE_KEYS))} (optional: "
                             f"{', '.join(sorted(GATE_OPTIONAL_KEYS))}), not {keys}")
    node = feature_node(model, gate["feature"]) if isinstance(gate["feature"], str) else None
    if node is None or len(node.out_shape) != 1:                                         # rule G2
        raise LnnFormatError(f"metadata: gate.feature {gate['feature']!r} must name a node of the graph with a "
                             f"vector output (such as a global average pool)"
                             + (f"; {node.name!r} outputs {list(node.out_shape)}" if node is not None else ""))
    scores = gate["scores"]
    if (not isinstance(scores, list) or not scores or len(set(map(str, scores))) != len(scores)
            or any(score not in SCORES for score in scores)):                           # rule G3
        raise LnnFormatError(f"metadata: gate.scores must be a non-empty list of distinct scores out of "
                             f"{', '.join(SCORES)}, not {scores!r}")
    logit_scores = [score for score in scores if score in LOGIT_SCORES]
    if logit_scores and model_outputs_probabilities(model):
        raise LnnFormatError(f"metadata: gate score {logit_scores[0]!r} needs logits, but the model's last layer "
                             "ends in a softmax or sigmoid")
    thresholds = gate["thresholds"]
    if (not isinstance(thresholds, dict) or set(thresholds) != set(scores)
            or not all(_number(value) for value in thresholds.values())):               # rule G4
        raise LnnFormatError(f"metadata: gate.thresholds must hold one finite number for each score "
                             f"({', '.join(scores)}), not {thresholds!r}")
    if not isinstance(gate["rule"], str) or ("subject" in gate and (not isinstance(gate["subject"], str)
                                                                   or not gate["subject"])):
        raise LnnFormatError("metadata: gate.rule and gate.subject must be strings")
    problem = subject_problem(gate.get("subject", ""))
    if problem:
        raise LnnFormatError(f"metadata: gate.subject {problem}")
    if ("knn" in scores) != ("knn_k" in gate) or ("knn_k" in gate and not (
            isinstance(gate["knn_k"], int) and not isinstance(gate["knn_k"], bool) and gate["knn_k"] >= 1)):
        raise LnnFormatError("metadata: gate.knn_k (a positive integer) goes with the knn score, and only with it")
    checks = gate.get("photo_checks")
    if checks is not None:
        bad = (not isinstance(checks, dict) or set(checks) - set(PHOTO_CHECKS)
               or not all(_number(v) and PHOTO_CHECKS[k][0] <= v <= PHOTO_CHECKS[k][1] for k, v in checks.items()))
        if bad:                                                                          # rule G5
            raise LnnFormatError(f"metadata: gate.photo_checks must map known checks ({', '.join(PHOTO_CHECKS)}) to "
                                 f"numbers in their ranges, not {checks!r}")


def _check_calibration(calibration, present: bool, model) -> None:
    if not present:
        return
    if (not isinstance(calibration, dict) or set(calibration) != {"temperature", "rule"}
            or not _number(calibration["temperature"]) or not calibration["temperature"] > 0
            or not isinstance(calibration["rule"], str)):                               # rule G7
        raise LnnFormatError(f"metadata: calibration must be {{\"temperature\": a positive number, \"rule\": text}}, "
                             f"not {calibration!r}")
    if model_outputs_probabilities(model):
        raise LnnFormatError("metadata: calibration divides logits by a temperature, but the model's last layer "
                             "ends in a softmax or sigmoid")


def gate_tensor_shapes(metadata: dict, model, stored_shapes: dict | None = None) -> dict:
    """{tensor name: shape} the gate of this (already checked) metadata needs, in the order they are stored.

    The knn score's stored feature count M is free: it is read from `stored_shapes` when given."""
    gate = metadata.get("gate")
    if gate is None:
        return {}
    size = feature_node(model, gate["feature"]).out_shape[0]
    classes = model.output_shape[0] if len(model.output_shape) == 1 else math.prod(model.output_shape)
    shapes = {}
    for score in SCORES:
        if score not in gate["scores"]:
            continue
        if score == "mahalanobis":
            shapes["gate.class_means"] = (classes, size)
            shapes["gate.precision"] = (size, size)
        elif score == "knn":
            stored = (stored_shapes or {}).get("gate.train_features")
            rows = stored[0] if stored and len(stored) == 2 else None
            shapes["gate.train_features"] = (rows, size)
    return shapes


def check_gate_tensor_shapes(shapes: dict, stored: dict) -> None:
    """Rule G6 for tensors present: each has its shape (None in `shapes` matches any positive size)."""
    for name, shape in shapes.items():
        have = tuple(stored[name])
        if len(have) != len(shape) or any(want is not None and want != got for want, got in zip(shape, have)):
            raise LnnFormatError(f"tensor {name!r} has shape {list(have)}, the gate needs "
                                 f"{['M' if s is None else s for s in shape]}")                # rule G6
