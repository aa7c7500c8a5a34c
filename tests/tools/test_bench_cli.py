"""lnn-bench: each backend measured in its own process on the model's real inputs (its test vectors or
photos), percentiles in order, a per-layer profile that covers every node, bad input as one line."""

import importlib.util
import json

import pytest

from cli_helpers import assert_one_line_error, run_command
from conftest import EXAMPLES
from test_vectors_cli import tiny_bin  # noqa: F401  (the fixture)
from lnn.formats.binfile import read_bin
from lnn.tools.export import main as export_main

QUICK = ("--runs", "3", "--warmup", "1")


def bench_json(*args) -> tuple:
    result = run_command("bench", *args, "--json", *QUICK)
    return result, (json.loads(result.stdout) if result.stdout.strip() else None)


def test_numpy_figures_are_ordered_and_the_inputs_are_the_test_vectors(tiny_bin):  # noqa: F811
    result, report = bench_json(tiny_bin, "--device", "numpy", "--batch", "3", "--profile")
    assert result.returncode == 0, result.stderr
    row = report["devices"]["numpy"]
    assert 0 < row["min_ms"] <= row["p50_ms"] <= row["p90_ms"] <= row["p99_ms"]
    assert row["load_ms"] > 0 and row["first_ms"] > 0 and row["peak_rss_bytes"] > 10 << 20
    assert report["batch"] == 3 and "4 test vector" in report["inputs"] and row["kernels"] is None
    assert row["threads"].startswith("numpy backend (no thread count of its own")
    nodes = [node.name for node in read_bin(tiny_bin).model.nodes]
    assert [layer["layer"] for layer in row["profile"]] == nodes and all(layer["ms"] >= 0 for layer in row["profile"])
    assert all(layer["threads"] is None for layer in row["profile"])       # NumPy's BLAS picks its own


def test_cpu_profile_names_every_node_once_in_its_fused_layers(tiny_bin):  # noqa: F811
    pytest.importorskip("numba")
    result, report = bench_json(tiny_bin, "--device", "cpu", "--profile", "--threads", "1")
    assert result.returncode == 0, result.stderr
    row = report["devices"]["cpu"]
    assert row["kernels"] in ("not cached yet", "from the cache", "ahead of time")
    assert row["threads"] == "cpu backend, 1 thread (as asked)"
    fused = [name for layer in row["profile"] for name in layer["layer"].split("+")]
    assert fused == [node.name for node in read_bin(tiny_bin).model.nodes]
    assert [layer["kind"] for layer in row["profile"]] == ["conv2d", "globalavgpool", "linear"]
    assert [layer["threads"] for layer in row["profile"]] == [1, 1, 1]


def test_photos_as_inputs_and_the_table(tiny_bin):  # noqa: F811
    result = run_command("bench", tiny_bin, "--device", "numpy", "--images", EXAMPLES / "leaves" / "healthy.jpg", *QUICK)
    assert result.returncode == 0, result.stderr
    assert "inputs: 1 photos: healthy.jpg" in result.stdout
    header, row, threads = result.stdout.splitlines()[1:4]
    assert header.split()[:3] == ["device", "load", "ms"] and row.split()[0] == "numpy"
    assert threads.split()[:2] == ["numpy", "numpy"] and "no thread count of its own" in threads


def test_a_model_without_vectors_and_bad_options_are_one_line(tiny_bin, tmp_path):  # noqa: F811
    assert export_main([str(tiny_bin), "-o", str(tmp_path / "none.bin"), "--test-vectors", "0"]) == 0
    cases = [((tmp_path / "none.bin",), "has no test vectors"), ((tmp_path / "missing.bin",), "no such file"),
             ((tiny_bin, "--batch", "0"), "--batch must be 1 to 4,096"), ((tiny_bin, "--device", "gpu"), "--device"),
             ((tiny_bin, "--threads", "0"), "--threads"), ((tiny_bin, "--images", tmp_path), "no photos")]
    for args, fragment in cases:
        result = run_command("bench", *args)
        assert result.returncode != 0 and result.stdout == ""
        assert_one_line_error(result.stderr, "lnn-bench", fragment)


def test_photos_for_a_series_model_are_one_line(tmp_path):
    import numpy as np

    from lnn.formats.binfile import write_bin
    from lnn.formats.model import parse_model

    model = parse_model({"name": "tiny_series", "input_shape": [1, 4],
                         "layers": [{"type": "flatten"}, {"type": "linear", "out_features": 2}],
                         "preprocess": {"kind": "series", "length": 4, "resample": "linear", "mean": [0.0], "std": [1.0]}})
    write_bin(tmp_path / "series.bin", model, {"linear_1.weight": np.ones((2, 4), np.float32),
                                               "linear_1.bias": np.zeros(2, np.float32)})
    result = run_command("bench", tmp_path / "series.bin", "--device", "numpy", "--images", EXAMPLES / "leaves" / "healthy.jpg")
    assert result.returncode == 1 and result.stdout == ""
    assert result.stderr.strip() == "lnn-bench: error: model 'tiny_series' takes series, not images: photos cannot be its inputs"
    exported = run_command("export", tmp_path / "series.bin", "-o", tmp_path / "again.bin", "--test-photos",
                           EXAMPLES / "leaves" / "healthy.jpg")
    assert exported.returncode == 1 and not (tmp_path / "again.bin").exists()
    assert exported.stderr.strip() == "lnn-export: error: model 'tiny_series' takes series, not images: photos cannot be its inputs"


@pytest.mark.skipif(importlib.util.find_spec("cupy") is not None, reason="CuPy is installed: cuda may work here")
def test_an_unavailable_backend_is_its_own_error_and_the_others_are_measured(tiny_bin):  # noqa: F811
    result, report = bench_json(tiny_bin, "--device", "numpy,cuda")
    assert result.returncode == 1
    assert "p50_ms" in report["devices"]["numpy"] and "cuda backend cannot load" in report["devices"]["cuda"]["error"]
    assert_one_line_error(result.stderr, "lnn-bench", "cuda:")
