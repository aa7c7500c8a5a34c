"""The JSON model description: parsing, checking, shape inference and per-layer cost.

A description looks like
    {"name": "mnist_cnn", "input_shape": [1, 28, 28],
     "layers": [{"type": "conv2d", "out_channels": 32, "kernel_size": 3, "padding": 1, "activation": "relu"},
                {"type": "maxpool2d", "kernel_size": 2}, {"type": "flatten"},
                {"type": "linear", "out_features": 10}],
     "loss": "cross_entropy", "optimizer": {"type": "sgd", "lr": 0.01, "momentum": 0.9},
     "preprocess": {"color": "gray", "scale": 0.00392156862745098, "mean": [0.1307], "std": [0.3081]},
     "labels": ["zero", "one", ...]}

`parse_model` turns it into a `Model`: every layer's attributes completed and checked, input and
output shapes, parameter shapes. `Model.to_description()` gives back the complete, normalized
description; parsing that again gives the same model (the `.bin` stores it as its graph).
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from lnn.formats import limits
from lnn.formats.errors import ModelSpecError, control_character
from lnn.formats.files import read_regular_file
from lnn.formats.limits import MAX_JSON_BYTES, MAX_JSON_DEPTH, refusal
from lnn.formats.ops import REQUIRED, SpecProblem, float32_number, get_op, normalize_activation

TOP_LEVEL_FIELDS = {"name", "description", "input_shape", "layers", "loss", "optimizer", "preprocess",
                    "labels", "training", "model_card"}
LOSSES = ("cross_entropy", "mse")
OPTIMIZERS = {
    "sgd": {"lr": 0.01, "momentum": 0.0, "nesterov": False, "weight_decay": 0.0},
    "adam": {"lr": 0.001, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.0},
    "adamw": {"lr": 0.001, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.01},
}
COLORS = ("rgb", "bgr", "gray")
FLOAT_BYTES = 4


@dataclass
class Node:
    """One layer of a parsed model, with its shapes (per sample, no batch dimension)."""

    index: int
    op: str
    name: str
    attrs: dict
    in_shape: tuple
    out_shape: tuple
    param_shapes: dict

    def param_key(self, param: str) -> str:
        return f"{self.name}.{param}"

    @property
    def flops(self) -> int:
        return get_op(self.op).flops(self.attrs, self.in_shape, self.out_shape)

    @property
    def elementwise_ops(self) -> int:
        return get_op(self.op).elementwise_ops(self.attrs, self.in_shape, self.out_shape)

    @property
    def num_params(self) -> int:
        return sum(math.prod(s) for s in self.param_shapes.values())

    @property
    def activation_bytes(self) -> int:
        """Bytes of this layer's float32 output for one sample (a recurrent layer's: with its gates and
        states at every step; formats/ops.py Op.activation_bytes)."""
        return get_op(self.op).activation_bytes(self.attrs, self.in_shape, self.out_shape)


def as_rows(node: Node) -> Node:
    """A 1-D window node (conv1d, maxpool1d, avgpool1d) as the 2-D node its backends run on [N, C, 1, T] views:
    the attributes of its op's `as_2d`, shapes [C, 1, T]; index, name, op and parameter shapes unchanged."""
    return dataclasses.replace(node, attrs=get_op(node.op).as_2d(node.attrs),
                               in_shape=(node.in_shape[0], 1, *node.in_shape[1:]),
                               out_shape=(node.out_shape[0], 1, *node.out_shape[1:]))


class DefaultLabels(Sequence):
    """The labels of a model whose description names none: {"name": "<i>", "display": "class <i>"}
    for each output, made when asked for, so a model with a million outputs costs no memory for
    them. Compares equal to the list it stands for; `list(labels)` makes that list."""

    def __init__(self, count: int):
        self.count = count

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, index):
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(self.count))]
        position = index + self.count if index < 0 else index
        if not 0 <= position < self.count:
            raise IndexError(f"label {index} of {self.count}")
        return {"name": str(position), "display": f"class {position}"}

    def __eq__(self, other) -> bool:
        if isinstance(other, DefaultLabels):
            return self.count == other.count
        return isinstance(other, list) and len(other) == self.count and all(a == b for a, b in zip(self, other))

    __hash__ = None

    def __repr__(self) -> str:
        return f"DefaultLabels({self.count})"


@dataclass
class Model:
    name: str
    input_shape: tuple
    nodes: list
    preprocess: dict | None
    labels: list
    loss: str
    optimizer: dict
    extra: dict = field(default_factory=dict)   # description, training, model_card: carried as given

    @property
    def takes_images(self) -> bool:
        """An image model ([C, H, W] with image preprocessing); series [C, T] and table [F] models are not."""
        return len(self.input_shape) == 3 and self.preprocess is not None

    @property
    def output_shape(self) -> tuple:
        return self.nodes[-1].out_shape if self.nodes else self.input_shape

    def param_shapes(self) -> dict[str, tuple]:
        """Every parameter key (`<layer name>.<param>`) and its shape, in layer order."""
        return {node.param_key(p): shape for node in self.nodes for p, shape in node.param_shapes.items()}

    @property
    def num_params(self) -> int:
        return sum(node.num_params for node in self.nodes)

    def to_description(self) -> dict:
        """The complete normalized description (every attribute written out)."""
        layers = []
        for node in self.nodes:
            layer = {"type": node.op, "name": node.name}
            for key, value in node.attrs.items():
                layer[key] = list(value) if isinstance(value, tuple) else value
            layers.append(layer)
        out = {"name": self.name, "input_shape": list(self.input_shape), "layers": layers,
               "loss": self.loss, "optimizer": self.optimizer, "labels": list(self.labels)}
        if self.preprocess is not None:
            out["preprocess"] = self.preprocess
        out.update(self.extra)
        return out


def load_description(path: str | Path) -> dict:
    """Read a JSON description file; a missing file, a device or pipe, a file over MAX_JSON_BYTES,
    bad JSON or JSON nested deeper than MAX_JSON_DEPTH becomes a one-line ModelSpecError."""
    path = Path(path)
    raw = read_regular_file(path, "a model description", MAX_JSON_BYTES, "MAX_JSON_BYTES", ModelSpecError)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as err:
        raise ModelSpecError(f"{path}: cannot read the model description ({err})") from None
    return parse_json_text(text, str(path))


def parse_json_text(text: str, what: str):
    """json.loads with lnn's rules: finite numbers only and at most MAX_JSON_DEPTH levels of nesting
    (checked before parsing, so a file nested 100,000 deep is one line, not a RecursionError)."""
    if json_nesting_depth(text.encode("utf-8")) > MAX_JSON_DEPTH:
        raise ModelSpecError(f"{what}: nests deeper than {MAX_JSON_DEPTH} levels "
                             f"(MAX_JSON_DEPTH in lnn/formats/limits.py)")
    try:
        value = loads_json(text)
    except json.JSONDecodeError as err:
        raise ModelSpecError(f"{what}: not valid JSON at line {err.lineno} column {err.colno}: {err.msg}") from None
    except ValueError as err:
        raise ModelSpecError(f"{what}: not valid JSON: {err}") from None
    problem = lone_surrogate(value)
    if problem:
        raise ModelSpecError(f"{what}: not valid text ({problem})")
    return value


JSON_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"')
NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")


def json_nesting_depth(raw: bytes) -> int:
    """How deep arrays and objects nest in JSON text (brackets inside strings not counted), in linear
    time without recursion. For invalid JSON it is a figure the parser will refuse anyway."""
    brackets = np.frombuffer(JSON_STRING.sub(b"", raw).translate(None, NOT_BRACKETS), np.uint8)
    steps = np.where((brackets == ord("[")) | (brackets == ord("{")), np.int8(1), np.int8(-1))
    return int(np.cumsum(steps, dtype=np.int32).max(initial=0))


def loads_json(text: str):
    """json.loads with lnn's rules for numbers: finite, and within a float's range, integers included (lnn computes
    with every number as a float). A JSONDecodeError or a ValueError naming the number; the caller names the file."""
    return json.loads(text, parse_constant=reject_json_constant, parse_float=finite_json_float,
                      parse_int=float_sized_json_int)


def reject_json_constant(name: str):
    """json.loads' parse_constant: NaN, Infinity and -Infinity are not JSON numbers."""
    raise ValueError(f"{name} is not a JSON number; write a finite number")


def lone_surrogate(value) -> str | None:
    """Why parsed JSON is not text ("a lone UTF-16 surrogate \\ud800 in a string"), or None. A `\\u` escape
    can write half of a surrogate pair, but that is no character: UTF-8 cannot encode it, so printing or
    writing the string would fail."""
    try:
        json.dumps(value, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError as err:
        return surrogate_problem(err)
    return None


def surrogate_problem(err: UnicodeEncodeError) -> str:
    """lone_surrogate's words for the UnicodeEncodeError of encoding JSON text as UTF-8 (for a caller that
    encodes it anyway: formats/binfile.py's `_json_bytes`)."""
    return f"a lone UTF-16 surrogate \\u{ord(err.object[err.start]):04x} in a string"


def finite_json_float(text: str) -> float:
    """json.loads' parse_float: a number too large for a float (1e999) is refused, not read as infinity."""
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"number {text} is out of range; write a finite number")
    return value


def float_sized_json_int(text: str) -> int:
    """json.loads' parse_int: JSON integers may have any number of digits, but one beyond a float's range
    (10**400) would fail float() or math.isfinite() with an OverflowError wherever it is checked, so it is
    refused here as 1e999 is. Text longer than -sys.float_info.max written out (310 characters) is beyond it
    without being converted."""
    value = int(text) if len(text) <= 310 else None
    if value is None or abs(value) > sys.float_info.max:
        shown = text if len(text) <= 24 else f"{text[:20]}... ({len(text.lstrip('-'))} digits)"
        raise ValueError(f"integer {shown} is out of range; write a finite number")
    return value


def parse_model(desc: dict, check_sizes: bool = True) -> Model:
    """A description (dict) -> Model, or one-line ModelSpecError. The model must be within the sizes of
    formats/limits.py (`size_refusals`); the `.bin` reader passes check_sizes=False and checks them as
    its own numbered rules."""
    if not isinstance(desc, dict):
        raise ModelSpecError("the model description must be a JSON object")
    unknown = set(desc) - TOP_LEVEL_FIELDS
    if unknown:
        raise ModelSpecError(f"unknown top-level field {sorted(unknown)[0]!r}{_did_you_mean(sorted(unknown)[0], TOP_LEVEL_FIELDS)}; "
                             f"known: {', '.join(sorted(TOP_LEVEL_FIELDS))}")
    name = desc.get("name", "model")
    if not isinstance(name, str) or not name:
        raise ModelSpecError("name must be a non-empty string")
    input_shape = _parse_input_shape(desc.get("input_shape"))
    layers = desc.get("layers")
    if not isinstance(layers, list) or not layers:
        raise ModelSpecError("layers must be a non-empty list of layer objects")

    nodes, shape, names = [], input_shape, set()
    for index, layer in enumerate(layers):
        node = _parse_layer(index, layer, shape)
        if node.name in names:
            raise ModelSpecError(f"layer {index} ({node.op}): name {node.name!r} is used by an earlier layer")
        names.add(node.name)
        nodes.append(node)
        shape = node.out_shape
    if check_sizes:
        problem = next(filter(None, size_refusals(input_shape, nodes)), None)
        if problem:
            raise ModelSpecError(problem)

    extra = {key: desc[key] for key in ("description", "training", "model_card") if key in desc}
    return Model(
        name=name, input_shape=input_shape, nodes=nodes,
        preprocess=_parse_preprocess(desc.get("preprocess"), input_shape),
        labels=_parse_labels(desc.get("labels"), shape),
        loss=_parse_loss(desc.get("loss", "cross_entropy")),
        optimizer=_parse_optimizer(desc.get("optimizer", {"type": "sgd"})),
        extra=extra,
    )


def load_model(path: str | Path) -> Model:
    return parse_model(load_description(path))


def activation_bytes(input_shape: tuple, nodes: list) -> int:
    return math.prod(input_shape) * FLOAT_BYTES + sum(node.activation_bytes for node in nodes)


def size_refusals(input_shape: tuple, nodes: list) -> list:
    """[input, parameters, activations]: each None when within formats/limits.py, else the one-line reason."""
    return [refusal(f"input_shape {list(input_shape)}", math.prod(input_shape), limits.MAX_INPUT_ELEMENTS,
                    "MAX_INPUT_ELEMENTS", " values"),
            refusal("the model's parameter count", sum(node.num_params for node in nodes), limits.MAX_PARAMETERS,
                    "MAX_PARAMETERS"),
            refusal("one sample's activations (the input and every layer's float32 output)",
                    activation_bytes(input_shape, nodes), limits.MAX_ACTIVATION_BYTES, "MAX_ACTIVATION_BYTES",
                    " bytes")]


def _did_you_mean(word: str, known) -> str:
    import difflib        # only for a misspelt field: not on every start
    close = difflib.get_close_matches(word, list(known), n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


def _parse_input_shape(value) -> tuple:
    if (not isinstance(value, list) or not value or len(value) > 4
            or not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in value)):
        raise ModelSpecError(f"input_shape must be a list of 1 to 4 positive integers without the batch, e.g. [3, 128, 128]; got {value!r}")
    return tuple(value)


def _parse_layer(index: int, layer, in_shape: tuple) -> Node:
    if not isinstance(layer, dict) or not isinstance(layer.get("type"), str):
        raise ModelSpecError(f"layer {index}: must be an object with a \"type\" field, got {layer!r}")
    try:
        op = get_op(layer["type"])
    except ModelSpecError as err:
        raise ModelSpecError(f"layer {index}: {err}") from None
    where = f"layer {index} ({op.name})"
    name = layer.get("name", f"{op.name}_{index}")
    if not isinstance(name, str) or not name:
        raise ModelSpecError(f"{where}: name must be a non-empty string")
    given = {k: v for k, v in layer.items() if k not in ("type", "name")}
    unknown = set(given) - set(op.attr_defaults)
    if unknown:
        known = ", ".join(["type", "name", *op.attr_defaults]) if op.attr_defaults else "type, name"
        raise ModelSpecError(f"{where}: unknown field {sorted(unknown)[0]!r}{_did_you_mean(sorted(unknown)[0], op.attr_defaults)}; known: {known}")
    attrs = {}
    for key, default in op.attr_defaults.items():
        if key in given:
            attrs[key] = given[key]
        elif default is REQUIRED:
            raise ModelSpecError(f"{where}: missing required field {key!r}")
        else:
            attrs[key] = default
    try:
        if op.has_activation_field:
            attrs["activation"] = normalize_activation(attrs["activation"])
        attrs = op.normalize(attrs, in_shape)
        out_shape = tuple(op.infer(attrs, in_shape))
        param_shapes = {k: tuple(v) for k, v in op.param_shapes(attrs, in_shape).items()}
    except SpecProblem as problem:
        field_part = f"{problem.field}: " if problem.field and not problem.message.startswith(problem.field) else ""
        raise ModelSpecError(f"{where}: {field_part}{problem.message}") from None
    return Node(index, op.name, name, attrs, tuple(in_shape), out_shape, param_shapes)


def _parse_preprocess(value, input_shape: tuple) -> dict | None:
    if len(input_shape) in (1, 2) and value is not None:
        return _parse_standardize(value, input_shape)
    if len(input_shape) != 3:
        if value is not None:
            raise ModelSpecError(f"preprocess: a model with input_shape {list(input_shape)} takes no preprocessing "
                                 f"(images [C, H, W], series [C, T] and tables [F] do)")
        return None
    value = {} if value is None else value
    if not isinstance(value, dict):
        raise ModelSpecError("preprocess must be an object")
    channels, height, width = input_shape
    known = {"color", "resize", "scale", "mean", "std", "layout"}
    unknown = set(value) - known
    if unknown:
        raise ModelSpecError(f"preprocess: unknown field {sorted(unknown)[0]!r}; known: {', '.join(sorted(known))}")
    if value.get("layout", "NCHW") != "NCHW":
        raise ModelSpecError(f"preprocess: layout must be \"NCHW\", not {value['layout']!r}")
    color = value.get("color", "gray" if channels == 1 else "rgb")
    if color not in COLORS:
        raise ModelSpecError(f"preprocess: color must be one of {', '.join(COLORS)}, not {color!r}")
    if (color == "gray") != (channels == 1):
        raise ModelSpecError(f"preprocess: color {color!r} does not fit {channels} input channel(s)")
    resize = value.get("resize", [height, width])
    if resize != [height, width]:
        raise ModelSpecError(f"preprocess: resize must equal the input size [{height}, {width}], got {resize!r}")
    scale = value.get("scale", 1 / 255)
    if not float32_number(scale, positive=True):
        raise ModelSpecError(f"preprocess: scale must be a positive number that float32 holds, not {scale!r}")
    out = {"color": color, "resize": [height, width], "scale": float(scale), "layout": "NCHW"}
    for key, default in (("mean", 0.0), ("std", 1.0)):
        out[key] = _standardization(key, value.get(key, [default] * channels), channels, "one per channel")
    return out


def _standardization(key: str, numbers, count: int, each: str) -> list:
    """A preprocessing's mean or std (images, series and tables alike): `count` numbers that float32, which the
    model computes in, holds; every std positive in float32 too (1e-320 is 0 there)."""
    if not isinstance(numbers, list) or len(numbers) != count or not all(float32_number(v) for v in numbers):
        raise ModelSpecError(f"preprocess: {key} must be a list of {count} number{'s' if count > 1 else ''} that "
                             f"float32 holds ({each}), got {numbers!r}")
    if key == "std" and not all(float32_number(v, positive=True) for v in numbers):
        raise ModelSpecError(f"preprocess: std values must be positive, in float32 too, got {numbers!r}")
    return [float(v) for v in numbers]


SERIES_PREPROCESS = {"kind": "series", "length": "T", "resample": '"linear" | "pad_mean"', "mean": "[C]", "std": "[C]"}
# How a raw series of another length T' is brought to the model's T (lnn.runtime.series fit_length): "linear"
# resamples it over the same time span; "pad_mean" keeps its time scale, a shorter series padded at its end with
# its own mean per channel (a longer one still resampled). lnn-train picks pad_mean for training series of
# unequal lengths (measured: BENCHMARKS "ucr_unseen").
SERIES_FITS = ("linear", "pad_mean")
TABLE_PREPROCESS = {"kind": "table", "columns": "[F names]", "mean": "[F]", "std": "[F]"}


def _parse_standardize(value, input_shape: tuple) -> dict:
    """The preprocessing of a series model ([C, T]: brought to T along time, then standardized per
    channel) or a table model ([F]: each column standardized); x = (raw - mean) / std. Complete, no defaults:
    it is fitted on the training data (lnn.train.series), never written by hand."""
    series = len(input_shape) == 2
    schema = SERIES_PREPROCESS if series else TABLE_PREPROCESS
    expected = ", ".join(f'"{key}": {shape}' for key, shape in schema.items())
    if not isinstance(value, dict) or set(value) != set(schema) or value.get("kind") != schema["kind"]:
        raise ModelSpecError(f"preprocess: a {schema['kind']} model's preprocessing is {{{expected}}}, got {value!r}")
    count = input_shape[0]
    out = {"kind": schema["kind"]}
    if series:
        if value["length"] != input_shape[1] or isinstance(value["length"], bool):
            raise ModelSpecError(f"preprocess: length must be the input length {input_shape[1]}, not {value['length']!r}")
        if value["resample"] not in SERIES_FITS:
            raise ModelSpecError(f"preprocess: resample must be one of {', '.join(map(repr, SERIES_FITS))}, "
                                 f"not {value['resample']!r}")
        out.update(length=input_shape[1], resample=value["resample"])
    else:
        columns = value["columns"]
        if (not isinstance(columns, list) or len(columns) != count or not all(isinstance(c, str) and c for c in columns)
                or len(set(columns)) != count):
            raise ModelSpecError(f"preprocess: columns must be {count} distinct non-empty names, got {columns!r}")
        out["columns"] = list(columns)
    for key in ("mean", "std"):
        out[key] = _standardization(key, value[key], count, "one per channel" if series else "one per column")
    return out


def _display_name(name: str) -> str:
    return name.replace("_", " ").strip().capitalize()


def _parse_labels(value, output_shape: tuple) -> list:
    classes = output_shape[0] if len(output_shape) == 1 else None
    if value is None:
        return DefaultLabels(classes or 0)
    if not isinstance(value, list):
        raise ModelSpecError("labels must be a list of names or of {\"name\", \"display\", \"advice\"} objects")
    labels = []
    for i, item in enumerate(value):
        if isinstance(item, str):
            item = {"name": item}
        if not isinstance(item, dict) or not isinstance(item.get("name"), str) or not item["name"]:
            raise ModelSpecError(f"labels[{i}]: must be a name or an object with a \"name\" string, got {item!r}")
        unknown = set(item) - {"name", "display", "advice"}
        if unknown:
            raise ModelSpecError(f"labels[{i}]: unknown field {sorted(unknown)[0]!r}; known: name, display, advice")
        label = {"name": item["name"], "display": item.get("display", _display_name(item["name"]))}
        if "advice" in item:
            label["advice"] = item["advice"]
        if not all(isinstance(v, str) for v in label.values()):
            raise ModelSpecError(f"labels[{i}]: display and advice must be strings")
        for key, text in label.items():
            character = control_character(text)
            if character:
                raise ModelSpecError(f"labels[{i}]: the {key} holds a control character ({character}), which would "
                                     f"break or rewrite the lines an answer is printed in")
            problem = lone_surrogate(text)
            if problem:         # a name in another encoding (lnn-train's class folders): no .bin could hold it
                raise ModelSpecError(f"labels[{i}]: the {key} is not UTF-8 text ({problem}: a name written in "
                                     f"another encoding)")
        labels.append(label)
    if classes is not None and len(labels) != classes:
        raise ModelSpecError(f"labels: {len(labels)} given, but the last layer outputs {classes} values")
    if len({label["name"] for label in labels}) != len(labels):
        raise ModelSpecError("labels: names must be unique")
    return labels


def _parse_loss(value) -> str:
    if value not in LOSSES:
        raise ModelSpecError(f"loss must be one of {', '.join(LOSSES)}, not {value!r}")
    return value


def _parse_optimizer(value) -> dict:
    if isinstance(value, str):
        value = {"type": value}
    if not isinstance(value, dict) or not isinstance(value.get("type"), str) or value["type"] not in OPTIMIZERS:
        raise ModelSpecError(f"optimizer must be an object whose type is one of {', '.join(OPTIMIZERS)}, got {value!r}")
    defaults = OPTIMIZERS[value["type"]]
    unknown = set(value) - {"type"} - set(defaults)
    if unknown:
        raise ModelSpecError(f"optimizer ({value['type']}): unknown field {sorted(unknown)[0]!r}; known: {', '.join(defaults)}")
    out = {"type": value["type"]}
    for key, default in defaults.items():
        given = value.get(key, default)
        rule, holds = OPTIMIZER_RULES[key]
        if not holds(given):
            raise ModelSpecError(f"optimizer ({value['type']}): {key} must be {rule}, not {given!r}")
        out[key] = float(given) if isinstance(default, float) else given
    return out


def _decay_rate(value) -> bool:
    return float32_number(value) and 0 <= value < 1


# Each hyper-parameter's rule as (words, test), checked before training starts: the optimizers of lnn/train/optim.py
# take them as they are (betas [] failed at the first step; momentum -5 or betas [5, 5] were trained with).
OPTIMIZER_RULES = {
    "lr": ("a positive number that float32 holds", lambda v: float32_number(v, positive=True)),
    "momentum": ("a number in [0, 1)", _decay_rate),
    "nesterov": ("true or false", lambda v: isinstance(v, bool)),
    "weight_decay": ("a number >= 0 that float32 holds", lambda v: float32_number(v) and v >= 0),
    "betas": ("two numbers in [0, 1), such as [0.9, 0.999]",
              lambda v: isinstance(v, list) and len(v) == 2 and all(_decay_rate(beta) for beta in v)),
    "eps": ("a positive number that float32 holds", lambda v: float32_number(v, positive=True)),
}
