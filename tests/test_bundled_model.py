"""The bundled tomato-leaf model: it loads, classifies the bundled sample photos, and refuses bad files."""

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import lnn
from conftest import EXAMPLES, REPO

MODEL = REPO / "models" / "tomato_leaf.bin"
SAMPLES = sorted((EXAMPLES / "leaves").glob("*.jpg"))


def test_bundled_model_carries_what_a_person_needs():
    session = lnn.load(MODEL, device="numpy")
    meta = session.metadata
    assert len(session.labels) == 10 and all(label["advice"] for label in session.labels)
    assert 0 < meta["thresholds"]["uncertain_below"] < 1
    assert "97." in meta["model_card"]["accuracy"] and "lnn-eval" in meta["model_card"]["accuracy"]
    assert meta["preprocess"]["color"] == "rgb" and session.input_shape == (3, 128, 128)


def test_the_example_description_card_has_no_placeholders_and_says_what_the_bundled_model_says():
    card = json.loads((EXAMPLES / "tomato_leaf.json").read_text(encoding="utf-8"))["model_card"]
    assert not [key for key, value in card.items() if "TO FILL" in str(value)]
    bundled = lnn.load(MODEL, device="numpy").metadata["model_card"]
    assert card["accuracy"] == bundled["accuracy"] and card["trained"] == bundled["trained"]


@pytest.mark.parametrize("device", ["numpy", "cpu"])
def test_bundled_test_vectors_are_two_sample_photos_and_pass_here(device):
    from lnn.runtime.vectors import check_session

    session = lnn.load(MODEL, device=device)
    inputs, outputs = session.bin.test_vectors
    assert session.metadata["test_vectors"]["inputs"] == "2 photos: healthy.jpg, late_blight.jpg"
    for x, name in zip(inputs, ("healthy", "late_blight")):
        assert np.array_equal(x, session.prepare_image(EXAMPLES / "leaves" / f"{name}.jpg"))
    names = [session.labels[i]["name"] for i in outputs.argmax(axis=1)]
    assert names == ["healthy", "late_blight"]
    assert check_session(session).passed


@pytest.mark.parametrize("device", ["numpy", "cpu"])
def test_bundled_samples_are_classified_as_their_file_names_say(device):
    assert len(SAMPLES) >= 6
    session = lnn.load(MODEL, device=device)
    names = {label["display"]: label["name"] for label in session.labels}
    for photo in SAMPLES:
        (best, probability), *_ = session.predict_image(photo)
        assert names[best] == photo.stem, f"{photo.name}: {best} ({probability:.2f})"
        assert probability >= session.metadata["thresholds"]["uncertain_below"]


def run_infer(*args, cwd=REPO):
    return subprocess.run([sys.executable, "-m", "lnn.tools.infer", *map(str, args)], cwd=cwd,
                          capture_output=True, text=True, timeout=120)


def test_main_job_command_answers_in_words_with_no_flags(tmp_path):
    done = run_infer(REPO / "examples" / "leaves" / "late_blight.jpg", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "Late blight" in done.stdout.splitlines()[0]


def test_a_corrupt_or_non_image_file_gets_one_clear_line(tmp_path):
    text = tmp_path / "notes.jpg"
    text.write_text("not a photo")
    truncated = tmp_path / "cut.jpg"
    truncated.write_bytes(SAMPLES[0].read_bytes()[:4000])
    for bad, fragment in ((text, "not an image"), (truncated, "truncated")):
        done = run_infer(bad)
        assert done.returncode != 0
        assert "Traceback" not in done.stderr and len(done.stderr.strip().splitlines()) == 1
        assert fragment in done.stderr and bad.name in done.stderr


def test_a_corrupt_model_gets_one_clear_line(tmp_path):
    damaged = bytearray(MODEL.read_bytes())
    damaged[len(damaged) // 2] ^= 0xFF
    (tmp_path / "damaged.bin").write_bytes(bytes(damaged))
    done = run_infer("--model", tmp_path / "damaged.bin", SAMPLES[0])
    assert done.returncode != 0 and "Traceback" not in done.stderr
    assert "checksum" in done.stderr and len(done.stderr.strip().splitlines()) == 1


def test_json_output_names_the_class_and_its_advice():
    done = run_infer("--json", SAMPLES[0])
    assert done.returncode == 0, done.stderr
    record = json.loads(done.stdout.splitlines()[0])
    assert Path(record["file"]).name == SAMPLES[0].name
    assert json.dumps(record).count("advice") >= 1


@pytest.mark.parametrize("optimization", ["disabled", "default"])
def test_onnx_export_gives_the_same_top1_on_every_bundled_sample(tmp_path, optimization):
    ort = pytest.importorskip("onnxruntime")
    from lnn.formats.binfile import read_bin
    from lnn.formats.onnx_export import export_bin_to_onnx

    export_bin_to_onnx(read_bin(MODEL), tmp_path / "tomato.onnx")
    options = ort.SessionOptions()
    if optimization == "disabled":
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    peer = ort.InferenceSession(str(tmp_path / "tomato.onnx"), options, providers=["CPUExecutionProvider"])
    session = lnn.load(MODEL, device="numpy")
    batch = np.stack([session.prepare_image(photo) for photo in SAMPLES])
    ours, theirs = session.run(batch), peer.run(None, {"input": batch})[0]
    np.testing.assert_allclose(theirs, ours, atol=1e-4)
    assert (theirs.argmax(1) == ours.argmax(1)).all()


def test_bundled_model_carries_a_gate_that_diagnoses_the_samples():
    session = lnn.load(MODEL, device="numpy")
    meta = session.metadata
    assert meta["gate"]["feature"] == "global_avg_pool_14" and meta["gate"]["scores"]
    assert "chosen on the outlier validation part" in meta["gate"]["rule"]
    assert meta["gate"]["fitted"]["outlier_validation_caught"] >= 0.95      # the fit's own measurement
    assert meta["calibration"]["temperature"] > 0 and meta["gate"]["photo_checks"]
    for photo in SAMPLES:
        answer = session.predict_image(photo)
        assert answer.reason is None and not answer.uncertain, (photo.name, answer.scores)


def test_bundled_model_says_not_a_tomato_leaf_for_outlier_test_photos():
    from conftest import DATA, need
    from lnn.train.outliers import split_outliers

    test = split_outliers(need(DATA / "outliers"))["test"]
    everyday = [p for p in test if p.parent.name == "everyday"][:12]
    done = run_infer("--json", *everyday)
    assert done.returncode == 0, done.stderr
    answers = [json.loads(line) for line in done.stdout.splitlines()]
    assert all(a["uncertain"] for a in answers) and {a["reason"] for a in answers} <= {
        "not_a_leaf", "blurred", "too_dark", "too_bright", "too_small"}
    assert sum(a["reason"] == "not_a_leaf" for a in answers) >= 10
    assert all("advice" not in a and a["instruction"] for a in answers)
    text = run_infer(everyday[0]).stdout
    assert "uncertain" in text.splitlines()[0] and "advice" not in text
