"""Image decoding and the model's own preprocessing, with OpenCV.

decode:     file or bytes -> HxWx3 uint8 BGR (OpenCV's order), refusing non-images and truncated JPEGs
preprocess: BGR image -> [C, H, W] float32 per the model's metadata:
            colour order (rgb/bgr/gray), resize to the input size, x * scale, then (x - mean) / std per channel
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from lnn.formats.errors import LnnInputError

_cv2 = None


def _opencv():
    """Import OpenCV on first use (it costs ~0.2 s), quietening libjpeg's warnings: we report problems ourselves."""
    global _cv2
    if _cv2 is None:
        import cv2
        if hasattr(cv2, "setLogLevel"):
            cv2.setLogLevel(2)   # errors only
        _cv2 = cv2
    return _cv2


def _looks_truncated(data: bytes) -> bool:
    if data[:3] == b"\xff\xd8\xff":                 # JPEG: must end with the end-of-image marker
        return data.rstrip(b"\x00\r\n")[-2:] != b"\xff\xd9"
    if data[:8] == b"\x89PNG\r\n\x1a\n":            # PNG: must end with the IEND chunk
        return b"IEND" not in data[-16:]
    return False


def read_image(source) -> np.ndarray:
    """Decode a path or encoded bytes into an HxWx3 uint8 BGR image; bad input raises LnnInputError."""
    cv2 = _opencv()
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
    image = cv2.imdecode(np.frombuffer(data, np.uint8), cv2.IMREAD_COLOR)
    if image is None:
        raise LnnInputError(f"{name}: not an image OpenCV can decode (JPEG, PNG, BMP, TIFF, WebP, ...)")
    return image


def preprocess_image(image: np.ndarray, preprocess: dict, color: str = "bgr") -> np.ndarray:
    """HxWx3 (in `color` order) or HxW uint8/float image -> [C, H, W] float32 normalized for the model."""
    cv2 = _opencv()
    image = np.asarray(image)
    if image.ndim == 2:
        image = cv2.cvtColor(image, cv2.COLOR_GRAY2BGR)
        color = "bgr"
    if image.ndim != 3 or image.shape[2] not in (3, 4):
        raise LnnInputError(f"an image must be HxW or HxWx3, got shape {list(image.shape)}")
    if image.shape[2] == 4:
        image = image[:, :, :3]
    if color == "rgb":
        image = image[:, :, ::-1]
    want = preprocess["color"]
    if want == "gray":
        image = cv2.cvtColor(np.ascontiguousarray(image), cv2.COLOR_BGR2GRAY)[:, :, None]
    elif want == "rgb":
        image = image[:, :, ::-1]
    height, width = preprocess["resize"]
    if image.shape[:2] != (height, width):
        shrinking = image.shape[0] > height or image.shape[1] > width
        image = cv2.resize(np.ascontiguousarray(image), (width, height),
                           interpolation=cv2.INTER_AREA if shrinking else cv2.INTER_LINEAR)
        if image.ndim == 2:
            image = image[:, :, None]
    x = image.astype(np.float32) * np.float32(preprocess["scale"])
    x = (x - np.asarray(preprocess["mean"], np.float32)) / np.asarray(preprocess["std"], np.float32)
    return np.ascontiguousarray(x.transpose(2, 0, 1))
