"""Fuzz targets for what reads untrusted bytes: the .bin reader, the model-description parser, image decoding.

The property, for every input: a valid result, or an LnnError subclass. Never any other exception, a
hang (HANG_S per input) or a huge allocation (the fuzzing process runs under RLIMIT_AS = MEMORY_LIMIT,
so one turns into a MemoryError, which fails the property). A valid result is also used: a parsed
description small enough is run by the NumPy backend and must give its declared output shape; a
decoded image must be HxWx3 uint8 and preprocess to the declared [C, H, W].

    python -m lnn.tests.fuzz --seconds 600                    # all targets, time split between them
    python -m lnn.tests.fuzz --seconds 600 --target bin       # one target
    python -m lnn.tests.fuzz --examples 150 --seed 0          # the fixed short run tests/test_fuzz.py makes
    python -m lnn.tests.fuzz --engine atheris --seconds 600   # coverage-guided (pip install 'lnn[fuzz]')

Engines: hypothesis (the dev extra) draws inputs by mutating seed inputs (bit flips, overwrites with
boundary integers, insertions, deletions, truncation; for descriptions also replacing a JSON value
anywhere in the tree), and shrinks a failure to a small input. atheris (libFuzzer, coverage-guided,
Linux wheels) mutates the same seeds, keeping inputs that reach new code. Each target takes bytes:
a .bin input's first byte says whether to repair its size field and both checksums after mutation
(so mutations get past the checksums into the tensor table and the JSON); a description input is
the JSON text. A failing input is written to FAILURES/<target>-<sha1>.bin and the run exits 1.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import resource
import signal
import struct
import sys
import time
import zlib
from pathlib import Path

import numpy as np

from lnn.formats.errors import LnnError
from lnn.tests.model_weights import random_weights

REPO = Path(__file__).resolve().parents[1]
FAILURES = Path("fuzz-failures")
MEMORY_LIMIT = 1 << 30            # bytes of address space for the fuzzing process
HANG_S = 5                        # seconds one input may take
RUN_ELEMENTS = 1 << 16            # a parsed model is run when its input has at most this many elements ...
RUN_FLOPS = 5e7                   # ... and it needs at most this many FLOPs per sample
IMAGE_PREPROCESS = {"color": "rgb", "scale": 1 / 255, "mean": [0.5, 0.5, 0.5], "std": [0.25, 0.25, 0.25]}
REPAIR, AS_IS = b"\x01", b"\x00"  # the first byte of a .bin input


class Hang(Exception):
    """An input took longer than HANG_S (raised by SIGALRM)."""


# --------------------------------------------------------------------------- the targets

def with_repaired_header(data: bytes) -> bytes:
    """The .bin bytes with file_size and both CRC32s made to match (the reader's cheap first checks)."""
    from lnn.formats.binfile import HEADER, HEADER_CRC_OFFSET, HEADER_SIZE

    if len(data) < HEADER_SIZE:
        return data
    fields = list(HEADER.unpack(data[:HEADER_SIZE]))
    header_size = fields[3]
    if not HEADER_SIZE <= header_size <= len(data):
        return data
    fields[-3] = len(data)                                        # file_size
    fields[-2] = zlib.crc32(data[header_size:])                   # body crc
    fields[-1] = 0
    head = bytearray(HEADER.pack(*fields) + data[HEADER_SIZE:header_size])
    head[HEADER_CRC_OFFSET:HEADER_CRC_OFFSET + 4] = struct.pack("<I", zlib.crc32(head))
    return bytes(head) + data[header_size:]


def check_bin(data: bytes) -> None:
    from lnn.formats.binfile import parse_bin_bytes

    body = with_repaired_header(data[1:]) if data[:1] == REPAIR else data[1:]
    bin_model = parse_bin_bytes(body)
    weights = bin_model.weights_fp32()
    assert set(weights) == set(bin_model.model.param_shapes()), "weights_fp32 keys differ from the graph's"
    run_if_small(bin_model.model, weights)


def check_description(data: bytes) -> None:
    from lnn.formats.model import load_description, parse_model

    path = Path("/dev/shm" if Path("/dev/shm").is_dir() else ".") / f"lnn-fuzz-{id(data)}.json"
    path.write_bytes(data)
    try:
        description = load_description(path)
    finally:
        path.unlink()
    run_if_small(parse_model(description))


def run_if_small(model, weights: dict | None = None) -> None:
    """A model small enough is run on the NumPy backend (with random weights unless given); its output must
    have the shape the parser inferred."""
    from lnn.runtime.reference import NumpyBackend

    if (math.prod(model.input_shape) > RUN_ELEMENTS or model.num_params > RUN_ELEMENTS
            or sum(node.flops for node in model.nodes) > RUN_FLOPS):
        return
    weights = random_weights(model) if weights is None else weights
    x = np.random.default_rng(1).standard_normal((2, *model.input_shape)).astype(np.float32)
    out = NumpyBackend(model, weights).run(x)
    assert out.shape == (2, *model.output_shape), f"output {out.shape}, the parser said {model.output_shape}"


def check_image(data: bytes) -> None:
    from lnn.runtime.preprocess import preprocess_image, read_image

    image = read_image(data)
    assert image.dtype == np.uint8 and image.ndim == 3 and image.shape[2] == 3, (image.dtype, image.shape)
    prepared = preprocess_image(image, {**IMAGE_PREPROCESS, "resize": [16, 16]})
    assert prepared.shape == (3, 16, 16) and prepared.dtype == np.float32, (prepared.shape, prepared.dtype)


TARGETS = {"bin": check_bin, "description": check_description, "image": check_image}


def judge(target: str, data: bytes, alarm: bool = True) -> None:
    """Run one input; an LnnError is a fine answer, anything else (or, with `alarm`, a hang) propagates.
    (libFuzzer keeps its own timer, so atheris runs without ours.)"""
    if alarm:
        signal.setitimer(signal.ITIMER_REAL, HANG_S)
    try:
        TARGETS[target](data)
    except LnnError:
        pass
    finally:
        if alarm:
            signal.setitimer(signal.ITIMER_REAL, 0)


# --------------------------------------------------------------------------- seed inputs

def seed_models() -> list:
    """Small valid .bin files: float32, float16 and int8 weights, a conv net and an MLP (a few KB each)."""
    from lnn.formats.binfile import build_metadata, encode_bin, fp16_dtypes, int8_dtypes
    from lnn.formats.model import parse_model

    conv = parse_model(json.loads(seed_descriptions()[0]))
    mlp = parse_model({"name": "mlp", "input_shape": [6], "labels": ["x", "y", "z"],
                       "layers": [{"type": "linear", "out_features": 5, "activation": "relu"},
                                  {"type": "batchnorm"}, {"type": "dropout", "p": 0.1},
                                  {"type": "linear", "out_features": 3, "activation": "softmax"}]})
    seeds = []
    for model in (conv, mlp):
        weights = random_weights(model)
        for dtypes in (None, fp16_dtypes(model), int8_dtypes(model)):
            seeds.append(encode_bin(model, weights, build_metadata(model), dtypes))
    return seeds


def seed_descriptions() -> list:
    tiny = {"name": "tiny", "input_shape": [3, 12, 12],
            "preprocess": {"color": "rgb", "scale": 1 / 255, "mean": [0.5, 0.5, 0.5], "std": [0.25, 0.25, 0.25]},
            "layers": [{"type": "conv2d", "out_channels": 4, "kernel_size": 3, "padding": 1, "activation": "relu"},
                       {"type": "batchnorm"}, {"type": "maxpool2d", "kernel_size": 2},
                       {"type": "conv2d", "out_channels": 4, "kernel_size": 3, "groups": 4, "stride": 2},
                       {"type": "global_avg_pool"}, {"type": "flatten"},
                       {"type": "linear", "out_features": 2, "activation": "softmax"}],
            "labels": [{"name": "a", "advice": "water it"}, "b"]}
    texts = [json.dumps(tiny)]
    examples = [p.read_text() for p in sorted((REPO / "examples").glob("**/*.json"))]
    texts += [text for text in examples if '"from_data"' not in text]      # recipes whose shapes come from data
    return texts


def seed_images() -> list:
    import cv2

    leaf = cv2.imread(str(REPO / "examples" / "leaves" / "healthy.jpg"))
    small = cv2.resize(leaf, (24, 20), interpolation=cv2.INTER_AREA)
    gray = cv2.cvtColor(small, cv2.COLOR_BGR2GRAY)
    encoded = [cv2.imencode(".png", small)[1], cv2.imencode(".png", gray)[1],
               cv2.imencode(".png", small.astype(np.uint16) * 257)[1],
               cv2.imencode(".jpg", small, [cv2.IMWRITE_JPEG_QUALITY, 80])[1],
               cv2.imencode(".jpg", small, [cv2.IMWRITE_JPEG_PROGRESSIVE, 1])[1],
               cv2.imencode(".jpg", gray)[1], cv2.imencode(".bmp", small)[1], cv2.imencode(".tiff", small)[1],
               cv2.imencode(".webp", small)[1]]
    return [bytes(e) for e in encoded]


def seeds(target: str) -> list:
    """Seed inputs in each target's byte encoding."""
    if target == "bin":
        return [flag + model for model in seed_models() for flag in (REPAIR, AS_IS)]
    if target == "description":
        return [text.encode("utf-8") for text in seed_descriptions()]
    return seed_images()


# --------------------------------------------------------------------------- hypothesis: mutations of the seeds

BOUNDARY_INTS = (0, 1, 2, 7, 8, 63, 64, 127, 128, 255, 256, 65535, 65536, 2**31 - 1, 2**31, 2**32 - 1, 2**63,
                 2**64 - 1, 10**12)
JSON_BOUNDARY = (0, -1, 1, 2**31, 2**63, 10**12, 10**30, -10**12, 1e308, -0.0, 0.5, "", "x", None, True, [], {})


def edit_bytes(data: bytes, edits: list) -> bytes:
    out = bytearray(data)
    for kind, where, value in edits:
        at = where % (len(out) + 1)
        if kind == "flip" and out:
            out[at % len(out)] ^= 1 << (value % 8)
        elif kind == "int":                     # a boundary integer, 1/2/4/8 bytes, either byte order
            width, order = (1, 2, 4, 8)[value % 4], "little" if value % 8 < 4 else "big"
            number = BOUNDARY_INTS[value % len(BOUNDARY_INTS)] % (1 << (8 * width))
            out[at:at + width] = number.to_bytes(width, order)
        elif kind == "insert":                  # one byte repeated up to 4096 times: deep nesting, long runs
            out[at:at] = bytes([value % 256]) * (1 + value % 64) ** 2
        elif kind == "delete":
            del out[at:at + 1 + value % 256]
        elif kind == "truncate":
            del out[at:]
    return bytes(out)


def json_paths(value, prefix=()):
    yield prefix
    if isinstance(value, dict):
        for key, item in value.items():
            yield from json_paths(item, (*prefix, key))
    elif isinstance(value, list):
        for index, item in enumerate(value):
            yield from json_paths(item, (*prefix, index))


def edit_json(text: bytes, edits: list) -> bytes:
    """Replace (or delete) values anywhere in the JSON tree; then the text goes to the parser."""
    tree = json.loads(text)
    for where, replacement, delete in edits:
        paths = list(json_paths(tree))[1:]
        if not paths:
            break
        *parents, last = paths[where % len(paths)]
        holder = tree
        for step in parents:
            holder = holder[step]
        if delete:
            del holder[last]
        else:
            holder[last] = replacement
    return json.dumps(tree).encode("utf-8")


def strategy(target: str):
    from hypothesis import strategies as st

    byte_edit = st.tuples(st.sampled_from(("flip", "flip", "int", "int", "insert", "delete", "truncate")),
                          st.integers(0, 1 << 24), st.integers(0, 1 << 16))
    mutated = st.builds(edit_bytes, st.sampled_from(seeds(target)), st.lists(byte_edit, min_size=1, max_size=6))
    if target == "bin":
        return st.one_of(mutated, st.binary(max_size=300).map(lambda body: REPAIR + b"\x89LNN\r\n\x1a\n" + body))
    if target == "image":
        return st.one_of(mutated, st.binary(max_size=200))
    values = st.recursive(st.one_of(st.sampled_from(JSON_BOUNDARY), st.integers(), st.floats(allow_nan=False),
                                    st.text(max_size=12)),
                          lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner,
                                                                                      max_size=4), max_leaves=8)
    json_edit = st.tuples(st.integers(0, 1 << 16), values, st.booleans())
    structured = st.builds(edit_json, st.sampled_from(seeds(target)), st.lists(json_edit, min_size=1, max_size=4))
    return st.one_of(structured, structured, mutated)


def hypothesis_run(target: str, examples: int, seed: int):
    """One hypothesis run of `examples` inputs; a failing input is re-raised after shrinking."""
    from hypothesis import HealthCheck, Phase, given, settings
    from hypothesis import seed as fixed_seed

    @fixed_seed(seed)
    @settings(max_examples=examples, deadline=None, database=None, suppress_health_check=list(HealthCheck),
              phases=(Phase.generate, Phase.shrink), print_blob=False, report_multiple_bugs=False)
    @given(strategy(target))
    def fuzz(data):
        fuzz.last = data
        judge(target, data)

    fuzz.last = b""
    try:
        fuzz()
    except Exception as err:
        raise FuzzFailure(target, fuzz.last, err) from err


class FuzzFailure(Exception):
    def __init__(self, target: str, data: bytes, error: BaseException):
        super().__init__(f"{target}: {type(error).__name__}: {error}")
        self.target, self.data, self.error = target, data, error


def save_failure(failure: FuzzFailure) -> Path:
    FAILURES.mkdir(exist_ok=True)
    path = FAILURES / f"{failure.target}-{hashlib.sha1(failure.data).hexdigest()[:12]}.bin"
    path.write_bytes(failure.data)
    return path


# --------------------------------------------------------------------------- atheris: coverage-guided

def atheris_run(target: str, seconds: float) -> int:
    """libFuzzer on one target in this process (it exits when done); seeds in a temporary corpus folder."""
    import tempfile

    import atheris

    TARGETS[target](seeds(target)[0])               # import what the target uses, then instrument it
    atheris.instrument_all()
    corpus = Path(tempfile.mkdtemp(prefix=f"lnn-fuzz-{target}-"))
    for i, data in enumerate(seeds(target)):
        (corpus / f"seed{i}").write_bytes(data)
    FAILURES.mkdir(exist_ok=True)
    atheris.Setup([sys.argv[0], f"-max_total_time={int(seconds)}", f"-timeout={HANG_S}", "-rss_limit_mb=0",
                   f"-artifact_prefix={FAILURES}/{target}-", str(corpus)],
                  lambda data: judge(target, data, alarm=False))
    atheris.Fuzz()
    return 0


# --------------------------------------------------------------------------- the command

def raise_hang(*_):
    raise Hang(f"one input took more than {HANG_S} s")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m lnn.tests.fuzz", description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", choices=(*TARGETS, "all"), default="all")
    budget = parser.add_mutually_exclusive_group()
    budget.add_argument("--seconds", type=float, help="fuzz for this long (split between the targets)")
    budget.add_argument("--examples", type=int, default=100, help="inputs per target (hypothesis; default 100)")
    parser.add_argument("--seed", type=int, default=0, help="hypothesis's seed (each later batch adds 1)")
    parser.add_argument("--engine", choices=("hypothesis", "atheris"), default="hypothesis")
    parser.add_argument("--replay", metavar="FILE", help="run one saved input (its name starts with the target), "
                                                          "showing the traceback of a failure")
    args = parser.parse_args(argv)
    targets = list(TARGETS) if args.target == "all" else [args.target]
    resource.setrlimit(resource.RLIMIT_AS, (MEMORY_LIMIT, MEMORY_LIMIT))
    if args.engine == "atheris":            # libFuzzer's -timeout uses SIGALRM itself
        if len(targets) > 1:
            parser.error("atheris fuzzes one --target per process")
        return atheris_run(targets[0], args.seconds or 60)
    signal.signal(signal.SIGALRM, raise_hang)
    if args.replay:
        judge(Path(args.replay).name.split("-")[0], Path(args.replay).read_bytes())
        print("no failure")
        return 0
    try:
        for target in targets:
            start, batch, count = time.monotonic(), 0, 0
            while True:
                examples = args.examples if args.seconds is None else 200
                hypothesis_run(target, examples, args.seed + batch)
                batch, count = batch + 1, count + examples
                if args.seconds is None or time.monotonic() - start > args.seconds / len(targets):
                    break
            print(f"{target}: {count} inputs, no failure ({time.monotonic() - start:.1f} s)", flush=True)
    except FuzzFailure as failure:
        path = save_failure(failure)
        print(f"FAILED {failure}\n  input ({len(failure.data)} bytes) saved as {path}; "
              f"reproduce: python -m lnn.tests.fuzz --replay {path}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
