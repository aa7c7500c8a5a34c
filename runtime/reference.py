"""The pure-NumPy reference backend: runs each op's reference forward from the op registry.

It is the oracle every other backend is tested against, and the fallback that always works
(no compiler, no GPU). Input [N, *input_shape] float32, output the last layer's values.
`keep` names nodes whose outputs run_with_features() also returns (the gate's feature node).
"""

from __future__ import annotations

import time

import numpy as np

from lnn.formats.model import Model
from lnn.formats.ops import get_op
from lnn.runtime.features import check_kept


class NumpyBackend:
    """Stateless between calls, so safe to share between threads. `threads` is accepted and ignored
    (NumPy runs on BLAS's own threads), so that the same options work on every device."""

    name = "numpy"

    def __init__(self, model: Model, weights: dict, threads: int | None = None, keep: tuple = ()):
        self.model = model
        self.keep = check_kept(model, keep)
        self.params = [{p: weights[node.param_key(p)] for p in node.param_shapes} for node in model.nodes]

    def run_with_features(self, x: np.ndarray) -> tuple:
        """(the last layer's outputs, {kept node name: its output [N, ...]})."""
        kept = {}
        for node, params in zip(self.model.nodes, self.params):
            x = get_op(node.op).forward(x, params, node.attrs)
            if node.name in self.keep:
                kept[node.name] = np.asarray(x, dtype=np.float32)
        return np.asarray(x, dtype=np.float32), kept

    def run(self, x: np.ndarray) -> np.ndarray:
        return self.run_with_features(x)[0]

    def profile(self, x: np.ndarray, repeats: int) -> list:
        """[(node name, op, median seconds, None)] over `repeats` whole runs of x (lnn-bench --profile; None: no
        thread count of its own, as the cpu backend's rows have)."""
        times = np.zeros((repeats, len(self.model.nodes)))
        for repeat in range(repeats):
            y = x
            for index, (node, params) in enumerate(zip(self.model.nodes, self.params)):
                start = time.perf_counter()
                y = get_op(node.op).forward(y, params, node.attrs)
                times[repeat, index] = time.perf_counter() - start
        return [(node.name, node.op, float(np.median(column)), None) for node, column in zip(self.model.nodes, times.T)]
BACKEND = NumpyBackend
