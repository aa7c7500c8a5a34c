"""The sequence ops against PyTorch: golden outputs and torch.onnx files made by
tests/goldens/make_series_goldens.py (committed, so no torch is needed here).

For each case the NumPy reference backend and the Numba CPU backend must give PyTorch's output, and
lnn-import of PyTorch's own ONNX export of the module must give it too."""

import json
from pathlib import Path

import numpy as np
import pytest

from lnn.formats.binfile import build_metadata, encode_bin, parse_bin_bytes
from lnn.formats.model import parse_model
from lnn.runtime import Session

GOLDENS = Path(__file__).parent.parent / "goldens" / "series"
CASES = sorted(path.stem for path in GOLDENS.glob("*.npz"))
TOLERANCE = 1e-5


def golden(case: str):
    data = np.load(GOLDENS / f"{case}.npz")
    model = parse_model(json.loads(str(data["description"])))
    weights = {key[len("param:"):]: data[key] for key in data.files if key.startswith("param:")}
    return model, weights, data["input"], data["expected"]


def session(model, weights, device: str) -> Session:
    return Session(parse_bin_bytes(encode_bin(model, weights, build_metadata(model))), device=device)


def test_the_fixtures_are_there():
    assert {"conv1d_same_even_bn_relu", "conv1d_stride_padding_depthwise", "pools_max_avg_global_avg",
            "global_max_pool"} <= set(CASES)


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("device", ["numpy", "cpu"])
def test_lnn_matches_pytorch(case, device):
    model, weights, x, expected = golden(case)
    got = session(model, weights, device).run(x)
    assert got.shape == expected.shape
    np.testing.assert_allclose(got, expected, rtol=0, atol=TOLERANCE)


@pytest.mark.parametrize("case", CASES)
def test_pytorch_onnx_export_imports_and_matches(case):
    pytest.importorskip("onnx")
    from lnn.formats.onnx_import import import_onnx

    model, weights, x, expected = golden(case)
    imported, imported_weights = import_onnx(GOLDENS / f"{case}.onnx")
    assert imported.input_shape == model.input_shape and imported.output_shape == model.output_shape
    assert imported.num_params <= model.num_params           # batch norms may come folded into the conv before
    np.testing.assert_allclose(session(imported, imported_weights, "numpy").run(x), expected, rtol=0, atol=TOLERANCE)
