"""Image decoding and the model's own preprocessing, with OpenCV, or with Pillow where OpenCV is absent.

decode:     file or bytes -> HxWx3 uint8 BGR (OpenCV's order), refusing non-images and truncated JPEGs
preprocess: BGR image -> [C, H, W] float32 per the model's metadata:
            colour order (rgb/bgr/gray), resize to the input size, x * scale, then (x - mean) / std per channel
resize:     area averaging when shrinking, bilinear (pixel centres aligned) when enlarging

The image library: OpenCV (lnn's dependency) when it is installed, else Pillow for decoding and NumPy for
resizing and grey: the packaged lnn-field ships Pillow (about 15 MiB) instead of OpenCV (about 150 MiB
with its FFmpeg and OpenBLAS libraries); LNN_IMAGE_LIBRARY=opencv|pillow chooses. The two give the same
pixels up to rounding: both decode with libjpeg-turbo and libpng and apply the EXIF orientation, the
NumPy resize computes OpenCV's INTER_AREA / INTER_LINEAR weights, grey is 0.299 R + 0.587 G + 0.114 B.
tests/runtime/test_preprocess.py compares them.
"""

from __future__ import annotations

import io
import os
from functools import partial
from pathlib import Path

import numpy as np

from lnn.formats.errors import LnnError, LnnInputError

LIBRARIES = ("opencv", "pillow")
GRAY_WEIGHTS_BGR = (0.114, 0.587, 0.299)
BAND_ROWS = 256           # rows resized at a time without OpenCV
WIDE_GRAY_MODES = ("I", "I;16", "I;16B", "I;16L", "I;16N")     # Pillow's modes for 16-bit grey images
EXIF_ORIENTATION = 0x0112
_cv2 = None
_library = None


def image_library() -> str:
    """The image library in use, opencv or pillow: LNN_IMAGE_LIBRARY if set, else OpenCV when it imports, else Pillow."""
    global _library
    if _library is None:
        wanted = os.environ.get("LNN_IMAGE_LIBRARY")
        if wanted is not None and wanted not in LIBRARIES:
            raise LnnError(f"LNN_IMAGE_LIBRARY must be opencv or pillow, not {wanted!r}")
        for library in [wanted] if wanted else LIBRARIES:
            try:
                _opencv() if library == "opencv" else _pillow()
            except ImportError:
                continue
            _library = library
            break
        else:
            raise LnnError(f"cannot decode images: {' or '.join([wanted] if wanted else LIBRARIES)} is not installed "
                           f"(pip install opencv-python-headless, or pillow)")
    return _library


def _opencv():
    """Import OpenCV on first use (it costs ~0.2 s), quietening libjpeg's warnings: we report problems ourselves."""
    global _cv2
    if _cv2 is None:
        import cv2
        if hasattr(cv2, "setLogLevel"):
            cv2.setLogLevel(2)   # errors only
        _cv2 = cv2
    return _cv2


def _pillow():
    from PIL import Image, ImageOps

    return Image, ImageOps


def _decode(data: bytes):
    """Encoded bytes -> HxWx3 uint8 BGR, or None when the library cannot decode them."""
    if image_library() == "opencv":
        cv2 = _opencv()
        return cv2.imdecode(np.frombuffer(data, np.uint8), cv2.IMREAD_COLOR)
    Image, ImageOps = _pillow()
    try:
        with Image.open(io.BytesIO(data)) as picture:
            if picture.getexif().get(EXIF_ORIENTATION, 1) != 1:   # OpenCV applies the EXIF orientation too
                picture = ImageOps.exif_transpose(picture)
            if picture.mode in WIDE_GRAY_MODES:                 # 16-bit grey: keep the high byte, as OpenCV does
                picture = Image.fromarray((np.asarray(picture).astype(np.uint32) >> 8).clip(0, 255).astype(np.uint8))
            rgb = np.asarray(picture if picture.mode == "RGB" else picture.convert("RGB"))
    except (OSError, SyntaxError, ValueError, Image.DecompressionBombError):
        return None
    bgr = np.empty_like(rgb)
    for channel in range(3):                 # three plain copies: faster than one copy of a reversed view
        bgr[:, :, channel] = rgb[:, :, 2 - channel]
    return bgr


def _bgr_to_gray(image: np.ndarray) -> np.ndarray:
    if image_library() == "opencv":
        cv2 = _opencv()
        return cv2.cvtColor(np.ascontiguousarray(image), cv2.COLOR_BGR2GRAY)
    gray = image.astype(np.float32) @ np.asarray(GRAY_WEIGHTS_BGR, np.float32)
    return np.rint(gray).astype(np.uint8) if image.dtype == np.uint8 else gray


def resize_image(image: np.ndarray, width: int, height: int) -> np.ndarray:
    """HxWxC image -> height x width x C, as OpenCV's INTER_AREA when either side shrinks, else INTER_LINEAR.

    Without OpenCV: the same arithmetic in NumPy, one side at a time, on bands of rows (bounded memory for
    large photos); uint8 stays uint8 (rounded), other types come back float32."""
    shrinking = image.shape[0] > height or image.shape[1] > width
    if image_library() == "opencv":
        cv2 = _opencv()
        resized = cv2.resize(np.ascontiguousarray(image), (width, height),
                             interpolation=cv2.INTER_AREA if shrinking else cv2.INTER_LINEAR)
        return resized[:, :, None] if resized.ndim == 2 else resized
    if not shrinking:
        resize_side = _linear_side
    elif image.shape[0] >= height and image.shape[1] >= width:
        resize_side = _area_side
    else:       # one side shrinks, the other grows: OpenCV's INTER_AREA interpolates with its own weights
        resize_side = partial(_linear_side, area_weights=True)
    bands = [resize_side(image[top:top + BAND_ROWS], width, axis=1)
             for top in range(0, image.shape[0], BAND_ROWS)]
    resized = resize_side(np.concatenate(bands), height, axis=0)
    if image.dtype == np.uint8:
        return np.rint(np.clip(resized, 0, 255)).astype(np.uint8)
    return resized.astype(np.float32)


def _area_side(x: np.ndarray, new: int, axis: int) -> np.ndarray:
    """Area averaging along `axis` (new <= old): output i is the mean of x over [e_i, e_i+1), e_i = i * old / new,
    partial pixels weighted by their overlap: the whole pixels' sum, plus the next edge's partial pixel, less
    this edge's."""
    old = x.shape[axis]
    exact_sum = np.float64 if x.dtype.kind == "f" else np.int64           # integers add exactly, and faster
    if old % new == 0:             # whole pixels only (256 -> 128): add every factor-th slice (numpy's sum
        factor = old // new        # over a short middle axis was 6x slower)
        every = [slice(None)] * x.ndim
        total = np.zeros((*x.shape[:axis], new, *x.shape[axis + 1:]), exact_sum)
        for offset in range(factor):
            every[axis] = slice(offset, None, factor)
            total += x[tuple(every)]
        return total / factor
    edges = np.arange(new + 1) * old / new          # exact: the last edge is `old`
    whole = edges.astype(np.int64)
    fraction = edges - whole
    sums = np.add.reduceat(x, whole[:-1], axis=axis, dtype=exact_sum)     # x[whole[i]:whole[i + 1]]
    shape = [1] * x.ndim
    shape[axis] = new + 1
    partial = fraction.reshape(shape) * np.take(x, np.minimum(whole, old - 1), axis)
    upper, lower = (np.take(partial, np.arange(first, first + new), axis) for first in (1, 0))
    return (sums + upper - lower) * (new / old)


def _linear_side(x: np.ndarray, new: int, axis: int, area_weights: bool = False) -> np.ndarray:
    """Linear interpolation along `axis` with pixel centres aligned, edge pixels repeated (OpenCV's INTER_LINEAR);
    area_weights: the left pixel and weight OpenCV's INTER_AREA uses when the other side grows."""
    old = x.shape[axis]
    scale = old / new
    if area_weights:
        left = np.floor(np.arange(new) * scale)
        fraction = np.arange(1, new + 1) - (left + 1) / scale
        fraction = np.where(fraction <= 0, 0.0, fraction - np.floor(fraction))
    else:
        source = (np.arange(new) + 0.5) * scale - 0.5
        left = np.floor(source)
        fraction = np.where(left < 0, 0.0, source - left)
    left = np.clip(left.astype(np.int64), 0, old - 1)
    right = np.minimum(left + 1, old - 1)
    shape = [1] * x.ndim
    shape[axis] = new
    low, high = (np.take(x, index, axis).astype(np.float64) for index in (left, right))
    return low + (high - low) * fraction.reshape(shape)


def _looks_truncated(data: bytes) -> bool:
    if data[:3] == b"\xff\xd8\xff":                 # JPEG: must end with the end-of-image marker
        return data.rstrip(b"\x00\r\n")[-2:] != b"\xff\xd9"
    if data[:8] == b"\x89PNG\r\n\x1a\n":            # PNG: must end with the IEND chunk
        return b"IEND" not in data[-16:]
    return False


def read_image(source) -> np.ndarray:
    """Decode a path or encoded bytes into an HxWx3 uint8 BGR image; bad input raises LnnInputError."""
    image_library()      # before reading: a missing image library is one clear error
    if isinstance(source, (bytes, bytearray)):
        data, name = bytes(source), "<bytes>"
    else:
        path = Path(source)
        name = str(path)
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            raise LnnInputError(f"{name}: no such file") from None
        except IsADirectoryError:
            raise LnnInputError(f"{name}: is a folder, not an image") from None
        except OSError as err:
            raise LnnInputError(f"{name}: cannot read ({err.strerror or err})") from None
    if not data:
        raise LnnInputError(f"{name}: the file is empty")
    if _looks_truncated(data):
        raise LnnInputError(f"{name}: the image is truncated (it ends before its end marker); copy or take it again")
    image = _decode(data)
    if image is None:
        library = "OpenCV" if image_library() == "opencv" else "Pillow"
        raise LnnInputError(f"{name}: not an image {library} can decode (JPEG, PNG, BMP, TIFF, WebP, ...)")
    return image


def preprocess_image(image: np.ndarray, preprocess: dict, color: str = "bgr") -> np.ndarray:
    """HxWx3 (in `color` order) or HxW uint8/float image -> [C, H, W] float32 normalized for the model."""
    image = np.asarray(image)
    if image.ndim == 2:
        image = np.repeat(image[:, :, None], 3, axis=2)
        color = "bgr"
    if image.ndim != 3 or image.shape[2] not in (3, 4):
        raise LnnInputError(f"an image must be HxW or HxWx3, got shape {list(image.shape)}")
    if image.shape[2] == 4:
        image = image[:, :, :3]
    if color == "rgb":
        image = image[:, :, ::-1]
    want = preprocess["color"]
    if want == "gray":
        image = _bgr_to_gray(image)[:, :, None]
    elif want == "rgb":
        image = image[:, :, ::-1]
    height, width = preprocess["resize"]
    if image.shape[:2] != (height, width):
        image = resize_image(image, width, height)
    x = image.astype(np.float32) * np.float32(preprocess["scale"])
    x = (x - np.asarray(preprocess["mean"], np.float32)) / np.asarray(preprocess["std"], np.float32)
    return np.ascontiguousarray(x.transpose(2, 0, 1))
