"""lnn-infer: answers agree with Session.predict_image, batch mode skips and reports bad files, the
uncertainty threshold and advice come from the model's metadata, and a single image never imports Numba."""

import csv
import io
import os
import json
import subprocess
import sys

import cv2
import numpy as np
import pytest

import lnn
from cli_helpers import assert_one_line_error, reference_bin, run_command  # noqa: F401 (reference_bin: fixture)
from conftest import EXAMPLES, REFERENCE_MODELS, need
from hostile_images import HEIC_START, png_claiming, with_data_left_over
from lnn.formats.binfile import read_bin, write_bin
from lnn.runtime import resolve_device
from lnn.tools import infer
from lnn.tools.infer import main

LEAF_PHOTO = REFERENCE_MODELS / "leaf_256.jpg"


def digit_images(folder, count=4):
    """The reference digit samples written back as PNG files (real-looking inputs, not zeros)."""
    samples = np.load(need(REFERENCE_MODELS / "mnist_cnn.samples.npz"))["input"]
    folder.mkdir(exist_ok=True)
    paths = []
    for i in range(count):
        digit = samples[i % len(samples), 0] * 0.3081 + 0.1307
        pixels = np.clip(np.roll(digit, i // len(samples), axis=1) * 255, 0, 255).astype(np.uint8)
        paths.append(folder / f"digit_{i:02d}.png")
        assert cv2.imwrite(str(paths[-1]), pixels)
    return paths


def run_json(capsys, argv) -> tuple:
    status = main([str(a) for a in argv])
    captured = capsys.readouterr()
    return status, [json.loads(line) for line in captured.out.splitlines()], captured.err


def assert_matches_session(answer, session, image, top_k=3):
    expected = session.predict_image(image, top_k=top_k)
    assert [entry["display"] for entry in answer["top_k"]] == [label for label, _ in expected]
    # lnn-infer computes the images as one batch, predict_image one at a time: BLAS sums them in another order
    # (probabilities 2e-6 apart, relative, with NumPy 2.2's OpenBLAS on Python 3.10)
    np.testing.assert_allclose([entry["probability"] for entry in answer["top_k"]], [p for _, p in expected],
                               rtol=1e-5, atol=1e-6)
    assert answer["confidence"] == answer["top_k"][0]["probability"]


def test_mnist_json_matches_predict_image(reference_bin, tmp_path, capsys):
    model = reference_bin("mnist_cnn")
    images = digit_images(tmp_path / "digits")
    status, answers, err = run_json(capsys, ["--model", model, "--json", "--top-k", "4", *images])
    assert status == 0 and err == ""
    session = lnn.load(model, device="numpy")
    assert [a["file"] for a in answers] == [str(p) for p in images]
    for answer, image in zip(answers, images):
        assert_matches_session(answer, session, image, top_k=4)


def test_leaf_photo_json_matches_predict_image(reference_bin, capsys):
    model = reference_bin("leaf_cnn")
    status, answers, _ = run_json(capsys, ["--model", model, "--json", need(LEAF_PHOTO)])
    assert status == 0 and len(answers) == 1
    assert_matches_session(answers[0], lnn.load(model, device="numpy"), LEAF_PHOTO)


def test_human_output_names_the_best_label_with_percent_then_top_k(reference_bin, tmp_path, capsys):
    model = reference_bin("mnist_cnn")
    image = digit_images(tmp_path / "digits", 1)[0]
    assert main(["--model", str(model), str(image)]) == 0
    lines = capsys.readouterr().out.splitlines()
    (best, p), *_ = lnn.load(model, device="numpy").predict_image(image)
    assert lines[0] == f"{image}: {best} ({p:.1%})"
    assert len(lines) == 4 and lines[1].lstrip().startswith(f"1. {best}")


def test_csv_has_one_row_per_image_and_rank(reference_bin, tmp_path, capsys):
    images = digit_images(tmp_path / "digits", 2)
    assert main(["--model", str(reference_bin("mnist_cnn")), "--csv", "--top-k", "2", *map(str, images)]) == 0
    rows = list(csv.DictReader(io.StringIO(capsys.readouterr().out)))
    assert [(r["file"], r["rank"]) for r in rows] == [(str(p), str(k)) for p in images for k in (1, 2)]
    assert float(rows[0]["probability"]) >= float(rows[1]["probability"])


def model_with_metadata(source, out, uncertain_below):
    """A copy of `source` whose metadata carries an uncertainty threshold and advice per label."""
    original = read_bin(source)
    metadata = dict(original.metadata)
    metadata["thresholds"] = {"uncertain_below": uncertain_below}
    metadata["labels"] = [dict(label, advice=f"advice for {label['name']}") for label in metadata["labels"]]
    write_bin(out, original.model, original.tensors, metadata)
    return out


def test_confident_answer_shows_advice_and_uncertain_one_asks_for_a_clearer_photo(reference_bin, tmp_path, capsys):
    image = digit_images(tmp_path / "digits", 1)[0]
    confident = model_with_metadata(reference_bin("mnist_cnn"), tmp_path / "low.bin", 0.01)
    assert main(["--model", str(confident), str(image)]) == 0
    out = capsys.readouterr().out
    best = lnn.load(confident, device="numpy").predict_image(image)[0][0]
    assert f"advice: advice for {best}" in out and "uncertain" not in out

    doubtful = model_with_metadata(reference_bin("mnist_cnn"), tmp_path / "high.bin", 1.0)
    assert main(["--model", str(doubtful), str(image)]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0].startswith(f"{image}: uncertain (best guess")
    assert "clearer photo of a single leaf" in out and "advice" not in out
    status, answers, _ = run_json(capsys, ["--model", doubtful, "--json", image])
    assert answers[0]["uncertain"] is True and "advice" not in answers[0]


def test_folder_expands_to_its_images_sorted_case_insensitively(tmp_path):
    for name in ("b.JPG", "a.png", "c.WebP", "notes.txt", "d.jpeg"):
        (tmp_path / name).write_bytes(b"x")
    (tmp_path / "sub.png").mkdir()
    paths, problems = infer.expand_inputs([str(tmp_path), "loose.jpg"])
    assert [p.name for p in paths] == ["a.png", "b.JPG", "c.WebP", "d.jpeg", "loose.jpg"] and problems == []


def test_device_policy_few_images_numpy_many_numba():
    assert infer.choose_device("auto", 1) == "numpy"
    assert infer.choose_device("auto", infer.FEW_IMAGES) == "numpy"
    assert infer.choose_device("auto", infer.FEW_IMAGES + 1) == resolve_device("auto")
    assert infer.choose_device("numpy", 100) == "numpy"
    assert infer.choose_device("cpu", 1) == "cpu"


def test_many_images_are_batched_and_agree_with_one_at_a_time(reference_bin, tmp_path, capsys):
    model = reference_bin("mnist_cnn")
    images = digit_images(tmp_path / "digits", infer.BATCH_SIZE + 3)       # two batches, the last partial
    status, answers, _ = run_json(capsys, ["--model", model, "--json", "--device", "numpy", tmp_path / "digits"])
    assert status == 0 and [a["file"] for a in answers] == [str(p) for p in images]
    session = lnn.load(model, device="numpy")
    for i in (0, infer.BATCH_SIZE - 1, infer.BATCH_SIZE + 2):
        assert_matches_session(answers[i], session, images[i])


def bad_images(folder):
    """A non-image named .jpg and a JPEG cut in half (from a real photo when ../shared has one)."""
    (folder / "text.jpg").write_text("not a picture\n")
    photo = LEAF_PHOTO.read_bytes() if LEAF_PHOTO.exists() else cv2.imencode(
        ".jpg", np.random.default_rng(0).integers(0, 255, (64, 64, 3), dtype=np.uint8))[1].tobytes()
    (folder / "truncated.jpg").write_bytes(photo[:len(photo) // 2])
    return folder / "text.jpg", folder / "truncated.jpg"


def test_batch_mode_reports_bad_files_skips_them_and_fails_at_the_end(reference_bin, tmp_path):
    folder = tmp_path / "mixed"
    good = digit_images(folder, 3)
    text, truncated = bad_images(folder)
    result = run_command("infer", "--model", reference_bin("mnist_cnn"), "--json", folder, tmp_path / "absent.png")
    assert result.returncode == 1
    records = [json.loads(line) for line in result.stdout.splitlines()]
    assert [r["file"] for r in records if "error" not in r] == [str(p) for p in good]
    assert [r["file"] for r in records if "error" in r] == [str(text), str(truncated), str(tmp_path / "absent.png")]
    errors = result.stderr.strip().splitlines()
    assert "Traceback" not in result.stderr and len(errors) == 3
    for line, path, why in zip(errors, (text, truncated, tmp_path / "absent.png"),
                               ("not an image", "truncated", "no such file")):
        assert line.startswith(f"lnn-infer: error: {path}: ") and why in line


@pytest.mark.parametrize("case, fragment", [
    ("missing_model", "no such file"),
    ("corrupt_model", "checksum mismatch"),
    ("json_as_model", "looks like JSON"),
    ("missing_image", "no such file"),
    ("text_named_jpg", "not an image"),
    ("truncated_jpeg", "truncated"),
    ("empty_folder", "holds no image files"),
])
def test_bad_input_is_one_line_on_stderr_and_a_failure(reference_bin, tmp_path, case, fragment):
    model = reference_bin("mnist_cnn")
    image = digit_images(tmp_path / "digits", 1)[0]
    text, truncated = bad_images(tmp_path)
    if case == "missing_model":
        model = tmp_path / "absent.bin"
    elif case == "corrupt_model":
        data = bytearray(model.read_bytes())
        data[len(data) // 2] ^= 0x01
        model = tmp_path / "corrupt.bin"
        model.write_bytes(bytes(data))
    elif case == "json_as_model":
        model = EXAMPLES / "reference" / "mnist_cnn.json"
    elif case == "missing_image":
        image = tmp_path / "absent.jpg"
    elif case == "text_named_jpg":
        image = text
    elif case == "truncated_jpeg":
        image = truncated
    elif case == "empty_folder":
        image = tmp_path / "empty"
        image.mkdir()
    result = run_command("infer", "--model", model, image)
    assert result.returncode == 1 and result.stdout == ""
    assert_one_line_error(result.stderr, "lnn-infer", fragment)


def test_missing_default_model_says_pass_model(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(infer, "DEFAULT_MODEL", tmp_path / "models" / "tomato_leaf.bin")
    assert main([str(tmp_path / "leaf.jpg")]) == 1
    assert_one_line_error(capsys.readouterr().err, "lnn-infer", "no bundled default model found", "--model")


def test_bad_options_are_usage_errors():
    result = run_command("infer", "--device", "gpu", "x.jpg")
    assert result.returncode == 2
    assert_one_line_error(result.stderr, "lnn-infer", "--device")
    result = run_command("infer", "--json", "--csv", "x.jpg")
    assert result.returncode == 2
    assert_one_line_error(result.stderr, "lnn-infer", "--csv")
    for threads in ("0", "two", "²", "1025"):          # ²: a digit to str.isdigit that int() cannot read
        result = run_command("infer", "--threads", threads, EXAMPLES / "leaves" / "healthy.jpg")
        assert result.returncode == 1 and result.stdout == ""
        assert_one_line_error(result.stderr, "lnn-infer", "threads")


def test_one_image_answers_without_importing_numba_or_tqdm(reference_bin, tmp_path):
    image = digit_images(tmp_path / "digits", 1)[0]
    code = ("import sys; from lnn.tools.infer import main; status = main(['--model', sys.argv[1], sys.argv[2]]); "
            "print(sorted(m for m in ('numba', 'tqdm') if m in sys.modules)); sys.exit(status)")
    result = subprocess.run([sys.executable, "-c", code, str(reference_bin("mnist_cnn")), str(image)],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines()[-1] == "[]"


def test_help_and_version():
    result = run_command("infer", "--help")
    assert result.returncode == 0 and "--top-k" in result.stdout and "--device" in result.stdout
    result = run_command("infer", "--version")
    assert result.returncode == 0 and result.stdout.strip() == f"lnn-infer (lnn) {lnn.__version__}"


def test_ctrl_c_exits_130_quietly(monkeypatch, capsys):
    def interrupted(inputs, recursive):
        raise KeyboardInterrupt

    monkeypatch.setattr(infer, "expand_inputs", interrupted)
    assert main(["x.jpg"]) == 130
    assert capsys.readouterr().err.strip() == ""


def test_a_backend_that_cannot_load_is_one_line(reference_bin, monkeypatch, tmp_path, capsys):
    import lnn.runtime

    # The cuda backend's module fails to import, as it does where CuPy is missing.
    monkeypatch.setitem(lnn.runtime.BACKENDS, "cuda", "cupy_missing_here")
    image = digit_images(tmp_path / "digits", 1)[0]
    assert main(["--model", str(reference_bin("mnist_cnn")), "--device", "cuda", str(image)]) == 1
    assert_one_line_error(capsys.readouterr().err, "lnn-infer", "the cuda backend cannot load", "cupy")


def test_importing_the_commands_loads_no_opencv_numba_or_tqdm():
    code = ("import sys, lnn.tools.export, lnn.tools.infer, lnn.tools.summary; "
            "print(sorted(m for m in ('cv2', 'numba', 'tqdm', 'onnx') if m in sys.modules))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and result.stdout.strip() == "[]", result.stderr


# --------------------------------------------------------------------------- hostile folders (issue 15)

def strict_json(line: str) -> dict:
    """json.loads refusing NaN and Infinity, which are not JSON."""
    def refuse(constant):
        raise ValueError(f"{constant} is not JSON")
    return json.loads(line, parse_constant=refuse)


def hostile_files(folder):
    """Among good photos: a pixel bomb, a non-image, a truncated JPEG, a JPEG with bytes after its end
    (good), an iPhone's HEIC photo, a named pipe; returns (good files, bad files) as lnn-infer lists them (sorted)."""
    photo = cv2.imencode(".jpg", np.random.default_rng(1).integers(0, 255, (64, 64, 3), dtype=np.uint8))[1].tobytes()
    folder.mkdir()
    (folder / "a_good.jpg").write_bytes(photo)
    (folder / "b_bomb.png").write_bytes(png_claiming(33000, 33000))
    (folder / "c_text.jpg").write_text("not a picture\n")
    (folder / "d_truncated.jpg").write_bytes(photo[:len(photo) // 2])
    (folder / "e_phone.jpg").write_bytes(photo + b"\x00trailer appended by a phone" * 10)
    (folder / "e_iphone.HEIC").write_bytes(HEIC_START + bytes(500))          # listed, not skipped: told what to do
    good = [folder / "a_good.jpg", folder / "e_phone.jpg"]
    bad = [folder / n for n in ("b_bomb.png", "c_text.jpg", "d_truncated.jpg", "e_iphone.HEIC")]
    if hasattr(os, "mkfifo"):
        os.mkfifo(folder / "f_pipe.jpg")
        bad.append(folder / "f_pipe.jpg")
    return good, bad


@pytest.mark.parametrize("style", ["--json", "--csv", "human"])
def test_every_good_photo_in_a_hostile_folder_is_answered_and_each_bad_one_gets_a_row(tmp_path, style):
    good, bad = hostile_files(tmp_path / "mixed")
    args = [tmp_path / "mixed"] + ([style] if style != "human" else [])
    result = subprocess.run([sys.executable, "-m", "lnn.tools.infer", *map(str, args)],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 1 and "Traceback" not in result.stderr
    errors = result.stderr.strip().splitlines()
    assert [line.split(": ")[2] for line in errors] == [str(p) for p in bad]
    assert all(line.startswith("lnn-infer: error: ") for line in errors)
    for path, why in zip(bad, ("over lnn's limit of 250,000,000 pixels", "not an image", "truncated", "a HEIC photo",
                               "named pipe")):
        assert why in next(line for line in errors if f" {path}: " in line)
    if style == "--json":
        records = [strict_json(line) for line in result.stdout.splitlines()]
        assert [r["file"] for r in records] == sorted(map(str, good + bad))
        assert {r["file"] for r in records if "label" in r} == set(map(str, good))
        assert all(set(r) == {"file", "error"} for r in records if "label" not in r)
        assert {r["error"] for r in records if "error" in r} == {line.split(": ", 3)[3] for line in errors}
    elif style == "--csv":
        rows = list(csv.DictReader(io.StringIO(result.stdout)))
        assert {row["file"] for row in rows if row["error"]} == set(map(str, bad))
        assert {row["file"] for row in rows if row["label"]} == set(map(str, good))
    else:
        assert {line.split(": ")[0] for line in result.stdout.splitlines() if not line.startswith(" ")} == set(map(str, good))


@pytest.mark.filterwarnings("error")                    # no RuntimeWarning lines either
def test_a_model_whose_output_is_nan_fails_that_image_and_prints_valid_json(tmp_path, capsys):
    source = read_bin(infer.DEFAULT_MODEL)
    weights = {**source.weights_fp32(), **source.gate_tensors}  # the network's and its gate's
    for param in ("weight", "bias"):                             # finite weights whose logits overflow to infinity
        key = source.model.nodes[-1].param_key(param)
        weights[key] = np.full_like(weights[key], 3e38)
    broken = tmp_path / "nan.bin"
    metadata = {key: value for key, value in source.metadata.items() if key != "test_vectors"}   # no longer true
    write_bin(broken, source.model, weights, metadata=metadata)
    leaf = sorted((EXAMPLES / "leaves").glob("*.jpg"))[0]
    status = main(["--model", str(broken), "--json", str(leaf)])
    out, err = capsys.readouterr()
    assert status == 1
    records = [strict_json(line) for line in out.splitlines()]
    assert records == [{"file": str(leaf), "error": infer.NOT_A_NUMBER}]
    assert err.strip() == f"lnn-infer: error: {leaf}: {infer.NOT_A_NUMBER}"


def test_a_folder_of_class_folders_suggests_recursive_which_answers_them_sorted(tmp_path, capsys):
    photo = cv2.imencode(".png", np.random.default_rng(2).integers(0, 255, (40, 40, 3), dtype=np.uint8))[1].tobytes()
    for name in ("healthy/b.png", "healthy/a.png", "Early_blight/z.png", "Early_blight/deeper/y.png"):
        (tmp_path / "data" / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "data" / name).write_bytes(photo)
    assert main([str(tmp_path / "data")]) == 1
    out, err = capsys.readouterr()
    assert out == "" and err.strip() == (f"lnn-infer: error: {tmp_path / 'data'}: the folder holds no image files, only "
                                         f"2 sub-folders (Early_blight, healthy); pass --recursive to answer the images in them")
    assert main(["--recursive", "--json", str(tmp_path / "data")]) == 0
    files = [strict_json(line)["file"] for line in capsys.readouterr().out.splitlines()]
    assert files == [str(tmp_path / "data" / n) for n in
                     ("Early_blight/deeper/y.png", "Early_blight/z.png", "healthy/a.png", "healthy/b.png")]


def test_a_grey_photo_is_answered_with_a_note(tmp_path, capsys):
    grey = tmp_path / "grey.png"
    cv2.imwrite(str(grey), cv2.imread(str(sorted((EXAMPLES / "leaves").glob("*.jpg"))[0]), cv2.IMREAD_GRAYSCALE))
    assert main(["--json", str(grey)]) == 0
    record = strict_json(capsys.readouterr().out)
    assert len(record["notes"]) == 1 and record["notes"][0].startswith("a grey image given to a colour (RGB) model")
    assert main([str(grey)]) == 0
    assert "  note: a grey image given to a colour (RGB) model" in capsys.readouterr().out


def test_a_jpeg_with_data_left_over_after_its_image_is_answered_with_a_note(tmp_path, capsys):
    """Bytes before the end marker that no block uses (DJI drones write them; most damage to the data ends so):
    the same answer as the clean photo, and a note saying what to do if the photo looks wrong."""
    clean = sorted((EXAMPLES / "leaves").glob("*.jpg"))[0]
    (tmp_path / "drone.jpg").write_bytes(with_data_left_over(clean.read_bytes()))
    assert main(["--json", str(clean), str(tmp_path / "drone.jpg")]) == 0
    before, after = (strict_json(line) for line in capsys.readouterr().out.splitlines())
    assert after["label"] == before["label"] and after["confidence"] == pytest.approx(before["confidence"])
    assert before["notes"] == [] and len(after["notes"]) == 1
    assert "the JPEG's data ran on after its image ended" in after["notes"][0]
    assert main([str(tmp_path / "drone.jpg")]) == 0
    assert "  note: " in capsys.readouterr().out


def test_answers_that_are_not_diagnoses_carry_a_reason_and_an_instruction():
    from lnn.tools.infer import Answer

    labels = [{"name": "a", "display": "A", "advice": "do a"}, {"name": "b", "display": "B"}]
    probabilities = np.array([0.9, 0.1])
    sure = Answer("x.jpg", probabilities, labels, 2, 0.5)
    assert sure.as_dict()["reason"] is None and sure.as_dict()["advice"] == "do a" and not sure.uncertain
    gated = Answer("x.jpg", probabilities, labels, 2, 0.5, "not_a_leaf", "This does not look like a tomato leaf.")
    record = gated.as_dict()
    assert record["uncertain"] and record["reason"] == "not_a_leaf" and "advice" not in record
    assert record["instruction"] == "This does not look like a tomato leaf."
    assert gated.human_lines()[0] == "x.jpg: uncertain (not a leaf): This does not look like a tomato leaf."
    assert not any("%" in line for line in gated.human_lines())      # no disease score beside the refusal
    assert "No diagnosis" in gated.explanation and "%" not in gated.explanation
    unsure = Answer("x.jpg", np.array([0.45, 0.55]), labels, 2, 0.6)       # an old caller: the threshold only
    assert unsure.reason == "low_confidence" and "clearer photo" in unsure.as_dict()["instruction"]
    assert unsure.csv_rows()[0][infer.CSV_COLUMNS.index("reason")] == "low_confidence"
