"""Per-thread caches of planned buffers, so that one backend (one Session) is safe to share between threads.

The CPU and CUDA backends plan a model once per batch size: buffers allocated once and kernel calls
bound to them. Two threads running one plan at once would write into each other's buffers, so each
calling thread gets its own plans (threading.local): concurrent calls share nothing mutable and run
in parallel, a single thread pays one attribute lookup, and a thread's plans are freed when it ends.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Callable, Hashable


class PerThreadCache:
    """`get(key)`: the calling thread's own value for key, built by `build(key)` on its first use; each
    thread keeps its `kept` most recently used values."""

    def __init__(self, build: Callable, kept: int):
        self._build = build
        self._kept = kept
        self._local = threading.local()

    def _values(self) -> OrderedDict:
        values = getattr(self._local, "values", None)
        if values is None:
            values = self._local.values = OrderedDict()
        return values

    def keys(self) -> list:
        """The calling thread's keys, least recently used first."""
        return list(self._values())

    def get(self, key: Hashable):
        local = self._local
        recent = getattr(local, "recent", None)       # (key, value) of this thread's last get: most calls repeat it
        if recent is not None and recent[0] == key:
            return recent[1]
        values = self._values()
        value = values.get(key)
        if value is None:
            value = values[key] = self._build(key)
            if len(values) > self._kept:
                values.popitem(last=False)
        else:
            values.move_to_end(key)
        local.recent = (key, value)
        return value
