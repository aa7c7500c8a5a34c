"""The op registry: the one definition of every layer type lnn knows.

Each op states, in one place:
  - its attributes and their defaults (what a JSON layer may carry),
  - its parameter tensors and their shapes,
  - shape inference (per-sample shapes, no batch dimension),
  - its cost: FLOPs (a multiply-add counts 2) and other element-wise operations,
  - a plain NumPy reference forward on batched NCHW / NCT / NC arrays,
  - its ONNX mapping: `to_onnx` (the nodes the export writes) and `onnx_readers` (the ONNX node types the
    import reads into it); formats/onnx_export.py and formats/onnx_import.py are generic drivers that call
    these with their graph builder and node reader (onnx itself is never imported here).

The reference forward is the semantics every backend must reproduce (the NumPy runtime runs
it as is; the Numba and CUDA backends are checked against it). Conventions follow PyTorch:
conv weight [O, I/groups, KH, KW], linear weight [out, in] with y = x @ W.T + b, flatten in
(C, H, W) order, batch norm y = (x - mean) / sqrt(var + eps) * weight + bias. A series sample is
channel-first [C, T] (conv1d weight [O, I/groups, K]; batch [N, C, T]); a 1-D window op (conv1d, maxpool1d,
avgpool1d) is its 2-D op on [C, 1, T] (`two_d`, `as_2d`), so its costs and reference are that op's; lstm / gru
take PyTorch's weights and gate order.

Adding an op means adding one class here (ONNX mapping included), registering it in OPS, and one module
per backend.
"""

from __future__ import annotations

import math

import numpy as np

from lnn.formats.errors import LnnError, ModelSpecError


class SpecProblem(Exception):
    """Raised inside an op's checks; the model parser adds the layer's index and type."""

    def __init__(self, field: str | None, message: str):
        super().__init__(message)
        self.field = field
        self.message = message


# --------------------------------------------------------------------------- activations

def _relu(x, attrs):
    return np.maximum(x, 0)


def _relu6(x, attrs):
    return np.clip(x, 0, 6)


def _leaky_relu(x, attrs):
    return np.where(x >= 0, x, x * np.asarray(attrs["negative_slope"], x.dtype))


def _sigmoid(x, attrs):
    # Stable for large |x|: exp of a non-positive number only.
    e = np.exp(-np.abs(x))
    return np.where(x >= 0, 1 / (1 + e), e / (1 + e)).astype(x.dtype)


def _tanh(x, attrs):
    return np.tanh(x)


def _softmax(x, attrs):
    shifted = x - x.max(axis=1, keepdims=True)
    e = np.exp(shifted)
    return e / e.sum(axis=1, keepdims=True)


# name -> (reference function, attribute defaults, element-wise ops per output element)
ACTIVATIONS = {
    "relu": (_relu, {}, 1),
    "relu6": (_relu6, {}, 2),
    "leaky_relu": (_leaky_relu, {"negative_slope": 0.01}, 2),
    "sigmoid": (_sigmoid, {}, 4),
    "tanh": (_tanh, {}, 4),
    "softmax": (_softmax, {}, 4),
}


# name -> its ONNX node (Activation.activation_to_onnx, activation_from_onnx)
ONNX_ACTIVATIONS = {"relu": "Relu", "relu6": "Clip", "leaky_relu": "LeakyRelu", "sigmoid": "Sigmoid", "tanh": "Tanh",
                    "softmax": "Softmax"}
ONNX_FLOAT_LIMIT = 3.0e38          # Clip's defaults before opset 11 were -FLT_MAX / FLT_MAX


def normalize_activation(value) -> dict | None:
    """`"relu"` or `{"type": "leaky_relu", "negative_slope": 0.1}` -> a full dict; None stays None."""
    if value is None or value == "none" or value == "linear":
        return None
    if isinstance(value, str):
        value = {"type": value}
    if not isinstance(value, dict) or not isinstance(value.get("type"), str):
        raise SpecProblem("activation", f"activation must be a name such as \"relu\" or an object with \"type\", not {value!r}")
    kind = value["type"]
    if kind not in ACTIVATIONS:
        raise SpecProblem("activation", f"unknown activation {kind!r}; known: {', '.join(sorted(ACTIVATIONS))}")
    defaults = ACTIVATIONS[kind][1]
    unknown = set(value) - {"type"} - set(defaults)
    if unknown:
        raise SpecProblem("activation", f"activation {kind} has no field {sorted(unknown)[0]!r}")
    out = {"type": kind}
    for key, default in defaults.items():
        number = value.get(key, default)
        if not float32_number(number):
            raise SpecProblem("activation", f"activation {kind}: {key} must be a number that float32 holds, not {number!r}")
        out[key] = float(number)
    return out


def apply_activation(x: np.ndarray, activation: dict | None) -> np.ndarray:
    if activation is None:
        return x
    return ACTIVATIONS[activation["type"]][0](x, activation)


def activation_ops(activation: dict | None) -> int:
    return 0 if activation is None else ACTIVATIONS[activation["type"]][2]


# --------------------------------------------------------------------------- attribute helpers

FLOAT32_MAX = float(np.finfo(np.float32).max)     # models compute in float32


def float32_number(value, positive: bool = False) -> bool:
    """Whether `value` is a number (true and false are not) that float32, which models compute in, holds: not NaN,
    an infinity or beyond ±FLOAT32_MAX (compared, never converted, so an integer of any length is refused, not an
    OverflowError). `positive`: above zero in float32 too, where 1e-320 is 0 (a division by zero)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not -FLOAT32_MAX <= value <= FLOAT32_MAX:
        return False
    return not positive or np.float32(value) > 0


def _pair(field: str, value, minimum: int) -> tuple[int, int]:
    if isinstance(value, bool):
        raise SpecProblem(field, f"{field} must be an integer or a pair of integers, not {value!r}")
    if isinstance(value, int):
        value = (value, value)
    if (not isinstance(value, (list, tuple)) or len(value) != 2
            or not all(isinstance(v, int) and not isinstance(v, bool) for v in value)):
        raise SpecProblem(field, f"{field} must be an integer or a pair of integers, not {value!r}")
    if min(value) < minimum:
        raise SpecProblem(field, f"{field} must be >= {minimum}, not {list(value)}")
    return (int(value[0]), int(value[1]))


def _positive_int(field: str, value) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise SpecProblem(field, f"{field} must be a positive integer, not {value!r}")
    return value


def _flag(field: str, value) -> bool:
    if not isinstance(value, bool):
        raise SpecProblem(field, f"{field} must be true or false, not {value!r}")
    return value


def _positive_float32(field: str, value) -> float:
    if not float32_number(value, positive=True):
        raise SpecProblem(field, f"{field} must be a positive number that float32 holds, not {value!r}")
    return float(value)


def _probability(field: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < 1:
        raise SpecProblem(field, f"{field} must be a number in [0, 1), not {value!r}")
    return float(value)


def _require_rank(in_shape, ranks, what):
    if len(in_shape) not in ranks:
        raise SpecProblem(None, f"needs {what} input, got shape {list(in_shape)}")


def _window_out(size, kernel, stride, pad, dilation, field_hint):
    """Outputs of a window along one axis; `pad` is the padding on each side, or a (before, after) pair."""
    span = dilation * (kernel - 1) + 1
    total = sum(pad) if isinstance(pad, tuple) else 2 * pad
    out = (size + total - span) // stride + 1
    if out < 1:
        raise SpecProblem(field_hint, f"window {kernel} (dilation {dilation}) does not fit input size {size} with padding {pad}")
    return out


def _pad_nchw(x, pad_h, pad_w, value):
    if pad_h == 0 and pad_w == 0:
        return x
    return np.pad(x, ((0, 0), (0, 0), (pad_h, pad_h), (pad_w, pad_w)), constant_values=value)


def _windows(x, kernel, stride, dilation):
    """[N, C, H, W] (already padded) -> [N, C, OH, OW, KH, KW] strided view of every window."""
    kh, kw = kernel
    dh, dw = dilation
    sh, sw = stride
    view = np.lib.stride_tricks.sliding_window_view(x, (dh * (kh - 1) + 1, dw * (kw - 1) + 1), axis=(2, 3))
    return view[:, :, ::sh, ::sw, ::dh, ::dw]


# --------------------------------------------------------------------------- ops

class Op:
    """Base of every op. Subclasses set `name`, `attr_defaults` and override what they need."""

    name = ""
    attr_defaults: dict = {}       # a default of REQUIRED means the field must be given
    has_activation_field = False   # may carry "activation": ...
    trainable = True               # parameters (if any) are learned
    kernel_params: tuple = ()      # parameters that are kernels: what `--fp16` / `--int8` compress (binfile.py)

    def kernel_param_names(self, attrs) -> tuple:
        """The parameters that are kernels (what `--fp16` / `--int8` compress): `kernel_params` by default."""
        return self.kernel_params

    def normalize(self, attrs: dict, in_shape: tuple) -> dict:
        """Check and complete the attributes against the input shape; return the normalized dict."""
        return dict(attrs)

    def param_shapes(self, attrs: dict, in_shape: tuple) -> dict[str, tuple]:
        return {}

    def buffer_names(self) -> tuple[str, ...]:
        """Parameters that are statistics, not learned (batch norm's running mean/var)."""
        return ()

    def initial_weights(self, attrs: dict, param_shapes: dict, rng) -> dict:
        """PyTorch's default initialization as the trainer draws it (train/trainer.py initial_weights): every
        parameter U(-1/sqrt(fan_in), 1/sqrt(fan_in)), fan_in the weight's inputs per output."""
        bound = 1 / math.sqrt(self.fan_in(attrs, param_shapes)) if param_shapes else 0
        return {name: rng.uniform(-bound, bound, shape) for name, shape in param_shapes.items()}

    def fan_in(self, attrs: dict, param_shapes: dict) -> int:
        return math.prod(param_shapes["weight"][1:])

    def infer(self, attrs: dict, in_shape: tuple) -> tuple:
        return tuple(in_shape)

    def flops(self, attrs: dict, in_shape: tuple, out_shape: tuple) -> int:
        """Multiply-add FLOPs per sample (a multiply-add counts 2)."""
        return 0

    def elementwise_ops(self, attrs: dict, in_shape: tuple, out_shape: tuple) -> int:
        """Other operations per sample (bias adds, activations, comparisons)."""
        return 0

    def activation_bytes(self, attrs: dict, in_shape: tuple, out_shape: tuple) -> int:
        """Bytes of float32 values one sample's forward produces: the output, plus for ops that compute
        more than they return (a recurrent layer's gates and states) those values too."""
        return math.prod(out_shape) * 4

    def forward(self, x: np.ndarray, params: dict, attrs: dict, training: bool = False) -> np.ndarray:
        raise NotImplementedError

    two_d = ""                     # a 1-D window op over [C, T]: the name of the 2-D op it is on [C, 1, T]

    def as_2d(self, attrs: dict) -> dict:
        """A 1-D window op's attributes as those of its `two_d` op (model.as_rows makes the whole 2-D node)."""
        raise NotImplementedError

    # ONNX. Export: `to_onnx(graph, node, params)` appends the nodes of one layer to onnx_export's _GraphBuilder
    # (params float32, a batch norm after it already folded in). Import: `onnx_readers` maps each ONNX op type
    # this op reads to the name of its method `(node, chain)`, which reads onnx_import's _Node into its _Chain;
    # where several ops read one type, the first in OPS whose `onnx_claims` is true reads it (else the last).
    # A node's outputs past the first may carry the chain on only where `onnx_last_state_output` names it.
    onnx_readers: dict = {}
    onnx_last_state_output: int | None = None

    def to_onnx(self, graph, node, params: dict) -> None:
        raise LnnError(f"layer {node.index} ({node.op}): no ONNX export for this op")

    def onnx_claims(self, node, chain) -> bool:
        return True

    def onnx_absorbs(self, layer: dict, following: dict) -> bool:
        """Import: merge the parameterless layer `following` into this op's `layer` right before it, where ONNX
        writes one lnn layer as two nodes (true when merged). By default an activation joins a layer that takes
        one and has none yet (Conv + Relu -> conv2d with activation relu)."""
        if self.has_activation_field and following["type"] in ACTIVATIONS and not layer.get("activation"):
            layer["activation"] = following
            return True
        return False


REQUIRED = object()


class Linear(Op):
    name = "linear"
    kernel_params = ("weight",)
    attr_defaults = {"out_features": REQUIRED, "in_features": None, "bias": True, "activation": None}
    has_activation_field = True

    def normalize(self, attrs, in_shape):
        if len(in_shape) != 1:
            raise SpecProblem(None, f"needs a flat input, got shape {list(in_shape)}; add a flatten layer before it")
        out = dict(attrs)
        out["out_features"] = _positive_int("out_features", attrs["out_features"])
        if attrs["in_features"] is not None and attrs["in_features"] != in_shape[0]:
            raise SpecProblem("in_features", f"in_features is {in_shape[0]} from the previous layer, not {attrs['in_features']}")
        out["in_features"] = in_shape[0]
        out["bias"] = _flag("bias", attrs["bias"])
        return out

    def param_shapes(self, attrs, in_shape):
        shapes = {"weight": (attrs["out_features"], attrs["in_features"])}
        if attrs["bias"]:
            shapes["bias"] = (attrs["out_features"],)
        return shapes

    def infer(self, attrs, in_shape):
        return (attrs["out_features"],)

    def flops(self, attrs, in_shape, out_shape):
        return 2 * attrs["in_features"] * attrs["out_features"]

    def elementwise_ops(self, attrs, in_shape, out_shape):
        return attrs["out_features"] * (int(attrs["bias"]) + activation_ops(attrs["activation"]))

    def forward(self, x, params, attrs, training=False):
        y = x @ params["weight"].T
        if attrs["bias"]:
            y = y + params["bias"]
        return apply_activation(y, attrs["activation"])

    onnx_readers = {"Gemm": "gemm_from_onnx", "MatMul": "matmul_from_onnx", "Add": "add_from_onnx"}

    def to_onnx(self, graph, node, params):
        """Gemm(transB=1): y = x @ W.T + b, W kept as lnn stores it ([out, in])."""
        inputs = [graph.constant(f"{node.name}.{p}", params[p]) for p in ("weight", "bias") if p in params]
        graph.add("Gemm", node.name, inputs, transB=1)

    @staticmethod
    def _onnx_bias(node, c: np.ndarray, out_features: int) -> np.ndarray:
        """A bias that is the same for every batch row ([], [1], [K] or [1, K]) -> [K]."""
        if c.ndim > 2 or (c.ndim == 2 and c.shape[0] != 1):
            raise node.error(f"bias of shape {list(c.shape)} differs between batch rows; lnn takes a per-output bias [{out_features}]")
        try:
            return np.broadcast_to(c.reshape(-1) if c.ndim == 2 else c, (out_features,)).astype(np.float32)
        except ValueError:
            raise node.error(f"bias of shape {list(c.shape)} does not fit {out_features} outputs") from None

    def gemm_from_onnx(self, node, chain):
        """Gemm: weight [out, in] = B.T (B when transB=1), times alpha; bias = beta * C."""
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
            params["bias"] = self._onnx_bias(node, c, weight.shape[0]) * np.float32(attrs["beta"])
        chain.append(layer, params)

    def matmul_from_onnx(self, node, chain):
        """MatMul [N, K] @ [K, M] (+ Add: add_from_onnx): weight B.T."""
        node.attributes()
        node.need_rank((1,), "a 2-D [N, K]")
        b = node.weight(1, "B")
        if b.ndim != 2:
            raise node.error(f"B of shape {list(b.shape)}: only a 2-D [N, K] @ [K, M] product is supported")
        chain.append({"type": "linear", "name": chain.unique_name(node.proto.input[1], "linear"),
                      "out_features": int(b.shape[1]), "bias": False},
                     {"weight": np.ascontiguousarray(b.T, dtype=np.float32)})

    def add_from_onnx(self, node, chain):
        node.attributes()
        last = chain.last
        if not last or last["type"] != "linear" or last["bias"] or last.get("activation"):
            raise node.error("Add is supported only as the bias right after a MatMul (MatMul + Add)")
        position = 1 if node.proto.input[1] in node.consts else 0
        last["bias"] = True
        chain.params[-1]["bias"] = self._onnx_bias(node, node.weight(position, "bias"), last["out_features"])


def _conv_channels(attrs, cin: int) -> dict:
    """A convolution's in_channels (the previous layer's C; a given one must agree) and out_channels."""
    if attrs["in_channels"] is not None and attrs["in_channels"] != cin:
        raise SpecProblem("in_channels", f"in_channels is {cin} from the previous layer, not {attrs['in_channels']}")
    return {"in_channels": cin, "out_channels": _positive_int("out_channels", attrs["out_channels"])}


def _conv_groups(attrs, cin: int, cout: int) -> dict:
    """A convolution's groups (dividing both channel counts) and bias flag."""
    groups = _positive_int("groups", attrs["groups"])
    if cin % groups or cout % groups:
        raise SpecProblem("groups", f"groups {groups} must divide in_channels {cin} and out_channels {cout}")
    return {"groups": groups, "bias": _flag("bias", attrs["bias"])}


class Conv2d(Op):
    name = "conv2d"
    kernel_params = ("weight",)
    attr_defaults = {"out_channels": REQUIRED, "kernel_size": REQUIRED, "in_channels": None, "stride": 1,
                     "padding": 0, "dilation": 1, "groups": 1, "bias": True, "activation": None,
                     "algorithm": "auto"}
    has_activation_field = True
    algorithms = ("auto", "im2col", "winograd")

    def normalize(self, attrs, in_shape):
        _require_rank(in_shape, (3,), "a [C, H, W]")
        out = dict(attrs)
        out.update(_conv_channels(attrs, in_shape[0]))
        out["kernel_size"] = _pair("kernel_size", attrs["kernel_size"], 1)
        out["stride"] = _pair("stride", attrs["stride"], 1)
        out["padding"] = _pair("padding", attrs["padding"], 0)
        out["dilation"] = _pair("dilation", attrs["dilation"], 1)
        out.update(_conv_groups(attrs, out["in_channels"], out["out_channels"]))
        if attrs["algorithm"] not in self.algorithms:
            raise SpecProblem("algorithm", f"algorithm must be one of {', '.join(self.algorithms)}, not {attrs['algorithm']!r}")
        return out

    def param_shapes(self, attrs, in_shape):
        kh, kw = attrs["kernel_size"]
        shapes = {"weight": (attrs["out_channels"], attrs["in_channels"] // attrs["groups"], kh, kw)}
        if attrs["bias"]:
            shapes["bias"] = (attrs["out_channels"],)
        return shapes

    def infer(self, attrs, in_shape):
        _, h, w = in_shape
        oh = _window_out(h, attrs["kernel_size"][0], attrs["stride"][0], attrs["padding"][0], attrs["dilation"][0], "kernel_size")
        ow = _window_out(w, attrs["kernel_size"][1], attrs["stride"][1], attrs["padding"][1], attrs["dilation"][1], "kernel_size")
        return (attrs["out_channels"], oh, ow)

    def flops(self, attrs, in_shape, out_shape):
        kh, kw = attrs["kernel_size"]
        return 2 * math.prod(out_shape) * (attrs["in_channels"] // attrs["groups"]) * kh * kw

    def elementwise_ops(self, attrs, in_shape, out_shape):
        return math.prod(out_shape) * (int(attrs["bias"]) + activation_ops(attrs["activation"]))

    def forward(self, x, params, attrs, training=False):
        n = x.shape[0]
        groups = attrs["groups"]
        x = _pad_nchw(x, *attrs["padding"], 0)
        win = _windows(x, attrs["kernel_size"], attrs["stride"], attrs["dilation"])  # N C OH OW KH KW
        weight = params["weight"]
        cout, cin_g = weight.shape[:2]
        cout_g = cout // groups
        oh, ow = win.shape[2:4]
        y = np.empty((n, cout, oh, ow), dtype=np.result_type(x, weight))
        for g in range(groups):
            wg = weight[g * cout_g:(g + 1) * cout_g].reshape(cout_g, -1)   # [O/g, I/g*KH*KW]
            # im2col: every window as a column, [N, I/g*KH*KW, OH*OW], then one matrix product
            cols = np.ascontiguousarray(win[:, g * cin_g:(g + 1) * cin_g].transpose(0, 1, 4, 5, 2, 3))
            y[:, g * cout_g:(g + 1) * cout_g] = (wg @ cols.reshape(n, wg.shape[1], oh * ow)).reshape(n, cout_g, oh, ow)
        if attrs["bias"]:
            y += params["bias"][None, :, None, None]
        return apply_activation(y, attrs["activation"])

    onnx_readers = {"Conv": "conv_from_onnx"}

    def to_onnx(self, graph, node, params):
        """Conv (pads written as [top, left, bottom, right])."""
        attrs = node.attrs
        inputs = [graph.constant(f"{node.name}.{p}", params[p]) for p in ("weight", "bias") if p in params]
        graph.add("Conv", node.name, inputs, kernel_shape=list(attrs["kernel_size"]), strides=list(attrs["stride"]),
                  pads=list(attrs["padding"]) * 2, dilations=list(attrs["dilation"]), group=attrs["groups"])

    def conv_from_onnx(self, node, chain):
        """Conv with a 4-D weight: symmetric pads, or auto_pad VALID / SAME that comes out symmetric."""
        attrs, weight, layer = _conv_from_onnx(node, chain, self.name)
        kernel = list(weight.shape[2:])
        strides = node.pair(attrs["strides"], "strides", [1, 1])
        dilations = node.pair(attrs["dilations"], "dilations", [1, 1])
        layer.update(kernel_size=kernel, stride=strides, dilation=dilations,
                     padding=node.symmetric_padding(attrs, kernel, strides, dilations))


def _conv_from_onnx(node, chain, lnn_op: str) -> tuple:
    """What Conv -> conv1d (a 3-D weight) and conv2d (4-D) share: (attributes, weight, the layer appended to the
    chain without its window fields)."""
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
    layer = {"type": lnn_op, "name": chain.unique_name(node.proto.input[1], lnn_op),
             "out_channels": int(weight.shape[0]), "groups": int(attrs["group"]), "bias": bias is not None}
    chain.append(layer, {"weight": weight} if bias is None else {"weight": weight, "bias": bias})
    return attrs, weight, layer


def _padding_1d(value, kernel: int, stride: int, dilation: int) -> tuple[int, int]:
    """conv1d's padding -> (left, right): an integer (both sides), [left, right], "valid" (none) or "same"
    (PyTorch's: stride 1, total dilation * (kernel - 1), the odd one on the right)."""
    if value == "valid":
        return (0, 0)
    if value == "same":
        if stride != 1:
            raise SpecProblem("padding", f"padding \"same\" needs stride 1, not {stride} (as PyTorch's Conv1d)")
        total = dilation * (kernel - 1)
        return (total // 2, total - total // 2)
    if isinstance(value, str):
        raise SpecProblem("padding", f"padding must be an integer, [left, right], \"same\" or \"valid\", not {value!r}")
    return _pair("padding", value, 0)


def conv1d_as_conv2d(attrs: dict, padding: tuple | None = None) -> dict:
    """conv1d's attributes as those of the conv2d that computes it on the input viewed as [C, 1, T] (weight
    [O, C/g, 1, K]): kernel (1, K), stride (1, S), dilation (1, D), padding (0, left) or (0, padding[1]) when
    `padding` (a pair) is given. The right padding attrs["padding"][1] may differ from the left (an even kernel
    with "same"): the 2-D window kernels pad from their padded buffer's size (`conv1d_padded_length`) or read
    zeros past the input, so only the buffer's size needs it."""
    pad = attrs["padding"] if padding is None else padding
    return {"out_channels": attrs["out_channels"], "in_channels": attrs["in_channels"],
            "kernel_size": (1, attrs["kernel_size"]), "stride": (1, attrs["stride"]), "padding": (0, pad[0]),
            "dilation": (1, attrs["dilation"]), "groups": attrs["groups"], "bias": attrs["bias"],
            "activation": attrs["activation"], "algorithm": "im2col"}


def conv1d_padded_length(attrs: dict, length: int) -> int:
    """T + left + right: the length of conv1d's zero-padded input."""
    return length + sum(attrs["padding"])


class Conv1d(Op):
    """1-D convolution over [C, T] (PyTorch Conv1d: weight [O, C/groups, K]); computed as the conv2d of height
    1 that conv1d_as_conv2d describes, so shapes, costs and the reference are conv2d's."""

    name = "conv1d"
    two_d = "conv2d"
    kernel_params = ("weight",)
    attr_defaults = {"out_channels": REQUIRED, "kernel_size": REQUIRED, "in_channels": None, "stride": 1,
                     "padding": 0, "dilation": 1, "groups": 1, "bias": True, "activation": None}
    has_activation_field = True

    def normalize(self, attrs, in_shape):
        _require_rank(in_shape, (2,), "a [C, T]")
        out = dict(attrs)
        out.update(_conv_channels(attrs, in_shape[0]))
        for key in ("kernel_size", "stride", "dilation"):
            out[key] = _positive_int(key, attrs[key])
        out["padding"] = _padding_1d(attrs["padding"], out["kernel_size"], out["stride"], out["dilation"])
        out.update(_conv_groups(attrs, out["in_channels"], out["out_channels"]))
        return out

    def param_shapes(self, attrs, in_shape):
        shapes = {"weight": (attrs["out_channels"], attrs["in_channels"] // attrs["groups"], attrs["kernel_size"])}
        if attrs["bias"]:
            shapes["bias"] = (attrs["out_channels"],)
        return shapes

    def infer(self, attrs, in_shape):
        length = _window_out(in_shape[1], attrs["kernel_size"], attrs["stride"], attrs["padding"], attrs["dilation"],
                             "kernel_size")
        return (attrs["out_channels"], length)

    def flops(self, attrs, in_shape, out_shape):
        return OPS[self.two_d].flops(self.as_2d(attrs), (in_shape[0], 1, in_shape[1]), (out_shape[0], 1, out_shape[1]))

    def elementwise_ops(self, attrs, in_shape, out_shape):
        return OPS[self.two_d].elementwise_ops(self.as_2d(attrs), (in_shape[0], 1, in_shape[1]),
                                               (out_shape[0], 1, out_shape[1]))

    def as_2d(self, attrs):
        return conv1d_as_conv2d(attrs)

    def forward(self, x, params, attrs, training=False):
        x = np.pad(x, ((0, 0), (0, 0), attrs["padding"]))
        rows = {key: value[:, :, None] if key == "weight" else value for key, value in params.items()}
        return OPS[self.two_d].forward(x[:, :, None], rows, conv1d_as_conv2d(attrs, (0, 0)))[:, :, 0]

    onnx_readers = {"Conv": "conv_from_onnx"}

    def to_onnx(self, graph, node, params):
        """Conv with a 3-D weight (pads [left, right])."""
        attrs = node.attrs
        inputs = [graph.constant(f"{node.name}.{p}", params[p]) for p in ("weight", "bias") if p in params]
        graph.add("Conv", node.name, inputs, kernel_shape=[attrs["kernel_size"]], strides=[attrs["stride"]],
                  pads=list(attrs["padding"]), dilations=[attrs["dilation"]], group=attrs["groups"])

    def onnx_claims(self, node, chain):
        weight = node.consts.get(node.proto.input[1]) if len(node.proto.input) > 1 else None
        return weight is not None and weight.ndim == 3

    def conv_from_onnx(self, node, chain):
        """Conv with a 3-D weight; any pads or auto_pad (the left and right ones may differ)."""
        attrs, weight, layer = _conv_from_onnx(node, chain, self.name)
        strides, dilations = [int(v) for v in attrs["strides"] or [1]], [int(v) for v in attrs["dilations"] or [1]]
        if len(strides) != 1 or len(dilations) != 1:
            raise node.error(f"strides {strides} / dilations {dilations}: a 1-D convolution takes one of each")
        begins, ends = node.padding(attrs, list(weight.shape[2:]), strides, dilations)
        layer.update(kernel_size=int(weight.shape[2]), stride=strides[0], dilation=dilations[0], padding=begins + ends)


class _WindowPoolOnnx:
    """ONNX MaxPool / AveragePool (`onnx_type`) <-> a window pool: 2-D on [N, C, H, W], or 1-D on [N, C, T] (the
    same node over the T axis). Import: symmetric pads, no dilation; ceil_mode only where it gives the same
    size as floor; AveragePool's count_include_pad."""

    onnx_type = ""

    def to_onnx(self, graph, node, params):
        attrs = node.attrs
        window = pool1d_as_2d(attrs) if self.two_d else attrs
        axes = slice(1, 2) if self.two_d else slice(0, 2)                 # a 1-D pool: the T axis only
        fields = dict(kernel_shape=list(window["kernel_size"][axes]), strides=list(window["stride"][axes]),
                      pads=list(window["padding"][axes]) * 2)
        if self.onnx_type == "AveragePool":
            fields["count_include_pad"] = int(attrs["count_include_pad"])
        graph.add(self.onnx_type, node.name, **fields)

    def onnx_claims(self, node, chain):
        return len(node.in_shape) == (2 if self.two_d else 3)

    def pool_from_onnx(self, node, chain):
        # MaxPool's storage_order only orders the unused Indices output
        extra = {"storage_order": 0} if self.onnx_type == "MaxPool" else {"count_include_pad": 0}
        attrs = node.attributes(auto_pad="NOTSET", ceil_mode=0, dilations=None, kernel_shape=None, pads=None,
                                strides=None, **extra)
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
        padding = node.symmetric_padding(attrs, kernel, strides, [1] * rank)
        if attrs["ceil_mode"]:
            for size, k, s, p in zip(node.in_shape[1:], kernel, strides, padding):
                if (size + 2 * p - k) % s:
                    raise node.error("ceil_mode=1 gives a larger output than lnn's floor rounding here; not supported")
        if rank == 1:
            layer = {"type": self.name, "kernel_size": kernel[0], "stride": strides[0], "padding": padding[0]}
        else:
            layer = {"type": self.name, "kernel_size": kernel, "stride": strides, "padding": padding}
        if self.onnx_type == "AveragePool":
            layer["count_include_pad"] = bool(attrs["count_include_pad"])
        chain.append(layer)


class _Pool2d(Op):
    attr_defaults = {"kernel_size": REQUIRED, "stride": None, "padding": 0}
    trainable = False

    def normalize(self, attrs, in_shape):
        _require_rank(in_shape, (3,), "a [C, H, W]")
        out = dict(attrs)
        out["kernel_size"] = _pair("kernel_size", attrs["kernel_size"], 1)
        out["stride"] = out["kernel_size"] if attrs["stride"] is None else _pair("stride", attrs["stride"], 1)
        out["padding"] = _pair("padding", attrs["padding"], 0)
        if any(2 * p > k for p, k in zip(out["padding"], out["kernel_size"])):
            raise SpecProblem("padding", f"padding {list(out['padding'])} must be at most half of kernel_size {list(out['kernel_size'])}")
        return out

    def infer(self, attrs, in_shape):
        c, h, w = in_shape
        oh = _window_out(h, attrs["kernel_size"][0], attrs["stride"][0], attrs["padding"][0], 1, "kernel_size")
        ow = _window_out(w, attrs["kernel_size"][1], attrs["stride"][1], attrs["padding"][1], 1, "kernel_size")
        return (c, oh, ow)


class MaxPool2d(_WindowPoolOnnx, _Pool2d):
    name = "maxpool2d"
    onnx_type, onnx_readers = "MaxPool", {"MaxPool": "pool_from_onnx"}

    def elementwise_ops(self, attrs, in_shape, out_shape):
        return math.prod(out_shape) * (math.prod(attrs["kernel_size"]) - 1)

    def forward(self, x, params, attrs, training=False):
        x = _pad_nchw(x, *attrs["padding"], -np.inf)
        windows = _windows(x, attrs["kernel_size"], attrs["stride"], (1, 1))          # N C OH OW KH KW (a view)
        out = windows[..., 0, 0].copy()
        for i, j in np.ndindex(*windows.shape[4:]):     # one maximum per kernel offset: a reduction over the
            np.maximum(out, windows[..., i, j], out=out)   # two window axes was 60% of a photo's NumPy time
        return out


class AvgPool2d(_WindowPoolOnnx, _Pool2d):
    """Average pooling; padded cells count as zeros (PyTorch's count_include_pad=True default)."""

    name = "avgpool2d"
    onnx_type, onnx_readers = "AveragePool", {"AveragePool": "pool_from_onnx"}
    attr_defaults = {**_Pool2d.attr_defaults, "count_include_pad": True}

    def normalize(self, attrs, in_shape):
        out = super().normalize(attrs, in_shape)
        out["count_include_pad"] = _flag("count_include_pad", attrs["count_include_pad"])
        return out

    def elementwise_ops(self, attrs, in_shape, out_shape):
        return math.prod(out_shape) * math.prod(attrs["kernel_size"])

    def forward(self, x, params, attrs, training=False):
        padded = _pad_nchw(x, *attrs["padding"], 0)
        sums = _windows(padded, attrs["kernel_size"], attrs["stride"], (1, 1)).sum(axis=(4, 5))
        if attrs["count_include_pad"]:
            return (sums / math.prod(attrs["kernel_size"])).astype(x.dtype)
        ones = _pad_nchw(np.ones((1, 1) + x.shape[2:], x.dtype), *attrs["padding"], 0)
        counts = _windows(ones, attrs["kernel_size"], attrs["stride"], (1, 1)).sum(axis=(4, 5))
        return (sums / counts).astype(x.dtype)


def pool1d_as_2d(attrs: dict) -> dict:
    """A 1-D pool's attributes as those of its 2-D pool on the input viewed as [C, 1, T]: kernel (1, K),
    stride (1, S), padding (0, P) (and count_include_pad as it is)."""
    return dict(attrs, kernel_size=(1, attrs["kernel_size"]), stride=(1, attrs["stride"]), padding=(0, attrs["padding"]))


class _Pool1d(Op):
    """A pool over T of [C, T] (PyTorch MaxPool1d / AvgPool1d): its 2-D op (`two_d`) on [C, 1, T]
    (pool1d_as_2d), so its costs and its reference forward are that op's."""

    attr_defaults = {"kernel_size": REQUIRED, "stride": None, "padding": 0}
    trainable = False
    two_d = ""

    def normalize(self, attrs, in_shape):
        _require_rank(in_shape, (2,), "a [C, T]")
        out = dict(attrs)
        out["kernel_size"] = _positive_int("kernel_size", attrs["kernel_size"])
        out["stride"] = out["kernel_size"] if attrs["stride"] is None else _positive_int("stride", attrs["stride"])
        padding = attrs["padding"]
        if not isinstance(padding, int) or isinstance(padding, bool) or padding < 0:
            raise SpecProblem("padding", f"padding must be an integer >= 0, not {padding!r}")
        if 2 * padding > out["kernel_size"]:
            raise SpecProblem("padding", f"padding {padding} must be at most half of kernel_size {out['kernel_size']}")
        return out

    def infer(self, attrs, in_shape):
        c, length = in_shape
        return (c, _window_out(length, attrs["kernel_size"], attrs["stride"], attrs["padding"], 1, "kernel_size"))

    def elementwise_ops(self, attrs, in_shape, out_shape):
        return OPS[self.two_d].elementwise_ops(self.as_2d(attrs), (in_shape[0], 1, in_shape[1]),
                                               (out_shape[0], 1, out_shape[1]))

    def as_2d(self, attrs):
        return pool1d_as_2d(attrs)

    def forward(self, x, params, attrs, training=False):
        return OPS[self.two_d].forward(x[:, :, None], params, self.as_2d(attrs))[:, :, 0]


class MaxPool1d(_WindowPoolOnnx, _Pool1d):
    name = "maxpool1d"
    onnx_type, onnx_readers = "MaxPool", {"MaxPool": "pool_from_onnx"}
    two_d = "maxpool2d"


class AvgPool1d(_WindowPoolOnnx, _Pool1d):
    """Average pooling over T; padded cells count as zeros unless count_include_pad is false (PyTorch's)."""

    name = "avgpool1d"
    onnx_type, onnx_readers = "AveragePool", {"AveragePool": "pool_from_onnx"}
    two_d = "avgpool2d"
    attr_defaults = {**_Pool1d.attr_defaults, "count_include_pad": True}

    def normalize(self, attrs, in_shape):
        out = super().normalize(attrs, in_shape)
        out["count_include_pad"] = _flag("count_include_pad", attrs["count_include_pad"])
        return out


class _GlobalPool(Op):
    """A reduction over everything after the channel: [C, T] or [C, H, W] -> [C] (keepdims: [C, 1] or
    [C, 1, 1]); over time for a series, over the image for an image."""

    attr_defaults = {"keepdims": False}
    trainable = False
    reduce = ""           # the NumPy reduction: "mean" or "max"

    def normalize(self, attrs, in_shape):
        _require_rank(in_shape, (2, 3), "a [C, T] or [C, H, W]")
        return {"keepdims": _flag("keepdims", attrs["keepdims"])}

    def infer(self, attrs, in_shape):
        return (in_shape[0],) + (1,) * (len(in_shape) - 1) if attrs["keepdims"] else (in_shape[0],)

    def elementwise_ops(self, attrs, in_shape, out_shape):
        return math.prod(in_shape)

    def forward(self, x, params, attrs, training=False):
        axes = tuple(range(2, x.ndim))
        return getattr(x, self.reduce)(axis=axes, keepdims=attrs["keepdims"]).astype(x.dtype, copy=False)

    onnx_type = ""        # GlobalAveragePool or GlobalMaxPool ([N, C, T] or [N, C, H, W], keepdims)

    @property
    def onnx_readers(self):
        return {self.onnx_type: "global_pool_from_onnx"}

    def to_onnx(self, graph, node, params):
        """The global pool, then Flatten(axis=1) unless keepdims."""
        graph.add(self.onnx_type, node.name)
        if not node.attrs["keepdims"]:
            graph.add("Flatten", f"{node.name}/flatten", axis=1)

    def global_pool_from_onnx(self, node, chain):
        node.attributes()
        node.need_rank((2, 3), "a 3-D [N, C, T] or 4-D [N, C, H, W]")
        chain.append({"type": self.name, "keepdims": True})

    def onnx_absorbs(self, layer, following):
        """The global pool + Flatten is one lnn layer without keepdims."""
        if following["type"] == "flatten" and layer["keepdims"]:
            layer["keepdims"] = False
            return True
        return False


class GlobalAvgPool(_GlobalPool):
    """Mean over T (or H and W)."""

    name = "global_avg_pool"
    reduce = "mean"
    onnx_type = "GlobalAveragePool"


class GlobalMaxPool(_GlobalPool):
    """Maximum over T (or H and W) (PyTorch AdaptiveMaxPool1d(1) / 2d(1), ONNX GlobalMaxPool)."""

    name = "global_max_pool"
    reduce = "max"
    onnx_type = "GlobalMaxPool"


# onnx_import's chain layouts in which a Reshape is an LSTM / GRU's (directions merged, or the last states as
# [N, D*H]), not a flatten
RECURRENT_RESHAPE_LAYOUTS = ("directions_last", "last_state_batch")


class Flatten(Op):
    name = "flatten"
    trainable = False

    def infer(self, attrs, in_shape):
        return (math.prod(in_shape),)

    def forward(self, x, params, attrs, training=False):
        return x.reshape(x.shape[0], -1)

    onnx_readers = {"Flatten": "flatten_from_onnx", "Reshape": "reshape_from_onnx"}

    def to_onnx(self, graph, node, params):
        graph.add("Flatten", node.name, axis=1)

    def onnx_claims(self, node, chain):
        return node.op != "Reshape" or chain.layout not in RECURRENT_RESHAPE_LAYOUTS   # else a recurrent layer's

    def flatten_from_onnx(self, node, chain):
        """Flatten on axis 1."""
        attrs = node.attributes(axis=1)
        rank = len(node.in_shape) + 1
        axis = attrs["axis"] + rank if attrs["axis"] < 0 else attrs["axis"]
        if axis != 1:
            raise node.error(f"axis {attrs['axis']} of a rank-{rank} input: lnn flattens everything after the batch (axis 1) only")
        chain.append({"type": "flatten"})

    def reshape_from_onnx(self, node, chain):
        """Reshape to [N, -1], [0, -1] or [N, K] only."""
        attrs = node.attributes(allowzero=0)
        target = [int(v) for v in node.const(1, "shape").reshape(-1)]
        features = math.prod(node.in_shape)
        batch_ok = {-1} if attrs["allowzero"] else {0, -1}       # allowzero=1 makes a 0 a real zero
        if node.batch is not None:
            batch_ok.add(node.batch)                              # the graph's fixed batch size written out
        if len(target) != 2 or target[0] not in batch_ok or target[1] not in (-1, features) or target == [-1, -1]:
            raise node.error(f"Reshape to {target} is not supported: lnn supports Reshape only as a flatten "
                             f"to [N, -1], [0, -1] or [-1, {features}]")
        chain.append({"type": "flatten"})


class BatchNorm(Op):
    """Batch norm over channels: [C] or [C, T] (1d) or [C, H, W] (2d); inference uses the running statistics."""

    name = "batchnorm"
    attr_defaults = {"num_features": None, "eps": 1e-5, "momentum": 0.1, "activation": None}
    has_activation_field = True

    def normalize(self, attrs, in_shape):
        _require_rank(in_shape, (1, 2, 3), "a [C], [C, T] or [C, H, W]")
        out = dict(attrs)
        c = in_shape[0]
        if attrs["num_features"] is not None and attrs["num_features"] != c:
            raise SpecProblem("num_features", f"num_features is {c} from the previous layer, not {attrs['num_features']}")
        out["num_features"] = c
        out["eps"] = _positive_float32("eps", attrs["eps"])
        out["momentum"] = _probability("momentum", attrs["momentum"])
        return out

    def param_shapes(self, attrs, in_shape):
        c = (attrs["num_features"],)
        return {"weight": c, "bias": c, "running_mean": c, "running_var": c}

    def buffer_names(self):
        return ("running_mean", "running_var")

    def initial_weights(self, attrs, param_shapes, rng):
        """weight 1, bias 0, running mean 0, running var 1."""
        return {name: np.ones(shape) if name in ("weight", "running_var") else np.zeros(shape)
                for name, shape in param_shapes.items()}

    def elementwise_ops(self, attrs, in_shape, out_shape):
        return math.prod(out_shape) * (2 + activation_ops(attrs["activation"]))

    def forward(self, x, params, attrs, training=False):
        shape = (1, -1) + (1,) * (x.ndim - 2)
        scale = params["weight"] / np.sqrt(params["running_var"] + attrs["eps"])
        shift = params["bias"] - params["running_mean"] * scale
        y = x * scale.reshape(shape).astype(x.dtype) + shift.reshape(shape).astype(x.dtype)
        return apply_activation(y, attrs["activation"])

    onnx_readers = {"BatchNormalization": "batchnorm_from_onnx"}

    def to_onnx(self, graph, node, params):
        """BatchNormalization (the export folds a batch norm into a conv1d / conv2d / linear just before it
        that has no activation: formats/fold.py)."""
        inputs = [graph.constant(f"{node.name}.{p}", params[p]) for p in ("weight", "bias", "running_mean", "running_var")]
        graph.add("BatchNormalization", node.name, inputs, epsilon=node.attrs["eps"])

    def batchnorm_from_onnx(self, node, chain):
        """Inference mode only."""
        attrs = node.attributes(epsilon=1e-5, momentum=0.9, training_mode=0, spatial=1)
        if attrs["training_mode"]:
            raise node.error("training_mode=1 (batch statistics) is not supported; export the model in eval mode")
        if attrs["spatial"] != 1:
            raise node.error("spatial=0 (per-element statistics) is not supported")
        params = {key: node.weight(i, key) for i, key in enumerate(("weight", "bias", "running_mean", "running_var"), 1)}
        chain.append({"type": "batchnorm", "name": chain.unique_name(node.proto.input[1], "batchnorm"),
                      "eps": float(attrs["epsilon"])}, params)


class LayerNorm(Op):
    """Layer norm over the trailing dimensions of a sample (PyTorch nn.LayerNorm(normalized_shape) on the
    tensor as laid out; ONNX LayerNormalization(axis)): y = (x - mean) / sqrt(var + eps) * weight + bias, with
    mean and the biased var over the normalized_shape values of each sample (of each position before them).
    normalized_shape defaults to the whole sample; weight and bias are normalized_shape, as PyTorch's."""

    name = "layernorm"
    attr_defaults = {"normalized_shape": None, "eps": 1e-5, "elementwise_affine": True, "bias": True}

    def normalize(self, attrs, in_shape):
        out = dict(attrs)
        shape = attrs["normalized_shape"]
        if shape is None:
            shape = list(in_shape)
        elif isinstance(shape, int) and not isinstance(shape, bool):
            shape = [shape]
        if (not isinstance(shape, (list, tuple)) or not shape
                or not all(isinstance(v, int) and not isinstance(v, bool) for v in shape)):
            raise SpecProblem("normalized_shape", f"normalized_shape must be an integer or a list of integers, "
                                                  f"not {attrs['normalized_shape']!r}")
        if len(shape) > len(in_shape) or tuple(shape) != tuple(in_shape[len(in_shape) - len(shape):]):
            raise SpecProblem("normalized_shape", f"normalized_shape {list(shape)} must be the last dimensions of "
                                                  f"the input {list(in_shape)}")
        out["normalized_shape"] = tuple(shape)
        out["eps"] = _positive_float32("eps", attrs["eps"])
        out["elementwise_affine"] = _flag("elementwise_affine", attrs["elementwise_affine"])
        out["bias"] = _flag("bias", attrs["bias"]) and out["elementwise_affine"]
        return out

    def param_shapes(self, attrs, in_shape):
        shapes = {}
        if attrs["elementwise_affine"]:
            shapes["weight"] = attrs["normalized_shape"]
            if attrs["bias"]:
                shapes["bias"] = attrs["normalized_shape"]
        return shapes

    def elementwise_ops(self, attrs, in_shape, out_shape):
        # per value: sum for the mean, subtract, square and sum for the variance, scale; then weight and bias
        return math.prod(in_shape) * (5 + len(self.param_shapes(attrs, in_shape)))

    def forward(self, x, params, attrs, training=False):
        axes = tuple(range(x.ndim - len(attrs["normalized_shape"]), x.ndim))
        wide = x.astype(np.float64)
        centered = wide - wide.mean(axis=axes, keepdims=True)
        y = centered / np.sqrt((centered * centered).mean(axis=axes, keepdims=True) + attrs["eps"])
        if "weight" in params:
            y = y * params["weight"]
        if "bias" in params:
            y = y + params["bias"]
        return y.astype(x.dtype)

    onnx_readers = {"LayerNormalization": "layernorm_from_onnx"}

    def to_onnx(self, graph, node, params):
        """LayerNormalization(axis = -len(normalized_shape), epsilon); a Scale of ones without
        elementwise_affine (ONNX requires one), no B without bias."""
        attrs = node.attrs
        scale = params.get("weight", np.ones(attrs["normalized_shape"], np.float32))
        inputs = [graph.constant(f"{node.name}.weight", scale)]
        if "bias" in params:
            inputs.append(graph.constant(f"{node.name}.bias", params["bias"]))
        graph.add("LayerNormalization", node.name, inputs, axis=-len(attrs["normalized_shape"]), epsilon=attrs["eps"])

    def layernorm_from_onnx(self, node, chain):
        """normalized_shape: the input's dimensions from axis on; Scale and B broadcast to it."""
        attrs = node.attributes(axis=-1, epsilon=1e-5, stash_type=1)
        rank = len(node.in_shape) + 1
        axis = attrs["axis"] + rank if attrs["axis"] < 0 else attrs["axis"]
        if not 1 <= axis < rank:
            raise node.error(f"axis {attrs['axis']} of a rank-{rank} input: lnn normalizes within a sample (axis >= 1)")
        shape = list(node.in_shape[axis - 1:])
        scale, bias = node.weight(1, "Scale"), node.weight(2, "B", optional=True)
        params = {}
        for key, value in (("weight", scale), ("bias", bias)):
            if value is None:
                continue
            try:
                params[key] = np.ascontiguousarray(np.broadcast_to(value, shape), dtype=np.float32)
            except ValueError:
                raise node.error(f"{'Scale' if key == 'weight' else 'B'} of shape {list(value.shape)} does not fit "
                                 f"the normalized shape {shape}") from None
        chain.append({"type": "layernorm", "name": chain.unique_name(node.proto.input[1], "layernorm"),
                      "normalized_shape": shape, "eps": float(attrs["epsilon"]), "bias": bias is not None}, params)


class Dropout(Op):
    """Identity at inference; the trainer implements the training-time mask."""

    name = "dropout"
    attr_defaults = {"p": 0.5}
    trainable = False

    def normalize(self, attrs, in_shape):
        return {"p": _probability("p", attrs["p"])}

    def forward(self, x, params, attrs, training=False):
        return x

    # Export: the inference graph has no dropout (onnx_export drops it before batch norms are folded).
    onnx_readers = {"Dropout": "dropout_from_onnx"}

    def dropout_from_onnx(self, node, chain):
        """The identity at inference, as in lnn (lnn-export drops it again)."""
        attrs = node.attributes(ratio=0.5, seed=0, is_test=1)
        if node.opset >= 12:
            ratio = node.const(1, "ratio", optional=True)
            ratio = 0.5 if ratio is None else float(ratio)
            training = node.const(2, "training_mode", optional=True)
            if training is not None and bool(training):
                raise node.error("training_mode=true is not supported; export the model in eval mode")
        else:
            ratio = float(attrs["ratio"])
        chain.append({"type": "dropout", "p": ratio})


class Activation(Op):
    """A stand-alone activation layer: {"type": "relu"}, {"type": "leaky_relu", "negative_slope": 0.2}."""

    trainable = False

    def __init__(self, kind: str):
        self.name = kind
        self.attr_defaults = dict(ACTIVATIONS[kind][1])
        self.onnx_readers = {ONNX_ACTIVATIONS[kind]: "activation_from_onnx"}

    def normalize(self, attrs, in_shape):
        if self.name == "softmax" and len(in_shape) != 1:
            raise SpecProblem(None, f"softmax needs a flat [K] input, got shape {list(in_shape)}")
        return normalize_activation({"type": self.name, **attrs})

    def elementwise_ops(self, attrs, in_shape, out_shape):
        return math.prod(out_shape) * activation_ops(attrs)

    def forward(self, x, params, attrs, training=False):
        return apply_activation(x, attrs)

    # Export: the activation's node, for a stand-alone layer and for the fused `activation` of the layer before
    # (onnx_export's _GraphBuilder.activation). Import: a node right after a layer that takes an activation and
    # has none yet becomes that layer's (Op.onnx_absorbs), else a stand-alone layer.
    def to_onnx(self, graph, node, params):
        self.activation_to_onnx(graph, node.attrs, node.name)

    def activation_to_onnx(self, graph, activation: dict, name: str) -> None:
        """Relu, Clip(0, 6), LeakyRelu(alpha), Sigmoid, Tanh, Softmax(axis=1)."""
        inputs, fields = [], {}
        if self.name == "relu6":
            inputs = [graph.constant(f"{name}.min", np.array(0.0)), graph.constant(f"{name}.max", np.array(6.0))]
        elif self.name == "leaky_relu":
            fields["alpha"] = activation["negative_slope"]
        elif self.name == "softmax":
            fields["axis"] = 1
        graph.add(ONNX_ACTIVATIONS[self.name], name, inputs, **fields)

    def activation_from_onnx(self, node, chain):
        """Clip 0..6 is relu6 and Clip 0..inf relu (relu6 reads Clip), an unbounded Clip nothing; LeakyRelu's
        alpha; Softmax over the last axis of [N, K] only."""
        activation = {"type": self.name}
        if self.name == "relu6":
            activation = self._clip_from_onnx(node)
            if activation is None:
                return                                  # no bounds: the identity
        elif self.name == "leaky_relu":
            activation["negative_slope"] = float(node.attributes(alpha=0.01)["alpha"])
        elif self.name == "softmax":
            attrs = node.attributes(axis=-1 if node.opset >= 13 else 1)
            rank = len(node.in_shape) + 1
            if rank != 2 or attrs["axis"] not in (1, -1):
                raise node.error(f"softmax over axis {attrs['axis']} of a rank-{rank} input: lnn's softmax works on "
                                 "[N, K] over K only")
        else:
            node.attributes()
        chain.append(activation)

    @staticmethod
    def _clip_from_onnx(node) -> dict | None:
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
            return None
        if low == 0 and high == 6:
            return {"type": "relu6"}
        if low == 0 and high >= ONNX_FLOAT_LIMIT:
            return {"type": "relu"}
        raise node.error(f"Clip to [{low:g}, {high:g}] is not supported: lnn has Clip only as relu6 (0 to 6) "
                         "or relu (0, no maximum)")


class _Recurrent(Op):
    """A recurrent layer over a channel-first series: x [C, T] (batch [N, C, T]) -> [H*D, T] with
    "return": "sequence", or [H*D] with "return": "last" (D = 2 when bidirectional, else 1).

    Parameters as PyTorch's state dict, per layer l and direction ("" forward, "_reverse" backward):
    weight_ih_l{l} [G*H, in_l], weight_hh_l{l} [G*H, H], bias_ih_l{l} and bias_hh_l{l} [G*H], with
    G gate blocks stacked in PyTorch's order, in_0 = C and in_l = H*D above. A layer's output at step
    t is its directions' hidden states concatenated [forward, backward]; it is the next layer's input.
    "last" is PyTorch's h_n of the top layer: the forward direction's state after step T-1 and the
    backward direction's after step 0 (its last step), concatenated, i.e. torch's
    cat(output[:, -1, :H], output[:, 0, H:]). Initial states are zero."""

    gates = 0
    returns = ("sequence", "last")
    attr_defaults = {"hidden_size": REQUIRED, "input_size": None, "num_layers": 1, "bidirectional": False,
                     "return": "sequence", "bias": True}

    def normalize(self, attrs, in_shape):
        _require_rank(in_shape, (2,), "a [C, T] (channels, time)")
        out = dict(attrs)
        if attrs["input_size"] is not None and attrs["input_size"] != in_shape[0]:
            raise SpecProblem("input_size", f"input_size is {in_shape[0]} from the previous layer, not {attrs['input_size']}")
        out["input_size"] = in_shape[0]
        out["hidden_size"] = _positive_int("hidden_size", attrs["hidden_size"])
        out["num_layers"] = _positive_int("num_layers", attrs["num_layers"])
        out["bidirectional"] = _flag("bidirectional", attrs["bidirectional"])
        out["bias"] = _flag("bias", attrs["bias"])
        if attrs["return"] not in self.returns:
            raise SpecProblem("return", f"return must be one of {', '.join(self.returns)}, not {attrs['return']!r}")
        return out

    @staticmethod
    def directions(attrs) -> int:
        return 2 if attrs["bidirectional"] else 1

    def fan_in(self, attrs, param_shapes):
        return attrs["hidden_size"]                 # PyTorch's RNNs: every tensor U(-1/sqrt(H), 1/sqrt(H))

    @classmethod
    def layer_input_size(cls, attrs, layer: int) -> int:
        return attrs["input_size"] if layer == 0 else attrs["hidden_size"] * cls.directions(attrs)

    def kernel_param_names(self, attrs) -> tuple:
        """weight_ih and weight_hh of every layer and direction."""
        return tuple(name for layer in range(attrs["num_layers"]) for direction in range(self.directions(attrs))
                     for name in self.param_names(attrs, layer, direction)[:2])

    @classmethod
    def param_names(cls, attrs, layer: int, direction: int) -> tuple:
        """(weight_ih, weight_hh, bias_ih, bias_hh) names of one layer and direction (biases None without bias)."""
        suffix = f"_l{layer}" + ("_reverse" if direction else "")
        biases = (f"bias_ih{suffix}", f"bias_hh{suffix}") if attrs["bias"] else (None, None)
        return (f"weight_ih{suffix}", f"weight_hh{suffix}", *biases)

    def param_shapes(self, attrs, in_shape):
        h, g = attrs["hidden_size"], self.gates
        shapes = {}
        for layer in range(attrs["num_layers"]):
            for direction in range(self.directions(attrs)):
                w_ih, w_hh, b_ih, b_hh = self.param_names(attrs, layer, direction)
                shapes[w_ih] = (g * h, self.layer_input_size(attrs, layer))
                shapes[w_hh] = (g * h, h)
                if attrs["bias"]:
                    shapes[b_ih] = shapes[b_hh] = (g * h,)
        return shapes

    def infer(self, attrs, in_shape):
        features = attrs["hidden_size"] * self.directions(attrs)
        return (features, in_shape[1]) if attrs["return"] == "sequence" else (features,)

    def flops(self, attrs, in_shape, out_shape):
        h, steps, d = attrs["hidden_size"], in_shape[1], self.directions(attrs)
        return sum(2 * self.gates * h * (self.layer_input_size(attrs, layer) + h) * steps * d
                   for layer in range(attrs["num_layers"]))

    def elementwise_ops(self, attrs, in_shape, out_shape):
        per_unit = self.gate_ops + (2 * self.gates if attrs["bias"] else 0)
        return per_unit * attrs["hidden_size"] * in_shape[1] * self.directions(attrs) * attrs["num_layers"]

    def activation_bytes(self, attrs, in_shape, out_shape):
        """The output, and per layer its gate values and hidden (and cell) states at every step."""
        h, steps, d = attrs["hidden_size"], in_shape[1], self.directions(attrs)
        per_layer = steps * d * h * (self.gates + self.states)
        return (math.prod(out_shape) + per_layer * attrs["num_layers"]) * 4

    def forward(self, x, params, attrs, training=False):
        h, d = attrs["hidden_size"], self.directions(attrs)
        seq = np.ascontiguousarray(x.transpose(2, 0, 1))               # [T, N, C]
        steps, n = seq.shape[:2]
        finals = []
        for layer in range(attrs["num_layers"]):
            outputs = np.empty((steps, n, h * d), x.dtype)
            finals = []
            for direction in range(d):
                w_ih, w_hh, b_ih, b_hh = (None if key is None else params[key]
                                          for key in self.param_names(attrs, layer, direction))
                zero = np.zeros(self.gates * h, x.dtype)
                projected = seq @ w_ih.T + (zero if b_ih is None else b_ih)    # [T, N, G*H]: every step at once
                b_hh = zero if b_hh is None else b_hh
                state = [np.zeros((n, h), x.dtype) for _ in range(self.states - 1)]
                hidden = np.zeros((n, h), x.dtype)
                for t in (range(steps - 1, -1, -1) if direction else range(steps)):
                    hidden, state = self.cell(projected[t], hidden @ w_hh.T + b_hh, hidden, state, h)
                    outputs[t, :, direction * h:(direction + 1) * h] = hidden
                finals.append(hidden)
            seq = outputs
        if attrs["return"] == "last":
            return np.concatenate(finals, axis=1)
        return np.ascontiguousarray(seq.transpose(1, 2, 0))

    # ONNX. Export: Transpose [N, C, T] -> [T, N, C], then per layer one LSTM / GRU node (W, R and B as ONNX
    # wants them: gate blocks reordered from PyTorch's order to ONNX's, `onnx_gate_order`), its Y [T, D, N, H]
    # brought to [T, N, D*H] (Squeeze, or Transpose + Reshape when bidirectional); then Transpose back to
    # [N, H*D, T], or for "last" the top node's Y_h [D, N, H] as [N, D*H]. Import: PyTorch's export of the
    # same, the layout between the nodes followed in chain.layout (None: lnn's [N, C, T]; "time_major"
    # [T, N, F]; "directions" an RNN's Y [T, D, N, H]; "directions_last" [T, N, D, H]); consecutive nodes
    # become one layer with num_layers; zero initial states, also when computed from the input's Shape, as
    # PyTorch writes them for a dynamic batch (onnx_import._shape_side). "last" as lnn exports it: the top
    # node's Y_h alone ("last_state" [D, N, H]), Transpose [1, 0, 2] ("last_state_batch"), Reshape [0, -1].
    onnx_type = ""
    onnx_last_state_output = 1      # Y_h [D, N, H]: "return": "last" (lnn's export: Transpose [1, 0, 2], Reshape [0, -1])
    onnx_gate_order: tuple = ()     # ONNX's gate blocks, as indices of PyTorch's (= lnn's) blocks
    onnx_activations: list = []     # the ONNX activations of lnn's cell
    onnx_cell_defaults: dict = {}   # the node's cell-specific attributes: ONNX's defaults (import) ...
    onnx_cell_fields: dict = {}     # ... and what the export writes

    @property
    def onnx_readers(self):
        return {self.onnx_type: "recurrent_from_onnx", "Transpose": "transpose_from_onnx",
                "Squeeze": "squeeze_from_onnx", "Reshape": "reshape_from_onnx"}

    def onnx_gate_blocks(self, array: np.ndarray, hidden: int, to_onnx: bool = True) -> np.ndarray:
        """Reorder the gate blocks (axis 0, H rows each) from PyTorch's order to ONNX's, or (to_onnx=False) back."""
        order = self.onnx_gate_order if to_onnx else tuple(np.argsort(self.onnx_gate_order))
        return np.concatenate([array[k * hidden:(k + 1) * hidden] for k in order])

    def to_onnx(self, graph, node, params):
        attrs = node.attrs
        h, d, name = attrs["hidden_size"], self.directions(attrs), node.name
        graph.add("Transpose", f"{name}/time_major", perm=[2, 0, 1])                 # [N, C, T] -> [T, N, C]
        for layer in range(attrs["num_layers"]):
            w, r, b = [], [], []
            for direction in range(d):
                w_ih, w_hh, b_ih, b_hh = self.param_names(attrs, layer, direction)
                w.append(self.onnx_gate_blocks(params[w_ih], h))
                r.append(self.onnx_gate_blocks(params[w_hh], h))
                if attrs["bias"]:
                    b.append(np.concatenate([self.onnx_gate_blocks(params[b_ih], h),
                                             self.onnx_gate_blocks(params[b_hh], h)]))
            step = f"{name}/l{layer}"
            inputs = [graph.current, graph.constant(f"{step}.W", np.stack(w)), graph.constant(f"{step}.R", np.stack(r))]
            if b:
                inputs.append(graph.constant(f"{step}.B", np.stack(b)))
            _, last_state = graph.add_node(self.onnx_type, step, inputs, [f"{step}/Y", f"{step}/Y_h"], hidden_size=h,
                                           direction="bidirectional" if d == 2 else "forward", **self.onnx_cell_fields)
            last = layer == attrs["num_layers"] - 1
            if last and attrs["return"] == "last":
                graph.current = last_state                                             # [D, N, H]
                graph.add("Transpose", f"{name}/h_n", perm=[1, 0, 2])
                graph.add("Reshape", f"{name}/last", [graph.integers(f"{name}/last.shape", [0, -1])])
                return
            if d == 1:                                                                 # [T, 1, N, H] -> [T, N, H]
                graph.add("Squeeze", f"{step}/steps", [graph.integers(f"{step}/steps.axes", [1])])
            else:                                                                      # [T, 2, N, H] -> [T, N, 2H]
                graph.add("Transpose", f"{step}/directions", perm=[0, 2, 1, 3])
                graph.add("Reshape", f"{step}/steps", [graph.integers(f"{step}/steps.shape", [0, 0, -1])])
        graph.add("Transpose", f"{name}/channels_first", perm=[1, 2, 0])            # [T, N, F] -> [N, F, T]

    def onnx_claims(self, node, chain):
        return node.op != "Reshape" or chain.layout in RECURRENT_RESHAPE_LAYOUTS

    def onnx_check_cell(self, node, attrs: dict) -> None:
        """Refuse the node's cell-specific attributes (onnx_cell_defaults) where they are not lnn's cell."""

    def recurrent_from_onnx(self, node, chain):
        defaults = dict(activation_alpha=None, activation_beta=None, activations=None, clip=None, direction="forward",
                        hidden_size=None, layout=0, **self.onnx_cell_defaults)
        attrs = node.attributes(**defaults)
        if chain.layout != "time_major":
            raise node.error("needs a time-major [T, N, F] input: lnn takes series channel-first [N, C, T], so the "
                             "graph must Transpose (perm [2, 0, 1]) right before it")
        if attrs["layout"] != 0:
            raise node.error("layout=1 (batch first) is not supported")
        if attrs["clip"] is not None or attrs["activation_alpha"] or attrs["activation_beta"]:
            raise node.error("clip and activation parameters are not supported")
        activations, given = self.onnx_activations, attrs["activations"]
        if given is not None and list(given) != activations * (len(given) // len(activations)):
            raise node.error(f"activations {list(given)}: lnn has {node.op} with {activations} only")
        self.onnx_check_cell(node, attrs)
        if attrs["direction"] not in ("forward", "bidirectional"):
            raise node.error(f"direction {attrs['direction']!r} is not supported (forward or bidirectional)")
        names = node.proto.input
        if len(names) > 4 and names[4]:
            raise node.error("sequence_lens is not supported: every series has the graph's length")
        if len(names) > 7 and names[7]:
            raise node.error("peephole weights (P) are not supported")
        for position, what in ((5, "initial_h"), (6, "initial_c"))[:self.states]:
            self._zero_state_from_onnx(node, position, what)
        w, r, b = node.weight(1, "W"), node.weight(2, "R"), node.weight(3, "B", optional=True)
        directions = 2 if attrs["direction"] == "bidirectional" else 1
        gates = self.gates
        hidden = r.shape[-1] if r.ndim == 3 else 0
        if (w.ndim != 3 or r.ndim != 3 or w.shape[0] != directions or r.shape != (directions, gates * hidden, hidden)
                or w.shape[1] != gates * hidden or (b is not None and b.shape != (directions, 2 * gates * hidden))
                or (attrs["hidden_size"] is not None and attrs["hidden_size"] != hidden)):
            raise node.error(f"W {list(w.shape)}, R {list(r.shape)}" + (f", B {list(b.shape)}" if b is not None else "")
                             + f" do not fit {directions} direction(s) of {node.op} with hidden size {hidden}")
        last = chain.last
        merge = (chain.rnn_open and last["type"] == self.name and last["hidden_size"] == hidden
                 and last["bidirectional"] == (directions == 2) and last["bias"] == (b is not None))
        if merge:
            layer_index, params = last["num_layers"], chain.params[-1]
            last["num_layers"] += 1
        else:
            chain.append({"type": self.name, "name": chain.unique_name(names[1], self.name), "hidden_size": hidden,
                          "num_layers": 1, "bidirectional": directions == 2, "bias": b is not None})
            layer_index, params = 0, chain.params[-1]
        for direction in range(directions):
            suffix = f"_l{layer_index}" + ("_reverse" if direction else "")
            params[f"weight_ih{suffix}"] = self.onnx_gate_blocks(w[direction], hidden, to_onnx=False)
            params[f"weight_hh{suffix}"] = self.onnx_gate_blocks(r[direction], hidden, to_onnx=False)
            if b is not None:
                params[f"bias_ih{suffix}"] = self.onnx_gate_blocks(b[direction, :gates * hidden], hidden, to_onnx=False)
                params[f"bias_hh{suffix}"] = self.onnx_gate_blocks(b[direction, gates * hidden:], hidden, to_onnx=False)
        chain.layout, chain.rnn_open = "directions", True
        if node.output == self.onnx_last_state_output:         # Y_h: this is the top layer, giving its last states
            chain.last["return"] = "last"
            chain.layout, chain.rnn_open = "last_state", False

    @staticmethod
    def _zero_state_from_onnx(node, position: int, what: str) -> None:
        names = node.proto.input
        if position >= len(names) or not names[position] or names[position] in node.zeros:
            return
        value = node.const(position, what)
        if np.any(value != 0):
            raise node.error(f"{what} is not zero: lnn's lstm and gru start from zero states")

    def transpose_from_onnx(self, node, chain):
        perm = [int(v) for v in node.attributes(perm=None)["perm"] or []]
        if chain.layout is None and len(node.in_shape) == 2 and perm == [2, 0, 1]:
            chain.layout = "time_major"                     # [N, C, T] -> [T, N, C], for an LSTM / GRU
        elif chain.layout == "directions" and perm == [0, 2, 1, 3]:
            chain.layout = "directions_last"                # Y [T, D, N, H] -> [T, N, D, H]
        elif chain.layout == "time_major" and chain.rnn_open and perm == [1, 2, 0]:
            chain.layout, chain.rnn_open = None, False      # [T, N, D*H] -> lnn's [N, D*H, T]
        elif chain.layout == "last_state" and perm == [1, 0, 2]:
            chain.layout = "last_state_batch"               # Y_h [D, N, H] -> [N, D, H]
        else:
            raise node.error(f"Transpose with perm {perm} is not supported here: lnn takes Transpose only around "
                             "LSTM / GRU nodes of a channel-first [N, C, T] series")

    def squeeze_from_onnx(self, node, chain):
        node.attributes(axes=None)
        axes = node.given.get("axes")
        if axes is None and len(node.proto.input) > 1:
            axes = node.const(1, "axes").reshape(-1).tolist()
        if chain.layout != "directions" or [int(a) for a in axes or []] != [1]:
            raise node.error("Squeeze is supported only as the directions axis (1) of a one-direction LSTM / GRU output")
        if chain.last["bidirectional"]:
            raise node.error("Squeeze of axis 1 of a bidirectional LSTM / GRU output (2 directions)")
        chain.layout = "time_major"

    def reshape_from_onnx(self, node, chain):
        """[T, N, D, H] -> [T, N, D*H]: a bidirectional RNN's output merged back into features; or its last states
        [N, D, H] -> [N, D*H], lnn's "return": "last"."""
        node.attributes(allowzero=0)
        target = [int(v) for v in node.const(1, "shape").reshape(-1)]
        if chain.layout == "last_state_batch":
            features = chain.last["hidden_size"] * self.directions(chain.last)
            if len(target) != 2 or target[0] not in {0, -1, node.batch} - {None} or target[1] not in (-1, features):
                raise node.error(f"Reshape to {target} is not supported after an LSTM / GRU's last states: lnn takes "
                                 f"[0, -1] ([N, {features}])")
            chain.layout = None
            return
        features = chain.last["hidden_size"] * 2
        if len(target) != 3 or target[0] not in (0, chain.shape[-1]) or target[1] not in {0, -1, node.batch} - {None} \
                or target[2] not in (-1, features):
            raise node.error(f"Reshape to {target} is not supported after a bidirectional LSTM / GRU: lnn takes "
                             f"[0, 0, -1] ([T, N, {features}])")
        chain.layout = "time_major"


class LSTM(_Recurrent):
    """PyTorch's nn.LSTM: gates i, f, g, o (in that order in the weights);
    c' = sigmoid(f) * c + sigmoid(i) * tanh(g), h' = sigmoid(o) * tanh(c')."""

    name = "lstm"
    gates, states = 4, 2                 # gate blocks; states kept per step (h and c)
    gate_ops = 3 * 4 + 2 * 4 + 4         # 3 sigmoids, 2 tanh, 3 products and a sum
    onnx_type, onnx_gate_order = "LSTM", (0, 3, 1, 2)        # ONNX: i, o, f, c
    onnx_activations = ["Sigmoid", "Tanh", "Tanh"]
    onnx_cell_defaults = {"input_forget": 0}

    def onnx_check_cell(self, node, attrs):
        if attrs["input_forget"]:
            raise node.error("input_forget=1 (coupled input and forget gates) is not supported")

    @staticmethod
    def cell(xw, hw, hidden, state, h):
        a = xw + hw
        i, f, g, o = _sigmoid(a[:, :h], {}), _sigmoid(a[:, h:2 * h], {}), np.tanh(a[:, 2 * h:3 * h]), _sigmoid(a[:, 3 * h:], {})
        c = f * state[0] + i * g
        return o * np.tanh(c), [c]


class GRU(_Recurrent):
    """PyTorch's nn.GRU: gates r, z, n (in that order in the weights);
    r = sigmoid(W_ir x + b_ir + W_hr h + b_hr), z likewise, n = tanh(W_in x + b_in + r * (W_hn h + b_hn)),
    h' = (1 - z) * n + z * h."""

    name = "gru"
    gates, states = 3, 1
    gate_ops = 2 * 4 + 4 + 5            # 2 sigmoids, a tanh, r * (...) and the blend
    onnx_type, onnx_gate_order = "GRU", (1, 0, 2)            # ONNX: z, r, h
    onnx_activations = ["Sigmoid", "Tanh"]
    onnx_cell_defaults, onnx_cell_fields = {"linear_before_reset": 0}, {"linear_before_reset": 1}   # PyTorch's GRU

    def onnx_check_cell(self, node, attrs):
        if attrs["linear_before_reset"] != 1:
            raise node.error("linear_before_reset=0 is not PyTorch's GRU: lnn computes n = tanh(W_in x + b_in + "
                             "r * (W_hn h + b_hn)), which is linear_before_reset=1")

    @staticmethod
    def cell(xw, hw, hidden, state, h):
        r = _sigmoid(xw[:, :h] + hw[:, :h], {})
        z = _sigmoid(xw[:, h:2 * h] + hw[:, h:2 * h], {})
        n = np.tanh(xw[:, 2 * h:] + r * hw[:, 2 * h:])
        return (1 - z) * n + z * hidden, state


OPS: dict[str, Op] = {op.name: op for op in (
    Linear(), Conv1d(), Conv2d(), MaxPool1d(), AvgPool1d(), MaxPool2d(), AvgPool2d(), GlobalAvgPool(),
    GlobalMaxPool(), Flatten(), BatchNorm(), LayerNorm(), Dropout(), LSTM(), GRU(),
    *(Activation(kind) for kind in ACTIVATIONS),
)}

# Names people write that mean an op above.
ALIASES = {
    "dense": "linear", "conv": "conv2d", "maxpool": "maxpool2d", "avgpool": "avgpool2d",
    "global_avgpool": "global_avg_pool", "globalavgpool": "global_avg_pool",
    "global_maxpool": "global_max_pool", "globalmaxpool": "global_max_pool",
    "batchnorm1d": "batchnorm", "batchnorm2d": "batchnorm", "batch_norm": "batchnorm",
    "layer_norm": "layernorm",
}


def layer_table(backend: str, namespaces) -> dict:
    """A backend's table op name -> layer class, built from the classes in `namespaces` (module dicts) that
    name the ops they run in their own `ops` (a class attribute, not inherited), in the registry's order.
    Each backend's tests check that every op of the registry has a layer there."""
    declared = {}
    for namespace in namespaces:
        for value in list(namespace.values()):
            for op in value.__dict__.get("ops", ()) if isinstance(value, type) else ():
                if declared.setdefault(op, value) is not value:
                    raise ImportError(f"{backend} layers {declared[op].__name__} and {value.__name__} both run {op}")
    unknown = sorted(set(declared) - set(OPS))
    if unknown:
        raise ImportError(f"{backend} layers for ops the registry does not have: {unknown}")
    return {op: declared[op] for op in OPS if op in declared}


def get_op(kind: str) -> Op:
    kind = ALIASES.get(kind, kind)
    if kind not in OPS:
        raise ModelSpecError(f"unknown layer type {kind!r}; known: {', '.join(sorted(OPS))}")
    return OPS[kind]
