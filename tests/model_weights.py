"""Random weights for any model's parameters, shared by the tests: He-scaled normal weights for conv, linear and
recurrent kernels (a layer's outputs stay of order 1 through deep stacks, so an absolute tolerance of about 1e-4
means something in float32), norm scales near 1, biases and batch-norm means small but not zero, batch-norm
variances in [0.5, 1.5] (positive, not 1: folding them is then tested)."""

import numpy as np


def random_weights(model, seed=0) -> dict:
    """{parameter key: float32 array}; seed: an int or a numpy Generator."""
    rng = np.random.default_rng(seed)
    weights = {}
    for node in model.nodes:
        for name, shape in node.param_shapes.items():
            if name == "running_var":
                value = rng.uniform(0.5, 1.5, shape)
            elif len(shape) > 1:
                value = rng.standard_normal(shape) * np.sqrt(2 / np.prod(shape[1:]))
            elif name == "weight":                     # a norm's scale
                value = 1 + 0.2 * rng.standard_normal(shape)
            else:
                value = 0.3 * rng.standard_normal(shape)
            weights[node.param_key(name)] = value.astype(np.float32)
    return weights
