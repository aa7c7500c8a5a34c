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
# the small models lnn is for: the bundled one has 0.9 M) fits with room, while a 200-byte
# description with `out_features: 10**12` is refused instead of asking for terabytes.
MAX_PARAMETERS = 1 << 28

# Bytes of the input and every layer's float32 output for ONE sample (lnn-summary's activation sum
# at batch 1; training keeps them all for the backward pass, inference needs less). 2 GiB: a
# 3x1024x1024 input through several full-resolution 32-channel convolutions fits; a model whose
# single image needs more than a small machine's memory is refused at load, not by MemoryError.
MAX_ACTIVATION_BYTES = 1 << 31

# Threads of one Session's cpu backend (`threads=`, the commands' --threads). Each is an OS thread that spins
# between a call's layers; more than a machine's cores only slows a call down. 1024 covers the largest servers,
# while --threads 100000 is refused in one line instead of failing to start threads (and 10^9 instead of asking
# for gigabytes of hand-off counters).
MAX_THREADS = 1024

# --------------------------------------------------------------------------- JSON (descriptions, the .bin's sections)

# A model description file, and each JSON section of a `.bin` (SPEC rule 19): parsing the worst
# 4 MiB takes about a second; the bundled model's description is 4 KB.
MAX_JSON_BYTES = 4 << 20

# Nesting of arrays and objects in that JSON (SPEC rule 21): a description needs 4 levels, a model
# card a few more; checked before parsing, since Python's parser recurses.
MAX_JSON_DEPTH = 64

# --------------------------------------------------------------------------- test vectors

# Test vectors a `.bin` carries (SPEC rule V1): each is one more inference when a machine checks the model
# (lnn-doctor MODEL.bin, the field app's first start), run one at a time; 4 is the default, 16 is plenty.
MAX_TEST_VECTORS = 16

# --------------------------------------------------------------------------- training

# A description's training.min_steps (lnn.train.config): a small dataset gets as many epochs as reach this many
# optimizer steps. The bundled series recipe asks 1,000; a million steps of a small model is hours on the CPU,
# while 10^12 (with epochs 1) would run for ever, one tiny epoch after another.
MAX_MIN_STEPS = 1_000_000

# Epochs of one run (training.epochs, --epochs, or those min_steps makes): every checkpoint carries each epoch's
# figures (about 220 bytes an epoch) in its metadata, which a checkpoint reader takes up to MAX_JSON_BYTES, so a run of
# about 19,000 epochs could no longer read back its own checkpoint (no export, no --resume). The longest recipe
# here is 280 epochs.
MAX_EPOCHS = 10_000


# --------------------------------------------------------------------------- series and tables
# Enforced by runtime/series.py for the UCR/UEA files (.ts, .tsv, .arff) and CSV tables that lnn-train,
# lnn-eval and lnn-infer read: a file is read whole as text, then NumPy parses each channel into float64
# (at most 2 bytes of text per value: up to 4x the file as values, so a 256 MiB file of one-digit values takes
# about 1.3 GB with its text; a value such as -0.64788 takes 8 or 9 bytes: about the file's size). It holds
# most of the archive (the UEA's largest, InsectWingbeat and the like, are refused naming this limit;
# raise it here to read them on a machine with the memory).
MAX_DATA_FILE_BYTES = 256 << 20

# Bytes of data an IDX file (lnn-train's mnist: data, gzipped or raw) declares in its header, checked before they
# are decompressed or read: MNIST's training images are 47 MB (Fashion-MNIST's and KMNIST's too), so 256 MiB holds
# five times that, kept in memory at one byte a pixel; a 2 MB .gz whose header declares 2.6 M images (2 GB) is
# refused before it expands.
MAX_IDX_BYTES = 256 << 20


# --------------------------------------------------------------------------- images
# Enforced by runtime/preprocess.py for both decoders (OpenCV and Pillow), so for lnn-infer, lnn-field,
# Session.predict_image and the training / evaluation caches alike. A phone's 200-megapixel JPEG must
# be answered within 1 GB of memory; a small file that claims a huge image must be refused before it
# is decoded.

# Bytes read from one image file (a 200 MP phone JPEG is 20-120 MB); only regular files are read,
# so a named pipe or a device given as an image is refused, never waited on or read for ever.
MAX_IMAGE_FILE_BYTES = 256 * 1024 * 1024

# Width x height as the file's header states it, checked before decoding: above every phone camera
# (200 MP, 16320 x 12240). A 33000 x 33000 PNG of 1 MB is refused here.
MAX_IMAGE_PIXELS = 250_000_000

# Pixels decoded at once (150 MB as 8-bit BGR). A larger baseline JPEG is decoded at 1/2, 1/4 or 1/8
# of its size, as little reduced as fits (the model needs ~128 px); an image that cannot be decoded
# reduced (PNG, TIFF, ..., progressive JPEG, whose decoder holds every coefficient: 3-6 bytes a
# pixel) is refused above this.
MAX_DECODED_PIXELS = 50_000_000

# Scans in one JPEG: each is a pass over the whole image (a photo has 1, a progressive one about 10,
# 5 s for 50 MP on a busy 2-core machine); thousands of tiny scans would keep the decoder busy for minutes.
MAX_JPEG_SCANS = 50

# Markers (segments) walked in one JPEG's structure before its end marker (a photo has under 50).
MAX_JPEG_SEGMENTS = 2000

# Blocks walked in a GIF before its first image, for its size (extensions' sub-blocks and stray bytes, each one):
# a GIF has a few (its loop count, a comment), an XMP packet or a colour profile in it a few thousand (sub-blocks of
# up to 255 bytes); 100,000 take about 10 ms, where a 256 MiB file of 2-byte sub-blocks would take 15 s.
MAX_GIF_BLOCKS = 100_000

# Chunks walked in one PNG (its pixel chunks checked against their CRCs before decoding): libpng writes its image
# data in chunks of 8 KB, Pillow in 64 KB ones, so a PNG at MAX_IMAGE_FILE_BYTES has about 33,000; an animated one a
# few more a frame. 100,000 take about 0.15 s and 20 MB, where 22 M empty chunks in 256 MiB would take 40 s and 6 GB.
MAX_PNG_CHUNKS = 100_000


def refusal(what: str, value: int, limit: int, limit_name: str, unit: str = "") -> str | None:
    """None when `value` is within `limit`; otherwise the one-line reason, e.g.
    "input_shape [3, 50000, 50000] is 7,500,000,000 values, over the limit of 16,777,216 values
    (MAX_INPUT_ELEMENTS in lnn/formats/limits.py)"."""
    if value <= limit:
        return None
    return f"{what} is {value:,}{unit}, over the limit of {limit:,}{unit} ({limit_name} in lnn/formats/limits.py)"
