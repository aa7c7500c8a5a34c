"""Test vectors a .bin may carry (formats/SPEC.md rules V1-V2): one crafted bad file per rule.

Files are crafted with test_binfile.py's independent writer (build / join) from the tiny model ([3, 6, 6]
in, 3 out) plus two vectors: test.inputs [2, 3, 6, 6] and test.outputs [2, 3].
"""

import re

import numpy as np
import pytest

from conftest import REPO
from lnn.formats.binfile import build_metadata, encode_bin, graph_of, parse_bin_bytes
from lnn.formats.errors import ModelSpecError
from lnn.formats.vectors import TOLERANCE, difference
from test_binfile import FLOAT16, FLOAT32, Tensor, build, canonical, join, refused, tiny, tiny_tensors  # noqa: F401
from test_gate_format import gate_metadata, gate_tensors

COUNT = 2
DROP = object()


def vector_metadata(model, base=None, **changes) -> dict:
    meta = dict(base or build_metadata(model))
    meta["test_vectors"] = {"count": COUNT, "inputs": "2 normal draws", "outputs": "a test"}
    for key, value in changes.items():
        if value is DROP:
            del meta["test_vectors"][key]
        else:
            meta["test_vectors"][key] = value
    return meta


def vector_tensors(count=COUNT, input_shape=(3, 6, 6), outputs=3, code=FLOAT32) -> list:
    rng = np.random.default_rng(2)
    inputs = rng.standard_normal((count, *input_shape)).astype("<f4")
    out = rng.standard_normal((count, outputs)).astype("<f2" if code == FLOAT16 else "<f4")
    return [Tensor(b"test.inputs", FLOAT32, inputs.shape, inputs.tobytes()),
            Tensor(b"test.outputs", code, out.shape, out.tobytes())]


def crafted(model, weights, meta=None, tensors=None) -> bytes:
    meta = vector_metadata(model) if meta is None else meta
    extra = vector_tensors() if tensors is None else tensors
    return join(build(canonical(graph_of(model)), canonical(meta), tiny_tensors(model, weights) + extra))


def as_arrays(tensors) -> dict:
    return {t.name.decode(): np.frombuffer(t.raw, "<f4").reshape(t.shape) for t in tensors}


def test_a_good_file_with_vectors_loads_and_matches_the_writer(tiny):
    model, weights = tiny
    data = crafted(model, weights)
    loaded = parse_bin_bytes(data, "vectors.bin")
    inputs, outputs = loaded.test_vectors
    assert inputs.shape == (COUNT, 3, 6, 6) and outputs.shape == (COUNT, 3) and inputs.dtype == np.float32
    assert encode_bin(model, {**weights, **as_arrays(vector_tensors())}, vector_metadata(model)) == data


def test_vectors_come_after_the_gate_and_both_load(tiny):
    model, weights = tiny
    meta = vector_metadata(model, gate_metadata(model))
    data = crafted(model, weights, meta, gate_tensors() + vector_tensors())
    loaded = parse_bin_bytes(data, "both.bin")
    assert list(loaded.tensors)[-4:] == ["gate.class_means", "gate.precision", "test.inputs", "test.outputs"]
    refused(crafted(model, weights, meta, vector_tensors() + gate_tensors()), r"not stored in the graph's layer order")


def test_a_file_without_vectors_still_loads(tiny):
    model, weights = tiny
    loaded = parse_bin_bytes(join(build(canonical(graph_of(model)), canonical(build_metadata(model)),
                                        tiny_tensors(model, weights))), "old.bin")
    assert loaded.test_vectors is None


V_CASES = {
    "V1": [("not-an-object", dict(meta="four"), None, r"test_vectors must be"),
           ("count-zero", dict(count=0), None, r"test_vectors must be .*1 to 16"),
           ("count-over-limit", dict(count=17), vector_tensors(count=17), r"test_vectors must be"),
           ("count-bool", dict(count=True), None, r"test_vectors must be"),
           ("unknown-key", dict(tolerance=1.0), None, r"test_vectors must be"),
           ("no-outputs-text", dict(outputs=DROP), None, r"test_vectors must be"),
           ("empty-inputs-text", dict(inputs=""), None, r"test_vectors must be")],
    "V2": [("tensor-missing", None, vector_tensors()[:1], r"needs tensor 'test.outputs' but the file has none"),
           ("count-mismatch", dict(count=3), None, r"'test.inputs' has shape \[2, 3, 6, 6\], the test vectors need \[3, 3, 6, 6\]"),
           ("wrong-input-shape", None, vector_tensors(input_shape=(3, 6, 5)), r"'test.inputs' has shape \[2, 3, 6, 5\]"),
           ("wrong-output-shape", None, vector_tensors(outputs=4), r"'test.outputs' has shape \[2, 4\]"),
           ("float16", None, vector_tensors(code=FLOAT16), r"'test.outputs': test vectors are float32, not float16"),
           ("out-of-order", None, vector_tensors()[::-1], r"not stored in the graph's layer order"),
           ("without-metadata", dict(meta=DROP), None, r"'test.inputs' belongs to no layer .*no test_vectors")],
}


@pytest.mark.parametrize("rule, changes, tensors, pattern",
                         [pytest.param(rule, changes, tensors, pattern, id=f"{rule}-{name}")
                          for rule, cases in V_CASES.items() for name, changes, tensors, pattern in cases])
def test_each_vector_rule_refuses_its_crafted_file(tiny, rule, changes, tensors, pattern):
    model, weights = tiny
    changes = dict(changes or {})
    whole = changes.pop("meta", None)
    meta = vector_metadata(model, **changes)
    if whole is DROP:
        del meta["test_vectors"]
    elif whole is not None:
        meta["test_vectors"] = whole
    refused(crafted(model, weights, meta, tensors), pattern)


def test_non_finite_vectors_are_refused_by_rule_51(tiny):
    model, weights = tiny
    tensors = vector_tensors()
    tensors[1].raw = np.float32("nan").tobytes() + tensors[1].raw[4:]
    refused(crafted(model, weights, None, tensors), r"tensor 'test.outputs' contains NaN or infinity")


def test_writer_refuses_vectors_that_do_not_fit(tiny):
    model, weights = tiny
    with pytest.raises(ModelSpecError, match="the test vectors need tensors"):
        encode_bin(model, weights, vector_metadata(model))
    bad = as_arrays(vector_tensors(outputs=4))
    with pytest.raises(ModelSpecError, match=r"test.outputs has shape \[2, 4\], the test vectors need \[2, 3\]"):
        encode_bin(model, {**weights, **bad}, vector_metadata(model))


def test_every_vector_rule_of_the_spec_has_a_crafted_file_and_a_check():
    spec = (REPO / "formats" / "SPEC.md").read_text(encoding="utf-8")
    section = spec.split("## Test vector rules", 1)[1].split("\n## ", 1)[0]
    numbers = set(re.findall(r"^(V\d+)\. ", section, flags=re.MULTILINE))
    assert numbers == set(V_CASES)
    source = "".join((REPO / "formats" / name).read_text(encoding="utf-8") for name in ("vectors.py", "binfile.py"))
    assert set(re.findall(r"# rule (V\d+)$", source, flags=re.MULTILINE)) == numbers
    assert f"{TOLERANCE:.0e}".replace("e-0", "e-") in section        # "1e-4"


def test_the_difference_is_scaled_by_the_outputs_and_fails_non_finite_values():
    stored = np.array([[10.0, -20.0]])
    assert difference(stored, stored) == 0
    assert difference(stored + [[0.0, 0.002]], stored) == pytest.approx(1e-4)      # 0.002 / 20
    small = np.array([[0.1, 0.2]])
    assert difference(small + 5e-5, small) == pytest.approx(5e-5)                  # scale at least 1
    assert difference(np.array([[np.nan, 0.0]]), stored) == float("inf")
