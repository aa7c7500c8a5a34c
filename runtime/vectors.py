"""Test vectors: made at export, run on this machine, the verdict remembered per model and machine.

formats/vectors.py defines them (SPEC "Test vector rules") and the tolerance. Here:
  - `with_test_vectors` computes the stored outputs on the exporting machine with the NumPy reference
    backend, one input at a time, from the weights as the file will store them (fp16 widened, int8
    dequantized); `normal_inputs` / `photo_inputs` make the inputs (seeded normal draws, or photos
    preprocessed as the model's metadata says);
  - `check_session` runs a Session's vectors one at a time and measures `formats.vectors.difference`;
  - `check_once` does that at most once per model file and machine: a PASS is remembered in the
    per-user cache (`verdicts/` beside the Numba cache), keyed by the file's CRCs, the device, the CPU
    and the versions of Python, NumPy, Numba and lnn, so an upgrade or another computer checks again.
    A FAIL is not remembered: it is checked (and refused) at every start.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import math
import platform
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from lnn.formats.errors import LnnError, LnnInputError
from lnn.formats.limits import MAX_TEST_VECTORS
from lnn.formats.vectors import INPUTS, METADATA_KEY, OUTPUTS, TENSOR_PREFIX, TOLERANCE, difference
from lnn.version import __version__

DEFAULT_COUNT = 4            # vectors lnn-export stores unless told otherwise, as many as fit in
DEFAULT_INPUT_BYTES = 512 << 10   # this many bytes of inputs, at least one: a 3x128x128 input is 192 KiB, so
                                  # the tomato model gets 2 (+384 KiB on 1.8 MiB), an MNIST model 4 (+12 KiB)
SEED = 0


def default_count(model) -> int:
    return max(1, min(DEFAULT_COUNT, DEFAULT_INPUT_BYTES // (4 * math.prod(model.input_shape))))


def normal_inputs(model, count: int | None = None) -> tuple:
    """(count (default_count) seeded standard-normal inputs [count, *input_shape] float32, what they are in words)."""
    count = count or default_count(model)
    inputs = np.random.default_rng(SEED).standard_normal((count, *model.input_shape)).astype(np.float32)
    return inputs, f"{count} inputs drawn from a standard normal distribution (NumPy default_rng({SEED}))"


def photo_inputs(model, paths) -> tuple:
    """(the photos preprocessed as the model's metadata says [N, C, H, W] float32, what they are in words)."""
    from lnn.runtime.preprocess import decode_image, preprocess_image

    if not model.takes_images:
        kind = {1: "table rows", 2: "series"}.get(len(model.input_shape), f"input {list(model.input_shape)}")
        raise LnnInputError(f"model {model.name!r} takes {kind}, not images: photos cannot be its inputs")
    if not 1 <= len(paths) <= MAX_TEST_VECTORS:
        raise LnnInputError(f"give 1 to {MAX_TEST_VECTORS} photos, not {len(paths)} (MAX_TEST_VECTORS in lnn/formats/limits.py)")
    inputs = np.stack([preprocess_image(decode_image(path), model.preprocess, "bgr") for path in paths])
    return inputs.astype(np.float32), f"{len(paths)} photos: {', '.join(Path(p).name for p in paths)}"


def outputs_made_by() -> str:
    return (f"lnn {__version__}, NumPy reference backend, {platform.machine()} {platform.system()}, "
            f"NumPy {np.__version__}")


def without_test_vectors(weights: dict, metadata: dict) -> tuple:
    """(weights, metadata) with any test vectors taken out."""
    return ({key: value for key, value in weights.items() if not key.startswith(TENSOR_PREFIX)},
            {key: value for key, value in metadata.items() if key != METADATA_KEY})


def with_test_vectors(model, weights: dict, metadata: dict, dtypes: dict, inputs: np.ndarray, what: str) -> tuple:
    """(weights, metadata) carrying `inputs` and the reference outputs for them, as encode_bin takes them.

    `weights` as encode_bin takes them (any old vectors are replaced); `dtypes` as the file will store
    them, since the outputs are computed from the stored weights widened to float32."""
    from lnn.formats.binfile import encode_bin, parse_bin_bytes
    from lnn.runtime.reference import NumpyBackend

    weights, metadata = without_test_vectors(weights, metadata)
    stored = parse_bin_bytes(encode_bin(model, weights, metadata, dtypes), "the model").weights_fp32()
    backend = NumpyBackend(model, stored)
    inputs = np.ascontiguousarray(inputs, np.float32)
    with np.errstate(all="ignore"):              # an output that overflows is refused just below, in one line
        outputs = np.concatenate([backend.run(inputs[i:i + 1]) for i in range(len(inputs))])
    if not np.isfinite(outputs).all():
        raise LnnError("the model's output for a test input is not finite (NaN or infinity), so it cannot be "
                       "stored as a test vector: check the weights, or export with --test-vectors 0")
    return ({**weights, INPUTS: inputs, OUTPUTS: outputs},
            {**metadata, METADATA_KEY: {"count": len(inputs), "inputs": what, "outputs": outputs_made_by()}})


@dataclass
class VectorCheck:
    """The test vectors of one model run on one device of this machine."""

    device: str
    count: int
    difference: float        # formats.vectors.difference over every vector
    cached: bool = False     # True: a PASS remembered from an earlier check (check_once)

    @property
    def passed(self) -> bool:
        return self.difference <= TOLERANCE

    def detail(self) -> str:
        when = " (checked before on this computer)" if self.cached else ""
        return (f"{self.count} test vectors on {self.device}, max difference {self.difference:.2g} of the "
                f"outputs' scale, allowed {TOLERANCE:g}{when}")

    def refusal(self, model_path) -> str:
        """The one-line reason a station refuses to use the model on this computer."""
        return (f"{model_path}: this computer computes something else than the one the model was exported on: "
                f"its {self.count} test vectors differ by {self.difference:.2g} on the {self.device} backend "
                f"(allowed {TOLERANCE:g}), so its answers cannot be trusted here; run lnn-doctor {model_path}")


def check_session(session) -> VectorCheck | None:
    """Run the session's model's test vectors on its backend, one at a time; None when it has none."""
    vectors = session.bin.test_vectors
    if vectors is None:
        return None
    inputs, outputs = vectors
    worst = max(difference(session.run(inputs[i:i + 1]), outputs[i:i + 1]) for i in range(len(inputs)))
    return VectorCheck(session.device, len(inputs), worst)


def machine_key(session) -> dict:
    """What decides whether a verdict still holds: the model file, the device and what runs it."""
    def version(name: str) -> str:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            return "absent"

    key = {"model": list(session.bin.checksums), "device": session.device, "machine": platform.machine(),
           "system": platform.system(), "cpu": _cpu_name(), "python": sys.version, "numpy": np.__version__,
           "lnn": __version__}
    if session.device == "cpu":
        from lnn.runtime.cpu.jit import KERNELS

        key.update(kernels=KERNELS, numba=version("numba") if KERNELS == "jit" else "compiled ahead of time")
    return key


def _cpu_name() -> str:
    """The CPU's model name (Linux's /proc/cpuinfo), else what platform knows."""
    try:
        for line in Path("/proc/cpuinfo").read_text(encoding="utf-8", errors="replace").splitlines():
            if line.split(":")[0].strip() in ("model name", "Model", "Hardware"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def verdict_path(session) -> Path:
    from lnn.runtime.cpu.cache import default_cache_root

    digest = hashlib.sha256(json.dumps(machine_key(session), sort_keys=True).encode()).hexdigest()[:32]
    return default_cache_root() / "verdicts" / f"{digest}.json"


def check_once(session) -> VectorCheck | None:
    """check_session, unless this model already passed on this device of this machine; a PASS is remembered
    (a cache that cannot be written only means checking again next time). None: the model has no vectors."""
    if session.bin.test_vectors is None:
        return None
    path = verdict_path(session)
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
        remembered = VectorCheck(session.device, int(record["count"]), float(record["difference"]), cached=True)
        if remembered.passed:
            return remembered
    except (OSError, ValueError, KeyError, TypeError):
        pass
    check = check_session(session)
    if check.passed:
        record_verdict(path, check)
    return check


def record_verdict(path: Path, check: VectorCheck) -> None:
    from lnn.formats.binfile import atomic_output

    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with atomic_output(path, "w", encoding="utf-8") as f:
            json.dump({"count": check.count, "difference": check.difference, "device": check.device}, f)
    except (OSError, LnnInputError):          # a cache that cannot be written (or a pipe in its place) goes without
        pass
