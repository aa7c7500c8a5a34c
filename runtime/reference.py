"""The pure-NumPy reference backend: runs each op's reference forward from the op registry.

It is the oracle every other backend is tested against, and the fallback that always works
(no compiler, no GPU). Input [N, *input_shape] float32, output the last layer's values.
"""

from __future__ import annotations

import numpy as np

from lnn.formats.model import Model
from lnn.formats.ops import get_op


class NumpyBackend:
    """Stateless between calls, so safe to share between threads. `threads` is accepted and ignored
    (NumPy runs on BLAS's own threads), so that the same options work on every device."""

    name = "numpy"

    def __init__(self, model: Model, weights: dict, threads: int | None = None):
        self.model = model
        self.params = [{p: weights[node.param_key(p)] for p in node.param_shapes} for node in model.nodes]

    def run(self, x: np.ndarray) -> np.ndarray:
        for node, params in zip(self.model.nodes, self.params):
            x = get_op(node.op).forward(x, params, node.attrs)
        return np.asarray(x, dtype=np.float32)
BACKEND = NumpyBackend
