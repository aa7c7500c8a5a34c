"""The JSON model description: shape inference for every op, one clear error per kind of mistake,
and parameter / FLOP / element-wise counts of the reference models checked against hand counts
(written out below) and against the PyTorch-side numbers in ../shared/reference_models/<name>.json."""

import copy
import json
import random
import sys

import pytest

from conftest import EXAMPLES, REFERENCE_MODELS, REFERENCE_NAMES, need
from lnn.formats.errors import ModelSpecError
from lnn.formats.model import load_description, load_model, parse_model
from lnn.formats.ops import OPS


def reference_description(name: str) -> dict:
    return json.loads((EXAMPLES / "reference" / f"{name}.json").read_text())


def spec_error(desc) -> str:
    with pytest.raises(ModelSpecError) as info:
        parse_model(desc)
    assert "\n" not in str(info.value)
    return str(info.value)


def shapes(input_shape, *layers):
    model = parse_model({"input_shape": list(input_shape), "layers": list(layers), "loss": "mse"})
    return [node.out_shape for node in model.nodes]


# --------------------------------------------------------------------------- shape inference, every op

def test_conv2d_output_size_follows_the_window_formula():
    # out = (size + 2*pad - dilation*(kernel-1) - 1) // stride + 1
    assert shapes([3, 32, 32], {"type": "conv2d", "out_channels": 8, "kernel_size": 3}) == [(8, 30, 30)]
    assert shapes([3, 32, 32], {"type": "conv2d", "out_channels": 8, "kernel_size": 3, "padding": 1}) == [(8, 32, 32)]
    assert shapes([3, 32, 32], {"type": "conv2d", "out_channels": 8, "kernel_size": 3, "stride": 2, "padding": 1}) == [(8, 16, 16)]
    assert shapes([3, 32, 31], {"type": "conv2d", "out_channels": 8, "kernel_size": [5, 3], "stride": [2, 3],
                                "padding": [2, 0], "dilation": [1, 2]}) == [(8, 16, 9)]     # (32+4-5)//2+1, (31-5)//3+1
    assert shapes([3, 9, 9], {"type": "conv2d", "out_channels": 6, "kernel_size": 3, "dilation": 3}) == [(6, 3, 3)]


def test_conv1d_output_length_padding_same_and_weight_shape():
    # out = (T + left + right - dilation*(kernel-1) - 1) // stride + 1; "same" is PyTorch's (odd pad on the right)
    assert shapes([3, 50], {"type": "conv1d", "out_channels": 8, "kernel_size": 5}) == [(8, 46)]
    assert shapes([3, 50], {"type": "conv1d", "out_channels": 8, "kernel_size": 5, "stride": 2, "padding": 2,
                            "dilation": 2}) == [(8, 23)]                       # (50+4-9)//2+1
    assert shapes([3, 50], {"type": "conv1d", "out_channels": 8, "kernel_size": 5, "padding": [0, 3]}) == [(8, 49)]
    model = parse_model({"input_shape": [4, 20], "loss": "mse", "layers": [
        {"type": "conv1d", "name": "c", "out_channels": 6, "kernel_size": 8, "padding": "same", "dilation": 3,
         "groups": 2}]})
    assert model.nodes[0].attrs["padding"] == (10, 11) and model.nodes[0].out_shape == (6, 20)
    assert model.param_shapes() == {"c.weight": (6, 2, 8), "c.bias": (6,)}
    assert model.nodes[0].flops == 2 * 6 * 20 * 2 * 8 and model.num_params == 6 * 2 * 8 + 6
    assert parse_model(model.to_description()).to_description() == model.to_description()
    assert spec_error({"input_shape": [3, 50], "layers": [{"type": "conv1d", "out_channels": 2, "kernel_size": 3,
                                                           "stride": 2, "padding": "same"}]}) == \
        'layer 0 (conv1d): padding "same" needs stride 1, not 2 (as PyTorch\'s Conv1d)'
    assert "needs a [C, T] input" in spec_error({"input_shape": [3, 5, 5], "layers": [
        {"type": "conv1d", "out_channels": 2, "kernel_size": 3}]})
    assert "does not fit input size 4" in spec_error({"input_shape": [3, 4], "layers": [
        {"type": "conv1d", "out_channels": 2, "kernel_size": 7}]})


def test_grouped_and_depthwise_conv_weight_shapes():
    model = parse_model({"input_shape": [12, 8, 8], "loss": "mse", "layers": [
        {"type": "conv2d", "name": "grouped", "out_channels": 6, "kernel_size": 3, "groups": 3, "bias": False},
        {"type": "conv2d", "name": "depthwise", "out_channels": 6, "kernel_size": 3, "groups": 6, "padding": 1}]})
    assert model.param_shapes() == {"grouped.weight": (6, 4, 3, 3), "depthwise.weight": (6, 1, 3, 3),
                                    "depthwise.bias": (6,)}
    assert [n.out_shape for n in model.nodes] == [(6, 6, 6), (6, 6, 6)]
    # grouped: 2 * 216 outputs * (12/3 * 9) multiply-adds each
    assert model.nodes[0].flops == 2 * 216 * 36


def test_pools_global_pool_flatten():
    assert shapes([4, 7, 7], {"type": "maxpool2d", "kernel_size": 2}) == [(4, 3, 3)]        # stride defaults to kernel
    assert shapes([4, 7, 7], {"type": "maxpool2d", "kernel_size": 3, "stride": 2, "padding": 1}) == [(4, 4, 4)]
    assert shapes([4, 7, 7], {"type": "avgpool2d", "kernel_size": [3, 2], "stride": 1, "padding": [1, 0]}) == [(4, 7, 6)]
    assert shapes([4, 7, 5], {"type": "global_avg_pool"}) == [(4,)]
    assert shapes([4, 7, 5], {"type": "global_avg_pool", "keepdims": True}, {"type": "flatten"}) == [(4, 1, 1), (4,)]
    assert shapes([4, 7, 5], {"type": "flatten"}) == [(140,)]


def test_1d_pools_and_global_pools_over_time():
    assert shapes([4, 15], {"type": "maxpool1d", "kernel_size": 2}) == [(4, 7)]            # stride defaults to kernel
    assert shapes([4, 15], {"type": "maxpool1d", "kernel_size": 3, "stride": 2, "padding": 1}) == [(4, 8)]
    assert shapes([4, 15], {"type": "avgpool1d", "kernel_size": 4, "stride": 1, "padding": 2}) == [(4, 16)]
    assert shapes([4, 15], {"type": "global_avg_pool"}) == [(4,)]
    assert shapes([4, 15], {"type": "global_max_pool", "keepdims": True}, {"type": "flatten"}) == [(4, 1), (4,)]
    assert shapes([4, 7, 5], {"type": "global_max_pool"}) == [(4,)]
    assert "padding 2 must be at most half of kernel_size 3" in spec_error(
        {"input_shape": [4, 15], "layers": [{"type": "maxpool1d", "kernel_size": 3, "padding": 2}]})
    assert "needs a [C, T] input" in spec_error({"input_shape": [4, 5, 5], "layers": [{"type": "avgpool1d",
                                                                                      "kernel_size": 2}]})
    assert "needs a [C, T] or [C, H, W] input" in spec_error({"input_shape": [4], "layers": [
        {"type": "global_max_pool"}]})
    model = parse_model({"input_shape": [4, 15], "loss": "mse", "layers": [{"type": "maxpool1d", "kernel_size": 3}]})
    assert model.nodes[0].elementwise_ops == 4 * 5 * 2 and model.num_params == 0   # comparisons: kernel - 1 per output


def test_layernorm_normalized_shape_is_trailing_dims_and_params_are_pytorchs():
    model = parse_model({"input_shape": [4, 15], "loss": "mse", "layers": [
        {"type": "layernorm", "name": "whole"}, {"type": "layer_norm", "name": "last", "normalized_shape": 15},
        {"type": "layernorm", "name": "plain", "normalized_shape": [4, 15], "elementwise_affine": False},
        {"type": "layernorm", "name": "nobias", "normalized_shape": [15], "bias": False, "eps": 1e-3}]})
    assert [n.out_shape for n in model.nodes] == [(4, 15)] * 4
    assert [n.attrs["normalized_shape"] for n in model.nodes] == [(4, 15), (15,), (4, 15), (15,)]
    assert model.param_shapes() == {"whole.weight": (4, 15), "whole.bias": (4, 15), "last.weight": (15,),
                                    "last.bias": (15,), "nobias.weight": (15,)}
    assert model.nodes[0].num_params == 2 * 60                # nn.LayerNorm([4, 15]): weight and bias of 60
    assert parse_model(model.to_description()).to_description() == model.to_description()
    assert 'normalized_shape [4] must be the last dimensions of the input [4, 15]' in spec_error(
        {"input_shape": [4, 15], "layers": [{"type": "layernorm", "normalized_shape": [4]}]})
    assert "eps must be a positive number" in spec_error(
        {"input_shape": [4, 15], "layers": [{"type": "layernorm", "eps": 0}]})


def test_batchnorm_dropout_and_activation_layers_keep_the_shape():
    layers = [{"type": "batchnorm"}, {"type": "dropout", "p": 0.3}] + [
        {"type": kind} for kind in ("relu", "relu6", "leaky_relu", "sigmoid", "tanh")]
    assert shapes([5, 4, 4], *layers) == [(5, 4, 4)] * len(layers)
    assert shapes([5], {"type": "batchnorm"}, {"type": "softmax"}) == [(5,), (5,)]
    model = parse_model({"input_shape": [5], "loss": "mse", "layers": [{"type": "batchnorm1d", "name": "bn"}]})
    assert model.param_shapes() == {f"bn.{p}": (5,) for p in ("weight", "bias", "running_mean", "running_var")}


@pytest.mark.parametrize("layer, expected", [
    ({"type": "batchnorm", "eps": float("nan")}, "layer 0 (batchnorm): eps must be a positive number that float32 holds, not nan"),
    ({"type": "batchnorm", "eps": 1e39}, "layer 0 (batchnorm): eps must be a positive number that float32 holds, not 1e+39"),
    ({"type": "layernorm", "eps": 1e-320}, "layer 0 (layernorm): eps must be a positive number that float32 holds, not 1e-320"),
    ({"type": "leaky_relu", "negative_slope": float("inf")},
     "layer 0 (leaky_relu): activation leaky_relu: negative_slope must be a number that float32 holds, not inf"),
    ({"type": "linear", "out_features": 2, "activation": {"type": "leaky_relu", "negative_slope": -1e39}},
     "layer 0 (linear): activation leaky_relu: negative_slope must be a number that float32 holds, not -1e+39"),
], ids=["eps nan", "eps beyond", "eps 0 in float32", "slope inf", "slope beyond"])
def test_float_attributes_are_numbers_float32_holds(layer, expected):
    """NaN passed `eps <= 0` and any slope was taken; such a model could not be written (JSON has no NaN) or computed."""
    assert spec_error({"input_shape": [4], "layers": [layer]}) == expected


def test_linear_and_in_features_in_channels_num_features_checked_when_given():
    assert shapes([6], {"type": "dense", "out_features": 3, "in_features": 6}) == [(3,)]
    assert shapes([2, 5, 5], {"type": "conv2d", "in_channels": 2, "out_channels": 3, "kernel_size": 1}) == [(3, 5, 5)]
    assert spec_error({"input_shape": [2, 5, 5], "layers": [
        {"type": "conv2d", "in_channels": 3, "out_channels": 3, "kernel_size": 1}]}) == \
        "layer 0 (conv2d): in_channels is 2 from the previous layer, not 3"
    assert spec_error({"input_shape": [2, 5, 5], "layers": [{"type": "batchnorm", "num_features": 4}]}) == \
        "layer 0 (batchnorm): num_features is 2 from the previous layer, not 4"


def test_lstm_and_gru_shapes_and_costs():
    assert shapes([3, 10], {"type": "lstm", "hidden_size": 4}) == [(4, 10)]
    assert shapes([3, 10], {"type": "gru", "hidden_size": 4, "bidirectional": True, "return": "last"}) == [(8,)]
    assert shapes([3, 10], {"type": "lstm", "hidden_size": 4, "num_layers": 3, "bidirectional": True},
                  {"type": "gru", "hidden_size": 2}) == [(8, 10), (2, 10)]
    model = parse_model({"input_shape": [3, 10], "loss": "mse", "layers": [{"type": "lstm", "hidden_size": 4,
                                                                              "num_layers": 2}]})
    # per step: 4 gates x 4 units x (inputs + 4 recurrent) multiply-adds, layer 0 with 3 inputs, layer 1 with 4
    assert model.nodes[0].flops == 2 * 10 * 4 * 4 * ((3 + 4) + (4 + 4))
    assert model.nodes[0].activation_bytes == 4 * (4 * 10 + 2 * 10 * 4 * (4 + 2))
    assert spec_error({"input_shape": [3, 10], "layers": [{"type": "lstm", "hidden_size": 4, "input_size": 5}]}) == \
        "layer 0 (lstm): input_size is 3 from the previous layer, not 5"


def test_every_registered_op_is_covered_by_a_shape_test():
    covered = {"linear", "conv1d", "conv2d", "maxpool1d", "avgpool1d", "maxpool2d", "avgpool2d", "global_avg_pool",
               "global_max_pool", "flatten", "batchnorm", "layernorm", "lstm", "gru",
               "dropout", "relu", "relu6", "leaky_relu", "sigmoid", "tanh", "softmax"}
    assert set(OPS) == covered, "a new op needs its shape inference tested here"


def test_normalized_description_parses_to_the_same_model():
    for name in REFERENCE_NAMES:
        model = load_model(EXAMPLES / "reference" / f"{name}.json")
        again = parse_model(model.to_description())
        assert again.to_description() == model.to_description()
        layer = model.to_description()["layers"][0]
        assert {"type", "name", "stride", "padding", "dilation", "groups", "bias", "activation"} <= set(layer) \
            or layer["type"] == "flatten"


# --------------------------------------------------------------------------- one clear message per mistake

def mnist_cnn_with(change) -> str:
    desc = reference_description("mnist_cnn")
    change(desc)
    return spec_error(desc)


def test_the_issue_example_error_exactly():
    message = mnist_cnn_with(lambda d: d["layers"][5].update(in_features=6272))
    assert message == "layer 5 (linear): in_features is 3136 from the previous layer, not 6272"


@pytest.mark.parametrize("change, expected", [
    (lambda d: d["layers"][0].update(type="conv3d"), "layer 0: unknown layer type 'conv3d'; known: avgpool1d, "),
    (lambda d: d["layers"][0].update(kernal_size=3),
     "layer 0 (conv2d): unknown field 'kernal_size' (did you mean 'kernel_size'?); known: type, name, out_channels"),
    (lambda d: d.update(lables=[]), "unknown top-level field 'lables' (did you mean 'labels'?)"),
    (lambda d: d["layers"][0].pop("out_channels"), "layer 0 (conv2d): missing required field 'out_channels'"),
    (lambda d: d["layers"][2].update(kernel_size=17, padding=0),
     "layer 2 (conv2d): kernel_size: window 17 (dilation 1) does not fit input size 14 with padding 0"),
    (lambda d: d["layers"][2].update(groups=5), "layer 2 (conv2d): groups 5 must divide in_channels 32 and out_channels 64"),
    (lambda d: d["layers"][0].update(activation="gelu"),
     "layer 0 (conv2d): activation: unknown activation 'gelu'; known: leaky_relu, relu, relu6, sigmoid, softmax, tanh"),
    (lambda d: d["layers"][0].update(activation={"type": "leaky_relu", "negative_slope": "big"}),
     "layer 0 (conv2d): activation leaky_relu: negative_slope must be a number that float32 holds, not 'big'"),
    (lambda d: d["layers"][0].update(bias="false"), "layer 0 (conv2d): bias must be true or false, not 'false'"),
    (lambda d: d.update(labels=["a", "b"]), "labels: 2 given, but the last layer outputs 10 values"),
    (lambda d: d.update(labels=["a"] * 10), "labels: names must be unique"),
    (lambda d: d["preprocess"].update(mean=[0.1, 0.2, 0.3]),
     "preprocess: mean must be a list of 1 number that float32 holds (one per channel), got [0.1, 0.2, 0.3]"),
    (lambda d: d["preprocess"].update(std=[0.0]), "preprocess: std values must be positive, in float32 too, got [0.0]"),
    (lambda d: d["preprocess"].update(color="rgb"), "preprocess: color 'rgb' does not fit 1 input channel(s)"),
    (lambda d: d["layers"][2].update(name="conv1"), "layer 2 (conv2d): name 'conv1' is used by an earlier layer"),
    (lambda d: d["layers"].pop(4), "layer 4 (linear): needs a flat input, got shape [64, 7, 7]; add a flatten layer before it"),
    (lambda d: d.update(input_shape=[1, 28, 28, 1, 1]), "input_shape must be a list of 1 to 4 positive integers"),
    (lambda d: d.update(optimizer={"type": ["sgd"]}), "optimizer must be an object whose type is one of sgd, adam, adamw"),
    (lambda d: d.update(optimizer={"type": "sgd", "lr": 0}),
     "optimizer (sgd): lr must be a positive number that float32 holds, not 0"),
    (lambda d: d.update(loss="hinge"), "loss must be one of cross_entropy, mse, not 'hinge'"),
    (lambda d: d["layers"].insert(4, {"type": "softmax"}), "layer 4 (softmax): softmax needs a flat [K] input, got shape [64, 7, 7]"),
], ids=["unknown type", "unknown field", "unknown top-level", "missing field", "kernel does not fit", "groups",
        "activation name", "activation field", "bias not bool", "label count", "label names", "mean length",
        "std zero", "color vs channels", "duplicate name", "no flatten", "input rank", "optimizer type", "lr",
        "loss", "softmax rank"])
def test_a_wrong_description_names_layer_field_and_expected_value(change, expected):
    message = mnist_cnn_with(change)
    assert message.startswith(expected), message


def image_description(**preprocess) -> dict:
    return {"input_shape": [3, 4, 4], "layers": [{"type": "flatten"}, {"type": "linear", "out_features": 2}],
            "preprocess": {"color": "rgb", **preprocess}}


@pytest.mark.parametrize("preprocess, expected", [
    ({"std": [0.25, 1e-320, 0.25]}, "preprocess: std values must be positive, in float32 too, got [0.25, 1e-320, 0.25]"),
    ({"std": [1e39, 1, 1]}, "preprocess: std must be a list of 3 numbers that float32 holds (one per channel)"),
    ({"mean": [1e308, -1e308, 1e308]}, "preprocess: mean must be a list of 3 numbers that float32 holds (one per channel)"),
    ({"mean": [10 ** 300, 0, 0]}, "preprocess: mean must be a list of 3 numbers that float32 holds (one per channel)"),
    ({"scale": 1e300}, "preprocess: scale must be a positive number that float32 holds, not 1e+300"),
    ({"scale": 1e-320}, "preprocess: scale must be a positive number that float32 holds, not 1e-320"),
], ids=["std 0 in float32", "std beyond", "mean beyond", "integer mean beyond", "scale beyond", "scale 0 in float32"])
def test_image_preprocessing_is_held_to_float32_as_series_and_tables_are(preprocess, expected):
    """The model computes (pixel * scale - mean) / std in float32: a std of 1e-320 is 0 there (every input became
    infinite and no photo was answered), a mean of 1e308 infinite."""
    assert spec_error(image_description(**preprocess)).startswith(expected)
    table = {"input_shape": [2], "layers": [{"type": "linear", "out_features": 2}],
             "preprocess": {"kind": "table", "columns": ["a", "b"], "mean": [0.0, 0.0], "std": [1.0, 1e-320]}}
    assert spec_error(table).startswith("preprocess: std values must be positive, in float32 too")


@pytest.mark.parametrize("optimizer, expected", [
    ({"type": "adam", "betas": []}, "betas must be two numbers in [0, 1), such as [0.9, 0.999], not []"),
    ({"type": "adam", "betas": ["a", None, 3]}, "betas must be two numbers in [0, 1), such as [0.9, 0.999], not ['a', None, 3]"),
    ({"type": "adamw", "betas": [5, 5]}, "betas must be two numbers in [0, 1), such as [0.9, 0.999], not [5, 5]"),
    ({"type": "adam", "betas": [0.9, 1]}, "betas must be two numbers in [0, 1), such as [0.9, 0.999], not [0.9, 1]"),
    ({"type": "sgd", "momentum": -5}, "momentum must be a number in [0, 1), not -5"),
    ({"type": "sgd", "nesterov": 1}, "nesterov must be true or false, not 1"),
    ({"type": "adam", "eps": 0}, "eps must be a positive number that float32 holds, not 0"),
    ({"type": "adam", "eps": float("nan")}, "eps must be a positive number that float32 holds, not nan"),
    ({"type": "adamw", "weight_decay": -1e30}, "weight_decay must be a number >= 0 that float32 holds, not -1e+30"),
    ({"type": "sgd", "lr": 1e300}, "lr must be a positive number that float32 holds, not 1e+300"),
], ids=["betas empty", "betas not numbers", "betas 5", "beta 1", "momentum negative", "nesterov not bool", "eps 0",
        "eps nan", "weight decay negative", "lr beyond"])
def test_optimizer_settings_are_checked_before_training(optimizer, expected):
    """The optimizers take them as they are: betas [] failed mid-run with a ValueError traceback, momentum -5 and
    betas [5, 5] trained on without a word."""
    message = spec_error({"input_shape": [4], "layers": [{"type": "linear", "out_features": 2}], "optimizer": optimizer})
    assert message == f"optimizer ({optimizer['type']}): {expected}"


def test_bad_json_file_reports_line_and_column(tmp_path):
    """The line of the trailing comma, with the column and words of Python's json (3.13 says "Illegal trailing comma
    before end of object" at column 20, 3.10-3.12 "Expecting property name enclosed in double quotes" at 21)."""
    text = '{\n  "name": "x",\n  "layers": [\n    {"type": "relu",}\n  ]\n}\n'
    path = tmp_path / "broken.json"
    path.write_text(text)
    with pytest.raises(json.JSONDecodeError) as parsed:
        json.loads(text)
    with pytest.raises(ModelSpecError) as info:
        load_description(path)
    assert parsed.value.lineno == 4 and parsed.value.colno in (20, 21)
    assert str(info.value) == f"{path}: not valid JSON at line 4 column {parsed.value.colno}: {parsed.value.msg}"


def test_nan_in_a_json_file_is_refused(tmp_path):
    path = tmp_path / "nan.json"
    path.write_text('{"input_shape": [4], "layers": [{"type": "batchnorm", "eps": NaN}]}')
    with pytest.raises(ModelSpecError, match=r"nan.json: not valid JSON: NaN is not a JSON number"):
        load_description(path)


def test_an_integer_beyond_a_float_in_a_json_file_is_refused_like_1e999(tmp_path):
    """JSON integers may have any number of digits; one a float cannot hold made float() raise OverflowError
    wherever a number field was checked (lr here; preprocess scale, batchnorm eps and the like alike)."""
    path = tmp_path / "huge.json"
    for number, shown in [("1" + "0" * 400, "10000000000000000000... (401 digits)"),
                          ("-" + "9" * 309, "-9999999999999999999... (309 digits)")]:
        path.write_text('{"input_shape": [4], "layers": [{"type": "linear", "out_features": 2}], '
                        f'"optimizer": {{"type": "sgd", "lr": {number}}}}}')
        with pytest.raises(ModelSpecError) as info:
            load_description(path)
        assert str(info.value) == f"{path}: not valid JSON: integer {shown} is out of range; write a finite number"
    largest = int(sys.float_info.max)                    # the largest float, written out in full: still read
    path.write_text(f'{{"seed": {largest}}}')
    assert load_description(path)["seed"] == largest


def test_a_lone_surrogate_escape_in_a_json_file_is_refused_as_text(tmp_path):
    path = tmp_path / "surrogate.json"
    for text, surrogate in [('{"name": "\\ud800", "input_shape": [4], "layers": []}', "\\ud800"),
                            ('{"labels": [{"name": "a\\udc80b"}]}', "\\udc80"),
                            ('{"\\udfff": 1}', "\\udfff")]:
        path.write_text(text)
        with pytest.raises(ModelSpecError) as info:
            load_description(path)
        assert str(info.value) == f"{path}: not valid text (a lone UTF-16 surrogate {surrogate} in a string)"
    path.write_text('{"name": "\\ud83c\\udf45"}')                          # a pair is one character
    assert load_description(path)["name"] == "\N{TOMATO}"


def test_missing_and_unreadable_files(tmp_path):
    with pytest.raises(ModelSpecError, match=r"nothere.json: no such file"):
        load_model(tmp_path / "nothere.json")
    with pytest.raises(ModelSpecError, match=r": is a folder, not a model description$"):
        load_model(tmp_path)
    latin = tmp_path / "latin.json"
    latin.write_bytes(b'{"name": "caf\xe9"}')
    with pytest.raises(ModelSpecError, match=r"latin.json: cannot read the model description"):
        load_model(latin)


def test_a_description_nested_100000_deep_is_one_line(tmp_path):
    path = tmp_path / "deep.json"
    path.write_text('{"name": "x", "model_card": ' + "[" * 100_000 + "]" * 100_000 + "}")
    with pytest.raises(ModelSpecError) as info:
        load_description(path)
    assert str(info.value) == f"{path}: nests deeper than 64 levels (MAX_JSON_DEPTH in lnn/formats/limits.py)"
    path.write_text('{"name": "[[[[", "model_card": ' + "[" * 60 + "]" * 60 + "}")     # brackets in strings do not count
    assert load_description(path)["name"] == "[[[["


def test_descriptions_that_are_no_files_or_too_big_are_refused_without_reading_them(tmp_path):
    with pytest.raises(ModelSpecError, match=r"^/dev/zero: is a character device, not a model description$"):
        load_description("/dev/zero")
    big = tmp_path / "big.json"
    big.write_bytes(b'{"name": "' + b"x" * (4 << 20) + b'"}')
    with pytest.raises(ModelSpecError, match=r"big.json: the file is 4,194,316 bytes, over lnn's limit of 4,194,304 bytes for a "
                                             r"model description \(MAX_JSON_BYTES in lnn/formats/limits.py\)"):
        load_description(big)


@pytest.mark.parametrize("desc, limit, figure", [
    ({"input_shape": [3, 50000, 50000], "layers": [{"type": "flatten"}]}, "MAX_INPUT_ELEMENTS", "7,500,000,000 values"),
    ({"input_shape": [16], "layers": [{"type": "linear", "out_features": 10**12}]}, "MAX_PARAMETERS", "17,000,000,000,000"),
    ({"input_shape": [1, 1, 1], "layers": [{"type": "conv2d", "out_channels": 1, "kernel_size": 1, "padding": 20000}]},
     "MAX_ACTIVATION_BYTES", "6,400,320,008 bytes"),
], ids=["input", "parameters", "activations"])
def test_sizes_over_the_limits_are_one_line_naming_the_limit_and_the_figure(desc, limit, figure):
    message = spec_error(desc)
    assert f"is {figure}, over the limit of" in message and f"({limit} in lnn/formats/limits.py)" in message


def test_default_labels_of_a_wide_output_are_made_only_when_asked_for():
    import time

    started = time.perf_counter()
    model = parse_model({"input_shape": [1 << 24], "layers": [{"type": "relu"}], "loss": "mse"})
    assert time.perf_counter() - started < 0.5          # building 16.8 M label objects takes many seconds and GBs
    labels = model.labels
    assert len(labels) == 1 << 24
    assert labels[7] == {"name": "7", "display": "class 7"} and labels[-1]["name"] == str((1 << 24) - 1)
    assert labels[1:3] == [{"name": "1", "display": "class 1"}, {"name": "2", "display": "class 2"}]
    small = parse_model({"input_shape": [3], "layers": [{"type": "relu"}], "loss": "mse"})
    assert small.labels == [{"name": str(i), "display": f"class {i}"} for i in range(3)]
    assert small.to_description()["labels"] == list(small.labels)


def test_random_damage_to_descriptions_raises_only_model_spec_errors():
    """Any value swapped for a value of another kind gives ModelSpecError (never TypeError, KeyError, ...)."""
    descs = [load_model(EXAMPLES / "reference" / f"{n}.json").to_description() for n in ("mnist_mlp", "mnist_cnn")]
    descs[1]["layers"][1:1] = [{"type": "batchnorm", "activation": {"type": "leaky_relu", "negative_slope": 0.2}},
                               {"type": "avgpool2d", "kernel_size": 3, "stride": 1, "padding": 1},
                               {"type": "dropout"}]
    values = [None, True, "x", "relu", [], {}, [1, 2], [[1]], -1, 0, 3.5, 1e308, {"type": []}, {"type": "sgd"}]
    rng = random.Random(0)

    def paths(obj, prefix=()):
        yield prefix
        items = obj.items() if isinstance(obj, dict) else enumerate(obj) if isinstance(obj, list) else ()
        for key, child in items:
            yield from paths(child, prefix + (key,))

    for _ in range(3000):
        desc = copy.deepcopy(rng.choice(descs))
        path = rng.choice(list(paths(desc))[1:])
        parent = desc
        for key in path[:-1]:
            parent = parent[key]
        if isinstance(parent, dict) and rng.random() < 0.2:
            del parent[path[-1]]
        else:
            parent[path[-1]] = copy.deepcopy(rng.choice(values))
        try:
            parse_model(desc)
        except ModelSpecError as err:
            assert "\n" not in str(err)


# --------------------------------------------------------------------------- counts against hand counts and PyTorch's

# Hand counts. Parameters: conv O*I*K*K + O, linear out*in + out. FLOPs: a multiply-add is 2, so
# conv 2 * (O*OH*OW) * (I*K*K), linear 2 * in * out. Other element-wise ops: +1 per output for a
# bias, +1 for relu, maxpool 2x2 compares 3 per output, global average pool adds each input once.
HAND_COUNTS = {
    # fc1 784*256+256 = 200,960; fc2 256*128+128 = 32,896; fc3 128*10+10 = 1,290
    "mnist_mlp": dict(params=200_960 + 32_896 + 1_290,
                      # 2*784*256 + 2*256*128 + 2*128*10
                      flops=401_408 + 65_536 + 2_560,
                      # (bias + relu) on 256 and 128 outputs, bias on 10
                      other=256 * 2 + 128 * 2 + 10),
    # conv1 32*1*9+32 = 320; conv2 64*32*9+64 = 18,496; fc1 128*3136+128 = 401,536; fc2 10*128+10 = 1,290
    "mnist_cnn": dict(params=320 + 18_496 + 401_536 + 1_290,
                      # conv1 2*(32*28*28)*(1*9) = 451,584; conv2 2*(64*14*14)*(32*9) = 7,225,344;
                      # fc1 2*3136*128 = 802,816; fc2 2*128*10 = 2,560
                      flops=451_584 + 7_225_344 + 802_816 + 2_560,
                      # conv1 25,088*2; pool 6,272*3; conv2 12,544*2; pool 3,136*3; fc1 128*2; fc2 10
                      other=25_088 * 2 + 6_272 * 3 + 12_544 * 2 + 3_136 * 3 + 128 * 2 + 10),
    # conv1 16*3*9+16 = 448; conv2 32*16*9+32 = 4,640; conv3 64*32*9+64 = 18,496; conv4 128*64*9+128 = 73,856;
    # fc 4*128+4 = 516
    "leaf_cnn": dict(params=448 + 4_640 + 18_496 + 73_856 + 516,
                     # conv1 2*(16*128*128)*27 = 14,155,776; conv2..4 2*(32*64*64)*144 = 2*(64*32*32)*288
                     # = 2*(128*16*16)*576 = 37,748,736 each; fc 2*128*4 = 1,024
                     flops=14_155_776 + 3 * 37_748_736 + 1_024,
                     # convs (bias+relu) 262,144/131,072/65,536/32,768 outputs; pools 65,536/32,768/16,384
                     # outputs * 3; GAP 32,768 inputs; fc 4
                     other=(262_144 + 131_072 + 65_536 + 32_768) * 2 + (65_536 + 32_768 + 16_384) * 3 + 32_768 + 4),
    # conv1 32*27+32 = 896; conv2 64*288+64 = 18,496; conv3 128*576+128 = 73,856; conv4 256*1152+256 = 295,168;
    # fc 4*256+4 = 1,028
    "leaf_cnn224": dict(params=896 + 18_496 + 73_856 + 295_168 + 1_028,
                        # conv1 2*(32*224*224)*27 = 86,704,128; conv2..4 462,422,016 each; fc 2*256*4 = 2,048
                        flops=86_704_128 + 3 * 462_422_016 + 2_048,
                        other=(1_605_632 + 802_816 + 401_408 + 200_704) * 2 + (401_408 + 200_704 + 100_352) * 3
                        + 200_704 + 4),
}


@pytest.mark.parametrize("name", REFERENCE_NAMES)
def test_counts_match_the_hand_count(name):
    model = load_model(EXAMPLES / "reference" / f"{name}.json")
    expected = HAND_COUNTS[name]
    assert model.num_params == expected["params"]
    assert sum(node.flops for node in model.nodes) == expected["flops"]
    assert sum(node.elementwise_ops for node in model.nodes) == expected["other"]


def test_mnist_cnn_has_421642_parameters_as_pytorch_counts():
    assert HAND_COUNTS["mnist_cnn"]["params"] == 421_642
    assert HAND_COUNTS["mnist_cnn"]["flops"] == 8_482_304
    assert HAND_COUNTS["mnist_cnn"]["other"] == 103_754


@pytest.mark.parametrize("name", REFERENCE_NAMES)
def test_counts_match_the_pytorch_reference(name):
    reference = json.loads(need(REFERENCE_MODELS / f"{name}.json").read_text())
    model = load_model(EXAMPLES / "reference" / f"{name}.json")
    assert model.num_params == reference["num_params"]
    assert sum(node.flops for node in model.nodes) == reference["flops_per_image"]
    assert sum(node.elementwise_ops for node in model.nodes) == reference["other_elementwise_ops_per_image"]
    by_name = {node.name: node for node in model.nodes}
    assert {key: by_name[key].flops for key in reference["flops_per_layer"]} == reference["flops_per_layer"]
    assert {k: list(v) for k, v in model.param_shapes().items()} == reference["params"]


def test_activation_bytes_per_layer():
    model = load_model(EXAMPLES / "reference" / "mnist_cnn.json")
    # float32 outputs per image: conv1 32x28x28, pool 32x14x14, conv2 64x14x14, pool 64x7x7, flatten 3136, 128, 10
    assert [node.activation_bytes for node in model.nodes] == [4 * n for n in (25_088, 6_272, 12_544, 3_136, 3_136, 128, 10)]
