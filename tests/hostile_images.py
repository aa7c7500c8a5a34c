"""Small hostile image files made at test time (no big files in the repository): a PNG or JPEG whose
header claims any size, for the decoding-limit tests of the runtime and the commands; a JPEG whose data runs
on after its image; the start of an iPhone's HEIC photo."""

from __future__ import annotations

import struct
import zlib


HEIC_START = b"\x00\x00\x00\x18ftypmif1\x00\x00\x00\x00mif1heic"        # an iPhone photo's first box (ISO media)


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


DATA_LEFT_OVER = bytes(range(1, 65))     # bytes after a scan's last block that no block uses, as DJI drones write


def with_data_left_over(data: bytes) -> bytes:
    """The JPEG with DATA_LEFT_OVER put before its end marker: the same pixels, and lnn's note that its data ran on."""
    end = data.rindex(b"\xff\xd9")
    return data[:end] + DATA_LEFT_OVER + data[end:]
