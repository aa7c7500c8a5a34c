"""ONNX -> lnn model + weights, for graphs made only of ops lnn has (e.g. exported by PyTorch).

The graph must be a chain: one float32 input [N, *shape] (dim 0 is the batch, the others fixed),
each node reading the tensor the node before it wrote (plus constants), one output at the end.
ONNX nodes map to lnn layers as follows:

    Conv                       conv2d (2-D; symmetric pads, or auto_pad VALID / SAME that comes out symmetric),
                               conv1d (1-D, a 3-D weight; any pads or auto_pad)
    Gemm, MatMul (+ Add)       linear: weight [out, in] = B.T (B when transB=1), times alpha; bias = beta * C
    MaxPool, AveragePool       maxpool2d, avgpool2d, or on [N, C, T] maxpool1d, avgpool1d (symmetric pads, no
                               dilation; ceil_mode only where it gives the same size as floor)
    GlobalAveragePool,         global_avg_pool, global_max_pool ([N, C, T] or [N, C, H, W]; keepdims, merged
    GlobalMaxPool              with a Flatten right after it)
    Flatten, Reshape           flatten (Flatten on axis 1; Reshape only to [N, -1] / [0, -1] / [N, K])
    BatchNormalization         batchnorm (inference mode)
    Relu, Clip, LeakyRelu,     relu, relu6 (Clip 0..6; Clip 0..inf is relu), leaky_relu, sigmoid, tanh,
    Sigmoid, Tanh, Softmax     softmax (over the last axis of [N, K]); folded into the conv2d / linear /
                               batchnorm before them as its `activation` when that has none yet
    Dropout                    dropout (the identity at inference; lnn-export drops it again)
    Identity                   nothing
    Constant                   a constant for the nodes after it

Initializers become weights keyed `<layer name>.weight` etc. A layer's name comes from its weight's
initializer name when that ends in `.weight` (PyTorch: `conv1.weight` -> layer `conv1`), otherwise
`<lnn op>_<layer index>`. Anything else gets one line naming the node and what is wrong, e.g.
    node 7 "Resize_3" (Resize): op Resize is not supported by lnn; supported: AveragePool, ...
ONNX models written by lnn's exporter carry labels and preprocessing in metadata_props; they are read back.
"""

from __future__ import annotations

import math
import os
import stat
from pathlib import Path

import numpy as np

from lnn.formats.errors import LnnError, LnnInputError, ModelSpecError
from lnn.formats.model import Model, parse_json_text, parse_model, size_refusals
from lnn.formats.onnx_export import METADATA_KEYS, require_onnx
from lnn.formats.ops import get_op


class OnnxImportError(LnnError):
    """An ONNX graph lnn cannot express; the message names the node and the problem."""


FLOAT_LIMIT = 3.0e38          # Clip's defaults before opset 11 were -FLT_MAX / FLT_MAX


def _where(proto, index: int) -> str:
    """How an error names a node: `node 7 "Resize_3" (Resize)`, or `node 7 (Resize)` when it has no name."""
    return f'node {index} "{proto.name}" ({proto.op_type})' if proto.name else f"node {index} ({proto.op_type})"


class _Node:
    """One ONNX node being converted: its attributes, its constant inputs, the shape flowing in."""

    def __init__(self, proto, index: int, consts: dict, in_shape: tuple, opset: int, batch: int | None):
        from onnx.helper import get_attribute_value

        self.proto, self.consts, self.in_shape, self.opset, self.batch = proto, consts, in_shape, opset, batch
        self.op = proto.op_type
        self.where = _where(proto, index)
        self.given = {}
        for attribute in proto.attribute:
            value = get_attribute_value(attribute)
            self.given[attribute.name] = value.decode() if isinstance(value, bytes) else value

    def error(self, message: str) -> OnnxImportError:
        return OnnxImportError(f"{self.where}: {message}")

    def attributes(self, **defaults) -> dict:
        """The node's attributes over `defaults`; an attribute not named there is refused."""
        unknown = sorted(set(self.given) - set(defaults))
        if unknown:
            raise self.error(f'attribute "{unknown[0]}" is not supported by lnn for {self.op}')
        return {**defaults, **self.given}

    def const(self, position: int, what: str, optional: bool = False):
        """Input `position` as a NumPy array; it must be an initializer or a Constant's output."""
        names = self.proto.input
        if position >= len(names) or names[position] == "":
            if optional:
                return None
            raise self.error(f"needs its {what} (input {position})")
        if names[position] not in self.consts:
            raise self.error(f'{what} "{names[position]}" must be a constant (an initializer), not computed in the graph')
        return self.consts[names[position]]

    def weight(self, position: int, what: str, optional: bool = False):
        array = self.const(position, what, optional)
        if array is None:
            return None
        if array.dtype.kind != "f":
            raise self.error(f"{what} has dtype {array.dtype}; lnn takes floating-point weights")
        return array.astype(np.float32)

    def need_rank(self, ranks, what: str) -> None:
        if len(self.in_shape) not in ranks:
            raise self.error(f"needs {what} input, got [N, {', '.join(map(str, self.in_shape))}]")


class _Chain:
    """The lnn layers built so far, with their parameters, and the per-sample shape after the last one."""

    def __init__(self, input_shape: tuple):
        self.input_shape = input_shape
        self.layers, self.params = [], []
        self.shape = input_shape

    @property
    def last(self) -> dict | None:
        return self.layers[-1] if self.layers else None

    def append(self, layer: dict, params: dict | None = None) -> None:
        self.layers.append(layer)
        self.params.append(params or {})

    def unique_name(self, weight_name: str, op: str) -> str:
        taken = {layer.get("name") for layer in self.layers}
        stem = weight_name[:-len(".weight")] if weight_name.endswith(".weight") else ""
        if stem and stem not in taken:
            return stem
        return f"{op}_{len(self.layers)}"

    def infer_shape(self, node: _Node) -> None:
        """Re-run lnn's shape inference; an lnn-side refusal is reported against the ONNX node."""
        if not self.layers:
            return
        try:
            model = parse_model({"input_shape": list(self.input_shape), "layers": self.layers})
        except ModelSpecError as err:
            raise node.error(str(err)) from None
        self.shape = model.output_shape


# --------------------------------------------------------------------------- padding and pooling helpers

def _padding(node: _Node, attrs: dict, kernel, strides, dilations) -> tuple[list, list]:
    """ONNX pads / auto_pad -> (padding before, padding after) per spatial axis."""
    rank = len(kernel)
    auto_pad = attrs["auto_pad"]
    if auto_pad == "VALID":
        return [0] * rank, [0] * rank
    if auto_pad in ("SAME_UPPER", "SAME_LOWER"):
        begins, ends = [], []
        for size, k, s, d in zip(node.in_shape[1:], kernel, strides, dilations):
            total = max((math.ceil(size / s) - 1) * s + (k - 1) * d + 1 - size, 0)
            small, large = total // 2, total - total // 2
            begins.append(small if auto_pad == "SAME_UPPER" else large)
            ends.append(large if auto_pad == "SAME_UPPER" else small)
        return begins, ends
    if auto_pad != "NOTSET":
        raise node.error(f"auto_pad {auto_pad!r} is not supported")
    pads = [int(p) for p in (attrs["pads"] or [0] * 2 * rank)]
    if len(pads) != 2 * rank:
        raise node.error(f"pads {pads} are not {rank}-D ([" + ", ".join(["begin"] * rank + ["end"] * rank) + "])")
    return pads[:rank], pads[rank:]


def _symmetric_padding(node: _Node, attrs: dict, kernel, strides, dilations) -> list:
    """ONNX pads / auto_pad -> lnn's padding per axis ([pad_h, pad_w]; the same on both sides)."""
    begins, ends = _padding(node, attrs, kernel, strides, dilations)
    if begins != ends:
        raise node.error(f"asymmetric pads {begins + ends} ([" + ("top, left, bottom, right" if len(kernel) == 2
                                                                   else "begin, end") + "]"
                         + (f" from auto_pad {attrs['auto_pad']}" if attrs["auto_pad"] != "NOTSET" else "")
                         + ") are not supported: lnn pads both sides alike")
    return begins


def _two_d(node: _Node, values, name: str, default) -> list:
    values = list(default if values is None else values)
    if len(values) != 2:
        raise node.error(f"{name} {values}: only 2-D is supported")
    return [int(v) for v in values]


def _pool_layer(node: _Node, kind: str, **extra_defaults) -> tuple[dict, dict]:
    """MaxPool / AveragePool -> `kind`pool2d on [N, C, H, W], `kind`pool1d on [N, C, T] (an integer per field)."""
    attrs = node.attributes(auto_pad="NOTSET", ceil_mode=0, dilations=None, kernel_shape=None, pads=None,
                            strides=None, **extra_defaults)
    node.need_rank((2, 3), "a 3-D [N, C, T] or 4-D [N, C, H, W]")
    rank = len(node.in_shape) - 1
    if attrs["kernel_shape"] is None:
        raise node.error("needs kernel_shape")
    kernel = [int(v) for v in attrs["kernel_shape"]]
    strides = [int(v) for v in attrs["strides"] or [1] * rank]
    if len(kernel) != rank or len(strides) != rank:
        raise node.error(f"kernel_shape {kernel} / strides {strides} do not fit a {rank}-D input")
    if list(attrs["dilations"] or [1] * rank) != [1] * rank:
        raise node.error(f"dilations {list(attrs['dilations'])} are not supported for pooling")
    padding = _symmetric_padding(node, attrs, kernel, strides, [1] * rank)
    if attrs["ceil_mode"]:
        for size, k, s, p in zip(node.in_shape[1:], kernel, strides, padding):
            if (size + 2 * p - k) % s:
                raise node.error("ceil_mode=1 gives a larger output than lnn's floor rounding here; not supported")
    if rank == 1:
        return {"type": f"{kind}pool1d", "kernel_size": kernel[0], "stride": strides[0], "padding": padding[0]}, attrs
    return {"type": f"{kind}pool2d", "kernel_size": kernel, "stride": strides, "padding": padding}, attrs


def _max_pool(node: _Node, chain: _Chain) -> None:
    layer, _ = _pool_layer(node, "max", storage_order=0)   # storage_order only orders the unused Indices
    chain.append(layer)


def _average_pool(node: _Node, chain: _Chain) -> None:
    layer, attrs = _pool_layer(node, "avg", count_include_pad=0)
    layer["count_include_pad"] = bool(attrs["count_include_pad"])
    chain.append(layer)


# --------------------------------------------------------------------------- converters: node -> chain

def _conv(node: _Node, chain: _Chain) -> None:
    """Conv with a 4-D weight -> conv2d; with a 3-D weight -> conv1d (its pads may differ left and right)."""
    attrs = node.attributes(auto_pad="NOTSET", dilations=None, group=1, kernel_shape=None, pads=None, strides=None)
    weight = node.weight(1, "weight")
    if weight.ndim not in (3, 4):
        raise node.error(f"weight of shape {list(weight.shape)}: only 1-D and 2-D convolution (a 3-D or 4-D weight) "
                         "are supported")
    one_d = weight.ndim == 3
    node.need_rank((2,) if one_d else (3,), "a 3-D [N, C, T]" if one_d else "a 4-D [N, C, H, W]")
    kernel = list(weight.shape[2:])
    if attrs["kernel_shape"] is not None and list(attrs["kernel_shape"]) != kernel:
        raise node.error(f"kernel_shape {list(attrs['kernel_shape'])} does not match the weight's {kernel}")
    bias = node.weight(2, "bias", optional=True)
    lnn_op = "conv1d" if one_d else "conv2d"
    layer = {"type": lnn_op, "name": chain.unique_name(node.proto.input[1], lnn_op),
             "out_channels": int(weight.shape[0]), "groups": int(attrs["group"]), "bias": bias is not None}
    if one_d:
        strides, dilations = [int(v) for v in attrs["strides"] or [1]], [int(v) for v in attrs["dilations"] or [1]]
        if len(strides) != 1 or len(dilations) != 1:
            raise node.error(f"strides {strides} / dilations {dilations}: a 1-D convolution takes one of each")
        begins, ends = _padding(node, attrs, kernel, strides, dilations)
        layer.update(kernel_size=kernel[0], stride=strides[0], dilation=dilations[0], padding=begins + ends)
    else:
        strides = _two_d(node, attrs["strides"], "strides", [1, 1])
        dilations = _two_d(node, attrs["dilations"], "dilations", [1, 1])
        layer.update(kernel_size=kernel, stride=strides, dilation=dilations,
                     padding=_symmetric_padding(node, attrs, kernel, strides, dilations))
    chain.append(layer, {"weight": weight} if bias is None else {"weight": weight, "bias": bias})


def _bias_vector(node: _Node, c: np.ndarray, out_features: int) -> np.ndarray:
    """A bias that is the same for every batch row ([], [1], [K] or [1, K]) -> [K]."""
    if c.ndim > 2 or (c.ndim == 2 and c.shape[0] != 1):
        raise node.error(f"bias of shape {list(c.shape)} differs between batch rows; lnn takes a per-output bias [{out_features}]")
    try:
        return np.broadcast_to(c.reshape(-1) if c.ndim == 2 else c, (out_features,)).astype(np.float32)
    except ValueError:
        raise node.error(f"bias of shape {list(c.shape)} does not fit {out_features} outputs") from None


def _gemm(node: _Node, chain: _Chain) -> None:
    attrs = node.attributes(alpha=1.0, beta=1.0, transA=0, transB=0)
    if attrs["transA"]:
        raise node.error("transA=1 (a transposed input) is not supported")
    node.need_rank((1,), "a 2-D [N, K]")
    b = node.weight(1, "B")
    if b.ndim != 2:
        raise node.error(f"B of shape {list(b.shape)} is not a matrix")
    weight = (b if attrs["transB"] else b.T) * np.float32(attrs["alpha"])
    c = node.weight(2, "C", optional=True)
    layer = {"type": "linear", "name": chain.unique_name(node.proto.input[1], "linear"),
             "out_features": int(weight.shape[0]), "bias": c is not None}
    params = {"weight": np.ascontiguousarray(weight, dtype=np.float32)}
    if c is not None:
        params["bias"] = _bias_vector(node, c, weight.shape[0]) * np.float32(attrs["beta"])
    chain.append(layer, params)


def _matmul(node: _Node, chain: _Chain) -> None:
    node.attributes()
    node.need_rank((1,), "a 2-D [N, K]")
    b = node.weight(1, "B")
    if b.ndim != 2:
        raise node.error(f"B of shape {list(b.shape)}: only a 2-D [N, K] @ [K, M] product is supported")
    chain.append({"type": "linear", "name": chain.unique_name(node.proto.input[1], "linear"),
                  "out_features": int(b.shape[1]), "bias": False},
                 {"weight": np.ascontiguousarray(b.T, dtype=np.float32)})


def _add(node: _Node, chain: _Chain) -> None:
    node.attributes()
    last = chain.last
    if not last or last["type"] != "linear" or last["bias"] or last.get("activation"):
        raise node.error("Add is supported only as the bias right after a MatMul (MatMul + Add)")
    position = 1 if node.proto.input[1] in node.consts else 0
    last["bias"] = True
    chain.params[-1]["bias"] = _bias_vector(node, node.weight(position, "bias"), last["out_features"])


def _batchnorm(node: _Node, chain: _Chain) -> None:
    attrs = node.attributes(epsilon=1e-5, momentum=0.9, training_mode=0, spatial=1)
    if attrs["training_mode"]:
        raise node.error("training_mode=1 (batch statistics) is not supported; export the model in eval mode")
    if attrs["spatial"] != 1:
        raise node.error("spatial=0 (per-element statistics) is not supported")
    params = {key: node.weight(i, key) for i, key in enumerate(("weight", "bias", "running_mean", "running_var"), 1)}
    chain.append({"type": "batchnorm", "name": chain.unique_name(node.proto.input[1], "batchnorm"),
                  "eps": float(attrs["epsilon"])}, params)


def _global_pool(lnn_op: str):
    def convert(node: _Node, chain: _Chain) -> None:
        node.attributes()
        node.need_rank((2, 3), "a 3-D [N, C, T] or 4-D [N, C, H, W]")
        chain.append({"type": lnn_op, "keepdims": True})
    return convert


def _flatten_layer(chain: _Chain) -> None:
    last = chain.last
    if last and last["type"] in ("global_avg_pool", "global_max_pool") and last["keepdims"]:
        last["keepdims"] = False          # GlobalAveragePool / GlobalMaxPool + Flatten is one lnn layer
    else:
        chain.append({"type": "flatten"})


def _flatten(node: _Node, chain: _Chain) -> None:
    attrs = node.attributes(axis=1)
    rank = len(node.in_shape) + 1
    axis = attrs["axis"] + rank if attrs["axis"] < 0 else attrs["axis"]
    if axis != 1:
        raise node.error(f"axis {attrs['axis']} of a rank-{rank} input: lnn flattens everything after the batch (axis 1) only")
    _flatten_layer(chain)


def _reshape(node: _Node, chain: _Chain) -> None:
    attrs = node.attributes(allowzero=0)
    target = [int(v) for v in node.const(1, "shape").reshape(-1)]
    features = math.prod(node.in_shape)
    batch_ok = {-1} if attrs["allowzero"] else {0, -1}       # allowzero=1 makes a 0 a real zero
    if node.batch is not None:
        batch_ok.add(node.batch)                              # the graph's fixed batch size written out
    if len(target) != 2 or target[0] not in batch_ok or target[1] not in (-1, features) or target == [-1, -1]:
        raise node.error(f"Reshape to {target} is not supported: lnn supports Reshape only as a flatten "
                         f"to [N, -1], [0, -1] or [-1, {features}]")
    _flatten_layer(chain)


def _activation(node: _Node, chain: _Chain, activation: dict) -> None:
    """Fold into the layer before when it takes an activation and has none yet; else a stand-alone layer."""
    last = chain.last
    if last and get_op(last["type"]).has_activation_field and not last.get("activation"):
        last["activation"] = activation
    else:
        chain.append(dict(activation))


def _relu(node, chain):
    node.attributes()
    _activation(node, chain, {"type": "relu"})


def _sigmoid(node, chain):
    node.attributes()
    _activation(node, chain, {"type": "sigmoid"})


def _tanh(node, chain):
    node.attributes()
    _activation(node, chain, {"type": "tanh"})


def _leaky_relu(node, chain):
    attrs = node.attributes(alpha=0.01)
    _activation(node, chain, {"type": "leaky_relu", "negative_slope": float(attrs["alpha"])})


def _clip(node, chain):
    if node.opset < 11:
        attrs = node.attributes(min=-np.inf, max=np.inf)
        low, high = float(attrs["min"]), float(attrs["max"])
    else:
        node.attributes()
        low, high = (node.const(i, name, optional=True) for i, name in ((1, "min"), (2, "max")))
        if any(bound is not None and bound.size != 1 for bound in (low, high)):
            raise node.error("min and max must be scalars")
        low = -np.inf if low is None else float(low.reshape(-1)[0])
        high = np.inf if high is None else float(high.reshape(-1)[0])
    if low == -np.inf and high == np.inf:
        return                                  # no bounds: the identity
    if low == 0 and high == 6:
        _activation(node, chain, {"type": "relu6"})
    elif low == 0 and high >= FLOAT_LIMIT:
        _activation(node, chain, {"type": "relu"})
    else:
        raise node.error(f"Clip to [{low:g}, {high:g}] is not supported: lnn has Clip only as relu6 (0 to 6) "
                         "or relu (0, no maximum)")


def _softmax(node, chain):
    attrs = node.attributes(axis=-1 if node.opset >= 13 else 1)
    rank = len(node.in_shape) + 1
    if rank != 2 or attrs["axis"] not in (1, -1):
        raise node.error(f"softmax over axis {attrs['axis']} of a rank-{rank} input: lnn's softmax works on "
                         "[N, K] over K only")
    _activation(node, chain, {"type": "softmax"})


def _dropout(node, chain):
    attrs = node.attributes(ratio=0.5, seed=0, is_test=1)
    if node.opset >= 12:
        ratio = node.const(1, "ratio", optional=True)
        ratio = 0.5 if ratio is None else float(ratio)
        training = node.const(2, "training_mode", optional=True)
        if training is not None and bool(training):
            raise node.error("training_mode=true is not supported; export the model in eval mode")
    else:
        ratio = float(attrs["ratio"])
    chain.append({"type": "dropout", "p": ratio})         # the identity at inference, as in lnn


def _identity(node, chain):
    node.attributes()


CONVERTERS = {
    "Conv": _conv, "Gemm": _gemm, "MatMul": _matmul, "Add": _add, "BatchNormalization": _batchnorm,
    "MaxPool": _max_pool, "AveragePool": _average_pool,
    "GlobalAveragePool": _global_pool("global_avg_pool"), "GlobalMaxPool": _global_pool("global_max_pool"),
    "Flatten": _flatten, "Reshape": _reshape,
    "Relu": _relu, "Clip": _clip, "Sigmoid": _sigmoid, "Tanh": _tanh, "LeakyRelu": _leaky_relu,
    "Softmax": _softmax, "Dropout": _dropout, "Identity": _identity,
}
SUPPORTED_OPS = sorted([*CONVERTERS, "Constant"])


# --------------------------------------------------------------------------- the graph walk

def load_onnx(path):
    """Read and check an ONNX file; a missing, foreign or invalid file gets a one-line error."""
    onnx = require_onnx()
    path = Path(path)
    try:
        if not stat.S_ISREG(os.stat(path).st_mode) and not path.is_dir():   # a device or pipe would read for ever
            raise LnnInputError(f"{path}: is not a regular file (a device, pipe or socket), not an ONNX file")
        with path.open("rb") as f:
            head = f.read(8)
    except FileNotFoundError:
        raise LnnInputError(f"{path}: no such file") from None
    except IsADirectoryError:
        raise LnnInputError(f"{path}: is a folder, not an ONNX file") from None
    if head.startswith(b"\x89LNN"):
        raise LnnInputError(f"{path}: is an lnn .bin model already, not an ONNX file")
    try:
        proto = onnx.load(str(path))
        onnx.checker.check_model(proto)
    except Exception as err:   # protobuf DecodeError, onnx ValidationError, missing external data: all "bad file"
        first_line = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise OnnxImportError(f"{path}: not a valid ONNX model ({first_line})") from None
    return proto


def _graph_input(graph, consts: dict, onnx) -> tuple:
    """The one real input (initializers may be listed as inputs too) -> (name, per-sample shape, batch or None)."""
    inputs = [value for value in graph.input if value.name not in consts]
    if len(inputs) != 1:
        raise OnnxImportError(f"the graph has {len(inputs)} inputs ({', '.join(v.name for v in inputs)}); lnn models take one")
    value = inputs[0]
    tensor_type = value.type.tensor_type
    if not value.type.HasField("tensor_type") or tensor_type.elem_type != onnx.TensorProto.FLOAT:
        raise OnnxImportError(f'input "{value.name}" must be a float32 tensor')
    dims = list(tensor_type.shape.dim)
    if not 2 <= len(dims) <= 5:
        raise OnnxImportError(f'input "{value.name}" has rank {len(dims)}; lnn takes [N, ...] with 1 to 4 dimensions after the batch')
    shape = []
    for i, dim in enumerate(dims[1:], 1):
        if not dim.HasField("dim_value") or dim.dim_value < 1:
            raise OnnxImportError(f'input "{value.name}" dimension {i} is {dim.dim_param or "unknown"}; '
                                  "only the batch dimension (0) may be dynamic")
        shape.append(dim.dim_value)
    batch = dims[0].dim_value if dims[0].HasField("dim_value") else None
    too_big = size_refusals(tuple(shape), [])[0]        # before any layer: a huge input is refused at once
    if too_big:
        raise OnnxImportError(f'input "{value.name}": {too_big}')
    return value.name, tuple(shape), batch


def _opset(proto) -> int:
    for entry in proto.opset_import:
        if entry.domain in ("", "ai.onnx"):
            return entry.version
    raise OnnxImportError("the model imports no standard ONNX opset")


def convert_graph(proto) -> tuple[dict, list]:
    """An ONNX ModelProto -> (partial lnn description {name, input_shape, layers}, per-layer params)."""
    onnx = require_onnx()
    graph, opset = proto.graph, _opset(proto)
    consts = {init.name: onnx.numpy_helper.to_array(init) for init in graph.initializer}
    current, input_shape, batch = _graph_input(graph, consts, onnx)
    chain = _Chain(input_shape)
    consumers = {}
    for proto_node in graph.node:
        for name in proto_node.input:
            consumers[name] = consumers.get(name, 0) + 1
    graph_outputs = [value.name for value in graph.output]

    for index, proto_node in enumerate(graph.node):
        where = _where(proto_node, index)
        if proto_node.domain not in ("", "ai.onnx"):
            raise OnnxImportError(f"{where}: op {proto_node.domain}.{proto_node.op_type} is not a standard ONNX op; "
                                  f"lnn supports: {', '.join(SUPPORTED_OPS)}")
        if proto_node.op_type == "Constant":
            if [a.name for a in proto_node.attribute] != ["value"]:
                raise OnnxImportError(f"{where}: only a Constant with a tensor `value` is supported")
            consts[proto_node.output[0]] = onnx.numpy_helper.to_array(proto_node.attribute[0].t)
            continue
        converter = CONVERTERS.get(proto_node.op_type)
        if converter is None:
            raise OnnxImportError(f"{where}: op {proto_node.op_type} is not supported by lnn; "
                                  f"supported: {', '.join(SUPPORTED_OPS)}")
        data_inputs = [name for name in proto_node.input if name and name not in consts]
        if data_inputs != [current]:
            raise OnnxImportError(f"{where}: reads {data_inputs or 'only constants'}, but lnn needs a chain where each "
                                  f'node reads only the previous output ("{current}") and constants')
        if consumers.get(current, 0) > 1 or current in graph_outputs:
            raise OnnxImportError(f'{where}: "{current}" is used by more than one node or is also a graph output; '
                                  "lnn needs a chain without branches")
        for extra in proto_node.output[1:]:
            if extra and (extra in consumers or extra in graph_outputs):
                raise OnnxImportError(f'{where}: its second output "{extra}" is used; lnn gives only the first')
        node = _Node(proto_node, index, consts, chain.shape, opset, batch)
        converter(node, chain)
        chain.infer_shape(node)
        current = proto_node.output[0]

    if graph_outputs != [current]:
        raise OnnxImportError(f"the graph's outputs are {graph_outputs}; lnn needs exactly one, the end of the chain "
                              f'("{current}")')
    if not chain.layers:
        raise OnnxImportError("the graph has no layer lnn runs (only Identity nodes)")
    description = {"name": graph.name or "model", "input_shape": list(input_shape), "layers": chain.layers}
    return description, chain.params


def _lnn_metadata(proto) -> dict:
    """labels / preprocess / name written by lnn's own exporter, when present."""
    props = {entry.key: entry.value for entry in proto.metadata_props}
    found = {}
    for field, key in METADATA_KEYS.items():
        if key in props:
            try:
                found[field] = parse_json_text(props[key], f"metadata_props {key}") if field != "name" else props[key]
            except ModelSpecError as err:
                raise OnnxImportError(str(err)) from None
    return found


def import_onnx(source, *, name: str | None = None, labels: list | None = None,
                preprocess: dict | None = None) -> tuple[Model, dict]:
    """An ONNX file (path) or ModelProto -> (lnn Model, weights keyed `<layer name>.<param>`).

    `labels` and `preprocess` (fields as in a JSON description: color, scale, mean, std) override
    what the file carries; preprocess fields not given keep the file's or lnn's defaults."""
    proto = load_onnx(source) if isinstance(source, (str, Path)) else source
    description, params = convert_graph(proto)
    carried = _lnn_metadata(proto)
    description["name"] = name or carried.get("name") or (Path(source).stem if isinstance(source, (str, Path))
                                                          else description["name"])
    merged_preprocess = {**(carried.get("preprocess") or {}), **(preprocess or {})}
    if merged_preprocess:
        description["preprocess"] = merged_preprocess
    if labels is not None or carried.get("labels"):
        description["labels"] = labels if labels is not None else carried["labels"]
    try:
        model = parse_model(description)
    except ModelSpecError as err:
        raise OnnxImportError(str(err)) from None
    weights = {node.param_key(key): value for node, layer_params in zip(model.nodes, params)
               for key, value in layer_params.items()}
    return model, weights
