"""One GPU training path: the captured CUDA-graph step against the same step run eagerly and on NumPy.

Trainer._device_step is the step; train/cuda_graph.py only captures and replays it. Each GPU case runs
three steps on different batches with a learning rate that changes between them: step 1 runs eagerly
on the graph's stream (warm-up), step 2 is captured and launched, step 3 replays it. Every step's
loss, correct count and gradient norm, and the weights after it, must match the eager CuPy trainer
(the same kernels: tight) and the float64 NumPy trainer (the reference: float32 tolerances; amp: fp16
or bf16 ones). The cases together hold every op of the registry (formats/ops.py OPS), which a CPU test checks,
so an op added without a GPU training path fails here. Needs CuPy and a GPU for the rest (skipped
otherwise):  pytest tests/train/test_cuda_graph.py
"""

import copy
import json

import numpy as np
import pytest

from lnn.formats.errors import LnnError
from lnn.formats.model import parse_model
from lnn.formats.ops import ACTIVATIONS, OPS
from lnn.train import Trainer

from conftest import EXAMPLES, gpu_cupy


def _description(name, **changes):
    description = json.loads((EXAMPLES / "reference" / f"{name}.json").read_text())
    description.update(copy.deepcopy(changes))
    return description


IMAGE = {"input_shape": [4, 12, 12], "preprocess": {"scale": 1 / 255, "mean": [0.5] * 4, "std": [0.25] * 4},
         "loss": "cross_entropy"}

GPU_CASES = {
    "mnist_mlp": _description("mnist_mlp"),
    "mnist_cnn": _description("mnist_cnn"),
    "leaf_cnn": _description("leaf_cnn"),
    # Adam's eps is large here: with eps=1e-8 an update is lr * sign(g) wherever |g| is tiny, and float32
    # GEMMs in another summation order may flip the sign of a gradient that sums to about zero.
    "mlp_adamw_clipped": _description("mnist_mlp", optimizer={"type": "adamw", "lr": 0.002, "weight_decay": 0.01,
                                                              "eps": 1e-3}, training={"batch_size": 64, "grad_clip": 0.05}),
    "cnn_winograd": _description("mnist_cnn", layers=[dict(layer, algorithm="winograd") if layer["type"] == "conv2d"
                                                      else layer for layer in _description("mnist_cnn")["layers"]]),
    # the bundled tomato model's blocks: conv without bias -> batch norm + relu -> max pool; global pool; Adam
    "batchnorm_blocks": dict(IMAGE, optimizer={"type": "adam", "lr": 0.003, "eps": 1e-3}, layers=[
        {"type": "conv2d", "out_channels": 8, "kernel_size": 3, "padding": 1, "bias": False},
        {"type": "batchnorm", "activation": "relu"}, {"type": "maxpool2d", "kernel_size": 2},
        {"type": "conv2d", "out_channels": 16, "kernel_size": 3, "padding": 1, "bias": False},
        {"type": "batchnorm", "activation": "relu"}, {"type": "global_avg_pool"},
        {"type": "linear", "out_features": 5}]),
    # every other op and activation: strided, grouped and depthwise convs, average pool, stand-alone
    # activations, batch norm on flat features, dropout, a final softmax; SGD with nesterov and clipping
    "every_op": dict(IMAGE, optimizer={"type": "sgd", "lr": 0.05, "momentum": 0.9, "nesterov": True,
                                       "weight_decay": 0.001}, training={"grad_clip": 1.0}, layers=[
        {"type": "conv2d", "out_channels": 8, "kernel_size": 3, "stride": 2, "padding": 1, "activation": "leaky_relu"},
        {"type": "conv2d", "out_channels": 8, "kernel_size": 3, "padding": 1, "groups": 2, "activation": "relu6"},
        {"type": "conv2d", "out_channels": 8, "kernel_size": 3, "padding": 1, "groups": 8, "activation": "tanh"},
        {"type": "maxpool2d", "kernel_size": 3, "stride": 2, "padding": 1},      # overlapping windows, padded
        {"type": "avgpool2d", "kernel_size": 2}, {"type": "sigmoid"}, {"type": "flatten"},
        {"type": "linear", "out_features": 24}, {"type": "batchnorm"}, {"type": "relu"}, {"type": "dropout", "p": 0.3},
        {"type": "linear", "out_features": 16}, {"type": "leaky_relu", "negative_slope": 0.1}, {"type": "relu6"},
        {"type": "tanh"},
        {"type": "linear", "out_features": 6}, {"type": "softmax"}]),
    # series [C, T]: conv1d ("same" padding, dilation, groups), batch norm over time, the 1-D pools, layer
    # norm and global max pooling over time; and global average pooling over time
    "series_ops": {"input_shape": [3, 40], "loss": "cross_entropy", "optimizer": {"type": "adam", "lr": 0.003, "eps": 1e-3},
                   "layers": [{"type": "conv1d", "out_channels": 8, "kernel_size": 5, "padding": "same", "dilation": 2,
                               "bias": False},
                              {"type": "batchnorm", "activation": "relu"}, {"type": "maxpool1d", "kernel_size": 2},
                              {"type": "conv1d", "out_channels": 8, "kernel_size": 3, "padding": 1, "groups": 2,
                               "activation": "tanh"},
                              {"type": "avgpool1d", "kernel_size": 2}, {"type": "layernorm"}, {"type": "global_max_pool"},
                              {"type": "linear", "out_features": 4}]},
    "series_average": {"input_shape": [2, 24], "loss": "cross_entropy", "optimizer": {"type": "sgd", "lr": 0.05, "momentum": 0.9},
                       "layers": [{"type": "conv1d", "out_channels": 6, "kernel_size": 3, "stride": 2, "activation": "relu"},
                                  {"type": "global_avg_pool"}, {"type": "linear", "out_features": 3}]},
    # recurrent: a bidirectional two-layer lstm over the whole sequence, then a gru's last step
    "recurrent": {"input_shape": [3, 12], "loss": "cross_entropy", "optimizer": {"type": "adam", "lr": 0.003, "eps": 1e-3},
                  "layers": [{"type": "lstm", "hidden_size": 6, "num_layers": 2, "bidirectional": True},
                             {"type": "gru", "hidden_size": 5, "return": "last"}, {"type": "linear", "out_features": 3}]},
    # the fused lstm and gru step kernels' tiles (8 rows x 8 hidden units; the product in chunks of 128 forward,
    # 256 backward): 20 rows and 130 units make partial tiles, two chunks forward and 2-3 backward, both directions
    "recurrent_wide": {"input_shape": [5, 9], "loss": "cross_entropy",
                       "optimizer": {"type": "adam", "lr": 0.003, "eps": 1e-3}, "training": {"batch_size": 20},
                       "layers": [{"type": "lstm", "hidden_size": 130, "bidirectional": True},
                                  {"type": "gru", "hidden_size": 130, "bidirectional": True, "return": "last"},
                                  {"type": "linear", "out_features": 3}]},
    # the convolutions by kernel path: 3x3 on the halo tiles (under and over 16 input channels), 1x1 on the
    # gather kernels, strided and grouped on im2col + cuBLAS; batch norm; SGD with momentum
    "conv_kinds": dict(IMAGE, optimizer={"type": "sgd", "lr": 0.05, "momentum": 0.9}, layers=[
        {"type": "conv2d", "out_channels": 16, "kernel_size": 3, "padding": 1, "activation": "relu"},
        {"type": "conv2d", "out_channels": 16, "kernel_size": 3, "padding": 1, "bias": False},
        {"type": "batchnorm", "activation": "relu"},
        {"type": "conv2d", "out_channels": 8, "kernel_size": 1, "activation": "relu"},
        {"type": "conv2d", "out_channels": 8, "kernel_size": 3, "stride": 2, "padding": 1, "activation": "relu"},
        {"type": "conv2d", "out_channels": 8, "kernel_size": 3, "padding": 1, "groups": 2},
        {"type": "global_avg_pool"}, {"type": "linear", "out_features": 5}]),
    "accumulated": _description("mnist_mlp", training={"batch_size": 16, "accumulate": 2}),
    "mse": {"input_shape": [10], "loss": "mse", "optimizer": {"type": "adam", "lr": 0.01, "eps": 1e-3},
            "layers": [{"type": "linear", "out_features": 16, "activation": "tanh"}, {"type": "linear", "out_features": 3}]},
}
AMP_CASES = ("mnist_cnn", "batchnorm_blocks", "leaf_cnn", "recurrent_wide")
BF16_CASES = AMP_CASES + ("conv_kinds", "mnist_mlp")


def _layer_ops(description):
    return {node.op for node in parse_model(description).nodes}


def test_the_gpu_cases_hold_every_op_of_the_registry():
    covered = set().union(*(_layer_ops(d) for d in GPU_CASES.values()))
    assert set(OPS) <= covered, f"ops without a GPU training test: {sorted(set(OPS) - covered)}"
    assert set(ACTIVATIONS) <= covered


def test_cpu_trainer_never_uses_the_graph():
    quiet = {"log": lambda *a: None}
    assert not Trainer(_description("mnist_mlp"), device="cpu", **quiet).graph_mode
    with pytest.raises(LnnError, match="the device is the CPU"):
        Trainer(_description("mnist_mlp"), device="cpu", cuda_graph=True, **quiet)
    with pytest.raises(LnnError, match="cuda_graph must be"):
        Trainer(_description("mnist_mlp"), device="cpu", cuda_graph="yes", **quiet)


# --------------------------------------------------------------------------- on the GPU

def _batches(description, rows, count=3, seed=7):
    model = parse_model(description)
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(count):
        if model.preprocess is not None:
            x = rng.integers(0, 256, (rows,) + tuple(model.input_shape), dtype=np.uint8)
        else:
            x = rng.normal(size=(rows,) + tuple(model.input_shape)).astype(np.float32)
        if model.loss == "cross_entropy":
            y = rng.integers(0, model.output_shape[0], rows)
        else:
            y = rng.normal(size=(rows,) + tuple(model.output_shape)).astype(np.float32)
        out.append((x, y))
    return out


def _rows(trainer):
    return trainer.plan.batch_size * trainer.config.accumulate       # a full step: the one that is captured


def _compare(case, trainers, batches, loss_rtol, weight_rtol, weight_atol, messages, outliers=False):
    cupy = gpu_cupy()
    for step, (x, y) in enumerate(batches, start=1):
        for trainer in trainers.values():
            trainer.lr = trainer.base_lr * (1 - 0.1 * step)          # the learning rate changes between replays
        results = {name: t.step(x if t.device == "cpu" else cupy.asarray(x), y if t.device == "cpu" else cupy.asarray(y))
                   for name, t in trainers.items()}
        assert not messages, messages                               # no fallback to eager happened
        graph = results["graph"]
        for name, other in results.items():
            assert graph.loss == pytest.approx(other.loss, rel=loss_rtol), (case, step, name)
            assert abs(graph.correct - other.correct) <= (0 if name == "eager" else 1), (case, step, name)
            assert graph.grad_norm == pytest.approx(other.grad_norm, rel=10 * loss_rtol), (case, step, name)
        weights = {name: t.weights() for name, t in trainers.items()}
        for key, value in weights["graph"].items():
            for name in trainers:
                np.testing.assert_allclose(value, weights[name][key], rtol=weight_rtol, atol=weight_atol,
                                           err_msg=f"{case} step {step} {key} vs {name}")
    graph = trainers["graph"]
    assert [g.graph is not None for g in graph._graphs.values()] == [True]      # steps 2 and 3 were replays


@pytest.mark.parametrize("case", sorted(GPU_CASES))
def test_graph_steps_match_eager_cupy_and_float64_numpy(case):
    gpu_cupy()
    description = GPU_CASES[case]
    messages = []
    trainers = {"numpy": Trainer(description, device="cpu", dtype="float64", log=messages.append),
                "eager": Trainer(description, device="cuda", cuda_graph=False, log=messages.append),
                "graph": Trainer(description, device="cuda", cuda_graph=True, log=messages.append)}
    assert trainers["graph"].graph_mode
    _compare(case, trainers, _batches(description, _rows(trainers["graph"])), 1e-4, 1e-3, 1e-4, messages)
    assert trainers["graph"].optimizer.steps == trainers["eager"].optimizer.steps == 3


@pytest.mark.parametrize("case", AMP_CASES)
def test_amp_graph_steps_match_amp_eager_and_fp32(case):
    """amp: the graph and the eager amp step run the same fp16 kernels (close to bitwise); against the
    float64 reference, fp16 activations hold the loss within 1% and the weights within 2e-3."""
    gpu_cupy()
    description = GPU_CASES[case]
    messages = []
    trainers = {"numpy": Trainer(description, device="cpu", dtype="float64", log=messages.append),
                "eager": Trainer(description, device="cuda", amp=True, cuda_graph=False, log=messages.append),
                "graph": Trainer(description, device="cuda", amp=True, cuda_graph=True, log=messages.append)}
    assert trainers["graph"].amp and trainers["graph"].graph_mode
    _compare(case, trainers, _batches(description, _rows(trainers["graph"])), 1e-2, 2e-2, 2e-3, messages)


@pytest.mark.parametrize("case", BF16_CASES)
def test_bf16_graph_steps_match_bf16_eager_and_fp32(case):
    """amp bf16: the graph and the eager bf16 step run the same kernels; against the float64 reference: loss
    2e-2 relative (grad norm 2e-1), weights 6e-2 relative and 6e-3 absolute (fp16's 1e-2, 2e-2, 2e-3 times 2-3:
    bfloat16 keeps 8 mantissa bits to float16's 11; master weights, accumulation and the optimizer are float32
    in both). The same steps in bfloat16 on NumPy (the generic kernels, ml_dtypes) came within loss 5e-4, grad
    norm 1.3e-2 and weights 3.4e-3 beyond the relative part on these cases. The loss scale stays 1."""
    gpu_cupy()
    pytest.importorskip("ml_dtypes")
    description = GPU_CASES[case]
    messages = []
    trainers = {"numpy": Trainer(description, device="cpu", dtype="float64", log=messages.append),
                "eager": Trainer(description, device="cuda", amp="bf16", cuda_graph=False, log=messages.append),
                "graph": Trainer(description, device="cuda", amp="bf16", cuda_graph=True, log=messages.append)}
    graph = trainers["graph"]
    assert graph.amp == "bf16" and graph.graph_mode and graph.plan.compute_dtype.name == "bfloat16"
    _compare(case, trainers, _batches(description, _rows(graph)), 2e-2, 6e-2, 6e-3, messages)
    assert graph.loss_scale == trainers["eager"].loss_scale == 1.0 and graph.overflow_steps == 0


def test_bf16_skips_a_non_finite_step_inside_the_graph_with_the_scale_at_1():
    cupy = gpu_cupy()
    pytest.importorskip("ml_dtypes")
    description = _description("mnist_mlp")
    trainer = Trainer(description, device="cuda", amp="bf16", cuda_graph=True, batch_size=32, log=print)
    (x, y), = _batches(description, 32, count=1)
    x, y = cupy.asarray(x), cupy.asarray(y)
    trainer.step(x, y), trainer.step(x, y)                           # warm-up, capture
    before = trainer.weights()
    plan = trainer.plan
    plan.params[0], plan.params_compute[0] = np.inf, np.inf          # the next forward is not finite
    result = trainer.step(x, y)
    assert result.skipped and trainer.overflow_steps == 1 and trainer.loss_scale == 1.0
    after = trainer.weights()
    first = next(iter(after))
    assert np.isinf(after[first].flat[0])
    after[first].flat[0] = before[first].flat[0]
    for key, value in after.items():
        np.testing.assert_array_equal(value, before[key], err_msg=key)
    plan.params[0], plan.params_compute[0] = float(before[first].flat[0]), float(before[first].flat[0])
    assert not trainer.step(x, y).skipped and trainer.optimizer.steps == 3 and trainer.loss_scale == 1.0


def test_bf16_is_refused_on_a_card_without_it(monkeypatch):
    gpu_cupy()
    pytest.importorskip("ml_dtypes")
    from lnn.train import trainer as trainer_module

    real = trainer_module.cuda_info
    monkeypatch.setattr(trainer_module, "cuda_info", lambda xp: dict(real(xp), name="Tesla T4",
                                                                      compute_capability="7.5", bfloat16=False))
    description = _description("mnist_mlp")
    with pytest.raises(LnnError, match=r"^amp bf16: Tesla T4 \(compute capability 7.5\) has no bfloat16 tensor "
                                       r"cores \(needs 8.0, Ampere, or newer\)"):
        Trainer(description, device="cuda", amp="bf16", log=print)
    assert Trainer(description, device="cuda", amp=True, log=print).amp == "fp16"     # fp16 needs 7.0 only


def test_amp_overflow_is_skipped_and_the_scale_halves_inside_the_graph():
    cupy = gpu_cupy()
    description = _description("mnist_mlp")
    trainer = Trainer(description, device="cuda", amp=True, cuda_graph=True, batch_size=32, log=print)
    (x, y), = _batches(description, 32, count=1)
    x, y = cupy.asarray(x), cupy.asarray(y)
    trainer.step(x, y), trainer.step(x, y)                           # warm-up, capture
    before = trainer.weights()
    trainer._amp_state[0] = 1e38                                     # the next step's scaled loss overflows fp16
    result = trainer.step(x, y)
    assert result.skipped and trainer.overflow_steps == 1 and trainer.loss_scale == pytest.approx(5e37)
    for key, value in trainer.weights().items():
        np.testing.assert_array_equal(value, before[key], err_msg=key)
    trainer._amp_state[0] = 2.0 ** 10
    assert not trainer.step(x, y).skipped and trainer.optimizer.steps == 3


def test_outlier_rows_train_in_the_graph():
    gpu_cupy()
    description = _description("mnist_mlp", training={"batch_size": 32, "outliers": {"weight": 0.5}})
    messages = []
    trainers = {"numpy": Trainer(description, device="cpu", dtype="float64", outliers=True, log=messages.append),
                "eager": Trainer(description, device="cuda", cuda_graph=False, outliers=True, log=messages.append),
                "graph": Trainer(description, device="cuda", cuda_graph=True, outliers=True, log=messages.append)}
    batches = [(x, np.where(np.arange(32) % 4 == 0, -1, y)) for x, y in _batches(description, 32)]
    _compare("outliers", trainers, batches, 1e-4, 1e-3, 1e-4, messages)


def test_a_failed_capture_falls_back_to_eager(monkeypatch):
    cupy = gpu_cupy()
    from lnn.train.cuda_graph import CaptureFailure, CapturedStep

    def broken(self, body):
        raise CaptureFailure("capture failed: simulated")

    monkeypatch.setattr(CapturedStep, "_capture", broken)
    description = _description("mnist_mlp")
    messages = []
    graph = Trainer(description, device="cuda", batch_size=16, cuda_graph=True, log=messages.append)
    eager = Trainer(description, device="cuda", batch_size=16, cuda_graph=False, log=lambda *a: None)
    for x, y in _batches(description, 16):
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
