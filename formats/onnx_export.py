"""lnn model + weights -> ONNX (opset >= 17), for onnxruntime and every other ONNX consumer.

The graph takes `input` [N, *input_shape] float32 (N is a dynamic dimension named "N") and gives
`logits` [N, *output_shape] (`output` when the model ends in softmax or sigmoid). This file is the generic
driver: dropout is removed (inference graph), a batch norm is folded into the conv1d / conv2d / linear just
before it when that layer has no activation (formats/fold.py), and each layer writes its own nodes
(`to_onnx` of its op in formats/ops.py, where each op's mapping is described), then its fused activation's.

The model's labels and preprocessing travel in the ONNX metadata_props as JSON (keys `lnn.labels`,
`lnn.preprocess`, `lnn.name`), so `lnn-import` gives the same model back.

onnx is an optional extra: it is imported inside the functions here, never at module import.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from lnn.formats.binfile import write_atomic
from lnn.formats.errors import LnnError
from lnn.formats.fold import fold_scale_and_shift, folds_into_previous, scale_and_shift
from lnn.formats.model import Model
from lnn.formats.ops import ACTIVATIONS, get_op
from lnn.version import __version__

MIN_OPSET = 17
BATCH_DIM = "N"
INPUT_NAME = "input"
METADATA_KEYS = {"labels": "lnn.labels", "preprocess": "lnn.preprocess", "name": "lnn.name"}


def require_onnx(module: str = "onnx"):
    """Import onnx (or onnxruntime) on demand; a missing package becomes a one-line LnnError."""
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError:
        raise LnnError("ONNX support needs the onnx extra: pip install 'lnn[onnx]'") from None


def _inference_layers(model: Model, weights: dict) -> list:
    """The model's layers as (node, params, fused activation or None), dropout removed and batch norm folded
    into the conv1d / conv2d / linear before it where that layer has no activation of its own."""
    layers = []
    for node in model.nodes:
        if node.op == "dropout":
            continue
        params = {p: np.asarray(weights[node.param_key(p)], dtype=np.float32) for p in node.param_shapes}
        previous = layers[-1] if layers else None
        if folds_into_previous(node, previous[0].op if previous else None, previous is not None and previous[2] is None):
            prev_node, prev_params, _ = previous
            weight, bias = fold_scale_and_shift(prev_params["weight"], prev_params.get("bias"),
                                                *scale_and_shift(node, weights))
            layers[-1] = (prev_node, {"weight": weight, "bias": bias}, node.attrs.get("activation"))
            continue
        fused = node.attrs["activation"] if get_op(node.op).has_activation_field else None
        layers.append((node, params, fused))
    return layers


class _GraphBuilder:
    """Collects nodes and initializers while walking the layer chain; `current` is the tensor flowing through."""

    def __init__(self, onnx):
        self.onnx = onnx
        self.nodes, self.initializers = [], []
        # Tensor and node names come from layer names, which may be anything: a layer named "input", "logits" or
        # "fc2.weight", or "fc/relu" beside layer "fc"'s fused relu, gave two tensors or nodes one name (a
        # traceback from onnx.checker, or a file onnxruntime refuses). Every name is made unique here (`_unique`);
        # the graph's input and output names are reserved.
        self.tensor_names = {INPUT_NAME, "logits", "output"}
        self.node_names = set()
        self.current = INPUT_NAME       # the tensor the next add() reads

    @staticmethod
    def _unique(name: str, taken: set) -> str:
        unique, count = name, 1
        while unique in taken:
            count += 1
            unique = f"{name}_{count}"
        taken.add(unique)
        return unique

    def constant(self, name: str, array: np.ndarray) -> str:
        name = self._unique(name, self.tensor_names)
        self.initializers.append(self.onnx.numpy_helper.from_array(np.asarray(array, dtype=np.float32, order="C"), name))
        return name

    def add(self, op_type: str, name: str, extra_inputs=(), **attributes) -> None:
        output = self._unique(name, self.tensor_names)
        self.nodes.append(self.onnx.helper.make_node(op_type, [self.current, *extra_inputs], [output],
                                                     name=self._unique(name, self.node_names), **attributes))
        self.current = output

    def add_node(self, op_type: str, name: str, inputs: list, outputs: list, **attributes) -> list:
        """A node of several inputs and outputs; the first output flows on. -> the outputs' names as written."""
        written = [self._unique(output, self.tensor_names) for output in outputs]
        self.nodes.append(self.onnx.helper.make_node(op_type, inputs, written, name=self._unique(name, self.node_names),
                                                     **attributes))
        self.current = written[0]
        return written

    def integers(self, name: str, values) -> str:
        name = self._unique(name, self.tensor_names)
        self.initializers.append(self.onnx.numpy_helper.from_array(np.asarray(values, dtype=np.int64), name))
        return name

    def activation(self, activation: dict, name: str) -> None:
        """The node of an activation (a fused one, or a stand-alone layer's): formats/ops.py Activation."""
        get_op(activation["type"]).activation_to_onnx(self, activation, name)


def build_onnx(model: Model, weights: dict, opset: int = MIN_OPSET):
    """The ONNX ModelProto of an lnn model (checked with onnx.checker)."""
    onnx = require_onnx()
    if opset < MIN_OPSET:
        raise LnnError(f"ONNX export needs opset {MIN_OPSET} or newer, not {opset}")
    graph = _GraphBuilder(onnx)
    last_activation = None
    for node, params, fused in _inference_layers(model, weights):
        get_op(node.op).to_onnx(graph, node, params)
        if fused is not None:
            graph.activation(fused, f"{node.name}/{fused['type']}")
        last_activation = node.attrs if node.op in ACTIVATIONS else fused
    ends_in_probabilities = last_activation is not None and last_activation["type"] in ("softmax", "sigmoid")
    output = "output" if ends_in_probabilities else "logits"
    if not graph.nodes:
        graph.add("Identity", output)
    graph.nodes[-1].output[0] = output          # a reserved name (_GraphBuilder), so no other tensor has it

    float32 = onnx.TensorProto.FLOAT
    graph_proto = onnx.helper.make_graph(
        graph.nodes, model.name,
        inputs=[onnx.helper.make_tensor_value_info(INPUT_NAME, float32, [BATCH_DIM, *model.input_shape])],
        outputs=[onnx.helper.make_tensor_value_info(output, float32, [BATCH_DIM, *model.output_shape])],
        initializer=graph.initializers)
    opset_imports = [onnx.helper.make_opsetid("", opset)]
    proto = onnx.helper.make_model(graph_proto, opset_imports=opset_imports, producer_name="lnn",
                                   producer_version=__version__,
                                   ir_version=onnx.helper.find_min_ir_version_for(opset_imports))
    onnx.helper.set_model_props(proto, {
        METADATA_KEYS["name"]: model.name,
        METADATA_KEYS["labels"]: json.dumps(list(model.labels), ensure_ascii=False),
        METADATA_KEYS["preprocess"]: json.dumps(model.preprocess, ensure_ascii=False),
    })
    onnx.checker.check_model(proto)
    return proto


def export_onnx(model: Model, weights: dict, path, opset: int = MIN_OPSET):
    """Write the model as ONNX to `path`, atomically (an older file survives a full disk); returns the ModelProto."""
    require_onnx()
    proto = build_onnx(model, weights, opset)
    path = Path(path)
    try:
        write_atomic(path, proto.SerializeToString())
    except OSError as err:
        raise LnnError(f"{path}: cannot write the ONNX file ({err.strerror or err})") from None
    return proto


def export_bin_to_onnx(bin_model, path, opset: int = MIN_OPSET):
    """The same for a loaded `.bin` (lnn.formats.binfile.BinModel); fp16 weights are widened to float32."""
    return export_onnx(bin_model.model, bin_model.weights_fp32(), path, opset)
