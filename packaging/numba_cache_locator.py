"""Where Numba caches compiled kernels inside the frozen (PyInstaller) lnn-field app.

Registered by the runtime hook (hooks/rthook_lnn_field.py) through NUMBA_CACHE_LOCATOR_CLASSES.
Numba's own locators fail in a frozen app: the kernels' source files do not exist on disk, so
NUMBA_CACHE_DIR is ignored, and the fallback keys the cache on the launch working directory and
crashes at import when that folder is not writable. This locator instead uses lnn's per-user
cache folder, the same one lnn/runtime/cpu/jit.py chooses (lnn.runtime.cpu.cache.numba_cache_dir),
in a sub-folder per install location, and stamps entries with the app's executable, so a new build
of the app recompiles while the same build reuses its kernels from any working directory.
"""

from __future__ import annotations

import hashlib
import os
import sys

from numba.core.caching import _CacheLocator, _SourceFileBackedLocatorMixin

from lnn.runtime.cpu.cache import numba_cache_dir


class FrozenAppCacheLocator(_SourceFileBackedLocatorMixin, _CacheLocator):
    """Numba's cache locator API: from_function() -> instance or None; cache path, source stamp, disambiguator.

    The source stamp (from the mixin) is a hash of sys.executable when frozen; the disambiguator is
    the function's first line number; Numba adds the module and function name to each file name."""

    def __init__(self, py_func, py_file):
        self._py_file = py_file
        self._lineno = py_func.__code__.co_firstlineno
        install = hashlib.sha1(os.path.dirname(os.path.abspath(sys.executable)).encode()).hexdigest()[:16]
        package = py_func.__module__.rpartition(".")[0] or py_func.__module__
        self._cache_path = os.path.join(numba_cache_dir(), f"frozen-{install}", package)

    def get_cache_path(self):
        return self._cache_path

    @classmethod
    def from_function(cls, py_func, py_file):
        if not getattr(sys, "frozen", False):
            return None                          # a normal install: Numba's own locators work
        locator = cls(py_func, py_file)
        try:
            locator.ensure_cache_path()
        except OSError:                          # not writable: jit.py has already turned caching off
            return None
        return locator
