"""The op registry: the one definition of every layer type lnn knows.

Each op states, in one place:
  - its attributes and their defaults (what a JSON layer may carry),
  - its parameter tensors and their shapes,
  - shape inference (per-sample shapes, no batch dimension),
  - its cost: FLOPs (a multiply-add counts 2) and other element-wise operations,
  - a plain NumPy reference forward on batched NCHW / NC arrays.

The reference forward is the semantics every backend must reproduce (the NumPy runtime runs
it as is; the Numba and CUDA backends are checked against it). Conventions follow PyTorch:
conv weight [O, I/groups, KH, KW] (conv1d [O, I/groups, K] on series [N, C, T]), linear weight [out, in] with y = x @ W.T + b, flatten in
(C, H, W) order, batch norm y = (x - mean) / sqrt(var + eps) * weight + bias.

Adding an op means adding one class here, registering it in OPS, and one kernel per backend.
"""

from __future__ import annotations

import math

import numpy as np

from lnn.formats.errors import ModelSpecError


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
        if isinstance(number, bool) or not isinstance(number, (int, float)):
            raise SpecProblem("activation", f"activation {kind}: {key} must be a number, not {number!r}")
        out[key] = float(number)
    return out


def apply_activation(x: np.ndarray, activation: dict | None) -> np.ndarray:
    if activation is None:
        return x
    return ACTIVATIONS[activation["type"]][0](x, activation)


def activation_ops(activation: dict | None) -> int:
    return 0 if activation is None else ACTIVATIONS[activation["type"]][2]


# --------------------------------------------------------------------------- attribute helpers

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

    def normalize(self, attrs: dict, in_shape: tuple) -> dict:
        """Check and complete the attributes against the input shape; return the normalized dict."""
        return dict(attrs)

    def param_shapes(self, attrs: dict, in_shape: tuple) -> dict[str, tuple]:
        return {}

    def buffer_names(self) -> tuple[str, ...]:
        """Parameters that are statistics, not learned (batch norm's running mean/var)."""
        return ()

    def infer(self, attrs: dict, in_shape: tuple) -> tuple:
        return tuple(in_shape)

    def flops(self, attrs: dict, in_shape: tuple, out_shape: tuple) -> int:
        """Multiply-add FLOPs per sample (a multiply-add counts 2)."""
        return 0

    def elementwise_ops(self, attrs: dict, in_shape: tuple, out_shape: tuple) -> int:
        """Other operations per sample (bias adds, activations, comparisons)."""
        return 0

    def forward(self, x: np.ndarray, params: dict, attrs: dict, training: bool = False) -> np.ndarray:
        raise NotImplementedError

    two_d = ""                     # a 1-D window op over [C, T]: the 2-D op it is on [C, 1, T] ...

    def as_2d(self, attrs: dict) -> dict:
        """... with these attributes (model.as_rows makes the whole 2-D node)."""
        raise NotImplementedError


REQUIRED = object()


class Linear(Op):
    name = "linear"
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


class Conv2d(Op):
    name = "conv2d"
    attr_defaults = {"out_channels": REQUIRED, "kernel_size": REQUIRED, "in_channels": None, "stride": 1,
                     "padding": 0, "dilation": 1, "groups": 1, "bias": True, "activation": None,
                     "algorithm": "auto"}
    has_activation_field = True
    algorithms = ("auto", "im2col", "winograd")

    def normalize(self, attrs, in_shape):
        _require_rank(in_shape, (3,), "a [C, H, W]")
        out = dict(attrs)
        cin = in_shape[0]
        if attrs["in_channels"] is not None and attrs["in_channels"] != cin:
            raise SpecProblem("in_channels", f"in_channels is {cin} from the previous layer, not {attrs['in_channels']}")
        out["in_channels"] = cin
        out["out_channels"] = _positive_int("out_channels", attrs["out_channels"])
        out["kernel_size"] = _pair("kernel_size", attrs["kernel_size"], 1)
        out["stride"] = _pair("stride", attrs["stride"], 1)
        out["padding"] = _pair("padding", attrs["padding"], 0)
        out["dilation"] = _pair("dilation", attrs["dilation"], 1)
        groups = _positive_int("groups", attrs["groups"])
        if cin % groups or out["out_channels"] % groups:
            raise SpecProblem("groups", f"groups {groups} must divide in_channels {cin} and out_channels {out['out_channels']}")
        out["groups"] = groups
        out["bias"] = _flag("bias", attrs["bias"])
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
    attr_defaults = {"out_channels": REQUIRED, "kernel_size": REQUIRED, "in_channels": None, "stride": 1,
                     "padding": 0, "dilation": 1, "groups": 1, "bias": True, "activation": None}
    has_activation_field = True

    def normalize(self, attrs, in_shape):
        _require_rank(in_shape, (2,), "a [C, T]")
        out = dict(attrs)
        cin = in_shape[0]
        if attrs["in_channels"] is not None and attrs["in_channels"] != cin:
            raise SpecProblem("in_channels", f"in_channels is {cin} from the previous layer, not {attrs['in_channels']}")
        out["in_channels"] = cin
        out["out_channels"] = _positive_int("out_channels", attrs["out_channels"])
        for key in ("kernel_size", "stride", "dilation"):
            out[key] = _positive_int(key, attrs[key])
        out["padding"] = _padding_1d(attrs["padding"], out["kernel_size"], out["stride"], out["dilation"])
        groups = _positive_int("groups", attrs["groups"])
        if cin % groups or out["out_channels"] % groups:
            raise SpecProblem("groups", f"groups {groups} must divide in_channels {cin} and out_channels {out['out_channels']}")
        out["groups"] = groups
        out["bias"] = _flag("bias", attrs["bias"])
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
        return OPS["conv2d"].flops(conv1d_as_conv2d(attrs), (in_shape[0], 1, in_shape[1]), (out_shape[0], 1, out_shape[1]))

    def elementwise_ops(self, attrs, in_shape, out_shape):
        return OPS["conv2d"].elementwise_ops(conv1d_as_conv2d(attrs), (in_shape[0], 1, in_shape[1]),
                                             (out_shape[0], 1, out_shape[1]))

    def as_2d(self, attrs):
        return conv1d_as_conv2d(attrs)

    def forward(self, x, params, attrs, training=False):
        x = np.pad(x, ((0, 0), (0, 0), attrs["padding"]))
        rows = {key: value[:, :, None] if key == "weight" else value for key, value in params.items()}
        return OPS["conv2d"].forward(x[:, :, None], rows, conv1d_as_conv2d(attrs, (0, 0)))[:, :, 0]


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


class MaxPool2d(_Pool2d):
    name = "maxpool2d"

    def elementwise_ops(self, attrs, in_shape, out_shape):
        return math.prod(out_shape) * (math.prod(attrs["kernel_size"]) - 1)

    def forward(self, x, params, attrs, training=False):
        x = _pad_nchw(x, *attrs["padding"], -np.inf)
        return _windows(x, attrs["kernel_size"], attrs["stride"], (1, 1)).max(axis=(4, 5))


class AvgPool2d(_Pool2d):
    """Average pooling; padded cells count as zeros (PyTorch's count_include_pad=True default)."""

    name = "avgpool2d"
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
        return OPS[self.two_d].elementwise_ops(pool1d_as_2d(attrs), (in_shape[0], 1, in_shape[1]),
                                               (out_shape[0], 1, out_shape[1]))

    def as_2d(self, attrs):
        return pool1d_as_2d(attrs)

    def forward(self, x, params, attrs, training=False):
        return OPS[self.two_d].forward(x[:, :, None], params, pool1d_as_2d(attrs))[:, :, 0]


class MaxPool1d(_Pool1d):
    name = "maxpool1d"
    two_d = "maxpool2d"


class AvgPool1d(_Pool1d):
    """Average pooling over T; padded cells count as zeros unless count_include_pad is false (PyTorch's)."""

    name = "avgpool1d"
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


class GlobalAvgPool(_GlobalPool):
    """Mean over T (or H and W)."""

    name = "global_avg_pool"
    reduce = "mean"


class GlobalMaxPool(_GlobalPool):
    """Maximum over T (or H and W) (PyTorch AdaptiveMaxPool1d(1) / 2d(1), ONNX GlobalMaxPool)."""

    name = "global_max_pool"
    reduce = "max"


class Flatten(Op):
    name = "flatten"
    trainable = False

    def infer(self, attrs, in_shape):
        return (math.prod(in_shape),)

    def forward(self, x, params, attrs, training=False):
        return x.reshape(x.shape[0], -1)


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
        if isinstance(attrs["eps"], bool) or not isinstance(attrs["eps"], (int, float)) or attrs["eps"] <= 0:
            raise SpecProblem("eps", f"eps must be a positive number, not {attrs['eps']!r}")
        out["eps"] = float(attrs["eps"])
        out["momentum"] = _probability("momentum", attrs["momentum"])
        return out

    def param_shapes(self, attrs, in_shape):
        c = (attrs["num_features"],)
        return {"weight": c, "bias": c, "running_mean": c, "running_var": c}

    def buffer_names(self):
        return ("running_mean", "running_var")

    def elementwise_ops(self, attrs, in_shape, out_shape):
        return math.prod(out_shape) * (2 + activation_ops(attrs["activation"]))

    def forward(self, x, params, attrs, training=False):
        shape = (1, -1) + (1,) * (x.ndim - 2)
        scale = params["weight"] / np.sqrt(params["running_var"] + attrs["eps"])
        shift = params["bias"] - params["running_mean"] * scale
        y = x * scale.reshape(shape).astype(x.dtype) + shift.reshape(shape).astype(x.dtype)
        return apply_activation(y, attrs["activation"])


class Dropout(Op):
    """Identity at inference; the trainer implements the training-time mask."""

    name = "dropout"
    attr_defaults = {"p": 0.5}
    trainable = False

    def normalize(self, attrs, in_shape):
        return {"p": _probability("p", attrs["p"])}

    def forward(self, x, params, attrs, training=False):
        return x


class Activation(Op):
    """A stand-alone activation layer: {"type": "relu"}, {"type": "leaky_relu", "negative_slope": 0.2}."""

    trainable = False

    def __init__(self, kind: str):
        self.name = kind
        self.attr_defaults = dict(ACTIVATIONS[kind][1])

    def normalize(self, attrs, in_shape):
        if self.name == "softmax" and len(in_shape) != 1:
            raise SpecProblem(None, f"softmax needs a flat [K] input, got shape {list(in_shape)}")
        return normalize_activation({"type": self.name, **attrs})

    def elementwise_ops(self, attrs, in_shape, out_shape):
        return math.prod(out_shape) * activation_ops(attrs)

    def forward(self, x, params, attrs, training=False):
        return apply_activation(x, attrs)


OPS: dict[str, Op] = {op.name: op for op in (
    Linear(), Conv1d(), Conv2d(), MaxPool1d(), AvgPool1d(), MaxPool2d(), AvgPool2d(), GlobalAvgPool(),
    GlobalMaxPool(), Flatten(), BatchNorm(), Dropout(),
    *(Activation(kind) for kind in ACTIVATIONS),
)}

# Names people write that mean an op above.
ALIASES = {
    "dense": "linear", "conv": "conv2d", "maxpool": "maxpool2d", "avgpool": "avgpool2d",
    "global_avgpool": "global_avg_pool", "globalavgpool": "global_avg_pool",
    "global_maxpool": "global_max_pool", "globalmaxpool": "global_max_pool",
    "batchnorm1d": "batchnorm", "batchnorm2d": "batchnorm", "batch_norm": "batchnorm",
}


def get_op(kind: str) -> Op:
    kind = ALIASES.get(kind, kind)
    if kind not in OPS:
        raise ModelSpecError(f"unknown layer type {kind!r}; known: {', '.join(sorted(OPS))}")
    return OPS[kind]
