"""ONNX import: PyTorch-made reference models reproduce PyTorch's outputs in lnn; foreign graph shapes
(MatMul + Add, Clip, Reshape, Constant, Gemm alpha/beta) match onnxruntime; everything lnn cannot
express is refused with one line naming the node."""

import subprocess
import sys

import numpy as np
import pytest

from conftest import REFERENCE_MODELS, REFERENCE_NAMES, need, runtime_devices
from lnn.formats.binfile import read_bin
from lnn.formats.errors import LnnError
from lnn.runtime import load

onnx = pytest.importorskip("onnx")
onnxruntime = pytest.importorskip("onnxruntime")

from onnx import TensorProto, helper, numpy_helper  # noqa: E402

from lnn.formats.onnx_import import OnnxImportError, import_onnx  # noqa: E402
from lnn.tools.import_onnx import main  # noqa: E402

TOLERANCE = 1e-4
LEAF_LABELS = ["healthy", "early_blight", "late_blight", "leaf_mold"]


@pytest.mark.parametrize("name", REFERENCE_NAMES)
def test_reference_onnx_reproduces_pytorch_outputs(name, tmp_path, capsys):
    source = need(REFERENCE_MODELS / f"{name}.onnx")
    samples = np.load(need(REFERENCE_MODELS / f"{name}.samples.npz"))
    assert main([str(source), "-o", str(tmp_path / "m.bin")]) == 0
    assert "wrote" in capsys.readouterr().out

    bin_model = read_bin(tmp_path / "m.bin")
    state_dict = np.load(need(REFERENCE_MODELS / f"{name}.weights.npz"))
    assert sorted(bin_model.tensors) == sorted(state_dict.files)           # layers named after PyTorch's modules
    for key in state_dict.files:
        assert np.array_equal(bin_model.tensors[key], state_dict[key])
    for device in runtime_devices():
        out = load(tmp_path / "m.bin", device=device).run(samples["input"])
        error = np.abs(out - samples["expected"]).max()
        print(f"{name} imported, {device}: max |lnn - pytorch| {error:.2e}")
        assert error <= TOLERANCE, device


def test_command_line_labels_and_preprocessing(tmp_path, capsys):
    source = need(REFERENCE_MODELS / "leaf_cnn.onnx")
    labels_file = tmp_path / "labels.txt"
    labels_file.write_text("\n".join(LEAF_LABELS) + "\n")
    assert main([str(source), "-o", str(tmp_path / "leaf.bin"), "--labels-file", str(labels_file), "--color", "bgr",
                 "--mean", "0.485", "0.456", "0.406", "--std", "0.229", "0.224", "0.225", "--name", "tomato"]) == 0
    meta = read_bin(tmp_path / "leaf.bin").metadata
    assert [label["name"] for label in meta["labels"]] == LEAF_LABELS
    assert meta["preprocess"]["color"] == "bgr"
    assert meta["preprocess"]["mean"] == [0.485, 0.456, 0.406] and meta["preprocess"]["std"] == [0.229, 0.224, 0.225]
    assert meta["input"]["shape"] == [3, 128, 128]
    assert read_bin(tmp_path / "leaf.bin").model.name == "tomato"

    assert main([str(need(REFERENCE_MODELS / "mnist_mlp.onnx")), "-o", str(tmp_path / "d.bin"), "--labels",
                 ",".join("0123456789"), "--color", "gray", "--scale", "1", "--mean", "0.5", "--std", "0.25"]) == 0
    meta = read_bin(tmp_path / "d.bin").metadata
    assert meta["preprocess"]["scale"] == 1.0 and meta["preprocess"]["color"] == "gray"
    assert read_bin(tmp_path / "d.bin").model.name == "mnist_mlp"


# --------------------------------------------------------------------------- hand-made graphs

def tensor(name, array):
    return numpy_helper.from_array(np.asarray(array, dtype=np.float32), name)


def make_model(nodes, initializers, input_shape, output_name, opset=17, output_rank=None, check=True):
    """A (checked unless told) ONNX model with input "x" [N, *input_shape]; the output's rank defaults to the input's."""
    output_shape = ["N", *(f"d{i}" for i in range((output_rank or len(input_shape) + 1) - 1))]
    graph = helper.make_graph(
        nodes, "handmade",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", *input_shape])],
        [helper.make_tensor_value_info(output_name, TensorProto.FLOAT, output_shape)],
        initializer=initializers)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = helper.find_min_ir_version_for(list(model.opset_import))
    if check:
        onnx.checker.check_model(model)
    return model


def assert_matches_onnxruntime(model, input_shape, seed=0):
    imported, weights = import_onnx(model)
    batch = np.random.default_rng(seed).standard_normal((3, *input_shape)).astype(np.float32)
    expected = onnxruntime.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(
        None, {"x": batch})[0]
    from lnn.runtime.reference import NumpyBackend
    got = NumpyBackend(imported, weights).run(batch)
    assert got.shape == expected.shape
    assert np.abs(got - expected).max() <= TOLERANCE
    return imported


def test_foreign_graph_shapes_match_onnxruntime():
    rng = np.random.default_rng(1)
    nodes = [
        helper.make_node("Constant", [], ["bn_scale"], value=numpy_helper.from_array(
            (1 + 0.1 * rng.standard_normal(4)).astype(np.float32))),
        helper.make_node("Conv", ["x", "w1"], ["c1"], name="conv", pads=[1, 1, 1, 1], auto_pad="NOTSET"),
        helper.make_node("BatchNormalization", ["c1", "bn_scale", "bn_b", "bn_mean", "bn_var"], ["b1"], name="bn",
                         epsilon=1e-3),
        helper.make_node("Clip", ["b1", "zero", "six"], ["r1"], name="relu6"),
        helper.make_node("Conv", ["r1", "w2", "b2"], ["c2"], name="same", auto_pad="SAME_UPPER", strides=[1, 1]),
        helper.make_node("Clip", ["c2", "zero"], ["r2"], name="relu_as_clip"),
        helper.make_node("AveragePool", ["r2"], ["p"], name="pool", kernel_shape=[3, 3], strides=[2, 2],
                         pads=[1, 1, 1, 1], ceil_mode=1),
        helper.make_node("Reshape", ["p", "flat"], ["f"], name="flatten"),
        helper.make_node("MatMul", ["f", "mm_w"], ["m"], name="matmul"),
        helper.make_node("Add", ["mm_b", "m"], ["a"], name="bias"),
        helper.make_node("LeakyRelu", ["a"], ["l"], name="leaky", alpha=0.3),
        helper.make_node("Dropout", ["l"], ["d"], name="dropout"),
        helper.make_node("Gemm", ["d", "g_w", "g_c"], ["g"], name="gemm", alpha=0.5, beta=2.0),
        helper.make_node("Identity", ["g"], ["i"]),
        helper.make_node("Softmax", ["i"], ["y"], name="softmax"),
    ]
    inits = [tensor("w1", rng.standard_normal((4, 2, 3, 3)) * 0.3), tensor("bn_b", rng.standard_normal(4)),
             tensor("bn_mean", rng.standard_normal(4) * 0.1), tensor("bn_var", rng.uniform(0.5, 2, 4)),
             tensor("zero", np.array(0.0)), tensor("six", np.array(6.0)),
             tensor("w2", rng.standard_normal((5, 4, 3, 3)) * 0.3), tensor("b2", rng.standard_normal(5) * 0.1),
             numpy_helper.from_array(np.array([0, -1], dtype=np.int64), "flat"),
             tensor("mm_w", rng.standard_normal((5 * 5 * 5, 7)) * 0.1), tensor("mm_b", rng.standard_normal(7)),
             tensor("g_w", rng.standard_normal((7, 3)) * 0.3), tensor("g_c", rng.standard_normal((1, 3)))]
    imported = assert_matches_onnxruntime(make_model(nodes, inits, [2, 9, 9], "y", output_rank=2), [2, 9, 9])
    assert [(n.op, (n.attrs.get("activation") or {}).get("type")) for n in imported.nodes] == [
        ("conv2d", None), ("batchnorm", "relu6"), ("conv2d", "relu"), ("avgpool2d", None), ("flatten", None),
        ("linear", "leaky_relu"), ("dropout", None), ("linear", "softmax")]
    assert imported.nodes[3].attrs["count_include_pad"] is False      # ONNX's default, unlike lnn's


def test_opset_11_clip_and_old_softmax_semantics():
    nodes = [helper.make_node("Gemm", ["x", "w", "b"], ["g"], transB=1),
             helper.make_node("Clip", ["g"], ["c"], min=0.0, max=6.0),
             helper.make_node("Softmax", ["c"], ["y"])]        # opset 9: axis 1
    rng = np.random.default_rng(2)
    model = make_model(nodes, [tensor("w", rng.standard_normal((4, 6))), tensor("b", rng.standard_normal(4))], [6], "y",
                       opset=9, output_rank=2)
    imported = assert_matches_onnxruntime(model, [6])
    assert [(n.op, (n.attrs.get("activation") or {}).get("type")) for n in imported.nodes] == [
        ("linear", "relu6"), ("softmax", None)]


def refusal(nodes, inits, input_shape=(2, 6, 6), output="y", opset=17, check=True) -> str:
    with pytest.raises(OnnxImportError) as info:
        import_onnx(make_model(nodes, inits, list(input_shape), output, opset, check=check))
    message = str(info.value)
    assert "\n" not in message
    return message


W = tensor("w", np.ones((3, 2, 3, 3)))


def test_unsupported_op_names_node_and_op():
    message = refusal([helper.make_node("Conv", ["x", "w"], ["c"], name="conv"),
                       helper.make_node("Resize", ["c", "", "scales"], ["y"], name="Resize_3")],
                      [W, tensor("scales", [1, 1, 2, 2])])
    assert message.startswith('node 1 "Resize_3" (Resize): op Resize is not supported by lnn; supported: ')
    assert "Conv" in message and "BatchNormalization" in message


@pytest.mark.parametrize("node, inits, fragment", [
    (helper.make_node("Conv", ["x", "w"], ["y"], name="c", pads=[0, 0, 1, 1]), [W], "asymmetric pads [0, 0, 1, 1]"),
    (helper.make_node("Conv", ["x", "w"], ["y"], name="c", auto_pad="SAME_UPPER", strides=[2, 2]), [W],
     "auto_pad SAME_UPPER"),
    (helper.make_node("MaxPool", ["x"], ["y"], name="p", kernel_shape=[2, 2], dilations=[2, 2]), [], "dilations"),
    (helper.make_node("MaxPool", ["x"], ["y"], name="p", kernel_shape=[3, 3], strides=[2, 2], ceil_mode=1),
     [], "ceil_mode"),
    (helper.make_node("Clip", ["x", "lo", "hi"], ["y"], name="clip"), [tensor("lo", -1.0), tensor("hi", 1.0)],
     "Clip to [-1, 1]"),
    (helper.make_node("Softmax", ["x"], ["y"], name="s", axis=1), [], "softmax over axis 1 of a rank-4 input"),
    (helper.make_node("Reshape", ["x", "shape"], ["y"], name="r"),
     [numpy_helper.from_array(np.array([0, 2, -1], np.int64), "shape")], "Reshape to [0, 2, -1]"),
    (helper.make_node("Flatten", ["x"], ["y"], name="f", axis=2), [], "axis 2 of a rank-4 input"),
    (helper.make_node("Conv", ["x", "w"], ["y"], name="c", foo=1), [W], 'attribute "foo" is not supported'),
])
def test_unsupported_attributes_name_the_node(node, inits, fragment):
    message = refusal([node], inits, check=False)        # unchecked: lnn's own checks must catch "foo" too
    assert message.startswith(f'node 0 "{node.name}" ({node.op_type}): ')
    assert fragment in message


BN_PARAMS = [tensor(name, np.ones(2)) for name in ("scale", "bias", "mean", "var")]


@pytest.mark.parametrize("node, inits, fragment", [
    (helper.make_node("LeakyRelu", ["x"], ["y"], name="l", alpha=float("inf")), [],
     "negative_slope must be a number that float32 holds, not inf"),
    (helper.make_node("LeakyRelu", ["x"], ["y"], name="l", alpha=1e39), [],       # stored as float32: inf
     "negative_slope must be a number that float32 holds, not inf"),
    (helper.make_node("LeakyRelu", ["x"], ["y"], name="l", alpha=float("nan")), [],
     "negative_slope must be a number that float32 holds, not nan"),
    (helper.make_node("BatchNormalization", ["x", "scale", "bias", "mean", "var"], ["y"], name="bn",
                      epsilon=float("nan")), BN_PARAMS, "eps must be a positive number that float32 holds, not nan"),
    (helper.make_node("BatchNormalization", ["x", "scale", "bias", "mean", "var"], ["y"], name="bn",
                      epsilon=float("inf")), BN_PARAMS, "eps must be a positive number that float32 holds, not inf"),
], ids=["alpha inf", "alpha 1e39", "alpha nan", "epsilon nan", "epsilon inf"])
def test_float_attributes_float32_cannot_hold_name_the_node(node, inits, fragment):
    """They were taken as they were and made write_bin's JSON fail with a traceback (NaN slipped past eps <= 0);
    the description's own check refuses them, named after the node."""
    message = refusal([node], inits)
    assert message.startswith(f'node 0 "{node.name}" ({node.op_type}): layer 0 ') and message.endswith(fragment)


def test_gemm_transposed_input_and_row_dependent_bias_are_refused():
    w = tensor("w", np.ones((6, 3)))
    assert "transA=1" in refusal([helper.make_node("Gemm", ["x", "w"], ["y"], name="g", transA=1)], [w], (6,))
    assert "differs between batch rows" in refusal(
        [helper.make_node("Gemm", ["x", "w", "c"], ["y"], name="g")], [w, tensor("c", np.ones((2, 3)))], (6,))


def test_graphs_that_are_not_chains_are_refused():
    branch = [helper.make_node("Relu", ["x"], ["a"], name="left"), helper.make_node("Sigmoid", ["x"], ["b"], name="right"),
              helper.make_node("Add", ["a", "b"], ["y"], name="join")]
    assert "chain" in refusal(branch, [])
    computed_weight = [helper.make_node("Relu", ["x"], ["a"], name="r"),
                       helper.make_node("Conv", ["x", "a"], ["y"], name="conv")]
    assert "chain" in refusal(computed_weight, [])
    assert "Add is supported only as the bias right after a MatMul" in refusal(
        [helper.make_node("Add", ["x", "k"], ["y"], name="add")], [tensor("k", 1.0)])


def test_inputs_lnn_cannot_take_are_refused():
    graph = helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 3, "H", "W"])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 3, "H", "W"])])
    with pytest.raises(OnnxImportError, match="only the batch dimension"):
        import_onnx(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]))


def test_sizes_over_the_limits_are_refused_as_the_description_parser_does():
    message = refusal([helper.make_node("Relu", ["x"], ["y"], name="r")], [], (3, 50000, 50000))
    assert message == ('input "x": input_shape [3, 50000, 50000] is 7,500,000,000 values, over the limit of '
                       "16,777,216 values (MAX_INPUT_ELEMENTS in lnn/formats/limits.py)")
    padded = helper.make_node("Conv", ["x", "w"], ["y"], name="c", pads=[20000] * 4)
    message = refusal([padded], [tensor("w", np.ones((1, 1, 1, 1)))], (1, 1, 1))
    assert message.startswith('node 0 "c" (Conv): ') and "MAX_ACTIVATION_BYTES" in message


def gemm_with_external_weight(folder, dims, length=None):
    """model.onnx in `folder`: a Gemm whose weight W (`dims`, float32) lies in w.data beside it, its length stated
    as `length` (None: not stated); w.data holds ones when its size is small."""
    weight = TensorProto(name="W", data_type=TensorProto.FLOAT, dims=dims, data_location=TensorProto.EXTERNAL)
    for key, value in [("location", "w.data"), ("offset", "0")] + ([("length", str(length))] if length is not None else []):
        weight.external_data.add(key=key, value=value)
    if np.prod(dims) < 1000:
        (folder / "w.data").write_bytes(np.ones(dims, np.float32).tobytes() + bytes(1 << 20))   # a 1 MiB tail
    graph = helper.make_graph([helper.make_node("Gemm", ["x", "W", "B"], ["y"], name="g", transB=1)], "ext",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", dims[1]])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", dims[0]])],
                              [weight, tensor("B", np.zeros(dims[0]))])
    (folder / "model.onnx").write_bytes(
        helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]).SerializeToString())
    return folder / "model.onnx"


def test_external_data_is_read_only_within_the_sizes_its_tensors_declare(tmp_path):
    """A 200-byte file whose weight [2, 2^28] lay in a 2 GiB external file was read whole (31 s and 8.4 GB for a
    4 GiB one) before any limit; the dims are checked first (here w.data is not even there), and a tensor must state
    the length its dims make, since onnx reads an unstated one to the end of the file."""
    huge = gemm_with_external_weight(tmp_path, [2, 1 << 28], length=8 << 28)
    with pytest.raises(OnnxImportError) as info:
        import_onnx(huge)
    assert str(info.value) == (f"{huge}: the number of values its tensors declare is 536,870,914, over the limit of "
                               "268,435,456 (MAX_PARAMETERS in lnn/formats/limits.py)")
    for length in (None, 33):
        with pytest.raises(OnnxImportError) as info:
            import_onnx(gemm_with_external_weight(tmp_path, [2, 4], length))
        assert str(info.value).endswith(f'tensor "W" keeps its data in an external file, whose length must be stated and '
                                        f"be that of its dims [2, 4], not {length or 'unstated'}")
    model, weights = import_onnx(gemm_with_external_weight(tmp_path, [2, 4], length=32))
    assert np.array_equal(weights["linear_0.weight"], np.ones((2, 4), np.float32))


def test_command_errors_are_one_line_with_exit_status(tmp_path):
    def run(*args):
        return subprocess.run([sys.executable, "-m", "lnn.tools.import_onnx", *map(str, args)],
                              capture_output=True, text=True, timeout=60)

    bad = make_model([helper.make_node("Conv", ["x", "w"], ["c"], name="conv"),
                      helper.make_node("Resize", ["c", "", "scales"], ["y"], name="Resize_3")],
                     [W, tensor("scales", [1, 1, 2, 2])], [2, 6, 6], "y")
    onnx.save(bad, tmp_path / "bad.onnx")
    not_onnx = tmp_path / "notes.onnx"
    not_onnx.write_bytes(b"\xff\xd8\xff\xe0 this is not a model")
    for args, fragment in [((tmp_path / "bad.onnx", "-o", tmp_path / "x.bin"), '"Resize_3" (Resize)'),
                           ((tmp_path / "missing.onnx", "-o", tmp_path / "x.bin"), "no such file"),
                           ((not_onnx, "-o", tmp_path / "x.bin"), "not a valid ONNX model"),
                           (("/dev/zero", "-o", tmp_path / "x.bin"), "/dev/zero: is a character device, not an ONNX file")]:
        result = run(*args)
        lines = result.stderr.strip().splitlines()
        assert result.returncode == 1 and len(lines) == 1, result.stderr
        assert lines[0].startswith(f"lnn-import: error: {args[0]}: ") and fragment in lines[0], lines[0]   # file named
        assert not (tmp_path / "x.bin").exists()
    source = need(REFERENCE_MODELS / "mnist_mlp.onnx")
    result = run(source, "-o", tmp_path / "x.bin", "--labels", "a,b")
    assert result.returncode == 1 and "labels: 2 given, but the last layer outputs 10" in result.stderr
    assert run(source).returncode == 2                                          # -o is required: usage error


def test_an_output_that_is_a_named_pipe_is_refused_and_left_as_it_is(tmp_path, capsys):
    import os

    pipe = tmp_path / "pipe"
    os.mkfifo(pipe)
    assert main([str(need(REFERENCE_MODELS / "mnist_mlp.onnx")), "-o", str(pipe)]) == 1
    assert capsys.readouterr().err == f"lnn-import: error: {pipe}: is a named pipe, not a regular output file\n"
    assert pipe.is_fifo()


@pytest.mark.parametrize("output_is", ["the model", "the labels file"])
def test_an_output_that_is_one_of_its_inputs_is_refused_and_left_as_it_is(tmp_path, capsys, output_is):
    """`lnn-import g.onnx -o g.onnx` replaced the ONNX model with the .bin made from it."""
    source, labels = tmp_path / "g.onnx", tmp_path / "labels.txt"
    onnx.save(make_model([helper.make_node("Relu", ["x"], ["y"], name="r")], [], [2, 4, 4], "y"), source)
    labels.write_text("a\nb\n")
    output = source if output_is == "the model" else labels
    original = output.read_bytes()
    assert main([str(source), "-o", str(output), "--labels-file", str(labels)]) == 1
    assert capsys.readouterr().err == (f"lnn-import: error: {output}: the output is the same file as the input "
                                       f"{output}; choose another output file (writing it would replace the input)\n")
    assert output.read_bytes() == original


def test_command_line_text_that_is_not_utf8_is_one_line(tmp_path, capsys):
    """A label or name typed in another encoding reaches Python as a lone surrogate (argv's surrogateescape), which
    cannot be written into the .bin: one line, and nothing written. A label is refused as the model's labels are
    checked (formats/model.py), a name where the description is encoded (encode_bin)."""
    source = str(need(REFERENCE_MODELS / "mnist_mlp.onnx"))
    labels = ",".join(["caf\udce9"] + [str(i) for i in range(9)])                 # "café" typed in Latin-1
    for option, value, expected in (
            ("--labels", labels, f"{source}: labels[0]: the name is not UTF-8 text (a lone UTF-16 surrogate \\udce9"),
            ("--name", "n\udcff", "the model description cannot be written: a lone UTF-16 surrogate \\udcff")):
        assert main([source, "-o", str(tmp_path / "x.bin"), option, value]) == 1
        error = capsys.readouterr().err
        assert error.startswith(f"lnn-import: error: {expected}"), error
        assert error.count("\n") == 1 and not (tmp_path / "x.bin").exists()


def test_missing_onnx_extra_is_one_clear_line(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "onnx", None)
    with pytest.raises(LnnError, match=r"ONNX support needs the onnx extra: pip install 'lnn\[onnx\]'"):
        import_onnx(tmp_path / "any.onnx")


def test_lnn_metadata_in_an_onnx_file_nested_100000_deep_is_one_line():
    model = make_model([helper.make_node("Relu", ["x"], ["y"], name="r")], [], [2, 6, 6], "y")
    helper.set_model_props(model, {"lnn.labels": "[" * 100_000 + "]" * 100_000})
    with pytest.raises(OnnxImportError) as info:
        import_onnx(model)
    assert str(info.value) == "metadata_props lnn.labels: nests deeper than 64 levels (MAX_JSON_DEPTH in lnn/formats/limits.py)"
    helper.set_model_props(model, {"lnn.labels": "[1,"})
    with pytest.raises(OnnxImportError, match=r"^metadata_props lnn.labels: not valid JSON at line 1"):
        import_onnx(model)


def test_a_lone_surrogate_escape_in_lnn_metadata_is_one_line():
    model = make_model([helper.make_node("Relu", ["x"], ["y"], name="r")], [], [2, 6, 6], "y")
    helper.set_model_props(model, {"lnn.labels": '["\\ud800"]'})
    with pytest.raises(OnnxImportError) as info:
        import_onnx(model)
    assert str(info.value) == "metadata_props lnn.labels: not valid text (a lone UTF-16 surrogate \\ud800 in a string)"


@pytest.mark.parametrize("text, kind", [("[1,2]", "list"), ('"rgb"', "str"), ("5", "int")])
def test_lnn_preprocess_metadata_that_is_not_an_object_is_one_line(text, kind):
    model = make_model([helper.make_node("Relu", ["x"], ["y"], name="r")], [], [2, 6, 6], "y")
    helper.set_model_props(model, {"lnn.preprocess": text})
    with pytest.raises(OnnxImportError) as info:
        import_onnx(model)
    assert str(info.value) == ("metadata_props lnn.preprocess: must be a JSON object of preprocessing fields, or null, "
                               f"not {kind}")
    helper.set_model_props(model, {"lnn.preprocess": "null"})      # what a model without preprocessing carries
    import_onnx(model)
