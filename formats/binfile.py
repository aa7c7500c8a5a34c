"""The `.bin` model file, version 1: writer and validating, zero-copy reader.

formats/SPEC.md is the normative description; this module implements it and nothing else. The
reader's checks carry the number of the SPEC rule they enforce (`# rule 17`), and
tests/formats/test_binfile.py crafts one bad file per rule.

Layout: a 128-byte header, the tensor table, the string table (tensor names), the graph JSON,
the metadata JSON, zero padding up to the alignment, then the data section with every tensor
starting on an `alignment`-byte boundary. All integers little-endian.

`read_bin(path)` checks every rule in one linear pass and raises LnnFormatError with a message
saying what is wrong; tensors come back as read-only NumPy views into one mmap.

Tensors are stored as float32, float16 (`--fp16`) or int8 with a float32 scale per output channel
(`--int8`, formats/quantize.py); `BinModel.weights_fp32()` widens and dequantizes them for computing.
Optional extras after the parameters: the out-of-distribution gate's tensors (formats/gate.py), then the
test vectors (formats/vectors.py).
"""

from __future__ import annotations

import contextlib
import json
import math
import mmap
import os
import struct
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from lnn.formats.errors import LnnFormatError, LnnInputError, ModelSpecError
from lnn.formats.files import regular_file
from lnn.formats.gate import TENSOR_PREFIX, check_gate_metadata, check_gate_tensor_shapes, gate_tensor_shapes
from lnn.formats.limits import MAX_JSON_BYTES, MAX_JSON_DEPTH
from lnn.formats.model import Model, json_nesting_depth, loads_json, parse_model, size_refusals, surrogate_problem
from lnn.formats.ops import FLOAT32_MAX, get_op
from lnn.formats.quantize import QMAX, dequantize, quantize_per_channel, scale_key
from lnn.formats.vectors import INPUTS, OUTPUTS, TENSOR_PREFIX as VECTOR_PREFIX, check_vectors_metadata, vector_tensor_shapes
from lnn.version import __version__

MAGIC = b"\x89LNN\r\n\x1a\n"
VERSION_MAJOR, VERSION_MINOR = 1, 0
HEADER_SIZE = 128
HEADER_CRC_OFFSET = 124
ENDIAN_TAG = 0x01020304
DEFAULT_ALIGNMENT = 64
MIN_ALIGNMENT, MAX_ALIGNMENT = 8, 65536

# flags_required: a reader that does not know a set bit must refuse the file.
FLAG_FP16 = 1 << 0
FLAG_INT8 = 1 << 1
KNOWN_REQUIRED_FLAGS = FLAG_FP16 | FLAG_INT8
# flags_optional: unknown bits are ignored. None are defined in 1.0.

HEADER = struct.Struct("<8sHHIIIIIII" + "QQ" "QQ" "Q" "QQ" "QQ" "Q" + "II")
TENSOR_ENTRY = struct.Struct("<QIBBBB6IQQQ")
TENSOR_ENTRY_SIZE = TENSOR_ENTRY.size
assert HEADER.size == HEADER_SIZE and TENSOR_ENTRY_SIZE == 64

DTYPES = {1: np.dtype("<f4"), 2: np.dtype("<f2"), 3: np.dtype("i1")}
DTYPE_CODES = {np.dtype("<f4"): 1, np.dtype("<f2"): 2, np.dtype("i1"): 3}
INT8 = np.dtype("i1")
QUANT_NONE = 0
QUANT_INT8_PER_CHANNEL = 1        # symmetric, one float32 scale per index of axis 0, in tensor `<name>.scale`
QUANT_CODES = (QUANT_NONE, QUANT_INT8_PER_CHANNEL)
MAX_NDIM = 6
MAX_TENSORS = 65536
MAX_NAME_BYTES = 1024
MAX_TENSOR_ELEMENTS = 1 << 31
REQUIRED_METADATA = ("input", "preprocess", "labels", "producer", "producer_version")
OPTIONAL_METADATA = ("description", "model_card")
LAYOUTS = {1: "NC", 2: "NCL", 3: "NCHW", 4: "NCDHW"}   # by the rank of input_shape (no batch)


@dataclass
class BinModel:
    """A loaded `.bin`: the parsed model, its tensors (views into the file) and its metadata."""

    path: Path
    model: Model
    tensors: dict            # key -> read-only np.ndarray as stored (float32, float16, or int8 plus `<key>.scale`)
    metadata: dict
    version: tuple
    alignment: int
    _mmap: object = None     # keeps the mapping alive as long as the views
    checksums: tuple = ()    # (header CRC, body CRC): what the file holds, in 8 bytes (for caching verdicts)

    def weights_fp32(self) -> dict:
        """Every parameter as float32: fp32 ones are the zero-copy views themselves, float16 ones are
        widened, int8 ones dequantized with their scales (which are not parameters themselves)."""
        scales = {key: self.tensors[scale_key(key)] for key in self.model.param_shapes()
                  if self.tensors[key].dtype == INT8}
        return _widened(self.model, self.tensors, scales)

    @property
    def gate_tensors(self) -> dict:
        """The out-of-distribution gate's tensors (`gate.*`, float32 views; formats/gate.py), empty without a gate."""
        return {key: value for key, value in self.tensors.items() if key.startswith(TENSOR_PREFIX)}

    @property
    def test_vectors(self) -> tuple | None:
        """(inputs [N, *input_shape], the exporting machine's outputs [N, *output_shape]) as stored
        (formats/vectors.py), or None for a file without them."""
        if INPUTS not in self.tensors:
            return None
        return self.tensors[INPUTS], self.tensors[OUTPUTS]

    @property
    def stored_dtypes(self) -> dict:
        """Parameter key -> stored dtype name ("float32", "float16", "int8"); scale tensors are not listed."""
        return {key: self.tensors[key].dtype.name for key in self.model.param_shapes()}


# --------------------------------------------------------------------------- writing

def input_layout(input_shape) -> str:
    return LAYOUTS[len(input_shape)]


def build_metadata(model: Model, extra: dict | None = None) -> dict:
    """The metadata JSON for a model: input, preprocessing, labels, producer (plus `extra`)."""
    meta = {
        "input": {"shape": list(model.input_shape), "layout": input_layout(model.input_shape), "dtype": "float32"},
        "preprocess": model.preprocess,
        "labels": list(model.labels),
        "producer": "lnn",
        "producer_version": __version__,
    }
    for key in OPTIONAL_METADATA:
        if key in model.extra:
            meta[key] = model.extra[key]
    meta.update(extra or {})
    return meta


def graph_of(model: Model) -> dict:
    """The graph JSON: the network itself (metadata holds preprocessing and labels)."""
    desc = model.to_description()
    return {key: desc[key] for key in ("name", "input_shape", "layers", "loss", "optimizer", "training") if key in desc}


def compressed_weights(model: Model) -> list:
    """The keys `--fp16` and `--int8` compress: the kernels (each op's `kernel_param_names`: linear and conv
    weights, lstm and gru's weight_ih_l* / weight_hh_l*, with one int8 scale per gate unit).

    Biases, batch-norm and layer-norm tensors stay float32: they are a tiny share of the bytes, a
    variance near eps loses its meaning in fp16, and a layer norm's weight [C, T] has no output channels."""
    return [node.param_key(param) for node in model.nodes for param in get_op(node.op).kernel_param_names(node.attrs)]


def fp16_dtypes(model: Model) -> dict:
    """The `--fp16` policy: the compressed weights (see compressed_weights) as float16."""
    return {key: "float16" for key in compressed_weights(model)}


def int8_dtypes(model: Model) -> dict:
    """The `--int8` policy: the compressed weights as int8 with a float32 scale per output channel."""
    return {key: "int8" for key in compressed_weights(model)}


def _json_bytes(obj) -> bytes:
    """The canonical JSON encoding: sorted keys, compact separators, UTF-8, no NaN or infinity. A string holding a
    lone UTF-16 surrogate (formats/model.py lone_surrogate) raises UnicodeEncodeError: the callers say so in words
    (surrogate_problem), so that each section is encoded once."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False).encode("utf-8")


def _align(n: int, alignment: int) -> int:
    return (n + alignment - 1) // alignment * alignment


def _split_quantized(model: Model, weights: dict) -> tuple:
    """(parameters, {key: scale}): an int8 parameter comes with its `<key>.scale` (as a loaded int8 .bin
    holds them); this separates the scales from the parameters and checks each pair."""
    scales = {key: weights[scale_key(key)] for key in model.param_shapes() if scale_key(key) in weights}
    params = {k: v for k, v in weights.items() if k not in {scale_key(key) for key in scales}}
    for key, scale in scales.items():
        q, scale = np.asarray(params.get(key)), np.asarray(scale)
        if q.dtype != INT8:
            raise ModelSpecError(f"weights: {scale_key(key)} is given but {key} is {q.dtype}, not int8")
        if scale.shape != q.shape[:1] or scale.dtype != np.float32 or not np.all(scale > 0) or q.ndim < 2:
            raise ModelSpecError(f"weights: {scale_key(key)} must be float32 [{len(q)}] and positive, one scale per "
                                 f"output channel of {key} (shape {list(q.shape)})")
        if np.any(q == -QMAX - 1):
            raise ModelSpecError(f"weights: {key} holds -128; int8 weights are symmetric, -127 to 127")
    return params, scales


def _widened(model: Model, params: dict, scales: dict) -> dict:
    """Every parameter as float32: float32 ones as they are (no copy), float16 widened, int8 dequantized."""
    return {key: dequantize(params[key], scales[key]) if key in scales else np.asarray(params[key], np.float32)
            for key in model.param_shapes()}


def float32_weights(model: Model, weights: dict) -> dict:
    """Weights as a .bin stores them (float32, float16, or int8 with `<key>.scale`), checked like
    check_weights, as float32 for computing or for a float-only format (ONNX)."""
    params, scales = _split_quantized(model, weights)
    check_weights(model.param_shapes(), params)
    return _widened(model, params, scales)


def _stored_arrays(model: Model, weights: dict, dtypes: dict) -> list:
    """(key, little-endian contiguous array) in the model's parameter order, converted to `dtypes`;
    each int8 tensor is followed by its float32 scale tensor `<key>.scale`."""
    expected = model.param_shapes()
    params, scales = _split_quantized(model, weights)
    check_weights(expected, params)
    unknown = sorted(set(dtypes) - set(expected))
    if unknown:
        raise ValueError(f"dtypes: {unknown[0]!r} is not a parameter of the model")
    out = []
    for key in expected:                                    # layer order, as the model lists them
        dtype_name = dtypes.get(key, "float32")
        if np.dtype(dtype_name) not in DTYPE_CODES:
            raise ValueError(f"dtypes: {key} as {dtype_name!r}; a .bin v1 stores float32, float16 or int8")
        value = params[key]
        if np.dtype(dtype_name) == INT8:
            if len(expected[key]) < 2:
                raise ValueError(f"dtypes: {key} as int8; int8 is per output channel, for tensors of 2 or more dimensions")
            q, scale = (value, scales[key]) if key in scales else quantize_per_channel(value)
            out += [(key, np.ascontiguousarray(q)), (scale_key(key), np.ascontiguousarray(scale, dtype="<f4"))]
            continue
        if key in scales:                                   # stored int8, now wanted as a float type
            value = dequantize(value, scales[key])
        with np.errstate(over="ignore"):                    # overflow to fp16 infinity is refused just below
            array = np.ascontiguousarray(value, dtype=np.dtype(dtype_name).newbyteorder("<"))
        if not np.all(np.isfinite(array)):
            raise ModelSpecError(f"weights: {key} has values beyond the float16 range (±65504); keep it float32")
        out.append((key, array))
    return out


def _gate_arrays(model: Model, metadata: dict, given: dict) -> list:
    """(key, float32 array) of the gate's tensors in their order: exactly those metadata.gate needs."""
    shapes = gate_tensor_shapes(metadata, model, {key: np.shape(value) for key, value in given.items()})
    if set(given) != set(shapes):
        raise ModelSpecError(f"weights: the gate needs tensors {sorted(shapes) or 'none'}, given {sorted(given)}")
    arrays = [(key, np.ascontiguousarray(given[key], dtype="<f4")) for key in shapes]
    try:
        check_gate_tensor_shapes(shapes, {key: array.shape for key, array in arrays})
    except LnnFormatError as err:
        raise ModelSpecError(f"weights: {err}") from None
    for key, array in arrays:
        if not np.all(np.isfinite(array)):
            raise ModelSpecError(f"weights: {key} contains NaN or infinity")
    return arrays


def _vector_arrays(model: Model, metadata: dict, given: dict) -> list:
    """(key, float32 array) of the test vectors (formats/vectors.py): exactly those metadata.test_vectors needs."""
    shapes = vector_tensor_shapes(metadata, model)
    if set(given) != set(shapes):
        raise ModelSpecError(f"weights: the test vectors need tensors {sorted(shapes) or 'none'}, given {sorted(given)}")
    arrays = [(key, np.ascontiguousarray(given[key], dtype="<f4")) for key in shapes]
    for key, array in arrays:
        if array.shape != shapes[key]:
            raise ModelSpecError(f"weights: {key} has shape {list(array.shape)}, the test vectors need {list(shapes[key])}")
        if not np.all(np.isfinite(array)):
            raise ModelSpecError(f"weights: {key} contains NaN or infinity")
    return arrays


def encode_bin(model: Model, weights: dict, metadata: dict, dtypes: dict | None = None,
               alignment: int = DEFAULT_ALIGNMENT) -> bytes:
    """Serialize a model into .bin v1 bytes.

    `weights` must hold exactly the model's parameters (keys `<layer name>.<param>`), finite; an int8
    parameter comes with its float32 scales `<key>.scale` (what a loaded int8 .bin's tensors hold).
    `dtypes` maps a key to "float32" (the default), "float16" or "int8"; `fp16_dtypes(model)` and
    `int8_dtypes(model)` are the `--fp16` and `--int8` choices. Float weights asked for as int8 are
    quantized per output channel (formats/quantize.py). The metadata is checked by the reader's own
    rules, so what this writes loads. A metadata `gate` (formats/gate.py) comes with its `gate.*` tensors in
    `weights`, stored float32 after the parameters; metadata `test_vectors` (formats/vectors.py) with
    `test.inputs` and `test.outputs`, stored float32 last."""
    if alignment < MIN_ALIGNMENT or alignment > MAX_ALIGNMENT or alignment & (alignment - 1):
        raise ValueError(f"alignment {alignment} is not a power of two between {MIN_ALIGNMENT} and {MAX_ALIGNMENT}")
    graph_value = graph_of(model)
    graph = _writable_json(graph_value, "model description")
    try:
        _model_from(graph_value, metadata, graph)
    except LnnFormatError as err:
        raise ModelSpecError(str(err)) from None
    gate_keys = [key for key in weights if key.startswith(TENSOR_PREFIX)]
    vector_keys = [key for key in weights if key.startswith(VECTOR_PREFIX)]
    stored = _stored_arrays(model, {k: v for k, v in weights.items() if k not in gate_keys + vector_keys},
                            dtypes or {})
    stored += _gate_arrays(model, metadata, {key: weights[key] for key in gate_keys})
    stored += _vector_arrays(model, metadata, {key: weights[key] for key in vector_keys})
    names = [key.encode("utf-8") for key, _ in stored]
    table_offset = HEADER_SIZE
    string_offset = table_offset + TENSOR_ENTRY_SIZE * len(stored)
    strings = b"".join(names)
    meta = _writable_json(metadata, "metadata")
    graph_offset = string_offset + len(strings)
    meta_offset = graph_offset + len(graph)
    data_offset = _align(meta_offset + len(meta), alignment)

    entries, chunks, running, name_running, flags = [], [], 0, 0, 0
    for name, (_, array) in zip(names, stored):
        if array.dtype == np.float16:
            flags |= FLAG_FP16
        elif array.dtype == INT8:
            flags |= FLAG_INT8
        quant = QUANT_INT8_PER_CHANNEL if array.dtype == INT8 else QUANT_NONE
        shape = list(array.shape) + [0] * (MAX_NDIM - array.ndim)
        entries.append(TENSOR_ENTRY.pack(name_running, len(name), DTYPE_CODES[array.dtype], quant, array.ndim, 0,
                                         *shape, running, array.nbytes, 0))
        padded = _align(array.nbytes, alignment)
        chunks.append(array.tobytes() + bytes(padded - array.nbytes))
        running += padded
        name_running += len(name)
    body = (b"".join(entries) + strings + graph + meta + bytes(data_offset - meta_offset - len(meta))
            + b"".join(chunks))
    file_size = HEADER_SIZE + len(body)
    fields = [MAGIC, VERSION_MAJOR, VERSION_MINOR, HEADER_SIZE, flags, 0, ENDIAN_TAG, alignment,
              len(stored), TENSOR_ENTRY_SIZE, graph_offset, len(graph), meta_offset, len(meta), table_offset,
              string_offset, len(strings), data_offset, running, file_size, zlib.crc32(body), 0]
    fields[-1] = zlib.crc32(HEADER.pack(*fields))
    return HEADER.pack(*fields) + body


def _writable_json(value, what: str) -> bytes:
    """_json_bytes(value), or one LnnInputError line for text that UTF-8 cannot hold."""
    try:
        return _json_bytes(value)
    except UnicodeEncodeError as err:   # text in another encoding (an argument, a file name): UTF-8 cannot hold it
        raise LnnInputError(f"the {what} cannot be written: {surrogate_problem(err)} (text that is not UTF-8, such "
                            f"as a command-line argument or a file name in another encoding)") from None


def check_weight_shapes(expected: dict, shapes: dict) -> None:
    """Raise ModelSpecError unless `shapes` (key -> shape) has exactly the expected keys and shapes."""
    missing = [k for k in expected if k not in shapes]
    if missing:
        raise ModelSpecError(f"weights: missing {missing[0]!r} (shape {list(expected[missing[0]])})"
                             + (f" and {len(missing) - 1} more" if len(missing) > 1 else ""))
    extra = sorted(set(shapes) - set(expected))
    if extra:
        raise ModelSpecError(f"weights: {extra[0]!r} is not a parameter of the model; expected keys: {', '.join(expected)}")
    for key, shape in expected.items():
        if tuple(shapes[key]) != tuple(shape):
            raise ModelSpecError(f"weights: {key} has shape {list(shapes[key])}, the model expects {list(shape)}")


def check_weights(expected: dict, weights: dict) -> None:
    """Raise ModelSpecError unless `weights` has exactly the expected keys and shapes, all finite."""
    check_weight_shapes(expected, {key: np.shape(value) for key, value in weights.items()})
    check_finite_weights(weights, expected)


def check_finite_weights(weights: dict, keys=None) -> None:
    """Raise ModelSpecError naming the first weight (of `keys`, in their order; default all) that holds NaN or
    infinity, or a value beyond float32's range (a float64 1e300), in which the model computes and every
    stored type is made: it would become infinity there (and NaN in an int8 scale)."""
    for key in weights if keys is None else keys:
        value = np.asarray(weights[key])
        if not np.all(np.isfinite(value)):
            raise ModelSpecError(f"weights: {key} contains NaN or infinity")
        if value.dtype.kind == "f" and value.dtype.itemsize > 4 and np.abs(value).max(initial=0) > FLOAT32_MAX:
            raise ModelSpecError(f"weights: {key} has values beyond float32's range (±{FLOAT32_MAX:.4g}), in which "
                                 f"the model computes")


@contextlib.contextmanager
def atomic_output(path: str | Path, mode: str = "wb", **open_args):
    """`with atomic_output(path, "w", encoding="utf-8") as f:` writes a temporary file in the same folder;
    when the block ends without error it is flushed, fsynced and renamed over `path`; on any error
    (a full disk, Ctrl-C) it is removed, so `path` is either the old file or the complete new one.

    The file gets the permissions an ordinary new file would (0666 less the umask), not
    mkstemp's private 0600.

    `path` must be a regular file or not exist: a folder, named pipe, device or socket there is refused
    in one line (LnnInputError) before anything is written, since the rename would put a regular file in
    its place. A symbolic link is written through, as the shell's `>` does: the link stays and the file
    it names is replaced (or created, for a dangling link) the same atomic way."""
    import tempfile       # here, not at the top: its imports (shutil, random, ...) cost lnn-infer's start ~4 ms

    path = Path(path)
    try:
        target = _replaced_file(path)
        fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    except OSError as err:                       # e.g. a missing folder: name the target, not a temporary file
        raise OSError(err.errno, err.strerror, str(path)) from None
    try:
        umask = os.umask(0)
        os.umask(umask)
        if hasattr(os, "fchmod"):
            os.fchmod(fd, 0o666 & ~umask)
        with os.fdopen(fd, mode, **open_args) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
    except BaseException as err:
        if os.path.exists(tmp):
            os.unlink(tmp)
        if isinstance(err, OSError) and err.errno is not None and err.filename in (None, tmp):
            raise OSError(err.errno, err.strerror, str(path)) from None      # name the file in the one-line error
        raise


def _replaced_file(path: Path) -> Path:
    """The file atomic_output replaces: `path`, or the file a symbolic link there names (see atomic_output)."""
    try:
        target = Path(os.path.realpath(path, strict=True))
    except FileNotFoundError:
        return Path(os.path.realpath(path))                  # a new file (or the one a dangling link names)
    regular_file(path, "a regular output file", LnnInputError)
    return target


def refuse_writing_over_inputs(outputs, inputs) -> None:
    """Refuse (one LnnInputError line) an output that is the same file as one of the command's inputs, by
    name or through a symbolic or hard link: atomic_output would replace the input with the result, and
    `lnn-export t.bin --onnx t.bin` left an ONNX file where the model (its gate, calibration, thresholds)
    had been. The commands call this before any work, with the files they write and those they read
    (None: an option not given; a folder never matches a file). A path that does not exist is not an
    input's file: the reader of a missing input says so itself."""
    for output in filter(None, outputs):
        for source in filter(None, inputs):
            try:
                same = os.path.samefile(output, source)
            except OSError:
                continue
            if same:
                raise LnnInputError(f"{output}: the output is the same file as the input {source}; choose another "
                                    f"output file (writing it would replace the input)")


def write_atomic(path: str | Path, data: bytes) -> None:
    """Write `data` to `path` atomically (see atomic_output)."""
    with atomic_output(path) as f:
        f.write(data)


def write_bin(path, model: Model, weights: dict, metadata: dict | None = None, dtypes: dict | None = None) -> int:
    """encode_bin, then write atomically; returns the file size. Metadata defaults to build_metadata(model)."""
    data = encode_bin(model, weights, metadata if metadata is not None else build_metadata(model), dtypes)
    write_atomic(path, data)
    return len(data)


# --------------------------------------------------------------------------- reading

def read_bin(path: str | Path) -> BinModel:
    """Map and validate a .bin file; any problem raises LnnFormatError("<path>: <what is wrong>")."""
    path = Path(path)
    regular_file(path, "a model file", LnnFormatError)                               # rule 1
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size < HEADER_SIZE:                                                   # rule 2
                raise LnnFormatError(f"{path}: {size} bytes is too short for an lnn model (the header alone is "
                                     f"{HEADER_SIZE}); the file is truncated or not a model{_sniff(f.read(16))}")
            mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    except FileNotFoundError:                   # removed since the check
        raise LnnFormatError(f"{path}: no such file") from None
    except OSError as err:
        raise LnnFormatError(f"{path}: cannot read the file ({err.strerror or err})") from None
    try:
        return _parse(path, memoryview(mapped), mapped)
    except LnnFormatError as err:
        problem = str(err)
    # Out of the except block the failed parse's frames (and any view into the map) are gone.
    mapped.close()
    raise LnnFormatError(f"{path}: {problem}")


def parse_bin_bytes(data: bytes, name: str = "<bytes>") -> BinModel:
    """Validate and load from memory (tests and tools that hold the bytes); views into `data`."""
    if len(data) < HEADER_SIZE:                                                      # rule 2
        raise LnnFormatError(f"{name}: {len(data)} bytes is too short for an lnn model (the header alone is "
                             f"{HEADER_SIZE}){_sniff(bytes(data[:16]))}")
    try:
        return _parse(Path(name), memoryview(data), None)
    except LnnFormatError as err:
        raise LnnFormatError(f"{name}: {err}") from None


def _sniff(head: bytes) -> str:
    """A hint about what a non-model file is, from its first bytes."""
    from lnn.formats.npz import NPZ_MAGIC        # (zipfile: only for files that are not models)
    if head[:3] == b"\xff\xd8\xff":
        return " (it is a JPEG image)"
    if head[:8] == b"\x89PNG\r\n\x1a\n":
        return " (it is a PNG image)"
    if head[:4] == NPZ_MAGIC:
        return " (it is a zip archive, such as a NumPy .npz of weights: give lnn-export the model's description and --weights)"
    if head.lstrip()[:1] in (b"{", b"["):
        return " (it looks like JSON: pass a model description to lnn-export first)"
    if head[:1] == b"\x08" and head[1:2] in (b"\x03", b"\x04", b"\x05", b"\x06", b"\x07", b"\x08", b"\x09", b"\x0a"):
        return " (it looks like an ONNX file)"
    return ""


def _parse(path: Path, buf: memoryview, keep_alive) -> BinModel:
    size = len(buf)
    head = bytes(buf[:HEADER_SIZE])
    (magic, major, minor, header_size, flags_required, flags_optional, endian, alignment, count, entry_size,
     graph_offset, graph_size, meta_offset, meta_size, table_offset, string_offset, string_size,
     data_offset, data_size, file_size, body_crc, header_crc) = HEADER.unpack(head)
    if magic != MAGIC:                                                               # rule 3
        from lnn.formats.npz import is_checkpoint_bytes
        hint = (" (this is a training checkpoint: export it with lnn-export CHECKPOINT -o model.bin)"
                if is_checkpoint_bytes(buf) else _sniff(head))
        raise LnnFormatError(f"not an lnn model file: wrong magic bytes{hint}")
    if endian != ENDIAN_TAG:                                                         # rule 4
        raise LnnFormatError(f"endian tag is {endian:#010x}, not 0x01020304: the header is damaged or "
                             "the file was not written little-endian")
    if major != VERSION_MAJOR:                                                       # rule 5
        newer = major > VERSION_MAJOR
        raise LnnFormatError(f"format version {major}.{minor} " + (
            f"is newer than this lnn reads ({VERSION_MAJOR}.x): upgrade lnn" if newer
            else "is not a version lnn ever wrote"))
    if header_size < HEADER_SIZE or header_size % 8 or header_size > size:          # rule 6
        raise LnnFormatError(f"header_size {header_size} is invalid (at least {HEADER_SIZE}, "
                             f"a multiple of 8, within the file)")
    full_header = bytearray(buf[:header_size])
    full_header[HEADER_CRC_OFFSET:HEADER_CRC_OFFSET + 4] = bytes(4)
    if zlib.crc32(full_header) != header_crc:                                        # rule 7
        raise LnnFormatError("header checksum mismatch: the file is damaged; export or copy it again")
    if file_size != size:                                                            # rule 8
        raise LnnFormatError(f"the header says the file is {file_size} bytes but it is {size}: "
                             "the file is truncated or has bytes appended; copy it again")
    if zlib.crc32(buf[header_size:]) != body_crc:                                    # rule 9
        raise LnnFormatError("data checksum mismatch: the file is damaged; export or copy it again")
    unknown = flags_required & ~KNOWN_REQUIRED_FLAGS
    if unknown:                                                                      # rule 10
        raise LnnFormatError(f"requires features this lnn does not know (flags_required bits {unknown:#x}): upgrade lnn")
    if alignment < MIN_ALIGNMENT or alignment > MAX_ALIGNMENT or alignment & (alignment - 1):  # rule 11
        raise LnnFormatError(f"alignment {alignment} is not a power of two between {MIN_ALIGNMENT} and {MAX_ALIGNMENT}")
    if entry_size < TENSOR_ENTRY_SIZE or entry_size % 8:                             # rule 12
        raise LnnFormatError(f"tensor_entry_size {entry_size} is invalid (at least {TENSOR_ENTRY_SIZE}, a multiple of 8)")
    if count > MAX_TENSORS:                                                          # rule 13
        raise LnnFormatError(f"tensor_count {count} is over the limit of {MAX_TENSORS}")

    # Sections lie back to back in a fixed order; anything else is refused.
    expected_layout = [("tensor table", table_offset, header_size, count * entry_size),
                       ("string table", string_offset, None, string_size),
                       ("graph JSON", graph_offset, None, graph_size),
                       ("metadata JSON", meta_offset, None, meta_size)]
    position = None
    for name, offset, must_be, length in expected_layout:
        must_be = position if must_be is None else must_be
        if offset != must_be:                                                        # rule 14
            raise LnnFormatError(f"{name} starts at offset {offset}, expected {must_be} (sections must follow each other)")
        if length > size - offset:                                                   # rule 15
            raise LnnFormatError(f"{name} ({length} bytes at offset {offset}) runs past the end of the file")
        position = offset + length
    if data_offset != _align(position, alignment):                                   # rule 16
        raise LnnFormatError(f"data section starts at {data_offset}, expected {_align(position, alignment)} "
                             f"(after the metadata, aligned to {alignment})")
    if data_offset > size or any(bytes(buf[position:data_offset])):                  # rule 17
        raise LnnFormatError("padding before the data section is not zero or runs past the end of the file")
    if data_size != size - data_offset:                                              # rule 18
        raise LnnFormatError(f"data section is {data_size} bytes, but {size - data_offset} bytes follow its start")

    graph, graph_bytes = _read_json(buf, graph_offset, graph_size, "graph JSON")
    metadata, _ = _read_json(buf, meta_offset, meta_size, "metadata JSON")
    entries = _read_tensor_table(buf, count, entry_size, table_offset, string_offset, string_size,
                                 data_offset, data_size, alignment)
    for flag, dtype, what in ((FLAG_FP16, np.float16, "fp16"), (FLAG_INT8, INT8, "int8")):
        if any(entry.dtype == dtype for entry in entries) != bool(flags_required & flag):   # rule 39
            raise LnnFormatError(f"the {what} flag in flags_required does not match the stored tensor types")
    model = _model_from(graph, metadata, graph_bytes)
    _check_entries_match(model, entries, metadata)
    tensors = {}
    for entry in entries:
        array = np.frombuffer(buf, dtype=entry.dtype, count=math.prod(entry.shape), offset=entry.start)
        if not np.isfinite(array).all():                                             # rule 51
            raise LnnFormatError(f"tensor {entry.name!r} contains NaN or infinity")
        array = array.reshape(entry.shape)
        array.flags.writeable = False
        tensors[entry.name] = array
    _check_int8(entries, tensors)
    return BinModel(path, model, tensors, metadata, (major, minor), alignment, keep_alive, (header_crc, body_crc))


def _read_json(buf, offset: int, size: int, what: str) -> tuple:
    """(the section's JSON object, its bytes: its canonical encoding)."""
    if size > MAX_JSON_BYTES:                                                        # rule 19
        raise LnnFormatError(f"{what} is {size} bytes, over the limit of {MAX_JSON_BYTES}")
    raw = bytes(buf[offset:offset + size])
    try:                                                                             # rule 20
        value = loads_json(raw.decode("utf-8"))
    except RecursionError:
        raise LnnFormatError(f"{what} nests deeper than {MAX_JSON_DEPTH} levels") from None
    except (UnicodeDecodeError, ValueError) as err:
        raise LnnFormatError(f"{what} is not valid UTF-8 JSON ({err})") from None
    if json_nesting_depth(raw) > MAX_JSON_DEPTH:                                         # rule 21
        raise LnnFormatError(f"{what} nests deeper than {MAX_JSON_DEPTH} levels")
    try:
        canonical = _json_bytes(value)
    except UnicodeEncodeError as err:                                                # rule 20
        raise LnnFormatError(f"{what} is not valid UTF-8 JSON ({surrogate_problem(err)})") from None
    if not isinstance(value, dict):                                                  # rule 22
        raise LnnFormatError(f"{what} must be a JSON object, not {type(value).__name__}")
    if canonical != raw:                                                             # rule 23
        raise LnnFormatError(f"{what} is not in canonical form (sorted keys, compact separators, "
                             "UTF-8 without escapes, each key once)")
    return value, raw


@dataclass
class _Entry:
    """One validated tensor table entry: where its data lies in the buffer."""

    name: str
    dtype: np.dtype
    quant: int
    shape: tuple
    start: int


def _read_tensor_table(buf, count, entry_size, table_offset, string_offset, string_size, data_offset, data_size,
                       alignment) -> list:
    entries, names, running, name_running = [], set(), 0, 0
    for i in range(count):
        entry_start = table_offset + i * entry_size
        (name_off, name_len, dtype_code, quant, ndim, reserved8, *rest) = TENSOR_ENTRY.unpack(
            bytes(buf[entry_start:entry_start + TENSOR_ENTRY_SIZE]))
        shape_slots, (offset, nbytes, reserved64) = rest[:MAX_NDIM], rest[MAX_NDIM:]
        where = f"tensor {i}"
        if (name_off != name_running or name_len == 0 or name_len > MAX_NAME_BYTES
                or name_off + name_len > string_size):                               # rule 24
            raise LnnFormatError(f"{where}: name at {name_off} (+{name_len} bytes) is not the next name in the "
                                 f"string table (names are 1 to {MAX_NAME_BYTES} bytes, packed in table order)")
        try:                                                                         # rule 25
            name = bytes(buf[string_offset + name_off:string_offset + name_off + name_len]).decode("utf-8")
        except UnicodeDecodeError:
            raise LnnFormatError(f"{where}: name is not valid UTF-8") from None
        name_running += name_len
        where = f"tensor {i} ({name})"
        if name in names:                                                            # rule 26
            raise LnnFormatError(f"{where}: the name appears twice")
        names.add(name)
        if dtype_code not in DTYPES:                                                 # rule 27
            raise LnnFormatError(f"{where}: unknown dtype code {dtype_code} (1 is float32, 2 is float16, 3 is int8)")
        if quant not in QUANT_CODES:                                                 # rule 28
            raise LnnFormatError(f"{where}: unknown quantization code {quant}")
        if reserved8 or reserved64 or any(bytes(buf[entry_start + TENSOR_ENTRY_SIZE:entry_start + entry_size])):  # rule 29
            raise LnnFormatError(f"{where}: reserved fields are not zero")
        if not 1 <= ndim <= MAX_NDIM:                                                # rule 30
            raise LnnFormatError(f"{where}: {ndim} dimensions; a tensor has 1 to {MAX_NDIM}")
        shape = tuple(shape_slots[:ndim])
        if any(shape_slots[ndim:]) or 0 in shape:                                    # rule 31
            raise LnnFormatError(f"{where}: shape slots {list(shape_slots)} do not match ndim {ndim} "
                                 "(the first ndim are positive, the rest zero)")
        elements = math.prod(shape)
        if elements > MAX_TENSOR_ELEMENTS:                                           # rule 32
            raise LnnFormatError(f"{where}: {elements} elements, over the limit of {MAX_TENSOR_ELEMENTS}")
        dtype = DTYPES[dtype_code]
        if nbytes != elements * dtype.itemsize:                                      # rule 33
            raise LnnFormatError(f"{where}: {nbytes} bytes do not match shape {list(shape)} of {dtype.name}")
        if offset != running:                                                        # rule 34
            raise LnnFormatError(f"{where}: data offset {offset}, expected {running} "
                                 "(tensors are packed in table order, each padded to the alignment)")
        padded = _align(nbytes, alignment)
        if running + padded > data_size:                                             # rule 35
            raise LnnFormatError(f"{where}: data ({nbytes} bytes at {offset}) runs past the data section")
        start = data_offset + offset
        if any(bytes(buf[start + nbytes:start + padded])):                           # rule 36
            raise LnnFormatError(f"{where}: padding after the data is not zero")
        entries.append(_Entry(name, dtype, quant, shape, start))
        running += padded
    if name_running != string_size:                                                  # rule 37
        raise LnnFormatError(f"string table is {string_size} bytes but the names use {name_running}")
    if running != data_size:                                                         # rule 38
        raise LnnFormatError(f"data section is {data_size} bytes but the tensors use {running}")
    return entries


def _model_from(graph: dict, metadata: dict, graph_bytes: bytes) -> Model:
    """Parse the graph with the metadata's labels and preprocessing; check both are complete and agree.
    graph_bytes: the graph's canonical encoding (_json_bytes(graph)), which its caller has made."""
    missing = [key for key in REQUIRED_METADATA if key not in metadata]
    if missing:                                                                      # rule 40
        raise LnnFormatError(f"metadata lacks the required field {missing[0]!r}")
    desc = dict(graph)
    desc["labels"] = metadata["labels"]
    if metadata["preprocess"] is not None:
        desc["preprocess"] = metadata["preprocess"]
    for key in OPTIONAL_METADATA:
        if key in metadata:
            desc[key] = metadata[key]
    try:                                                                             # rule 41
        model = parse_model(desc, check_sizes=False)
    except ModelSpecError as err:
        section = "metadata" if str(err).startswith(("labels", "preprocess")) else "graph"
        raise LnnFormatError(f"{section}: {err}") from None
    too_many_inputs, too_many_params, too_much_activation = size_refusals(model.input_shape, model.nodes)
    if too_many_inputs:                                                              # rule 57
        raise LnnFormatError(f"graph: {too_many_inputs}")
    if too_many_params:                                                              # rule 58
        raise LnnFormatError(f"graph: {too_many_params}")
    if too_much_activation:                                                          # rule 59
        raise LnnFormatError(f"graph: {too_much_activation}")
    if _json_bytes(graph_of(model)) != graph_bytes:                                  # rule 42
        raise LnnFormatError("graph: not the normalized model description (every layer attribute written out, "
                             "nothing else); re-export the model")
    input_meta = {"shape": list(model.input_shape), "layout": input_layout(model.input_shape), "dtype": "float32"}
    if metadata["input"] != input_meta:                                              # rule 43
        raise LnnFormatError(f"metadata: input is {metadata['input']!r}, the graph needs {input_meta!r}")
    if metadata["preprocess"] != model.preprocess:                                   # rule 44
        raise LnnFormatError(f"metadata: preprocess must be complete: {model.preprocess!r}")
    if metadata["labels"] != model.labels:                                           # rule 45
        raise LnnFormatError("metadata: labels must be complete objects {name, display[, advice]}, "
                             "one per output")
    for key in ("producer", "producer_version"):
        if not isinstance(metadata[key], str) or not metadata[key]:                  # rule 46
            raise LnnFormatError(f"metadata: {key} must be a non-empty string")
    check_gate_metadata(metadata, model)                                             # rules G1-G5, G7, G8
    check_vectors_metadata(metadata)                                                 # rule V1
    return model


def _check_entries_match(model: Model, entries: list, metadata: dict) -> None:
    stored = {entry.name: entry for entry in entries}
    expected = {}                     # the graph's parameters, each int8 one followed by its scales
    for key, shape in model.param_shapes().items():
        expected[key] = shape
        if key in stored and stored[key].dtype == INT8:
            expected[scale_key(key)] = tuple(shape[:1])
    gate = gate_tensor_shapes(metadata, model, {name: entry.shape for name, entry in stored.items()})
    for key, shape in expected.items():
        if key not in stored:                                                        # rule 47
            raise LnnFormatError(f"the graph needs tensor {key!r} (shape {list(shape)}) but the file has none")
        if stored[key].shape != tuple(shape):                                        # rule 48
            raise LnnFormatError(f"tensor {key!r} has shape {list(stored[key].shape)}, its layer expects {list(shape)}")
    missing = [key for key in gate if key not in stored]
    if missing:                                                                      # rule G6
        raise LnnFormatError(f"metadata.gate needs tensor {missing[0]!r} but the file has none")
    check_gate_tensor_shapes(gate, {key: stored[key].shape for key in gate})         # rule G6
    not_float32 = [key for key in gate if stored[key].dtype != np.float32]
    if not_float32:                                                                  # rule G6
        raise LnnFormatError(f"tensor {not_float32[0]!r}: gate tensors are float32, not {stored[not_float32[0]].dtype.name}")
    vectors = vector_tensor_shapes(metadata, model)
    for key, shape in vectors.items():
        if key not in stored:                                                        # rule V2
            raise LnnFormatError(f"metadata.test_vectors needs tensor {key!r} but the file has none")
        if stored[key].shape != shape:                                               # rule V2
            raise LnnFormatError(f"tensor {key!r} has shape {list(stored[key].shape)}, the test vectors need {list(shape)}")
        if stored[key].dtype != np.float32:                                          # rule V2
            raise LnnFormatError(f"tensor {key!r}: test vectors are float32, not {stored[key].dtype.name}")
    extra = [name for name in stored if name not in expected and name not in gate and name not in vectors]
    if extra:                                                                        # rule 49
        unused = {TENSOR_PREFIX: " (and metadata.gate does not use it)",
                  VECTOR_PREFIX: " (and the metadata has no test_vectors)"}
        raise LnnFormatError(f"tensor {extra[0]!r} belongs to no layer of the graph"
                             + next((why for prefix, why in unused.items() if extra[0].startswith(prefix)), ""))
    if list(stored) != list(expected) + list(gate) + list(vectors):                  # rule 50
        raise LnnFormatError("tensors are not stored in the graph's layer order (the gate's tensors, then the "
                             "test vectors, last)")


def _check_int8(entries: list, tensors: dict) -> None:
    """The int8 rules, once every tensor is in place: codes, scales, range."""
    for entry in entries:
        if (entry.dtype == INT8) != (entry.quant == QUANT_INT8_PER_CHANNEL):         # rule 52
            raise LnnFormatError(f"tensor {entry.name!r}: quantization code {entry.quant} with dtype "
                                 f"{entry.dtype.name} (int8 tensors, and only they, have code 1)")
        if entry.dtype != INT8:
            continue
        if len(entry.shape) < 2:                                                     # rule 53
            raise LnnFormatError(f"tensor {entry.name!r}: int8 with {len(entry.shape)} dimension; int8 is per "
                                 "output channel, for tensors of 2 or more dimensions")
        scale = tensors[scale_key(entry.name)]
        if scale.dtype != np.float32:                                                # rule 54
            raise LnnFormatError(f"tensor {scale_key(entry.name)!r}: scales are float32, not {scale.dtype.name}")
        if not (scale > 0).all():                                                    # rule 55
            raise LnnFormatError(f"tensor {scale_key(entry.name)!r}: a scale is zero or negative")
        if (tensors[entry.name] == -QMAX - 1).any():                                 # rule 56
            raise LnnFormatError(f"tensor {entry.name!r}: holds -128; int8 weights are symmetric, -127 to 127")
