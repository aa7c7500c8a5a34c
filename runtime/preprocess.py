"""Image decoding and the model's own preprocessing, with OpenCV, or with Pillow where OpenCV is absent.

read:       only a regular file, at most MAX_IMAGE_FILE_BYTES (formats/limits.py); its header read before
            decoding: format, size (refused over MAX_IMAGE_PIXELS), complete (a JPEG walked to its end
            marker: bytes after it are fine, a file ending before it is truncated)
decode:     -> HxWx3 uint8 BGR (OpenCV's order), or HxW for a grey image (decode_image; read_image always
            gives 3 channels); a baseline JPEG over MAX_DECODED_PIXELS decoded reduced by libjpeg, and one
            larger than its caller needs (keep_side: the model's input, the photo checks' copy) too; JPEGs
            by libjpeg-turbo's TurboJPEG (simplejpeg), which reports damaged data (refused) where OpenCV
            prints a warning and guesses; a PNG's pixel chunks checked against their CRCs
preprocess: an image array (the rules in _image_array) -> [C, H, W] float32 per the model's metadata:
            colour order (rgb/bgr/gray), resize to the input size, x * scale, then (x - mean) / std per channel;
            remarks (grey into a colour model, float 0..1) go to a notes list or are LnnWarnings
resize:     area averaging when shrinking, bilinear (pixel centres aligned) when enlarging

The image library: OpenCV (lnn's dependency) when it is installed, else Pillow for decoding and NumPy for
resizing and grey: the packaged lnn-field ships Pillow (about 15 MiB) instead of OpenCV (about 150 MiB
with its FFmpeg and OpenBLAS libraries); LNN_IMAGE_LIBRARY=opencv|pillow chooses. JPEGs are TurboJPEG's
in both (the image library only for the few it refuses outright). The two give the same pixels up to
rounding: both decode with libpng and apply the EXIF orientation, the NumPy resize computes OpenCV's
INTER_AREA / INTER_LINEAR weights, grey is 0.299 R + 0.587 G + 0.114 B.
tests/runtime/test_preprocess.py compares them.
"""

from __future__ import annotations

import io
import os
import re
import struct
import warnings
import zlib
from dataclasses import dataclass, replace
from functools import partial
from typing import NamedTuple

import numpy as np

from lnn.formats import limits
from lnn.formats.errors import LnnError, LnnInputError, LnnWarning
from lnn.formats.files import read_regular_file

LIBRARIES = ("opencv", "pillow")
GRAY_WEIGHTS_BGR = (0.114, 0.587, 0.299)
BAND_ROWS = 256           # rows resized at a time without OpenCV
WIDE_GRAY_MODES = ("I", "I;16", "I;16B", "I;16L", "I;16N")     # Pillow's modes for 16-bit grey images
GRAY_MODES = ("LA", "La", "1")                                  # Pillow's grey modes other than L and 16-bit
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
    """Import OpenCV on first use (it costs ~0.2 s), its log silenced (its codecs' warnings, such as libjpeg's or
    libtiff's, would be stray lines on stderr): lnn reports a problem itself, in one line."""
    global _cv2
    if _cv2 is None:
        import cv2
        cv2.utils.logging.setLogLevel(cv2.utils.logging.LOG_LEVEL_SILENT)
        _cv2 = cv2
    return _cv2


def _pillow():
    """Pillow, its own decompression-bomb limit raised to lnn's (process-wide): every header is checked
    against formats/limits.py before Pillow opens it, and Pillow's lower default warned on 100 MP photos."""
    from PIL import Image, ImageOps

    if Image.MAX_IMAGE_PIXELS is not None and Image.MAX_IMAGE_PIXELS < limits.MAX_IMAGE_PIXELS:
        Image.MAX_IMAGE_PIXELS = limits.MAX_IMAGE_PIXELS
    return Image, ImageOps


def _decode(data: bytes, header: "ImageHeader", notes: list):
    """Encoded bytes -> HxWx3 uint8 BGR, or HxW uint8 for a grey image, reduced by header.reduction
    (a JPEG); None when the library cannot decode them; LnnInputError (without a file name) for a JPEG or
    PNG whose data is damaged. JPEG: libjpeg-turbo through simplejpeg (_decode_jpeg, which may add a remark
    to notes), the image library only for what TurboJPEG refuses to decode at all."""
    if header.format == "JPEG":
        image = _decode_jpeg(data, header, notes)
        if image is not None:
            return image
    if header.format == "PNG":
        data = png_pixel_chunks(data)
    if image_library() == "opencv":
        cv2 = _opencv()
        flags = cv2.IMREAD_ANYCOLOR | OPENCV_REDUCED.get(header.reduction, 0)   # grey stays one channel
        try:
            return cv2.imdecode(np.frombuffer(data, np.uint8), flags)
        except cv2.error:
            return None
    try:
        return _pillow_decode(data, header)
    except (OSError, SyntaxError, ValueError, _pillow()[0].DecompressionBombError):
        return None


def _decode_jpeg(data: bytes, header: "ImageHeader", notes: list) -> np.ndarray | None:
    """A JPEG -> HxWx3 BGR or HxW grey uint8, reduced by header.reduction, EXIF orientation applied (as OpenCV
    does); None where TurboJPEG cannot decode it at all (the image library tries). TurboJPEG reports libjpeg's
    warnings as errors where OpenCV prints them on stderr and answers with the damaged pixels: data that lost
    its place (JPEG_DAMAGE) is refused; the other warnings leave the pixels whole, and the image is decoded.
    Data left over after a scan's last block (JPEG_LEFTOVER) is decoded with a remark in notes: DJI drones and
    some camera modules write such bytes in good photos, and most damage to a photo's data (bit flips, a run
    of bytes lost or repeated) ends the same way, which no decoder can tell apart. Bytes before a marker that
    libjpeg discards in the header (header.extra: some webcams and scanners write them) are cut out first, and
    header values libjpeg warns about and then assumes (header.fixes) are written as it assumes them: TurboJPEG
    refuses a file with a warning in its header (turbojpeg_copy)."""
    try:
        import simplejpeg
    except ImportError:
        raise LnnError("cannot decode JPEG photos: simplejpeg (lnn's dependency) is not installed "
                       "(pip install simplejpeg)") from None
    if header.extra or header.fixes:
        data = turbojpeg_copy(data, header)
    options = dict(colorspace="GRAY" if header.components == 1 else "BGR",
                   min_height=-(-header.height // header.reduction), min_width=-(-header.width // header.reduction))
    try:
        image = simplejpeg.decode_jpeg(data, **options)
    except ValueError as error:
        warning = str(error).strip()
        if JPEG_DAMAGE.search(warning):
            raise LnnInputError(f"the JPEG's data is damaged (libjpeg: {warning}); copy or take it again") from None
        leftover = JPEG_LEFTOVER.search(warning)
        if leftover:
            notes.append(f"the JPEG's data ran on after its image ended ({leftover[1]} bytes left over): some cameras "
                         f"write such bytes, and damage to the data ends the same way; if part of the photo looks "
                         f"wrong, copy or take it again")
        try:
            image = simplejpeg.decode_jpeg(data, strict=False, **options)
        except ValueError:
            return None
    return np.ascontiguousarray(exif_oriented(image[:, :, 0] if header.components == 1 else image,
                                              header.orientation))


def turbojpeg_copy(data: bytes, header: "ImageHeader") -> bytes:
    """The JPEG as TurboJPEG reads it, which refuses a file whose header libjpeg warns about, where libjpeg reads on
    (and OpenCV, given it, prints the warning on stderr): the bytes before markers that libjpeg discards cut out
    (header.extra), and an unknown JFIF major version or Adobe colour transform written as libjpeg then assumes
    it (header.fixes)."""
    fixed = bytearray(data)
    for offset, value in header.fixes:
        fixed[offset] = value
    kept, start = [], 0
    view = memoryview(fixed)
    for skip_start, skip_stop in header.extra:
        kept.append(view[start:skip_start])
        start = skip_stop
    return b"".join([*kept, view[start:]])


def exif_oriented(image: np.ndarray, orientation: int) -> np.ndarray:
    """The image turned as its EXIF orientation (1-8) asks, as OpenCV's imdecode turns it: 2 mirrored, 3 turned
    half a turn, 4 flipped, 5 transposed, 6 turned a quarter clockwise, 7 transposed and turned half, 8 a
    quarter anticlockwise. A view."""
    if orientation in (5, 6, 7, 8):
        image = image.swapaxes(0, 1)
    if orientation in (2, 3, 6, 7):
        image = image[:, ::-1]
    if orientation in (3, 4, 7, 8):
        image = image[::-1]
    return image


def png_pixel_chunks(data: bytes) -> bytes:
    """The PNG without the ancillary chunks OpenCV's decoder does not use for its pixels (colour profiles, text,
    gamma, ...): libpng checks each one it meets and prints its own warning on stderr for a damaged one
    (`libpng warning: iCCP: ...`); OpenCV gives no way to turn that off. Kept: the critical chunks, PNG_PIXEL_CHUNKS
    and text holding EXIF (its orientation is applied), each checked against its CRC first: a kept ancillary
    chunk that fails it is dropped (libpng would warn and skip it), a critical one is LnnInputError (without a
    file name; libpng would print its own line, then fail). The data is returned as it is when nothing is dropped.
    At most MAX_PNG_CHUNKS chunks are walked (LnnInputError): each kept one is a view held until the join, and a
    16x16 PNG with 8 M empty IDAT chunks (96 MB) took 2.5 GB. For OpenCV, its image data must not inflate to much
    more than its image needs (png_inflates_within)."""
    view = memoryview(data)
    kept, position, dropped, image_data = [view[:8]], 8, False, []
    for _ in range(limits.MAX_PNG_CHUNKS):
        if position + 12 > len(data):
            break
        length = int.from_bytes(data[position:position + 4], "big")
        kind, end = data[position + 4:position + 8], position + 12 + length
        ancillary = kind[0] & 0x20                                 # a lower-case first letter
        unused = ancillary and kind not in PNG_PIXEL_CHUNKS and not data.startswith(PNG_EXIF_TEXT, position + 8)
        damage = None if unused else (
            "runs past the end of the file" if end > len(data) else
            "fails its CRC check" if zlib.crc32(view[position + 4:end - 4]) != int.from_bytes(view[end - 4:end], "big")
            else None)
        if unused or damage and ancillary:
            dropped = True
        elif damage:
            raise LnnInputError(f"the PNG is damaged (its {kind.decode('latin-1')!r} chunk {damage}); copy or take it again")
        else:
            kept.append(view[position:end])
            if kind == b"IDAT":
                image_data.append(view[position + 8:end - 4])
        position = end
        if kind == b"IEND":
            break
    else:
        raise LnnInputError(f"the PNG has more than {limits.MAX_PNG_CHUNKS:,} chunks (lnn's limit)")
    if image_library() == "opencv":                # Pillow stops inflating where the image is whole
        png_inflates_within(data, image_data)
    return b"".join([*kept, view[position:]]) if dropped else data


PNG_CHANNELS = {0: 1, 2: 3, 3: 1, 4: 2, 6: 4}          # by colour type: grey, RGB, palette, grey + alpha, RGBA
ADAM7_PASSES = ((0, 0, 8, 8), (4, 0, 8, 8), (0, 4, 4, 8), (2, 0, 4, 4), (0, 2, 2, 4), (1, 0, 2, 2), (0, 1, 1, 2))
INFLATE_STEP = 1 << 20                                # bytes inflated at a time by png_inflates_within


def png_image_bytes(data: bytes) -> int:
    """The bytes a PNG's image data inflates to, from its IHDR: each row's filter byte and pixels, for every pass of
    an interlaced (Adam7) one; 0 for a colour type or bit depth no PNG has."""
    width, height, depth, colour, _, _, interlaced = struct.unpack(">IIBBBBB", data[16:29])
    bits = depth * PNG_CHANNELS.get(colour, 0)
    passes = ADAM7_PASSES if interlaced else ((0, 0, 1, 1),)
    total = 0
    for x0, y0, dx, dy in passes:
        columns, rows = -(-(width - x0) // dx), -(-(height - y0) // dy)
        if columns > 0 and rows > 0:
            total += rows * (1 + -(-columns * bits // 8))
    return total


def png_inflates_within(data: bytes, image_data: list) -> None:
    """LnnInputError where a PNG's image data (its IDAT chunks' bytes) inflates to over twice what its image needs
    (png_image_bytes) and 64 KB: deflate packs up to 1032 bytes in one, so a 486 KB PNG of a 100x100 image carried
    500 MB of zeros, which libpng inflated whole (1 s, and a 'Too much image data' line on stderr), and a 10 MB upload
    would have taken 20 s of a decoding thread (Pillow stops where the image is whole: 25 ms). Inflated here a step
    at a time, up to that bound (no more memory than a step), before OpenCV decodes it: one more inflation of every
    PNG (by hand: 63 against 28 ms for a 1600x1200 photo saved as PNG, 1.9 MB); a stream zlib cannot read is left
    to the decoder's own error."""
    bound = 2 * png_image_bytes(data) + 65536
    inflater, inflated = zlib.decompressobj(), 0
    try:
        for chunk in image_data:
            while chunk and not inflater.eof:
                inflated += len(inflater.decompress(chunk, INFLATE_STEP))
                if inflated > bound:
                    raise LnnInputError(f"the PNG's image data inflates to more than {bound:,} bytes, where its "
                                        f"image needs {png_image_bytes(data):,} (a decompression bomb)")
                chunk = inflater.unconsumed_tail
    except zlib.error:
        return


def _pillow_decode(data: bytes, header: "ImageHeader") -> np.ndarray:
    """Pillow: HxWx3 BGR or HxW grey uint8, EXIF orientation applied, reduced by header.reduction."""
    Image, ImageOps = _pillow()
    with Image.open(io.BytesIO(data)) as picture:
        if header.reduction > 1:                                 # libjpeg's scaled decoding, as OpenCV's
            picture.draft(picture.mode, (header.width // header.reduction, header.height // header.reduction))
        if picture.getexif().get(EXIF_ORIENTATION, 1) != 1:       # OpenCV applies the EXIF orientation too
            picture = ImageOps.exif_transpose(picture)
        if picture.mode in GRAY_MODES:
            picture = picture.convert("L")
        elif picture.mode not in ("RGB", "L", *WIDE_GRAY_MODES):
            picture = picture.convert("RGB")
        return _pillow_pixels(picture)


def _pillow_pixels(picture) -> np.ndarray:
    """An RGB, L or 16-bit grey Pillow image -> HxWx3 BGR or HxW uint8 (16-bit: the high byte, as OpenCV
    keeps), copied in bands of rows: np.asarray(picture) would hold two more whole copies at once (its
    bytes, then their join): 300 MB more at 50 MP."""
    width, height = picture.size
    channels = 3 if picture.mode == "RGB" else 1
    out = np.empty((height, width, channels), np.uint8)
    for top in range(0, height, BAND_ROWS):
        rows = min(BAND_ROWS, height - top)
        band = np.asarray(picture.crop((0, top, width, top + rows))).reshape(rows, width, channels)
        if picture.mode in WIDE_GRAY_MODES:
            band = (band.astype(np.uint32) >> 8).clip(0, 255)
        out[top:top + rows] = band[:, :, ::-1]                   # RGB -> BGR (grey: one channel, unchanged)
    return out[:, :, 0] if channels == 1 else out


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


# --------------------------------------------------------------------------- reading and headers

@dataclass(frozen=True)
class ImageHeader:
    """What an image file's header says, read before any decoding."""

    format: str                  # JPEG, PNG, BMP, GIF, WebP, TIFF, PNM
    width: int
    height: int
    complete: bool = True        # JPEG and PNG: the data reaches the end marker (bytes after it are allowed); GIF:
                                 # its first image's descriptor
    astray: bool = False         # JPEG, not complete: yet an end marker follows its last scan's start (damage: a false
                                 # marker in the data led the walk past it), so not truncated
    reducible: bool = False      # a baseline JPEG: libjpeg can decode it at 1/2, 1/4, 1/8 of its size
    reduction: int = 1           # the factor it will be decoded at (set by check_header)
    components: int = 0          # JPEG: the frame's colour components (1: grey; 3: YCbCr or RGB; 4: CMYK)
    orientation: int = 1         # JPEG: the EXIF orientation (1-8; 1 also where there is none or it is garbled)
    extra: tuple = ()            # JPEG: (start, stop) of the bytes before markers that libjpeg discards
    fixes: tuple = ()            # JPEG: (offset, value) of header bytes libjpeg warns about, as it assumes them

    @property
    def pixels(self) -> int:
        return self.width * self.height

    @property
    def decoded_pixels(self) -> int:
        """The pixels the decoder makes: a reduced JPEG's (its sides rounded up, as libjpeg rounds them)."""
        return -(-self.width // self.reduction) * -(-self.height // self.reduction)


JPEG_SOF = set(range(0xC0, 0xD0)) - {0xC4, 0xC8, 0xCC}        # start-of-frame markers (C4 DHT, C8 JPG, CC DAC)
JPEG_BASELINE_SOF = {0xC0, 0xC1}                              # sequential Huffman: decoded in a few rows at a time
JPEG_STANDALONE = {0x01, *range(0xD0, 0xD8)}                  # TEM, RSTn: markers without a length
JPEG_NEXT_MARKER = re.compile(rb"\xff\xff*[^\x00\xd0-\xd7\xff]")   # in entropy-coded data: 0xFF00 is a stuffed 0xFF,
                            # 0xFF fill bytes may come before any marker (RSTn too); written with a literal first
                            # byte, which re's search skips to (as \xff+ it tried every byte: 8x slower, 0.18 ms a
                            # 25 KB photo)
JPEG_DAMAGE = re.compile(r"premature end|bad (Huffman|arithmetic) code|instead of RST", re.IGNORECASE)
                             # libjpeg's warnings for entropy-coded data that lost its place: the rest is guessed
JPEG_LEFTOVER = re.compile(r"(\d+) extraneous bytes before marker 0x(?!d[0-7])[0-9a-f]{2}", re.IGNORECASE)
                             # data left over after a scan's last block (not before a restart marker: webcams pad
                             # their restart intervals): some cameras write it, and damage ends the same way
JPEG_EXIF = b"Exif\x00\x00"   # an APP1 segment holding EXIF (XMP uses APP1 too)
JPEG_JFIF = b"JFIF\x00"        # APP0: then the major and minor version (libjpeg warns about a major other than 1)
JPEG_ADOBE = b"Adobe"          # APP14: its 12th byte the colour transform, which libjpeg reads for 3 or 4 components:
JPEG_ADOBE_KNOWN = {3: (0, 1), 4: (0, 2)}     # 3: RGB, YCbCr; 4: CMYK, YCCK
JPEG_ADOBE_ASSUMED = {3: 1, 4: 2}             # any other: libjpeg warns, then assumes YCbCr (3) or YCCK (4)
MAX_EXIF_BLOCKS = 8            # EXIF blocks read for an orientation (each can hold 5,000 entries to walk)
TIFF_SIZE_TYPES = {1: "B", 6: "B", 3: "H", 8: "H", 4: "I", 9: "I", 13: "I", 16: "Q", 17: "Q", 18: "Q"}
                               # the entry types libtiff takes a width or height from (BYTE, SHORT, LONG, IFD, LONG8,
                               # IFD8; the signed ones read unsigned: a negative size is over the limits), as struct
                               # reads them. An 8-byte value lies at the offset the entry holds: libtiff and Pillow
                               # read it there in a classic TIFF too (lnn read the offset as the size)
GIF_IMAGE, GIF_EXTENSION, GIF_TRAILER = 0x2C, 0x21, 0x3B      # what a GIF's blocks start with: ",", "!", ";"
PNM_HEADER_BYTES = 4096        # the start of a PNM read for its size, comments and all
PNM_GAP = re.compile(rb"(?:\s+|#[^\r\n]*)*")   # whitespace and comments before a PNM header's number (always matches:
                                               # no backtracking)
PNM_NUMBER = re.compile(rb"\d+")
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
PNG_IEND = b"\x00\x00\x00\x00IEND\xaeB`\x82"                  # the last chunk: always these 12 bytes
PNG_PIXEL_CHUNKS = {b"tRNS", b"eXIf", b"acTL", b"fcTL", b"fdAT"}   # ancillary, used by OpenCV: transparency,
                                                                 # EXIF orientation, an animation's first frame
PNG_EXIF_TEXT = (b"Raw profile type exif\x00", b"Raw profile type APP12\x00")   # a text chunk's keyword: EXIF
OPENCV_REDUCED = {2: 16, 4: 32, 8: 64}                       # cv2.IMREAD_REDUCED_*_2/4/8's scale bits
REDUCTIONS = (2, 4, 8)

def read_header(data: bytes) -> ImageHeader | None:
    """The format and size from an image's header (and, for JPEG, PNG and GIF, whether the data is complete);
    None for data that is none of the formats lnn reads. Raises LnnInputError (without a file name) for a
    JPEG over the scan or segment limits, a GIF over its block limit, and a PNM whose size the decoders read
    differently."""
    try:
        if data[:3] == b"\xff\xd8\xff":
            return _jpeg_header(data)
        if data[:8] == PNG_SIGNATURE and data[12:16] == b"IHDR":
            width, height = struct.unpack(">II", data[16:24])
            return ImageHeader("PNG", width, height, complete=PNG_IEND in data)
        if data[:2] == b"BM":
            if struct.unpack("<I", data[14:18])[0] == 12:        # OS/2 BITMAPCOREHEADER
                width, height = struct.unpack("<HH", data[18:22])
            else:
                width, height = struct.unpack("<ii", data[18:26])
            return ImageHeader("BMP", abs(width), abs(height))   # negative height: stored top-down
        if data[:6] in (b"GIF87a", b"GIF89a"):
            return _gif_header(data)
        if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
            return _webp_header(data)
        if data[:4] in (b"II*\x00", b"MM\x00*"):
            return _tiff_header(data)
        if data[:1] == b"P" and data[1:2] in b"123456" and data[2:3].isspace():
            return _pnm_header(data)
    except (struct.error, ValueError, LookupError):   # a header cut short or garbled: not an image we can read
        return None
    return None


READABLE = "JPEG, PNG, BMP, TIFF, WebP, GIF, PNM"               # the formats read_header knows, for error lines
PHOTO_SUFFIXES = (".jpg", ".jpeg", ".png", ".bmp", ".tif", ".tiff", ".webp")     # files taken from a folder as photos
UNREADABLE_PHOTO_SUFFIXES = (".heic", ".heif", ".avif")     # photos lnn cannot read (unreadable_kind says what to do)
HEIF_BRANDS = {b"heic", b"heix", b"hevc", b"hevx", b"heim", b"heis", b"mif1", b"msf1"}    # ISO media: HEIF stills
AVIF_BRANDS = {b"avif", b"avis"}
VIDEO_BRANDS = {b"isom", b"iso2", b"iso4", b"iso5", b"iso6", b"mp41", b"mp42", b"avc1", b"qt  ", b"M4V ", b"3gp4",
                b"3gp5", b"3gp6", b"3g2a"}                       # MP4, QuickTime and phones' 3GP videos
SEND_AS_JPEG = "save or send it as JPEG"


def unreadable_kind(data: bytes) -> str | None:
    """What a file lnn does not read is, with what to do, when it is a kind people send for a photo: "a HEIC
    photo (...); ..." for an iPhone's own photos, AVIF, JPEG XL, JPEG 2000, a video, a PDF, an SVG drawing, a
    web page. None for anything else (read_header's None then stays "not an image lnn can read")."""
    if data[4:8] == b"ftyp":                                      # ISO base media: HEIF, AVIF, MP4, QuickTime
        size = int.from_bytes(data[:4], "big")
        brands = {data[8:12], *(data[i:i + 4] for i in range(16, min(size, 256) - 3, 4))}
        if brands & AVIF_BRANDS:
            return f"an AVIF picture, which lnn cannot read; {SEND_AS_JPEG}"
        if brands & HEIF_BRANDS:
            return (f"a HEIC photo (an iPhone's own format), which lnn cannot read; {SEND_AS_JPEG} (on the iPhone: "
                    f"Settings > Camera > Formats > Most Compatible)")
        if data[8:12] in VIDEO_BRANDS:                            # the major brand (a Canon raw, CR3, lists isom too)
            return "a video, not a photo; send a photo (JPEG)"
    if data[:2] == b"\xff\x0a" or data[:12] == b"\x00\x00\x00\x0cJXL \r\n\x87\n":
        return f"a JPEG XL picture, which lnn cannot read; {SEND_AS_JPEG}"
    if data[:12] == b"\x00\x00\x00\x0cjP  \r\n\x87\n" or data[:4] == b"\xff\x4f\xff\x51":
        return f"a JPEG 2000 picture, which lnn cannot read; {SEND_AS_JPEG}"
    if data[:5] == b"%PDF-":
        return "a PDF document, not a photo; send the photo itself (JPEG)"
    start = data[:1024].lstrip(b"\xef\xbb\xbf \t\r\n").lower()
    if start.startswith(b"<svg") or (start.startswith(b"<?xml") and b"<svg" in start):
        return "an SVG drawing, not a photo; send a photo (JPEG)"
    if start.startswith((b"<!doctype html", b"<html")):
        return "a web page (HTML), not a photo; send the photo itself (JPEG)"
    return None


def _jpeg_header(data: bytes) -> ImageHeader | None:
    """Walk the JPEG's segments (skipping entropy-coded data) to its end-of-image marker: the frame
    header gives the size, and data ending before the marker is truncated (bytes after it are allowed:
    phones append their own). Bytes before a marker that libjpeg discards (anything but 0xFF, and 0xFF 0x00
    pairs: some webcams and scanners write them) are skipped, their places kept in `extra`. A JFIF major version
    other than 1, or an Adobe colour transform libjpeg does not know for the frame's components, is kept in
    `fixes` as the value libjpeg warns about and then assumes (jdmarker.c, jdapimin.c). A walk that ends short of
    an end marker which the data after its last scan holds went astray (`astray`): a bit flipped in the data made
    a marker there, whose length led past the end; the file is damaged, not truncated. The orientation
    is that of the first EXIF block before the first scan that holds one (of at most MAX_EXIF_BLOCKS), as
    OpenCV reads it."""
    frame, scans, position, end = None, 0, 2, len(data)
    orientation, exif_blocks, extra, fixes, adobe_transform, scan_data = None, 0, [], [], None, None

    def header(complete: bool) -> ImageHeader | None:
        astray = not complete and scan_data is not None and data.find(b"\xff\xd9", scan_data) >= 0
        if frame is None:
            return None if complete else ImageHeader("JPEG", 0, 0, complete=False, astray=astray)
        marker, segment = frame
        height, width = struct.unpack(">HH", segment[1:5])
        assumed = JPEG_ADOBE_ASSUMED.get(segment[5])              # the last Adobe segment's transform counts
        unknown_transform = (adobe_transform is not None and assumed
                             and data[adobe_transform] not in JPEG_ADOBE_KNOWN[segment[5]])
        adobe_fix = [(adobe_transform, assumed)] if unknown_transform else []
        return ImageHeader("JPEG", width, height, complete=complete, astray=astray,
                           reducible=marker in JPEG_BASELINE_SOF, components=segment[5], orientation=orientation or 1,
                           extra=tuple(extra), fixes=tuple(fixes + adobe_fix))

    for _ in range(limits.MAX_JPEG_SEGMENTS):
        if position >= end:
            break
        if data[position] != 0xFF:                              # discarded bytes before a marker
            following = data.find(b"\xff", position)
            if following < 0:
                break
            extra.append((position, following))
            position = following
        marker_start = position
        while position < end and data[position] == 0xFF:        # the marker's 0xFF and any fill bytes
            position += 1
        if position >= end:
            break
        marker = data[position]
        position += 1
        if marker == 0x00:                                      # 0xFF 0x00 outside entropy-coded data: discarded
            extra.append((marker_start, position))
            continue
        if marker == 0xD9:                                      # end of image
            return header(complete=True)
        if marker in JPEG_STANDALONE:
            continue
        length = struct.unpack(">H", data[position:position + 2])[0]
        if length < 2:                                          # garbled: the decoder decides
            return header(complete=True)
        if marker in JPEG_SOF and frame is None:
            frame = (marker, data[position + 2:position + length])
        if marker == 0xE0 and length >= 16 and end > position + 7 and data.startswith(JPEG_JFIF, position + 2) \
                and data[position + 7] != 1:
            fixes.append((position + 7, 1))                     # JFIF major version: libjpeg reads on as 1
        if marker == 0xEE and length >= 14 and end > position + 13 and data.startswith(JPEG_ADOBE, position + 2):
            adobe_transform = position + 13
        if (marker == 0xE1 and orientation is None and scans == 0 and exif_blocks < MAX_EXIF_BLOCKS
                and data.startswith(JPEG_EXIF, position + 2)):
            exif_blocks += 1
            orientation = _exif_orientation(data[position + 8:position + length])
        position += length
        if marker == 0xDA:                                      # start of scan: entropy-coded data follows
            scans += 1
            if scans > limits.MAX_JPEG_SCANS:
                raise LnnInputError(f"the JPEG has more than {limits.MAX_JPEG_SCANS} scans (lnn's limit)")
            scan_data = position
            following = JPEG_NEXT_MARKER.search(data, position)
            if following is None:
                break
            position = following.start()
    else:
        raise LnnInputError(f"the JPEG has more than {limits.MAX_JPEG_SEGMENTS} segments (lnn's limit)")
    return header(complete=False)


def _exif_orientation(tiff: bytes) -> int | None:
    """The orientation tag (EXIF_ORIENTATION) of EXIF's first IFD (a TIFF structure), its 16 bits read whatever
    type the entry claims, as OpenCV reads it: 1-8, or 1 for a value out of that range; None where the block
    is garbled or has no such tag (OpenCV then reads the next block)."""
    try:
        order, entries = _first_ifd_entries(tiff)
        for entry in entries:
            if struct.unpack(order + "H", tiff[entry:entry + 2])[0] == EXIF_ORIENTATION:
                value = struct.unpack(order + "H", tiff[entry + 8:entry + 10])[0]
                return value if 1 <= value <= 8 else 1
    except (KeyError, struct.error):
        pass
    return None


def _webp_header(data: bytes) -> ImageHeader:
    chunk = data[12:16]
    if chunk == b"VP8X":                                        # extended: 24-bit sizes minus one
        return ImageHeader("WebP", int.from_bytes(data[24:27], "little") + 1, int.from_bytes(data[27:30], "little") + 1)
    if chunk == b"VP8L":                                        # lossless: 14-bit sizes minus one
        bits = int.from_bytes(data[21:25], "little")
        return ImageHeader("WebP", (bits & 0x3FFF) + 1, ((bits >> 14) & 0x3FFF) + 1)
    if chunk == b"VP8 ":                                        # lossy: after the key frame's start code
        width, height = struct.unpack("<HH", data[26:30])
        return ImageHeader("WebP", width & 0x3FFF, height & 0x3FFF)
    raise ValueError("unknown WebP chunk")


def _gif_header(data: bytes) -> ImageHeader:
    """A GIF's size: its logical screen's, grown to hold its first image (the image descriptor's left + width and
    top + height), as Pillow grows it before decoding that image (lnn read the screen only, and a 15800x15800 image
    under a 16x16 screen passed the limits; OpenCV refuses an image that overflows the screen). The blocks before the
    image are walked as Pillow walks them: the global colour table, extensions (a label, then sub-blocks up to an
    empty one), any other byte skipped; at most MAX_GIF_BLOCKS (LnnInputError). A GIF that ends before its first
    image is truncated; one whose trailer comes first keeps the screen's size (no decoder finds an image in it)."""
    width, height, flags = struct.unpack("<HHB", data[6:11])
    position = 13 + (3 << ((flags & 7) + 1) if flags & 0x80 else 0)     # after the global colour table
    in_extension = False
    for _ in range(limits.MAX_GIF_BLOCKS):
        if position >= len(data):
            return ImageHeader("GIF", width, height, complete=False)
        block = data[position]
        if in_extension:                               # a sub-block: its length, then its bytes; an empty one ends it
            position += 1 + block
            in_extension = block != 0
        elif block == GIF_IMAGE:
            left, top, image_width, image_height = struct.unpack("<4H", data[position + 1:position + 9])
            return ImageHeader("GIF", max(width, left + image_width), max(height, top + image_height))
        elif block == GIF_TRAILER:
            return ImageHeader("GIF", width, height)
        elif block == GIF_EXTENSION:                   # the introducer, then the extension's label
            position += 2
            in_extension = True
        else:                                          # a stray byte
            position += 1
    raise LnnInputError(f"the GIF has more than {limits.MAX_GIF_BLOCKS:,} blocks before its first image (lnn's limit)")


def _pnm_header(data: bytes) -> ImageHeader:
    """The width and height after a PNM's magic, as OpenCV and Pillow read them: each number follows whitespace and
    comments, from '#' to the end of its line, which both end at a CR or an LF (lnn ended them at an LF only, and read
    `P4 #<CR>8900 8900 #x<LF>1 1` as 1x1, which OpenCV decoded as 8900x8900), and ends at whitespace. A '#' right
    after a number is LnnInputError: OpenCV ends the number there, Pillow reads on after the comment (`89#<LF>00` is
    8900 to it). A size not ended within the first PNM_HEADER_BYTES is ValueError: cut there it would read short."""
    header, position, sides = data[:PNM_HEADER_BYTES], 2, []
    while len(sides) < 2:
        number = PNM_NUMBER.match(header, PNM_GAP.match(header, position).end())
        if number is None:
            raise ValueError("no PNM size")
        position = number.end()
        if header[position:position + 1] == b"#":
            raise LnnInputError("the PNM header's size can be read two ways (a comment right after a number: OpenCV "
                                "ends the number there, Pillow reads on after the comment); put a space before it")
        if not header[position:position + 1].isspace():
            raise ValueError("a PNM size not ended by whitespace within PNM_HEADER_BYTES")
        sides.append(int(number[0]))
    return ImageHeader("PNM", *sides)


def _first_ifd_entries(tiff: bytes) -> tuple:
    """(struct's byte order, the offsets of the 12-byte entries of the first IFD) of a TIFF structure (a TIFF file,
    or the EXIF block of a JPEG); KeyError or struct.error where it is garbled."""
    order = {b"II": "<", b"MM": ">"}[tiff[:2]]
    first = struct.unpack(order + "I", tiff[4:8])[0]
    count = struct.unpack(order + "H", tiff[first:first + 2])[0]
    return order, range(first + 2, first + 2 + 12 * count, 12)


def _tiff_header(data: bytes) -> ImageHeader:
    """The first image's width and height tags (256, 257) from the first IFD, each value read as its entry's type
    says (TIFF_SIZE_TYPES; a type libtiff refuses, or more than one value, is not read: KeyError or ValueError). A tag
    given more than once counts at its largest: libtiff (OpenCV) and Pillow take the first, and a 20000x20000 TIFF
    whose tags were repeated as 10x10 after them passed the pixel limits as 10x10."""
    order, entries = _first_ifd_entries(data)
    sizes = {}
    for entry in entries:
        tag, kind, count = struct.unpack(order + "HHI", data[entry:entry + 8])
        if tag in (256, 257):
            if count != 1:
                raise ValueError("a TIFF size tag with more than one value")
            value_type = order + TIFF_SIZE_TYPES[kind]
            at = entry + 8 if struct.calcsize(value_type) <= 4 else struct.unpack_from(order + "I", data, entry + 8)[0]
            sizes[tag] = max(sizes.get(tag, 0), struct.unpack_from(value_type, data, at)[0])
    return ImageHeader("TIFF", sizes[256], sizes[257])


class PixelLimit(NamedTuple):
    """A caller's own limit on an image's pixels (lnn-serve's --max-pixels), checked with lnn's own when the
    header is read, and the words of its error line: "the image is WxH = N pixels, over {called} of
    {pixels} pixels; {advice}"."""
    pixels: int
    called: str
    advice: str


def check_header(header: ImageHeader, name: str, keep_side: int = 0,
                 pixel_limit: PixelLimit | None = None) -> ImageHeader:
    """Refuse an image over the pixel limits (formats/limits.py, and the caller's pixel_limit), or truncated;
    choose its reduction: a baseline JPEG over MAX_DECODED_PIXELS is reduced below it, and one whose sides stay
    at least keep_side pixels (0: never) when reduced is decoded so (libjpeg's scaled decoding, the largest
    such factor)."""
    size = f"{header.width}x{header.height} = {header.pixels:,} pixels"
    if header.astray:
        raise LnnInputError(f"{name}: the JPEG's data is damaged (its markers lead past its end marker); copy or take "
                            f"it again")
    if not header.complete:
        raise LnnInputError(f"{name}: the image is truncated (it ends before its end marker); copy or take it again")
    if header.pixels == 0:
        raise LnnInputError(f"{name}: the {header.format} header says the image is {header.width}x{header.height}: "
                            f"not an image that can be decoded")
    if pixel_limit is not None and header.pixels > pixel_limit.pixels:
        raise LnnInputError(f"{name}: the image is {size}, over {pixel_limit.called} of {pixel_limit.pixels:,} "
                            f"pixels; {pixel_limit.advice}")
    if header.pixels > limits.MAX_IMAGE_PIXELS:
        raise LnnInputError(f"{name}: the image is {size}, over lnn's limit of {limits.MAX_IMAGE_PIXELS:,} pixels")
    if header.pixels > limits.MAX_DECODED_PIXELS and not header.reducible:
        kind = "progressive JPEG" if header.format == "JPEG" else header.format
        raise LnnInputError(f"{name}: the image is {size}; a {kind} cannot be decoded at a reduced size, and "
                            f"lnn's limit for decoding at full size is {limits.MAX_DECODED_PIXELS:,} pixels "
                            f"(save it as a baseline JPEG, or scale it down)")
    if not header.reducible:
        return header
    reduced = {factor: (-(-header.width // factor), -(-header.height // factor)) for factor in (1, *REDUCTIONS)}
    below_limit = next(factor for factor, (width, height) in reduced.items()
                       if width * height <= limits.MAX_DECODED_PIXELS)
    kept = max(factor for factor, (width, height) in reduced.items()
               if factor == 1 or keep_side and min(width, height) >= keep_side)
    return replace(header, reduction=max(below_limit, kept))


def read_image_file(path) -> bytes:
    """A regular file's bytes, up to MAX_IMAGE_FILE_BYTES (formats/files.py); anything else is one LnnInputError line."""
    return read_regular_file(path, "an image file", limits.MAX_IMAGE_FILE_BYTES, "MAX_IMAGE_FILE_BYTES")


def encoded_source(source, name: str | None) -> tuple:
    """(the encoded bytes, what error lines call them) of what decode_image takes: a path (str or os.PathLike),
    bytes-like, or a uint8 array of bytes, 1-D or [N, 1] (what cv2.imencode returns); anything else is one
    LnnInputError line."""
    if isinstance(source, np.ndarray) and source.dtype == np.uint8 and (source.ndim == 1 or source.shape[1:] == (1,)):
        return source.tobytes(), name or "<bytes>"
    if isinstance(source, (bytes, bytearray, memoryview)):
        return bytes(source), name or "<bytes>"
    if isinstance(source, (str, os.PathLike)):
        return read_image_file(source), name or str(source)
    what = (f"a {source.dtype} array of shape {list(source.shape)} (a decoded image goes to prepare_image)"
            if isinstance(source, np.ndarray) else f"{type(source).__name__} {repr(source)[:40]}")
    raise LnnInputError(f"{name or '<image>'}: a photo to decode is a path, encoded bytes, or a uint8 array of "
                        f"them (1-D or [N, 1], as cv2.imencode gives); not {what}")


def decode_image(source, name: str | None = None, keep_side: int = 0, notes: list | None = None,
                 pixel_limit: PixelLimit | None = None, before_decoding=None) -> np.ndarray:
    """Decode a path or encoded bytes (see encoded_source) into an HxWx3 uint8 BGR image, or HxW uint8 for a grey one; bad
    input raises LnnInputError: missing, not a regular file, too large, not an image, truncated, over
    the pixel limits. A baseline JPEG over MAX_DECODED_PIXELS comes back reduced (1/2, 1/4 or 1/8 of its
    size), and one whose sides stay at least keep_side pixels so reduced too (check_header): a caller that
    only needs that many (Session.decode_side) skips decoding the rest (a 1600x1200 phone photo for the
    bundled model: 1/4, 400x300). name: what the error lines call the image (default: the path, or "<bytes>").
    notes: a list that receives one-line remarks on the decoding (a JPEG whose data ran on past its image); without
    one they are issued as LnnWarning, the image named. pixel_limit: the caller's own limit (check_header),
    checked from the same reading of the header. before_decoding(header): called once the header has passed its
    checks, before the decoder runs (it may raise: lnn-serve sends a photo that decodes large to a lane of its own)."""
    image_library()      # before reading: a missing image library is one clear error
    data, name = encoded_source(source, name)
    if not data:
        raise LnnInputError(f"{name}: the file is empty")
    library = "OpenCV" if image_library() == "opencv" else "Pillow"
    try:
        header = read_header(data)
    except LnnInputError as err:
        raise LnnInputError(f"{name}: {err}") from None
    if header is None:
        raise LnnInputError(f"{name}: {unreadable_kind(data) or f'not an image lnn can read ({READABLE})'}")
    header = check_header(header, name, keep_side, pixel_limit)
    if before_decoding is not None:
        before_decoding(header)
    remarks = [] if notes is None else notes
    try:
        image = _decode(data, header, remarks)
    except LnnInputError as err:
        raise LnnInputError(f"{name}: {err}") from None
    except MemoryError:
        raise LnnInputError(f"{name}: not enough memory to decode this {header.width}x{header.height} image") from None
    if image is None or image.size == 0:
        raise LnnInputError(f"{name}: not an image {library} can decode (a damaged or unusual {header.format})")
    if notes is None:
        for remark in remarks:
            warnings.warn(f"{name}: {remark}", LnnWarning, stacklevel=2)
    return image


def read_image(source, keep_side: int = 0, notes: list | None = None) -> np.ndarray:
    """Decode a path or encoded bytes into an HxWx3 uint8 BGR image (grey copied to the three channels,
    as OpenCV's IMREAD_COLOR does); bad input raises LnnInputError; keep_side, notes: see decode_image."""
    image = decode_image(source, keep_side=keep_side, notes=notes)
    return np.repeat(image[:, :, None], 3, axis=2) if image.ndim == 2 else image


# --------------------------------------------------------------------------- arrays -> the model's input

def _image_array(image, notes: list) -> tuple[np.ndarray, bool]:
    """Any array a caller may pass -> (HxWx3 or HxWx1 array, uint8 or float32 in 0..255; is it grey).

    The rules (one LnnInputError line for anything else):
      HxW or HxWx1: grey; HxWx3: colour; HxWx4: colour with alpha, the alpha ignored.
      uint8: 0..255. Other integers: must hold 0..255. bool: refused.
      float: must be finite and within 0..255; when every value is within 0..1 it is read as 0..1
             (multiplied by 255) and a note says so."""
    image = np.asarray(image)
    shape = list(image.shape)
    if image.ndim == 2:
        image = image[:, :, None]
    if image.ndim != 3 or image.shape[2] not in (1, 3, 4):
        raise LnnInputError(f"an image must be HxW, HxWx3 or HxWx4 (BGRA), got shape {shape}")
    if image.size == 0:
        raise LnnInputError(f"the image is empty (shape {shape})")
    image = image[:, :, :3]
    kind = image.dtype.kind
    if kind == "b":
        raise LnnInputError("a bool array is not an image: pass uint8 values 0..255 (e.g. mask.astype(np.uint8) * 255)")
    if kind in "iu" and image.dtype != np.uint8:
        low, high = int(image.min()), int(image.max())
        if low < 0 or high > 255:
            raise LnnInputError(f"integer image values must be 0..255 (8-bit), got {low}..{high}; "
                                f"for a 16-bit image pass (image // 257).astype(np.uint8)")
        image = image.astype(np.uint8)
    elif kind == "f":
        image = image.astype(np.float32, copy=False)
        if not np.isfinite(image).all():
            raise LnnInputError("the image holds NaN or infinite values")
        low, high = float(image.min()), float(image.max())
        if low < 0 or high > 255:
            raise LnnInputError(f"float image values must be within 0..1 or 0..255, got {low:g}..{high:g}")
        if high <= 1:
            image = image * np.float32(255)
            notes.append("the float image's values are all within 0..1: read as 0..1 (x 255); "
                         "pass uint8 0..255 to avoid this guess")
    elif kind != "u":
        raise LnnInputError(f"an image must hold numbers (uint8 0..255, or float 0..1 or 0..255), not {image.dtype}")
    return image, image.shape[2] == 1


def channel_order(color) -> str:
    """`color`, the order of an image array's channels, as "bgr" or "rgb" (either case); anything else is one
    LnnInputError line."""
    if isinstance(color, str) and color.lower() in ("bgr", "rgb"):
        return color.lower()
    raise LnnInputError(f"color must be 'bgr' or 'rgb' (the order of the image's channels), not {color!r}")


def photo_array(image, color: str = "bgr") -> np.ndarray:
    """Any image array preprocess_image takes -> HxWx3 uint8 BGR, as the photo checks measure it."""
    color = channel_order(color)
    image, grey = _image_array(image, [])
    if grey:
        image = np.repeat(image, 3, axis=2)
    elif color == "rgb":
        image = image[:, :, ::-1]
    return image if image.dtype == np.uint8 else np.clip(np.rint(image), 0, 255).astype(np.uint8)


def input_range(preprocess: dict) -> tuple:
    """(low, high), each [C] float64 (or [1] for all channels): the values preprocess_image makes from any photo,
    per channel: pixels of 0 and 255 scaled, less the mean, over the std."""
    mean = np.asarray(preprocess["mean"], np.float64)
    ends = (np.array([[0.0], [255.0 * preprocess["scale"]]]) - mean) / np.asarray(preprocess["std"], np.float64)
    return ends.min(axis=0), ends.max(axis=0)


def preprocess_image(image: np.ndarray, preprocess: dict, color: str = "bgr", notes: list | None = None) -> np.ndarray:
    """HxW, HxWx3 (in `color` order) or HxWx4 image (see _image_array for the values taken) -> [C, H, W]
    float32 normalized for the model.

    notes: a list to which one-line remarks about the conversion are appended (a grey image given to a
    colour model, a float image read as 0..1); without one they are issued as LnnWarning."""
    color = channel_order(color)
    remarks = [] if notes is None else notes
    image, grey = _image_array(image, remarks)
    want = preprocess["color"]
    if want == "gray" and not grey:
        image = _bgr_to_gray(image if color == "bgr" else image[:, :, ::-1])[:, :, None]
    elif want != "gray" and grey:
        remarks.append(f"a grey image given to a colour ({want.upper()}) model: its grey is copied to the "
                       f"three channels; a colour photo gives a more reliable answer")
    height, width = preprocess["resize"]
    if image.shape[:2] != (height, width):     # before any channel reordering: a plain copy of fewer pixels
        image = resize_image(image, width, height)
    if want != "gray" and grey:
        image = np.repeat(image, 3, axis=2)
    elif want != "gray" and want != color:
        image = image[:, :, ::-1]
    # [C, H, W] first, then the arithmetic in place on whole channel planes: over a last axis of 3 channels
    # NumPy's loops were 5x slower (the same float32 operations in the same order: the same bytes)
    x = image.transpose(2, 0, 1).astype(np.float32, order="C")
    x *= np.float32(preprocess["scale"])
    x -= np.asarray(preprocess["mean"], np.float32).reshape(-1, 1, 1)
    x /= np.asarray(preprocess["std"], np.float32).reshape(-1, 1, 1)
    if notes is None:
        for remark in remarks:
            warnings.warn(remark, LnnWarning, stacklevel=3)
    return x
