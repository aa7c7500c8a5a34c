"""Where compiled Numba kernels are cached, and a cheap "is this model warm?" check.

Nothing here imports Numba, so a command can ask `kernels_cached(model)` before deciding
whether to load the Numba backend at all (importing Numba alone costs ~0.5 s; a cold
compile of a model's kernels costs seconds).

Cache directory, first match wins:
    $NUMBA_CACHE_DIR                        (the user's own choice, used as is)
    $LNN_CACHE_DIR/numba
    Linux:   $XDG_CACHE_HOME/lnn/numba, else ~/.cache/lnn/numba
    macOS:   ~/Library/Caches/lnn/numba
    Windows: %LOCALAPPDATA%\\lnn\\numba

Warm markers: after the backend has run a model once with the cache on, it writes an empty
file `lnn-warm/<digest>` in the cache directory. The digest covers the model's layers (without
names), the Python and Numba versions and the size and mtime of every kernel source file, so
editing a kernel or upgrading Numba makes every marker stale, as it makes Numba's own cache stale.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
import sys
import tempfile
from pathlib import Path

KERNEL_DIR = Path(__file__).resolve().parent


def default_cache_root() -> Path:
    """lnn's per-user cache root for this platform (the numba cache is its `numba` folder)."""
    if os.environ.get("LNN_CACHE_DIR"):
        return Path(os.environ["LNN_CACHE_DIR"])
    if sys.platform == "win32":
        return Path(os.environ.get("LOCALAPPDATA") or Path.home() / "AppData" / "Local") / "lnn"
    if sys.platform == "darwin":
        return Path.home() / "Library" / "Caches" / "lnn"
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "lnn"


def numba_cache_dir() -> Path:
    if os.environ.get("NUMBA_CACHE_DIR"):
        return Path(os.environ["NUMBA_CACHE_DIR"])
    return default_cache_root() / "numba"


def ensure_writable(path: Path) -> str | None:
    """Create `path` if needed and prove it writable; return None, or why it is not usable."""
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as err:
        return f"{err.strerror or err} ({path})"
    return None


def model_digest(model) -> str:
    """Digest of what decides which kernels a model compiles, plus the kernel sources' stamps."""
    layers = [{"op": node.op, "in": list(node.in_shape),
               "attrs": {k: v for k, v in sorted(node.attrs.items())}} for node in model.nodes]
    try:
        numba_version = importlib.metadata.version("numba")
    except importlib.metadata.PackageNotFoundError:
        numba_version = "absent"
    blob = json.dumps([layers, sys.version, numba_version, kernel_sources_digest()], default=list, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:32]


def kernel_sources_digest() -> str:
    """Digest of the size and mtime of every kernel source file (an edited kernel makes it new)."""
    sources = sorted((p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in KERNEL_DIR.glob("*.py"))
    return hashlib.sha256(json.dumps(sources).encode()).hexdigest()[:16]


def _marker(model) -> Path:
    return numba_cache_dir() / "lnn-warm" / model_digest(model)


def kernels_cached(model) -> bool:
    """True when this model's kernels were compiled into the cache by an earlier run (cheap: no Numba import)."""
    return _marker(model).exists()


def mark_cached(model) -> None:
    """Record that this model's kernels are in the cache (called by the backend after a first run)."""
    marker = _marker(model)
    try:
        marker.parent.mkdir(parents=True, exist_ok=True)
        marker.touch()
    except OSError:
        pass    # only an optimisation hint; the cache itself still works
