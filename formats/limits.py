"""Limits on sizes, stated once. Every reader and command that takes a size from a file or from a
person (a model description, a `.bin`, an ONNX file, a weights archive, a batch size) checks it
against these before it allocates anything for it, and a refusal is one line naming the limit and
the value (`refusal` below). Raise a limit here, and only here, if a real model needs more.
"""

from __future__ import annotations

# --------------------------------------------------------------------------- model sizes

# Values in one sample of the model's input (the batch not counted). 2^24 = 16.8 M values, 64 MiB as
# float32: a 3x1024x1024 photo input (3.1 M) fits five times over, while the 1 KB file that declares
# a 3x50000x50000 input (7.5 G values, 30 GB for one image) is refused before anything is allocated.
MAX_INPUT_ELEMENTS = 1 << 24

# Parameters of the whole model. 2^28 = 268 M, 1 GiB as float32: a ~100 M-parameter model (well past
# the small models lnn is for: the bundled one has 0.1 M) fits with room, while a 200-byte
# description with `out_features: 10**12` is refused instead of asking for terabytes.
MAX_PARAMETERS = 1 << 28

# Bytes of the input and every layer's float32 output for ONE sample (lnn-summary's activation sum
# at batch 1; training keeps them all for the backward pass, inference needs less). 2 GiB: a
# 3x1024x1024 input through several full-resolution 32-channel convolutions fits; a model whose
# single image needs more than a small machine's memory is refused at load, not by MemoryError.
MAX_ACTIVATION_BYTES = 1 << 31

# --------------------------------------------------------------------------- JSON (descriptions, the .bin's sections)

# A model description file, and each JSON section of a `.bin` (SPEC rule 19): parsing the worst
# 4 MiB takes about a second; the bundled model's description is 4 KB.
MAX_JSON_BYTES = 4 << 20

# Nesting of arrays and objects in that JSON (SPEC rule 21): a description needs 4 levels, a model
# card a few more; checked before parsing, since Python's parser recurses.
MAX_JSON_DEPTH = 64


def refusal(what: str, value: int, limit: int, limit_name: str, unit: str = "") -> str | None:
    """None when `value` is within `limit`; otherwise the one-line reason, e.g.
    "input_shape [3, 50000, 50000] is 7,500,000,000 values, over the limit of 16,777,216 values
    (MAX_INPUT_ELEMENTS in lnn/formats/limits.py)"."""
    if value <= limit:
        return None
    return f"{what} is {value:,}{unit}, over the limit of {limit:,}{unit} ({limit_name} in lnn/formats/limits.py)"
