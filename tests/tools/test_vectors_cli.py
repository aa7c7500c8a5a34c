"""Test vectors through the commands: lnn-export stores them, lnn-doctor MODEL.bin runs them on this
machine's backends, and the field app's first start refuses a computer that computes something else
(a model whose stored outputs were changed stands in for such a computer), remembering a PASS."""

import queue

import numpy as np
import pytest

from cli_helpers import assert_one_line_error, run_command
from conftest import EXAMPLES
from lnn.formats.binfile import encode_bin, read_bin, write_atomic
from lnn.formats.model import parse_model
from lnn.formats.vectors import OUTPUTS
from lnn.runtime.reference import NumpyBackend
from lnn.tools.export import main as export_main

TINY = {"name": "tiny_leaf", "input_shape": [3, 8, 8], "layers": [
    {"type": "conv2d", "name": "conv", "out_channels": 4, "kernel_size": 3, "padding": 1, "activation": "relu"},
    {"type": "global_avg_pool"}, {"type": "linear", "name": "fc", "out_features": 3}],
    "labels": ["healthy", "early_blight", "late_blight"]}


@pytest.fixture(scope="module")
def tiny_bin(tmp_path_factory):
    import json

    folder = tmp_path_factory.mktemp("vectors")
    (folder / "tiny.json").write_text(json.dumps(TINY), encoding="utf-8")
    model = parse_model(TINY)
    rng = np.random.default_rng(3)
    np.savez(folder / "w.npz", **{key: rng.standard_normal(shape).astype(np.float32)
                                  for key, shape in model.param_shapes().items()})
    assert export_main([str(folder / "tiny.json"), "--weights", str(folder / "w.npz"), "-o", str(folder / "tiny.bin")]) == 0
    return folder / "tiny.bin"


def tampered(path, tmp_path, shift=1e-2):
    """A copy whose stored outputs are off by `shift` (what a machine computing something else would see)."""
    source = read_bin(path)
    tensors = dict(source.tensors)
    tensors[OUTPUTS] = tensors[OUTPUTS] + np.float32(shift)
    out = tmp_path / "tampered.bin"
    write_atomic(out, encode_bin(source.model, tensors, source.metadata, source.stored_dtypes))
    return out


def test_export_stores_reference_outputs_that_the_numpy_backend_reproduces(tiny_bin):
    loaded = read_bin(tiny_bin)
    inputs, outputs = loaded.test_vectors
    assert inputs.shape == (4, 3, 8, 8) and np.abs(inputs).max() > 0.5          # normal draws, not zeros
    assert np.array_equal(NumpyBackend(loaded.model, loaded.weights_fp32()).run(inputs[:1]), outputs[:1])
    assert "NumPy reference backend" in loaded.metadata["test_vectors"]["outputs"]


def test_fp16_re_export_recomputes_the_outputs_from_the_stored_weights(tiny_bin, tmp_path):
    half = tmp_path / "half.bin"
    assert export_main([str(tiny_bin), "-o", str(half), "--fp16"]) == 0
    full, halved = read_bin(tiny_bin), read_bin(half)
    assert np.array_equal(halved.test_vectors[0], full.test_vectors[0])               # the same inputs
    assert not np.array_equal(halved.test_vectors[1], full.test_vectors[1])
    expected = np.concatenate([NumpyBackend(halved.model, halved.weights_fp32()).run(x[None])
                               for x in halved.test_vectors[0]])
    assert np.array_equal(halved.test_vectors[1], expected)


def test_photos_as_test_inputs_and_none(tiny_bin, tmp_path):
    photos = tmp_path / "photos.bin"
    assert export_main([str(tiny_bin), "-o", str(photos), "--test-photos", str(EXAMPLES / "leaves")]) == 0
    loaded = read_bin(photos)
    assert loaded.metadata["test_vectors"]["count"] == 8 and "late_blight.jpg" in loaded.metadata["test_vectors"]["inputs"]
    assert export_main([str(tiny_bin), "-o", str(tmp_path / "none.bin"), "--test-vectors", "0"]) == 0
    assert read_bin(tmp_path / "none.bin").test_vectors is None


@pytest.mark.parametrize("args, fragment", [(["--test-vectors", "17"], "--test-vectors must be 0 to 16"),
                                            (["--test-photos", "nowhere.jpg"], "nowhere.jpg")])
def test_bad_vector_options_are_one_line(tiny_bin, tmp_path, args, fragment):
    result = run_command("export", tiny_bin, "-o", tmp_path / "x.bin", *args)
    assert result.returncode != 0
    assert_one_line_error(result.stderr, "lnn-export", fragment)


def doctor_lines(result) -> dict:
    return {line.split()[0]: line for line in result.stdout.splitlines()}


def test_doctor_passes_a_good_model_on_numpy_and_cpu(tiny_bin):
    result = run_command("doctor", tiny_bin)
    lines = doctor_lines(result)
    assert result.returncode == 0, result.stdout + result.stderr
    assert lines["numpy"].count("PASS") == 1 and "max difference 0 " in result.stdout
    assert lines["verdict"].split()[1] == "PASS"
    assert "2 test vectors" not in result.stdout and "4 test vectors on cpu" in result.stdout


def test_doctor_fails_a_machine_that_computes_something_else(tiny_bin, tmp_path):
    result = run_command("doctor", tampered(tiny_bin, tmp_path))
    assert result.returncode == 1
    verdict = doctor_lines(result)["verdict"]
    assert verdict.split()[1] == "FAIL" and "computes something else" in verdict
    assert "FAIL  4 test vectors on numpy, max difference" in result.stdout


def test_doctor_on_a_model_without_vectors_or_a_damaged_one(tiny_bin, tmp_path):
    assert export_main([str(tiny_bin), "-o", str(tmp_path / "none.bin"), "--test-vectors", "0"]) == 0
    result = run_command("doctor", tmp_path / "none.bin")
    assert result.returncode == 1 and "carries no test vectors" in doctor_lines(result)["model"]
    damaged = bytearray(tiny_bin.read_bytes())
    damaged[-10] ^= 0xFF
    (tmp_path / "damaged.bin").write_bytes(bytes(damaged))
    result = run_command("doctor", tmp_path / "damaged.bin")
    assert result.returncode == 1
    assert_one_line_error(result.stderr, "lnn-doctor", "checksum mismatch")


def load_in_worker(path):
    from lnn.tools.field_ui import Worker

    results = queue.Queue()
    Worker(results).load(path)
    return [results.get_nowait() for _ in range(results.qsize())]


def test_the_field_app_refuses_a_computer_that_fails_and_remembers_a_pass(tiny_bin, tmp_path, monkeypatch):
    pytest.importorskip("tkinter")
    from lnn.runtime import vectors

    monkeypatch.setenv("LNN_CACHE_DIR", str(tmp_path / "cache"))
    kinds = [message[0] for message in load_in_worker(tampered(tiny_bin, tmp_path))]
    assert kinds == ["preparing", "refused"]
    refused = load_in_worker(tampered(tiny_bin, tmp_path))[-1][2]
    assert "computes something else" in refused and "lnn-doctor" in refused and "\n" not in refused
    assert not (tmp_path / "cache" / "verdicts").exists() or not list((tmp_path / "cache" / "verdicts").iterdir())

    assert [message[0] for message in load_in_worker(tiny_bin)] == ["preparing", "ready"]
    assert len(list((tmp_path / "cache" / "verdicts").iterdir())) == 1

    def not_again(session):
        raise AssertionError("the vectors ran again on a computer that passed")
    monkeypatch.setattr(vectors, "check_session", not_again)
    assert [message[0] for message in load_in_worker(tiny_bin)] == ["preparing", "ready"]


def test_an_int8_export_stores_outputs_of_its_dequantized_weights_which_pass_on_cpu(tiny_bin, tmp_path):
    pytest.importorskip("numba")
    import lnn
    from lnn.runtime.vectors import check_session

    quantized = tmp_path / "int8.bin"
    assert export_main([str(tiny_bin), "-o", str(quantized), "--int8", "--force"]) == 0
    session = lnn.load(quantized, device="cpu")
    assert session.bin.stored_dtypes["conv.weight"] == "int8"
    assert not np.array_equal(session.bin.test_vectors[1], read_bin(tiny_bin).test_vectors[1])
    assert check_session(session).passed
