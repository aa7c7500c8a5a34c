"""The plan's eval forward against the op registry's reference; accumulation; optimizers; memory plan."""

import numpy as np
import pytest

from lnn.formats.errors import LnnError, ModelSpecError
from lnn.formats.model import load_model, parse_model
from lnn.runtime.reference import NumpyBackend
from lnn.train import Trainer, plan_memory
from lnn.train.config import TrainingConfig, learning_rate
from lnn.train.optim import make_optimizer
from lnn.train.plan import Plan, amp_precision
from lnn.train.trainer import amp_refusal

from conftest import EXAMPLES
from test_gradients import CASES, random_plan_case
from lnn.tests.model_weights import random_weights

REFERENCE_NAMES = ["mnist_mlp", "mnist_cnn", "leaf_cnn"]


@pytest.mark.parametrize("case", sorted(CASES))
def test_eval_forward_equals_reference_forward(case):
    input_shape, layers = CASES[case]
    model = parse_model({"input_shape": list(input_shape), "layers": layers, "loss": "mse"})
    trainer = Trainer(model, device="cpu", batch_size=5, log=lambda *a: None)
    weights = random_weights(model)
    trainer.set_weights(weights)
    x = np.random.default_rng(1).normal(size=(7,) + tuple(input_shape)).astype(np.float32)
    expected = NumpyBackend(model, weights).run(x)
    np.testing.assert_allclose(trainer.predict(x), expected, rtol=2e-5, atol=2e-6)


@pytest.mark.parametrize("name", REFERENCE_NAMES)
def test_reference_models_forward_equals_reference(name):
    model = load_model(EXAMPLES / "reference" / f"{name}.json")
    trainer = Trainer(model, device="cpu", batch_size=4, log=lambda *a: None)
    weights = random_weights(model)
    for key in weights:
        weights[key] *= 0.2
    trainer.set_weights(weights)
    x = np.random.default_rng(2).normal(size=(3,) + model.input_shape).astype(np.float32)
    np.testing.assert_allclose(trainer.predict(x), NumpyBackend(model, weights).run(x), rtol=1e-4, atol=1e-5)


def test_final_softmax_is_folded_into_cross_entropy():
    model = parse_model({"input_shape": [6], "loss": "cross_entropy",
                         "layers": [{"type": "linear", "out_features": 4}, {"type": "softmax"}]})
    trainer = Trainer(model, device="cpu", batch_size=8, dtype="float64", log=lambda *a: None)
    x = np.random.default_rng(0).normal(size=(8, 6))
    probabilities = trainer.predict(x)
    np.testing.assert_allclose(probabilities.sum(axis=1), 1, rtol=1e-12)
    result = trainer.step(x, np.arange(8) % 4)
    logits = np.log(probabilities)                      # up to a per-row constant: same cross-entropy
    expected = -np.mean(logits[np.arange(8), np.arange(8) % 4] - np.log(np.exp(logits).sum(axis=1)))
    assert result.loss == pytest.approx(expected, rel=1e-10)


def _accumulation_model(optimizer):
    return parse_model({"input_shape": [1, 8, 8], "loss": "cross_entropy", "optimizer": optimizer,
                        "layers": [{"type": "conv2d", "out_channels": 3, "kernel_size": 3, "padding": 1,
                                    "activation": "relu"},
                                   {"type": "maxpool2d", "kernel_size": 2}, {"type": "flatten"},
                                   {"type": "linear", "out_features": 5}]})


@pytest.mark.parametrize("optimizer", [{"type": "sgd", "lr": 0.1, "momentum": 0.9, "nesterov": True},
                                       {"type": "adamw", "lr": 0.01}])
def test_accumulate_k_equals_one_k_times_larger_batch(optimizer):
    model = _accumulation_model(optimizer)
    rng = np.random.default_rng(5)
    x = rng.normal(size=(24, 1, 8, 8))
    y = rng.integers(0, 5, 24)
    big = Trainer(model, device="cpu", batch_size=12, accumulate=1, dtype="float64", log=lambda *a: None)
    small = Trainer(model, device="cpu", batch_size=4, accumulate=3, dtype="float64", log=lambda *a: None)
    for step in range(2):
        rows = slice(step * 12, step * 12 + 12)
        a, b = big.step(x[rows], y[rows]), small.step(x[rows], y[rows])
        assert a.loss == pytest.approx(b.loss, rel=1e-12)
        assert a.grad_norm == pytest.approx(b.grad_norm, rel=1e-12)
    for key, value in big.weights().items():
        np.testing.assert_allclose(small.weights()[key], value, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(small.plan.params, big.plan.params, rtol=1e-12, atol=1e-14)


def test_unequal_micro_batches_still_match():
    model = _accumulation_model({"type": "sgd", "lr": 0.1})
    rng = np.random.default_rng(6)
    x, y = rng.normal(size=(10, 1, 8, 8)), rng.integers(0, 5, 10)
    big = Trainer(model, device="cpu", batch_size=10, dtype="float64", log=lambda *a: None)
    small = Trainer(model, device="cpu", batch_size=4, dtype="float64", log=lambda *a: None)   # 4 + 4 + 2 rows
    big.step(x, y)
    small.step(x, y)
    np.testing.assert_allclose(small.plan.params, big.plan.params, rtol=1e-12, atol=1e-14)


# --------------------------------------------------------------------------- optimizers by hand

def _run_optimizer(config, steps=3):
    params = np.array([0.5, -1.0, 2.0])
    grads = [np.array([0.1, -0.2, 0.3]), np.array([-0.4, 0.5, 0.6]), np.array([0.7, 0.8, -0.9])]
    optimizer = make_optimizer(np, params, config)
    for g in grads[:steps]:
        optimizer.update(g.copy(), config["lr"])
    return params, grads


def test_sgd_nesterov_by_hand():
    config = {"type": "sgd", "lr": 0.1, "momentum": 0.9, "nesterov": True, "weight_decay": 0.01}
    params, grads = _run_optimizer(config)
    p, buf = np.array([0.5, -1.0, 2.0]), None
    for g in grads:
        d = g + 0.01 * p
        buf = d if buf is None else 0.9 * buf + d
        p = p - 0.1 * (d + 0.9 * buf)
    np.testing.assert_allclose(params, p, rtol=1e-14)


def test_adam_bias_correction_by_hand():
    config = {"type": "adam", "lr": 0.01, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.1}
    params, grads = _run_optimizer(config)
    p, m, v = np.array([0.5, -1.0, 2.0]), 0.0, 0.0
    for t, g in enumerate(grads, 1):
        g = g + 0.1 * p
        m = 0.9 * m + 0.1 * g
        v = 0.999 * v + 0.001 * g * g
        p = p - 0.01 * (m / (1 - 0.9 ** t)) / (np.sqrt(v / (1 - 0.999 ** t)) + 1e-8)
    np.testing.assert_allclose(params, p, rtol=1e-13)
    first_step, _ = _run_optimizer(config, steps=1)      # bias-corrected: the first step moves ~lr per coordinate
    np.testing.assert_allclose(np.abs(first_step - [0.5, -1.0, 2.0]), 0.01, rtol=1e-5)


def test_adamw_decays_decoupled_by_hand():
    config = {"type": "adamw", "lr": 0.01, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.1}
    params, grads = _run_optimizer(config)
    p, m, v = np.array([0.5, -1.0, 2.0]), 0.0, 0.0
    for t, g in enumerate(grads, 1):
        p = p * (1 - 0.01 * 0.1)
        m = 0.9 * m + 0.1 * g
        v = 0.999 * v + 0.001 * g * g
        p = p - 0.01 * (m / (1 - 0.9 ** t)) / (np.sqrt(v / (1 - 0.999 ** t)) + 1e-8)
    np.testing.assert_allclose(params, p, rtol=1e-13)


def test_gradient_clipping_and_norm():
    model = _accumulation_model({"type": "sgd", "lr": 0.1})
    rng = np.random.default_rng(7)
    x, y = rng.normal(size=(6, 1, 8, 8)) * 50, rng.integers(0, 5, 6)
    free = Trainer(model, device="cpu", batch_size=6, dtype="float64", log=lambda *a: None)
    clipped = Trainer(model, device="cpu", batch_size=6, dtype="float64", grad_clip=0.01, log=lambda *a: None)
    start = free.plan.params.copy()
    a, b = free.step(x, y), clipped.step(x, y)
    assert a.grad_norm == pytest.approx(b.grad_norm) and a.grad_norm > 0.01
    assert np.linalg.norm(free.plan.params - start) == pytest.approx(0.1 * a.grad_norm, rel=1e-9)
    assert np.linalg.norm(clipped.plan.params - start) == pytest.approx(0.1 * 0.01, rel=1e-5)


def test_gradients_and_activations_by_layer_name():
    model = load_model(EXAMPLES / "reference" / "mnist_cnn.json")
    trainer = Trainer(model, device="cpu", batch_size=2, inspect=True, log=lambda *a: None)
    x = np.random.default_rng(0).integers(0, 256, (2, 1, 28, 28), dtype=np.uint8)
    trainer.step(x, np.array([3, 7]))
    assert trainer.activations["conv1"].shape == (2, 32, 28, 28)
    assert trainer.activations["conv1"].min() >= 0                 # relu output
    assert trainer.gradients["conv1.weight"].shape == (32, 1, 3, 3)
    assert np.abs(trainer.gradients["fc2.bias"]).sum() > 0
    pooled = Trainer(model, device="cpu", batch_size=2, log=lambda *a: None)
    with pytest.raises(LnnError, match="inspect=True"):
        pooled.activations


# --------------------------------------------------------------------------- memory plan

@pytest.mark.parametrize("name", REFERENCE_NAMES)
def test_pooled_activations_are_smaller_and_never_overlap_while_alive(name):
    model = load_model(EXAMPLES / "reference" / f"{name}.json")
    plan = Plan(model, 64)
    report = plan.memory_report()
    assert report["activations_pooled"] < report["activations_naive"]
    assert report["peak"] == sum(report[k] for k in ("params", "running_stats", "grads", "optimizer_state",
                                                     "amp_copies", "activations_pooled", "conv_scratch",
                                                     "gemm_workspace", "dropout_index", "batch_data"))
    buffers = list(plan.buffers.values())
    for i, a in enumerate(buffers):
        for b in buffers[i + 1:]:
            if a.first <= b.last and b.first <= a.last:
                a_end, b_end = a.offset + a.nbytes(64), b.offset + b.nbytes(64)
                assert a_end <= b.offset or b_end <= a.offset, f"{a.name} and {b.name} overlap while alive"
    assert plan_memory(model, 64, gpu=False) == report


def test_memory_report_counts_optimizer_state():
    model = load_model(EXAMPLES / "reference" / "mnist_mlp.json")
    sgd = Plan(model, 32).memory_report()
    adam = Plan(model, 32).memory_report({"type": "adam"})
    assert sgd["optimizer_state"] == sgd["params"] and adam["optimizer_state"] == 2 * adam["params"]
    assert sgd["params"] >= model.num_params * 4


# --------------------------------------------------------------------------- amp precisions

def test_amp_precision_names():
    assert amp_precision(True) == amp_precision("fp16") == "fp16"
    assert amp_precision("bf16") == "bf16"
    assert amp_precision(False) is None and amp_precision(None) is None
    with pytest.raises(LnnError, match="amp must be one of fp16, bf16 .* not 'bf32'"):
        amp_precision("bf32")


@pytest.mark.parametrize("name", REFERENCE_NAMES)
def test_bf16_plans_the_bytes_of_fp16(name):
    pytest.importorskip("ml_dtypes")
    model = load_model(EXAMPLES / "reference" / f"{name}.json")
    bf16, fp16 = (Plan(model, 64, amp=amp, implicit_conv=True) for amp in ("bf16", "fp16"))
    fp32 = Plan(model, 64, implicit_conv=True)
    assert bf16.compute_dtype.name == "bfloat16" and bf16.compute_dtype.itemsize == 2 and bf16.amp == "bf16"
    report = bf16.memory_report()
    assert report == fp16.memory_report() == plan_memory(model, 64, amp="bf16")
    assert report["amp_copies"] == 2 * 2 * bf16.params_size > 0
    assert report["activations_pooled"] < fp32.memory_report()["activations_pooled"]
    assert {n: b.dtype.name for n, b in bf16.buffers.items() if b.dtype.itemsize == 2} == {
        n: "bfloat16" for n, b in fp16.buffers.items() if b.dtype == np.float16}


def test_bf16_is_refused_in_one_line_on_a_card_without_it():
    pytest.importorskip("ml_dtypes")
    old = {"name": "Tesla T4", "compute_capability": "7.5", "fast_fp16": True, "bfloat16": False}
    refusal = amp_refusal("bf16", old, np)
    assert refusal.splitlines() == [refusal] and "Tesla T4 (compute capability 7.5)" in refusal
    assert "needs 8.0" in refusal and "fp16" in refusal
    assert amp_refusal("fp16", old, np) is None
    ampere = dict(old, name="A100", compute_capability="8.0", bfloat16=True)
    assert amp_refusal("bf16", ampere, np) is None                       # NumPy with ml_dtypes makes bf16 arrays

    class NoBfloat16:                                                    # an array module without bfloat16 (CuPy 13)
        __version__ = "13.6.0"

        @staticmethod
        def zeros(shape, dtype):
            raise TypeError(f"Unsupported dtype {dtype}\nmore")
    refusal = amp_refusal("bf16", ampere, NoBfloat16)
    assert refusal == ("amp bf16: CuPy 13.6.0 cannot make bfloat16 arrays (needs CuPy 14 or newer with ml_dtypes): "
                       "Unsupported dtype bfloat16")


def _plan_step(model, amp, dtype, params, stats, x, r, n):
    plan = Plan(model, n, dtype=dtype, amp=amp, input_gradient=True)
    plan.allocate(np)
    plan.params[...], plan.stats[...] = params, stats
    plan.params_compute[...] = plan.params
    plan.input_buffer(n)[...] = x
    keys = {i: 7 + i for i in range(len(model.nodes))}
    out = plan.forward(n, training=True, dropout_keys=keys).astype(np.float64)
    plan.grads_compute.fill(0)
    plan.output_grad_buffer(n)[...] = r
    plan.backward(n, dropout_keys=keys)
    return out, plan.grads_compute.astype(np.float64), plan.views(n)["grad:-1"].astype(np.float64)


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_bf16_plan_runs_the_generic_kernels_within_bf16_rounding_of_float64(case):
    """The NumPy half of every layer's kernels on bfloat16 activations (ml_dtypes' type; the GPU runs the same
    code where fused.py has no kernel): output, parameter and input gradients within 3e-2 of the largest
    value (bfloat16 keeps 8 mantissa bits). With a max pool only the output is compared: values that differ
    in float64 tie in bfloat16, and the gradient then goes to the first of them."""
    pytest.importorskip("ml_dtypes")
    n = 5
    model, params, stats, x, r = random_plan_case(case, n)
    expected = _plan_step(model, False, "float64", params, stats, x, r, n)
    got = _plan_step(model, "bf16", "float32", params, stats, x, r, n)
    compared = 1 if any(node.op in ("maxpool2d", "maxpool1d", "global_max_pool") for node in model.nodes) else 3
    for name, a, b in list(zip(("output", "parameter gradients", "input gradient"), got, expected))[:compared]:
        np.testing.assert_allclose(a, b, rtol=0, atol=3e-2 * max(1.0, np.abs(b).max()), err_msg=name)


def test_amp_on_the_cpu_says_so_and_trains_in_float32():
    messages = []
    trainer = Trainer(EXAMPLES / "reference" / "mnist_mlp.json", device="cpu", amp="bf16", log=messages.append)
    assert trainer.amp is None and trainer.plan.compute_dtype == np.float32 and trainer.loss_scale == 1.0
    assert messages == ["amp: mixed precision needs a CUDA GPU; training in float32 on the CPU"]


# --------------------------------------------------------------------------- training block

def test_training_block_defaults_and_errors():
    assert TrainingConfig.parse(None).batch_size == 64
    config = TrainingConfig.parse({"epochs": 3, "batch_size": 32, "accumulate": 2, "grad_clip": 1.0,
                                   "lr_schedule": {"type": "cosine", "warmup_epochs": 1}})
    assert (config.epochs, config.accumulate, config.lr_schedule["min_lr"]) == (3, 2, 0.0)
    for bad, message in [({"epochs": 0}, "epochs must be a positive integer"),
                         ({"batch": 3}, "unknown field 'batch'"),
                         ({"grad_clip": -1}, "grad_clip must be a positive number"),
                         ({"lr_schedule": {"type": "linear"}}, "lr_schedule must be an object whose type"),
                         ({"lr_schedule": {"type": "step", "gamma": 0}}, "gamma must be a positive number"),
                         ({"lr_schedule": {"type": "cosine", "steps": 3}}, "unknown field 'steps'"),
                         ({"min_steps": 0}, "min_steps must be a positive integer"),
                         ({"epochs": 1, "min_steps": 10 ** 12}, r"training: min_steps is 1,000,000,000,000 steps, "
                                                                r"over the limit of 1,000,000 steps \(MAX_MIN_STEPS")]:
        with pytest.raises(ModelSpecError, match=message):
            TrainingConfig.parse(bad)
    assert TrainingConfig.parse({"min_steps": 1_000_000}).min_steps == 1_000_000


def test_min_steps_raises_the_epochs_of_a_small_dataset_only():
    config = TrainingConfig.parse({"epochs": 10, "min_steps": 100})
    assert [config.epochs_for(steps) for steps in (1, 3, 10, 50)] == [100, 34, 10, 10]
    assert TrainingConfig.parse({"epochs": 10}).epochs_for(1) == 10
    model = parse_model({"input_shape": [4], "layers": [{"type": "linear", "out_features": 2}],
                         "optimizer": {"type": "sgd", "lr": 0.05}, "training": {"epochs": 2, "min_steps": 12}})
    rng = np.random.default_rng(0)
    data = (rng.normal(size=(20, 4)).astype(np.float32), rng.integers(0, 2, 20))
    messages = []
    trainer = Trainer(model, device="numpy", batch_size=10, log=messages.append)
    assert len(trainer.fit(data, progress=False)) == 6                     # 2 steps an epoch: 6 epochs for 12
    assert any("training.min_steps 12: 6 epochs of 2 steps" in m for m in messages)
    assert len(Trainer(model, device="numpy", batch_size=10, log=lambda *a: None).fit(data, epochs=1, progress=False)) == 1


def test_a_run_of_more_epochs_than_its_checkpoint_can_hold_is_refused_before_training(tmp_path):
    """Each checkpoint keeps every epoch's figures; past MAX_EPOCHS it could not be read back (no export, no
    --resume), whether the epochs are asked for or come from min_steps on a small dataset."""
    model = parse_model({"input_shape": [4], "layers": [{"type": "linear", "out_features": 2}],
                         "optimizer": {"type": "sgd", "lr": 0.05}, "training": {"epochs": 1, "min_steps": 20_000}})
    rng = np.random.default_rng(0)
    data = (rng.normal(size=(20, 4)).astype(np.float32), rng.integers(0, 2, 20))
    trainer = Trainer(model, device="numpy", batch_size=20, log=lambda *a: None)
    for epochs in (10_001, None):                                           # None: min_steps makes 20,000
        with pytest.raises(LnnError, match=r"^the run is [\d,]+ epochs, over the limit of 10,000 epochs \(MAX_EPOCHS"):
            trainer.fit(data, epochs=epochs, out_dir=tmp_path / "run", progress=False)
        assert not (tmp_path / "run").exists()


def test_learning_rate_schedules():
    cosine = {"type": "cosine", "warmup_epochs": 1.0, "min_lr": 0.0}
    assert learning_rate(0.1, cosine, 0, 10, 5) == pytest.approx(0.01)
    assert learning_rate(0.1, cosine, 9, 10, 5) == pytest.approx(0.1)
    assert learning_rate(0.1, cosine, 10, 10, 5) == pytest.approx(0.1)
    assert learning_rate(0.1, cosine, 49, 10, 5) == pytest.approx(0.0, abs=1e-12)
    assert learning_rate(0.1, cosine, 29 + 1, 10, 5) < 0.05 + 1e-9
    step = {"type": "step", "warmup_epochs": 0.0, "step_epochs": 2, "gamma": 0.5}
    assert [learning_rate(1.0, step, s * 10, 10, 6) for s in range(6)] == [1, 1, 0.5, 0.5, 0.25, 0.25]


def test_negative_leaky_slope_is_refused_for_training():
    model = parse_model({"input_shape": [3], "loss": "mse",
                         "layers": [{"type": "linear", "out_features": 2,
                                     "activation": {"type": "leaky_relu", "negative_slope": -0.5}}]})
    with pytest.raises(ModelSpecError, match="negative_slope >= 0"):
        Trainer(model, device="cpu", log=lambda *a: None)


def test_batchnorm_running_stats_follow_pytorch():
    model = parse_model({"input_shape": [2, 3, 3], "loss": "mse",
                         "layers": [{"type": "batchnorm", "momentum": 0.1}, {"type": "flatten"}]})
    trainer = Trainer(model, device="cpu", batch_size=4, dtype="float64", log=lambda *a: None)
    x = np.random.default_rng(0).normal(2, 3, (4, 2, 3, 3))
    trainer.step(x, np.zeros((4, 18)))
    w = trainer.weights()
    mean, var = x.mean(axis=(0, 2, 3)), x.var(axis=(0, 2, 3), ddof=1)
    np.testing.assert_allclose(w["batchnorm_0.running_mean"], 0.1 * mean, rtol=1e-6)
    np.testing.assert_allclose(w["batchnorm_0.running_var"], 0.9 + 0.1 * var, rtol=1e-6)
    channel = (slice(None), None, None)
    expected = ((x[:1] - w["batchnorm_0.running_mean"][channel]) / np.sqrt(w["batchnorm_0.running_var"][channel] + 1e-5)
                * w["batchnorm_0.weight"][channel] + w["batchnorm_0.bias"][channel])
    np.testing.assert_allclose(trainer.predict(x[:1]), expected.reshape(1, -1), rtol=1e-6)   # eval: running stats


def test_memmap_cache_and_prefetch_thread_train_like_in_memory(tmp_path):
    from lnn.train import ArrayDataset, MemmapDataset
    from lnn.train.data import Prefetcher

    rng = np.random.default_rng(8)
    cache = MemmapDataset.create(tmp_path / "cache", 200, (1, 28, 28))
    cache.images[...] = rng.integers(0, 256, cache.images.shape, dtype=np.uint8)
    cache.labels[...] = rng.integers(0, 10, 200)
    cache.flush()
    streamed = MemmapDataset.open(tmp_path / "cache")
    in_memory = ArrayDataset(np.array(streamed.images), np.array(streamed.labels))
    model = load_model(EXAMPLES / "reference" / "mnist_mlp.json")
    a = Trainer(model, device="cpu", batch_size=32, log=lambda *a: None).fit(streamed, in_memory, epochs=2, progress=False)
    b = Trainer(model, device="cpu", batch_size=32, log=lambda *a: None).fit(in_memory, in_memory, epochs=2, progress=False)
    assert a[-1]["train_loss"] == b[-1]["train_loss"] and a[-1]["val_accuracy"] == b[-1]["val_accuracy"]

    def failing(indices):
        raise OSError("disk went away")

    with pytest.raises(OSError, match="disk went away"):
        list(Prefetcher([np.arange(3)], failing))
