"""The CUDA-graph training step (train/cuda_graph.py) against the eager CuPy step and the NumPy step.

Which setups the graph step takes is decided without a GPU and tested here everywhere; the rest
needs CuPy and a GPU (skipped otherwise):  pytest tests/train/test_cuda_graph.py
Each GPU case runs three steps on different batches: step 1 runs the graph's launches uncaptured,
step 2 captures and launches the graph, step 3 replays it; every step's loss, correct count and
gradient norm, and the weights after it, must match both eager paths.
"""

import copy
import json

import numpy as np
import pytest

from lnn.formats.errors import LnnError
from lnn.formats.model import parse_model
from lnn.train import Trainer
from lnn.train.config import TrainingConfig
from lnn.train.cuda_graph import reduce_chunks, unsupported_reason

from conftest import EXAMPLES, gpu_cupy


def _description(name, **changes):
    description = json.loads((EXAMPLES / "reference" / f"{name}.json").read_text())
    description.update(copy.deepcopy(changes))
    return description


def _reason(description, amp=False, dtype="float32"):
    model = parse_model(description)
    config = TrainingConfig.parse(model.extra.get("training"))
    return unsupported_reason(model, config, model.optimizer, amp, dtype)


@pytest.mark.parametrize("name", ["mnist_mlp", "mnist_cnn", "leaf_cnn"])
def test_reference_models_are_supported(name):
    assert _reason(_description(name)) is None


def test_unsupported_setups_say_why():
    assert "amp" in _reason(_description("mnist_cnn"), amp=True)
    assert "float64" in _reason(_description("mnist_cnn"), dtype="float64")
    assert "accumulate" in _reason(_description("mnist_mlp", training={"batch_size": 8, "accumulate": 2}))
    layers = _description("mnist_cnn")["layers"]
    with_bn = layers[:1] + [{"type": "batchnorm"}] + layers[1:]
    assert "batchnorm" in _reason(_description("mnist_cnn", layers=with_bn))
    sigmoid = copy.deepcopy(layers)
    sigmoid[0]["activation"] = "sigmoid"
    assert "sigmoid" in _reason(_description("mnist_cnn", layers=sigmoid))
    assert _reason(_description("mnist_mlp", optimizer={"type": "adamw", "lr": 0.001})) is None


def test_reduction_chunks_cover_the_data():
    assert reduce_chunks(1) == 1
    assert reduce_chunks(4096) == 1 and reduce_chunks(4097) == 2
    assert reduce_chunks(10 ** 9) == 256


def test_cpu_trainer_never_uses_the_graph():
    quiet = {"log": lambda *a: None}
    assert not Trainer(_description("mnist_mlp"), device="cpu", **quiet).graph_mode
    with pytest.raises(LnnError, match="the device is the CPU"):
        Trainer(_description("mnist_mlp"), device="cpu", cuda_graph=True, **quiet)
    with pytest.raises(LnnError, match="cuda_graph must be"):
        Trainer(_description("mnist_mlp"), device="cpu", cuda_graph="yes", **quiet)


# --------------------------------------------------------------------------- on the GPU

GPU_CASES = {
    # Adam's eps is large here: with eps=1e-8 an update is lr * sign(g) wherever |g| is tiny, and float32
    # GEMMs in another summation order may flip the sign of a gradient that sums to about zero.
    "mnist_mlp": _description("mnist_mlp"),
    "mnist_cnn": _description("mnist_cnn"),
    "leaf_cnn": _description("leaf_cnn"),
    "mlp_adamw_clipped": _description("mnist_mlp", optimizer={"type": "adamw", "lr": 0.002, "weight_decay": 0.01, "eps": 1e-3},
                                      training={"batch_size": 64, "grad_clip": 0.05}),
    "cnn_nesterov": _description("mnist_cnn", optimizer={"type": "sgd", "lr": 0.05, "momentum": 0.9,
                                                         "nesterov": True, "weight_decay": 0.001}),
    # Winograd forward and input gradient (weight gradient: implicit GEMM), batched GEMMs in the graph
    "cnn_winograd": _description("mnist_cnn", layers=[dict(layer, algorithm="winograd") if layer["type"] == "conv2d"
                                                      else layer for layer in _description("mnist_cnn")["layers"]]),
    # implicit-GEMM convs (3x3, 1x1) next to an im2col one (stride 2), an overlapping pool undoing a relu,
    # conv -> conv with relu, and a relu before global average pooling
    "mixed_convs": {"input_shape": [3, 20, 20], "preprocess": {"scale": 1 / 255, "mean": [0.5] * 3, "std": [0.25] * 3},
                    "layers": [{"type": "conv2d", "out_channels": 8, "kernel_size": 3, "padding": 1, "activation": "relu"},
                               {"type": "conv2d", "out_channels": 12, "kernel_size": 3, "stride": 2, "activation": "relu"},
                               {"type": "maxpool2d", "kernel_size": 3, "stride": 2, "padding": 1},
                               {"type": "conv2d", "out_channels": 16, "kernel_size": 1, "activation": "relu"},
                               {"type": "global_avg_pool"}, {"type": "linear", "out_features": 5}],
                    "loss": "cross_entropy", "optimizer": {"type": "sgd", "lr": 0.05, "momentum": 0.9}},
}


def _three_batches(description, rows, classes):
    model = parse_model(description)
    rng = np.random.default_rng(7)
    return [(rng.integers(0, 256, (rows,) + tuple(model.input_shape), dtype=np.uint8),
             rng.integers(0, classes, rows)) for _ in range(3)]


@pytest.mark.parametrize("case", sorted(GPU_CASES))
def test_graph_steps_match_eager_cupy_and_numpy(case):
    cupy = gpu_cupy()
    description = GPU_CASES[case]
    rows = 8 if case == "leaf_cnn" else 32
    classes = parse_model(description).output_shape[0]
    messages = []
    trainers = {"numpy": Trainer(description, device="cpu", batch_size=rows, log=messages.append),
                "eager": Trainer(description, device="cuda", batch_size=rows, cuda_graph=False, log=messages.append),
                "graph": Trainer(description, device="cuda", batch_size=rows, cuda_graph=True, log=messages.append)}
    assert trainers["graph"].graph_mode
    for step, (x, y) in enumerate(_three_batches(description, rows, classes), start=1):
        for trainer in trainers.values():
            trainer.lr = trainer.base_lr * (1 - 0.1 * step)          # the learning rate changes between replays
        results = {name: t.step(x if name == "numpy" else cupy.asarray(x), y if name == "numpy" else cupy.asarray(y))
                   for name, t in trainers.items()}
        assert not messages, messages                               # no fallback happened
        graph = results["graph"]
        for name in ("numpy", "eager"):
            other = results[name]
            assert graph.loss == pytest.approx(other.loss, rel=1e-4), (step, name)
            assert graph.correct == other.correct, (step, name)
            assert graph.grad_norm == pytest.approx(other.grad_norm, rel=1e-3), (step, name)
        weights = {name: t.weights() for name, t in trainers.items()}
        for key, value in weights["graph"].items():
            for name in ("numpy", "eager"):
                np.testing.assert_allclose(value, weights[name][key], rtol=1e-4, atol=1e-5,
                                           err_msg=f"{case} step {step} {key} vs {name}")
    assert trainers["graph"]._graph.graph is not None                  # steps 2 and 3 were graph launches
    assert trainers["graph"].optimizer.steps == trainers["eager"].optimizer.steps == 3


def test_a_failed_capture_falls_back_to_eager(monkeypatch):
    cupy = gpu_cupy()
    from lnn.train.cuda_graph import GraphFailure, GraphStep

    def broken(self):
        raise GraphFailure("capture failed: simulated")

    monkeypatch.setattr(GraphStep, "_capture", broken)
    description = _description("mnist_mlp")
    messages = []
    graph = Trainer(description, device="cuda", batch_size=16, cuda_graph=True, log=messages.append)
    eager = Trainer(description, device="cuda", batch_size=16, cuda_graph=False, log=lambda *a: None)
    for x, y in _three_batches(description, 16, 10):
        a, b = graph.step(cupy.asarray(x), cupy.asarray(y)), eager.step(cupy.asarray(x), cupy.asarray(y))
        assert a.loss == pytest.approx(b.loss, rel=1e-4)
    assert len(messages) == 1 and "simulated" in messages[0] and "eagerly" in messages[0]
    assert not graph.graph_mode
    for key, value in graph.weights().items():
        np.testing.assert_allclose(value, eager.weights()[key], rtol=1e-4, atol=1e-5, err_msg=key)


def test_partial_batches_run_eagerly_between_graph_steps():
    cupy = gpu_cupy()
    description = _description("mnist_cnn")
    rng = np.random.default_rng(3)
    graph = Trainer(description, device="cuda", batch_size=16, cuda_graph=True, log=print)
    eager = Trainer(description, device="cuda", batch_size=16, cuda_graph=False, log=print)
    for rows in (16, 16, 5, 16):
        x = cupy.asarray(rng.integers(0, 256, (rows, 1, 28, 28), dtype=np.uint8))
        y = cupy.asarray(rng.integers(0, 10, rows))
        assert graph.step(x, y).loss == pytest.approx(eager.step(x, y).loss, rel=1e-4)
    assert graph.graph_mode
    for key, value in graph.weights().items():
        np.testing.assert_allclose(value, eager.weights()[key], rtol=1e-4, atol=1e-5, err_msg=key)
