"""lnn-export: reference models reproduce PyTorch's outputs after export, re-export is byte-identical,
--fp16 halves the weights and stays close, and every bad input is one line on stderr."""

import json

import numpy as np
import pytest

import lnn
from cli_helpers import assert_one_line_error, reference_bin, run_command  # noqa: F401 (reference_bin: fixture)
from conftest import EXAMPLES, REFERENCE_MODELS, REFERENCE_NAMES, REPO, need
from lnn.formats.binfile import read_bin
from lnn.formats.model import parse_model
from lnn.tools.export import main

MNIST_JSON = EXAMPLES / "reference" / "mnist_cnn.json"


def mnist_weights():
    return need(REFERENCE_MODELS / "mnist_cnn.weights.npz")


def error_of(capsys, argv) -> str:
    assert main([str(a) for a in argv]) == 1
    captured = capsys.readouterr()
    assert captured.out == ""
    assert_one_line_error(captured.err, "lnn-export")
    return captured.err


@pytest.mark.parametrize("name", REFERENCE_NAMES)
def test_exported_reference_model_reproduces_pytorch(reference_bin, name):
    samples = np.load(need(REFERENCE_MODELS / f"{name}.samples.npz"))
    session = lnn.load(reference_bin(name), device="numpy")
    np.testing.assert_allclose(session.run(samples["input"]), samples["expected"], rtol=0, atol=1e-4)


def test_export_prints_size_tensors_and_parameters(tmp_path, capsys):
    out = tmp_path / "m.bin"
    assert main([str(MNIST_JSON), "--weights", str(mnist_weights()), "-o", str(out)]) == 0
    printed = capsys.readouterr().out
    assert f"{out.stat().st_size:,} bytes" in printed
    assert "8 tensors (8 float32)" in printed and "421,642 parameters" in printed


@pytest.mark.parametrize("fp16", [False, True])
def test_export_load_export_is_byte_identical(reference_bin, tmp_path, fp16):
    first = reference_bin("mnist_cnn")
    if fp16:
        assert main([str(first), "-o", str(tmp_path / "half.bin"), "--fp16"]) == 0
        first = tmp_path / "half.bin"
    assert main([str(first), "-o", str(tmp_path / "again.bin")]) == 0
    assert (tmp_path / "again.bin").read_bytes() == first.read_bytes()


def test_fp16_stores_weight_matrices_as_half_and_predicts_close(reference_bin, tmp_path):
    full = tmp_path / "leaf.bin"                                          # sizes without the test vectors
    assert main([str(reference_bin("leaf_cnn")), "-o", str(full), "--test-vectors", "0"]) == 0
    half = tmp_path / "leaf_fp16.bin"
    assert main([str(full), "-o", str(half), "--fp16", "--test-vectors", "0"]) == 0
    stored = read_bin(half).stored_dtypes
    assert {k for k, d in stored.items() if d == "float16"} == {"conv1.weight", "conv2.weight", "conv3.weight",
                                                                "conv4.weight", "fc.weight"}
    assert half.stat().st_size < 0.6 * full.stat().st_size
    batch = np.load(need(REFERENCE_MODELS / "leaf_cnn.samples.npz"))["input"]       # not photos: run, not predict

    def probabilities(path):
        session = lnn.load(path, device="numpy")
        return session.judge_rules.probabilities(session.run(batch))
    expected, got = probabilities(full), probabilities(half)
    np.testing.assert_allclose(got, expected, atol=2e-3)
    assert (got.argmax(1) == expected.argmax(1)).all()


@pytest.mark.parametrize("from_bin", [False, True])
def test_onnx_output_reproduces_pytorch_in_onnxruntime(reference_bin, tmp_path, capsys, from_bin):
    onnxruntime = pytest.importorskip("onnxruntime")
    source = [reference_bin("leaf_cnn")] if from_bin else [EXAMPLES / "reference" / "leaf_cnn.json", "--weights",
                                                           need(REFERENCE_MODELS / "leaf_cnn.weights.npz")]
    assert main([*map(str, source), "--onnx", str(tmp_path / "leaf.onnx")]) == 0
    assert "ONNX, float32, 97,956 parameters" in capsys.readouterr().out
    samples = np.load(need(REFERENCE_MODELS / "leaf_cnn.samples.npz"))
    ort = onnxruntime.InferenceSession(str(tmp_path / "leaf.onnx"), providers=["CPUExecutionProvider"])
    (got,) = ort.run(None, {ort.get_inputs()[0].name: samples["input"]})
    np.testing.assert_allclose(got, samples["expected"], rtol=0, atol=1e-4)


def test_onnx_of_a_bin_with_a_gate_says_the_gate_stays_behind(tmp_path, capsys):
    # ONNX carries the network, labels and preprocessing only: the bundled model's calibration, gate and
    # thresholds were dropped without a word, and a .bin imported back from the file answered every photo
    # (never "uncertain" / "not a leaf"); now a warning line says so (the file is still written)
    pytest.importorskip("onnx")

    assert main([str(REPO / "models" / "tomato_leaf.bin"), "--onnx", str(tmp_path / "t.onnx")]) == 0
    captured = capsys.readouterr()
    assert "ONNX, float32" in captured.out and (tmp_path / "t.onnx").exists()
    (warning,) = captured.err.splitlines()
    assert warning.startswith("warning: ") and "calibration, gate, thresholds" in warning
    assert main([str(MNIST_JSON), "--weights", str(mnist_weights()), "--onnx", str(tmp_path / "m.onnx")]) == 0
    assert capsys.readouterr().err == ""                                 # nothing left behind: no warning


def batchnorm_model(tmp_path):
    desc = {"name": "bn", "input_shape": [2, 4, 4], "layers": [
        {"type": "conv2d", "name": "conv", "out_channels": 3, "kernel_size": 3, "padding": 1},
        {"type": "batchnorm", "name": "bn", "activation": "relu"},
        {"type": "global_avg_pool"}, {"type": "linear", "name": "fc", "out_features": 2}]}
    path = tmp_path / "bn.json"
    path.write_text(json.dumps(desc))
    return path


def test_pytorch_num_batches_tracked_is_ignored(tmp_path):
    rng = np.random.default_rng(0)
    weights = {"conv.weight": rng.normal(size=(3, 2, 3, 3)), "conv.bias": rng.normal(size=3),
               "bn.weight": rng.normal(size=3), "bn.bias": rng.normal(size=3),
               "bn.running_mean": rng.normal(size=3), "bn.running_var": rng.uniform(0.5, 2, size=3),
               "bn.num_batches_tracked": np.array(100, dtype=np.int64),
               "fc.weight": rng.normal(size=(2, 3)), "fc.bias": rng.normal(size=2)}
    np.savez(tmp_path / "w.npz", **weights)
    assert main([str(batchnorm_model(tmp_path)), "--weights", str(tmp_path / "w.npz"), "-o", str(tmp_path / "bn.bin")]) == 0
    tensors = read_bin(tmp_path / "bn.bin").tensors
    assert "bn.num_batches_tracked" not in tensors
    np.testing.assert_array_equal(tensors["bn.running_var"], weights["bn.running_var"].astype(np.float32))


@pytest.mark.parametrize("case, fragment", [
    ("missing_weights", "no such file"),
    ("text_as_npz", "not a NumPy .npz archive"),
    ("npy_not_npz", "single array"),
    ("wrong_shape", "fc1.weight has shape [3136, 128], the model expects [128, 3136]"),
    ("missing_key", "missing 'fc2.bias'"),
    ("extra_key", "'fc3.weight' is not a parameter"),
    ("no_weights_flag", "give its weights with --weights"),
    ("bad_json", "not valid JSON at line"),
    ("wrong_description", "layer 5 (linear): in_features is 3136 from the previous layer, not 6272"),
    ("missing_model", "no such file"),
    ("weights_for_bin", "carries its own weights"),
    ("output_folder_missing", "cannot write"),
    ("fp16_overflow", "beyond the float16 range"),
])
def test_bad_input_is_one_line(tmp_path, capsys, reference_bin, case, fragment):
    good = dict(np.load(mnist_weights()))
    model, weights, extra = MNIST_JSON, tmp_path / "w.npz", []
    out = tmp_path / "out.bin"
    if case == "missing_weights":
        weights = tmp_path / "absent.npz"
    elif case == "text_as_npz":
        weights.write_text("these are not weights\n")
    elif case == "npy_not_npz":
        weights = tmp_path / "w.npy"
        np.save(weights, good["fc1.weight"])
    else:
        if case == "wrong_shape":
            good["fc1.weight"] = good["fc1.weight"].T
        elif case == "missing_key":
            del good["fc2.bias"]
        elif case == "extra_key":
            good["fc3.weight"] = good["fc2.weight"]
        elif case == "fp16_overflow":
            good["fc2.weight"] = good["fc2.weight"] * 1e6
            extra = ["--fp16"]
        np.savez(weights, **good)
    if case == "no_weights_flag":
        argv = [model, "-o", out]
    else:
        if case == "bad_json":
            model = tmp_path / "bad.json"
            model.write_text('{"name": "x", "layers": [')
        elif case == "wrong_description":
            desc = json.loads(MNIST_JSON.read_text())
            desc["layers"][5]["in_features"] = 6272
            model = tmp_path / "wrong.json"
            model.write_text(json.dumps(desc))
        elif case == "missing_model":
            model = tmp_path / "absent.json"
        elif case == "weights_for_bin":
            model = reference_bin("mnist_cnn")
        elif case == "output_folder_missing":
            out = tmp_path / "no" / "such" / "out.bin"
        argv = [model, "--weights", weights, "-o", out, *extra]
    assert fragment in error_of(capsys, argv)
    assert not out.exists()


def test_errors_from_a_process_are_one_line_with_status_1_and_usage_errors_status_2(tmp_path):
    (tmp_path / "w.npz").write_bytes(b"PK\x03\x04 truncated zip")
    result = run_command("export", MNIST_JSON, "--weights", tmp_path / "w.npz", "-o", tmp_path / "o.bin")
    assert result.returncode == 1 and result.stdout == ""
    assert_one_line_error(result.stderr, "lnn-export", "w.npz")

    result = run_command("export", MNIST_JSON, "--weights", tmp_path / "w.npz")   # no output named
    assert result.returncode == 2
    assert_one_line_error(result.stderr, "lnn-export", "-o OUT.bin, --onnx OUT.onnx")
    result = run_command("export", MNIST_JSON, "--onnx", tmp_path / "o.onnx", "--fp16")
    assert result.returncode == 2
    assert_one_line_error(result.stderr, "lnn-export", "--fp16 applies to the .bin")
    result = run_command("export", MNIST_JSON, "-o", tmp_path / "same", "--onnx", tmp_path / "." / "same")
    assert result.returncode == 2 and not (tmp_path / "same").exists()      # the ONNX file had replaced the .bin
    assert_one_line_error(result.stderr, "lnn-export", "-o and --onnx name the same file")


def test_help_and_version():
    result = run_command("export", "--help")
    assert result.returncode == 0 and "--fp16" in result.stdout and "--weights" in result.stdout
    result = run_command("export", "--version")
    assert result.returncode == 0 and result.stdout.strip() == f"lnn-export (lnn) {lnn.__version__}"


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    """A 2-epoch lnn-train run of a small conv + batch-norm model on random data -> (run folder, trainer, x)."""
    from lnn.train import Trainer

    folder = tmp_path_factory.mktemp("run")
    rng = np.random.default_rng(0)
    x = rng.normal(size=(48, 2, 4, 4)).astype(np.float32)
    y = (x[:, 0].sum(axis=(1, 2)) > 0).astype(np.int64)
    model = batchnorm_model(folder)
    trainer = Trainer(model, device="cpu", seed=0, batch_size=16, log=lambda *a: None)
    trainer.fit((x, y), (x[:16], y[:16]), epochs=2, out_dir=folder / "run", progress=False)
    return folder / "run", trainer, x


def test_a_training_checkpoint_exports_like_the_run_itself(tiny_run, tmp_path, capsys):
    folder, trainer, x = tiny_run
    out = tmp_path / "from_best.bin"
    assert main([str(folder / "best.npz"), "-o", str(out)]) == 0
    assert f"wrote {out}" in capsys.readouterr().out
    assert out.read_bytes() == (folder / "model.bin").read_bytes()      # the .bin lnn-train wrote at the end
    assert main([str(folder / "checkpoint.npz"), "-o", str(tmp_path / "last.bin")]) == 0
    got = lnn.load(tmp_path / "last.bin", device="numpy").run(x)
    np.testing.assert_allclose(got, trainer.predict(x), rtol=1e-5, atol=1e-5)   # the trainer's state is the last epoch's


def test_a_training_checkpoint_exports_fp16_and_onnx(tiny_run, tmp_path):
    onnxruntime = pytest.importorskip("onnxruntime")
    folder, trainer, x = tiny_run
    assert main([str(folder / "checkpoint.npz"), "-o", str(tmp_path / "h.bin"), "--fp16",
                 "--onnx", str(tmp_path / "m.onnx")]) == 0
    assert read_bin(tmp_path / "h.bin").stored_dtypes["fc.weight"] == "float16"
    expected = trainer.predict(x)
    np.testing.assert_allclose(lnn.load(tmp_path / "h.bin", device="numpy").run(x), expected, atol=2e-2)
    ort = onnxruntime.InferenceSession(str(tmp_path / "m.onnx"))
    got = ort.run(None, {ort.get_inputs()[0].name: x})[0]
    np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-4)


def test_a_weights_npz_as_the_model_and_weights_for_a_checkpoint_are_one_line_errors(tiny_run, tmp_path, capsys):
    folder, _, _ = tiny_run
    np.savez(tmp_path / "w.npz", **{"fc.weight": np.zeros((2, 3), np.float32)})
    assert "a NumPy .npz of weights, not a model" in error_of(capsys, [tmp_path / "w.npz", "-o", tmp_path / "o.bin"])
    assert "carries its own weights" in error_of(capsys, [folder / "best.npz", "--weights", tmp_path / "w.npz",
                                                          "-o", tmp_path / "o.bin"])
    (tmp_path / "broken.npz").write_bytes((folder / "best.npz").read_bytes()[:200])
    assert "broken.npz" in error_of(capsys, [tmp_path / "broken.npz", "-o", tmp_path / "o.bin"])
    assert not (tmp_path / "o.bin").exists()


# --------------------------------------------------------------------------- archives whose headers claim huge arrays

def npy_claiming(shape, dtype="<f4", data_bytes=50_000) -> bytes:
    """An .npy member whose header claims `shape` but which holds only `data_bytes` of data (a 51 KB file
    that np.load would allocate the whole claimed array for)."""
    import io

    header = io.BytesIO()
    np.lib.format.write_array_header_1_0(header, {"descr": dtype, "fortran_order": False, "shape": tuple(shape)})
    return header.getvalue() + bytes(data_bytes)


def rewrite_archive(source, target, **members) -> None:
    """Copy a zip archive (an .npz), replacing or adding the members given as name=bytes (name without .npy)."""
    import zipfile

    with zipfile.ZipFile(source) as old, zipfile.ZipFile(target, "w") as new:
        for info in old.infolist():
            if info.filename[:-len(".npy")] not in members:
                new.writestr(info, old.read(info))
        for name, data in members.items():
            new.writestr(name + ".npy", data)


def test_a_weights_archive_claiming_a_huge_array_is_refused_from_its_header(tmp_path, capsys):
    import time
    import zipfile

    model = batchnorm_model(tmp_path)
    with zipfile.ZipFile(tmp_path / "bomb.npz", "w") as archive:
        archive.writestr("fc.weight.npy", npy_claiming((100000, 100000)))
    assert (tmp_path / "bomb.npz").stat().st_size < 52_000
    started = time.perf_counter()
    message = error_of(capsys, [model, "--weights", tmp_path / "bomb.npz", "-o", tmp_path / "o.bin"])
    assert time.perf_counter() - started < 5
    assert "bomb.npz: weights: missing 'conv.weight'" in message            # names checked from the headers
    rng = np.random.default_rng(0)
    good = {"conv.weight": rng.normal(size=(3, 2, 3, 3)), "conv.bias": rng.normal(size=3), "bn.weight": np.ones(3),
            "bn.bias": np.zeros(3), "bn.running_mean": np.zeros(3), "bn.running_var": np.ones(3),
            "fc.bias": np.zeros(2)}
    np.savez(tmp_path / "good.npz", **good, **{"fc.weight": np.ones((2, 3))})
    rewrite_archive(tmp_path / "good.npz", tmp_path / "bomb2.npz", **{"fc.weight": npy_claiming((100000, 100000))})
    message = error_of(capsys, [model, "--weights", tmp_path / "bomb2.npz", "-o", tmp_path / "o.bin"])
    assert "weights: fc.weight has shape [100000, 100000], the model expects [2, 3]" in message
    assert not (tmp_path / "o.bin").exists()


@pytest.mark.parametrize("member, claim, fragment", [
    ("w/fc.weight", (100000, 100000), "weight 'fc.weight' has shape [100000, 100000] in the checkpoint's header, "
                                      "its layer expects [2, 3]"),
    ("w/ghost.weight", (4,), "holds weight 'ghost.weight', which no layer of its model has"),
    ("opt/momentum_buffer", (100000, 100000), "array 'opt/momentum_buffer' claims shape [100000, 100000]"),
    ("meta", (100000, 100000), "its meta entry is not JSON bytes of at most 4,194,304 bytes"),
])
def test_a_checkpoint_claiming_a_huge_array_is_refused_from_its_header(tiny_run, tmp_path, capsys, member, claim,
                                                                        fragment):
    folder, _, _ = tiny_run
    rewrite_archive(folder / "best.npz", tmp_path / "bomb.npz",
                    **{member: npy_claiming(claim, "|u1" if member == "meta" else "<f4")})
    assert fragment in error_of(capsys, [tmp_path / "bomb.npz", "-o", tmp_path / "o.bin"])


def test_a_checkpoint_with_a_damaged_description_is_one_line(tiny_run, tmp_path, capsys):
    import io
    import zipfile

    folder, _, _ = tiny_run
    with zipfile.ZipFile(folder / "best.npz") as archive:
        meta = json.loads(np.load(io.BytesIO(archive.read("meta.npy"))).tobytes())
    for name, description in [("garbage", {"layers": "garbage"}), ("deep", [[[[]]]] * 3 + ["[" * 100]),
                              ("wrong", {**meta["description"], "input_shape": [3, 50000, 50000]})]:
        buffer = io.BytesIO()
        np.save(buffer, np.frombuffer(json.dumps({**meta, "description": description}).encode(), np.uint8))
        rewrite_archive(folder / "best.npz", tmp_path / f"{name}.npz", meta=buffer.getvalue())
        assert "the checkpoint's model description is unusable" in error_of(
            capsys, [tmp_path / f"{name}.npz", "-o", tmp_path / "o.bin"])
    deep = io.BytesIO()
    np.save(deep, np.frombuffer(('{"a": ' + "[" * 100_000 + "]" * 100_000 + "}").encode(), np.uint8))
    rewrite_archive(folder / "best.npz", tmp_path / "nested.npz", meta=deep.getvalue())
    assert "nests deeper than 64 levels" in error_of(capsys, [tmp_path / "nested.npz", "-o", tmp_path / "o.bin"])


def test_a_checkpoint_given_as_a_model_file_says_to_export_it(tiny_run):
    from lnn.formats.errors import LnnFormatError

    folder, _, _ = tiny_run
    with pytest.raises(LnnFormatError, match=r"best.npz: not an lnn model file: wrong magic bytes \(this is a training "
                                             r"checkpoint: export it with lnn-export CHECKPOINT -o model.bin\)"):
        read_bin(folder / "best.npz")


def test_onnx_on_a_full_disk_keeps_the_older_file_and_leaves_no_partial_one(tiny_run, tmp_path, capsys):
    pytest.importorskip("onnx")
    from cli_helpers import full_disk, temporaries

    folder, _, _ = tiny_run
    old = tmp_path / "model.onnx"
    old.write_bytes(b"an older export")
    with full_disk():
        message = error_of(capsys, [folder / "best.npz", "--onnx", old])
    assert "model.onnx" in message and "No space left on device" in message
    assert old.read_bytes() == b"an older export" and temporaries(tmp_path) == []
    assert main([str(folder / "best.npz"), "--onnx", str(old)]) == 0                # with room, it is replaced
    assert old.read_bytes()[:2] != b"an"


@pytest.mark.parametrize("flag", ["-o", "--onnx"])
def test_an_output_that_is_a_named_pipe_is_refused_and_left_as_it_is(tmp_path, capsys, flag):
    import os

    if flag == "--onnx":
        pytest.importorskip("onnx")
    pipe = tmp_path / "pipe"
    os.mkfifo(pipe)
    assert error_of(capsys, [MNIST_JSON, "--weights", mnist_weights(), flag, pipe]) == (
        f"lnn-export: error: {pipe}: is a named pipe, not a regular output file\n")
    assert pipe.is_fifo()


@pytest.mark.parametrize("case", ["-o", "--onnx", "symbolic link", "hard link", "--weights"])
def test_an_output_that_is_one_of_its_inputs_is_refused_before_any_work(tmp_path, capsys, case):
    """`lnn-export t.bin --onnx t.bin` replaced the model with an ONNX file (its gate, calibration and thresholds
    gone): the same file, by name or through a link, is refused and left as it was."""
    import os
    import shutil

    model = tmp_path / "t.bin"
    shutil.copyfile(REPO / "models" / "tomato_leaf.bin", model)
    original = model.read_bytes()
    argv, output = [model, "-o", model], model
    if case == "--onnx":
        argv = [model, "--onnx", model]
    elif case == "symbolic link":
        output = tmp_path / "link.bin"
        output.symlink_to(model)
        argv = [model, "-o", output]
    elif case == "hard link":
        output = tmp_path / "other_name.bin"
        os.link(model, output)
        argv = [model, "-o", output]
    elif case == "--weights":
        model = tmp_path / "w.npz"
        model.write_bytes(b"PK\x03\x04 weights, not read before the refusal")
        original, output = model.read_bytes(), model
        argv = [MNIST_JSON, "--weights", model, "-o", model]
    assert error_of(capsys, argv) == (f"lnn-export: error: {output}: the output is the same file as the input "
                                      f"{model}; choose another output file (writing it would replace the input)\n")
    assert model.read_bytes() == original


TINY_CONV = {"name": "tiny", "input_shape": [3, 8, 8], "labels": ["a", "b"],
             "layers": [{"type": "conv2d", "name": "conv", "out_channels": 4, "kernel_size": 3, "padding": 1},
                        {"type": "global_avg_pool"}, {"type": "flatten"},
                        {"type": "linear", "name": "fc", "out_features": 2}]}


@pytest.mark.parametrize("dtype, value, message", [
    ("uint64", 2 ** 64 - 1, "the model's output for a test input is not finite (NaN or infinity), so it cannot be "
                            "stored as a test vector: check the weights, or export with --test-vectors 0"),
    ("float64", 1e300, "weights: conv.weight has values beyond float32's range (±3.403e+38), in which the model "
                       "computes"),
])
def test_weights_too_large_for_float32_are_one_line_naming_float32(tmp_path, dtype, value, message):
    """uint64 weights of 2^64 - 1 printed two `RuntimeWarning: overflow encountered in matmul` lines before the
    error; float64 weights of 1e300, exported as float32, were said to be beyond the float16 range."""
    model = parse_model(TINY_CONV)
    (tmp_path / "tiny.json").write_text(json.dumps(TINY_CONV))
    weights = {key: np.full(shape, value, dtype) for key, shape in model.param_shapes().items()}
    np.savez(tmp_path / "w.npz", **weights)
    result = run_command("export", tmp_path / "tiny.json", "--weights", tmp_path / "w.npz", "-o", tmp_path / "t.bin")
    assert (result.returncode, result.stdout) == (1, "")
    assert result.stderr == f"lnn-export: error: {message}\n"
