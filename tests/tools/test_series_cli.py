"""Series and tables through the commands: lnn-train / lnn-eval with ucr: and csv: data, lnn-infer on .ts and
.csv files, lnn-summary's per-layer plan memory and --length. Small generated data (nothing shared)."""

import json
import math
import subprocess
import sys

import numpy as np
import pytest

from cli_helpers import assert_one_line_error, run_command
from conftest import DATA, EXAMPLES, need
from lnn.formats.binfile import read_bin
from lnn.formats.errors import LnnInputError
from lnn.formats.model import parse_model
from lnn.tools.eval import main as eval_main
from lnn.tools.export import main as export_main
from lnn.tools.infer import main as infer_main
from lnn.tools.summary import main as summary_main
from lnn.tools.train import main as train_main
from lnn.train.plan import plan_memory

MLP = {"name": "series_mlp", "input_shape": "from_data",
       "layers": [{"type": "flatten"}, {"type": "linear", "out_features": 16, "activation": "relu"},
                  {"type": "linear", "out_features": "from_data"}],
       "optimizer": {"type": "adam", "lr": 0.01}, "training": {"epochs": 15, "batch_size": 8, "seed": 0}}


def toy_series(count: int, seed: int) -> list:
    """(label, [2, T_i]) pairs: a rising or a falling ramp with noise, offset 5 (so standardizing matters),
    lengths 18 to 24 (unequal: padded with their mean)."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(count):
        label = ("rise", "fall")[i % 2]
        t = np.linspace(0, 1, int(rng.integers(18, 25)))
        ramp = t if label == "rise" else 1 - t
        out.append((label, np.stack([5 + ramp, -3 + 0.5 * ramp]) + rng.normal(0, 0.1, (2, len(t)))))
    return out


def write_ts(path, rows):
    lines = ["@problemName Toy", "@timeStamps false", "@univariate false", "@dimensions 2", "@equalLength false",
             "@classLabel true rise fall", "@data"]
    lines += [":".join(",".join(f"{v:.5f}" for v in channel) for channel in series) + f":{label}"
              for label, series in rows]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")


@pytest.fixture(scope="module")
def toy_ucr(tmp_path_factory):
    folder = tmp_path_factory.mktemp("ucr") / "Toy"
    folder.mkdir()
    write_ts(folder / "Toy_TRAIN.ts", toy_series(40, 0))
    write_ts(folder / "Toy_TEST.ts", toy_series(30, 1))
    return folder


@pytest.fixture(scope="module")
def trained_series(toy_ucr, tmp_path_factory):
    run = tmp_path_factory.mktemp("run")
    description = run / "mlp.json"
    description.write_text(json.dumps(MLP))
    assert train_main([str(description), "--data", f"ucr:{toy_ucr}", "--out", str(run / "out"), "--quiet"]) == 0
    return run / "out" / "model.bin"


def test_train_stores_the_fitted_preprocessing_and_the_data_shape(trained_series, toy_ucr):
    bin_model = read_bin(trained_series)
    pre = bin_model.metadata["preprocess"]
    assert bin_model.model.input_shape == (2, 24) and pre["length"] == 24        # the longest training series
    assert pre["resample"] == "pad_mean"                                        # unequal lengths: padded
    assert [label["name"] for label in bin_model.model.labels] == ["rise", "fall"]   # @classLabel order
    from lnn.runtime.series import read_series_file, stack_series

    series = read_series_file(toy_ucr / "Toy_TRAIN.ts").series
    raw = stack_series(series, 24, "pad_mean").astype(np.float64)
    short = next(i for i, values in enumerate(series) if values.shape[1] < 24)
    np.testing.assert_allclose(raw[short, :, -1], series[short].mean(axis=1), rtol=1e-6)   # the series' own mean
    np.testing.assert_allclose(pre["mean"], raw.mean(axis=(0, 2)), rtol=1e-9)
    np.testing.assert_allclose(pre["std"], raw.std(axis=(0, 2)), rtol=1e-9)


def test_eval_on_the_test_split_writes_accuracy(trained_series, toy_ucr, tmp_path, capsys):
    assert eval_main([str(trained_series), "--data", f"ucr:{toy_ucr}", "--split", "test", "--out", str(tmp_path)]) == 0
    metrics = json.loads((tmp_path / "metrics.json").read_text())
    assert metrics["series"] == 30 and metrics["split"] == "test"
    assert metrics["accuracy"] >= 0.9
    predictions = (tmp_path / "predictions.csv").read_text().splitlines()
    assert len(predictions) == 31 and predictions[0] == "line,true,predicted,confidence"
    # the calibration error, as for photos: 15 equal bins of confidence, |accuracy - confidence| weighted by count
    rows = [line.split(",") for line in predictions[1:]]
    confidence = np.array([float(row[3]) for row in rows])
    correct = np.array([row[1] == row[2] for row in rows])
    bins = np.minimum((confidence * 15).astype(int), 14)
    ece = sum(abs(correct[bins == b].mean() - confidence[bins == b].mean()) * np.mean(bins == b)
              for b in range(15) if np.any(bins == b))
    assert metrics["expected_calibration_error"] == pytest.approx(ece, abs=1e-5)
    assert f"expected calibration error (15 bins) {metrics['expected_calibration_error']:.2%}" in capsys.readouterr().out


def test_infer_answers_every_series_and_a_bad_file_is_one_line(trained_series, toy_ucr, tmp_path, capsys):
    bad = tmp_path / "bad.ts"
    bad.write_text("@classLabel false\n@data\n1,2,oops:3,4,5\n")
    code = infer_main(["--model", str(trained_series), "--json", "--top-k", "1", str(toy_ucr / "Toy_TEST.ts"), str(bad)])
    out, err = capsys.readouterr()
    records = [json.loads(line) for line in out.splitlines()]
    assert code == 1
    assert [r["row"] for r in records[:-1]] == list(range(1, 31))
    truth = [label for label, _ in toy_series(30, 1)]
    assert np.mean([r["label"] == t for r, t in zip(records, truth)]) >= 0.9
    assert len(records[0]["top_k"]) == 1 and 0.5 <= records[0]["confidence"] <= 1
    assert records[-1]["file"] == str(bad) and "line 3, channel 1, value 3: 'oops' is not a number" in records[-1]["error"]
    assert err.count("\n") == 1 and "Traceback" not in err


def test_infer_text_is_one_line_per_series(trained_series, toy_ucr, capsys):
    assert infer_main(["--model", str(trained_series), str(toy_ucr / "Toy_TRAIN.ts")]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 40 and lines[0].startswith(f"{toy_ucr / 'Toy_TRAIN.ts'} row 1: ") and "top-2: " in lines[0]


def test_predict_series_matches_the_command(trained_series, toy_ucr, capsys):
    import lnn

    session = lnn.load(trained_series, device="numpy")
    series = toy_series(30, 1)
    answers = session.predict_series([s for _, s in series])
    assert infer_main(["--model", str(trained_series), "--json", str(toy_ucr / "Toy_TEST.ts")]) == 0
    records = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    for answer, record in zip(answers, records):
        assert answer[0][0] == record["display"] and answer[0][1] == pytest.approx(record["confidence"], abs=1e-5)


def test_series_errors_are_one_line(trained_series, toy_ucr, tmp_path):
    result = run_command("eval", trained_series, "--data", f"ucr:{tmp_path}", "--split", "test")
    assert result.returncode != 0
    assert_one_line_error(result.stderr, "lnn-eval", "no NAME_TRAIN file")
    result = run_command("infer", "--model", trained_series, EXAMPLES / "leaves" / "healthy.jpg")
    assert_one_line_error(result.stderr, "lnn-infer", "takes series (.ts, .tsv, .arff), not images")
    import lnn

    session = lnn.load(trained_series, device="numpy")
    assert session.decode_side() == 0                       # (lnn-field asks it before prepare_and_check says why)
    with pytest.raises(LnnInputError, match="takes no images"):
        session.prepare_and_check(EXAMPLES / "leaves" / "healthy.jpg")



def test_a_folder_of_several_datasets_gives_the_one_named_like_it(tmp_path):
    from lnn.formats.errors import LnnInputError
    from lnn.train.series import ucr_files

    folder = tmp_path / "Toy"
    folder.mkdir()
    for name in ("Toy", "Toy_eq"):
        for split, seed in (("TRAIN", 0), ("TEST", 1)):
            write_ts(folder / f"{name}_{split}.ts", toy_series(6, seed))
    assert {split: path.name for split, path in ucr_files(folder).items()} == {"train": "Toy_TRAIN.ts",
                                                                                 "test": "Toy_TEST.ts"}
    other = tmp_path / "Other"
    folder.rename(other)
    with pytest.raises(LnnInputError, match="several datasets .Toy, Toy_eq. and none named like the folder"):
        ucr_files(other)

# --------------------------------------------------------------------------- tables

def toy_table(path, rows: int = 120, seed: int = 0):
    """Two informative columns (a ring: class by radius, not linearly separable) and a noise column."""
    rng = np.random.default_rng(seed)
    lines = ["x,noise,y,kind"]
    for i in range(rows):
        kind = ("inner", "outer")[i % 2]
        radius, angle = (1.0 if kind == "inner" else 3.0) + rng.normal(0, 0.2), rng.uniform(0, 2 * np.pi)
        lines.append(f"{100 + radius * np.cos(angle):.4f},{rng.normal():.4f},{radius * np.sin(angle):.4f},{kind}")
    path.write_text("\n".join(lines) + "\n")
    return path


def test_table_train_eval_infer(tmp_path, capsys):
    table = toy_table(tmp_path / "ring.csv")
    run = tmp_path / "run"
    assert train_main([str(EXAMPLES / "tabular" / "mlp.json"), "--data", f"csv:{table}", "--target", "kind",
                       "--out", str(run), "--quiet", "--epochs", "30"]) == 0
    bin_model = read_bin(run / "model.bin")
    assert bin_model.metadata["preprocess"]["columns"] == ["x", "noise", "y"]
    assert bin_model.model.input_shape == (3,)
    assert eval_main([str(run / "model.bin"), "--data", f"csv:{table}", "--target", "kind", "--out", str(tmp_path / "e")]) == 0
    metrics = json.loads((tmp_path / "e" / "metrics.json").read_text())
    assert metrics["rows"] == 24 and metrics["accuracy"] >= 0.9                   # 20% of each class held out
    capsys.readouterr()
    reordered = tmp_path / "reordered.csv"                                         # columns by name, class left unread
    lines = table.read_text().splitlines()
    cells = [line.split(",") for line in lines]
    reordered.write_text("\n".join(",".join([c[3], c[2], c[0], c[1]]) for c in cells) + "\n")
    assert infer_main(["--model", str(run / "model.bin"), "--json", str(table), str(reordered)]) == 0
    records = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert len(records) == 240
    assert [r["label"] for r in records[:120]] == [r["label"] for r in records[120:]]
    truth = [c[3] for c in cells[1:]]
    assert np.mean([r["label"] == t for r, t in zip(records, truth)]) >= 0.9
    # int8, checked on the validation rows lnn-eval measured (a table model had no calibration kind: --force only)
    out = tmp_path / "int8.bin"
    assert export_main([str(run / "model.bin"), "-o", str(out), "--int8", "--calibration", f"csv:{table}",
                        "--target", "kind"]) == 0
    printed = capsys.readouterr().out
    assert "int8 accuracy" in printed and f"on 24 rows of {table} (validation split: seed 0, 20% per class)" in printed
    assert read_bin(out).stored_dtypes["fc1.weight"] == "int8"
    assert export_main([str(run / "model.bin"), "-o", str(out), "--int8", "--calibration", f"csv:{table}"]) == 1
    assert capsys.readouterr().err.strip() == (f"lnn-export: error: --calibration csv:{table} needs --target COLUMN "
                                               f"(the column holding the class)")
    assert export_main([str(run / "model.bin"), "-o", str(out), "--int8", "--calibration", f"ucr:{tmp_path}"]) == 1
    assert capsys.readouterr().err.strip() == (f"lnn-export: error: model {bin_model.model.name!r} takes table rows, so "
                                               f"ucr:{tmp_path} cannot calibrate it; give csv:FILE")


def test_table_errors_name_row_and_column(tmp_path):
    table = tmp_path / "t.csv"
    table.write_text("a,b,kind\n1,2,x\n3,,y\n")
    result = run_command("train", EXAMPLES / "tabular" / "mlp.json", "--data", f"csv:{table}", "--target", "kind",
                         "--out", tmp_path / "run")
    assert result.returncode != 0
    assert_one_line_error(result.stderr, "lnn-train", "line 3", "column 'b'", "missing value")
    result = run_command("train", EXAMPLES / "tabular" / "mlp.json", "--data", f"csv:{table}", "--out", tmp_path / "run")
    assert_one_line_error(result.stderr, "lnn-train", "needs --target COLUMN")


def test_a_table_or_series_of_one_class_is_refused_before_training(tmp_path):
    """Both trained a one-output model to a loss of 0 and exported it, exit 0."""
    table = tmp_path / "t.csv"
    table.write_text("a,b,kind\n1,2,ok\n3,4,ok\n5,6,ok\n")
    write_ts(tmp_path / "One_TRAIN.ts", [row for row in toy_series(6, 0) if row[0] == "rise"])
    write_ts(tmp_path / "One_TEST.ts", toy_series(4, 1))
    (tmp_path / "mlp.json").write_text(json.dumps(MLP))
    for data, source in [(["--data", f"csv:{table}", "--target", "kind"], table),
                         (["--data", f"ucr:{tmp_path}"], tmp_path / "One_TRAIN.ts")]:
        result = run_command("train", tmp_path / "mlp.json", *data, "--out", tmp_path / "run")
        assert_one_line_error(result.stderr, "lnn-train", f"{source}: holds one class only (", "two or more")
        assert not (tmp_path / "run").exists()


# --------------------------------------------------------------------------- lnn-summary memory

CONV = {"name": "conv_series", "input_shape": [3, 64],                # a series in, a series out (any length)
        "layers": [{"type": "conv1d", "out_channels": 16, "kernel_size": 5, "padding": "same"},
                   {"type": "batchnorm", "activation": "relu"},
                   {"type": "conv1d", "out_channels": 2, "kernel_size": 3, "padding": "same"}],
        "loss": "mse", "optimizer": {"type": "adam"}}


def per_layer(out: str) -> dict:
    """lnn-summary's per-layer plan table -> {layer: [activations, gradients, optimizer state] as printed}."""
    lines = out.split("per layer in that plan", 1)[1].splitlines()[2:]
    rows = {}
    for line in lines:
        if line.strip().startswith("-"):
            break
        name, *cells = line.split()
        rows[name] = " ".join(cells)
    return rows


def test_summary_memory_per_layer_follows_batch_and_length(tmp_path, capsys):
    description = tmp_path / "conv.json"
    description.write_text(json.dumps(CONV))
    for batch, length in ((4, 64), (8, 64), (4, 128)):
        args = [str(description), "--batch", str(batch)] + (["--length", str(length)] if length != 64 else [])
        assert summary_main(args) == 0
        out = capsys.readouterr().out
        assert f"per layer in that plan (batch {batch}, length {length}" in out
        model = parse_model({**CONV, "input_shape": [3, length]})
        layers = plan_memory(model, batch)["layers"]
        conv = next(row for row in layers if row["name"] == "conv1d_0")
        last = next(row for row in layers if row["name"] == "conv1d_2")
        params = 4 * (16 * 3 * 5 + 16)
        assert conv["optimizer_state"] == 2 * params                          # Adam: two copies of its parameters
        assert conv["gradients"] == params + batch * 16 * length * 4          # its weights' and its output's gradients
        assert conv["activations"] >= batch * 16 * length * 4                 # its output (plus saved windows)
        assert last["optimizer_state"] == 2 * 4 * (2 * 16 * 3 + 2)
        if (batch, length) == (4, 64):
            base = conv["activations"]
        elif batch == 8:
            assert conv["activations"] == 2 * base                          # linear in the batch
        else:                                                               # in the length (the padded input's
            assert conv["activations"] == pytest.approx(2 * base, rel=0.01)  # two kernel halves do not double)
        assert per_layer(out)["conv1d_0"].split()[0] != "0"


def test_summary_max_batch_shrinks_with_length(tmp_path, capsys):
    from lnn.tools.summary import largest_batch, usable_card_bytes

    description = tmp_path / "conv.json"
    description.write_text(json.dumps(CONV))
    found = {}
    for length in (1000, 4000):
        assert summary_main([str(description), "--max-batch", "--memory", "1GB", "--length", str(length)]) == 0
        printed = int(capsys.readouterr().out.split("largest training batch: ")[1].split()[0].rstrip(","))
        model = parse_model({**json.loads(description.read_text()), "input_shape": [3, length]})
        usable = usable_card_bytes(10**9)
        found[length] = batch = largest_batch(model, usable)
        assert printed == batch
        assert plan_memory(model, batch)["peak"] <= usable < plan_memory(model, batch + 1)["peak"]
    assert found[4000] < found[1000]


def test_summary_length_refusals(tmp_path):
    description = tmp_path / "conv.json"
    description.write_text(json.dumps(CONV))
    description.write_text(json.dumps({**CONV, "layers": CONV["layers"] + [{"type": "flatten"},
                                                                          {"type": "linear", "out_features": 3}]}))
    result = run_command("summary", description, "--length", "100")
    assert_one_line_error(result.stderr, "lnn-summary", "--length 100", "in_features")
    result = run_command("summary", EXAMPLES / "reference" / "mnist_mlp.json", "--length", "100")
    assert_one_line_error(result.stderr, "lnn-summary", "for series models")


# --------------------------------------------------------------------------- the default recipe, end to end

@pytest.mark.slow
def test_default_recipe_trains_italy_power_demand(tmp_path):
    data = need(DATA / "ucr" / "ItalyPowerDemand")
    result = subprocess.run([sys.executable, "-m", "lnn.tools.train", str(EXAMPLES / "series" / "default.json"),
                             "--data", f"ucr:{data}", "--out", str(tmp_path), "--quiet"],
                            capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stderr
    result = run_command("eval", tmp_path / "model.bin", "--data", f"ucr:{data}", "--split", "test", "--out",
                         tmp_path / "eval")
    assert result.returncode == 0, result.stderr
    accuracy = json.loads((tmp_path / "eval" / "metrics.json").read_text())["accuracy"]
    assert accuracy >= 0.96 and math.isfinite(accuracy)


def test_int8_export_of_a_series_model_is_checked_on_its_ucr_test_split(trained_series, toy_ucr, tmp_path, capsys):
    """--calibration ucr:DIR measures a series model as given and as int8 on NAME_TEST (as lnn-eval --split test);
    a kind that does not fit the model is one line naming what it takes."""
    out = tmp_path / "int8.bin"
    assert export_main([str(trained_series), "-o", str(out), "--int8", "--calibration", f"ucr:{toy_ucr}"]) == 0
    printed = capsys.readouterr().out
    assert "int8 accuracy" in printed and "on 30 series of" in printed and "Toy_TEST.ts (test split)" in printed
    assert read_bin(out).stored_dtypes["linear_1.weight"] == "int8"
    import lnn

    session = lnn.load(out, device="numpy")
    test = toy_series(30, 1)
    best = session.predict(session.prepare_series([series for _, series in test])).argmax(axis=1)
    assert np.mean([session.labels[i]["name"] == label for i, (label, _) in zip(best, test)]) >= 0.9
    assert export_main([str(trained_series), "-o", str(out), "--int8", "--calibration", f"mnist:{tmp_path}"]) == 1
    assert capsys.readouterr().err.strip() == (f"lnn-export: error: model 'series_mlp' takes series, so mnist:{tmp_path} "
                                               f"cannot calibrate it; give ucr:DIR")
