"""Opening NumPy .npz archives (weights given to lnn-export, training checkpoints) with one-line errors."""

from __future__ import annotations

import zipfile
from pathlib import Path

import numpy as np

# What np.load and reading an archive's entries raise for a damaged or foreign file.
NPZ_READ_ERRORS = (ValueError, EOFError, OSError, zipfile.BadZipFile)


def open_npz(path: str | Path, kind: str, expected: str, error: type[Exception]):
    """np.load an .npz archive without pickles. A missing file, a folder, an unreadable file or a
    single-array .npy raises `error` with one line naming `kind` ("weights file") and what the file
    should have been (`expected`, e.g. "an lnn checkpoint")."""
    path = Path(path)
    try:
        archive = np.load(path, allow_pickle=False)
    except FileNotFoundError:
        raise error(f"{path}: no such {kind}") from None
    except IsADirectoryError:
        raise error(f"{path}: is a folder, not a {kind}") from None
    except NPZ_READ_ERRORS:
        raise error(f"{path}: not {expected} (the file is not a readable .npz archive)") from None
    if not isinstance(archive, np.lib.npyio.NpzFile):
        raise error(f"{path}: not {expected} (it holds a single array, saved with np.save)")
    return archive
