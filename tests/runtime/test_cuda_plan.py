"""The CUDA backend's plan (layer fusion, batch-norm folding, buffers, layouts) on NumPy, where no GPU is.

`CudaBackend(model, weights, array_module=numpy)` runs the same plan with the generic kernels of
runtime/cuda/kernels.py (the ones the trainer shares) in place of the CuPy-only fused kernels; the
GPU run of the same cases is tests/runtime/test_cuda_backend.py. Cases: the CPU backend's op-driven
parity cases (every op of formats/ops.py, odd shapes), at batch sizes 1 (GEMM writes the output,
pointwise convs read their input as cols) and 3 (the [O, N, P] -> [N, O, P] epilogue).
"""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from conftest import EXAMPLES, REFERENCE_NAMES
from lnn.formats.model import load_model, parse_model
from lnn.runtime.cuda.backend import CudaBackend
from lnn.runtime.reference import NumpyBackend
from lnn.tests.model_weights import random_weights
from test_cpu_backend import CASES, TOLERANCE, check_weights_and_input_left_alone


def numpy_plan(model, weights):
    return CudaBackend(model, weights, array_module=np)


def test_every_op_has_a_cuda_layer():
    """backend.py's table is built from the ops each layer class names (`ops`): an op of the registry that no
    layer names fails here, dropout alone being the identity at inference."""
    from lnn.formats.ops import OPS
    from lnn.runtime.cuda.backend import IDENTITY_AT_INFERENCE, LAYERS

    assert sorted(set(OPS) - set(LAYERS)) == sorted(IDENTITY_AT_INFERENCE) == ["dropout"]
    assert all(callable(getattr(layer, "plan", None)) for layer in LAYERS.values())


@pytest.mark.parametrize("case", sorted(CASES))
def test_plan_matches_numpy_reference(case):
    input_shape, layers = CASES[case]
    model = parse_model({"name": case, "input_shape": input_shape, "layers": layers})
    rng = np.random.default_rng(sorted(CASES).index(case))
    weights = random_weights(model, rng)
    backend, reference = numpy_plan(model, weights), NumpyBackend(model, weights)
    for batch in (1, 3, 1):
        x = rng.standard_normal((batch, *input_shape)).astype(np.float32)
        np.testing.assert_allclose(backend.run(x), reference.run(x), rtol=0, atol=TOLERANCE, err_msg=f"{case}, batch {batch}")


@pytest.mark.parametrize("name", REFERENCE_NAMES)
def test_reference_architectures_with_random_weights(name):
    model = load_model(EXAMPLES / "reference" / f"{name}.json")
    rng = np.random.default_rng(11)
    weights = random_weights(model, rng)
    x = rng.standard_normal((2, *model.input_shape)).astype(np.float32)
    np.testing.assert_allclose(numpy_plan(model, weights).run(x), NumpyBackend(model, weights).run(x),
                               rtol=0, atol=TOLERANCE)


def test_batchnorm_folds_and_activations_join_epilogues():
    def layer_types(layers, input_shape):
        model = parse_model({"input_shape": input_shape, "layers": layers})
        return [type(layer).__name__ for layer in numpy_plan(model, random_weights(model, np.random.default_rng(0))).layers]

    assert layer_types(*reversed(CASES["batchnorm2d_folded_into_conv"])) == ["Conv2dLayer"]
    assert layer_types(*reversed(CASES["conv_then_activation_layer_then_pool"])) == ["Conv2dLayer", "MaxPool2dLayer"]
    assert layer_types(*reversed(CASES["batchnorm2d_after_conv_with_activation"])) == ["Conv2dLayer", "AffineLayer"]
    assert layer_types(*reversed(CASES["mlp_activations"])) == ["FlattenLayer", "LinearLayer", "LinearLayer",
                                                                "LinearLayer"]


def test_does_not_modify_weights_or_input():
    check_weights_and_input_left_alone(numpy_plan)


def test_importing_the_kernels_and_backend_does_not_import_cupy():
    code = ("import sys, lnn.runtime, lnn.runtime.cuda, lnn.runtime.cuda.kernels, lnn.runtime.cuda.backend, "
            "lnn.train.kernels; print('cupy' in sys.modules)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "False"
