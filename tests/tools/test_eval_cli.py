"""lnn-eval: metrics and confusion matrix against hand counts and Session.predict_image, the validation
split is lnn-train's, the uncertainty threshold follows its rule and travels in a copy of the .bin,
and bad input is one line."""

import csv
import json

import cv2
import numpy as np
import pytest

import lnn
from cli_helpers import assert_one_line_error, full_disk, run_command, temporaries
from lnn.formats.binfile import read_bin, write_bin
from lnn.formats.model import parse_model
from lnn.tools.eval import choose_threshold, main
from lnn.train.images import scan_folder, split_by_leaf

COLOURS = ("blue", "green", "red")          # sorted, as the class folders are


@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("LNN_CACHE_DIR", str(tmp_path / "cache"))


def colour_model(path, input_shape=(3, 8, 8)):
    """A tiny exported model: logits = 20 * mean of each RGB channel (0..1), so the dominant colour wins."""
    model = parse_model({
        "name": "colours", "input_shape": list(input_shape),
        "preprocess": {"color": "rgb", "scale": 1 / 255, "mean": [0, 0, 0], "std": [1, 1, 1]},
        "layers": [{"type": "global_avg_pool"}, {"type": "linear", "name": "fc", "out_features": 3}],
        "labels": [{"name": c, "display": c.capitalize() + " leaf"} for c in COLOURS],
    })
    rgb_index = {"red": 0, "green": 1, "blue": 2}
    weight = np.zeros((3, 3), np.float32)
    for row, colour in enumerate(COLOURS):
        weight[row, rgb_index[colour]] = 20.0
    write_bin(path, model, {"fc.weight": weight, "fc.bias": np.zeros(3, np.float32)})
    return path


def colour_folder(root, per_class=10):
    """Photos dominated by their folder's colour (random strength, random size); red/ holds 2 green ones."""
    rng = np.random.default_rng(1)
    bgr_channel = {"blue": 0, "green": 1, "red": 2}
    for colour in COLOURS:
        (root / colour).mkdir(parents=True)
        for i in range(per_class):
            shown = "green" if colour == "red" and i < 2 else colour
            h, w = rng.integers(10, 40, 2)
            image = rng.integers(0, 80, (h, w, 3), dtype=np.uint8)
            image[:, :, bgr_channel[shown]] = rng.integers(90, 255)
            cv2.imwrite(str(root / colour / f"photo_{i:02d}.png"), image)
    return root


def run_eval(capsys, *args):
    code = main([str(a) for a in args] + ["--device", "numpy", "--quiet"])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_all_photos_metrics_and_files(tmp_path, capsys):
    model, folder = colour_model(tmp_path / "m.bin"), colour_folder(tmp_path / "photos")
    code, out, err = run_eval(capsys, model, "--data", f"folder:{folder}", "--split", "all", "--out", tmp_path / "ev")
    assert code == 0, err
    assert "30 photos, accuracy 93.33%" in out
    # hand count: rows true (blue, green, red), columns predicted; two red-folder photos are green
    want = [[10, 0, 0], [0, 10, 0], [0, 2, 8]]
    rows = list(csv.reader(open(tmp_path / "ev" / "confusion.csv")))
    assert rows[0] == ["true \\ predicted", "Blue leaf", "Green leaf", "Red leaf"]
    assert [[int(v) for v in row[1:]] for row in rows[1:]] == want
    metrics = json.loads((tmp_path / "ev" / "metrics.json").read_text())
    assert metrics["accuracy"] == pytest.approx(28 / 30)
    assert metrics["classes"]["green"] == pytest.approx({"precision": 10 / 12, "recall": 1.0,
                                                         "f1": 2 * 10 / 22, "support": 10})
    assert metrics["classes"]["red"]["recall"] == pytest.approx(0.8) and metrics["classes"]["red"]["precision"] == 1
    assert "Green leaf" in out and "83.3%" in out
    # every prediction agrees with the runtime reading the file itself
    session = lnn.load(model, device="numpy")
    predictions = list(csv.DictReader(open(tmp_path / "ev" / "predictions.csv")))
    assert len(predictions) == 30
    for row in predictions:
        best, probability = session.predict_image(folder / row["file"], top_k=1)[0]
        assert best == row["predicted"].capitalize() + " leaf"
        assert float(row["confidence"]) == pytest.approx(probability, abs=1e-5)
    picture = cv2.imread(str(tmp_path / "ev" / "confusion.png"))
    assert picture is not None and picture.shape[0] > 200 and picture.shape[1] > 200


def test_validation_split_is_the_one_lnn_train_uses(tmp_path, capsys):
    model, folder = colour_model(tmp_path / "m.bin"), colour_folder(tmp_path / "photos")
    code, out, err = run_eval(capsys, model, "--data", f"folder:{folder}", "--out", tmp_path / "ev", "--seed", "3")
    assert code == 0, err
    _, files, labels, _ = scan_folder(folder)
    validation = sorted(files[i] for i in split_by_leaf(files, labels, 0.2, seed=3)[1])
    assert sorted(r["file"] for r in csv.DictReader(open(tmp_path / "ev" / "predictions.csv"))) == validation
    assert "6 photos" in out and "seed 3" in out


def brute_force_threshold(confidence, correct, keep):
    """The largest candidate t (a confidence value, rounded down to 4 places) keeping >= keep of the correct."""
    best = 0.0
    for candidate in np.unique(np.floor(confidence * 1e4) / 1e4):
        if np.mean(confidence[correct] >= candidate) >= keep:
            best = max(best, candidate)
    return best


def test_threshold_rule_against_brute_force():
    rng = np.random.default_rng(0)
    for keep in (0.9, 0.95, 0.99, 1.0):
        confidence = rng.uniform(0.3, 1.0, 500)
        correct = rng.random(500) < confidence
        chosen = choose_threshold(confidence, correct, keep)
        assert chosen["uncertain_below"] == pytest.approx(brute_force_threshold(confidence, correct, keep))
        assert chosen["correct_kept"] >= keep
        accepted = confidence >= chosen["uncertain_below"]
        assert chosen["coverage"] == pytest.approx(accepted.mean())
        assert chosen["accuracy_of_accepted"] == pytest.approx(correct[accepted].mean())
    with pytest.raises(lnn.LnnError, match="no photo"):
        choose_threshold(np.array([0.5]), np.array([False]))


@pytest.mark.parametrize("keep", [1e-10, 1e-3, 0.01, 0.1, 0.5, 0.7, 0.9, 0.99, 0.999, 1 - 1e-12, 1.0])
def test_threshold_rule_against_brute_force_for_any_keep_and_few_photos(keep):
    """Every keep in (0, 1], down to a tiny one (which indexed past the sorted answers), from 1 to 100 photos."""
    rng = np.random.default_rng(1)
    for photos in (1, 2, 3, 7, 10, 100):
        confidence = rng.uniform(0.3, 1.0, photos)
        correct = rng.random(photos) < confidence
        correct[0] = True
        chosen = choose_threshold(confidence, correct, keep)
        assert chosen["uncertain_below"] == pytest.approx(brute_force_threshold(confidence, correct, keep))
        assert chosen["correct_kept"] >= keep


def test_threshold_is_written_into_a_copy_that_lnn_infer_reads(tmp_path, capsys):
    model, folder = colour_model(tmp_path / "m.bin"), colour_folder(tmp_path / "photos")
    copy = tmp_path / "with_threshold.bin"
    code, out, err = run_eval(capsys, model, "--data", f"folder:{folder}", "--split", "all", "--keep", "0.9",
                              "--write-threshold", copy, "--out", tmp_path / "ev")
    assert code == 0, err
    predictions = list(csv.DictReader(open(tmp_path / "ev" / "predictions.csv")))
    confidence = np.array([float(r["confidence"]) for r in predictions])
    correct = np.array([r["true"] == r["predicted"] for r in predictions])
    want = brute_force_threshold(confidence, correct, 0.9)
    assert f"uncertainty threshold: {want:.4f}" in out
    original, written = read_bin(model), read_bin(copy)
    assert written.metadata["thresholds"]["uncertain_below"] == pytest.approx(want)
    assert {k: v for k, v in written.metadata.items() if k != "thresholds"} == original.metadata
    for key, tensor in original.tensors.items():
        assert np.array_equal(written.tensors[key], tensor)
    # the least confident correct photo now falls under it in lnn-infer
    from lnn.tools.infer import main as infer_main

    lowest = min((r for r in predictions if r["true"] == r["predicted"]), key=lambda r: float(r["confidence"]))
    assert infer_main(["--model", str(copy), "--json", "--device", "numpy", str(folder / lowest["file"])]) == 0
    answer = json.loads(capsys.readouterr().out)
    assert float(lowest["confidence"]) < want and answer["uncertain"] is True


def test_bad_input_is_one_line(tmp_path):
    folder = colour_folder(tmp_path / "photos", per_class=2)
    model = colour_model(tmp_path / "m.bin")
    garbage = tmp_path / "garbage.bin"
    garbage.write_bytes(b"\x89LNN\r\n\x1a\n" + bytes(40))
    result = run_command("eval", garbage, "--data", f"folder:{folder}")
    assert result.returncode == 1
    assert_one_line_error(result.stderr, "lnn-eval", "garbage.bin")
    result = run_command("eval", model, "--data", f"folder:{tmp_path / 'nowhere'}")
    assert result.returncode == 1
    assert_one_line_error(result.stderr, "lnn-eval", "nowhere", "no such folder")
    result = run_command("eval", model, "--data", str(folder))
    assert result.returncode == 1
    assert_one_line_error(result.stderr, "lnn-eval", "folder:DIR")


def test_unknown_class_folder_and_non_image_model(tmp_path, capsys):
    folder = colour_folder(tmp_path / "photos", per_class=2)
    (folder / "purple").mkdir()
    cv2.imwrite(str(folder / "purple" / "p.png"), np.full((9, 9, 3), 200, np.uint8))
    code, _, err = run_eval(capsys, colour_model(tmp_path / "m.bin"), "--data", f"folder:{folder}")
    assert code == 1 and "class folders the model does not know: purple" in err and len(err.splitlines()) == 1
    flat = parse_model({"name": "flat", "input_shape": [4], "layers": [{"type": "linear", "out_features": 3}],
                        "labels": list(COLOURS)})
    write_bin(tmp_path / "flat.bin", flat, {"linear_0.weight": np.ones((3, 4), np.float32),
                                             "linear_0.bias": np.zeros(3, np.float32)})
    code, _, err = run_eval(capsys, tmp_path / "flat.bin", "--data", f"folder:{folder}")
    assert code == 1 and "takes no images" in err


def test_a_full_disk_leaves_the_old_outputs_and_no_partial_file(tmp_path, capsys):
    model, folder = colour_model(tmp_path / "m.bin"), colour_folder(tmp_path / "photos", per_class=2)
    out = tmp_path / "ev"
    out.mkdir()
    (out / "confusion.csv").write_text("the old matrix\n")
    assert run_eval(capsys, model, "--data", f"folder:{folder}", "--split", "all")[0] == 0    # the photos' cache
    with full_disk():
        code, _, err = run_eval(capsys, model, "--data", f"folder:{folder}", "--split", "all", "--out", out)
    assert code == 1
    assert_one_line_error(err, "lnn-eval", "confusion.csv: No space left on device")
    assert (out / "confusion.csv").read_text() == "the old matrix\n"
    assert temporaries(out) == [] and sorted(p.name for p in out.iterdir()) == ["confusion.csv"]


def test_an_output_in_a_folder_that_cannot_exist_names_the_output_not_a_temporary_file(tmp_path, capsys):
    model, folder = colour_model(tmp_path / "m.bin"), colour_folder(tmp_path / "photos", per_class=2)
    (tmp_path / "a_file").write_text("")
    assert run_eval(capsys, model, "--data", f"folder:{folder}", "--split", "all")[0] == 0    # the photos' cache
    for out, problem in [(tmp_path / "a_file" / "x.bin", "Not a directory"),
                         (tmp_path / "no_folder" / "x.bin", "No such file or directory")]:
        code, _, err = run_eval(capsys, model, "--data", f"folder:{folder}", "--split", "all", "--write-threshold", out)
        assert code == 1 and err == f"lnn-eval: error: {out}: {problem}\n"


def test_an_unwritable_cache_is_one_warning_not_a_failure(tmp_path, monkeypatch, capsys):
    model, folder = colour_model(tmp_path / "m.bin"), colour_folder(tmp_path / "photos", per_class=2)
    (tmp_path / "a_file").write_text("")
    monkeypatch.setenv("LNN_CACHE_DIR", str(tmp_path / "a_file" / "cache"))      # cannot be created, even by root
    code, out, err = run_eval(capsys, model, "--data", f"folder:{folder}", "--split", "all")
    assert code == 0, err
    assert "6 photos, accuracy" in out
    assert [line for line in err.splitlines() if "warning" in line] == [next(
        line for line in err.splitlines() if line.startswith("warning: cannot write the image cache"))]


@pytest.mark.parametrize("option, fragment", [(["--seed", "-1"], "the split seed must be a non-negative integer, not -1"),
                                              (["--val-fraction", "1.5"], "between 0 and 1, not 1.5"),
                                              (["--subject", "tomato\nleaf"], "--subject holds a control character")])
def test_a_bad_split_is_one_line_before_decoding(tmp_path, capsys, option, fragment):
    model, folder = colour_model(tmp_path / "m.bin"), colour_folder(tmp_path / "photos", per_class=2)
    code, _, err = run_eval(capsys, model, "--data", f"folder:{folder}", *option)
    assert code == 1
    assert_one_line_error(err, "lnn-eval", fragment)
    assert not (tmp_path / "cache").exists()                    # refused before any photo was decoded


def test_the_copy_with_the_threshold_carries_this_evaluation_as_its_card_accuracy(tmp_path, capsys):
    model = parse_model({
        "name": "colours", "input_shape": [3, 8, 8], "model_card": {"accuracy": "TO FILL", "task": "colours"},
        "layers": [{"type": "global_avg_pool"}, {"type": "linear", "name": "fc", "out_features": 3}],
        "labels": list(COLOURS)})
    weight = np.zeros((3, 3), np.float32)
    weight[[0, 1, 2], [2, 1, 0]] = 20.0                         # blue, green, red rows read B, G, R of RGB
    write_bin(tmp_path / "m.bin", model, {"fc.weight": weight, "fc.bias": np.zeros(3, np.float32)})
    folder = colour_folder(tmp_path / "photos")
    code, out, err = run_eval(capsys, tmp_path / "m.bin", "--data", f"folder:{folder}", "--split", "all",
                              "--write-threshold", tmp_path / "t.bin")
    assert code == 0, err
    card = read_bin(tmp_path / "t.bin").metadata["model_card"]
    assert card["task"] == "colours"
    assert card["accuracy"] == (f"93.33% on 30 photos, {folder} (all photos): lnn-eval {tmp_path / 'm.bin'} "
                                f"--data folder:{folder} --split all.")


@pytest.mark.parametrize("flag", ["--write-threshold", "--write-gate"])
def test_a_copy_written_over_the_model_itself_is_refused_before_any_work(tmp_path, capsys, flag):
    """`--write-threshold m.bin` on m.bin itself replaced the model given with its copy: refused, before a photo
    is decoded, the model left as it was."""
    model, folder = colour_model(tmp_path / "m.bin"), colour_folder(tmp_path / "photos", per_class=2)
    original = model.read_bytes()
    gate = ["--fit-gate", "--outliers", tmp_path / "photos"] if flag == "--write-gate" else []
    code, _, err = run_eval(capsys, model, "--data", f"folder:{folder}", flag, model, *gate)
    assert code == 1
    assert err == (f"lnn-eval: error: {model}: the output is the same file as the input {model}; choose another "
                   f"output file (writing it would replace the input)\n")
    assert model.read_bytes() == original and not (tmp_path / "cache").exists()


def grey_folder(root, count=30):
    """Outlier photos for the colour model: grey, with a little noise (no dominant colour)."""
    rng = np.random.default_rng(2)
    (root / "grey").mkdir(parents=True)
    for i in range(count):
        image = np.clip(rng.integers(60, 200) + rng.normal(0, 3, (16, 16, 3)), 0, 255).astype(np.uint8)
        cv2.imwrite(str(root / "grey" / f"g_{i:02d}.png"), image)
    return root


def test_fit_gate_writes_a_gated_model_that_keeps_the_validation_photos_and_flags_outliers(tmp_path, capsys):
    from lnn.train.outliers import split_outliers

    model, folder = colour_model(tmp_path / "m.bin"), colour_folder(tmp_path / "photos", per_class=20)
    outliers = grey_folder(tmp_path / "outliers")
    code, out, err = run_eval(capsys, model, "--data", f"folder:{folder}", "--outliers", outliers, "--fit-gate",
                              "--write-gate", tmp_path / "gated.bin", "--subject", "coloured leaf")
    assert code == 0, err
    assert "expected calibration error" in out and "chosen: " in out and "mahalanobis" in out
    gated = read_bin(tmp_path / "gated.bin")
    meta = gated.metadata
    assert meta["gate"]["feature"] == "global_avg_pool_0" and meta["gate"]["subject"] == "coloured leaf"
    assert meta["calibration"]["temperature"] > 0 and "photo_checks" in meta["gate"]
    assert np.array_equal(gated.tensors["fc.weight"], read_bin(model).tensors["fc.weight"])
    session = lnn.load(tmp_path / "gated.bin", device="numpy")
    _, files, labels, _ = scan_folder(folder)
    validation = split_by_leaf(files, labels)[1]
    batch = np.stack([session.prepare_image(folder / files[i]) for i in validation])
    assert session.judge(batch).reasons.count(None) >= 0.97 * len(validation) - 1
    test = split_outliers(outliers)["test"]
    reasons = session.judge(np.stack([session.prepare_image(p) for p in test])).reasons
    assert reasons.count("not_a_leaf") >= 0.9 * len(test), reasons
    answer = session.predict_image(test[0])
    assert answer.reason in ("not_a_leaf", "too_small") and answer.uncertain
    # lnn-eval on the gated model reports its decision and the calibrated ECE
    code, out, _ = run_eval(capsys, tmp_path / "gated.bin", "--data", f"folder:{folder}")
    assert code == 0 and "at the model's temperature" in out and "the model's decision" in out


def test_fit_gate_needs_its_companions(tmp_path, capsys):
    model, folder = colour_model(tmp_path / "m.bin"), colour_folder(tmp_path / "photos")
    code, _, err = run_eval(capsys, model, "--data", f"folder:{folder}", "--fit-gate")
    assert code != 0 and "go together" in err and len(err.strip().splitlines()) == 1


def test_too_few_photos_for_a_validation_split_is_one_line_not_a_traceback(tmp_path, capsys):
    model, folder = colour_model(tmp_path / "m.bin"), colour_folder(tmp_path / "photos", per_class=2)
    code, _, err = run_eval(capsys, model, "--data", f"folder:{folder}")        # round(0.2 * 2) = 0 per class
    assert code == 1 and "Traceback" not in err
    assert_one_line_error(err.splitlines()[-1] + "\n", "lnn-eval", "no photo falls on the validation side of the split",
                          "--split all")


def test_fit_gate_with_no_decodable_outlier_validation_photo_is_one_line(tmp_path, capsys):
    from lnn.train.outliers import split_outliers

    model, folder = colour_model(tmp_path / "m.bin"), colour_folder(tmp_path / "photos")
    (tmp_path / "outliers").mkdir()
    for i in range(10):
        (tmp_path / "outliers" / f"bad_{i}.jpg").write_text("not a photo\n")
    assert split_outliers(tmp_path / "outliers")["validation"]           # some fall in the validation part
    code, _, err = run_eval(capsys, model, "--data", f"folder:{folder}", "--outliers", tmp_path / "outliers",
                            "--fit-gate", "--write-gate", tmp_path / "gated.bin")
    assert code == 1 and "Traceback" not in err
    lines = err.splitlines()
    assert lines[-1].startswith("lnn-eval: error: ") and "none of the" in lines[-1] and "could be decoded" in lines[-1]
    assert any(line.startswith("lnn-eval: skipped an outlier photo: ") for line in lines[:-1])
    assert not (tmp_path / "gated.bin").exists()
