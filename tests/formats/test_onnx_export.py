"""ONNX export: the exported graph, run by onnxruntime (optimizations off and at the default level),
must give what lnn's NumPy reference runtime gives, and on the reference models what PyTorch gave."""

import json
import sys

import numpy as np
import pytest

from conftest import EXAMPLES, REFERENCE_MODELS, REFERENCE_NAMES, need
from lnn.formats.binfile import build_metadata, encode_bin, parse_bin_bytes
from lnn.formats.errors import LnnError
from lnn.formats.model import load_model, parse_model
from lnn.runtime import Session

onnx = pytest.importorskip("onnx")
onnxruntime = pytest.importorskip("onnxruntime")

from lnn.formats.onnx_export import build_onnx, export_bin_to_onnx, export_onnx  # noqa: E402
from lnn.formats.onnx_import import import_onnx  # noqa: E402
from lnn.tests.model_weights import random_weights

TOLERANCE = 1e-4
LEVELS = {"optimizations off": onnxruntime.GraphOptimizationLevel.ORT_DISABLE_ALL,
          "default optimizations": onnxruntime.GraphOptimizationLevel.ORT_ENABLE_ALL}

# Every op and attribute the exporter handles: batch norm folded into a bias-less conv and into a linear,
# a batch norm that cannot fold (its conv has an activation), groups, depthwise, dilation, stride,
# rectangular kernels, pooling with padding (both count_include_pad), dropout, every activation fused
# and stand-alone, global_avg_pool with keepdims then flatten.
EVERY_OP = {
    "name": "every_op", "input_shape": [4, 17, 15],
    "layers": [
        {"type": "conv2d", "name": "conv_bn", "out_channels": 12, "kernel_size": 3, "padding": 1, "bias": False},
        {"type": "batchnorm", "name": "bn_folded", "activation": "relu6"},
        {"type": "conv2d", "name": "grouped", "out_channels": 12, "kernel_size": [3, 5], "stride": 2,
         "dilation": [2, 1], "padding": [2, 1], "groups": 3,
         "activation": {"type": "leaky_relu", "negative_slope": 0.2}},
        {"type": "batchnorm", "name": "bn_alone", "activation": "tanh"},
        {"type": "avgpool2d", "kernel_size": 3, "stride": 2, "padding": 1, "count_include_pad": False},
        {"type": "conv2d", "name": "depthwise", "out_channels": 12, "kernel_size": 3, "padding": 1, "groups": 12,
         "activation": "sigmoid"},
        {"type": "avgpool2d", "kernel_size": 2, "stride": 1, "padding": 1, "count_include_pad": True},
        {"type": "maxpool2d", "kernel_size": 3, "stride": 2, "padding": 1},
        {"type": "relu"},
        {"type": "dropout", "p": 0.3},
        {"type": "conv2d", "name": "pointwise", "out_channels": 8, "kernel_size": 1},
        {"type": "global_avg_pool", "keepdims": True},
        {"type": "flatten"},
        {"type": "linear", "name": "fc_bn", "out_features": 16},
        {"type": "batchnorm", "name": "bn1d"},
        {"type": "leaky_relu", "negative_slope": 0.1},
        {"type": "tanh"}, {"type": "sigmoid"}, {"type": "relu6"},
        {"type": "linear", "name": "fc_out", "out_features": 5, "activation": "relu"},
        {"type": "softmax"},
    ],
    "labels": ["a", "b", "c", "d", "e"],
}


# The sequence ops on [C, T]: conv1d with "same" (even kernel: one more zero on the right), asymmetric pads,
# stride, dilation, groups, a batch norm folded into it and one that cannot fold; 1-D pools with padding
# (both count_include_pad), layer norms (the whole sample, the time axis without bias, without affine, a
# flat vector), global max pool with keepdims then flatten, global average pool.
EVERY_SERIES_OP = {
    "name": "every_series_op", "input_shape": [3, 41],
    "layers": [
        {"type": "conv1d", "name": "c_same", "out_channels": 8, "kernel_size": 8, "padding": "same", "bias": False},
        {"type": "batchnorm", "name": "bn_folded", "activation": "relu"},
        {"type": "maxpool1d", "kernel_size": 3, "stride": 2, "padding": 1},
        {"type": "conv1d", "name": "c_grouped", "out_channels": 6, "kernel_size": 3, "stride": 2, "dilation": 2,
         "padding": [1, 2], "groups": 2, "activation": "tanh"},
        {"type": "batchnorm", "name": "bn_alone"},
        {"type": "avgpool1d", "kernel_size": 3, "stride": 1, "padding": 1, "count_include_pad": False},
        {"type": "conv1d", "name": "c_valid", "out_channels": 4, "kernel_size": 3, "padding": "valid"},
        {"type": "avgpool1d", "kernel_size": 2, "padding": 1},
        {"type": "layernorm", "name": "ln_whole"},
        {"type": "layernorm", "name": "ln_time", "normalized_shape": 5, "bias": False, "eps": 1e-3},
        {"type": "layernorm", "name": "ln_plain", "normalized_shape": [5], "elementwise_affine": False},
        {"type": "global_max_pool", "keepdims": True},
        {"type": "flatten"},
        {"type": "linear", "name": "fc", "out_features": 3},
        {"type": "layernorm", "name": "ln_flat"},
    ],
}
SERIES_AVERAGE = {"name": "series_average", "input_shape": [3, 17], "layers": [
    {"type": "conv1d", "name": "c", "out_channels": 5, "kernel_size": 3, "activation": "relu"},
    {"type": "global_avg_pool"}]}


def numpy_session(model, weights) -> Session:
    return Session(parse_bin_bytes(encode_bin(model, weights, build_metadata(model))), device="numpy")


def ort_run(path, batch, level) -> np.ndarray:
    options = onnxruntime.SessionOptions()
    options.graph_optimization_level = level
    session = onnxruntime.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    return session.run(None, {"input": batch})[0]


@pytest.mark.parametrize("name", REFERENCE_NAMES)
def test_reference_models_match_lnn_and_pytorch_in_onnxruntime(name, tmp_path):
    model = load_model(EXAMPLES / "reference" / f"{name}.json")
    weights = dict(np.load(need(REFERENCE_MODELS / f"{name}.weights.npz")))
    samples = np.load(need(REFERENCE_MODELS / f"{name}.samples.npz"))
    export_onnx(model, weights, tmp_path / f"{name}.onnx")
    lnn_out = numpy_session(model, weights).run(samples["input"])
    assert np.abs(lnn_out - samples["expected"]).max() <= TOLERANCE
    for level_name, level in LEVELS.items():
        ort_out = ort_run(tmp_path / f"{name}.onnx", samples["input"], level)
        print(f"{name} ({level_name}): max |ort - lnn| {np.abs(ort_out - lnn_out).max():.2e}, "
              f"max |ort - pytorch| {np.abs(ort_out - samples['expected']).max():.2e}")
        assert np.abs(ort_out - lnn_out).max() <= TOLERANCE, level_name
        assert np.abs(ort_out - samples["expected"]).max() <= TOLERANCE, level_name
        assert (ort_out.argmax(1) == samples["expected"].argmax(1)).all(), level_name


def test_every_op_matches_lnn_numpy_runtime(tmp_path):
    model = parse_model(EVERY_OP)
    weights = random_weights(model)
    proto = export_onnx(model, weights, tmp_path / "every_op.onnx")
    onnx.checker.check_model(proto, full_check=True)

    batch = np.random.default_rng(1).standard_normal((3, 4, 17, 15)).astype(np.float32)
    lnn_out = numpy_session(model, weights).run(batch)
    for level_name, level in LEVELS.items():
        ort_out = ort_run(tmp_path / "every_op.onnx", batch, level)
        assert ort_out.shape == (3, 5)
        assert np.abs(ort_out - lnn_out).max() <= TOLERANCE, level_name

    op_types = [node.op_type for node in proto.graph.node]
    assert "Dropout" not in op_types
    assert op_types.count("BatchNormalization") == 1          # bn_folded and bn1d folded; bn_alone follows an activation
    assert {"Conv", "Gemm", "MaxPool", "AveragePool", "GlobalAveragePool", "Flatten", "Relu", "Clip", "LeakyRelu",
            "Sigmoid", "Tanh", "Softmax"} <= set(op_types)
    pools = {node.name: node for node in proto.graph.node if node.op_type == "AveragePool"}
    count_include_pad = sorted(onnx.helper.get_attribute_value(a) for node in pools.values()
                               for a in node.attribute if a.name == "count_include_pad")
    assert count_include_pad == [0, 1]
    assert proto.graph.output[0].name == "output"             # ends in softmax: probabilities, not logits


def test_every_series_op_matches_lnn_to_1e5_and_imports_back(tmp_path):
    model = parse_model(EVERY_SERIES_OP)
    weights = random_weights(model, seed=11)
    proto = export_onnx(model, weights, tmp_path / "series.onnx")
    onnx.checker.check_model(proto, full_check=True)
    assert [node.op_type for node in proto.graph.node].count("BatchNormalization") == 1
    batch = np.random.default_rng(12).standard_normal((4, 3, 41)).astype(np.float32)
    lnn_out = numpy_session(model, weights).run(batch)
    for level_name, level in LEVELS.items():
        assert np.abs(ort_run(tmp_path / "series.onnx", batch, level) - lnn_out).max() <= 1e-5, level_name
    back, back_weights = import_onnx(tmp_path / "series.onnx")
    assert [(n.op, n.attrs.get("padding")) for n in back.nodes if n.op != "linear"] == [
        ("conv1d", (3, 4)), ("maxpool1d", 1), ("conv1d", (1, 2)), ("batchnorm", None), ("avgpool1d", 1),
        ("conv1d", (0, 0)), ("avgpool1d", 1), ("layernorm", None), ("layernorm", None), ("layernorm", None),
        ("global_max_pool", None), ("layernorm", None)]
    assert [n.attrs["normalized_shape"] for n in back.nodes if n.op == "layernorm"] == [(4, 5), (5,), (5,), (3,)]
    assert np.abs(numpy_session(back, back_weights).run(batch) - lnn_out).max() <= 1e-5
    average = parse_model(SERIES_AVERAGE)
    weights = random_weights(average, seed=13)
    export_onnx(average, weights, tmp_path / "average.onnx")
    batch = np.random.default_rng(14).standard_normal((2, 3, 17)).astype(np.float32)
    ort_out = ort_run(tmp_path / "average.onnx", batch, LEVELS["default optimizations"])
    assert ort_out.shape == (2, 5)
    assert np.abs(ort_out - numpy_session(average, weights).run(batch)).max() <= 1e-5


def test_batchnorm_folding_changes_only_rounding():
    """The folded conv alone equals conv then batch norm in lnn (the fold is exact up to float32 rounding)."""
    model = parse_model({"input_shape": [3, 9, 9], "layers": [
        {"type": "conv2d", "name": "conv", "out_channels": 6, "kernel_size": 3, "groups": 3},
        {"type": "batchnorm", "name": "bn", "eps": 1e-3}]})
    weights = random_weights(model, seed=5)
    proto = build_onnx(model, weights)
    assert [node.op_type for node in proto.graph.node] == ["Conv"]
    batch = np.random.default_rng(2).standard_normal((2, 3, 9, 9)).astype(np.float32)
    session = onnxruntime.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
    assert np.abs(session.run(None, {"input": batch})[0] - numpy_session(model, weights).run(batch)).max() <= 1e-5


def test_graph_interface_metadata_and_dynamic_batch(tmp_path):
    model = load_model(EXAMPLES / "reference" / "mnist_cnn.json")
    weights = random_weights(model, seed=3)
    proto = export_onnx(model, weights, tmp_path / "m.onnx")
    assert proto.opset_import[0].version >= 17
    (graph_input,) = proto.graph.input
    assert graph_input.name == "input"
    dims = graph_input.type.tensor_type.shape.dim
    assert dims[0].dim_param == "N" and [d.dim_value for d in dims[1:]] == [1, 28, 28]
    assert proto.graph.output[0].name == "logits"
    props = {entry.key: entry.value for entry in proto.metadata_props}
    assert json.loads(props["lnn.labels"]) == model.labels
    assert json.loads(props["lnn.preprocess"]) == model.preprocess
    assert props["lnn.name"] == "mnist_cnn"
    session = numpy_session(model, weights)
    for n in (1, 5):
        batch = np.random.default_rng(n).standard_normal((n, 1, 28, 28)).astype(np.float32)
        ort_out = ort_run(tmp_path / "m.onnx", batch, LEVELS["default optimizations"])
        assert ort_out.shape == (n, 10)
        assert np.abs(ort_out - session.run(batch)).max() <= TOLERANCE


def test_export_from_fp16_bin(tmp_path):
    model = load_model(EXAMPLES / "reference" / "mnist_mlp.json")
    weights = random_weights(model, seed=4)
    dtypes = {node.param_key("weight"): "float16" for node in model.nodes if node.op == "linear"}
    bin_model = parse_bin_bytes(encode_bin(model, weights, build_metadata(model), dtypes))
    export_bin_to_onnx(bin_model, tmp_path / "half.onnx")
    batch = np.random.default_rng(6).standard_normal((4, 1, 28, 28)).astype(np.float32)
    expected = Session(bin_model, device="numpy").run(batch)
    assert np.abs(ort_run(tmp_path / "half.onnx", batch, LEVELS["optimizations off"]) - expected).max() <= TOLERANCE


def test_round_trip_through_lnn_import_keeps_model_and_outputs(tmp_path):
    model = parse_model(EVERY_OP)
    weights = random_weights(model, seed=7)
    export_onnx(model, weights, tmp_path / "every_op.onnx")
    back, back_weights = import_onnx(tmp_path / "every_op.onnx")
    assert back.name == "every_op" and back.labels == model.labels
    # dropout gone, two batch norms folded, GlobalAveragePool + Flatten one layer, the first activation after
    # a layer without one folded into it
    assert [(n.op, (n.attrs.get("activation") or {}).get("type")) for n in back.nodes] == [
        ("conv2d", "relu6"), ("conv2d", "leaky_relu"), ("batchnorm", "tanh"), ("avgpool2d", None),
        ("conv2d", "sigmoid"), ("avgpool2d", None), ("maxpool2d", None), ("relu", None), ("conv2d", None),
        ("global_avg_pool", None), ("linear", "leaky_relu"), ("tanh", None), ("sigmoid", None), ("relu6", None),
        ("linear", "relu"), ("softmax", None)]
    assert back.nodes[9].attrs["keepdims"] is False
    assert [n.name for n in back.nodes if n.param_shapes] == ["conv_bn", "grouped", "bn_alone", "depthwise",
                                                               "pointwise", "fc_bn", "fc_out"]
    batch = np.random.default_rng(8).standard_normal((2, 4, 17, 15)).astype(np.float32)
    assert np.abs(numpy_session(back, back_weights).run(batch) - numpy_session(model, weights).run(batch)).max() <= TOLERANCE


@pytest.mark.parametrize("names", [
    ["input", "fc"], ["logits", "fc"], ["fc", "fc/relu"], ["fc2.weight", "fc2"], ["fc2", "fc2.weight"]])
def test_layer_names_that_are_also_onnx_tensor_or_node_names_export(tmp_path, names):
    # Tensor and node names come from layer names: a layer named "input" or "logits", one whose output name is
    # another layer's weight ("fc2.weight"), or "fc/relu" beside layer fc's fused relu gave two tensors (an
    # onnx.checker traceback) or two nodes (a file onnxruntime refused) one name; now each is made unique
    model = parse_model({"name": "names", "input_shape": [5], "layers": [
        {"type": "linear", "name": names[0], "out_features": 4, "activation": "relu"},
        {"type": "linear", "name": names[1], "out_features": 4, "bias": False},
        {"type": "linear", "name": "out", "out_features": 3, "activation": "softmax"}]})
    weights = random_weights(model, seed=9)
    proto = export_onnx(model, weights, tmp_path / "names.onnx")
    onnx.checker.check_model(proto, full_check=True)
    assert [v.name for v in proto.graph.input] == ["input"] and [v.name for v in proto.graph.output] == ["output"]
    batch = np.random.default_rng(10).standard_normal((7, 5)).astype(np.float32)
    expected = numpy_session(model, weights).run(batch)
    for level in LEVELS.values():
        assert np.abs(ort_run(tmp_path / "names.onnx", batch, level) - expected).max() <= TOLERANCE
    back, back_weights = import_onnx(tmp_path / "names.onnx")
    assert np.abs(numpy_session(back, back_weights).run(batch) - expected).max() <= TOLERANCE


def test_an_lstm_beside_a_layer_named_like_its_nodes_exports(tmp_path):
    model = parse_model({"name": "rnn_names", "input_shape": [3, 6], "layers": [
        {"type": "lstm", "name": "r", "hidden_size": 3, "num_layers": 2, "return": "last"},
        {"type": "linear", "name": "r/l1", "out_features": 2}]})
    weights = random_weights(model, seed=11)
    export_onnx(model, weights, tmp_path / "rnn.onnx")
    batch = np.random.default_rng(12).standard_normal((7, 3, 6)).astype(np.float32)
    assert np.abs(ort_run(tmp_path / "rnn.onnx", batch, LEVELS["default optimizations"])
                  - numpy_session(model, weights).run(batch)).max() <= TOLERANCE


def test_errors_are_one_line_lnn_errors(tmp_path, monkeypatch):
    model = load_model(EXAMPLES / "reference" / "mnist_mlp.json")
    weights = random_weights(model)
    with pytest.raises(LnnError, match="opset 17 or newer"):
        build_onnx(model, weights, opset=13)
    with pytest.raises(LnnError, match="cannot write the ONNX file"):
        export_onnx(model, weights, tmp_path / "no_such_folder" / "m.onnx")
    monkeypatch.setitem(sys.modules, "onnx", None)              # as if the onnx extra were not installed
    with pytest.raises(LnnError, match=r"ONNX support needs the onnx extra: pip install 'lnn\[onnx\]'"):
        build_onnx(model, weights)


def test_every_op_of_the_registry_is_in_the_export_and_import_cases():
    """EVERY_OP, the series cases and test_recurrent.py's drive the ONNX export and round-trip tests: an op added to formats/ops.py without an
    ONNX mapping fails here until it joins them."""
    from lnn.formats.ops import OPS

    from test_recurrent import CASES as RECURRENT_CASES, golden      # lstm and gru: tests/formats/test_recurrent.py

    covered = {node.op for case in (EVERY_OP, EVERY_SERIES_OP, SERIES_AVERAGE) for node in parse_model(case).nodes}
    covered |= {node.op for case in RECURRENT_CASES for node in golden(case)[0].nodes}
    assert set(OPS) <= covered, f"ops without ONNX export/import tests: {sorted(set(OPS) - covered)}"


def test_every_op_of_the_registry_carries_its_onnx_mapping():
    """Each op's ONNX mapping is on its class in formats/ops.py (the export and import files are drivers): an op
    without `to_onnx` (dropout alone: not in an inference graph) or without ONNX node types it reads fails here."""
    from lnn.formats.onnx_import import READERS
    from lnn.formats.ops import OPS, Op

    assert sorted(name for name, op in OPS.items() if type(op).to_onnx is Op.to_onnx) == ["dropout"]
    assert [name for name, op in OPS.items() if not op.onnx_readers] == []
    for onnx_type, ops in READERS.items():
        assert all(callable(getattr(op, op.onnx_readers[onnx_type])) for op in ops), onnx_type
