"""The gate and calibration a .bin may carry (formats/SPEC.md rules G1-G8): one crafted bad file per rule.

Files are crafted with test_binfile.py's independent writer (build / join) from the tiny model plus a
gate on its flatten node (36 values, 3 classes): gate.class_means [3, 36], gate.precision [36, 36].
"""

import json
import re

import numpy as np
import pytest

from conftest import REPO
from lnn.formats.binfile import build_metadata, encode_bin, graph_of, parse_bin_bytes
from lnn.formats.errors import LnnFormatError, ModelSpecError
from test_binfile import FLOAT16, FLOAT32, Tensor, build, canonical, join, refused, tiny, tiny_tensors  # noqa: F401

FEATURE, CLASSES, SIZE = "flatten_3", 3, 36


def gate_metadata(model, **changes) -> dict:
    meta = build_metadata(model)
    meta["gate"] = {"feature": FEATURE, "scores": ["mahalanobis", "energy"],
                    "thresholds": {"mahalanobis": 50.0, "energy": -1.0}, "rule": "any score above its threshold",
                    "subject": "tomato leaf", "photo_checks": {"min_side": 64, "blur_below": 8.0}}
    meta["calibration"] = {"temperature": 1.5, "rule": "minimum NLL on validation"}
    meta["thresholds"] = {"uncertain_below": 0.5}
    for path, value in changes.items():
        target, *keys = path.split("__")
        holder = meta if not keys else meta[target]
        key = keys[-1] if keys else target
        if value is DROP:
            del holder[key]
        else:
            holder[key] = value
    return meta


DROP = object()


def gate_tensors(rows=SIZE, precision_dtype=FLOAT32, extra=(), means_shape=(CLASSES, SIZE)) -> list:
    rng = np.random.default_rng(1)
    means = rng.standard_normal(means_shape).astype("<f4")
    precision = np.eye(rows, dtype="<f4")
    raw = precision.astype("<f2").tobytes() if precision_dtype == FLOAT16 else precision.tobytes()
    return [Tensor(b"gate.class_means", FLOAT32, means.shape, means.tobytes()),
            Tensor(b"gate.precision", precision_dtype, precision.shape, raw), *extra]


def crafted(model, weights, meta=None, tensors=None) -> bytes:
    meta = gate_metadata(model) if meta is None else meta
    extra = gate_tensors() if tensors is None else tensors
    return join(build(canonical(graph_of(model)), canonical(meta), tiny_tensors(model, weights) + extra))


def test_a_good_gated_file_loads_and_matches_the_writer(tiny):
    model, weights = tiny
    data = crafted(model, weights)
    loaded = parse_bin_bytes(data, "gated.bin")
    assert list(loaded.gate_tensors) == ["gate.class_means", "gate.precision"]
    assert loaded.metadata["gate"]["feature"] == FEATURE
    gate = {t.name.decode(): np.frombuffer(t.raw, "<f4").reshape(t.shape) for t in gate_tensors()}
    assert encode_bin(model, {**weights, **gate}, gate_metadata(model)) == data


def test_a_file_without_a_gate_still_loads(tiny):
    model, weights = tiny
    loaded = parse_bin_bytes(join(build(canonical(graph_of(model)), canonical(build_metadata(model)),
                                        tiny_tensors(model, weights))), "old.bin")
    assert loaded.gate_tensors == {} and "gate" not in loaded.metadata


G_CASES = {
    "G1": [("not-an-object", dict(gate="mahalanobis"), None, r"gate must be an object"),
           ("unknown-key", dict(gate__colour="red"), None, r"gate must be an object"),
           ("missing-rule", dict(gate__rule=DROP), None, r"gate must be an object")],
    "G2": [("unknown-node", dict(gate__feature="nowhere"), None, r"gate.feature 'nowhere' must name a node"),
           ("not-a-vector", dict(gate__feature="conv"), None, r"'conv' outputs \[4, 6, 6\]")],
    "G3": [("unknown-score", dict(gate__scores=["mahalanobis", "magic"], gate__thresholds={"mahalanobis": 1, "magic": 2}),
            None, r"gate.scores must be a non-empty list"),
           ("repeated", dict(gate__scores=["energy", "energy", "mahalanobis"]), None, r"distinct"),
           ("empty", dict(gate__scores=[], gate__thresholds={}), gate_tensors()[:0], r"non-empty")],
    "G4": [("threshold-missing", dict(gate__thresholds={"mahalanobis": 50.0}), None, r"one finite number for each score"),
           ("threshold-not-number", dict(gate__thresholds={"mahalanobis": "50", "energy": 1}), None, r"one finite number"),
           ("knn-without-k", dict(gate__scores=["energy"], gate__thresholds={"energy": 1.0}, gate__knn_k=3), [],
            r"knn_k"),
           ("newline-in-subject", dict(gate__subject="leaf\nfake.jpg: Late blight"), None,
            r"gate.subject holds a control character \(\\n\)")],
    "G5": [("unknown-check", dict(gate__photo_checks={"sharpness": 3}), None, r"photo_checks must map known checks"),
           ("out-of-range", dict(gate__photo_checks={"leaf_fill_below": 2.0}), None, r"photo_checks")],
    "G6": [("tensor-missing", None, gate_tensors()[:1], r"needs tensor 'gate.precision'"),
           ("wrong-shape", None, gate_tensors(means_shape=(CLASSES + 1, SIZE)), r"'gate.class_means' has shape \[4, 36\]"),
           ("float16", None, gate_tensors(precision_dtype=FLOAT16), r"gate tensors are float32"),
           ("unused-gate-tensor", dict(gate=DROP), None, r"'gate.class_means' belongs to no layer"),
           ("out-of-order", None, gate_tensors()[::-1], r"not stored in the graph's layer order")],
    "G7": [("zero-temperature", dict(calibration={"temperature": 0, "rule": "x"}), None, r"calibration must be"),
           ("no-rule", dict(calibration={"temperature": 1.2}), None, r"calibration must be")],
    "G8": [("threshold-over-one", dict(thresholds={"uncertain_below": 1.5}), None, r"uncertain_below must be a probability"),
           ("thresholds-a-list", dict(thresholds=[1, 2]), None,
            r'^crafted.bin: metadata: thresholds must be an object such as \{"uncertain_below": 0.5\}, not list$'),
           ("thresholds-a-string", dict(thresholds="abc"), None, r"thresholds must be an object .*, not str$"),
           ("thresholds-a-number", dict(thresholds=7), None, r"thresholds must be an object .*, not int$")],
}


@pytest.mark.parametrize("rule, changes, tensors, pattern",
                         [pytest.param(rule, changes, tensors, pattern, id=f"{rule}-{name}")
                          for rule, cases in G_CASES.items() for name, changes, tensors, pattern in cases])
def test_each_gate_rule_refuses_its_crafted_file(tiny, rule, changes, tensors, pattern):
    model, weights = tiny
    meta = gate_metadata(model, **(changes or {}))
    if "gate" not in meta:
        meta.pop("calibration")
    refused(crafted(model, weights, meta, tensors), pattern)


def test_gate_scores_that_need_logits_are_refused_for_a_softmax_model(tiny):
    from lnn.formats.model import parse_model
    from test_binfile import TINY

    from lnn.tests.model_weights import random_weights

    description = json.loads(json.dumps(TINY))
    description["layers"][-1]["activation"] = "softmax"
    model = parse_model(description)
    weights = random_weights(model)
    refused(crafted(model, weights, gate_metadata(model, calibration=DROP)), r"'energy' needs logits")
    meta = gate_metadata(model, gate__scores=["mahalanobis"], gate__thresholds={"mahalanobis": 1.0})
    refused(crafted(model, weights, meta), r"calibration divides logits")


def test_writer_refuses_a_gate_without_its_tensors(tiny):
    model, weights = tiny
    with pytest.raises(ModelSpecError, match="the gate needs tensors"):
        encode_bin(model, weights, gate_metadata(model))


def test_every_gate_rule_of_the_spec_has_a_crafted_file_and_a_check():
    spec = (REPO / "formats" / "SPEC.md").read_text(encoding="utf-8")
    section = spec.split("## Gate and calibration rules", 1)[1].split("\n## ", 1)[0]
    numbers = set(re.findall(r"^(G\d+)\. ", section, flags=re.MULTILINE))
    assert numbers == set(G_CASES)
    source = "".join((REPO / "formats" / name).read_text(encoding="utf-8") for name in ("gate.py", "binfile.py"))
    assert set(re.findall(r"# rule (G\d+)$", source, flags=re.MULTILINE)) == numbers


def test_refused_gate_files_are_one_line_format_errors(tiny):
    model, weights = tiny
    with pytest.raises(LnnFormatError) as info:
        parse_bin_bytes(crafted(model, weights, gate_metadata(model, gate__feature=7)), "x.bin")
    assert "\n" not in str(info.value) and str(info.value).startswith("x.bin: ")
