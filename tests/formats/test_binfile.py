"""The .bin v1 format: every numbered validation rule of formats/SPEC.md has a crafted bad file here.

The files are crafted by a small writer in this test (`build` / `join`), written from SPEC.md's byte
tables and independent of formats/binfile.py's writer: a conformance test checks that both produce
the same bytes for a good file. A crafted bad file breaks exactly one rule and has its CRCs
recomputed, so the rule's own check (not a checksum) must fire, with a message naming the problem.
"""

import json
import re
import struct
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from conftest import EXAMPLES, REPO
from lnn.formats import binfile, limits
from lnn.formats.binfile import (BinModel, build_metadata, encode_bin, fp16_dtypes, graph_of, int8_dtypes,
                                 parse_bin_bytes, read_bin, write_bin)
from lnn.formats.errors import LnnFormatError, LnnInputError, ModelSpecError
from lnn.tests.model_weights import random_weights
from lnn.formats.model import load_model, parse_model

# --------------------------------------------------------------------------- SPEC.md's byte tables, restated

HEADER_FIELDS = ("magic", "major", "minor", "header_size", "flags_required", "flags_optional", "endian",
                 "alignment", "tensor_count", "tensor_entry_size", "graph_offset", "graph_size", "meta_offset",
                 "meta_size", "table_offset", "string_offset", "string_size", "data_offset", "data_size",
                 "file_size", "body_crc", "header_crc")
HEADER = struct.Struct("<8s HH I I I I I I I QQ QQ Q QQ QQ Q I I".replace(" ", ""))
ENTRY_FIELDS = ("name_offset", "name_length", "dtype", "quant", "ndim", "reserved8", "shape", "offset", "nbytes",
                "reserved64")
ENTRY = struct.Struct("<Q I B B B B 6I Q Q Q".replace(" ", ""))
MAGIC = b"\x89LNN\r\n\x1a\n"
FLOAT32, FLOAT16, INT8 = 1, 2, 3
CODES = {np.dtype("float32"): FLOAT32, np.dtype("float16"): FLOAT16, np.dtype("int8"): INT8}
FLAG_FP16, FLAG_INT8 = 1, 2


def canonical(value) -> bytes:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode("utf-8")


def align(n: int, alignment: int) -> int:
    return -(-n // alignment) * alignment


@dataclass
class Tensor:
    name: bytes
    code: int
    shape: tuple
    raw: bytes


@dataclass
class Parts:
    """A .bin taken apart: every header and entry field is free to be set to a bad value."""

    header: dict
    header_extra: bytes
    entries: list
    entry_extras: list
    strings: bytes
    graph: bytes
    meta: bytes
    padding: bytes
    data: bytes


def build(graph: bytes, meta: bytes, tensors: list, alignment=64, header_size=128, entry_size=64) -> Parts:
    """A consistent layout for these sections (header, table, strings, graph, metadata, padding, data)."""
    strings = b"".join(t.name for t in tensors)
    string_offset = header_size + entry_size * len(tensors)
    graph_offset = string_offset + len(strings)
    meta_offset = graph_offset + len(graph)
    data_offset = align(meta_offset + len(meta), alignment)
    entries, data, name_offset = [], b"", 0
    for t in tensors:
        entries.append(dict(name_offset=name_offset, name_length=len(t.name), dtype=t.code,
                            quant=int(t.code == INT8), ndim=len(t.shape),
                            reserved8=0, shape=list(t.shape) + [0] * (6 - len(t.shape)), offset=len(data),
                            nbytes=len(t.raw), reserved64=0))
        data += t.raw + bytes(align(len(t.raw), alignment) - len(t.raw))
        name_offset += len(t.name)
    header = dict(magic=MAGIC, major=1, minor=0, header_size=header_size,
                  flags_required=(FLAG_FP16 * any(t.code == FLOAT16 for t in tensors)
                                  | FLAG_INT8 * any(t.code == INT8 for t in tensors)),
                  flags_optional=0, endian=0x01020304,
                  alignment=alignment, tensor_count=len(tensors), tensor_entry_size=entry_size,
                  graph_offset=graph_offset, graph_size=len(graph), meta_offset=meta_offset, meta_size=len(meta),
                  table_offset=header_size, string_offset=string_offset, string_size=len(strings),
                  data_offset=data_offset, data_size=len(data), file_size=data_offset + len(data),
                  body_crc=0, header_crc=0)
    return Parts(header, bytes(header_size - 128), entries, [bytes(entry_size - 64)] * len(tensors), strings,
                 graph, meta, bytes(data_offset - meta_offset - len(meta)), data)


def pack_entry(entry: dict) -> bytes:
    values = []
    for name in ENTRY_FIELDS:
        values.extend(entry[name] if name == "shape" else [entry[name]])
    return ENTRY.pack(*values)


def join(parts: Parts, fix_crcs: bool = True) -> bytes:
    """The file's bytes; with fix_crcs both checksums are recomputed as SPEC.md defines them."""
    body = (b"".join(pack_entry(e) + extra for e, extra in zip(parts.entries, parts.entry_extras))
            + parts.strings + parts.graph + parts.meta + parts.padding + parts.data)
    header = dict(parts.header)
    if fix_crcs:
        header["body_crc"] = zlib.crc32(body)
        header["header_crc"] = 0
        header["header_crc"] = zlib.crc32(HEADER.pack(*header.values()) + parts.header_extra)
    return HEADER.pack(*header.values()) + parts.header_extra + body


def refresh_crcs(data) -> bytes:
    """Recompute both CRCs of a patched file in place of its own (header_size as the file says)."""
    data = bytearray(data)
    header_size = struct.unpack_from("<I", data, 12)[0]
    struct.pack_into("<I", data, 120, zlib.crc32(data[header_size:]))
    struct.pack_into("<I", data, 124, 0)
    struct.pack_into("<I", data, 124, zlib.crc32(data[:header_size]))
    return bytes(data)


# --------------------------------------------------------------------------- a small model with every kind of tensor

TINY = {"name": "tiny", "input_shape": [3, 6, 6], "layers": [
    {"type": "conv2d", "name": "conv", "out_channels": 4, "kernel_size": 3, "padding": 1},
    {"type": "batchnorm", "name": "bn", "activation": "relu"},
    {"type": "maxpool2d", "kernel_size": 2},
    {"type": "flatten"},
    {"type": "linear", "name": "fc", "out_features": 3}],
    "labels": ["healthy", "early_blight", {"name": "mold", "display": "Leaf mold", "advice": "Ventilate."}]}


@pytest.fixture(scope="module")
def tiny():
    model = parse_model(TINY)
    return model, random_weights(model)


def tiny_tensors(model, weights, dtypes=None) -> list:
    dtypes = dtypes or {}
    out = []
    for key in model.param_shapes():
        array = weights[key].astype(dtypes.get(key, "float32"))
        out.append(Tensor(key.encode(), CODES[array.dtype], array.shape, array.astype(array.dtype.newbyteorder("<")).tobytes()))
    return out


def int8_tensors(model, weights) -> list:
    """The tiny model's tensors with conv.weight and fc.weight as int8, each followed by its scales
    (SPEC.md's formula restated: scale = max|row| / 127, q = round(w / scale)). Indices: 0 conv.weight,
    1 conv.weight.scale, 2 conv.bias, 3-6 bn, 7 fc.weight, 8 fc.weight.scale, 9 fc.bias."""
    out = []
    for t in tiny_tensors(model, weights):
        if t.name in (b"conv.weight", b"fc.weight"):
            rows = weights[t.name.decode()].reshape(t.shape[0], -1)
            scale = (np.abs(rows).max(axis=1) / np.float32(127)).astype("<f4")
            q = np.clip(np.rint(rows / scale[:, None]), -127, 127).astype("i1")
            out += [Tensor(t.name, INT8, t.shape, q.tobytes()),
                    Tensor(t.name + b".scale", FLOAT32, (t.shape[0],), scale.tobytes())]
        else:
            out.append(t)
    return out


def tiny_parts(model, weights, graph=None, meta=None, tensors=None, **layout) -> Parts:
    graph = canonical(graph_of(model)) if graph is None else graph
    meta = canonical(build_metadata(model)) if meta is None else meta
    return build(graph, meta, tiny_tensors(model, weights) if tensors is None else tensors, **layout)


def refused(data: bytes, pattern: str) -> str:
    with pytest.raises(LnnFormatError) as info:
        parse_bin_bytes(data, "crafted.bin")
    message = str(info.value)
    assert "\n" not in message
    assert re.search(pattern, message), f"{pattern!r} not in {message!r}"
    return message


# --------------------------------------------------------------------------- conformance of the writer

def test_writer_matches_the_spec_layout(tiny):
    model, weights = tiny
    assert encode_bin(model, weights, build_metadata(model)) == join(tiny_parts(model, weights))


def test_fp16_writer_matches_the_spec_layout(tiny):
    model, weights = tiny
    dtypes = fp16_dtypes(model)
    parts = build(canonical(graph_of(model)), canonical(build_metadata(model)), tiny_tensors(model, weights, dtypes))
    assert parts.header["flags_required"] == 1
    assert encode_bin(model, weights, build_metadata(model), dtypes) == join(parts)


def test_int8_writer_matches_the_spec_layout(tiny):
    model, weights = tiny
    parts = tiny_parts(model, weights, tensors=int8_tensors(model, weights))
    assert parts.header["flags_required"] == FLAG_INT8
    assert encode_bin(model, weights, build_metadata(model), int8_dtypes(model)) == join(parts)


def test_crafted_good_file_loads(tiny):
    model, weights = tiny
    loaded = parse_bin_bytes(join(tiny_parts(model, weights)))
    assert list(loaded.tensors) == list(model.param_shapes())


# --------------------------------------------------------------------------- one crafted file per SPEC rule

def set_header(**fields):
    def patch(parts):
        parts.header.update(fields)
    return patch


def set_entry(index, **fields):
    def patch(parts):
        parts.entries[index].update(fields)
    return patch


def with_graph(change):
    """Re-layout the tiny model's file with its graph JSON changed by `change(graph_dict)` (or replaced by bytes)."""
    def make(model, weights):
        graph = graph_of(model)
        new = change(json.loads(canonical(graph)))
        return tiny_parts(model, weights, graph=new if isinstance(new, bytes) else canonical(new))
    return make


def with_meta(change):
    def make(model, weights):
        new = change(json.loads(canonical(build_metadata(model))))
        return tiny_parts(model, weights, meta=new if isinstance(new, bytes) else canonical(new))
    return make


def with_tensors(change):
    def make(model, weights):
        tensors = tiny_tensors(model, weights)
        change(tensors)
        return tiny_parts(model, weights, tensors=tensors)
    return make


def patched(*patches, make=None):
    """A case: start from the tiny model's good parts (or `make`'s), apply the patches, fix the CRCs."""
    def craft(model, weights):
        parts = make(model, weights) if make else tiny_parts(model, weights)
        for patch in patches:
            patch(parts)
        return join(parts)
    return craft


def nonzero_padding(parts):
    assert parts.padding, "the tiny model's metadata must not end on the alignment"
    parts.padding = parts.padding[:-1] + b"\x01"


def nonzero_tensor_padding(parts):
    bias = parts.entries[1]                        # conv.bias: 16 bytes of data, 48 of padding
    end = bias["offset"] + bias["nbytes"]
    parts.data = parts.data[:end] + b"\x01" + parts.data[end + 1:]


def extra_string_byte(parts):
    parts.strings += b"x"
    for key in ("graph_offset", "meta_offset"):
        parts.header[key] += 1
    parts.header["string_size"] += 1
    parts.padding = parts.padding[:-1]


def extra_data_block(parts):
    parts.data += bytes(64)
    parts.header["data_size"] += 64
    parts.header["file_size"] += 64


def deep(levels):
    return lambda graph: b'{"a":' + b"[" * levels + b"]" * levels + b"}"


def swap_first_tensors(tensors):
    tensors[0], tensors[1] = tensors[1], tensors[0]


def set_fp16_flag(parts):
    parts.header["flags_required"] |= 1


def fp16_without_flag(model, weights):
    parts = build(canonical(graph_of(model)), canonical(build_metadata(model)),
                  tiny_tensors(model, weights, fp16_dtypes(model)))
    parts.header["flags_required"] = 0
    return parts


def nan_in_tensor(tensors):
    tensors[0].raw = np.float32("nan").tobytes() + tensors[0].raw[4:]


def fp16_infinity_in_fc_weight(tensors):
    fc_weight = tensors[6]
    fc_weight.code = FLOAT16
    fc_weight.raw = np.full(fc_weight.shape, np.inf, "<f2").tobytes()


def with_int8_tensors(change=lambda tensors: None):
    """The tiny model with int8 conv and fc weights (see int8_tensors), its tensor list changed by `change`."""
    def make(model, weights):
        tensors = int8_tensors(model, weights)
        change(tensors)
        return tiny_parts(model, weights, tensors=tensors)
    return make


def set_tensor(index, **fields):
    return lambda tensors: [setattr(tensors[index], key, value) for key, value in fields.items()]


def int8_bias(tensors):
    """conv.bias as int8 (with a conv.bias.scale after it): a 1-D int8 tensor."""
    tensors[2:3] = [Tensor(b"conv.bias", INT8, (4,), bytes(4)),
                    Tensor(b"conv.bias.scale", FLOAT32, (4,), np.ones(4, "<f4").tobytes())]


def drop_field(key):
    def change(value):
        del value[key]
        return value
    return change


def set_key(path, value):
    def change(obj):
        target = obj
        for step in path[:-1]:
            target = target[step]
        target[path[-1]] = value
        return obj
    return change


def oversized(description):
    """A file for a model over a size limit of formats/limits.py, written by this test's own writer (lnn's
    refuses such a model), with small weights: the graph declares the size, the tensors stay tiny."""
    def craft(_model, _weights):
        model = parse_model(description, check_sizes=False)
        tensors = tiny_tensors(model, random_weights(model))
        return join(build(canonical(graph_of(model)), canonical(build_metadata(model)), tensors))
    return craft


HUGE_INPUT = {"name": "huge_input", "input_shape": [3, 50000, 50000], "layers": [
    {"type": "conv2d", "out_channels": 2, "kernel_size": 1}, {"type": "global_avg_pool"}]}
HUGE_ACTIVATIONS = {"name": "huge_activations", "input_shape": [1, 1, 1], "layers": [
    {"type": "conv2d", "out_channels": 1, "kernel_size": 1, "padding": 20000}]}     # out [1, 40001, 40001]


@dataclass
class UnderLimit:
    """A case run with formats/limits.py's `name` lowered to `value` (a file over the real limit is too big to craft)."""

    name: str
    value: int
    craft: object


# rule number -> [(case id, craft(model, weights) -> bytes, message pattern)]
RULE_CASES = {
    3: [("magic", patched(set_header(magic=b"\x89LNX\r\n\x1a\n")), r"not an lnn model file: wrong magic")],
    4: [("endian", patched(set_header(endian=0x04030201)), r"endian tag is 0x04030201")],
    5: [("newer major", patched(set_header(major=2)), r"version 2\.0 is newer .* upgrade lnn"),
        ("major 0", patched(set_header(major=0)), r"version 0\.0 is not a version lnn ever wrote")],
    6: [("header_size 120", patched(set_header(header_size=120)), r"header_size 120 is invalid"),
        ("header_size 132", patched(set_header(header_size=132)), r"header_size 132 is invalid"),
        ("header_size past end", patched(set_header(header_size=1 << 30)), r"header_size 1073741824 is invalid")],
    7: [("header crc", lambda m, w: join(tiny_parts(m, w), fix_crcs=False), r"header checksum mismatch")],
    8: [("file_size", patched(set_header(file_size=999)), r"header says the file is 999 bytes but it is \d+")],
    9: [("body crc", lambda m, w: join(tiny_parts(m, w))[:-1] + b"\x07", r"data checksum mismatch")],
    10: [("unknown required bit", patched(set_header(flags_required=1 << 7)),
          r"requires features this lnn does not know \(flags_required bits 0x80\)")],
    11: [("alignment 48", patched(set_header(alignment=48)), r"alignment 48 is not a power of two"),
         ("alignment 4", patched(set_header(alignment=4)), r"alignment 4 is not a power of two between 8")],
    12: [("entry size 56", patched(set_header(tensor_entry_size=56)), r"tensor_entry_size 56 is invalid"),
         ("entry size 68", patched(set_header(tensor_entry_size=68)), r"tensor_entry_size 68 is invalid")],
    13: [("tensor count", patched(set_header(tensor_count=65537)), r"tensor_count 65537 is over the limit of 65536")],
    14: [("table offset", patched(set_header(table_offset=136)), r"tensor table starts at offset 136, expected 128"),
         ("string offset", patched(lambda p: p.header.update(string_offset=p.header["string_offset"] + 1)),
          r"string table starts at offset \d+, expected \d+"),
         ("meta offset", patched(lambda p: p.header.update(meta_offset=p.header["meta_offset"] - 1)),
          r"metadata JSON starts at offset \d+, expected \d+")],
    15: [("metadata past end", patched(set_header(meta_size=1 << 40)), r"metadata JSON \(1099511627776 bytes .* runs past the end"),
         ("table past end", patched(set_header(tensor_count=60000)), r"tensor table \(3840000 bytes at offset 128\) runs past the end")],
    16: [("data offset", patched(lambda p: p.header.update(data_offset=p.header["data_offset"] + 64)),
          r"data section starts at \d+, expected \d+ \(after the metadata, aligned to 64\)")],
    17: [("padding", patched(nonzero_padding), r"padding before the data section is not zero")],
    18: [("data size", patched(lambda p: p.header.update(data_size=p.header["data_size"] - 64)),
          r"data section is \d+ bytes, but \d+ bytes follow its start")],
    19: [("json cap", "json-cap", r"graph JSON is \d+ bytes, over the limit of 100")],
    20: [("not json", patched(make=with_graph(lambda g: b"{layers")), r"graph JSON is not valid UTF-8 JSON"),
         ("not utf-8", patched(make=with_meta(lambda m: b'{"a":"\xff"}')), r"metadata JSON is not valid UTF-8 JSON"),
         ("NaN", patched(make=with_meta(lambda m: b'{"a":NaN}')), r"metadata JSON is not valid .*NaN is not a JSON number"),
         ("overflow", patched(make=with_meta(lambda m: b'{"a":1e999}')), r"metadata JSON is not valid .*out of range"),
         ("integer overflow", patched(make=with_meta(lambda m: m["preprocess"].update(scale=10 ** 400) or m)),
          r"metadata JSON is not valid UTF-8 JSON \(integer 10000000000000000000\.\.\. \(401 digits\) is out of range"),
         ("lone surrogate", patched(make=with_meta(lambda m: canonical(m)[:-1] + b',"zz":"\\ud800"}')),
          r"metadata JSON is not valid UTF-8 JSON \(a lone UTF-16 surrogate \\ud800 in a string\)$")],
    21: [("depth 65", patched(make=with_graph(deep(65))), r"graph JSON nests deeper than 64 levels"),
         ("depth 100000", patched(make=with_graph(deep(100000))), r"graph JSON nests deeper than 64 levels")],
    22: [("array", patched(make=with_meta(lambda m: b"[1,2]")), r"metadata JSON must be a JSON object, not list")],
    23: [("indented", patched(make=with_graph(lambda g: json.dumps(g, indent=1, sort_keys=True).encode())),
          r"graph JSON is not in canonical form"),
         ("unsorted", patched(make=with_meta(lambda m: json.dumps(dict(reversed(m.items())), separators=(",", ":")).encode())),
          r"metadata JSON is not in canonical form"),
         ("duplicate key", patched(make=with_meta(lambda m: b'{"a":1,"a":1}')), r"metadata JSON is not in canonical form"),
         ("escaped", patched(make=with_meta(lambda m: canonical(m)[:-1] + b',"zz":"\\u00e9"}')),
          r"metadata JSON is not in canonical form")],
    24: [("name offset", patched(set_entry(1, name_offset=1)), r"tensor 1: name at 1 \(\+9 bytes\) is not the next name"),
         ("empty name", patched(set_entry(0, name_length=0)), r"tensor 0: name at 0 \(\+0 bytes\)"),
         ("long name", patched(set_entry(0, name_length=5000)), r"tensor 0: name at 0 \(\+5000 bytes\)")],
    25: [("name utf-8", patched(lambda p: setattr(p, "strings", b"\xff" + p.strings[1:])), r"tensor 0: name is not valid UTF-8")],
    26: [("duplicate name", patched(make=with_tensors(lambda t: setattr(t[1], "name", t[0].name))),
          r"tensor 1 \(conv.weight\): the name appears twice")],
    27: [("dtype 4", patched(set_entry(0, dtype=4)), r"tensor 0 \(conv.weight\): unknown dtype code 4")],
    28: [("quant 2", patched(set_entry(0, quant=2)), r"tensor 0 \(conv.weight\): unknown quantization code 2")],
    29: [("reserved byte", patched(set_entry(2, reserved8=1)), r"tensor 2 \(bn.weight\): reserved fields are not zero"),
         ("reserved u64", patched(set_entry(2, reserved64=1)), r"tensor 2 \(bn.weight\): reserved fields are not zero"),
         ("entry tail", patched(lambda p: p.entry_extras.__setitem__(3, b"\0" * 7 + b"\1"),
                                make=lambda m, w: tiny_parts(m, w, entry_size=72)),
          r"tensor 3 \(bn.bias\): reserved fields are not zero")],
    30: [("ndim 0", patched(set_entry(1, ndim=0, shape=[0] * 6)), r"tensor 1 \(conv.bias\): 0 dimensions; a tensor has 1 to 6"),
         ("ndim 7", patched(set_entry(1, ndim=7)), r"tensor 1 \(conv.bias\): 7 dimensions")],
    31: [("slot past ndim", patched(set_entry(1, shape=[4, 1, 0, 0, 0, 0])), r"tensor 1 \(conv.bias\): shape slots \[4, 1, 0, 0, 0, 0\] do not match ndim 1"),
         ("zero dim", patched(set_entry(0, shape=[4, 3, 0, 3, 0, 0])), r"tensor 0 \(conv.weight\): shape slots")],
    32: [("elements", patched(set_entry(0, ndim=3, shape=[65536, 65536, 2, 0, 0, 0])),
          r"tensor 0 \(conv.weight\): 8589934592 elements, over the limit of 2147483648")],
    33: [("nbytes", patched(set_entry(1, nbytes=20)), r"tensor 1 \(conv.bias\): 20 bytes do not match shape \[4\] of float32")],
    34: [("offset", patched(lambda p: p.entries[2].update(offset=p.entries[2]["offset"] + 64)),
          r"tensor 2 \(bn.weight\): data offset \d+, expected \d+")],
    35: [("past data", patched(lambda p: p.entries[-1].update(shape=[300, 0, 0, 0, 0, 0], nbytes=1200)),
          r"tensor 7 \(fc.bias\): data \(1200 bytes at \d+\) runs past the data section")],
    36: [("tensor padding", patched(nonzero_tensor_padding), r"tensor 1 \(conv.bias\): padding after the data is not zero")],
    37: [("string table", patched(extra_string_byte), r"string table is \d+ bytes but the names use \d+")],
    38: [("data section", patched(extra_data_block), r"data section is \d+ bytes but the tensors use \d+")],
    39: [("flag without fp16", patched(set_fp16_flag), r"fp16 flag in flags_required does not match"),
         ("fp16 without flag", patched(make=fp16_without_flag), r"fp16 flag in flags_required does not match"),
         ("flag without int8", patched(set_header(flags_required=FLAG_INT8)), r"int8 flag in flags_required does not match"),
         ("int8 without flag", patched(set_header(flags_required=0), make=with_int8_tensors()),
          r"int8 flag in flags_required does not match")],
    40: [(f"no {key}", patched(make=with_meta(drop_field(key))), f"metadata lacks the required field '{key}'")
         for key in ("input", "preprocess", "labels", "producer", "producer_version")],
    41: [("unknown op", patched(make=with_graph(set_key(["layers", 0, "type"], "conv9d"))),
          r"graph: layer 0: unknown layer type 'conv9d'"),
         ("wrong in_features", patched(make=with_graph(set_key(["layers", 4, "in_features"], 12))),
          r"graph: layer 4 \(linear\): in_features is 36 from the previous layer, not 12"),
         ("label count", patched(make=with_meta(set_key(["labels"], [{"name": "a", "display": "A"}]))),
          r"metadata: labels: 1 given, but the last layer outputs 3 values"),
         ("std 0 in float32", patched(make=with_meta(set_key(["preprocess", "std"], [1.0, 1e-320, 1.0]))),
          r"metadata: preprocess: std values must be positive, in float32 too, got \[1.0, 1e-320, 1.0\]"),
         ("mean beyond float32", patched(make=with_meta(set_key(["preprocess", "mean"], [0.5, 1e308, 0.5]))),
          r"metadata: preprocess: mean must be a list of 3 numbers that float32 holds \(one per channel\)"),
         ("scale beyond float32", patched(make=with_meta(set_key(["preprocess", "scale"], 1e300))),
          r"metadata: preprocess: scale must be a positive number that float32 holds, not 1e\+300"),
         ("newline in a display name", patched(make=with_meta(set_key(["labels", 0, "display"],
                                                                      "Healthy\nfake.jpg: Late blight (99.0%)"))),
          r"metadata: labels\[0\]: the display holds a control character \(\\n\), which would break"),
         ("escape in advice", patched(make=with_meta(set_key(["labels", 2, "advice"], "Spray\x1b[31m now"))),
          r"metadata: labels\[2\]: the advice holds a control character \(\\x1b\)")],
    42: [("attribute left out", patched(make=with_graph(lambda g: (g["layers"][0].pop("stride"), g)[1])),
          r"graph: not the normalized model description"),
         ("labels in graph", patched(make=with_graph(set_key(["labels"], ["a", "b", "c"]))),
          r"graph: not the normalized model description")],
    43: [("input shape", patched(make=with_meta(set_key(["input", "shape"], [3, 7, 7]))), r"metadata: input is .* the graph needs"),
         ("input layout", patched(make=with_meta(set_key(["input", "layout"], "NHWC"))), r"metadata: input is .*NHWC"),
         ("input dtype", patched(make=with_meta(set_key(["input", "dtype"], "float16"))), r"metadata: input is .*float16")],
    44: [("preprocess null", patched(make=with_meta(set_key(["preprocess"], None))), r"metadata: preprocess must be complete"),
         ("preprocess partial", patched(make=with_meta(lambda m: (m["preprocess"].pop("layout"), m)[1])),
          r"metadata: preprocess must be complete")],
    45: [("labels as strings", patched(make=with_meta(set_key(["labels"], ["healthy", "early_blight", "mold"]))),
          r"metadata: labels must be complete objects")],
    46: [("producer empty", patched(make=with_meta(set_key(["producer"], ""))), r"metadata: producer must be a non-empty string"),
         ("version number", patched(make=with_meta(set_key(["producer_version"], 1))),
          r"metadata: producer_version must be a non-empty string")],
    47: [("missing tensor", patched(make=with_tensors(lambda t: setattr(t[7], "name", b"fc.biaz"))),
          r"the graph needs tensor 'fc.bias' \(shape \[3\]\) but the file has none"),
         ("missing scale", patched(make=with_int8_tensors(lambda t: t.pop(1))),
          r"the graph needs tensor 'conv.weight.scale' \(shape \[4\]\) but the file has none")],
    48: [("tensor shape", patched(make=with_tensors(lambda t: (setattr(t[7], "shape", (2,)), setattr(t[7], "raw", t[7].raw[:8])))),
          r"tensor 'fc.bias' has shape \[2\], its layer expects \[3\]"),
         ("scale shape", patched(make=with_int8_tensors(lambda t: (setattr(t[1], "shape", (3,)), setattr(t[1], "raw", t[1].raw[:12])))),
          r"tensor 'conv.weight.scale' has shape \[3\], its layer expects \[4\]")],
    49: [("extra tensor", patched(make=with_tensors(lambda t: t.append(Tensor(b"ghost.weight", FLOAT32, (1,), bytes(4))))),
          r"tensor 'ghost.weight' belongs to no layer of the graph"),
         ("scale of a float tensor", patched(make=with_tensors(lambda t: t.insert(1, Tensor(b"conv.weight.scale", FLOAT32, (4,), np.ones(4, "<f4").tobytes())))),
          r"tensor 'conv.weight.scale' belongs to no layer of the graph")],
    50: [("order", patched(make=with_tensors(swap_first_tensors)), r"tensors are not stored in the graph's layer order"),
         ("scale after the bias", patched(make=with_int8_tensors(lambda t: t.insert(2, t.pop(1)))),
          r"tensors are not stored in the graph's layer order")],
    51: [("nan", patched(make=with_tensors(nan_in_tensor)), r"tensor 'conv.weight' contains NaN or infinity"),
         ("fp16 inf", patched(make=with_tensors(fp16_infinity_in_fc_weight)), r"tensor 'fc.weight' contains NaN or infinity"),
         ("scale inf", patched(make=with_int8_tensors(set_tensor(8, raw=np.full(3, np.inf, "<f4").tobytes()))),
          r"tensor 'fc.weight.scale' contains NaN or infinity")],
    52: [("int8 with quant 0", patched(set_entry(0, quant=0), make=with_int8_tensors()),
          r"tensor 'conv.weight': quantization code 0 with dtype int8"),
         ("float32 with quant 1", patched(set_entry(1, quant=1)), r"tensor 'conv.bias': quantization code 1 with dtype float32")],
    53: [("1-D int8", patched(make=with_int8_tensors(int8_bias)), r"tensor 'conv.bias': int8 with 1 dimension")],
    54: [("float16 scales", patched(make=with_int8_tensors(set_tensor(1, code=FLOAT16, raw=np.ones(4, "<f2").tobytes()))),
          r"tensor 'conv.weight.scale': scales are float32, not float16")],
    55: [("zero scale", patched(make=with_int8_tensors(set_tensor(1, raw=np.array([1, 0, 1, 1], "<f4").tobytes()))),
          r"tensor 'conv.weight.scale': a scale is zero or negative"),
         ("negative scale", patched(make=with_int8_tensors(set_tensor(8, raw=np.array([1, 1, -2], "<f4").tobytes()))),
          r"tensor 'fc.weight.scale': a scale is zero or negative")],
    56: [("-128", patched(make=with_int8_tensors(lambda t: setattr(t[7], "raw", b"\x80" + t[7].raw[1:]))),
          r"tensor 'fc.weight': holds -128")],
    57: [("3x50000x50000 input", oversized(HUGE_INPUT),
          r"graph: input_shape \[3, 50000, 50000\] is 7,500,000,000 values, over the limit of 16,777,216 values "
          r"\(MAX_INPUT_ELEMENTS in lnn/formats/limits.py\)")],
    58: [("parameters", UnderLimit("MAX_PARAMETERS", 100, patched()),
          r"graph: the model's parameter count is 239, over the limit of 100 \(MAX_PARAMETERS")],
    59: [("40001x40001 activation", oversized(HUGE_ACTIVATIONS),
          r"graph: one sample's activations .* is 6,400,320,008 bytes, over the limit of 2,147,483,648 bytes "
          r"\(MAX_ACTIVATION_BYTES")],
}
# Rules 1 and 2 concern the file itself (missing, a folder, too short): tested with real files below.
RULES_TESTED_WITH_FILES = {1: "test_read_bin_refuses_what_is_not_a_model_file",
                           2: "test_read_bin_refuses_what_is_not_a_model_file"}

CASES = [pytest.param(rule, craft, pattern, id=f"rule{rule}-{name}")
         for rule, cases in RULE_CASES.items() for name, craft, pattern in cases]


@pytest.mark.parametrize("rule, craft, pattern", CASES)
def test_each_rule_refuses_its_crafted_file(tiny, monkeypatch, rule, craft, pattern):
    model, weights = tiny
    if craft == "json-cap":
        monkeypatch.setattr(binfile, "MAX_JSON_BYTES", 100)
        data = join(tiny_parts(model, weights))
    elif isinstance(craft, UnderLimit):
        monkeypatch.setattr(limits, craft.name, craft.value)
        data = craft.craft(model, weights)
    else:
        data = craft(model, weights)
    refused(data, pattern)


def spec_rule_numbers() -> set:
    text = (REPO / "formats" / "SPEC.md").read_text(encoding="utf-8")
    section = text.split("## Validation rules", 1)[1].split("\n## ", 1)[0]
    return {int(n) for n in re.findall(r"^(\d+)\. ", section, flags=re.MULTILINE)}


def test_every_spec_rule_has_a_crafted_file():
    numbers = spec_rule_numbers()
    assert numbers == set(range(1, max(numbers) + 1)), "SPEC.md's rules are numbered 1..N without gaps"
    assert numbers == set(RULE_CASES) | set(RULES_TESTED_WITH_FILES)


def test_every_rule_in_the_reader_is_in_the_spec():
    source = (REPO / "formats" / "binfile.py").read_text(encoding="utf-8")
    assert {int(n) for n in re.findall(r"# rule (\d+)$", source, flags=re.MULTILINE)} == spec_rule_numbers()


# --------------------------------------------------------------------------- what the rules allow

def test_newer_minor_version_unknown_optional_flags_and_longer_header_and_entries_load(tiny):
    model, weights = tiny
    parts = tiny_parts(model, weights, header_size=136, entry_size=72)
    parts.header.update(minor=9, flags_optional=0xFFFF)
    loaded = parse_bin_bytes(join(parts))
    assert loaded.version == (1, 9)
    for key, array in loaded.tensors.items():
        np.testing.assert_array_equal(array, weights[key])


def test_other_alignments_load(tiny):
    model, weights = tiny
    for alignment in (8, 128, 4096):
        data = encode_bin(model, weights, build_metadata(model), alignment=alignment)
        assert data == join(tiny_parts(model, weights, alignment=alignment))
        assert parse_bin_bytes(data).alignment == alignment


def test_brackets_inside_strings_do_not_count_as_nesting(tiny):
    model, weights = tiny
    metadata = build_metadata(model, {"note": "[" * 100 + '\\"{' * 100, "deep": [[[[[[[[1]]]]]]]]})
    assert parse_bin_bytes(encode_bin(model, weights, metadata)).metadata["note"].startswith("[[[")


def test_model_without_parameters_loads():
    model = parse_model({"name": "probe", "input_shape": [4], "layers": [{"type": "softmax"}]})
    data = encode_bin(model, {}, build_metadata(model))
    loaded = parse_bin_bytes(data)
    assert loaded.tensors == {} and loaded.metadata["preprocess"] is None
    assert loaded.metadata["input"] == {"shape": [4], "layout": "NC", "dtype": "float32"}


# --------------------------------------------------------------------------- the writer refuses what the reader would

def test_writer_refuses_bad_weights_and_metadata(tiny):
    model, weights = tiny
    with pytest.raises(ModelSpecError, match=r"weights: missing 'fc.bias'"):
        encode_bin(model, {k: v for k, v in weights.items() if k != "fc.bias"}, build_metadata(model))
    with pytest.raises(ModelSpecError, match=r"weights: fc.bias has shape \[4\], the model expects \[3\]"):
        encode_bin(model, {**weights, "fc.bias": np.zeros(4, np.float32)}, build_metadata(model))
    with pytest.raises(ModelSpecError, match=r"weights: fc.bias contains NaN"):
        encode_bin(model, {**weights, "fc.bias": np.array([0, np.nan, 0], np.float32)}, build_metadata(model))
    with pytest.raises(ModelSpecError, match=r"metadata lacks the required field 'labels'"):
        encode_bin(model, weights, {k: v for k, v in build_metadata(model).items() if k != "labels"})
    with pytest.raises(ModelSpecError, match=r"fc.weight has values beyond the float16 range"):
        encode_bin(model, {**weights, "fc.weight": weights["fc.weight"] * 1e6}, build_metadata(model), fp16_dtypes(model))
    with pytest.raises(ValueError, match=r"dtypes: 'nope' is not a parameter"):
        encode_bin(model, weights, build_metadata(model), {"nope": "float16"})
    with pytest.raises(ValueError, match=r"float32, float16 or int8"):
        encode_bin(model, weights, build_metadata(model), {"fc.weight": "float64"})
    card = {**build_metadata(model), "model_card": {"accuracy": "97% on /data/caf\udce9"}}  # a Latin-1 path's byte
    with pytest.raises(LnnInputError, match=r"^the metadata cannot be written: a lone UTF-16 surrogate \\udce9 in a string"):
        encode_bin(model, weights, card)


# --------------------------------------------------------------------------- round trips and determinism

def test_fp32_round_trip_is_exact(tiny, tmp_path):
    model, weights = tiny
    write_bin(tmp_path / "m.bin", model, weights)
    loaded = read_bin(tmp_path / "m.bin")
    assert loaded.model.to_description() == model.to_description()
    assert loaded.metadata == build_metadata(model)
    assert loaded.stored_dtypes == {key: "float32" for key in weights}
    for key, array in loaded.tensors.items():
        assert array.dtype == np.float32
        np.testing.assert_array_equal(array, weights[key])


def test_fp16_and_int8_compress_conv1d_kernels_not_layernorm_tensors():
    model = parse_model({"input_shape": [3, 10], "layers": [
        {"type": "conv1d", "name": "c", "out_channels": 4, "kernel_size": 3}, {"type": "layernorm", "name": "ln"},
        {"type": "flatten"}, {"type": "linear", "name": "fc", "out_features": 2}]})
    assert model.param_shapes()["ln.weight"] == (4, 8)        # 2-D, but no output channels to quantize by
    assert fp16_dtypes(model) == {"c.weight": "float16", "fc.weight": "float16"}
    assert int8_dtypes(model) == {"c.weight": "int8", "fc.weight": "int8"}


def test_fp16_stores_kernels_as_float16_and_keeps_1d_tensors_float32(tiny, tmp_path):
    model, weights = tiny
    assert fp16_dtypes(model) == {"conv.weight": "float16", "fc.weight": "float16"}
    size32 = write_bin(tmp_path / "m32.bin", model, weights)
    size16 = write_bin(tmp_path / "m16.bin", model, weights, dtypes=fp16_dtypes(model))
    assert size16 < size32
    loaded = read_bin(tmp_path / "m16.bin")
    for key, array in loaded.tensors.items():
        if key in ("conv.weight", "fc.weight"):
            assert array.dtype == np.float16
            np.testing.assert_array_equal(array, weights[key].astype(np.float16))
        else:                                                 # biases and batch-norm stay exact
            assert array.dtype == np.float32
            np.testing.assert_array_equal(array, weights[key])
    widened = loaded.weights_fp32()
    assert all(v.dtype == np.float32 for v in widened.values())
    np.testing.assert_allclose(widened["fc.weight"], weights["fc.weight"], rtol=1e-3, atol=1e-4)


@pytest.mark.parametrize("kind", ["fp32", "fp16", "int8"])
@pytest.mark.parametrize("name", ["tiny", "mnist_cnn", "leaf_cnn"])
def test_export_load_export_is_byte_identical(tmp_path, name, kind):
    model = parse_model(TINY) if name == "tiny" else load_model(EXAMPLES / "reference" / f"{name}.json")
    weights = random_weights(model, seed=3)
    dtypes = {"fp32": None, "fp16": fp16_dtypes(model), "int8": int8_dtypes(model)}[kind]
    write_bin(tmp_path / "a.bin", model, weights, dtypes=dtypes)
    first = read_bin(tmp_path / "a.bin")
    write_bin(tmp_path / "b.bin", first.model, first.tensors, first.metadata, first.stored_dtypes)
    assert (tmp_path / "a.bin").read_bytes() == (tmp_path / "b.bin").read_bytes()
    # The loaded model carries its description along, so the default metadata is the same too.
    assert build_metadata(first.model) == first.metadata


def test_read_bin_gives_read_only_aligned_views_into_the_mapping(tmp_path):
    model = load_model(EXAMPLES / "reference" / "mnist_cnn.json")
    weights = random_weights(model, seed=4)
    for alignment, dtypes in ((64, None), (64, fp16_dtypes(model)), (64, int8_dtypes(model)), (128, None)):
        path = tmp_path / f"m{alignment}.bin"
        path.write_bytes(encode_bin(model, weights, build_metadata(model), dtypes, alignment=alignment))
        loaded = read_bin(path)
        mapping_start = np.frombuffer(loaded._mmap, np.uint8).ctypes.data
        data_offset = struct.unpack_from("<Q", path.read_bytes(), 96)[0]
        running = 0
        for key, array in loaded.tensors.items():
            assert not array.flags.writeable and not array.flags.owndata
            assert array.flags.c_contiguous
            assert array.ctypes.data % alignment == 0
            assert array.ctypes.data - mapping_start == data_offset + running      # a view, not a copy
            running += align(array.nbytes, alignment)
            with pytest.raises(ValueError):
                array[(0,) * array.ndim] = 1


# --------------------------------------------------------------------------- files that are not models

def test_read_bin_refuses_what_is_not_a_model_file(tmp_path):
    import cv2

    jpeg = tmp_path / "leaf.jpg"
    ok, encoded = cv2.imencode(".jpg", np.random.default_rng(0).integers(0, 255, (64, 64, 3), dtype=np.uint8))
    jpeg.write_bytes(encoded.tobytes())
    png = tmp_path / "leaf.png"
    png.write_bytes(cv2.imencode(".png", np.zeros((200, 200), np.uint8))[1].tobytes())
    description = EXAMPLES / "reference" / "mnist_cnn.json"
    empty = tmp_path / "empty.bin"
    empty.write_bytes(b"")
    short = tmp_path / "short.bin"
    short.write_bytes(MAGIC + bytes(50))
    cases = [(tmp_path / "missing.bin", r"missing.bin: no such file"),          # rule 1
             (tmp_path, r"is a folder, not a model file"),                              # rule 1
             (empty, r"empty.bin: 0 bytes is too short for an lnn model"),               # rule 2
             (short, r"short.bin: 58 bytes is too short"),                               # rule 2
             (jpeg, r"leaf.jpg: not an lnn model file: wrong magic bytes \(it is a JPEG image\)"),
             (png, r"leaf.png: not an lnn model file: wrong magic bytes \(it is a PNG image\)"),
             (description, r"not an lnn model file: wrong magic bytes \(it looks like JSON")]
    if Path("/dev/null").exists():
        cases.append((Path("/dev/null"), r"/dev/null: is a character device, not a model file"))                 # rule 1
    for path, pattern in cases:
        with pytest.raises(LnnFormatError) as info:
            read_bin(path)
        assert re.search(pattern, str(info.value)), (pattern, str(info.value))
        assert "\n" not in str(info.value)


def test_parse_bin_bytes_refuses_short_input():
    with pytest.raises(LnnFormatError, match=r"x.bin: 3 bytes is too short"):
        parse_bin_bytes(b"{}\n", "x.bin")


# --------------------------------------------------------------------------- damage anywhere gives LnnFormatError

def damaged_variants(data: bytes, positions, fix_crcs: bool, masks=(0x01, 0x80, 0xFF)):
    for position in positions:
        for mask in masks:
            bad = bytearray(data)
            bad[position] ^= mask
            yield position, mask, (refresh_crcs(bad) if fix_crcs else bytes(bad))


def parse_or_format_error(data: bytes):
    """Only two outcomes are allowed: a loaded model or LnnFormatError (never another exception)."""
    try:
        return parse_bin_bytes(data, "damaged.bin")
    except LnnFormatError as err:
        assert str(err).startswith("damaged.bin: ") and "\n" not in str(err)
        return None


@pytest.fixture(scope="module")
def fuzz_models():
    models = [parse_model(TINY)] + [load_model(EXAMPLES / "reference" / f"{n}.json") for n in ("mnist_mlp", "leaf_cnn")]
    files = []
    for i, model in enumerate(models):
        weights = random_weights(model, seed=i)
        files.append(encode_bin(model, weights, build_metadata(model)))
        files.append(encode_bin(model, weights, build_metadata(model), fp16_dtypes(model)))
        files.append(encode_bin(model, weights, build_metadata(model), int8_dtypes(model)))
    return files


def spread(size: int, count: int, seed: int):
    rng = np.random.default_rng(seed)
    return sorted(set(rng.integers(0, size, count).tolist()) | {0, size - 1})


def test_single_byte_flips_are_refused(fuzz_models):
    """Without CRC repair every flip, anywhere, is caught (the checksums cover every byte)."""
    for index, data in enumerate(fuzz_models):
        positions = list(range(128)) + spread(len(data), 300, index)
        for position, mask, bad in damaged_variants(data, positions, fix_crcs=False):
            with pytest.raises(LnnFormatError):
                parse_bin_bytes(bad, "damaged.bin")


def test_flips_with_repaired_crcs_never_escape_as_other_errors(fuzz_models):
    """With the CRCs recomputed the structural checks alone must hold: load or LnnFormatError, nothing else.

    Bytes of the header and tensor table are all constrained except minor (10-11), flags_optional (20-23)
    and the CRCs themselves (120-127, rewritten by the repair); JSON text and weights may change meaning."""
    free_header_bytes = set(range(10, 12)) | set(range(20, 24)) | set(range(120, 128))
    for index, data in enumerate(fuzz_models):
        string_offset, _, data_offset = struct.unpack_from("<QQQ", data, 80)
        positions = sorted(set(range(string_offset)) | set(spread(data_offset, 200, index))
                           | {data_offset + p for p in spread(len(data) - data_offset, 30, index + 100)})
        for position, mask, bad in damaged_variants(data, positions, fix_crcs=True, masks=(0x01, 0xFF)):
            loaded = parse_or_format_error(bad)
            if position < string_offset and position not in free_header_bytes:
                assert loaded is None, f"byte {position} ^ {mask:#x} of the header or tensor table went unnoticed"


def test_truncations_are_refused(fuzz_models):
    for index, data in enumerate(fuzz_models):
        for length in sorted(set(range(0, 300)) | set(spread(len(data), 200, index))):
            if length == len(data):
                continue
            with pytest.raises(LnnFormatError):
                parse_bin_bytes(data[:length], "cut.bin")
            with pytest.raises(LnnFormatError):                # the size field alone is not what catches it
                parse_bin_bytes(refresh_crcs(data[:length]) if length >= 128 else data[:length], "cut.bin")


def test_damaged_files_on_disk(tmp_path, fuzz_models):
    data = fuzz_models[2]
    path = tmp_path / "model.bin"
    for position in spread(len(data), 40, 7):
        bad = bytearray(data)
        bad[position] ^= 1 << (position % 8)
        path.write_bytes(bad)
        with pytest.raises(LnnFormatError, match=r"model.bin: .*(checksum mismatch|magic|endian|version|header)"):
            read_bin(path)
    path.write_bytes(data[:len(data) // 2])
    with pytest.raises(LnnFormatError, match=r"the header says the file is \d+ bytes but it is \d+"):
        read_bin(path)
    path.write_bytes(data + b"\0")
    with pytest.raises(LnnFormatError, match=r"truncated or has bytes appended"):
        read_bin(path)
    path.write_bytes(data)
    assert isinstance(read_bin(path), BinModel)


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="needs /proc/self/maps")
def test_a_refused_file_is_unmapped(tmp_path, tiny):
    """A file refused after some tensors were viewed is unmapped at once (it can be replaced, also on Windows)."""
    model, weights = tiny
    path = tmp_path / "late_failure.bin"
    path.write_bytes(patched(make=with_tensors(fp16_infinity_in_fc_weight))(model, weights))
    with pytest.raises(LnnFormatError, match="fc.weight' contains NaN or infinity"):
        read_bin(path)
    assert str(path) not in Path("/proc/self/maps").read_text()
    path.write_bytes(join(tiny_parts(model, weights)))
    loaded = read_bin(path)
    assert str(path) in Path("/proc/self/maps").read_text()
    assert loaded.tensors["fc.bias"].shape == (3,)


def test_atomic_write_gives_ordinary_file_permissions(tmp_path):
    import os
    from lnn.formats.binfile import write_atomic

    umask = os.umask(0o022)
    try:
        write_atomic(tmp_path / "out.bin", b"data")
    finally:
        os.umask(umask)
    assert (tmp_path / "out.bin").stat().st_mode & 0o777 == 0o644
    assert [p.name for p in tmp_path.iterdir()] == ["out.bin"]


def test_atomic_write_refuses_what_is_not_a_regular_file_and_writes_through_a_symlink(tmp_path):
    import os
    from lnn.formats.binfile import write_atomic
    from lnn.formats.errors import LnnInputError

    pipe, folder = tmp_path / "pipe", tmp_path / "folder"
    os.mkfifo(pipe)
    folder.mkdir()
    (tmp_path / "to_pipe").symlink_to(pipe)
    for target, kind in [(pipe, "a named pipe"), (folder, "a folder"), (tmp_path / "to_pipe", "a named pipe")]:
        with pytest.raises(LnnInputError) as refused:
            write_atomic(target, b"data")
        assert str(refused.value) == f"{target}: is {kind}, not a regular output file"
    assert pipe.is_fifo() and folder.is_dir() and not any(folder.iterdir())
    (tmp_path / "old.bin").write_bytes(b"old")
    (tmp_path / "link.bin").symlink_to("old.bin")
    write_atomic(tmp_path / "link.bin", b"new")
    assert (tmp_path / "link.bin").is_symlink() and (tmp_path / "old.bin").read_bytes() == b"new"
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]


def test_a_tiny_file_declaring_a_huge_input_is_one_line_in_the_commands(tmp_path):
    import subprocess
    import sys

    path = tmp_path / "huge_input.bin"
    path.write_bytes(oversized(HUGE_INPUT)(None, None))
    assert path.stat().st_size < 1500
    photo = sorted((EXAMPLES / "leaves").glob("*.jpg"))[0]
    for command, args in [("infer", ["--model", path, photo]), ("summary", [path])]:
        done = subprocess.run([sys.executable, "-m", f"lnn.tools.{command}", *map(str, args)], capture_output=True,
                              text=True, timeout=60)
        assert done.returncode == 1
        assert done.stderr.count("\n") == 1 and "Traceback" not in done.stderr
        assert "input_shape [3, 50000, 50000] is 7,500,000,000 values" in done.stderr and "MAX_INPUT_ELEMENTS" in done.stderr
