"""Every op's hand-written backward against central finite differences, in float64.

Each case is a one-layer (or two-layer) model compiled into a float64 plan that also computes the
input gradient; the scalar checked is sum(output * R) for a fixed random R, so dL/d(output) = R.
Shapes are small and odd (tails), convolutions strided, dilated, grouped and padded, pools padded.
"""

import numpy as np
import pytest

from lnn.formats.model import parse_model
from lnn.train import kernels as K
from lnn.train.plan import Plan

EPS = 1e-6
TOLERANCE = 1e-6


def _model(input_shape, layers, loss="mse"):
    return parse_model({"input_shape": list(input_shape), "layers": layers, "loss": loss})


def _plan(model, n, seed=0):
    plan = Plan(model, n, dtype="float64", input_gradient=True)
    plan.allocate(np)
    rng = np.random.default_rng(seed)
    plan.params[...] = rng.normal(0, 0.5, plan.params.shape)
    plan.stats[...] = rng.uniform(0.5, 1.5, plan.stats.shape)
    return plan


def _loss(plan, x, r, keys):
    n = len(x)
    plan.input_buffer(n)[...] = x
    return float((plan.forward(n, training=True, dropout_keys=keys) * r).sum())


def _check(input_shape, layers, n=3, seed=0, samples=12):
    model = _model(input_shape, layers)
    plan = _plan(model, n, seed)
    rng = np.random.default_rng(seed + 1)
    x = rng.normal(0, 1, (n,) + tuple(input_shape))
    r = rng.normal(0, 1, (n,) + tuple(model.output_shape))
    keys = {i: 12345 + i for i in range(len(model.nodes))}

    _loss(plan, x, r, keys)
    plan.grads.fill(0)
    plan.output_grad_buffer(n)[...] = r
    plan.backward(n, dropout_keys=keys)
    analytic_dx = plan.views(n)["grad:-1"].copy()
    analytic_params = plan.grads.copy()

    def numeric(vector, index, evaluate):
        old = vector[index]
        vector[index] = old + EPS
        up = evaluate()
        vector[index] = old - EPS
        down = evaluate()
        vector[index] = old
        return (up - down) / (2 * EPS)

    flat_x = x.reshape(-1)
    for index in rng.choice(flat_x.size, min(samples, flat_x.size), replace=False):
        expected = numeric(flat_x, index, lambda: _loss(plan, x, r, keys))
        assert analytic_dx.reshape(-1)[index] == pytest.approx(expected, abs=TOLERANCE, rel=TOLERANCE), \
            f"d input[{index}]"
    for key, slot in plan.param_slots.items():
        for local in rng.choice(slot.size, min(samples, slot.size), replace=False):
            index = slot.offset + local
            expected = numeric(plan.params, index, lambda: _loss(plan, x, r, keys))
            assert analytic_params[index] == pytest.approx(expected, abs=TOLERANCE, rel=TOLERANCE), f"d {key}[{local}]"
    return model


ACTIVATIONS = ["relu", "relu6", {"type": "leaky_relu", "negative_slope": 0.1}, "sigmoid", "tanh", "softmax"]

CASES = {
    "linear": ((7,), [{"type": "linear", "out_features": 5}]),
    "linear_no_bias_relu": ((7,), [{"type": "linear", "out_features": 5, "bias": False, "activation": "relu"}]),
    "conv_plain": ((3, 7, 6), [{"type": "conv2d", "out_channels": 4, "kernel_size": 3}]),
    "conv_stride_pad": ((3, 9, 8), [{"type": "conv2d", "out_channels": 5, "kernel_size": [3, 2], "stride": [2, 3],
                                     "padding": [1, 2], "activation": "tanh"}]),
    "conv_dilated": ((2, 9, 9), [{"type": "conv2d", "out_channels": 3, "kernel_size": 3, "dilation": 2,
                                  "padding": 1}]),
    "conv_grouped": ((4, 7, 7), [{"type": "conv2d", "out_channels": 6, "kernel_size": 3, "groups": 2,
                                  "padding": 1, "stride": 2}]),
    "conv_depthwise": ((3, 6, 5), [{"type": "conv2d", "out_channels": 3, "kernel_size": 3, "groups": 3,
                                    "bias": False}]),
    "conv1d_same_even_kernel": ((3, 11), [{"type": "conv1d", "out_channels": 4, "kernel_size": 4, "padding": "same",
                                           "activation": "tanh"}]),
    "conv1d_stride_dilation_groups": ((4, 13), [{"type": "conv1d", "out_channels": 6, "kernel_size": 3, "stride": 2,
                                                 "dilation": 2, "padding": [1, 2], "groups": 2}]),
    "conv1d_bn_relu_conv1d": ((2, 9), [{"type": "conv1d", "out_channels": 3, "kernel_size": 3, "bias": False},
                                       {"type": "batchnorm", "activation": "relu"},
                                       {"type": "conv1d", "out_channels": 2, "kernel_size": 1}]),
    "conv1d_relu_maxpool1d": ((2, 12), [{"type": "conv1d", "out_channels": 3, "kernel_size": 3, "padding": 1,
                                         "activation": "relu"},
                                        {"type": "maxpool1d", "kernel_size": 3, "stride": 2, "padding": 1}]),
    "maxpool1d": ((3, 11), [{"type": "maxpool1d", "kernel_size": 2}]),
    "avgpool1d_pad": ((2, 13), [{"type": "avgpool1d", "kernel_size": 3, "stride": 2, "padding": 1}]),
    "avgpool1d_pad_exclude": ((2, 13), [{"type": "avgpool1d", "kernel_size": 4, "stride": 3, "padding": 2,
                                         "count_include_pad": False}]),
    "global_avg_pool_time": ((3, 9), [{"type": "global_avg_pool"}]),
    "conv1d_relu_global_avg_pool": ((2, 9), [{"type": "conv1d", "out_channels": 3, "kernel_size": 3,
                                              "activation": "relu"}, {"type": "global_avg_pool"}]),
    "global_max_pool_time": ((3, 9), [{"type": "global_max_pool"}]),
    "global_max_pool_image_keepdims": ((3, 4, 5), [{"type": "global_max_pool", "keepdims": True}]),
    "conv1d_relu_global_max_pool": ((2, 9), [{"type": "conv1d", "out_channels": 3, "kernel_size": 3,
                                              "activation": "relu"}, {"type": "global_max_pool"}]),
    "maxpool": ((3, 7, 7), [{"type": "maxpool2d", "kernel_size": 2}]),
    "maxpool_overlap_pad": ((2, 7, 6), [{"type": "maxpool2d", "kernel_size": 3, "stride": 2, "padding": 1}]),
    "avgpool": ((2, 7, 7), [{"type": "avgpool2d", "kernel_size": 3, "stride": 2}]),
    "avgpool_pad": ((2, 6, 7), [{"type": "avgpool2d", "kernel_size": 3, "stride": 2, "padding": 1}]),
    "avgpool_pad_exclude": ((2, 6, 7), [{"type": "avgpool2d", "kernel_size": 3, "stride": 2, "padding": 1,
                                         "count_include_pad": False}]),
    # on the GPU: Winograd forward and input gradient (padding 2, then 0; odd sizes)
    "conv_winograd": ((3, 7, 9), [{"type": "conv2d", "out_channels": 4, "kernel_size": 3, "padding": 2,
                                   "algorithm": "winograd", "activation": "relu"},
                                  {"type": "conv2d", "out_channels": 3, "kernel_size": 3, "algorithm": "winograd"}]),
    # a relu right before a max pool is undone by the pool's backward (train/layers.py make_layers)
    "conv_relu_maxpool": ((2, 8, 8), [{"type": "conv2d", "out_channels": 3, "kernel_size": 3, "padding": 1,
                                       "activation": "relu"}, {"type": "maxpool2d", "kernel_size": 2}]),
    "conv_relu_global_avg_pool": ((2, 6, 5), [{"type": "conv2d", "out_channels": 3, "kernel_size": 3, "padding": 1,
                                               "activation": "relu"}, {"type": "global_avg_pool"}]),
    "conv_relu_maxpool_overlap": ((2, 7, 7), [{"type": "conv2d", "out_channels": 3, "kernel_size": 3,
                                               "activation": "relu"},
                                              {"type": "maxpool2d", "kernel_size": 3, "stride": 2, "padding": 1}]),
    "global_avg_pool": ((3, 5, 4), [{"type": "global_avg_pool"}]),
    "global_avg_pool_keepdims": ((3, 5, 4), [{"type": "global_avg_pool", "keepdims": True}]),
    "flatten_linear": ((2, 3, 3), [{"type": "flatten"}, {"type": "linear", "out_features": 4}]),
    "batchnorm2d_train": ((3, 5, 4), [{"type": "batchnorm", "activation": "relu"}]),
    "batchnorm1d_train": ((6,), [{"type": "batchnorm"}]),
    "layernorm_whole_series": ((3, 7), [{"type": "layernorm"}]),
    "layernorm_last_axis_no_bias": ((3, 7), [{"type": "layernorm", "normalized_shape": [7], "bias": False}]),
    "layernorm_no_affine_image": ((2, 3, 4), [{"type": "layernorm", "normalized_shape": [3, 4],
                                               "elementwise_affine": False}]),
    "conv1d_layernorm_relu": ((2, 9), [{"type": "conv1d", "out_channels": 3, "kernel_size": 3},
                                       {"type": "layernorm", "normalized_shape": 7, "eps": 1e-3}, {"type": "relu"}]),
    "dropout": ((13,), [{"type": "dropout", "p": 0.3}]),
    "dropout_2d": ((2, 3, 5), [{"type": "dropout", "p": 0.5}]),
    "conv_bn_pool_linear": ((2, 8, 8), [{"type": "conv2d", "out_channels": 3, "kernel_size": 3, "padding": 1},
                                        {"type": "batchnorm", "activation": "relu"},
                                        {"type": "maxpool2d", "kernel_size": 2}, {"type": "flatten"},
                                        {"type": "dropout", "p": 0.2},
                                        {"type": "linear", "out_features": 3, "activation": "softmax"}]),
    # backpropagation through time: several layers, both directions, either return, with and without bias
    "lstm_sequence": ((3, 5), [{"type": "lstm", "hidden_size": 4}]),
    "lstm_bidirectional_two_layers_last": ((2, 4), [{"type": "lstm", "hidden_size": 3, "num_layers": 2,
                                                     "bidirectional": True, "return": "last"}]),
    "lstm_no_bias_bidirectional": ((2, 4), [{"type": "lstm", "hidden_size": 3, "bidirectional": True, "bias": False}]),
    "gru_sequence_two_layers": ((3, 5), [{"type": "gru", "hidden_size": 4, "num_layers": 2}]),
    "gru_bidirectional_last_linear": ((2, 4), [{"type": "gru", "hidden_size": 3, "bidirectional": True,
                                                "return": "last"}, {"type": "linear", "out_features": 2}]),
    "gru_no_bias_one_step": ((2, 1), [{"type": "gru", "hidden_size": 3, "bias": False, "bidirectional": True}]),
}
for act in ACTIVATIONS:
    name = act if isinstance(act, str) else act["type"]
    CASES[f"activation_{name}"] = ((9,), [act if isinstance(act, dict) else {"type": act}])
    CASES[f"linear_fused_{name}"] = ((6,), [{"type": "linear", "out_features": 5, "activation": act}])


def random_plan_case(case: str, n: int = 5):
    """CASES[case] as a model with random parameters, statistics, input x and output gradient r for n rows,
    the start of the tests that run one plan's forward and backward in two ways and compare them."""
    input_shape, layers = CASES[case]
    model = parse_model({"input_shape": list(input_shape), "layers": layers, "loss": "mse"})
    probe = Plan(model, n, input_gradient=True)
    rng = np.random.default_rng(0)
    params = rng.normal(0, 0.5, probe.params_size).astype(np.float32)
    stats = rng.uniform(0.5, 1.5, probe.stats_size).astype(np.float32)
    x = rng.normal(size=(n,) + tuple(input_shape)).astype(np.float32)
    r = rng.normal(size=(n,) + tuple(model.output_shape)).astype(np.float32)
    return model, params, stats, x, r


@pytest.mark.parametrize("case", sorted(CASES))
def test_backward_matches_finite_differences(case):
    input_shape, layers = CASES[case]
    _check(input_shape, layers, n=3 if "batchnorm" not in case else 4)


def test_every_op_of_the_registry_is_checked():
    from lnn.formats.ops import OPS

    checked = {parse_model({"input_shape": list(s), "layers": layers, "loss": "mse"}).nodes[i].op
               for s, layers in CASES.values() for i in range(len(layers))}
    assert set(OPS) <= checked


def test_every_op_of_the_registry_has_a_training_layer():
    """train/layers.py's table is built from the ops each layer class names (`ops`): an op no class names fails."""
    from lnn.formats.ops import OPS
    from lnn.train.layers import LAYERS, Layer

    assert list(LAYERS) == list(OPS)
    assert all(issubclass(layer, Layer) for layer in LAYERS.values())


def test_softmax_cross_entropy_gradient():
    rng = np.random.default_rng(3)
    logits = rng.normal(0, 3, (5, 7))
    labels = rng.integers(0, 7, 5)
    grad = np.empty_like(logits)
    loss_sum, _ = K.softmax_cross_entropy_forward_backward(np, logits, labels, 1 / 5, grad)
    assert float(loss_sum) == pytest.approx(float(K.softmax_cross_entropy_forward(np, logits, labels)[0]))
    for index in range(logits.size):
        flat = logits.reshape(-1)
        old = flat[index]
        flat[index] = old + EPS
        up = float(K.softmax_cross_entropy_forward(np, logits, labels)[0]) / 5
        flat[index] = old - EPS
        down = float(K.softmax_cross_entropy_forward(np, logits, labels)[0]) / 5
        flat[index] = old
        assert grad.reshape(-1)[index] == pytest.approx((up - down) / (2 * EPS), abs=1e-7)


def test_softmax_cross_entropy_is_stable_for_huge_logits():
    logits = np.array([[1000.0, 0.0, -1000.0], [-5e4, 5e4, 0.0]], np.float32)
    grad = np.empty_like(logits)
    loss_sum, correct = K.softmax_cross_entropy_forward_backward(np, logits, np.array([0, 0]), 1.0, grad)
    assert np.isfinite(float(loss_sum)) and float(loss_sum) == pytest.approx(1e5)
    assert np.all(np.isfinite(grad)) and int(correct) == 1


def test_mse_gradient():
    rng = np.random.default_rng(4)
    pred, target = rng.normal(size=(4, 3)), rng.normal(size=(4, 3))
    grad = np.empty_like(pred)
    K.mse_forward_backward(np, pred, target, 1 / 12, grad)
    for index in range(pred.size):
        flat = pred.reshape(-1)
        old = flat[index]
        flat[index] = old + EPS
        up = float(K.mse_forward(np, pred, target)) / 12
        flat[index] = old - EPS
        down = float(K.mse_forward(np, pred, target)) / 12
        flat[index] = old
        assert grad.reshape(-1)[index] == pytest.approx((up - down) / (2 * EPS), abs=1e-7)


def test_outlier_exposure_loss_and_gradient():
    """Rows labelled -1 have the uniform posterior as target: loss w * mean_k(-log p_k), in float64 against
    finite differences of the forward, mixed with labelled rows."""
    rng = np.random.default_rng(5)
    logits = rng.normal(0, 3, (6, 4))
    labels = np.array([2, -1, 0, -1, 3, 1])
    weight, scale = 0.7, 1 / 4
    grad = np.empty_like(logits)
    loss_sum, correct = K.softmax_cross_entropy_forward_backward(np, logits, labels, scale, grad, weight)
    log_p = logits - np.log(np.exp(logits).sum(axis=1, keepdims=True))
    labelled = labels >= 0
    want = -log_p[labelled, labels[labelled]].sum() + weight * (-log_p[~labelled].mean(axis=1)).sum()
    assert float(loss_sum) == pytest.approx(want)
    assert float(K.softmax_cross_entropy_forward(np, logits, labels, weight)[0]) == pytest.approx(want)
    assert int(correct) == int((logits.argmax(axis=1) == labels)[labelled].sum())
    for index in range(logits.size):
        flat = logits.reshape(-1)
        old = flat[index]
        flat[index] = old + EPS
        up = float(K.softmax_cross_entropy_forward(np, logits, labels, weight)[0]) * scale
        flat[index] = old - EPS
        down = float(K.softmax_cross_entropy_forward(np, logits, labels, weight)[0]) * scale
        flat[index] = old
        assert grad.reshape(-1)[index] == pytest.approx((up - down) / (2 * EPS), abs=1e-7)
    # an outlier row's gradient pushes towards the uniform posterior: it sums to zero and vanishes there
    assert np.allclose(grad[~labelled].sum(axis=1), 0)
    flat_logits = np.zeros((1, 4))
    K.softmax_cross_entropy_forward_backward(np, flat_logits, np.array([-1]), 1.0, grad[:1], weight)
    assert np.allclose(grad[:1], 0)
