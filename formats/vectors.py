"""Test vectors a `.bin` may carry: a few inputs and the outputs the exporting machine computed for them.

formats/SPEC.md rules V1-V3 (group "Test vector rules") are enforced here; binfile.py calls
`check_vectors_metadata` after the graph and metadata rules and matches the file's `test.*` tensors
against `vector_tensor_shapes`. Running them is lnn/runtime/vectors.py; this module only knows what
well-formed vectors are and how far a machine's outputs may be from the stored ones:

    metadata["test_vectors"] = {
        "count": 4,                                   # vectors stored, 1 to MAX_TEST_VECTORS
        "inputs": "4 photos: healthy.jpg, ...",       # what the inputs are, in words
        "outputs": "lnn 0.1.0, NumPy reference backend, x86_64 Linux, NumPy 2.2.6",   # what computed them
    }
    tensors "test.inputs" [count, *input_shape] and "test.outputs" [count, *output_shape], float32,
    stored last (after the gate's); the inputs already preprocessed, as Session.run takes them.

The comparison (SPEC "Test vector rules"): a machine passes when, over every vector,
max |got - stored| <= TOLERANCE * max(1, max |stored|).
"""

from __future__ import annotations

import numpy as np

from lnn.formats.errors import LnnFormatError
from lnn.formats.limits import MAX_TEST_VECTORS

METADATA_KEY = "test_vectors"
KEYS = ("count", "inputs", "outputs")
TENSOR_PREFIX = "test."
INPUTS, OUTPUTS = "test.inputs", "test.outputs"
# float32 on another CPU, BLAS or kernel order differs by about 1e-6 to 1e-5 of the outputs' scale (x86-64
# against arm64: 1.2-4.1e-6 on the reference models; lnn against PyTorch: under 6e-6); a machine that
# computes something else (a broken kernel, a wrong weight, denormals flushed mid-network) is off by far more.
TOLERANCE = 1e-4


def check_vectors_metadata(metadata: dict) -> None:
    """Rule V1: metadata.test_vectors, when present, is well formed."""
    if METADATA_KEY not in metadata:
        return
    vectors = metadata[METADATA_KEY]
    count = vectors.get("count") if isinstance(vectors, dict) else None
    if (not isinstance(vectors, dict) or set(vectors) != set(KEYS)
            or not isinstance(count, int) or isinstance(count, bool) or not 1 <= count <= MAX_TEST_VECTORS
            or not all(isinstance(vectors[key], str) and vectors[key] for key in ("inputs", "outputs"))):  # rule V1
        raise LnnFormatError(f"metadata: test_vectors must be {{\"count\": 1 to {MAX_TEST_VECTORS}, \"inputs\": text, "
                             f"\"outputs\": text}}, not {vectors!r}"[:300])


def vector_tensor_shapes(metadata: dict, model) -> dict:
    """{tensor name: shape} the (already checked) test_vectors of this metadata need, in stored order."""
    if METADATA_KEY not in metadata:
        return {}
    count = metadata[METADATA_KEY]["count"]
    return {INPUTS: (count, *model.input_shape), OUTPUTS: (count, *model.output_shape)}


def difference(got, stored) -> float:
    """The measure TOLERANCE bounds: max |got - stored| over max(1, max |stored|); infinite when `got` is not finite."""
    got, stored = np.asarray(got, np.float64), np.asarray(stored, np.float64)
    if not np.isfinite(got).all():
        return float("inf")
    scale = max(1.0, float(np.abs(stored).max(initial=0.0)))
    return float(np.abs(got - stored).max(initial=0.0)) / scale
