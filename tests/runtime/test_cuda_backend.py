"""The CUDA backend (CuPy) against the NumPy reference backend; skipped without CuPy and a GPU.

Run on a GPU machine with:  pytest tests/runtime/test_cuda_backend.py
Every op of formats/ops.py on odd shapes (the CPU backend's op-driven cases), at batch sizes 1 and 3
and 5, the four reference architectures with random weights built in memory (no ../shared needed),
through a .bin file and lnn.load(path, device="cuda"), and the PyTorch-made reference models with
their golden outputs when ../shared is present.
"""

from __future__ import annotations

import numpy as np
import pytest

from conftest import EXAMPLES, REFERENCE_NAMES, gpu_cupy
from lnn.formats.binfile import build_metadata, write_bin
from lnn.formats.model import load_model, parse_model
from lnn.formats.ops import OPS
from lnn.runtime.reference import NumpyBackend
from lnn.tests.model_weights import random_weights
from test_cpu_backend import CASES, TOLERANCE, check_reference_model_through_bin

cupy = gpu_cupy()                  # skips the whole module without CuPy and a GPU

import lnn  # noqa: E402
from lnn.runtime.cuda.backend import CudaBackend  # noqa: E402


def test_every_op_has_a_case():
    used = {parse_model({"input_shape": s, "layers": layers}).nodes[i].op
            for s, layers in CASES.values() for i in range(len(layers))}
    used |= {layer["activation"] if isinstance(layer["activation"], str) else layer["activation"]["type"]
             for _, layers in CASES.values() for layer in layers if layer.get("activation")}
    assert set(OPS) <= used


@pytest.mark.parametrize("case", sorted(CASES))
def test_matches_numpy_reference(case):
    input_shape, layers = CASES[case]
    model = parse_model({"name": case, "input_shape": input_shape, "layers": layers})
    rng = np.random.default_rng(sorted(CASES).index(case))
    weights = random_weights(model, rng)
    backend, reference = CudaBackend(model, weights), NumpyBackend(model, weights)
    for batch in (1, 3, 5, 1):
        x = rng.standard_normal((batch, *input_shape)).astype(np.float32)
        got = backend.run(x)
        assert isinstance(got, np.ndarray) and got.dtype == np.float32
        np.testing.assert_allclose(got, reference.run(x), rtol=0, atol=TOLERANCE, err_msg=f"{case}, batch {batch}")


@pytest.mark.parametrize("name", REFERENCE_NAMES)
def test_reference_architectures_with_random_weights_through_bin(name, tmp_path):
    model = load_model(EXAMPLES / "reference" / f"{name}.json")
    rng = np.random.default_rng(21)
    weights = random_weights(model, rng)
    path = tmp_path / f"{name}.bin"
    write_bin(path, model, weights, build_metadata(model))
    session = lnn.load(path, device="cuda")
    assert session.backend.name == "cuda"
    reference = NumpyBackend(model, weights)
    for batch in (1, 7):
        x = rng.standard_normal((batch, *model.input_shape)).astype(np.float32)
        np.testing.assert_allclose(session.run(x), reference.run(x), rtol=0, atol=TOLERANCE, err_msg=f"batch {batch}")


@pytest.mark.parametrize("name", REFERENCE_NAMES)
def test_reference_model_golden_outputs(name):
    check_reference_model_through_bin(name, "cuda")


def test_plans_are_reused_and_input_left_alone():
    input_shape, layers = CASES["batchnorm2d_standalone"]          # in-place epilogues on the plan's input
    model = parse_model({"input_shape": input_shape, "layers": layers})
    weights = random_weights(model, np.random.default_rng(3))
    backend = CudaBackend(model, weights)
    x = np.random.default_rng(4).standard_normal((4, *input_shape)).astype(np.float32)
    x_before = x.copy()
    first = backend.run(x)
    plan = backend._plan(4)
    np.testing.assert_array_equal(backend.run(x), first)
    assert backend._plan(4) is plan
    assert np.array_equal(x, x_before)


def test_gate_features_and_decision_match_numpy():
    """The out-of-distribution gate on the GPU: the kept feature node and the Session's decision equal NumPy's."""
    from lnn.runtime import Session
    from test_gate import DESCRIPTION, gated_bin, inputs, thresholds_in_gaps, weights_for

    model = parse_model(DESCRIPTION)
    weights = weights_for(model)
    x = inputs()
    keep = ("c1", "bn", "pool")
    _, expected = NumpyBackend(model, weights, keep=keep).run_with_features(x)
    _, got = CudaBackend(model, weights, keep=keep).run_with_features(x)
    for name in keep:
        np.testing.assert_allclose(got[name], expected[name], rtol=1e-4, atol=1e-5, err_msg=name)
    gated = gated_bin(thresholds=thresholds_in_gaps(Session(gated_bin(), "numpy").judge(x).scores))
    reference, judged = Session(gated, "numpy").judge(x), Session(gated, "cuda").judge(x)
    assert judged.reasons == reference.reasons
    for name, values in reference.scores.items():
        np.testing.assert_allclose(judged.scores[name], values, rtol=1e-4, err_msg=name)


@pytest.mark.parametrize("from_bytes", [0, None])
def test_session_checks_inputs_from_their_extremes_on_the_gpu(monkeypatch, from_bytes):
    """Session's checks on the cuda backend take each input's lowest and highest value from its uploaded copy
    (run_measured; from_bytes 0: every batch, None: as shipped, this small one's on the host): equal to NumPy's; NaN
    and infinity named as on the host, before an input out of the prepared range in an earlier chunk, each by its
    index in the whole batch (over RUN_CHUNK: checked once all chunks ran)."""
    from lnn.runtime.cuda import backend
    from lnn.formats.binfile import build_metadata, encode_bin, parse_bin_bytes
    from lnn.runtime import RUN_CHUNK, Session
    from conftest import prepared_photos

    if from_bytes is not None:
        monkeypatch.setattr(backend, "DEVICE_EXTREMES_FROM_BYTES", from_bytes)
    model = parse_model({"name": "small", "input_shape": [3, 8, 8], "labels": ["a", "b"],
                         "preprocess": {"color": "rgb", "scale": 1 / 255, "mean": [0.5] * 3, "std": [0.25] * 3},
                         "layers": [{"type": "conv2d", "out_channels": 4, "kernel_size": 3, "activation": "relu"},
                                    {"type": "global_avg_pool"}, {"type": "linear", "out_features": 2}]})
    weights = random_weights(model, np.random.default_rng(5))
    bin_model = parse_bin_bytes(encode_bin(model, weights, build_metadata(model)))
    gpu, host = Session(bin_model, "cuda"), Session(bin_model, "numpy")
    count = RUN_CHUNK["cuda"] + 4
    x = prepared_photos(model, count)
    for axes in ((1, 2, 3), (2, 3)):
        _, _, (lowest, highest) = gpu.backend.run_measured(x[:5], axes)
        np.testing.assert_array_equal(lowest, x[:5].min(axis=axes))
        np.testing.assert_array_equal(highest, x[:5].max(axis=axes))
    np.testing.assert_allclose(gpu.predict(x), host.predict(x), rtol=1e-4, atol=1e-6)
    y = x.copy()
    y[3] = x[3] * 1000                                   # out of range, first chunk
    for bad, value in ((count - 2, np.nan), (count - 1, np.inf), (RUN_CHUNK["cuda"], -np.inf)):
        z = y.copy()
        z[bad, 2, 1, 1] = value
        for call in (gpu.run, gpu.predict, gpu.judge):
            with pytest.raises(lnn.LnnInputError, match=f"^input {bad} of the batch holds NaN or infinity"):
                call(z)
    with pytest.raises(lnn.LnnInputError, match=r"^input 3 is not a photo prepared for this model"):
        gpu.judge(y)
    assert gpu.run(y).shape == (count, 2)                # run takes any finite numbers
