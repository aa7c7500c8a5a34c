"""The Numba CPU backend against the NumPy reference backend and PyTorch-made golden outputs.

The parity cases are driven by the op registry: every op in formats/ops.py OPS must appear in
some case (a new op without a case fails `test_every_op_has_a_case`). Shapes are odd on purpose
(13 and 24 channels, odd H and W, stride 2, dilation 2, groups 3, depthwise, pool padding) to hit
loop tails and borders, at batch sizes 1 and 3.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import tracemalloc

import numpy as np
import pytest

from conftest import EXAMPLES, REFERENCE_MODELS, REFERENCE_NAMES, need
from lnn.formats.binfile import build_metadata, encode_bin, parse_bin_bytes
from lnn.formats.errors import LnnInputError
from lnn.formats.model import load_model, parse_model
from lnn.formats.ops import OPS
from lnn.runtime import Session
from lnn.runtime.reference import NumpyBackend
from lnn.tests.model_weights import random_weights

TOLERANCE = 1e-4


def conv(out_channels, kernel_size=3, **attrs):
    return {"type": "conv2d", "out_channels": out_channels, "kernel_size": kernel_size, **attrs}


def conv1d(out_channels, kernel_size, **attrs):
    return {"type": "conv1d", "out_channels": out_channels, "kernel_size": kernel_size, **attrs}


# id -> (input_shape, layers)
CASES = {
    "conv_pad_relu": ([13, 9, 11], [conv(24, padding=1, activation="relu")]),
    "conv_stride2_dilation2": ([24, 13, 11], [conv(13, stride=2, padding=2, dilation=2, activation="tanh")]),
    "conv_groups3_gemm": ([24, 9, 7], [conv(12, groups=3, padding=1, activation={"type": "leaky_relu", "negative_slope": 0.2})]),
    "conv_depthwise_direct": ([13, 11, 9], [conv(13, groups=13, stride=2, padding=1, activation="relu6")]),
    "conv_pointwise": ([13, 7, 9], [conv(24, kernel_size=1, activation="sigmoid")]),
    "conv_pointwise_groups_direct": ([24, 5, 7], [conv(12, kernel_size=1, groups=3, bias=False)]),
    "conv_rect_kernel_stride": ([3, 15, 13], [conv(13, kernel_size=[3, 5], stride=[2, 1], padding=[1, 2])]),
    "conv_softmax_channels": ([5, 6, 7], [conv(7, padding=1, activation="softmax")]),
    "conv_relu_maxpool_fused": ([13, 11, 13], [conv(24, padding=1, activation="relu"),
                                               {"type": "maxpool2d", "kernel_size": 3, "stride": 2, "padding": 1}]),
    "conv_pool_then_batchnorm": ([6, 9, 8], [conv(7, padding=1), {"type": "maxpool2d", "kernel_size": 2},
                                             {"type": "batchnorm", "activation": "relu6"}]),
    "conv_pool_then_activation_layer": ([6, 9, 8], [conv(7, stride=2, padding=1), {"type": "maxpool2d", "kernel_size": 2,
                                                                                    "stride": 1, "padding": 1},
                                                    {"type": "tanh"}]),
    "conv_chain_writing_padded_inputs": ([5, 12, 10], [conv(8, padding=1, activation="relu"), {"type": "maxpool2d", "kernel_size": 2},
                                                       conv(6, padding=2, dilation=2, activation="softmax"),
                                                       conv(4, kernel_size=[3, 1], padding=[1, 0], stride=[2, 1])]),
    "conv_then_activation_layer_then_pool": ([3, 12, 10], [conv(13, padding=1), {"type": "leaky_relu"},
                                                           {"type": "maxpool2d", "kernel_size": 2}]),
    "conv_negative_leaky_relu_then_maxpool": ([3, 12, 10], [conv(8, padding=1, activation={"type": "leaky_relu", "negative_slope": -0.5}),
                                                            {"type": "maxpool2d", "kernel_size": 2}]),
    "conv_winograd_auto_relu_maxpool": ([16, 12, 10], [conv(24, padding=1, activation="relu"),
                                                        {"type": "maxpool2d", "kernel_size": 2}]),
    "conv_direct_rgb_relu_maxpool": ([3, 17, 15], [conv(16, padding=1, activation="relu"),    # conv_direct.py
                                                    {"type": "maxpool2d", "kernel_size": 2}]),
    "conv_winograd_odd_unpadded": ([5, 9, 11], [conv(7, algorithm="winograd", activation="sigmoid")]),
    "conv_winograd_odd_padded2_pool3": ([6, 9, 7], [conv(5, padding=2, algorithm="winograd"),
                                                   {"type": "maxpool2d", "kernel_size": 3, "stride": 2, "padding": 1}]),
    "maxpool_odd": ([13, 11, 9], [{"type": "maxpool2d", "kernel_size": 3, "stride": 1}]),
    "maxpool_default_stride": ([13, 11, 9], [{"type": "maxpool2d", "kernel_size": 2}]),
    "avgpool_include_pad": ([13, 11, 9], [{"type": "avgpool2d", "kernel_size": 3, "stride": 2, "padding": 1}]),
    "avgpool_exclude_pad": ([13, 11, 9], [{"type": "avgpool2d", "kernel_size": 3, "stride": 2, "padding": 1,
                                           "count_include_pad": False}]),
    "avgpool_no_pad": ([24, 10, 7], [{"type": "avgpool2d", "kernel_size": [2, 3], "stride": [2, 1]}]),
    "global_avg_pool": ([24, 7, 5], [{"type": "global_avg_pool"}]),
    "global_avg_pool_keepdims": ([13, 7, 5], [{"type": "global_avg_pool", "keepdims": True}, {"type": "flatten"}]),
    "batchnorm2d_folded_into_conv": ([13, 9, 7], [conv(24, padding=1), {"type": "dropout", "p": 0.3},
                                                  {"type": "batchnorm", "activation": "relu"}]),
    "batchnorm2d_standalone": ([13, 9, 7], [{"type": "batchnorm"}, {"type": "relu"},
                                            {"type": "maxpool2d", "kernel_size": 2}, {"type": "batchnorm", "activation": "tanh"}]),
    "batchnorm2d_after_conv_with_activation": ([5, 7, 9], [conv(13, activation="relu"), {"type": "batchnorm"}]),
    "mlp_activations": ([13, 3, 5], [{"type": "flatten"}, {"type": "linear", "out_features": 24, "activation": "relu6"},
                                     {"type": "dropout"}, {"type": "linear", "out_features": 13, "bias": False},
                                     {"type": "batchnorm"}, {"type": "tanh"},
                                     {"type": "linear", "out_features": 7, "activation": "softmax"}]),
    "batchnorm1d_standalone_and_layers": ([24], [{"type": "batchnorm", "activation": "sigmoid"}, {"type": "relu"},
                                                 {"type": "relu6"}, {"type": "sigmoid"}, {"type": "tanh"},
                                                 {"type": "leaky_relu", "negative_slope": 0.3}, {"type": "softmax"}]),
    "linear_then_softmax_layer": ([13], [{"type": "linear", "out_features": 5}, {"type": "softmax"}]),
    "conv1d_same_even_kernel_groups_batchnorm": ([6, 23], [conv1d(9, 8, padding="same", groups=3), {"type": "batchnorm"},
                                                          {"type": "relu"}, conv1d(5, 3, padding=2, stride=2, dilation=2)]),
    "conv1d_asymmetric_depthwise_pointwise": ([5, 17], [conv1d(10, 5, padding=[1, 3], activation="tanh"),
                                                       conv1d(10, 3, groups=10, padding="same", bias=False),
                                                       conv1d(7, 1, activation="softmax")]),
    "conv1d_relu_maxpool1d_fused_then_pools": ([6, 37], [conv1d(9, 5, padding=2, activation="relu"),
                                                         {"type": "maxpool1d", "kernel_size": 3, "stride": 2, "padding": 1},
                                                         {"type": "avgpool1d", "kernel_size": 3, "stride": 1, "padding": 1,
                                                          "count_include_pad": False},
                                                         {"type": "maxpool1d", "kernel_size": 2},
                                                         {"type": "avgpool1d", "kernel_size": 2, "padding": 1},
                                                         {"type": "global_max_pool"}]),
    "conv1d_tanh_maxpool1d_global_avg_keepdims": ([5, 20], [conv1d(7, 3, activation="tanh"),
                                                            {"type": "maxpool1d", "kernel_size": 2},
                                                            {"type": "global_avg_pool", "keepdims": True},
                                                            {"type": "flatten"}]),
    "global_max_pool_image_keepdims": ([13, 7, 5], [{"type": "global_max_pool", "keepdims": True}]),
    "layernorm_series_whole_then_last_axis": ([6, 13], [conv1d(8, 3, padding=1), {"type": "layernorm"},
                                                        {"type": "layernorm", "normalized_shape": [13], "bias": False},
                                                        {"type": "layernorm", "normalized_shape": 13,
                                                         "elementwise_affine": False, "eps": 1e-2}]),
    "layernorm_image_and_flat": ([3, 5, 7], [{"type": "layernorm", "normalized_shape": [5, 7]}, {"type": "flatten"},
                                             {"type": "linear", "out_features": 24}, {"type": "layernorm"}]),
    "conv1d_valid_stride3_then_linear": ([3, 31], [conv1d(4, 7, stride=3, padding="valid", activation="relu6"),
                                                  {"type": "flatten"}, {"type": "linear", "out_features": 3}]),
    "lstm_bidirectional_two_layers": ([3, 9], [{"type": "lstm", "hidden_size": 6, "num_layers": 2, "bidirectional": True}]),
    "gru_last_then_linear": ([4, 7], [{"type": "gru", "hidden_size": 5, "return": "last"},
                                      {"type": "linear", "out_features": 3}]),
}


def cpu_backend(model, weights, **options):
    from lnn.runtime.cpu import BACKEND

    return BACKEND(model, weights, **options)


def test_every_op_has_a_case():
    used = {layer["type"] for _, layers in CASES.values() for layer in layers}
    used |= {layer["activation"] if isinstance(layer.get("activation"), str) else layer["activation"]["type"]
             for _, layers in CASES.values() for layer in layers if layer.get("activation")}
    assert set(OPS) - used == set()


def test_every_op_has_a_cpu_layer():
    """backend.py's table is built from what each layer class says it runs (`ops`): an op of the registry that no
    layer names fails here, dropout alone being the identity at inference."""
    from lnn.formats.ops import layer_table
    from lnn.runtime.cpu.backend import IDENTITY_AT_INFERENCE, LAYERS

    assert sorted(set(OPS) - set(LAYERS)) == sorted(IDENTITY_AT_INFERENCE) == ["dropout"]
    assert all(callable(getattr(layer, "plan", None)) for layer in LAYERS.values())
    with pytest.raises(ImportError, match=r"CPU layers for ops the registry does not have: \['lstm2'\]"):
        layer_table("CPU", [{"Layer": type("Layer", (), {"ops": ("lstm2",)})}])


@pytest.mark.parametrize("case", sorted(CASES))
def test_matches_numpy_reference(case):
    input_shape, layers = CASES[case]
    model = parse_model({"name": case, "input_shape": input_shape, "layers": layers})
    rng = np.random.default_rng(sorted(CASES).index(case))
    weights = random_weights(model, rng)
    backend = cpu_backend(model, weights)
    reference = NumpyBackend(model, weights)
    for batch in (1, 3):
        x = rng.standard_normal((batch, *input_shape)).astype(np.float32)
        got = backend.run(x)
        expected = reference.run(x)
        assert got.shape == expected.shape
        np.testing.assert_allclose(got, expected, rtol=0, atol=TOLERANCE, err_msg=f"{case}, batch {batch}")


@pytest.mark.parametrize("case", ["lstm_bidirectional_two_layers", "gru_last_then_linear"])
def test_recurrent_row_blocks_match_numpy_reference(case):
    """lstm / gru run their products in blocks of 3 rows (recurrent.py ROW_BLOCK): a batch of several blocks
    and a last one of 2 rows."""
    input_shape, layers = CASES[case]
    model = parse_model({"name": case, "input_shape": input_shape, "layers": layers})
    rng = np.random.default_rng(5)
    weights = random_weights(model, rng)
    x = rng.standard_normal((8, *input_shape)).astype(np.float32)
    np.testing.assert_allclose(cpu_backend(model, weights).run(x), NumpyBackend(model, weights).run(x), rtol=0,
                               atol=TOLERANCE)


@pytest.mark.parametrize("case", ["conv_relu_maxpool_fused", "conv_pool_then_activation_layer", "conv_rect_kernel_stride",
                                  "conv_chain_writing_padded_inputs", "conv_pointwise", "conv_groups3_gemm",
                                  "conv_winograd_auto_relu_maxpool", "conv_winograd_odd_padded2_pool3",
                                  "conv_direct_rgb_relu_maxpool"])
def test_matches_numpy_reference_in_row_bands(case, monkeypatch):
    """With a tiny band budget every image runs as many bands of output rows (pool windows that
    overlap two bands, pool padding, stride-2 im2col, pointwise and grouped products)."""
    from lnn.runtime.cpu import conv2d

    monkeypatch.setattr(conv2d, "CHUNK_BYTES", 2048)
    monkeypatch.setattr(conv2d, "WINOGRAD_BAND_PER_U", 0)    # (not U's size either)
    input_shape, layers = CASES[case]
    model = parse_model({"name": case, "input_shape": input_shape, "layers": layers})
    rng = np.random.default_rng(5)
    weights = random_weights(model, rng)
    backend = cpu_backend(model, weights)
    assert any(band[2] > 0 for layer in backend.layers if isinstance(layer, conv2d.Conv2dLayer)
               for band in layer._bands(2, input_shape[2] + 2)[0])
    x = rng.standard_normal((2, *input_shape)).astype(np.float32)
    np.testing.assert_allclose(backend.run(x), NumpyBackend(model, weights).run(x), rtol=0, atol=TOLERANCE)


def test_fusions_happen():
    """Batch norm folds into the conv (through a dropout), the activation layer joins the conv, and a
    max-pool after a conv with a monotone activation runs inside the conv; a batch norm after an
    activation stays a layer, and so does one after a fused pool (its scale may be negative)."""
    def layers_of(case_layers, input_shape=(13, 11, 13)):
        model = parse_model({"input_shape": list(input_shape), "layers": case_layers})
        return cpu_backend(model, random_weights(model, np.random.default_rng(0))).layers

    def layer_types(case):
        input_shape, layers = CASES[case]
        return [type(layer).__name__ for layer in layers_of(layers, input_shape)]

    assert layer_types("batchnorm2d_folded_into_conv") == ["Conv2dLayer"]
    assert layer_types("conv_then_activation_layer_then_pool") == ["Conv2dLayer"]
    assert layer_types("batchnorm2d_after_conv_with_activation") == ["Conv2dLayer", "BatchNormLayer"]
    assert layer_types("conv_pool_then_batchnorm") == ["Conv2dLayer", "BatchNormLayer"]
    [conv_layer] = layers_of(CASES["conv_relu_maxpool_fused"][1])
    assert conv_layer.has_pool and conv_layer.out_shape == (24, 6, 7)
    assert [type(layer).__name__ for layer in layers_of([conv(5, activation="softmax"), {"type": "maxpool2d", "kernel_size": 2}])] \
        == ["Conv2dLayer", "MaxPool2dLayer"]
    assert layer_types("conv_negative_leaky_relu_then_maxpool") == ["Conv2dLayer", "MaxPool2dLayer"]


def test_non_monotone_activation_before_max_pool_matches_onnxruntime(tmp_path):
    """Conv -> LeakyRelu(-0.5) -> MaxPool: the pool must not run before the activation (it did: 4.9 off)."""
    pytest.importorskip("onnx")
    onnxruntime = pytest.importorskip("onnxruntime")
    from lnn.formats.onnx_export import export_onnx

    input_shape, layers = CASES["conv_negative_leaky_relu_then_maxpool"]
    model = parse_model({"name": "leaky_pool", "input_shape": input_shape, "layers": layers})
    rng = np.random.default_rng(7)
    weights = random_weights(model, rng)
    export_onnx(model, weights, tmp_path / "leaky_pool.onnx")
    x = rng.standard_normal((2, *input_shape)).astype(np.float32)
    ort = onnxruntime.InferenceSession(str(tmp_path / "leaky_pool.onnx"), providers=["CPUExecutionProvider"])
    np.testing.assert_allclose(cpu_backend(model, weights).run(x), ort.run(None, {"input": x})[0], rtol=0, atol=TOLERANCE)


def test_conv_algorithm_choice():
    """"auto" runs Winograd for 3x3 stride-1 ungrouped convs with enough inputs and output tiles (fewer
    when all are whole); a layer's "algorithm" overrides it where Winograd applies, and is ignored
    where it does not (stride 2)."""
    from lnn.runtime.cpu.conv2d import WINOGRAD_MIN_CHANNELS

    def uses_winograd(channels, size=12, **attrs):
        model = parse_model({"input_shape": [channels, size, size], "layers": [conv(4, **attrs)]})
        return cpu_backend(model, random_weights(model, np.random.default_rng(0))).layers[0].winograd

    assert uses_winograd(WINOGRAD_MIN_CHANNELS, padding=1)                  # 3 x 3 tiles
    assert not uses_winograd(WINOGRAD_MIN_CHANNELS - 1, padding=1)
    assert uses_winograd(WINOGRAD_MIN_CHANNELS, size=8, padding=1)          # 2 x 2 whole tiles
    assert not uses_winograd(WINOGRAD_MIN_CHANNELS, size=6, padding=1)      # 2 x 2 tiles, 36 of 64 cells used
    assert not uses_winograd(WINOGRAD_MIN_CHANNELS, size=4, padding=1)      # 1 tile
    assert uses_winograd(WINOGRAD_MIN_CHANNELS, size=6, padding=1, algorithm="winograd")
    assert not uses_winograd(WINOGRAD_MIN_CHANNELS, padding=1, algorithm="im2col")
    assert uses_winograd(3, algorithm="winograd")
    assert not uses_winograd(3, algorithm="winograd", stride=2)
    assert not uses_winograd(WINOGRAD_MIN_CHANNELS, kernel_size=5)


def test_padded_inputs_are_written_in_place():
    """A conv feeding a padded conv writes into that conv's zero-bordered input, and a padded first
    conv reads the plan's input buffer: no padding copy is left in the plan."""
    input_shape, layers = CASES["conv_chain_writing_padded_inputs"]
    model = parse_model({"input_shape": input_shape, "layers": layers})
    backend = cpu_backend(model, random_weights(model, np.random.default_rng(0)))
    backend.run(np.ones((2, *input_shape), np.float32))
    assert np.copyto not in [getattr(step, "func", None) for step in backend._plan(2).steps]


def check_weights_and_input_left_alone(make_backend):
    """make_backend(model, weights) runs a folded batch norm without changing its weights or input."""
    input_shape, layers = CASES["batchnorm2d_folded_into_conv"]
    model = parse_model({"input_shape": input_shape, "layers": layers})
    weights = random_weights(model, np.random.default_rng(7))
    frozen = {k: v.copy() for k, v in weights.items()}
    x = np.random.default_rng(8).standard_normal((2, *input_shape)).astype(np.float32)
    x_before = x.copy()
    make_backend(model, weights).run(x)
    assert all(np.array_equal(weights[k], frozen[k]) for k in weights)
    assert np.array_equal(x, x_before)


def test_does_not_modify_weights_or_input():
    check_weights_and_input_left_alone(cpu_backend)


def check_reference_model_through_bin(name, device):
    """The PyTorch-made reference model `name`, encoded as .bin, gives its golden outputs on `device`."""
    model = load_model(EXAMPLES / "reference" / f"{name}.json")
    weights = dict(np.load(need(REFERENCE_MODELS / f"{name}.weights.npz")))
    samples = np.load(need(REFERENCE_MODELS / f"{name}.samples.npz"))
    session = Session(parse_bin_bytes(encode_bin(model, weights, build_metadata(model))), device)
    assert session.backend.name == device
    np.testing.assert_allclose(session.run(samples["input"]), samples["expected"], rtol=0, atol=TOLERANCE)
    np.testing.assert_allclose(session.run(samples["input"][:1]), samples["expected"][:1], rtol=0, atol=TOLERANCE)


@pytest.mark.parametrize("name", REFERENCE_NAMES)
def test_reference_model_through_bin(name):
    check_reference_model_through_bin(name, "cpu")


def test_no_allocation_after_first_call_per_batch_size():
    """tracemalloc sees every NumPy buffer; the kernels create no arrays (Numba's only per-call allocations
    are the small wrappers it makes for each array argument, which tracemalloc does not see). The calls up to
    the PROGRAM_AT_RUN'th build the plan's one-thread program (its tables) too: counted from there."""
    from lnn.runtime.cpu.backend import PROGRAM_AT_RUN

    input_shape = [13, 41, 45]
    model = parse_model({"input_shape": input_shape, "layers": [
        conv(24, padding=1, activation="relu"), {"type": "maxpool2d", "kernel_size": 3, "stride": 2, "padding": 1},
        conv(24, kernel_size=1), {"type": "batchnorm"}, conv(24, padding=1, algorithm="winograd"),
        conv(24, kernel_size=3, groups=24, padding=1, activation="tanh"), {"type": "avgpool2d", "kernel_size": 2},
        {"type": "flatten"}, {"type": "linear", "out_features": 10, "activation": "softmax"}]})
    backend = cpu_backend(model, random_weights(model, np.random.default_rng(3)), threads=1)
    batch = 8
    x = np.random.default_rng(4).standard_normal((batch, *input_shape)).astype(np.float32)
    limit = 64 * 1024       # Python's own small objects (threadpoolctl's, the GC's) come and go below this
    assert all(np.prod(node.out_shape) * batch * 4 > limit for node in model.nodes[:-1])

    first = backend.run(x)
    expected = first.copy()
    for _ in range(PROGRAM_AT_RUN - 1):
        backend.run(x)
    tracemalloc.start()
    for _ in range(50):
        out = backend.run(x)
    after, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()

    assert out is first                  # the same planned output buffer every call
    np.testing.assert_array_equal(out, expected)
    assert peak < limit                  # no intermediate buffer was allocated, even briefly
    assert after < limit                 # and nothing accumulates


def test_layers_share_one_scratch_block(monkeypatch):
    """A conv's working buffers (V, M, acc, columns, ...) are pieces of one block that every layer of the plan
    reuses from its start (the layers run one after another): the block is the largest layer's need, not the
    sum. The outputs are byte for byte those of plans in which every buffer is its own, at 1 and 2 threads
    (every layer split), over calls that alternate inputs and batch sizes."""
    from lnn.runtime.cpu.backend import Plan
    from lnn.runtime.cpu.parallel import all_steps

    input_shape = [3, 40, 40]
    model = parse_model({"input_shape": input_shape, "layers": [
        conv(16, padding=1, activation="relu"), {"type": "maxpool2d", "kernel_size": 2},          # direct, pooled
        {"type": "batchnorm"},                   # a layer: the next conv pads a copy, its border set once
        conv(24, padding=1, algorithm="winograd", activation="relu"), {"type": "maxpool2d", "kernel_size": 2},
        conv(32, padding=1, stride=2, activation="relu"),                                         # columns + GEMM
        conv(48, padding=1, algorithm="winograd"), {"type": "batchnorm"},                         # few tiles
        {"type": "global_avg_pool"}, {"type": "linear", "out_features": 5}]})
    weights = random_weights(model, np.random.default_rng(8))
    backend = cpu_backend(model, weights, threads=1)
    plan = Plan(backend.layers, model.input_shape, 2)
    (block,) = plan.scratch.values()                                  # one thread: one worker's block
    start = block.ctypes.data
    ends = []                  # per layer: where its scratch ends in the block (bytes), 0 when it has none
    for first, end in plan.layer_steps:
        used = [a.ctypes.data + a.nbytes - start for step in all_steps(plan.steps[first:end])
                for a in getattr(step, "args", ()) if isinstance(a, np.ndarray) and np.shares_memory(a, block)]
        ends.append(max(used, default=0))
    assert sum(end > 0 for end in ends) == 4                         # each conv
    assert max(ends) <= block.nbytes < sum(ends)

    own = Plan._new_buffer
    monkeypatch.setattr(Plan, "_new_buffer", lambda self, shape, scratch=False, worker=0: own(self, shape))
    separate = {threads: cpu_backend(model, weights, threads=threads) for threads in (1, 2)}
    for each in separate.values():
        each.task_flops = 0
        each.run(np.zeros((1, *input_shape), np.float32))            # its plans made with buffers of their own
        each.run(np.zeros((3, *input_shape), np.float32))
    monkeypatch.undo()
    rng = np.random.default_rng(9)
    for threads, reference in separate.items():
        shared = cpu_backend(model, weights, threads=threads)
        shared.task_flops = 0
        for batch in (1, 3, 1, 3):
            x = rng.standard_normal((batch, *input_shape)).astype(np.float32)
            np.testing.assert_array_equal(shared.run(x), reference.run(x), err_msg=f"{threads} threads, batch {batch}")


def test_each_thread_has_a_scratch_block_of_its_own():
    """In a split plan the scratch of a Parallel step's task i is a piece of worker i's block (the thread that runs
    task i), and only the Winograd V that the tasks of both threads write and read is in the shared block: no
    scratch line is written by one core and then by the other (when the cores share no cache, tomato's split calls
    took 1.31-1.61 ms so, 1.80-2.05 with one block for all, by hand). The blocks do not overlap."""
    from lnn.runtime.cpu.backend import Plan
    from lnn.runtime.cpu.parallel import SHARED, Parallel

    model = parse_model({"input_shape": [8, 32, 32], "layers": [
        conv(32, padding=1, algorithm="winograd", activation="relu"), {"type": "maxpool2d", "kernel_size": 2},
        conv(128, padding=1, algorithm="winograd", activation="relu"),         # U outweighs V: by output channels
        {"type": "global_avg_pool"}, {"type": "linear", "out_features": 5}]})
    backend = cpu_backend(model, random_weights(model, np.random.default_rng(3)), threads=1)
    plan = Plan(backend.layers, model.input_shape, 1, parts=2, task_flops=0)
    assert set(plan.scratch) == {0, 1, SHARED}
    spans = sorted((block.ctypes.data, block.ctypes.data + block.nbytes) for block in plan.scratch.values())
    assert all(end <= start for (_, end), (start, _) in zip(spans, spans[1:]))

    def blocks_of(steps):
        return {worker for step in steps for a in getattr(step, "args", ()) if isinstance(a, np.ndarray)
                for worker, block in plan.scratch.items() if np.shares_memory(a, block)}

    split = [step for step in plan.steps if type(step) is Parallel]
    assert len(split) >= 3                          # conv1 by rows; conv2's V by input channels, then the rest
    for step in split:
        for task, steps in enumerate(step.tasks):
            assert blocks_of(steps) <= {task, SHARED}, f"task {task}"
            assert task in blocks_of(steps)
    assert any(SHARED in blocks_of(steps) for step in split for steps in step.tasks[1:])
    assert blocks_of(step for step in plan.steps if type(step) is not Parallel) <= {0}


def test_threads_option_limits_blas_during_run():
    from threadpoolctl import threadpool_info

    from lnn.runtime.cpu.linear import FUSED_MAX_BATCH

    model = parse_model({"input_shape": [13], "layers": [{"type": "linear", "out_features": 5}]})
    backend = cpu_backend(model, random_weights(model, np.random.default_rng(0)), threads=1)
    seen = []
    backend.layers[0].plan = _spy_plan(backend.layers[0].plan, lambda: seen.append(
        [info["num_threads"] for info in threadpool_info() if info["user_api"] == "blas"]))
    over = FUSED_MAX_BATCH + 1
    backend.run(np.ones((over, 13), np.float32))              # a BLAS product (not the fused kernel)
    assert seen and all(n == 1 for n in seen[0])
    assert backend._plan(over).uses_blas
    backend.run(np.ones((2, 13), np.float32))                 # batch 2: one fused kernel, BLAS left alone
    assert not backend._plan(2).uses_blas
    with pytest.raises(LnnInputError, match="threads must be a positive whole number or 'auto', not 0"):
        cpu_backend(model, random_weights(model, np.random.default_rng(0)), threads=0)


def test_a_large_linear_layer_of_a_small_batch_is_one_fused_kernel_and_gets_a_program():
    """A layer past FUSED_MAX_WEIGHTS (a flatten of conv features into a wide layer, say) at batches 1-4: linear_dots
    on its own weights, not np.matmul (the same speed at batch 1, faster at 2; a split plan with an np.matmul step
    got no helper program); the same answers as the NumPy backend, on 1 and 2 threads. A packed copy of its weights
    (AVX-512) or a chain's concatenated copy is made only up to FUSED_MAX_WEIGHTS."""
    from lnn.runtime.cpu import linear, programs
    from lnn.runtime.cpu.parallel import all_steps

    model = parse_model({"input_shape": [1200], "layers": [{"type": "linear", "out_features": 1000, "activation": "relu"},
                                                           {"type": "linear", "out_features": 10}]})
    weights = random_weights(model, np.random.default_rng(2))
    assert model.nodes[0].param_shapes["weight"] == (1000, 1200) and 1000 * 1200 > linear.FUSED_MAX_WEIGHTS
    reference = NumpyBackend(model, weights)
    for threads in (1, 2):
        backend = cpu_backend(model, weights, threads=threads)
        backend.task_flops = 0
        for batch in (1, 2, 4):
            x = np.random.default_rng(batch).standard_normal((batch, 1200)).astype(np.float32)
            for _ in range(3):
                np.testing.assert_allclose(backend.run(x), reference.run(x), rtol=1e-4, atol=1e-4)
            plan = backend._plan(batch, threads)
            first, end = plan.layer_steps[0]
            kernels = {getattr(step, "func", None) for step in all_steps(plan.steps[first:end])}
            if linear.PACKED:         # no packed copy past FUSED_MAX_WEIGHTS: BLAS, then its bias and activation
                assert np.matmul in kernels and linear.DOTS not in kernels
            else:
                assert kernels == {linear.DOTS}               # never in a chain
            assert plan.uses_blas == linear.PACKED
        if threads == 2 and programs.AVAILABLE and not linear.PACKED:
            assert backend._plan(1, 2).program is not None


def test_blas_is_held_at_one_thread_in_a_call_from_another_thread_too():
    """threadpoolctl's setter lets only its "controlling thread" (here the main one, inside threadpool_limits) set an
    OpenBLAS count and does nothing in any other: a call on a worker thread ran its BLAS products on every thread
    (two such calls at once took 2.4x as long as one alone, with the app's compiled kernels, by hand), as it did
    again with NumPy 2.5's OpenBLAS 0.3.34, which no longer exports the openblas_set_num_threads_local lnn called.
    Checked on NumPy's BLAS, the one lnn's products call, where it is its wheels' OpenBLAS (pthreads)."""
    from threadpoolctl import threadpool_info, threadpool_limits

    from lnn.runtime.cpu.jit import blas_libraries
    from lnn.runtime.cpu.linear import FUSED_MAX_BATCH

    held = {library.filepath for library in blas_libraries()
            if "scipy_openblas" in library.filepath and library.threading_layer == "pthreads"}
    if not held:
        pytest.skip("NumPy's BLAS here is not its wheels' OpenBLAS (pthreads)")

    def blas_counts():
        return {info["filepath"]: info["num_threads"] for info in threadpool_info() if info["filepath"] in held}

    model = parse_model({"input_shape": [13], "layers": [{"type": "linear", "out_features": 5}]})
    backend = cpu_backend(model, random_weights(model, np.random.default_rng(0)), threads=1)
    seen = []
    backend.layers[0].plan = _spy_plan(backend.layers[0].plan, lambda: seen.append(blas_counts()))
    x = np.ones((FUSED_MAX_BATCH + 1, 13), np.float32)          # a BLAS product
    with threadpool_limits(2, user_api="blas"):
        before = blas_counts()
        backend.run(x)                                          # the main thread sets a count, then gives it back
        worker = threading.Thread(target=backend.run, args=(x,))
        worker.start()
        worker.join()
        after = blas_counts()
    assert before == dict.fromkeys(held, 2)
    assert seen == [dict.fromkeys(held, 1)] * 2
    assert after == before


def _spy_plan(plan, spy):
    def spied(src, new_buffer, *parts):
        dst, steps = plan(src, new_buffer, *parts)
        return dst, [spy, *steps]
    return spied


def test_warmup_records_compile_time():
    model = parse_model({"input_shape": [3, 8, 8], "layers": [conv(4, padding=1, activation="relu")]})
    backend = cpu_backend(model, random_weights(model, np.random.default_rng(0)))
    assert backend.compile_seconds is None
    assert backend.warmup() == backend.compile_seconds >= 0


def _python(code: str, env_changes: dict, timeout=900) -> subprocess.CompletedProcess:
    """Run code in a fresh interpreter. The timeout only guards against a hang: a fresh Numba compile takes
    seconds here but ran past 120 s under arm64 emulation on a busy host (BENCHMARKS arm64_emulation)."""
    env = {k: v for k, v in os.environ.items() if k not in ("NUMBA_CACHE_DIR", "LNN_CACHE_DIR")}
    env.update(env_changes)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=timeout)


SMALL_MODEL = {"input_shape": [3, 6, 5], "layers": [conv(4, padding=1, activation="relu"), {"type": "flatten"},
                                                      {"type": "linear", "out_features": 3}]}
RUN_SMALL_MODEL = f"""
import json, warnings, numpy as np
warnings.simplefilter("always")
from lnn.formats.model import parse_model
from lnn.runtime.reference import NumpyBackend
from lnn.runtime.cpu import cache
model = parse_model(json.loads({json.dumps(json.dumps(SMALL_MODEL))}))
rng = np.random.default_rng(0)
weights = {{k: rng.standard_normal(s).astype(np.float32) for k, s in model.param_shapes().items()}}
x = rng.standard_normal((2, 3, 6, 5)).astype(np.float32)
print("cached before:", cache.kernels_cached(model))
from lnn.runtime.cpu import BACKEND
backend = BACKEND(model, weights)
backend.warmup()
print("max error:", float(np.abs(backend.run(x) - NumpyBackend(model, weights).run(x)).max()))
print("cached after:", cache.kernels_cached(model))
"""


def test_unwritable_cache_falls_back_with_one_warning(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a folder")
    result = _python(RUN_SMALL_MODEL, {"LNN_CACHE_DIR": str(blocker / "cache")})
    assert result.returncode == 0, result.stderr
    assert result.stderr.count("cannot write the Numba kernel cache") == 1, result.stderr
    assert float(result.stdout.split("max error:")[1].split()[0]) <= TOLERANCE
    assert "cached after: False" in result.stdout


def test_cache_folder_and_warm_marker(tmp_path):
    """The marker (lnn-bench's "from the cache") follows the first call that ends, warm_up or not."""
    result = _python(RUN_SMALL_MODEL.replace("backend.warmup()\n", ""), {"LNN_CACHE_DIR": str(tmp_path)})
    assert result.returncode == 0, result.stderr
    assert "cannot write" not in result.stderr
    assert "cached before: False" in result.stdout and "cached after: True" in result.stdout
    assert list((tmp_path / "numba").rglob("*.nbi")), "numba wrote no cache index in the chosen folder"
    again = _python(RUN_SMALL_MODEL, {"LNN_CACHE_DIR": str(tmp_path)})
    assert "cached before: True" in again.stdout


def test_importing_the_runtime_does_not_import_numba():
    code = ("import sys, lnn.runtime, lnn.runtime.cpu, lnn.runtime.cpu.cache; "
            "print('numba' in sys.modules)")
    result = _python(code, {})
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "False"


def test_threads_split_a_large_batch_and_match_the_reference():
    from lnn.runtime.cpu.backend import MIN_SPLIT_FLOPS

    model = load_model(EXAMPLES / "reference" / "leaf_cnn.json")
    weights = random_weights(model, np.random.default_rng(5))
    backend, reference = cpu_backend(model, weights, threads=2), NumpyBackend(model, weights)
    per_row = sum(node.flops for node in model.nodes)
    rng = np.random.default_rng(6)
    for batch in (1, 3, 1):                     # 1 row: its layers split; 3 rows are split into units [0, 2) and [2, 3)
        x = rng.standard_normal((batch, *model.input_shape)).astype(np.float32)
        np.testing.assert_allclose(backend.run(x), reference.run(x), rtol=0, atol=TOLERANCE)
    assert 3 * per_row >= MIN_SPLIT_FLOPS > per_row
    assert set(backend._plans.keys()) == {(1, 2, 0), (1, 1, 0), (2, 1, 0), (2, 1, 1), (1, 1, 1)}  # (rows, parts, part):
    # a lone row's split plan; each thread's plans for units of 2 rows and of 1
