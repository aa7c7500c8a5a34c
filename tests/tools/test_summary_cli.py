"""lnn-summary: mnist_cnn's parameter and FLOP counts (PyTorch's count and a hand count), the memory
estimates against sizes written out by hand, .bin metadata, and one-line errors."""

import json

import pytest

import lnn
from lnn.tools.cli import human_bytes
from cli_helpers import assert_one_line_error, reference_bin, run_command  # noqa: F401 (reference_bin: fixture)
from conftest import EXAMPLES
from lnn.formats.model import load_model
from lnn.tools.summary import (CARD_RESERVE_BYTES, CARD_RESERVE_FRACTION, main, memory_estimates, parse_size,
                               usable_card_bytes)
from lnn.train.plan import plan_memory

MNIST_CNN = EXAMPLES / "reference" / "mnist_cnn.json"
# mnist_cnn by hand: conv1 28*28*32*(1*9)*2, conv2 14*14*64*(32*9)*2, fc1 3136*128*2, fc2 128*10*2
MNIST_CNN_FLOPS = 28 * 28 * 32 * 9 * 2 + 14 * 14 * 64 * 32 * 9 * 2 + 3136 * 128 * 2 + 128 * 10 * 2
MNIST_CNN_PARAMS = (32 * 9 + 32) + (64 * 32 * 9 + 64) + (128 * 3136 + 128) + (10 * 128 + 10)   # 421,642 in PyTorch
# floats per image: input, conv1, pool, conv2, pool, flatten, fc1, fc2
MNIST_CNN_ACTIVATIONS = [784, 32 * 28 * 28, 32 * 14 * 14, 64 * 14 * 14, 64 * 7 * 7, 3136, 128, 10]


def summary_of(capsys, *argv) -> str:
    assert main([str(a) for a in argv]) == 0
    return capsys.readouterr().out


def test_mnist_cnn_counts(capsys):
    assert MNIST_CNN_PARAMS == 421_642 and MNIST_CNN_FLOPS == 8_482_304
    out = summary_of(capsys, MNIST_CNN)
    assert "parameters:  421,642 (1.6 MiB as float32)" in out
    assert "FLOPs:       8,482,304 per image (8.48 MFLOPs)" in out
    conv2 = next(line for line in out.splitlines() if line.split()[:2] == ["2", "conv2"])
    assert conv2.split()[2:9] == ["conv2d+relu", "[64,", "14,", "14]", "18,496", "7,225,344", "49.0"]


def test_sequence_layers_parameters_are_pytorchs(tmp_path, capsys):
    # PyTorch: Conv1d(in, out, k, groups=g) has out * in/g * k weights + out biases; LayerNorm(shape) a weight
    # and a bias of prod(shape) each; the pools none
    path = tmp_path / "series.json"
    path.write_text(json.dumps({"name": "series", "input_shape": [3, 128], "layers": [
        {"type": "conv1d", "name": "c1", "out_channels": 16, "kernel_size": 8, "padding": "same", "bias": False},
        {"type": "conv1d", "name": "c2", "out_channels": 8, "kernel_size": 3, "groups": 2, "activation": "relu"},
        {"type": "maxpool1d", "name": "pool", "kernel_size": 2},
        {"type": "layernorm", "name": "ln"},
        {"type": "global_max_pool", "name": "gmp"}]}))
    rows = {line.split()[1]: line.split() for line in summary_of(capsys, path).splitlines()
            if line.split()[:1] in (["0"], ["1"], ["2"], ["3"], ["4"])}
    assert rows["c1"][2:6] == ["conv1d", "[16,", "128]", f"{16 * 3 * 8:,}"]
    assert rows["c2"][2:6] == ["conv1d+relu", "[8,", "126]", f"{8 * 8 * 3 + 8:,}"]
    assert rows["c2"][6] == f"{2 * 8 * 126 * 8 * 3:,}"          # a multiply-add counts 2
    assert rows["pool"][2:6] == ["maxpool1d", "[8,", "63]", "0"]
    assert rows["ln"][2:6] == ["layernorm", "[8,", "63]", f"{2 * 8 * 63:,}"]
    assert rows["gmp"][2:5] == ["global_max_pool", "[8]", "0"]


@pytest.mark.parametrize("batch", [1, 32])
def test_memory_estimates_follow_the_stated_formula(batch, capsys):
    params = MNIST_CNN_PARAMS * 4
    activations = [n * 4 * batch for n in MNIST_CNN_ACTIVATIONS]
    live_pair = (32 * 28 * 28 + 32 * 14 * 14) * 4 * batch         # conv1 output + pool output: the largest pair
    saved = sum(activations)
    expected = {"inference": params + live_pair,
                "training, SGD (momentum)": params * 3 + saved + live_pair,
                "training, Adam": params * 4 + saved + live_pair}
    assert memory_estimates(load_model(MNIST_CNN), batch) == expected
    out = summary_of(capsys, MNIST_CNN, "--batch", batch)
    for what, size in expected.items():
        assert f"({size:,} bytes)" in out
    assert "inference = P + max_i(A[i-1] + A[i])" in out


def test_batchnorm_statistics_get_no_gradient_or_optimizer_state(tmp_path):
    desc = {"name": "bn", "input_shape": [8], "layers": [{"type": "batchnorm", "name": "bn"},
                                                         {"type": "linear", "name": "fc", "out_features": 2}]}
    path = tmp_path / "bn.json"
    path.write_text(json.dumps(desc))
    estimates = memory_estimates(load_model(path), 1)
    trainable = (8 + 8 + 2 * 8 + 2) * 4                            # bn weight, bias; fc weight, bias
    assert estimates["training, Adam"] - estimates["training, SGD (momentum)"] == trainable


def test_training_memory_of_the_real_plan_is_shown(capsys):
    report = plan_memory(load_model(MNIST_CNN), 64)
    out = summary_of(capsys, MNIST_CNN, "--batch", 64)
    assert "training memory of the plan lnn-train builds on the GPU, at batch 64 (float32, sgd" in out
    for key in ("activations_pooled", "params", "grads", "optimizer_state", "conv_scratch", "peak"):
        assert f"({report[key]:,} bytes)" in out
    assert f"naive sum of {human_bytes(report['activations_naive'])} ({report['activations_naive']:,} bytes)" in out
    assert report["activations_pooled"] < report["activations_naive"]


def test_amp_plans_are_shown_and_bf16_counts_as_fp16(capsys):
    pytest.importorskip("ml_dtypes")
    model = load_model(EXAMPLES / "reference" / "leaf_cnn.json")
    fp32, fp16, bf16 = (plan_memory(model, 64, amp=amp) for amp in (False, "fp16", "bf16"))
    assert bf16 == fp16 and bf16["peak"] < fp32["peak"]
    outs = {amp: summary_of(capsys, EXAMPLES / "reference" / "leaf_cnn.json", "--batch", 64, *flags)
            for amp, flags in (("fp16", ["--amp"]), ("bf16", ["--amp", "bf16"]))}
    assert "at batch 64 (amp bf16: bfloat16 activations, float32 master weights, sgd" in outs["bf16"]
    assert "bf16 copies of the parameters and gradients" in outs["bf16"] and f"({bf16['peak']:,} bytes)" in outs["bf16"]
    plans = {amp: out.split("training memory of the plan")[1] for amp, out in outs.items()}
    assert plans["bf16"].replace("bf16", "fp16").replace("bfloat16", "float16") == plans["fp16"]
    out = summary_of(capsys, EXAMPLES / "reference" / "leaf_cnn.json", "--max-batch", "--memory", "6GB", "--amp", "bf16")
    batch = int(out.split("largest training batch: ")[1].split(" ")[0])
    usable = usable_card_bytes(parse_size("6GB"))
    assert "with amp bf16" in out
    assert plan_memory(model, batch, amp="bf16")["peak"] <= usable < plan_memory(model, batch + 1, amp="bf16")["peak"]


@pytest.mark.parametrize("text, size", [("6GB", 6 * 10**9), ("6GiB", 6 * 2**30), ("512MB", 512 * 10**6),
                                        ("1.5 gib", 3 * 2**29), ("300MiB", 300 * 2**20), ("80kb", 80_000)])
def test_sizes_are_decimal_for_gb_and_binary_for_gib(text, size):
    assert parse_size(text) == size


@pytest.mark.parametrize("name, memory", [("mnist_cnn", "6GB"), ("leaf_cnn", "6GiB"), ("mnist_mlp", "512MB")])
def test_max_batch_fits_and_one_more_does_not(name, memory, capsys):
    model = load_model(EXAMPLES / "reference" / f"{name}.json")
    card = parse_size(memory)
    out = summary_of(capsys, EXAMPLES / "reference" / f"{name}.json", "--max-batch", "--memory", memory)
    batch = int(out.split("largest training batch: ")[1].split(",")[0])
    usable = int(card * (1 - CARD_RESERVE_FRACTION)) - CARD_RESERVE_BYTES       # the stated margin, by hand
    assert usable == usable_card_bytes(card)
    assert plan_memory(model, batch)["peak"] <= usable < plan_memory(model, batch + 1)["peak"]
    assert f"keeping 10% of it and 300.0 MiB (CUDA context, workspaces) free: {usable:,} bytes" in out
    assert f"a card of {card:,} bytes" in out


def test_bin_shows_metadata(reference_bin, tmp_path, capsys):
    from lnn.tools.export import main as export_main

    half = tmp_path / "half.bin"
    assert export_main([str(reference_bin("mnist_cnn")), "-o", str(half), "--fp16"]) == 0
    capsys.readouterr()
    out = summary_of(capsys, half)
    assert "file: " in out and f"({half.stat().st_size:,} bytes)" in out
    assert "stored: 8 tensors (4 float16, 4 float32)" in out
    assert "labels: 10 (0, 1, 2, 3, 4, 5, ...)" in out
    assert "preprocess: gray, resize to 28x28" in out
    assert "parameters:  421,642" in out
    assert "test vectors: 4 (4 inputs drawn from a standard normal distribution" in out


@pytest.mark.parametrize("case, fragment, status", [
    ("missing", "no such file", 1),
    ("bad_json", "not valid JSON", 1),
    ("surrogate", "surrogate.json: not valid text (a lone UTF-16 surrogate \\ud800 in a string)", 1),
    ("image", "cannot read the model description", 1),
    ("batch_zero", "--batch must be at least 1", 1),
    ("batch_text", "invalid int value", 2),
    ("batch_huge", "--batch must be at least 1 and at most 16,777,216 (the largest lnn-summary figures: a larger one "
                   "could overflow the plan's 64-bit byte counts), not 9,223,372,036,854,775,807", 1),
    ("size_no_unit", "'6' is not a size", 2),
    ("size_bad_unit", "'6gigs' is not a size", 2),
    ("size_zero", "more than 0 bytes", 2),
    ("memory_without_max_batch", "--max-batch and --memory SIZE go together", 2),
    ("card_too_small", "leaves nothing for training", 1),
    ("batch_1_too_big", "batch 1 needs", 1),
])
def test_bad_input_is_one_line(tmp_path, case, fragment, status):
    source, extra = tmp_path / "absent.json", []
    if case == "bad_json":
        source = tmp_path / "bad.json"
        source.write_text("{nope")
    elif case == "surrogate":
        source = tmp_path / "surrogate.json"
        source.write_text('{"name": "\\ud800", "input_shape": [4], "layers": [{"type": "linear", "out_features": 2}]}')
    elif case == "image":
        source = tmp_path / "photo.png"
        source.write_bytes(b"\x89PNG\r\n\x1a\n" + bytes(100))
    elif case == "batch_zero":
        source, extra = MNIST_CNN, ["--batch", "0"]
    elif case == "batch_huge":
        source, extra = MNIST_CNN, ["--batch", str(2**63 - 1)]
    elif case == "batch_text":
        source, extra = MNIST_CNN, ["--batch", "many"]
    elif case.startswith("size_"):
        size = {"size_no_unit": "6", "size_bad_unit": "6gigs", "size_zero": "0GB"}[case]
        source, extra = MNIST_CNN, ["--max-batch", "--memory", size]
    elif case == "memory_without_max_batch":
        source, extra = MNIST_CNN, ["--memory", "6GB"]
    elif case == "card_too_small":
        source, extra = MNIST_CNN, ["--max-batch", "--memory", "300MiB"]
    elif case == "batch_1_too_big":
        source, extra = EXAMPLES / "reference" / "leaf_cnn.json", ["--max-batch", "--memory", "335MiB"]
    result = run_command("summary", source, *extra)
    assert result.returncode == status and result.stdout == ""
    assert_one_line_error(result.stderr, "lnn-summary", fragment)


def test_help_and_version():
    result = run_command("summary", "--help")
    assert result.returncode == 0 and "--batch" in result.stdout
    result = run_command("summary", "--version")
    assert result.returncode == 0 and result.stdout.strip() == f"lnn-summary (lnn) {lnn.__version__}"


def test_a_huge_output_without_labels_is_refused_at_once(tmp_path):
    path = tmp_path / "huge.json"
    path.write_text('{"input_shape": [4], "layers": [{"type": "linear", "out_features": 1000000000000}]}')
    result = run_command("summary", path)
    assert result.returncode == 1
    assert_one_line_error(result.stderr, "lnn-summary", "parameter count is 5,000,000,000,000", "MAX_PARAMETERS")


def test_time_grows_about_linearly_with_the_layer_count(tmp_path, capsys):
    import time

    def seconds(layers: int) -> float:
        path = tmp_path / f"deep{layers}.json"
        path.write_text(json.dumps({"input_shape": [16], "loss": "mse", "layers": [
            {"type": "linear", "out_features": 16, "activation": "relu"}] * layers}))
        started = time.perf_counter()
        summary_of(capsys, path)
        return time.perf_counter() - started

    seconds(10)                                            # imports
    took = seconds(2000)
    assert took < 4, f"2,000 layers took {took:.1f} s (the quadratic placement took 14 s)"
