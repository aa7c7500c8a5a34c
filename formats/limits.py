"""The limits lnn enforces on what it reads, stated once. Every refusal is one line naming the limit
and the value it met; the code that enforces each limit imports it from here.
"""

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
