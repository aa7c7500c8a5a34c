"""lnn-export --int8: the accuracy gate (passes a model int8 keeps, refuses one it breaks unless --force),
and int8 and fp16 files working in lnn.load, lnn-infer and lnn-summary."""

import json

import cv2
import numpy as np
import pytest

import lnn
from cli_helpers import assert_one_line_error
from conftest import DATA, REPO, need
from lnn.formats.binfile import build_metadata, read_bin, write_bin
from lnn.formats.model import parse_model
from lnn.tools.export import main as export_main
from lnn.tools.infer import main as infer_main
from lnn.tools.summary import main as summary_main

SIDE = 8
HALVES = {
    "name": "halves", "input_shape": [1, SIDE, SIDE],
    "preprocess": {"color": "gray", "scale": 1 / 255, "mean": [0.0], "std": [1.0]},
    "layers": [{"type": "flatten"}, {"type": "linear", "name": "fc", "out_features": 2}],
    "labels": ["left", "right"],
}


def halves_folder(root, per_class=10):
    """Gray SIDE x SIDE photos: class `left` bright on the left half, `right` on the right half;
    pixel (0, 0) is always black."""
    rng = np.random.default_rng(0)
    for index, name in enumerate(("left", "right")):
        (root / name).mkdir(parents=True)
        for i in range(per_class):
            image = rng.integers(0, 60, (SIDE, SIDE), dtype=np.uint8)
            columns = slice(0, SIDE // 2) if index == 0 else slice(SIDE // 2, SIDE)
            image[:, columns] += 150
            image[0, 0] = 0
            cv2.imwrite(str(root / name / f"{name}_{i}.png"), image)
    return root


def halves_bin(path, outlier: float = 0.0):
    """The halves classifier, right on every photo: score = (left half - right half) brightness.
    `outlier` puts one huge weight per row on pixel (0, 0), which is always 0: harmless in float,
    but it sets each row's int8 scale, so every other weight rounds to 0 in int8."""
    model = parse_model(HALVES)
    sign = np.where(np.arange(SIDE) < SIDE // 2, 1.0, -1.0)
    row = np.tile(sign, SIDE).astype(np.float32)
    weight = np.stack([row, -row])
    weight[:, 0] = outlier
    write_bin(path, model, {"fc.weight": weight, "fc.bias": np.zeros(2, np.float32)}, build_metadata(model))
    return path


@pytest.fixture
def folder(tmp_path, monkeypatch):
    monkeypatch.setenv("LNN_CACHE_DIR", str(tmp_path / "cache"))
    return halves_folder(tmp_path / "photos")


def export(capsys, *argv):
    """(exit status, stdout, stderr) of lnn-export in this process (a usage error exits, with status 2)."""
    try:
        status = export_main([str(a) for a in argv])
    except SystemExit as leaving:
        status = leaving.code
    captured = capsys.readouterr()
    return status, captured.out, captured.err


def last_line(err: str) -> str:
    """The error line, after the progress lines decoding the calibration photos print."""
    assert "Traceback" not in err
    return err.strip().splitlines()[-1] + "\n"


def test_int8_that_keeps_accuracy_is_written(tmp_path, folder, capsys):
    source = halves_bin(tmp_path / "fp32.bin")
    out = tmp_path / "int8.bin"
    status, printed, err = export(capsys, source, "-o", out, "--int8", "--calibration", f"folder:{folder}")
    assert status == 0, err
    assert "int8 accuracy 100.00% vs 100.00% as given (+0.00 points) on 4 images" in printed
    assert read_bin(out).stored_dtypes == {"fc.weight": "int8", "fc.bias": "float32"}


def test_int8_that_loses_accuracy_is_refused_unless_forced(tmp_path, folder, capsys):
    source = halves_bin(tmp_path / "fp32.bin", outlier=1000.0)
    out = tmp_path / "int8.bin"
    status, printed, err = export(capsys, source, "-o", out, "--int8", "--calibration", f"folder:{folder}")
    assert status == 1 and printed == ""
    assert_one_line_error(last_line(err), "lnn-export", "int8 accuracy 50.00% vs 100.00% as given (-50.00 points)",
                          "loses more than 0.5 points, not written", "--force")
    assert not out.exists()

    status, printed, err = export(capsys, source, "-o", out, "--int8", "--calibration", f"folder:{folder}", "--force")
    assert status == 0 and "written because of --force" in err
    assert read_bin(out).stored_dtypes["fc.weight"] == "int8"
    assert np.all(read_bin(out).weights_fp32()["fc.weight"][:, 1:] == 0)      # what the gate caught


def test_int8_without_calibration_needs_force(tmp_path, capsys):
    source = halves_bin(tmp_path / "fp32.bin")
    out = tmp_path / "int8.bin"
    status, printed, err = export(capsys, source, "-o", out, "--int8")
    assert status == 1
    assert_one_line_error(err, "lnn-export", "--int8 needs --calibration folder:DIR, mnist:DIR, (a series model) ucr:DIR or (a table model) csv:FILE", "--force")
    assert not out.exists()
    status, printed, err = export(capsys, source, "-o", out, "--int8", "--force")
    assert status == 0 and "not checked" in err and out.exists()


@pytest.mark.parametrize("per_class", [1, 2])
def test_a_calibration_folder_too_small_for_a_validation_split_is_one_line(tmp_path, monkeypatch, capsys, per_class):
    # 1 or 2 photos per class: 20% of a class rounds to no photo, so the validation split was empty and
    # measuring accuracy on it crashed with a traceback (numpy.concatenate of nothing); now one line
    monkeypatch.setenv("LNN_CACHE_DIR", str(tmp_path / "cache"))
    photos = halves_folder(tmp_path / "photos", per_class=per_class)
    out = tmp_path / "int8.bin"
    status, printed, err = export(capsys, halves_bin(tmp_path / "fp32.bin"), "-o", out, "--int8",
                                  "--calibration", f"folder:{photos}")
    assert status == 1 and printed == ""
    assert_one_line_error(last_line(err), "lnn-export", "no photo falls on the validation side of the split",
                          f"of its {2 * per_class} photos", "int8 cannot be checked", "--calibration")
    assert not out.exists()


@pytest.mark.parametrize("argv, fragment", [
    (["--int8", "--calibration", "photos"], "--calibration must look like folder:DIR, mnist:DIR, (a series model) ucr:DIR or (a table model) csv:FILE"),
    (["--int8", "--calibration", "folder:/nonexistent"], "/nonexistent: no such folder"),
    (["--int8", "--calibration", "mnist:/nonexistent"], "takes [1, 8, 8], not MNIST's [1, 28, 28]"),
    (["--int8", "--fp16"], "choose one of --fp16 and --int8"),
    (["--force"], "--calibration and --force go with --int8"),
    (["--int8", "--calibration", "folder:photos", "--target", "kind"], "--target COLUMN goes with --calibration csv:FILE"),
    (["--int8", "--calibration", "csv:rows.csv", "--target", "kind"], "takes images, so csv:rows.csv cannot calibrate it; "
                                                                      "give folder:DIR or mnist:DIR"),
])
def test_bad_int8_arguments_are_one_line(tmp_path, capsys, argv, fragment):
    source = halves_bin(tmp_path / "fp32.bin")
    status, _, err = export(capsys, source, "-o", tmp_path / "out.bin", *argv)
    assert status in (1, 2)
    assert_one_line_error(err, "lnn-export", fragment)


@pytest.mark.slow
def test_trained_mnist_cnn_passes_the_gate_on_the_mnist_test_set(tmp_path, capsys):
    source = REPO / "examples" / "trained" / "mnist_cnn.bin"
    out = tmp_path / "int8.bin"
    status, printed, err = export(capsys, source, "-o", out, "--int8", "--calibration", f"mnist:{need(DATA / 'mnist')}")
    assert status == 0, err
    assert "on 10,000 images" in printed
    assert out.stat().st_size <= 0.3 * source.stat().st_size


# --------------------------------------------------------------------------- int8 and fp16 files in the other commands

@pytest.fixture(scope="module")
def compressed_tomato(tmp_path_factory):
    """The bundled tomato model re-exported as fp16 and as int8 (unchecked), with its fp32 original."""
    out = tmp_path_factory.mktemp("compressed")
    source = REPO / "models" / "tomato_leaf.bin"
    assert export_main([str(source), "-o", str(out / "fp16.bin"), "--fp16"]) == 0
    assert export_main([str(source), "-o", str(out / "int8.bin"), "--int8", "--force"]) == 0
    return {"fp32": source, "fp16": out / "fp16.bin", "int8": out / "int8.bin"}


LEAVES = sorted((REPO / "examples" / "leaves").glob("*.jpg"))


@pytest.mark.parametrize("kind", ["fp16", "int8"])
def test_load_runs_compressed_files_close_to_fp32(compressed_tomato, kind):
    reference = lnn.load(compressed_tomato["fp32"], device="numpy")
    session = lnn.load(compressed_tomato[kind], device="cpu")
    batch = np.stack([reference.prepare_image(path) for path in LEAVES[:3]])
    expected, got = reference.predict(batch), session.predict(batch)
    assert np.abs(got - expected).max() < 0.05                       # probabilities, not bit-equal
    assert got.argmax(axis=1).tolist() == expected.argmax(axis=1).tolist()


@pytest.mark.parametrize("kind", ["fp16", "int8"])
def test_infer_and_summary_take_compressed_files(compressed_tomato, kind, capsys):
    assert infer_main(["--model", str(compressed_tomato[kind]), "--json", str(LEAVES[0])]) == 0
    answer = json.loads(capsys.readouterr().out)
    assert answer["file"] == str(LEAVES[0]) and 0 < answer["confidence"] <= 1
    assert summary_main([str(compressed_tomato[kind])]) == 0
    printed = capsys.readouterr().out
    assert kind.replace("fp", "float") in printed


@pytest.mark.parametrize("compression", ["--int8", "--fp16"])
def test_a_compressed_bin_exports_to_onnx_as_its_widened_float_weights(tmp_path, capsys, compression):
    onnxruntime = pytest.importorskip("onnxruntime")
    model = parse_model({"name": "small", "input_shape": [2, 6, 6], "layers": [
        {"type": "conv2d", "name": "conv", "out_channels": 4, "kernel_size": 3, "activation": "relu"},
        {"type": "flatten"}, {"type": "linear", "name": "fc1", "out_features": 3}]})
    rng = np.random.default_rng(0)
    weights = {key: rng.normal(size=shape).astype(np.float32) for key, shape in model.param_shapes().items()}
    write_bin(tmp_path / "f32.bin", model, weights)
    args = ["--force"] if compression == "--int8" else []
    assert export_main([str(tmp_path / "f32.bin"), "-o", str(tmp_path / "small.bin"), compression, *args]) == 0
    assert export_main([str(tmp_path / "small.bin"), "--onnx", str(tmp_path / "small.onnx")]) == 0
    capsys.readouterr()
    x = rng.normal(size=(5, 2, 6, 6)).astype(np.float32)
    expected = lnn.load(tmp_path / "small.bin", device="numpy").run(x)          # the compressed model's own answers
    ort = onnxruntime.InferenceSession(str(tmp_path / "small.onnx"))
    np.testing.assert_allclose(ort.run(None, {ort.get_inputs()[0].name: x})[0], expected, rtol=1e-5, atol=1e-5)
    float_answers = lnn.load(tmp_path / "f32.bin", device="numpy").run(x)
    assert not np.allclose(expected, float_answers, rtol=0, atol=1e-7)          # the ONNX is the compressed one
