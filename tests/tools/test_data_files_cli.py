"""lnn-infer given bad series and table files among good ones: each bad file is one error line, the good ones
are still answered, the exit status is 1. Tiny generated models (nothing shared)."""

import json

import numpy as np
import pytest

from cli_helpers import assert_one_line_error, run_command
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
