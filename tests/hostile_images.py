"""Small hostile image files made at test time (no big files in the repository): a PNG or JPEG whose
header claims any size, for the decoding-limit tests of the runtime and the commands."""

from __future__ import annotations

import struct
import zlib


def png_chunk(kind: bytes, body: bytes) -> bytes:
    return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))


def png_claiming(width: int, height: int) -> bytes:
    """A grey PNG whose header says width x height, with the first rows of zeros as data (about 1 KB)."""
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0)
    rows = zlib.compress(bytes(width + 1) * 4)
    return b"\x89PNG\r\n\x1a\n" + png_chunk(b"IHDR", ihdr) + png_chunk(b"IDAT", rows) + png_chunk(b"IEND", b"")


def with_jpeg_size(data: bytes, width: int, height: int) -> bytes:
    """A baseline JPEG with its frame header rewritten to say width x height."""
    at = data.index(b"\xff\xc0") + 5
    return data[:at] + struct.pack(">HH", height, width) + data[at + 4:]
