"""lstm and gru (formats/ops.py) against PyTorch: the reference forward on the goldens that
tests/formats/recurrent/make_goldens.py wrote with torch (nn.LSTM / nn.GRU, their state dicts),
parameter names, shapes and counts as PyTorch's, and the NumPy and Numba backends on the same files."""

import json
import math
from pathlib import Path

import numpy as np
import pytest

from lnn.formats.binfile import build_metadata, encode_bin, parse_bin_bytes
from lnn.formats.model import parse_model
from lnn.formats.ops import get_op

HERE = Path(__file__).resolve().parent / "recurrent"
GOLDENS = np.load(HERE / "goldens.npz")
CASES = sorted({key.split(".")[0] for key in GOLDENS.files})


def golden(case):
    layer = json.loads(str(GOLDENS[f"{case}.layer"]))
    input_shape = layer.pop("input_shape")
    model = parse_model({"input_shape": input_shape, "layers": [dict(layer, name="rnn")], "loss": "mse"})
    params = {key[len(case) + 1:]: GOLDENS[key] for key in GOLDENS.files
              if key.startswith(case + ".") and key.split(".", 1)[1] not in ("x", "y", "layer")}
    return model, params, GOLDENS[f"{case}.x"], GOLDENS[f"{case}.y"]


def session_of(model, params, device):
    """A Session on the model with the golden's weights, through a .bin written and read back."""
    from lnn.runtime import Session

    weights = {f"rnn.{key}": value for key, value in params.items()}
    return Session(parse_bin_bytes(encode_bin(model, weights, build_metadata(model))), device)


@pytest.mark.parametrize("case", CASES)
def test_parameters_are_pytorchs(case):
    model, params, _, _ = golden(case)
    node = model.nodes[0]
    assert node.param_shapes == {key: value.shape for key, value in params.items()}
    assert node.num_params == sum(value.size for value in params.values())


def test_lstm_parameter_count_formula():
    model = parse_model({"input_shape": [3, 50], "layers": [{"type": "lstm", "hidden_size": 128}]})
    assert model.num_params == 4 * (3 * 128 + 128 * 128 + 2 * 128)
    bi = parse_model({"input_shape": [3, 50], "layers": [{"type": "lstm", "hidden_size": 8, "num_layers": 2,
                                                           "bidirectional": True}]})
    assert bi.num_params == 2 * 4 * (3 * 8 + 8 * 8 + 16) + 2 * 4 * (16 * 8 + 8 * 8 + 16)
    assert bi.output_shape == (16, 50)


@pytest.mark.parametrize("case", CASES)
def test_reference_matches_pytorch(case):
    model, params, x, y = golden(case)
    node = model.nodes[0]
    out = get_op(node.op).forward(x, params, node.attrs)
    assert out.shape == y.shape == (len(x), *node.out_shape)
    np.testing.assert_allclose(out, y, atol=2e-6, rtol=1e-5)


def test_bad_attributes_are_one_line():
    from lnn.formats.errors import ModelSpecError

    with pytest.raises(ModelSpecError, match="return must be one of sequence, last"):
        parse_model({"input_shape": [3, 8], "layers": [{"type": "lstm", "hidden_size": 4, "return": "all"}]})
    with pytest.raises(ModelSpecError, match=r"needs a \[C, T\]"):
        parse_model({"input_shape": [3, 8, 8], "layers": [{"type": "gru", "hidden_size": 4}]})


@pytest.mark.parametrize("device", ["numpy", "cpu"])
@pytest.mark.parametrize("case", CASES)
def test_backends_match_pytorch(case, device):
    model, params, x, y = golden(case)
    session = session_of(model, params, device)
    np.testing.assert_allclose(session.run(x), y, atol=3e-6, rtol=1e-5)
    np.testing.assert_allclose(session.run(x[:1]), y[:1], atol=3e-6, rtol=1e-5)


@pytest.mark.parametrize("case", CASES)
def test_onnx_export_runs_in_onnxruntime(case, tmp_path):
    onnxruntime = pytest.importorskip("onnxruntime")
    from lnn.formats.onnx_export import export_onnx

    model, params, x, y = golden(case)
    export_onnx(model, {f"rnn.{key}": value for key, value in params.items()}, tmp_path / "m.onnx")
    ort = onnxruntime.InferenceSession(str(tmp_path / "m.onnx"), providers=["CPUExecutionProvider"])
    ours = session_of(model, params, "numpy").run(x)
    for rows in (x, x[:1]):
        theirs = ort.run(None, {"input": rows})[0]
        np.testing.assert_allclose(theirs, ours[:len(rows)], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("op", ["lstm", "gru"])
@pytest.mark.parametrize("rows", [1, 2, 5, 13])
def test_cpu_backend_tiles_match_numpy(op, rows):
    """runtime/cpu/recurrent.py's products in panels of 8 hidden units, blocks of 3 rows and groups of 12:
    hidden 13 (a second, partial panel), two bidirectional layers (inputs of 4, then 26 features), and
    batches of one row (its own product), two (a block with a row repeated), 5 (a full block, then 2 rows)
    and 13 (a full group of 4 blocks, then one row)."""
    from lnn.runtime import Session

    model = parse_model({"input_shape": [4, 6], "loss": "mse", "layers": [
        {"type": op, "name": "rnn", "hidden_size": 13, "num_layers": 2, "bidirectional": True}]})
    rng = np.random.default_rng(rows)
    weights = {f"rnn.{name}": rng.uniform(-0.4, 0.4, shape).astype(np.float32)
               for name, shape in model.nodes[0].param_shapes.items()}
    blob = parse_bin_bytes(encode_bin(model, weights, build_metadata(model)))
    x = rng.standard_normal((rows, 4, 6)).astype(np.float32)
    np.testing.assert_allclose(Session(blob, "cpu").run(x), Session(blob, "numpy").run(x), atol=3e-6, rtol=1e-5)


def test_tanh_and_sigmoid_ratios_are_within_4e_7():
    """The gate kernels' tanh and sigmoid are numerator / denominator pairs (divided late, over common
    denominators); each ratio is within 4e-7 of the function, with denominators the kernels may multiply."""
    from lnn.runtime.cpu.recurrent import sigmoid_ratio, tanh_ratio

    for x in np.concatenate([np.linspace(-12, 12, 2001), [0.0, 1e-30, -1e-8, 40.0, -40.0]]).astype(np.float32):
        p, q = tanh_ratio(x)
        assert abs(float(p / q) - math.tanh(float(x))) <= 4e-7, x
        assert 0.0048 <= q <= 0.91, x
        p, q = sigmoid_ratio(x)
        assert abs(float(p / q) - 1 / (1 + math.exp(-float(x)))) <= 4e-7, x
    p, q = tanh_ratio(np.float32("nan"))
    assert math.isnan(p / q)


@pytest.mark.parametrize("kind", ["lstm", "gru"])
def test_pytorch_exported_onnx_imports_and_matches(kind):
    """torch.onnx's export (dynamic batch: zero initial states computed from the input's Shape) of a
    2-layer bidirectional nn.LSTM / nn.GRU between channel-first Transposes imports as one layer."""
    pytest.importorskip("onnx")
    from lnn.formats.onnx_import import import_onnx
    from lnn.runtime import Session

    samples = np.load(HERE / "onnx_samples.npz")
    model, weights = import_onnx(HERE / f"torch_{kind}.onnx")
    assert [node.op for node in model.nodes] == [kind]
    node = model.nodes[0]
    assert node.attrs["num_layers"] == 2 and node.attrs["bidirectional"] and node.attrs["return"] == "sequence"
    assert set(node.param_shapes) == {f"{w}_l{l}{s}" for w in ("weight_ih", "weight_hh", "bias_ih", "bias_hh")
                                      for l in (0, 1) for s in ("", "_reverse")}
    x, y = samples[f"{kind}.x"], samples[f"{kind}.y"]
    for device in ("numpy", "cpu"):
        session = Session(parse_bin_bytes(encode_bin(model, weights, build_metadata(model))), device)
        np.testing.assert_allclose(session.run(x), y, atol=3e-6, rtol=1e-5)


def test_onnx_round_trip_through_lnn_export(tmp_path):
    pytest.importorskip("onnx")
    from lnn.formats.onnx_export import export_onnx
    from lnn.formats.onnx_import import import_onnx
    from lnn.runtime import Session

    for case in CASES:                          # "return": "last" too: the top layer's Y_h
        model, params, x, y = golden(case)
        export_onnx(model, {f"rnn.{key}": value for key, value in params.items()}, tmp_path / f"{case}.onnx")
        back, weights = import_onnx(tmp_path / f"{case}.onnx")
        assert back.nodes[0].attrs == model.nodes[0].attrs
        session = Session(parse_bin_bytes(encode_bin(back, weights, build_metadata(back))), "numpy")
        np.testing.assert_allclose(session.run(x), y, atol=3e-6, rtol=1e-5)


@pytest.mark.parametrize("kind", ["lstm", "gru"])
def test_a_one_direction_last_state_model_round_trips_through_onnx(kind, tmp_path):
    """lnn's export of "return": "last" reads the top node's Y_h (its second output); the import takes it back
    into the same layer, and a layer after it."""
    pytest.importorskip("onnx")
    from lnn.formats.onnx_export import export_onnx
    from lnn.formats.onnx_import import import_onnx
    from lnn.runtime import Session

    model = parse_model({"input_shape": [2, 7], "layers": [
        {"type": kind, "name": "rnn", "hidden_size": 3, "num_layers": 2, "return": "last"},
        {"type": "linear", "name": "fc", "out_features": 4}]})
    rng = np.random.default_rng(0)
    weights = {key: rng.standard_normal(shape).astype(np.float32) * 0.5 for key, shape in model.param_shapes().items()}
    x = rng.standard_normal((5, 2, 7)).astype(np.float32)
    export_onnx(model, weights, tmp_path / "m.onnx")
    back, back_weights = import_onnx(tmp_path / "m.onnx")
    assert back.nodes[0].attrs == model.nodes[0].attrs
    run = [Session(parse_bin_bytes(encode_bin(m, w, build_metadata(m))), "numpy").run(x)
           for m, w in ((model, weights), (back, back_weights))]
    np.testing.assert_allclose(run[1], run[0], atol=1e-6, rtol=1e-5)


def test_onnx_import_refuses_what_lnn_does_not_compute(tmp_path):
    onnx = pytest.importorskip("onnx")
    from lnn.formats.onnx_import import OnnxImportError, import_onnx

    proto = onnx.load(HERE / "torch_gru.onnx")
    for node in proto.graph.node:
        if node.op_type == "GRU":
            for attribute in node.attribute:
                if attribute.name == "linear_before_reset":
                    attribute.i = 0
    with pytest.raises(OnnxImportError, match="linear_before_reset=0 is not PyTorch's GRU"):
        import_onnx(proto)


def test_fp16_and_int8_files_compress_the_recurrent_matrices():
    from lnn.formats.binfile import fp16_dtypes, int8_dtypes

    model, params, x, y = golden("lstm_bi2_last")
    weights = {f"rnn.{key}": value for key, value in params.items()}
    assert sorted(int8_dtypes(model)) == sorted(key for key in weights if ".weight_" in key)
    for dtypes, tolerance in ((fp16_dtypes(model), 2e-3), (int8_dtypes(model), 3e-2)):
        data = encode_bin(model, weights, build_metadata(model), dtypes)
        assert len(data) < len(encode_bin(model, weights, build_metadata(model)))
        from lnn.runtime import Session

        np.testing.assert_allclose(Session(parse_bin_bytes(data), "cpu").run(x), y, atol=tolerance)
