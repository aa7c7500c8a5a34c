"""The `.bin` model file, version 1: writer and validating, zero-copy reader.

formats/SPEC.md is the normative description; this module implements it and nothing else.
Layout: a 128-byte header, the tensor table, the string table (tensor names), the graph JSON,
the metadata JSON, zero padding up to the alignment, then the data section with every tensor
starting on an `alignment`-byte boundary. All integers little-endian.

`read_bin(path)` checks every rule of SPEC.md in one linear pass and raises LnnFormatError with a
message saying what is wrong; tensors come back as read-only NumPy views into one mmap.
"""

from __future__ import annotations

import json
import math
import mmap
import os
import struct
import tempfile
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from lnn.formats.errors import LnnFormatError, ModelSpecError
from lnn.formats.model import Model, parse_model
from lnn.version import __version__

MAGIC = b"\x89LNN\r\n\x1a\n"
VERSION_MAJOR, VERSION_MINOR = 1, 0
HEADER_SIZE = 128
ENDIAN_TAG = 0x01020304
DEFAULT_ALIGNMENT = 64

# flags_required: a reader that does not know a set bit must refuse the file.
FLAG_FP16 = 1 << 0
KNOWN_REQUIRED_FLAGS = FLAG_FP16
# flags_optional: unknown bits are ignored. None are defined in 1.0.

HEADER = struct.Struct("<8sHHIIIIIII" + "QQ" "QQ" "Q" "QQ" "QQ" "Q" + "II")
TENSOR_ENTRY = struct.Struct("<QIBBBB6IQQQ")
TENSOR_ENTRY_SIZE = TENSOR_ENTRY.size
assert HEADER.size == HEADER_SIZE and TENSOR_ENTRY_SIZE == 64

DTYPES = {1: np.dtype("<f4"), 2: np.dtype("<f2")}
DTYPE_CODES = {np.dtype("<f4"): 1, np.dtype("<f2"): 2}
QUANT_NONE = 0
MAX_NDIM = 6
MAX_TENSORS = 65536
MAX_NAME_BYTES = 1024
MAX_TENSOR_ELEMENTS = 1 << 31
MAX_JSON_BYTES = 16 << 20
MAX_JSON_DEPTH = 64
REQUIRED_METADATA = ("input", "preprocess", "labels", "producer", "producer_version")


@dataclass
class BinModel:
    """A loaded `.bin`: the parsed model, its tensors (views into the file) and its metadata."""

    path: Path
    model: Model
    tensors: dict            # key -> read-only np.ndarray as stored (float32 or float16)
    metadata: dict
    version: tuple
    alignment: int
    _mmap: object = None     # keeps the mapping alive as long as the views

    def weights_fp32(self) -> dict:
        """Every tensor as float32 (fp32 ones are the zero-copy views themselves)."""
        return {k: v if v.dtype == np.float32 else v.astype(np.float32) for k, v in self.tensors.items()}

    @property
    def stored_dtypes(self) -> dict:
        return {k: v.dtype.name for k, v in self.tensors.items()}


# --------------------------------------------------------------------------- writing

def build_metadata(model: Model, extra: dict | None = None) -> dict:
    """The metadata JSON for a model: input, preprocessing, labels, producer (plus `extra`)."""
    meta = {
        "input": {"shape": list(model.input_shape), "layout": "NCHW" if len(model.input_shape) == 3 else "NC",
                  "dtype": "float32"},
        "preprocess": model.preprocess,
        "labels": model.labels,
        "producer": "lnn",
        "producer_version": __version__,
    }
    for key in ("description", "model_card"):
        if key in model.extra:
            meta[key] = model.extra[key]
    meta.update(extra or {})
    return meta


def graph_of(model: Model) -> dict:
    """The graph JSON: the network itself (metadata holds preprocessing and labels)."""
    desc = model.to_description()
    return {key: desc[key] for key in ("name", "input_shape", "layers", "loss", "optimizer", "training") if key in desc}


def _json_bytes(obj) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False).encode("utf-8")


def _align(n: int, alignment: int) -> int:
    return (n + alignment - 1) // alignment * alignment


def encode_bin(model: Model, weights: dict, metadata: dict, dtypes: dict | None = None,
               alignment: int = DEFAULT_ALIGNMENT) -> bytes:
    """Serialize; `weights` must hold exactly the model's parameters; `dtypes` maps key -> 'float16'."""
    dtypes = dtypes or {}
    expected = model.param_shapes()
    check_weights(expected, weights)
    names, arrays = [], []
    for key in expected:                                    # layer order, as the model lists them
        array = np.ascontiguousarray(weights[key], dtype=np.dtype(dtypes.get(key, "float32")).newbyteorder("<"))
        names.append(key.encode("utf-8"))
        arrays.append(array)

    table_offset = HEADER_SIZE
    string_offset = table_offset + TENSOR_ENTRY_SIZE * len(arrays)
    strings = b"".join(names)
    graph = _json_bytes(graph_of(model))
    meta = _json_bytes(metadata)
    graph_offset = string_offset + len(strings)
    meta_offset = graph_offset + len(graph)
    data_offset = _align(meta_offset + len(meta), alignment)

    entries, chunks, running, name_running, flags = [], [], 0, 0, 0
    for name, array in zip(names, arrays):
        code = DTYPE_CODES[array.dtype]
        if code == 2:
            flags |= FLAG_FP16
        shape = list(array.shape) + [0] * (MAX_NDIM - array.ndim)
        entries.append(TENSOR_ENTRY.pack(name_running, len(name), code, QUANT_NONE, array.ndim, 0, *shape,
                                         running, array.nbytes, 0))
        padded = _align(array.nbytes, alignment)
        chunks.append(array.tobytes() + bytes(padded - array.nbytes))
        running += padded
        name_running += len(name)
    body = (b"".join(entries) + strings + graph + meta + bytes(data_offset - meta_offset - len(meta))
            + b"".join(chunks))
    file_size = HEADER_SIZE + len(body)
    fields = [MAGIC, VERSION_MAJOR, VERSION_MINOR, HEADER_SIZE, flags, 0, ENDIAN_TAG, alignment,
              len(arrays), TENSOR_ENTRY_SIZE, graph_offset, len(graph), meta_offset, len(meta), table_offset,
              string_offset, len(strings), data_offset, running, file_size, zlib.crc32(body), 0]
    fields[-1] = zlib.crc32(HEADER.pack(*fields))
    return HEADER.pack(*fields) + body


def check_weights(expected: dict, weights: dict) -> None:
    """Raise ModelSpecError unless `weights` has exactly the expected keys and shapes."""
    missing = [k for k in expected if k not in weights]
    if missing:
        raise ModelSpecError(f"weights: missing {missing[0]!r} (shape {list(expected[missing[0]])})"
                             + (f" and {len(missing) - 1} more" if len(missing) > 1 else ""))
    extra = sorted(set(weights) - set(expected))
    if extra:
        raise ModelSpecError(f"weights: {extra[0]!r} is not a parameter of the model; expected keys: {', '.join(expected)}")
    for key, shape in expected.items():
        if tuple(np.shape(weights[key])) != tuple(shape):
            raise ModelSpecError(f"weights: {key} has shape {list(np.shape(weights[key]))}, the model expects {list(shape)}")
        if not np.all(np.isfinite(weights[key])):
            raise ModelSpecError(f"weights: {key} contains NaN or infinity")


def write_atomic(path: str | Path, data: bytes) -> None:
    """Write to a temporary file in the same folder, fsync, then rename over `path`."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent or ".")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def write_bin(path, model: Model, weights: dict, metadata: dict | None = None, dtypes: dict | None = None) -> int:
    data = encode_bin(model, weights, metadata if metadata is not None else build_metadata(model), dtypes)
    write_atomic(path, data)
    return len(data)


# --------------------------------------------------------------------------- reading

def read_bin(path: str | Path) -> BinModel:
    path = Path(path)
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size < HEADER_SIZE:
                raise LnnFormatError(f"{path}: {size} bytes is too short for an lnn model (the header alone is {HEADER_SIZE}); the file is truncated or not a model")
            mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    except FileNotFoundError:
        raise LnnFormatError(f"{path}: no such model file") from None
    except IsADirectoryError:
        raise LnnFormatError(f"{path}: is a folder, not a model file") from None
    except OSError as err:
        raise LnnFormatError(f"{path}: cannot read the model file ({err.strerror or err})") from None
    try:
        return _parse(path, mapped)
    except LnnFormatError as err:
        mapped.close()
        raise LnnFormatError(f"{path}: {err}") from None


def parse_bin_bytes(data: bytes, name: str = "<bytes>") -> BinModel:
    """Validate and load from memory (tests and tools that hold the bytes)."""
    if len(data) < HEADER_SIZE:
        raise LnnFormatError(f"{name}: {len(data)} bytes is too short for an lnn model (the header alone is {HEADER_SIZE})")
    try:
        return _parse(Path(name), memoryview(data))
    except LnnFormatError as err:
        raise LnnFormatError(f"{name}: {err}") from None


def _sniff(head: bytes) -> str:
    if head[:4] == b"\xff\xd8\xff\xe0" or head[:3] == b"\xff\xd8\xff":
        return " (it is a JPEG image)"
    if head[:8] == b"\x89PNG\r\n\x1a\n":
        return " (it is a PNG image)"
    if head[:1] == b"{":
        return " (it looks like JSON: pass a model description to lnn-export first)"
    if head[:2] == b"\x08\x07" or head[:2] == b"\x08\x08" or head[:2] == b"\x08\x09":
        return " (it looks like an ONNX file: convert it with lnn-import)"
    return ""


def _parse(path: Path, buf) -> BinModel:
    size = len(buf)
    head = bytes(buf[:HEADER_SIZE])
    (magic, major, minor, header_size, flags_required, flags_optional, endian, alignment, count, entry_size,
     graph_offset, graph_size, meta_offset, meta_size, table_offset, string_offset, string_size,
     data_offset, data_size, file_size, body_crc, header_crc) = HEADER.unpack(head)
    if magic != MAGIC:
        raise LnnFormatError(f"not an lnn model file: wrong magic bytes{_sniff(head)}")
    if endian != ENDIAN_TAG:
        raise LnnFormatError(f"endian tag is {endian:#010x}, not 0x01020304: the header is damaged or the file was not written little-endian")
    if major != VERSION_MAJOR:
        newer = major > VERSION_MAJOR
        raise LnnFormatError(f"format version {major}.{minor} " + ("is newer than this lnn reads (1.x): upgrade lnn" if newer
                                                                    else "is not a version lnn ever wrote"))
    if header_size < HEADER_SIZE or header_size % 8 or header_size > size:
        raise LnnFormatError(f"header_size {header_size} is invalid (at least {HEADER_SIZE}, a multiple of 8, within the file)")
    full_header = bytearray(buf[:header_size])
    full_header[124:128] = bytes(4)
    if zlib.crc32(full_header) != header_crc:
        raise LnnFormatError("header checksum mismatch: the file is damaged; export or copy it again")
    if file_size != size:
        raise LnnFormatError(f"the header says the file is {file_size} bytes but it is {size}: the file is truncated or has bytes appended; copy it again")
    if zlib.crc32(buf[header_size:]) != body_crc:
        raise LnnFormatError("data checksum mismatch: the file is damaged; export or copy it again")
    unknown = flags_required & ~KNOWN_REQUIRED_FLAGS
    if unknown:
        raise LnnFormatError(f"requires features this lnn does not know (flags_required bits {unknown:#x}): upgrade lnn")
    if alignment < 8 or alignment > 65536 or alignment & (alignment - 1):
        raise LnnFormatError(f"alignment {alignment} is not a power of two between 8 and 65536")
    if entry_size < TENSOR_ENTRY_SIZE or entry_size % 8:
        raise LnnFormatError(f"tensor_entry_size {entry_size} is invalid (at least {TENSOR_ENTRY_SIZE}, a multiple of 8)")
    if count > MAX_TENSORS:
        raise LnnFormatError(f"tensor_count {count} is over the limit of {MAX_TENSORS}")

    # Sections lie back to back in a fixed order; anything else is refused.
    expected_layout = [("tensor table", table_offset, header_size, count * entry_size),
                       ("string table", string_offset, None, string_size),
                       ("graph JSON", graph_offset, None, graph_size),
                       ("metadata JSON", meta_offset, None, meta_size)]
    position = None
    for name, offset, must_be, length in expected_layout:
        must_be = position if must_be is None else must_be
        if offset != must_be:
            raise LnnFormatError(f"{name} starts at offset {offset}, expected {must_be} (sections must follow each other)")
        if length > size - offset:
            raise LnnFormatError(f"{name} ({length} bytes at offset {offset}) runs past the end of the file")
        position = offset + length
    if data_offset != _align(position, alignment):
        raise LnnFormatError(f"data section starts at {data_offset}, expected {_align(position, alignment)} (after the metadata, aligned to {alignment})")
    if any(buf[position:data_offset]):
        raise LnnFormatError("padding before the data section is not zero")
    if data_size != size - data_offset:
        raise LnnFormatError(f"data section is {data_size} bytes, but {size - data_offset} bytes follow its start")

    graph = _read_json(buf, graph_offset, graph_size, "graph JSON")
    metadata = _read_json(buf, meta_offset, meta_size, "metadata JSON")
    tensors = _read_tensors(buf, count, entry_size, table_offset, string_offset, string_size,
                            data_offset, data_size, alignment)
    if any(t.dtype == np.float16 for t in tensors.values()) != bool(flags_required & FLAG_FP16):
        raise LnnFormatError("the fp16 flag does not match the stored tensor types")
    model = _model_from(graph, metadata)
    _check_tensors_match(model, tensors)
    return BinModel(path, model, tensors, metadata, (major, minor), alignment, buf if isinstance(buf, mmap.mmap) else None)


def _json_depth_ok(raw: bytes) -> bool:
    """True when brackets nest at most MAX_JSON_DEPTH deep (strings skipped), so json.loads cannot recurse away."""
    depth, in_string, escaped = 0, False, False
    for byte in raw:
        if in_string:
            if escaped:
                escaped = False
            elif byte == 0x5C:      # backslash
                escaped = True
            elif byte == 0x22:      # quote
                in_string = False
        elif byte == 0x22:
            in_string = True
        elif byte in (0x5B, 0x7B):
            depth += 1
            if depth > MAX_JSON_DEPTH:
                return False
        elif byte in (0x5D, 0x7D):
            depth -= 1
    return True


def _read_json(buf, offset: int, size: int, what: str) -> dict:
    if size > MAX_JSON_BYTES:
        raise LnnFormatError(f"{what} is {size} bytes, over the limit of {MAX_JSON_BYTES}")
    raw = bytes(buf[offset:offset + size])
    if not _json_depth_ok(raw):
        raise LnnFormatError(f"{what} nests deeper than {MAX_JSON_DEPTH} levels")
    try:
        value = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as err:
        raise LnnFormatError(f"{what} is not valid UTF-8 JSON ({err})") from None
    if not isinstance(value, dict):
        raise LnnFormatError(f"{what} must be a JSON object")
    return value


def _read_tensors(buf, count, entry_size, table_offset, string_offset, string_size, data_offset, data_size,
                  alignment) -> dict:
    tensors, running, name_running = {}, 0, 0
    for i in range(count):
        entry = bytes(buf[table_offset + i * entry_size: table_offset + i * entry_size + TENSOR_ENTRY_SIZE])
        (name_off, name_len, dtype_code, quant, ndim, reserved8, *rest) = TENSOR_ENTRY.unpack(entry)
        shape_slots, (offset, nbytes, reserved64) = rest[:MAX_NDIM], rest[MAX_NDIM:]
        where = f"tensor {i}"
        if name_off != name_running or name_len == 0 or name_len > MAX_NAME_BYTES or name_off + name_len > string_size:
            raise LnnFormatError(f"{where}: name at {name_off} (+{name_len}) is not the next name in the string table")
        try:
            name = bytes(buf[string_offset + name_off: string_offset + name_off + name_len]).decode("utf-8")
        except UnicodeDecodeError:
            raise LnnFormatError(f"{where}: name is not valid UTF-8") from None
        name_running += name_len
        where = f"tensor {i} ({name})"
        if name in tensors:
            raise LnnFormatError(f"{where}: the name appears twice")
        if dtype_code not in DTYPES:
            raise LnnFormatError(f"{where}: unknown dtype code {dtype_code}")
        if quant != QUANT_NONE:
            raise LnnFormatError(f"{where}: unknown quantization code {quant}")
        if reserved8 or reserved64 or entry[TENSOR_ENTRY_SIZE:] or any(buf[table_offset + i * entry_size + TENSOR_ENTRY_SIZE: table_offset + (i + 1) * entry_size]):
            raise LnnFormatError(f"{where}: reserved fields are not zero")
        if ndim > MAX_NDIM:
            raise LnnFormatError(f"{where}: {ndim} dimensions, more than {MAX_NDIM}")
        shape = tuple(shape_slots[:ndim])
        if any(shape_slots[ndim:]) or 0 in shape:
            raise LnnFormatError(f"{where}: shape slots {list(shape_slots)} do not match ndim {ndim}")
        elements = math.prod(shape)
        if elements > MAX_TENSOR_ELEMENTS:
            raise LnnFormatError(f"{where}: {elements} elements, over the limit of {MAX_TENSOR_ELEMENTS}")
        dtype = DTYPES[dtype_code]
        if nbytes != elements * dtype.itemsize:
            raise LnnFormatError(f"{where}: {nbytes} bytes do not match shape {list(shape)} of {dtype.name}")
        if offset != running:
            raise LnnFormatError(f"{where}: data offset {offset}, expected {running} (tensors are packed in table order)")
        padded = _align(nbytes, alignment)
        if running + padded > data_size:
            raise LnnFormatError(f"{where}: data ({nbytes} bytes at {offset}) runs past the data section")
        start = data_offset + offset
        if any(buf[start + nbytes: start + padded]):
            raise LnnFormatError(f"{where}: padding after the data is not zero")
        array = np.frombuffer(buf, dtype=dtype, count=elements, offset=start).reshape(shape)
        array.flags.writeable = False
        tensors[name] = array
        running += padded
    if name_running != string_size:
        raise LnnFormatError(f"string table is {string_size} bytes but the names use {name_running}")
    if running != data_size:
        raise LnnFormatError(f"data section is {data_size} bytes but the tensors use {running}")
    return tensors


def _model_from(graph: dict, metadata: dict) -> Model:
    missing = [key for key in REQUIRED_METADATA if key not in metadata]
    if missing:
        raise LnnFormatError(f"metadata lacks the required field {missing[0]!r}")
    desc = dict(graph)
    desc["labels"] = metadata["labels"]
    if metadata["preprocess"] is not None:
        desc["preprocess"] = metadata["preprocess"]
    try:
        model = parse_model(desc)
    except ModelSpecError as err:
        raise LnnFormatError(f"graph: {err}") from None
    input_meta = metadata["input"]
    if not isinstance(input_meta, dict) or input_meta.get("shape") != list(model.input_shape):
        raise LnnFormatError(f"metadata: input shape {input_meta.get('shape') if isinstance(input_meta, dict) else input_meta!r} "
                             f"does not match the graph's {list(model.input_shape)}")
    return model


def _check_tensors_match(model: Model, tensors: dict) -> None:
    expected = model.param_shapes()
    for key, shape in expected.items():
        if key not in tensors:
            raise LnnFormatError(f"the graph needs tensor {key!r} (shape {list(shape)}) but the file has none")
        if tensors[key].shape != tuple(shape):
            raise LnnFormatError(f"tensor {key!r} has shape {list(tensors[key].shape)}, its layer expects {list(shape)}")
    extra = [key for key in tensors if key not in expected]
    if extra:
        raise LnnFormatError(f"tensor {extra[0]!r} belongs to no layer of the graph")
    if list(tensors) != list(expected):
        raise LnnFormatError("tensors are not stored in the graph's layer order")
