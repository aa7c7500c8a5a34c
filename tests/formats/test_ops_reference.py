"""Each op's NumPy reference forward (formats/ops.py) against an independent computation: naive
loops written here from the definitions (PyTorch semantics), scalar math for activations, and the
four PyTorch-made reference models end to end (samples.npz `expected`, max abs error <= 1e-4)."""

import math

import numpy as np
import pytest

from conftest import EXAMPLES, REFERENCE_MODELS, REFERENCE_NAMES, need
from lnn.formats.binfile import build_metadata, encode_bin, parse_bin_bytes
from lnn.formats.model import load_model, parse_model
from lnn.formats.ops import get_op
from lnn.runtime import Session

RNG = np.random.default_rng(1234)


def forward(layer: dict, x: np.ndarray, params: dict | None = None) -> np.ndarray:
    """Run one layer, its attributes completed by the description parser, through its reference forward."""
    node = parse_model({"input_shape": list(x.shape[1:]), "layers": [layer], "loss": "mse"}).nodes[0]
    return get_op(node.op).forward(x, params or {}, node.attrs)


def normal(*shape) -> np.ndarray:
    return RNG.standard_normal(shape).astype(np.float32)


# --------------------------------------------------------------------------- naive references

def naive_conv2d(x, weight, bias, stride, padding, dilation, groups):
    n, cin, h, w = x.shape
    cout, cin_g, kh, kw = weight.shape
    (sh, sw), (ph, pw), (dh, dw) = stride, padding, dilation
    oh = (h + 2 * ph - dh * (kh - 1) - 1) // sh + 1
    ow = (w + 2 * pw - dw * (kw - 1) - 1) // sw + 1
    cout_g = cout // groups
    out = np.zeros((n, cout, oh, ow), np.float64)
    for b in range(n):
        for o in range(cout):
            g = o // cout_g
            for oy in range(oh):
                for ox in range(ow):
                    total = 0.0 if bias is None else float(bias[o])
                    for c in range(cin_g):
                        for ky in range(kh):
                            for kx in range(kw):
                                iy, ix = oy * sh - ph + ky * dh, ox * sw - pw + kx * dw
                                if 0 <= iy < h and 0 <= ix < w:
                                    total += float(x[b, g * cin_g + c, iy, ix]) * float(weight[o, c, ky, kx])
                    out[b, o, oy, ox] = total
    return out


def naive_pool(x, kernel, stride, padding, mode, count_include_pad=True):
    n, c, h, w = x.shape
    (kh, kw), (sh, sw), (ph, pw) = kernel, stride, padding
    oh, ow = (h + 2 * ph - kh) // sh + 1, (w + 2 * pw - kw) // sw + 1
    out = np.zeros((n, c, oh, ow), np.float64)
    for b in range(n):
        for ch in range(c):
            for oy in range(oh):
                for ox in range(ow):
                    inside = [float(x[b, ch, oy * sh - ph + ky, ox * sw - pw + kx])
                              for ky in range(kh) for kx in range(kw)
                              if 0 <= oy * sh - ph + ky < h and 0 <= ox * sw - pw + kx < w]
                    if mode == "max":
                        out[b, ch, oy, ox] = max(inside)
                    else:
                        out[b, ch, oy, ox] = sum(inside) / (kh * kw if count_include_pad else len(inside))
    return out


# --------------------------------------------------------------------------- conv, linear

CONV_CASES = [
    dict(cin=3, cout=4, kernel=(3, 3), stride=(1, 1), padding=(1, 1), dilation=(1, 1), groups=1, size=(7, 9)),
    dict(cin=4, cout=6, kernel=(3, 2), stride=(2, 1), padding=(0, 1), dilation=(1, 1), groups=2, size=(8, 7)),
    dict(cin=5, cout=3, kernel=(3, 3), stride=(2, 3), padding=(2, 1), dilation=(2, 2), groups=1, size=(9, 10)),
    dict(cin=6, cout=6, kernel=(3, 3), stride=(1, 1), padding=(1, 1), dilation=(1, 1), groups=6, size=(6, 5)),
    dict(cin=6, cout=12, kernel=(1, 1), stride=(2, 2), padding=(0, 0), dilation=(1, 1), groups=3, size=(5, 5)),
]


@pytest.mark.parametrize("case", CONV_CASES, ids=["3x3 pad", "grouped stride", "dilated", "depthwise", "pointwise groups"])
@pytest.mark.parametrize("bias", [True, False])
def test_conv2d_matches_naive_loops(case, bias):
    x = normal(2, case["cin"], *case["size"])
    weight = normal(case["cout"], case["cin"] // case["groups"], *case["kernel"])
    params = {"weight": weight, "bias": normal(case["cout"])} if bias else {"weight": weight}
    layer = {"type": "conv2d", "out_channels": case["cout"], "kernel_size": list(case["kernel"]),
             "stride": list(case["stride"]), "padding": list(case["padding"]), "dilation": list(case["dilation"]),
             "groups": case["groups"], "bias": bias}
    expected = naive_conv2d(x, weight, params.get("bias"), case["stride"], case["padding"], case["dilation"], case["groups"])
    got = forward(layer, x, params)
    assert got.dtype == np.float32 and got.shape == expected.shape
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)


def test_conv2d_fused_activation():
    x, weight, bias = normal(1, 2, 5, 5), normal(3, 2, 3, 3), normal(3)
    got = forward({"type": "conv2d", "out_channels": 3, "kernel_size": 3, "activation": "relu6"}, x,
                  {"weight": weight, "bias": bias})
    plain = naive_conv2d(x, weight, bias, (1, 1), (0, 0), (1, 1), 1)
    np.testing.assert_allclose(got, np.minimum(np.maximum(plain, 0), 6), rtol=1e-5, atol=1e-5)


def test_linear_matches_loops():
    x, weight, bias = normal(3, 7), normal(5, 7), normal(5)
    expected = [[sum(float(x[b, i]) * float(weight[o, i]) for i in range(7)) + float(bias[o]) for o in range(5)]
                for b in range(3)]
    np.testing.assert_allclose(forward({"type": "linear", "out_features": 5}, x, {"weight": weight, "bias": bias}),
                               expected, rtol=1e-5, atol=1e-5)
    no_bias = forward({"type": "linear", "out_features": 5, "bias": False}, x, {"weight": weight})
    np.testing.assert_allclose(no_bias, np.asarray(expected) - bias, rtol=1e-5, atol=1e-5)


# --------------------------------------------------------------------------- pools, flatten

@pytest.mark.parametrize("kernel, stride, padding", [((2, 2), (2, 2), (0, 0)), ((3, 3), (2, 2), (1, 1)),
                                                     ((3, 2), (1, 2), (1, 0)), ((2, 3), (3, 1), (1, 1))])
def test_maxpool2d_with_padding(kernel, stride, padding):
    x = normal(2, 3, 7, 8) - 5                 # all-negative regions: padding must not win as a zero
    layer = {"type": "maxpool2d", "kernel_size": list(kernel), "stride": list(stride), "padding": list(padding)}
    np.testing.assert_array_equal(forward(layer, x), naive_pool(x, kernel, stride, padding, "max").astype(np.float32))


@pytest.mark.parametrize("count_include_pad", [True, False])
@pytest.mark.parametrize("kernel, stride, padding", [((2, 2), (2, 2), (0, 0)), ((3, 3), (2, 2), (1, 1)),
                                                     ((3, 2), (1, 1), (1, 1))])
def test_avgpool2d_counts_padding_both_ways(kernel, stride, padding, count_include_pad):
    x = normal(2, 3, 6, 7)
    layer = {"type": "avgpool2d", "kernel_size": list(kernel), "stride": list(stride), "padding": list(padding),
             "count_include_pad": count_include_pad}
    expected = naive_pool(x, kernel, stride, padding, "avg", count_include_pad)
    np.testing.assert_allclose(forward(layer, x), expected, rtol=1e-6, atol=1e-6)
    if padding != (0, 0):      # the two conventions really differ at the borders
        other = naive_pool(x, kernel, stride, padding, "avg", not count_include_pad)
        assert not np.allclose(forward(layer, x), other)


def test_global_avg_pool_and_flatten_order():
    x = normal(2, 3, 4, 5)
    means = [[sum(float(v) for v in x[b, c].ravel()) / 20 for c in range(3)] for b in range(2)]
    np.testing.assert_allclose(forward({"type": "global_avg_pool"}, x), means, rtol=1e-6, atol=1e-6)
    assert forward({"type": "global_avg_pool", "keepdims": True}, x).shape == (2, 3, 1, 1)
    flat = forward({"type": "flatten"}, x)
    assert flat[1, 1 * 20 + 2 * 5 + 3] == x[1, 1, 2, 3]         # (C, H, W) order, as torch.flatten


# --------------------------------------------------------------------------- batch norm, dropout

@pytest.mark.parametrize("shape", [(4, 3), (2, 3, 4, 5)], ids=["1d", "2d"])
def test_batchnorm_uses_running_statistics(shape):
    x = normal(*shape)
    params = {"weight": normal(3), "bias": normal(3), "running_mean": normal(3),
              "running_var": np.abs(normal(3)) + 0.1}
    got = forward({"type": "batchnorm", "eps": 1e-3}, x, params)
    expected = np.empty(shape)
    for c in range(3):
        channel = x[:, c].astype(np.float64)
        expected[:, c] = ((channel - params["running_mean"][c]) / math.sqrt(params["running_var"][c] + 1e-3)
                          * params["weight"][c] + params["bias"][c])
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)


def test_dropout_is_identity_at_inference():
    x = normal(3, 4)
    np.testing.assert_array_equal(forward({"type": "dropout", "p": 0.9}, x), x)


# --------------------------------------------------------------------------- activations

SCALAR_ACTIVATIONS = {
    "relu": lambda v: max(v, 0.0),
    "relu6": lambda v: min(max(v, 0.0), 6.0),
    "leaky_relu": lambda v: v if v >= 0 else 0.2 * v,
    "sigmoid": lambda v: 1 / (1 + math.exp(-v)) if v >= 0 else math.exp(v) / (1 + math.exp(v)),
    "tanh": math.tanh,
}


@pytest.mark.parametrize("kind", sorted(SCALAR_ACTIVATIONS))
def test_activations_match_scalar_math(kind):
    x = np.concatenate([normal(2, 50) * 4, np.array([[-800, -30, -6, -1e-3, 0, 1e-3, 6, 7, 30, 800] * 5], np.float32)
                        .reshape(1, 50)])
    layer = {"type": kind, "negative_slope": 0.2} if kind == "leaky_relu" else {"type": kind}
    got = forward(layer, x)
    assert got.dtype == np.float32 and np.all(np.isfinite(got))
    expected = np.vectorize(SCALAR_ACTIVATIONS[kind])(x.astype(np.float64))
    np.testing.assert_allclose(got, expected, rtol=1e-6, atol=1e-7)


def test_softmax_is_stable_and_exact_at_large_inputs():
    x = np.array([[1000.0, 999.0, 998.0], [-1000.0, -1001.0, -1000.5], [0.0, 88.0, 89.0], [1e-3, 0.0, -1e-3]],
                 np.float32)
    got = forward({"type": "softmax"}, x)
    assert np.all(np.isfinite(got))
    for row, out in zip(x.astype(np.float64), got):
        top = max(row)
        exps = [math.exp(v - top) for v in row]
        np.testing.assert_allclose(out, [e / sum(exps) for e in exps], rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(got.sum(axis=1), 1, rtol=1e-6)


def test_activation_as_a_layer_field_equals_the_layer():
    x, weight, bias = normal(3, 6), normal(4, 6), normal(4)
    fused = forward({"type": "linear", "out_features": 4, "activation": {"type": "leaky_relu", "negative_slope": 0.1}},
                    x, {"weight": weight, "bias": bias})
    separate = forward({"type": "leaky_relu", "negative_slope": 0.1},
                       forward({"type": "linear", "out_features": 4}, x, {"weight": weight, "bias": bias}))
    np.testing.assert_array_equal(fused, separate)


# --------------------------------------------------------------------------- the reference models end to end

@pytest.mark.parametrize("name", REFERENCE_NAMES)
def test_reference_models_reproduce_pytorch_through_a_bin(name):
    weights = dict(np.load(need(REFERENCE_MODELS / f"{name}.weights.npz")))
    samples = np.load(need(REFERENCE_MODELS / f"{name}.samples.npz"))
    model = load_model(EXAMPLES / "reference" / f"{name}.json")
    session = Session(parse_bin_bytes(encode_bin(model, weights, build_metadata(model)), f"{name}.bin"), device="numpy")
    out = session.run(samples["input"])
    assert out.dtype == np.float32 and out.shape == samples["expected"].shape
    assert np.max(np.abs(out - samples["expected"])) <= 1e-4
