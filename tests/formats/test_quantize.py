"""int8 weights: the per-channel quantization itself, the writer's int8 path, and loading int8 files.

The crafted bad int8 files (one per SPEC rule) live with the other rules in test_binfile.py."""

import numpy as np
import pytest

import lnn
from conftest import EXAMPLES
from lnn.formats.binfile import (build_metadata, encode_bin, fp16_dtypes, int8_dtypes, parse_bin_bytes, read_bin,
                                 write_bin)
from lnn.formats.errors import ModelSpecError
from lnn.formats.model import load_model
from lnn.formats.quantize import dequantize, quantize_per_channel, scale_key


def test_quantize_per_channel_against_the_formula():
    rng = np.random.default_rng(0)
    weight = rng.standard_normal((5, 3, 2, 2)).astype(np.float32) * np.array([1, 10, 0.01, 3, 0.5], np.float32)[:, None, None, None]
    weight[3] = 0                                                     # a row of zeros
    q, scale = quantize_per_channel(weight)
    assert q.dtype == np.int8 and q.shape == weight.shape
    assert scale.dtype == np.float32 and scale.shape == (5,)
    for o in range(5):                                                # row by row, in float64
        amax = np.abs(weight[o]).max()
        expected_scale = amax / 127 if amax else 1.0
        assert scale[o] == pytest.approx(expected_scale, rel=1e-6)
        assert np.abs(q[o]).max() == (127 if amax else 0)             # the largest value maps to ±127
        assert np.all(np.abs(weight[o] / scale[o] - q[o]) <= 0.5 + 1e-4)   # rounded to nearest
    error = np.abs(dequantize(q, scale) - weight)
    assert np.all(error <= scale[:, None, None, None] / 2 * (1 + 1e-5))


def test_quantize_never_uses_minus_128_and_keeps_signs():
    weight = np.array([[-3.0, 3.0, -1.5, 0.0], [-1e-30, 2e-30, 0, 0]], np.float32)
    q, scale = quantize_per_channel(weight)
    assert q.min() >= -127
    assert q[0].tolist() == [-127, 127, -64, 0]                       # -1.5 / (3/127) = -63.5 -> -64 (to even)
    assert np.all(scale > 0)
    np.testing.assert_allclose(dequantize(q, scale)[1], weight[1], atol=1e-30)


def test_int8_file_is_about_a_quarter_of_fp32_and_dequantizes_at_load():
    model = load_model(EXAMPLES / "reference" / "mnist_cnn.json")
    rng = np.random.default_rng(1)
    weights = {key: rng.standard_normal(shape).astype(np.float32) * 0.1 for key, shape in model.param_shapes().items()}
    size32 = len(encode_bin(model, weights, build_metadata(model)))
    data8 = encode_bin(model, weights, build_metadata(model), int8_dtypes(model))
    assert len(data8) <= 0.3 * size32
    loaded = parse_bin_bytes(data8)
    assert loaded.stored_dtypes["fc1.weight"] == "int8" and loaded.stored_dtypes["fc1.bias"] == "float32"
    assert loaded.tensors[scale_key("fc1.weight")].shape == (model.param_shapes()["fc1.weight"][0],)
    widened = loaded.weights_fp32()
    assert list(widened) == list(model.param_shapes())                # scales are not parameters
    for key, value in widened.items():
        assert value.dtype == np.float32
        if key in int8_dtypes(model):
            q, scale = quantize_per_channel(weights[key])
            np.testing.assert_array_equal(value, dequantize(q, scale))
        else:
            np.testing.assert_array_equal(value, weights[key])


def test_writer_refuses_bad_int8_input():
    model = load_model(EXAMPLES / "reference" / "mnist_mlp.json")
    rng = np.random.default_rng(2)
    weights = {key: rng.standard_normal(shape).astype(np.float32) for key, shape in model.param_shapes().items()}
    meta = build_metadata(model)
    key = next(iter(int8_dtypes(model)))
    q, scale = quantize_per_channel(weights[key])
    with pytest.raises(ValueError, match=r"int8 is per output channel"):
        encode_bin(model, weights, meta, {key.replace("weight", "bias"): "int8"})
    with pytest.raises(ModelSpecError, match=rf"{scale_key(key)} is given but {key} is float32, not int8"):
        encode_bin(model, {**weights, scale_key(key): scale}, meta)
    with pytest.raises(ModelSpecError, match=r"must be float32 \[\d+\] and positive"):
        encode_bin(model, {**weights, key: q, scale_key(key): -scale}, meta, int8_dtypes(model))
    bad = q.copy()
    bad[0, 0] = -128
    with pytest.raises(ModelSpecError, match=r"holds -128"):
        encode_bin(model, {**weights, key: bad, scale_key(key): scale}, meta, int8_dtypes(model))


def test_int8_weights_rewritten_as_float_are_dequantized(tmp_path):
    model = load_model(EXAMPLES / "reference" / "mnist_mlp.json")
    rng = np.random.default_rng(3)
    weights = {key: rng.standard_normal(shape).astype(np.float32) for key, shape in model.param_shapes().items()}
    write_bin(tmp_path / "q.bin", model, weights, dtypes=int8_dtypes(model))
    quantized = read_bin(tmp_path / "q.bin")
    write_bin(tmp_path / "h.bin", model, quantized.tensors, quantized.metadata, fp16_dtypes(model))
    half = read_bin(tmp_path / "h.bin")
    assert set(half.stored_dtypes.values()) == {"float16", "float32"} and len(half.tensors) == len(weights)
    for key, value in half.weights_fp32().items():
        np.testing.assert_allclose(value, quantized.weights_fp32()[key], rtol=1e-3, atol=1e-6)


@pytest.mark.parametrize("device", ["numpy", "cpu"])
def test_int8_model_runs_like_its_dequantized_fp32_twin(tmp_path, device):
    """An int8 file's outputs equal those of an fp32 file holding the dequantized weights, on both CPU backends."""
    model = load_model(EXAMPLES / "reference" / "mnist_cnn.json")
    rng = np.random.default_rng(4)
    weights = {key: rng.standard_normal(shape).astype(np.float32) * 0.1 for key, shape in model.param_shapes().items()}
    write_bin(tmp_path / "q.bin", model, weights, dtypes=int8_dtypes(model))
    write_bin(tmp_path / "f.bin", model, read_bin(tmp_path / "q.bin").weights_fp32())
    batch = rng.standard_normal((3,) + model.input_shape).astype(np.float32)
    int8_out = lnn.load(tmp_path / "q.bin", device=device).run(batch)
    twin_out = lnn.load(tmp_path / "f.bin", device="numpy").run(batch)
    np.testing.assert_allclose(int8_out, twin_out, rtol=1e-4, atol=1e-4)
    write_bin(tmp_path / "original.bin", model, weights)
    original_out = lnn.load(tmp_path / "original.bin", device="numpy").run(batch)
    assert 0 < np.abs(int8_out - original_out).max() <= 0.03 * np.abs(original_out).max()   # close, not equal
