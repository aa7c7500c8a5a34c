"""The CuPy path of the trainer against its NumPy path (skipped without CuPy and a GPU).

Run on a GPU machine with:  pytest tests/train/test_gpu.py
Every op's forward and backward (the gradient-check cases), a full training step, mixed precision,
and the pinned-memory prefetch path for data that is not held on the device.
"""

import numpy as np
import pytest

from lnn.formats.model import load_model
from lnn.train import MemmapDataset, Trainer
from lnn.train.plan import Plan

from conftest import EXAMPLES, gpu_cupy
from test_gradients import CASES, random_plan_case

cupy = gpu_cupy()                  # skips the whole module without CuPy and a GPU


def _run_plan(xp, model, params, stats, x, r, keys):
    plan = Plan(model, len(x), dtype="float32", input_gradient=True, implicit_conv=xp is cupy)   # as the Trainer
    plan.allocate(xp)
    plan.params[...] = xp.asarray(params)
    plan.stats[...] = xp.asarray(stats)
    n = len(x)
    plan.input_buffer(n)[...] = xp.asarray(x)
    out = plan.forward(n, training=True, dropout_keys=keys).copy()
    plan.grads.fill(0)
    plan.output_grad_buffer(n)[...] = xp.asarray(r)
    plan.backward(n, dropout_keys=keys)
    to_host = (lambda a: a.get()) if xp is cupy else np.asarray
    return to_host(out), to_host(plan.views(n)["grad:-1"]), to_host(plan.grads), to_host(plan.stats)


@pytest.mark.parametrize("case", sorted(CASES))
def test_cupy_forward_and_backward_match_numpy(case):
    model, params, stats, x, r = random_plan_case(case)
    keys = {i: 777 + i for i in range(len(CASES[case][1]))}
    expected = _run_plan(np, model, params, stats, x, r, keys)
    got = _run_plan(cupy, model, params, stats, x, r, keys)
    for name, a, b in zip(("output", "input gradient", "parameter gradients", "running stats"), got, expected):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5, err_msg=name)


@pytest.mark.parametrize("name", ["mnist_mlp", "mnist_cnn"])
def test_cupy_training_steps_match_numpy(name):
    model = load_model(EXAMPLES / "reference" / f"{name}.json")
    rng = np.random.default_rng(1)
    x = rng.integers(0, 256, (64,) + model.input_shape, dtype=np.uint8)
    y = rng.integers(0, 10, 64)
    cpu = Trainer(model, device="cpu", batch_size=32, log=lambda *a: None)
    gpu = Trainer(model, device="cuda", batch_size=32, log=lambda *a: None)
    for _ in range(3):
        a, b = cpu.step(x, y), gpu.step(cupy.asarray(x), cupy.asarray(y))
        assert b.loss == pytest.approx(a.loss, rel=1e-4)
        assert b.grad_norm == pytest.approx(a.grad_norm, rel=1e-3)
    for key, value in cpu.weights().items():
        np.testing.assert_allclose(gpu.weights()[key], value, rtol=1e-3, atol=1e-5, err_msg=key)


def test_amp_trains_and_counts_overflows():
    model = load_model(EXAMPLES / "reference" / "mnist_cnn.json")
    rng = np.random.default_rng(2)
    x = cupy.asarray(rng.integers(0, 256, (128, 1, 28, 28), dtype=np.uint8))
    y = cupy.asarray(np.arange(128) % 10)
    trainer = Trainer(model, device="cuda", batch_size=64, amp=True, log=lambda *a: None)
    assert trainer.amp and trainer.plan.compute_dtype == np.float16
    assert trainer.plan.memory_report()["amp_copies"] > 0
    losses = [trainer.step(x, y) for _ in range(30)]
    applied = [r for r in losses if not r.skipped]
    assert trainer.overflow_steps == len(losses) - len(applied)
    assert applied[-1].loss < applied[0].loss
    assert trainer.loss_scale == 2.0 ** 16 / 2 ** trainer.overflow_steps
    reference = Trainer(model, device="cpu", batch_size=64, log=lambda *a: None)
    reference.set_weights(trainer.weights())
    x_host = x.get()
    np.testing.assert_allclose(trainer.predict(x[:8]), reference.predict(x_host[:8]), rtol=0.05, atol=0.05)


def test_amp_run_with_overflowed_steps_writes_readable_files(tmp_path):
    """An epoch whose amp steps overflow (grad norm inf) must still write strict-JSON metrics and checkpoints
    that read back: the H200 run of the bundled recipe lost its model.bin to an Infinity in best.npz."""
    import json

    from lnn.train import ArrayDataset
    from lnn.train.checkpoint import read_checkpoint

    model = load_model(EXAMPLES / "reference" / "mnist_cnn.json")
    rng = np.random.default_rng(4)
    data = ArrayDataset(rng.integers(0, 256, (128, 1, 28, 28), dtype=np.uint8), np.arange(128) % 10)
    trainer = Trainer(model, device="cuda", batch_size=64, amp=True, log=lambda *a: None)
    trainer._amp_state[0] = 2.0 ** 40                 # every fp16 gradient overflows until the scale comes down
    history = trainer.fit(data, data, epochs=2, out_dir=tmp_path / "run", progress=False)
    assert history[0]["overflow_steps"] == 2 and history[0]["grad_norm"] is None

    def refuse(constant):
        raise AssertionError(f"metrics.jsonl holds {constant}")

    lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line, parse_constant=refuse)["epoch"] for line in lines] == [1, 2]
    for name in ("best.npz", "checkpoint.npz"):
        meta, _, _ = read_checkpoint(tmp_path / "run" / name)
        assert len(meta["history"]) >= 1
    assert (tmp_path / "run" / "model.bin").stat().st_size > 0


def test_bf16_amp_trains_on_tensor_cores_with_the_scale_at_1():
    pytest.importorskip("ml_dtypes")
    model = load_model(EXAMPLES / "reference" / "mnist_cnn.json")
    rng = np.random.default_rng(2)
    x = cupy.asarray(rng.integers(0, 256, (128, 1, 28, 28), dtype=np.uint8))
    y = cupy.asarray(np.arange(128) % 10)
    trainer = Trainer(model, device="cuda", batch_size=64, amp="bf16", log=lambda *a: None)
    assert trainer.amp == "bf16" and trainer.plan.compute_dtype.name == "bfloat16"
    fp16 = Trainer(model, device="cuda", batch_size=64, amp="fp16", log=lambda *a: None)
    assert trainer.plan.memory_report() == fp16.plan.memory_report()
    losses = [trainer.step(x, y) for _ in range(30)]
    assert not any(r.skipped for r in losses) and trainer.overflow_steps == 0 and trainer.loss_scale == 1.0
    assert losses[-1].loss < losses[0].loss
    convs = [layer for layer in trainer.plan.layers if getattr(layer, "implicit", False)]
    assert convs and all(layer.implicit_kernels().tensor_cores for layer in convs)
    reference = Trainer(model, device="cpu", batch_size=64, log=lambda *a: None)
    reference.set_weights(trainer.weights())
    np.testing.assert_allclose(trainer.predict(x[:8]).astype(np.float32), reference.predict(x.get()[:8]),
                               rtol=0.1, atol=0.1)


def test_memmap_data_through_pinned_prefetch(tmp_path):
    model = load_model(EXAMPLES / "reference" / "mnist_mlp.json")
    rng = np.random.default_rng(3)
    cache = MemmapDataset.create(tmp_path / "cache", 300, (1, 28, 28))
    cache.images[...] = rng.integers(0, 256, cache.images.shape, dtype=np.uint8)
    cache.labels[...] = rng.integers(0, 10, 300)
    cache.flush()
    streamed = MemmapDataset.open(tmp_path / "cache")
    gpu = Trainer(model, device="cuda", batch_size=64, log=lambda *a: None)
    cpu = Trainer(model, device="cpu", batch_size=64, log=lambda *a: None)
    from lnn.train import ArrayDataset

    in_memory = ArrayDataset(np.array(streamed.images), np.array(streamed.labels))
    a, b = gpu.fit(streamed, in_memory, epochs=2, progress=False), cpu.fit(in_memory, in_memory, epochs=2, progress=False)
    assert a[-1]["train_loss"] == pytest.approx(b[-1]["train_loss"], rel=1e-3)
    assert a[-1]["val_accuracy"] == pytest.approx(b[-1]["val_accuracy"], abs=0.01)


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_fused_step_kernels_match_the_numpy_code(dtype):
    """runtime/cuda/fused.py's activation gradients, dropout, norm and optimizer updates (one launch each, no
    temporaries) against train/kernels.py's and train/optim.py's NumPy code on the same values."""
    from lnn.train import kernels as K
    from lnn.train.optim import global_norm, make_optimizer

    rng = np.random.default_rng(5)
    y = rng.standard_normal((4, 6, 33)).astype(dtype)
    dy = rng.standard_normal(y.shape).astype(dtype)
    for activation in ({"type": "relu"}, {"type": "relu6"}, {"type": "leaky_relu", "negative_slope": 0.1},
                       {"type": "sigmoid"}, {"type": "tanh"}):
        out = y if activation["type"] != "sigmoid" else 1 / (1 + np.exp(-y.astype(np.float32))).astype(dtype)
        expected = K.activation_backward(np, activation, dy.copy(), out, np.empty_like(dy))
        got = cupy.asarray(dy)
        K.activation_backward(cupy, activation, got, cupy.asarray(out), got)             # in place, as the layers
        np.testing.assert_allclose(got.get().astype(np.float32), expected.astype(np.float32), rtol=2e-3, atol=2e-3,
                                   err_msg=activation["type"])
    index = np.arange(y.size, dtype=np.uint32)
    expected = K.dropout_forward(np, y, 0.3, np.uint32(12345), index, np.empty_like(y))
    got = K.dropout_forward(cupy, cupy.asarray(y), 0.3, cupy.asarray(np.uint32(12345)), cupy.asarray(index),
                            cupy.empty(y.shape, dtype))
    assert np.array_equal(got.get() != 0, expected != 0)                              # the same mask, bit for bit
    np.testing.assert_array_equal(got.get(), expected)

    params = rng.standard_normal(1000).astype(np.float32)
    for config in ({"type": "sgd", "lr": 0.1, "momentum": 0.0, "nesterov": False, "weight_decay": 0.0},
                   {"type": "sgd", "lr": 0.1, "momentum": 0.9, "nesterov": True, "weight_decay": 0.01},
                   {"type": "adam", "lr": 0.01, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.01},
                   {"type": "adamw", "lr": 0.01, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.01}):
        host, device = make_optimizer(np, params.copy(), config), make_optimizer(cupy, cupy.asarray(params), config)
        for step, skip in enumerate((False, True, False, False)):
            grads = rng.standard_normal(params.size).astype(np.float32)
            lr = np.float32(config["lr"] / (step + 1))
            host.update(grads, lr, skip=np.asarray(skip))
            device.update(cupy.asarray(grads), cupy.asarray(lr), skip=cupy.asarray(skip))
        assert device.steps == host.steps == 3
        np.testing.assert_allclose(device.params.get(), host.params, rtol=1e-5, atol=1e-6, err_msg=config["type"])
        for name, value in host.state.items():
            np.testing.assert_allclose(device.state[name].get(), value, rtol=1e-5, atol=1e-7, err_msg=name)
    assert float(global_norm(cupy, cupy.asarray(params))) == pytest.approx(float(np.linalg.norm(params)), rel=1e-5)


MEMORY_CASES = {
    "fcn series": {"input_shape": [2, 300], "layers": [
        {"type": "conv1d", "out_channels": 64, "kernel_size": 8, "padding": "same", "bias": False},
        {"type": "batchnorm", "activation": "relu"},
        {"type": "conv1d", "out_channels": 32, "kernel_size": 5, "padding": "same", "activation": "relu"},
        {"type": "global_avg_pool"}, {"type": "linear", "out_features": 3}],
        "optimizer": {"type": "adamw", "lr": 0.003, "weight_decay": 0.01}},
    "conv1d + lstm": {"input_shape": [3, 200], "layers": [
        {"type": "conv1d", "out_channels": 32, "kernel_size": 7, "padding": "same", "activation": "tanh"},
        {"type": "lstm", "hidden_size": 48, "num_layers": 2, "bidirectional": True, "return": "last"},
        {"type": "linear", "out_features": 4}], "optimizer": {"type": "adam", "lr": 0.001}},
    "table mlp with dropout": {"input_shape": [12], "layers": [
        {"type": "linear", "out_features": 256, "activation": "relu"}, {"type": "dropout", "p": 0.2},
        {"type": "linear", "out_features": 256, "activation": "sigmoid"}, {"type": "linear", "out_features": 3}],
        "optimizer": {"type": "sgd", "lr": 0.1, "momentum": 0.9, "nesterov": True}},
}


@pytest.mark.parametrize("case", sorted(MEMORY_CASES))
@pytest.mark.parametrize("amp", [None, "fp16"])
def test_training_holds_what_the_plan_says(case, amp):
    """Issue 12: the plan's memory figure (lnn-summary's) is what captured training holds on the GPU. The
    process's cuBLAS handle, with its workspace (counted in every plan), exists before the trainer here."""
    import gc

    from lnn.runtime.cuda import blas

    batch = 256
    blas.matmul(cupy, cupy.ones((2, 2), np.float32), cupy.ones((2, 2), np.float32), cupy.empty((2, 2), np.float32))
    pool = cupy.get_default_memory_pool()
    gc.collect()
    pool.free_all_blocks()
    before = pool.total_bytes()
    trainer = Trainer({**MEMORY_CASES[case], "name": "m", "loss": "cross_entropy"}, device="cuda", batch_size=batch,
                      cuda_graph=True, amp=amp, log=lambda *a: None)
    rng = np.random.default_rng(0)
    for _ in range(4):
        trainer.step(rng.standard_normal((batch, *trainer.model.input_shape), dtype=np.float32),
                     rng.integers(0, trainer.model.output_shape[-1], batch))
    cupy.cuda.Device().synchronize()
    assert trainer.graph_mode
    held = trainer.memory_held() - before
    planned = trainer.plan.memory_report()["peak"] - blas.WORKSPACE_BYTES
    assert abs(held - planned) <= 0.02 * planned + 2 ** 20, f"held {held:,} bytes, planned {planned:,}"
