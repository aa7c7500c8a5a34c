"""The hostile-input corpus, generated at test time into a folder (nothing big lives in the repository).

`build_corpus(folder)` writes every file the cases in test_hostile.py name and returns {name: path}
(strings, ready for a command line). Kinds:
  photos   good ones that must be answered (a JPEG with bytes after its end marker, 16-bit PNG, grey
           JPEG, CMYK JPEG, a JPEG with a near-64 KiB EXIF block) and bad ones (truncated, half a JPEG with
           its end marker pasted on, a PNG failing its CRC, one byte flipped, not an image, empty, a folder, a named pipe, a symlink loop, /dev/zero, a valid
           33000x33000 PNG bomb and a 30000x30000 one, a JPEG whose header claims 65000x65000)
  models   tomato_leaf.bin truncated, bit-flipped, random bytes after the magic; a valid tiny .bin whose
           input is 3x50000x50000; a valid .bin whose output is NaN; an int8 .bin; a checkpoint
  descriptions  out_features 10**12, nesting 100,000 deep, wrong types, NaN and 1e999 numbers,
           3,000 layers; a weights .npz whose header claims a 100000x100000 array
  ONNX     garbage bytes, a truncated export, an input of 3x50000x50000
  data     a tiny image-folder dataset (2 classes of noise photos), a cache folder already holding it,
           one with bad files among them
"""

from __future__ import annotations

import io
import json
import os
import shutil
import struct
import sys
import zipfile
import zlib
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests" / "formats"))   # test_binfile's own SPEC writer crafts what lnn's refuses
LEAVES = REPO / "examples" / "leaves"
TOMATO = REPO / "models" / "tomato_leaf.bin"
GOOD_LEAVES = ("healthy.jpg", "late_blight.jpg")

TINY_DESCRIPTION = {
    "name": "tiny", "input_shape": [3, 16, 16],
    "preprocess": {"color": "rgb", "scale": 1 / 255, "mean": [0.5, 0.5, 0.5], "std": [0.25, 0.25, 0.25]},
    "layers": [{"type": "conv2d", "out_channels": 4, "kernel_size": 3, "padding": 1, "activation": "relu"},
               {"type": "global_avg_pool"}, {"type": "flatten"}, {"type": "linear", "out_features": 2}],
    "labels": ["a", "b"],
    "training": {"epochs": 1, "batch_size": 4},
}
POOLED_LAYERS = [{"type": "global_avg_pool"}, {"type": "flatten"}, {"type": "linear", "out_features": 2}]


def png_bytes(width: int, height: int, rows: bytes, bit_depth: int = 8, color_type: int = 2) -> bytes:
    """A valid PNG from its filtered rows (zlib-compressed here, in one IDAT chunk)."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    header = struct.pack(">IIBBBBB", width, height, bit_depth, color_type, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", rows) + chunk(b"IEND", b"")


def png_bomb(side: int) -> bytes:
    """A valid side x side black 1-bit PNG: about side**2 / 8 bytes of zlib input, a few hundred KB on
    disk, side**2 * 3 bytes once decoded to BGR (3.3 GB for 33000)."""
    compressor = zlib.compressobj(9)
    row = bytes(1 + (side + 7) // 8)                  # filter byte 0, then the row's bits
    block = row * 1024
    parts = [compressor.compress(block) for _ in range(side // 1024)]
    parts += [compressor.compress(row * (side % 1024)), compressor.flush()]
    return png_bytes(side, side, b"".join(parts), bit_depth=1, color_type=0)


def jpeg_with_size(jpeg: bytes, width: int, height: int) -> bytes:
    """The JPEG with its frame header (SOF0/SOF2) claiming another size; the data stays as it was."""
    for marker in (b"\xff\xc0", b"\xff\xc2"):
        at = jpeg.find(marker)
        if at > 0:
            return jpeg[:at + 5] + struct.pack(">HH", height, width) + jpeg[at + 9:]
    raise AssertionError("no SOF marker")


def pillow_jpeg(image, **options) -> bytes:
    out = io.BytesIO()
    image.save(out, format="JPEG", **options)
    return out.getvalue()


def leaf_variants(folder: Path) -> dict:
    """Good photos of other kinds, made from a sample leaf with Pillow."""
    from PIL import Image

    leaf = Image.open(LEAVES / "healthy.jpg").convert("RGB")
    made = {}
    made["trailing.jpg"] = (LEAVES / "healthy.jpg").read_bytes() + b"\x00" * 64 + b"trailing bytes of a phone's own"
    made["gray.jpg"] = pillow_jpeg(leaf.convert("L"))
    made["cmyk.jpg"] = pillow_jpeg(leaf.convert("CMYK"))
    exif = Image.Exif()
    exif[0x010E] = "x" * 60000                         # ImageDescription: the EXIF block near its 64 KiB limit
    exif[0x0112] = 6                                   # orientation: rotated
    made["exif.jpg"] = pillow_jpeg(leaf, exif=exif.tobytes())
    deep = (np.asarray(leaf, np.uint16) * 257).astype(">u2")          # 16-bit RGB PNG, big-endian rows
    rows = b"".join(b"\x00" + deep[y].tobytes() for y in range(deep.shape[0]))
    made["png16.png"] = png_bytes(deep.shape[1], deep.shape[0], zlib.compress(rows), bit_depth=16)
    for name, data in made.items():
        (folder / name).write_bytes(data)
    return {name: str(folder / name) for name in made}


def crc_damaged_png() -> bytes:
    """A leaf as PNG with one byte of its image data changed (its chunk's CRC no longer matches)."""
    import cv2

    data = bytearray(cv2.imencode(".png", cv2.imread(str(LEAVES / "late_blight.jpg")))[1].tobytes())
    data[data.index(b"IDAT") + 100] ^= 0x01
    return bytes(data)


def bad_photos(folder: Path) -> dict:
    leaf = (LEAVES / "late_blight.jpg").read_bytes()
    flipped = bytearray(leaf)
    flipped[len(leaf) // 2] ^= 0xFF
    files = {
        "truncated.jpg": leaf[:len(leaf) // 2],
        "ended_early.jpg": leaf[:len(leaf) // 2] + b"\xff\xd9",   # a broken copy's half, its end marker pasted on
        "crc_damaged.png": crc_damaged_png(),
        "bitflip.jpg": bytes(flipped),
        "text.jpg": b"this is a shopping list, not a photo\n" * 20,
        "empty.png": b"",
        "garbage.png": b"\x89PNG\r\n\x1a\n" + os.urandom(2000) + b"IEND\xaeB`\x82",
        "bomb33000.png": png_bomb(33000),
        "bomb30000.png": png_bomb(30000),
        "jpeg_bomb.jpg": jpeg_with_size(leaf, 65000, 65000),
    }
    for name, data in files.items():
        (folder / name).write_bytes(data)
    paths = {name: str(folder / name) for name in files}
    (folder / "folder.jpg").mkdir()
    os.mkfifo(folder / "pipe.jpg")                     # no writer: opening it to read blocks for ever
    os.symlink(folder / "loop_b.jpg", folder / "loop_a.jpg")
    os.symlink(folder / "loop_a.jpg", folder / "loop_b.jpg")
    paths.update({name: str(folder / name) for name in ("folder.jpg", "pipe.jpg", "loop_a.jpg")})
    paths["dev_zero"] = "/dev/zero"
    return paths


def mixed_folder(folder: Path, good: dict, bad: dict) -> tuple[str, list]:
    """A folder of good photos and bad files side by side; -> (its path, the good photos' paths in it)."""
    folder.mkdir()
    answered = []
    for name in GOOD_LEAVES:
        shutil.copy(LEAVES / name, folder / name)
        answered.append(str(folder / name))
    for name, path in good.items():
        shutil.copy(path, folder / name)
        answered.append(str(folder / name))
    for name in ("truncated.jpg", "ended_early.jpg", "crc_damaged.png", "text.jpg", "empty.png", "garbage.png",
                 "bomb33000.png", "jpeg_bomb.jpg"):
        shutil.copy(bad[name], folder / name)
    os.mkfifo(folder / "pipe.jpg")
    return str(folder), sorted(answered)


def tiny_bins(folder: Path) -> dict:
    """Valid .bin files that are hostile by content."""
    from lnn.formats.binfile import write_bin
    from lnn.formats.model import parse_model

    def write(name: str, description: dict, weight_value=None) -> str:
        model = parse_model(description)
        rng = np.random.default_rng(0)
        weights = {key: (rng.standard_normal(shape) * 0.3 if weight_value is None else np.full(shape, weight_value))
                   .astype(np.float32) for key, shape in model.param_shapes().items()}
        write_bin(folder / name, model, weights)
        return str(folder / name)

    # Every weight 3e38 (finite): the first linear layer's outputs are huge and equal, the second's are all
    # +inf or all -inf, and the softmax of those is NaN.
    nan = {**TINY_DESCRIPTION, "layers": [*POOLED_LAYERS[:2], {"type": "linear", "out_features": 4},
                                          {"type": "linear", "out_features": 2}]}
    return {"tiny.bin": write("tiny.bin", TINY_DESCRIPTION),
            "huge_input.bin": huge_input_bin(folder / "huge_input.bin"),
            "nan_output.bin": write("nan_output.bin", nan, weight_value=3e38)}


def huge_input_bin(path: Path) -> str:
    """A valid .bin of about 1 KB whose input is 3x50000x50000: the network of POOLED_LAYERS (8 parameters,
    whatever the input size) with its normalized graph and metadata made at 16x16 and the size changed,
    written by the SPEC tests' own writer (lnn's refuses a model over its size limits)."""
    from test_binfile import build, canonical, join, tiny_tensors

    from lnn.formats.binfile import build_metadata, graph_of
    from lnn.tests.model_weights import random_weights
    from lnn.formats.model import parse_model

    small = parse_model({**TINY_DESCRIPTION, "layers": POOLED_LAYERS})
    graph, metadata = graph_of(small), build_metadata(small)
    graph["input_shape"] = metadata["input"]["shape"] = [3, 50000, 50000]
    metadata["preprocess"]["resize"] = [50000, 50000]
    path.write_bytes(join(build(canonical(graph), canonical(metadata), tiny_tensors(small, random_weights(small)))))
    return str(path)


def damaged_bins(folder: Path) -> dict:
    data = TOMATO.read_bytes()
    files = {"truncated.bin": data[:len(data) // 2], "random.bin": data[:8] + os.urandom(4096)}
    for name, offset in (("flip_header.bin", 40), ("flip_table.bin", 200), ("flip_tensor.bin", len(data) - 1000)):
        flipped = bytearray(data)
        flipped[offset] ^= 0x10
        files[name] = bytes(flipped)
    for name, content in files.items():
        (folder / name).write_bytes(content)
    return {name: str(folder / name) for name in files}


def replaced(text: str, old: str, new: str) -> str:
    assert old in text, old
    return text.replace(old, new)


def descriptions(folder: Path) -> dict:
    tiny = json.dumps(TINY_DESCRIPTION)
    scale = f'"scale": {json.dumps(1 / 255)}'
    texts = {
        "out_features_huge.json": json.dumps({"input_shape": [4], "layers": [{"type": "linear", "out_features": 10**12}]}),
        "deep.json": "[" * 100_000 + "]" * 100_000,
        "deep_object.json": '{"a":' * 100_000 + "1" + "}" * 100_000,
        "wrong_types.json": json.dumps({"input_shape": "3x16x16", "layers": {"type": "linear"}}),
        "wrong_layer_types.json": replaced(tiny, '"out_channels": 4', '"out_channels": "four"'),
        "negative_shape.json": replaced(tiny, "[3, 16, 16]", "[3, -16, 16]"),
        "huge_shape.json": replaced(tiny, "[3, 16, 16]", "[3, 100000000000000000000, 16]"),
        "nan.json": replaced(tiny, scale, '"scale": NaN'),
        "infinite.json": replaced(tiny, scale, '"scale": 1e999'),
        "tiny.json": tiny,
        "many_layers.json": json.dumps({"input_shape": [8], "labels": ["a", "b"],
                                        "layers": [{"type": "linear", "out_features": 8, "activation": "relu"}] * 3000
                                        + [{"type": "linear", "out_features": 2}]}),
    }
    for name, text in texts.items():
        (folder / name).write_text(text)
    (folder / "not_utf8.json").write_bytes(b'{"name": "\xff\xfe"}')
    return {name: str(folder / name) for name in [*texts, "not_utf8.json"]}


def lying_npz(path: Path) -> str:
    """A small .npz whose conv weight entry's header claims a 100000 x 100000 float32 array."""
    header = "{'descr': '<f4', 'fortran_order': False, 'shape': (100000, 100000), }"
    header += " " * (63 - (10 + len(header)) % 64) + "\n"
    npy = b"\x93NUMPY\x01\x00" + struct.pack("<H", len(header)) + header.encode("latin1") + bytes(50_000)
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as archive:
        archive.writestr("conv2d_0.weight.npy", npy)
    return str(path)


def onnx_files(folder: Path, tiny_bin: str) -> dict:
    """Garbage, a truncated export of the tiny model, and one whose input is 3x50000x50000."""
    import onnx

    from lnn.formats.binfile import read_bin
    from lnn.formats.onnx_export import export_bin_to_onnx

    good = folder / "tiny.onnx"
    export_bin_to_onnx(read_bin(tiny_bin), good)
    data = good.read_bytes()
    (folder / "truncated.onnx").write_bytes(data[:len(data) // 2])
    (folder / "garbage.onnx").write_bytes(b"\x08\x07" + os.urandom(3000))
    proto = onnx.load(str(good))
    dims = proto.graph.input[0].type.tensor_type.shape.dim
    for dim, value in zip(dims[1:], (3, 50000, 50000)):
        dim.dim_value = value
    del proto.metadata_props[:]                       # lnn-export's preprocessing would not match the new size
    onnx.save(proto, str(folder / "huge_input.onnx"))
    return {name: str(folder / name) for name in ("tiny.onnx", "truncated.onnx", "garbage.onnx", "huge_input.onnx")}


def noise_dataset(folder: Path, per_class: int = 4, extra: dict | None = None) -> str:
    """folder/<label>/*.png of random pixels (not zeros) for the tiny model's two labels; `extra` adds files to a/."""
    import cv2

    rng = np.random.default_rng(1)
    for label in TINY_DESCRIPTION["labels"]:
        (folder / label).mkdir(parents=True)
        for i in range(per_class):
            assert cv2.imwrite(str(folder / label / f"Leaf {label}{i}.png"), rng.integers(0, 256, (20, 20, 3), np.uint8))
    for name, source in (extra or {}).items():
        shutil.copy(source, folder / "a" / name)
    return str(folder)


def int8_and_checkpoint(folder: Path, tiny_bin: str) -> dict:
    from lnn.formats.binfile import encode_bin, int8_dtypes, read_bin, write_atomic
    from lnn.train.checkpoint import save_checkpoint

    tomato = read_bin(TOMATO)
    metadata = {key: value for key, value in tomato.metadata.items() if key != "test_vectors"}   # fp32 outputs
    write_atomic(folder / "int8.bin", encode_bin(tomato.model, {**tomato.weights_fp32(), **tomato.gate_tensors}, metadata,
                                                 int8_dtypes(tomato.model)))
    tiny = read_bin(tiny_bin)
    save_checkpoint(folder / "checkpoint.npz", {"description": tiny.model.to_description(), "epoch": 1},
                    tiny.weights_fp32(), {})
    damaged = folder / "damaged_run"
    damaged.mkdir()
    save_checkpoint(damaged / "checkpoint.npz", {"description": {"layers": "not a list"}, "epoch": 1}, {}, {})
    return {"int8.bin": str(folder / "int8.bin"), "checkpoint.npz": str(folder / "checkpoint.npz"),
            "damaged_run": str(damaged)}


def warm_cache(folder: Path, data: str) -> str:
    """An LNN_CACHE_DIR already holding the decoded tiny dataset, so a command can run with no room to write."""
    from lnn.train.images import ImageFolder

    ImageFolder.load(data, TINY_DESCRIPTION["input_shape"], "rgb", cache_root=folder / "datasets", progress=False)
    return str(folder)


def unwritable_folder(folder: Path) -> str:
    """A cache folder nothing can be written into: read-only, or (for root, whom modes do not stop) a
    path under a regular file."""
    folder.mkdir()
    if os.geteuid() == 0:
        (folder / "a_file").write_text("not a folder\n")
        return str(folder / "a_file" / "cache")
    folder.chmod(0o555)
    return str(folder)


def build_corpus(root: Path) -> dict:
    corpus = {"leaf": str(LEAVES / "healthy.jpg"), "tomato": str(TOMATO), "root": str(root)}
    for sub in ("photos", "bad", "models", "descriptions", "onnx", "out"):
        (root / sub).mkdir()
    good = leaf_variants(root / "photos")
    bad = bad_photos(root / "bad")
    corpus.update(good)
    corpus.update(bad)
    corpus["mixed"], corpus["mixed_good"] = mixed_folder(root / "mixed", good, bad)
    corpus.update(tiny_bins(root / "models"))
    corpus.update(damaged_bins(root / "models"))
    corpus.update(descriptions(root / "descriptions"))
    corpus["lying.npz"] = lying_npz(root / "models" / "lying.npz")
    corpus.update(onnx_files(root / "onnx", corpus["tiny.bin"]))
    corpus.update(int8_and_checkpoint(root / "models", corpus["tiny.bin"]))
    corpus["data"] = noise_dataset(root / "data")
    corpus["bad_data"] = noise_dataset(root / "bad_data", extra={name: bad[name] for name in
                                                                ("bomb33000.png", "truncated.jpg", "ended_early.jpg",
                                                                 "text.jpg")})
    corpus["warm_cache"] = warm_cache(root / "warm_cache", corpus["data"])
    corpus["unwritable"] = unwritable_folder(root / "unwritable")
    corpus["old.onnx"] = str(root / "out" / "old.onnx")
    Path(corpus["old.onnx"]).write_bytes(b"an older export that must survive a failed one")
    return corpus
