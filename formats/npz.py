"""Opening NumPy .npz archives (weights given to lnn-export, training checkpoints) with one-line errors,
and reading what their arrays are (shape, dtype) from the .npy headers before reading any data, so an
archive whose header claims a 100000x100000 array is refused before anything is allocated for it."""

from __future__ import annotations

import io
import math
import zipfile
from pathlib import Path

import numpy as np

from lnn.formats.files import regular_file

# What np.load and reading an archive's entries raise for a damaged or foreign file.
NPZ_READ_ERRORS = (ValueError, EOFError, OSError, zipfile.BadZipFile)
NPZ_MAGIC = b"PK\x03\x04"                 # an .npz is a zip archive
CHECKPOINT_META = "meta.npy"               # the entry only lnn-train's checkpoints hold
NPY_HEADER_READERS = {(1, 0): np.lib.format.read_array_header_1_0, (2, 0): np.lib.format.read_array_header_2_0}


def open_npz(path: str | Path, kind: str, expected: str, error: type[Exception]):
    """np.load an .npz archive without pickles. A missing file, a folder, an unreadable file or a
    single-array .npy raises `error` with one line naming `kind` ("weights file") and what the file
    should have been (`expected`, e.g. "an lnn checkpoint")."""
    path = Path(path)
    regular_file(path, f"a {kind}", error)
    try:
        archive = np.load(path, allow_pickle=False)
    except NPZ_READ_ERRORS:
        raise error(f"{path}: not {expected} (the file is not a readable .npz archive)") from None
    if not isinstance(archive, np.lib.npyio.NpzFile):
        raise error(f"{path}: not {expected} (it holds a single array, saved with np.save)")
    return archive


def array_headers(archive, path, error: type[Exception]) -> dict:
    """key -> (shape, dtype) of every array of an open .npz, from its .npy header (a few hundred bytes
    each; no array data is read). A damaged header raises `error` in one line."""
    headers = {}
    for info in archive.zip.infolist():
        if not info.filename.endswith(".npy"):
            continue
        key = info.filename[:-len(".npy")]
        try:
            with archive.zip.open(info) as member:
                version = np.lib.format.read_magic(member)
                if version not in NPY_HEADER_READERS:
                    raise ValueError(f".npy format version {version[0]}.{version[1]}")
                shape, _fortran, dtype = NPY_HEADER_READERS[version](member)
        except (*NPZ_READ_ERRORS, SyntaxError, TypeError) as err:
            raise error(f"{path}: array {key!r} has a damaged header ({err})") from None
        headers[key] = (tuple(shape), dtype)
    return headers


def check_array_fits(path, key: str, header: tuple, most_elements: int, error: type[Exception]) -> None:
    """Refuse (one line) an array whose header claims more than `most_elements` values."""
    shape, dtype = header
    if math.prod(shape) > most_elements:
        raise error(f"{path}: array {key!r} claims shape {list(shape)} ({math.prod(shape):,} values of {dtype}) "
                    f"in its header, more than the {most_elements:,} the model can have there; the file is "
                    f"damaged or not for this model")


def is_checkpoint_bytes(data) -> bool:
    """True when `data` (bytes or a buffer) is a zip archive holding an lnn-train checkpoint's meta entry."""
    if bytes(data[:len(NPZ_MAGIC)]) != NPZ_MAGIC:
        return False
    try:
        with zipfile.ZipFile(io.BytesIO(data)) as archive:
            return CHECKPOINT_META in archive.namelist()
    except (zipfile.BadZipFile, OSError, ValueError):
        return False
