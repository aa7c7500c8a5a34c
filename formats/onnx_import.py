"""ONNX -> lnn model + weights, for graphs made only of ops lnn has (e.g. exported by PyTorch).

The graph must be a chain: one float32 input [N, *shape] (dim 0 is the batch, the others fixed),
each node reading the tensor the node before it wrote (plus constants), one output at the end.
This file is the generic driver: each op of formats/ops.py names the ONNX node types it reads
(`onnx_readers`) and reads them into the chain of layers (where each op's mapping is described); Identity
adds nothing and a Constant is a constant for the nodes after it. A node that ONNX writes after a layer
but lnn holds in it (an activation after a layer without one, a Flatten after a global pool) is merged
into that layer (`Op.onnx_absorbs`).

Initializers become weights keyed `<layer name>.weight` etc. A layer's name comes from its weight's
initializer name when that ends in `.weight` (PyTorch: `conv1.weight` -> layer `conv1`), otherwise
`<lnn op>_<layer index>`. Anything else gets one line naming the node and what is wrong, e.g.
    node 7 "Resize_3" (Resize): op Resize is not supported by lnn; supported: AveragePool, ...
ONNX models written by lnn's exporter carry labels and preprocessing in metadata_props; they are read back.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from lnn.formats.errors import LnnError, LnnInputError, ModelSpecError
from lnn.formats.files import regular_file
from lnn.formats.limits import MAX_PARAMETERS, refusal
from lnn.formats.model import Model, parse_json_text, parse_model, size_refusals
from lnn.formats.onnx_export import METADATA_KEYS, require_onnx
from lnn.formats.ops import OPS, get_op


class OnnxImportError(LnnError):
    """An ONNX graph lnn cannot express; the message names the node and the problem."""


def _where(proto, index: int) -> str:
    """How an error names a node: `node 7 "Resize_3" (Resize)`, or `node 7 (Resize)` when it has no name."""
    return f'node {index} "{proto.name}" ({proto.op_type})' if proto.name else f"node {index} ({proto.op_type})"


class _Node:
    """One ONNX node being converted: its attributes, its constant inputs, the shape flowing in."""

    def __init__(self, proto, index: int, consts: dict, in_shape: tuple, opset: int, batch: int | None,
                 zeros: frozenset = frozenset()):
        from onnx.helper import get_attribute_value

        self.proto, self.consts, self.in_shape, self.opset, self.batch = proto, consts, in_shape, opset, batch
        self.zeros = zeros          # computed tensors known to be all zeros (initial states from ConstantOfShape)
        self.op = proto.op_type
        self.output = 0             # the output the chain goes on from (1: an LSTM / GRU's last state Y_h)
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

    def padding(self, attrs: dict, kernel, strides, dilations) -> tuple[list, list]:
        """ONNX pads / auto_pad -> (padding before, padding after) per spatial axis."""
        rank = len(kernel)
        auto_pad = attrs["auto_pad"]
        if auto_pad == "VALID":
            return [0] * rank, [0] * rank
        if auto_pad in ("SAME_UPPER", "SAME_LOWER"):
            begins, ends = [], []
            for size, k, s, d in zip(self.in_shape[1:], kernel, strides, dilations):
                total = max((math.ceil(size / s) - 1) * s + (k - 1) * d + 1 - size, 0)
                small, large = total // 2, total - total // 2
                begins.append(small if auto_pad == "SAME_UPPER" else large)
                ends.append(large if auto_pad == "SAME_UPPER" else small)
            return begins, ends
        if auto_pad != "NOTSET":
            raise self.error(f"auto_pad {auto_pad!r} is not supported")
        pads = [int(p) for p in (attrs["pads"] or [0] * 2 * rank)]
        if len(pads) != 2 * rank:
            raise self.error(f"pads {pads} are not {rank}-D ([" + ", ".join(["begin"] * rank + ["end"] * rank) + "])")
        return pads[:rank], pads[rank:]

    def symmetric_padding(self, attrs: dict, kernel, strides, dilations) -> list:
        """ONNX pads / auto_pad -> lnn's padding per axis ([pad_h, pad_w]; the same on both sides)."""
        begins, ends = self.padding(attrs, kernel, strides, dilations)
        if begins != ends:
            raise self.error(f"asymmetric pads {begins + ends} ([" + ("top, left, bottom, right" if len(kernel) == 2
                                                                       else "begin, end") + "]"
                             + (f" from auto_pad {attrs['auto_pad']}" if attrs["auto_pad"] != "NOTSET" else "")
                             + ") are not supported: lnn pads both sides alike")
        return begins

    def pair(self, values, name: str, default) -> list:
        """A 2-D attribute (strides, dilations) as two integers."""
        values = list(default if values is None else values)
        if len(values) != 2:
            raise self.error(f"{name} {values}: only 2-D is supported")
        return [int(v) for v in values]


class _Chain:
    """The lnn layers built so far, with their parameters, and the per-sample shape after the last one."""

    def __init__(self, input_shape: tuple):
        self.input_shape = input_shape
        self.layers, self.params = [], []
        self.shape = input_shape
        # Where a series is time-major around LSTM / GRU nodes: None (lnn's own [N, C, T] layout),
        # "time_major" ([T, N, F]), "directions" (an RNN's Y [T, D, N, H]), "directions_last" ([T, N, D, H]),
        # "last_state" (an RNN's Y_h [D, N, H]), "last_state_batch" ([N, D, H]).
        self.layout = None
        self.rnn_open = False       # the time-major tensor is the output of the last lstm / gru layer

    @property
    def last(self) -> dict | None:
        return self.layers[-1] if self.layers else None

    def append(self, layer: dict, params: dict | None = None) -> None:
        """Add a layer, or merge a parameterless one into the layer before where that op absorbs it."""
        if not params and self.last is not None and get_op(self.last["type"]).onnx_absorbs(self.last, layer):
            return
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


def _readers() -> dict:
    """ONNX op type -> the ops that read it (`onnx_readers`), in the registry's order."""
    readers = {}
    for op in OPS.values():
        for onnx_type in op.onnx_readers:
            readers.setdefault(onnx_type, []).append(op)
    return readers


READERS = _readers()
SUPPORTED_OPS = sorted([*READERS, "Identity", "Constant"])


def _read(node: _Node, chain: _Chain) -> None:
    """Read one node into the chain: the first op reading its type that claims it, else the last one."""
    ops = READERS.get(node.op)
    if ops is None:                       # Identity (convert_graph refuses other types)
        node.attributes()
        return
    op = next((op for op in ops if op.onnx_claims(node, chain)), ops[-1])
    if node.output and node.output != op.onnx_last_state_output:
        raise node.error(f'its output {node.output + 1} ("{node.proto.output[node.output]}") is used; lnn gives only the first')
    getattr(op, op.onnx_readers[node.op])(node, chain)


# --------------------------------------------------------------------------- the graph walk

def load_onnx(path):
    """Read and check an ONNX file; a missing, foreign or invalid file gets a one-line error."""
    onnx = require_onnx()
    path = Path(path)
    regular_file(path, "an ONNX file")
    try:
        with path.open("rb") as f:
            head = f.read(8)
    except OSError as err:
        raise LnnInputError(f"{path}: cannot read the file ({err.strerror or err})") from None
    if head.startswith(b"\x89LNN"):
        raise LnnInputError(f"{path}: is an lnn .bin model already, not an ONNX file")
    try:
        proto = onnx.load(str(path), load_external_data=False)
    except Exception as err:   # protobuf DecodeError and the like: a bad file
        raise _invalid(path, err) from None
    _check_declared_sizes(proto, path)
    try:
        onnx.load_external_data_for_model(proto, str(path.parent))
        onnx.checker.check_model(proto)
    except Exception as err:   # missing or short external data, onnx ValidationError: a bad file
        raise _invalid(path, err) from None
    return proto


def _invalid(path: Path, err: Exception) -> OnnxImportError:
    first_line = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    return OnnxImportError(f"{path}: not a valid ONNX model ({first_line})")


def _check_declared_sizes(proto, path: Path) -> None:
    """Before any external data is read (a 186-byte file can point at a 4 GiB one): the values the stored tensors
    declare by their dims within MAX_PARAMETERS, and each tensor kept in an external file stating the length its
    dims make (without one, onnx reads the file to its end)."""
    onnx = require_onnx()
    tensors = list(_stored_tensors(proto.graph))
    too_many = refusal("the number of values its tensors declare", sum(math.prod(t.dims) for t in tensors),
                       MAX_PARAMETERS, "MAX_PARAMETERS")
    if too_many:
        raise OnnxImportError(f"{path}: {too_many}")
    for tensor in tensors:
        if tensor.data_location != onnx.TensorProto.EXTERNAL:
            continue
        stated = {entry.key: entry.value for entry in tensor.external_data}.get("length")
        try:
            size = math.prod(tensor.dims) * np.dtype(onnx.helper.tensor_dtype_to_np_dtype(tensor.data_type)).itemsize
        except KeyError:           # an unknown element type: no size to expect
            size = None
        if size is None or stated != str(size):
            raise OnnxImportError(f'{path}: tensor "{tensor.name}" keeps its data in an external file, whose length '
                                  f"must be stated and be that of its dims {list(tensor.dims)}, not {stated or 'unstated'}")


def _stored_tensors(graph):
    """Every tensor a graph stores: its initializers and its nodes' tensor attributes, in subgraphs too."""
    yield from graph.initializer
    for node in graph.node:
        for attribute in node.attribute:
            if attribute.HasField("t"):
                yield attribute.t
            yield from attribute.tensors
            for subgraph in ([attribute.g] if attribute.HasField("g") else []) + list(attribute.graphs):
                yield from _stored_tensors(subgraph)


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


SHAPE_SIDE_OPS = {"Shape", "Gather", "Unsqueeze", "Squeeze", "Concat", "ConstantOfShape", "Slice", "Expand",
                  "Reshape", "Cast", "Identity"}
ZERO_PRESERVING = {"Slice", "Expand", "Squeeze", "Unsqueeze", "Reshape", "Cast", "Identity", "Gather"}


def _shape_side(graph, onnx, constant_names: set) -> tuple[set, set]:
    """The nodes (by index) that only compute from the data's Shape, as PyTorch writes zero initial RNN states
    for a dynamic batch (Shape -> Gather -> Concat -> ConstantOfShape -> Slice), and which of their outputs
    are all zeros. They are skipped by the chain walk; an LSTM / GRU accepts a zero one as its initial state."""
    side_nodes, side, zeros = set(), set(), set()
    known = set(constant_names)
    for index, proto_node in enumerate(graph.node):
        if proto_node.op_type == "Constant":
            known.update(proto_node.output)
            continue
        inputs = [name for name in proto_node.input if name]
        if proto_node.op_type == "Shape" or (
                proto_node.op_type in SHAPE_SIDE_OPS and inputs and all(n in known or n in side for n in inputs)
                and any(n in side for n in inputs)):
            side_nodes.add(index)
            side.update(proto_node.output)
            if proto_node.op_type == "ConstantOfShape":
                value = [a.t for a in proto_node.attribute if a.name == "value"]
                if not value or not np.any(onnx.numpy_helper.to_array(value[0])):
                    zeros.update(proto_node.output)
            elif proto_node.op_type in ZERO_PRESERVING and inputs[0] in zeros:
                zeros.update(proto_node.output)
    return side_nodes, zeros


def convert_graph(proto) -> tuple[dict, list]:
    """An ONNX ModelProto -> (partial lnn description {name, input_shape, layers}, per-layer params)."""
    onnx = require_onnx()
    graph, opset = proto.graph, _opset(proto)
    consts = {init.name: onnx.numpy_helper.to_array(init) for init in graph.initializer}
    current, input_shape, batch = _graph_input(graph, consts, onnx)
    chain = _Chain(input_shape)
    side_nodes, zeros = _shape_side(graph, onnx, set(consts))
    side_outputs = {name for index in side_nodes for name in graph.node[index].output}
    consumers = {}
    for index, proto_node in enumerate(graph.node):
        if index in side_nodes:
            continue
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
        if index in side_nodes:
            continue
        if proto_node.op_type not in READERS and proto_node.op_type != "Identity":
            raise OnnxImportError(f"{where}: op {proto_node.op_type} is not supported by lnn; "
                                  f"supported: {', '.join(SUPPORTED_OPS)}")
        data_inputs = [name for name in proto_node.input if name and name not in consts and name not in side_outputs]
        if data_inputs != [current]:
            raise OnnxImportError(f"{where}: reads {data_inputs or 'only constants'}, but lnn needs a chain where each "
                                  f'node reads only the previous output ("{current}") and constants')
        if consumers.get(current, 0) > 1 or current in graph_outputs:
            raise OnnxImportError(f'{where}: "{current}" is used by more than one node or is also a graph output; '
                                  "lnn needs a chain without branches")
        used = [i for i, name in enumerate(proto_node.output) if name and (name in consumers or name in graph_outputs)]
        if len(used) > 1:
            raise OnnxImportError(f'{where}: outputs {", ".join(proto_node.output[i] for i in used)} are all used; '
                                  f"lnn needs a chain without branches")
        node = _Node(proto_node, index, consts, chain.shape, opset, batch, frozenset(zeros))
        node.output = used[0] if used else 0      # not the first: _read refuses it unless the op gives that one
        _read(node, chain)
        chain.infer_shape(node)
        current = proto_node.output[node.output]

    if graph_outputs != [current]:
        raise OnnxImportError(f"the graph's outputs are {graph_outputs}; lnn needs exactly one, the end of the chain "
                              f'("{current}")')
    if not chain.layers:
        raise OnnxImportError("the graph has no layer lnn runs (only Identity nodes)")
    if chain.layout is not None:
        raise OnnxImportError("the graph ends in a time-major LSTM / GRU output; lnn needs it back in [N, H*D, T] "
                              "(Transpose perm [1, 2, 0])")
    description = {"name": graph.name or "model", "input_shape": list(input_shape), "layers": chain.layers}
    return description, chain.params


def _lnn_metadata(proto) -> dict:
    """labels / preprocess / name written by lnn's own exporter, when present."""
    props = {entry.key: entry.value for entry in proto.metadata_props}
    found = {}
    for field, key in METADATA_KEYS.items():
        if key in props:            # a ModelSpecError is named after the file by import_onnx
            found[field] = parse_json_text(props[key], f"metadata_props {key}") if field != "name" else props[key]
    preprocess = found.get("preprocess")
    if preprocess is not None and not isinstance(preprocess, dict):                # null: a model without preprocessing
        raise OnnxImportError(f"metadata_props {METADATA_KEYS['preprocess']}: must be a JSON object of preprocessing "
                              f"fields, or null, not {type(preprocess).__name__}")
    return found


def import_onnx(source, *, name: str | None = None, labels: list | None = None,
                preprocess: dict | None = None) -> tuple[Model, dict]:
    """An ONNX file (path) or ModelProto -> (lnn Model, weights keyed `<layer name>.<param>`).

    `labels` and `preprocess` (fields as in a JSON description: color, scale, mean, std) override
    what the file carries; preprocess fields not given keep the file's or lnn's defaults."""
    is_file = isinstance(source, (str, Path))
    proto = load_onnx(source) if is_file else source
    try:
        description, params = convert_graph(proto)
        carried = _lnn_metadata(proto)
        description["name"] = name or carried.get("name") or (Path(source).stem if is_file else description["name"])
        merged_preprocess = {**(carried.get("preprocess") or {}), **(preprocess or {})}
        if merged_preprocess:
            description["preprocess"] = merged_preprocess
        if labels is not None or carried.get("labels"):
            description["labels"] = labels if labels is not None else carried["labels"]
        model = parse_model(description)
    except LnnError as err:            # the graph's, its metadata's or the description's: named after the file
        raise OnnxImportError(f"{source}: {err}" if is_file else str(err)) from None
    weights = {node.param_key(key): value for node, layer_params in zip(model.nodes, params)
               for key, value in layer_params.items()}
    return model, weights
