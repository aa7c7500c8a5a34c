"""lnn-infer given bad series and table files among good ones: each bad file is one error line, the good ones
are still answered, the exit status is 1. Tiny generated models (nothing shared)."""

import json

import numpy as np
import pytest

from cli_helpers import assert_one_line_error, run_command
from conftest import EXAMPLES
from lnn.formats.binfile import write_bin
from lnn.formats.model import parse_model

TABLE = {"name": "tiny_table", "input_shape": [2], "layers": [{"type": "linear", "out_features": 2}],
         "labels": [{"name": "ok", "display": "ok"}, {"name": "faulty", "display": "faulty"}],
         "preprocess": {"kind": "table", "columns": ["a", "b"], "mean": [1.0, 2.0], "std": [1.0, 4.0]}}


@pytest.fixture(scope="module")
def table_bin(tmp_path_factory):
    path = tmp_path_factory.mktemp("table") / "table.bin"
    write_bin(path, parse_model(TABLE), {"linear_0.weight": np.eye(2, dtype=np.float32),
                                         "linear_0.bias": np.zeros(2, np.float32)})
    return path


def test_a_cell_over_the_csv_limit_loses_no_other_file(table_bin, tmp_path):
    good = tmp_path / "good.csv"
    good.write_text("a,b\n1,2\n3,4\n")
    big = tmp_path / "big.csv"
    big.write_text("a,b\n1,2\n3," + "9" * 200_000 + "\n")
    result = run_command("infer", "--model", table_bin, "--json", good, big, good)
    assert result.returncode == 1
    assert_one_line_error(result.stderr, "lnn-infer")
    assert result.stderr.strip() == (f"lnn-infer: error: {big}: line 3: a cell is longer than the csv module's "
                                     f"limit of 131,072 characters")
    records = [json.loads(line) for line in result.stdout.splitlines()]
    assert [(r["file"], r.get("row")) for r in records] == [(str(good), 1), (str(good), 2), (str(big), None),
                                                            (str(good), 1), (str(good), 2)]


SERIES = {"name": "tiny_series", "input_shape": [1, 4],
          "layers": [{"type": "flatten"}, {"type": "linear", "out_features": 2}],
          "labels": [{"name": "up", "display": "up"}, {"name": "down", "display": "down"}],
          "preprocess": {"kind": "series", "length": 4, "resample": "linear", "mean": [0.0], "std": [1.0]}}


@pytest.fixture(scope="module")
def series_bin(tmp_path_factory):
    path = tmp_path_factory.mktemp("series") / "series.bin"
    write_bin(path, parse_model(SERIES), {"linear_1.weight": np.ones((2, 4), np.float32),
                                          "linear_1.bias": np.zeros(2, np.float32)})
    return path


def test_a_data_file_among_photos_is_one_error_record_for_the_image_model(tmp_path):
    photo = EXAMPLES / "leaves" / "healthy.jpg"
    table = tmp_path / "rows.csv"
    table.write_text("a,b\n1,2\n")
    result = run_command("infer", "--json", photo, table)
    assert result.returncode == 1
    message = (f"{table}: model 'tomato_leaf' takes photos (.jpg, .jpeg, .png, .bmp, .tif, .tiff, .webp), "
               f"not series or table files")
    assert result.stderr.strip() == f"lnn-infer: error: {message}"
    first, second = [json.loads(line) for line in result.stdout.splitlines()]
    assert first["file"] == str(photo) and first["label"] == "healthy"
    assert second == {"file": str(table), "error": message.removeprefix(f"{table}: ")}


def test_a_photo_among_series_files_is_one_error_line_for_the_series_model(series_bin, tmp_path):
    photo = EXAMPLES / "leaves" / "healthy.jpg"
    series = tmp_path / "s.ts"
    series.write_text("@classLabel true up down\n@data\n1,2,3,4:up\n")
    result = run_command("infer", "--model", series_bin, series, photo, series)
    assert result.returncode == 1
    assert result.stderr.strip() == f"lnn-infer: error: {photo}: model 'tiny_series' takes series (.ts, .tsv, .arff), not images"
    assert [line.split(":")[0] for line in result.stdout.splitlines()] == [f"{series} row 1"] * 2


def test_a_value_beyond_float32_is_one_line_naming_it_without_warnings(series_bin, table_bin, tmp_path):
    series = tmp_path / "huge.ts"
    series.write_text("@classLabel true up down\n@data\n1,2,3,4:up\n1,2,1e308,4:up\n")
    result = run_command("infer", "--model", series_bin, series)
    assert result.returncode == 1
    assert result.stderr.strip() == (f"lnn-infer: error: {series}: line 4, channel 1, value 3: '1e308' is beyond "
                                     f"float32's range (±3.403e+38), in which the model computes")
    table = tmp_path / "huge.csv"
    table.write_text("b,a\n1,-1e300\n")
    result = run_command("infer", "--model", table_bin, table)
    assert result.stderr.strip() == (f"lnn-infer: error: {table}: line 2, column 'a': '-1e300' is beyond "
                                     f"float32's range (±3.403e+38), in which the model computes")


def test_lnn_eval_names_the_line_of_a_value_the_models_standardisation_takes_beyond_float32(tmp_path):
    """Column b's std of 0.5 doubles its values: 3e38 is a float32, its standardised value is not. lnn-eval reads
    the table with the model's preprocessing, as lnn-infer does, so the line names the file, line and column
    (it named only the row, after reading); a column the model does not take is left unread."""
    squeezed = {**TABLE, "name": "squeezed", "preprocess": {**TABLE["preprocess"], "std": [1.0, 0.5]}}
    model = tmp_path / "squeezed.bin"
    write_bin(model, parse_model(squeezed), {"linear_0.weight": np.eye(2, dtype=np.float32),
                                             "linear_0.bias": np.zeros(2, np.float32)})
    table = tmp_path / "t.csv"
    table.write_text("note,b,a,state\nx,1,2,ok\ny,3e38,1,faulty\n")
    result = run_command("eval", model, "--data", f"csv:{table}", "--target", "state", "--split", "all")
    assert result.returncode == 1
    assert result.stderr.strip() == (f"lnn-eval: error: {table}: line 3, column 'b': '3e38' overflows float32 "
                                     f"after the model's standardisation (x - mean) / std")
    table.write_text("note,b,a,state\nx,1,2,ok\ny,3,1,faulty\n")
    result = run_command("eval", model, "--data", f"csv:{table}", "--target", "state", "--split", "all")
    assert result.returncode == 0, result.stderr
    assert "2 rows" in result.stdout
