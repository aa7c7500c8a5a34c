"""lnn-train end to end on real MNIST (skipped without ../shared): accuracy through the exported .bin,
kill -9 then --resume, checkpoints always loadable, one-line errors; and the IDX reader's errors."""

import gzip
import json
import re
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

import lnn
from conftest import DATA, EXAMPLES, need
from lnn.formats.errors import LnnFormatError, LnnInputError
from lnn.train.checkpoint import load_checkpoint, read_checkpoint
from lnn.train.data import IDX_IMAGES, load_mnist, read_idx

MLP = EXAMPLES / "reference" / "mnist_mlp.json"


def _train_command(out, *extra):
    return [sys.executable, "-m", "lnn.tools.train", str(MLP), "--data", f"mnist:{DATA / 'mnist'}", "--out", str(out),
            "--device", "cpu", "--quiet", *map(str, extra)]


def _bin_accuracy(path) -> float:
    """Accuracy on the 10,000 test images through the CPU NumPy runtime, with the model's own preprocessing."""
    session = lnn.load(path, device="numpy")
    _, test = load_mnist(DATA / "mnist")
    pre = session.model.preprocess
    x = ((test.images * pre["scale"] - pre["mean"][0]) / pre["std"][0]).astype(np.float32)
    return float((session.run(x).argmax(axis=1) == test.labels).mean())


@pytest.mark.slow
def test_mnist_mlp_on_10000_images_reaches_94_percent(tmp_path):
    need(DATA / "mnist")
    done = subprocess.run(_train_command(tmp_path / "run", "--epochs", 2, "--batch", 64, "--limit-train", 10000,
                                         "--lr-schedule", "cosine"), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    metrics = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [m["epoch"] for m in metrics] == [1, 2]
    assert (tmp_path / "run" / "curves.png").stat().st_size > 1000
    accuracy = _bin_accuracy(tmp_path / "run" / "model.bin")
    assert accuracy >= 0.94
    assert accuracy == pytest.approx(max(m["val_accuracy"] for m in metrics), abs=1e-4)   # the best epoch is exported
    model, weights, state = load_checkpoint(tmp_path / "run" / "checkpoint.npz")
    assert state["epoch"] == 2 and model.name == "mnist_mlp" and weights["fc1.weight"].shape == (256, 784)


@pytest.mark.slow
def test_kill_9_then_resume_finishes_like_an_uninterrupted_run(tmp_path):
    need(DATA / "mnist")
    settings = ("--epochs", 4, "--batch", 16, "--limit-train", 6000)
    reference = subprocess.run(_train_command(tmp_path / "straight", *settings), capture_output=True, text=True,
                               timeout=300)
    assert reference.returncode == 0, reference.stderr

    run = tmp_path / "killed"
    checkpoint = run / "checkpoint.npz"
    process = subprocess.Popen(_train_command(run, *settings), stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    loads = 0
    deadline = time.time() + 120
    while time.time() < deadline and process.poll() is None:
        if checkpoint.exists():
            read_checkpoint(checkpoint)               # never half-written: loadable whenever it exists
            loads += 1
            if read_checkpoint(checkpoint)[0]["epoch"] >= 1:
                break
        time.sleep(0.005)
    assert process.poll() is None, "the run ended before it could be killed; make it longer"
    process.send_signal(signal.SIGKILL)
    process.wait()
    assert loads >= 1
    meta = read_checkpoint(checkpoint)[0]
    assert 1 <= meta["epoch"] < 4

    resumed = subprocess.run(_train_command(run, "--resume"), capture_output=True, text=True, timeout=300)   # run.json
    assert resumed.returncode == 0, resumed.stderr
    assert f"resumed {run} after epoch {meta['epoch']}" in resumed.stdout
    assert not list(run.glob(".*.tmp"))
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [m["epoch"] for m in metrics] == [1, 2, 3, 4]
    straight, after_kill = _bin_accuracy(tmp_path / "straight" / "model.bin"), _bin_accuracy(run / "model.bin")
    assert after_kill == pytest.approx(straight, abs=0.005)


def test_resume_alone_continues_the_run_with_the_options_it_was_started_with(tmp_path, monkeypatch, capsys):
    """An interrupted run resumed with only --data, --target and --resume ends byte for byte as the uninterrupted
    run; an option given again with another value is one line, and changes nothing."""
    from lnn.tools.train import main
    from lnn.train.run import RunDirectory

    table = EXAMPLES / "tabular"
    data = ["--data", f"csv:{table / 'machines.csv'}", "--target", "state", "--device", "cpu", "--quiet"]
    started = [str(table / "mlp.json"), *data, "--epochs", "5", "--batch", "16", "--lr", "0.004"]
    assert main([*started, "--out", str(tmp_path / "straight")]) == 0

    end_epoch = RunDirectory.end_epoch

    def interrupted_after_epoch_2(run, entry):
        end_epoch(run, entry)
        if entry["epoch"] == 2:
            raise KeyboardInterrupt
    monkeypatch.setattr(RunDirectory, "end_epoch", interrupted_after_epoch_2)
    run = tmp_path / "interrupted"
    assert main([*started, "--out", str(run)]) != 0
    monkeypatch.setattr(RunDirectory, "end_epoch", end_epoch)
    assert [json.loads(line)["epoch"] for line in (run / "metrics.jsonl").read_text().splitlines()] == [1, 2]
    capsys.readouterr()

    assert main([str(table / "mlp.json"), *data, "--out", str(run), "--resume", "--epochs", "9"]) != 0
    error = capsys.readouterr().err.strip().splitlines()
    assert len(error) == 1 and "--epochs 9: the run in" in error[0] and "was started with --epochs 5" in error[0]

    assert main([str(table / "mlp.json"), *data, "--out", str(run), "--resume"]) == 0
    assert "resuming with the run's options: --epochs 5 --batch 16 --lr 0.004" in capsys.readouterr().out
    assert (run / "model.bin").read_bytes() == (tmp_path / "straight" / "model.bin").read_bytes()
    assert [json.loads(line)["epoch"] for line in (run / "metrics.jsonl").read_text().splitlines()] == [1, 2, 3, 4, 5]


@pytest.mark.parametrize("stop", [signal.SIGTERM, signal.SIGINT])
def test_a_stopped_run_says_which_epoch_its_checkpoint_keeps_and_how_to_resume(tmp_path, stop):
    """Ctrl-C ended a run with an empty line, and SIGTERM (a scheduler's time limit) without a word."""
    table, run = EXAMPLES / "tabular", tmp_path / "run"
    process = subprocess.Popen([sys.executable, "-m", "lnn.tools.train", str(table / "mlp.json"), "--data",
                                f"csv:{table / 'machines.csv'}", "--target", "state", "--device", "cpu", "--quiet",
                                "--epochs", "5000", "--out", str(run)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True)
    deadline = time.time() + 60
    while not (run / "checkpoint.npz").exists() and time.time() < deadline and process.poll() is None:
        time.sleep(0.01)
    process.send_signal(stop)
    out, err = process.communicate(timeout=60)
    assert process.returncode == 130 and "Traceback" not in err, err
    epoch = read_checkpoint(run / "checkpoint.npz")[0]["epoch"]
    assert epoch >= 1 and out.splitlines()[-1] == (f"interrupted: {run / 'checkpoint.npz'} keeps the run as it was "
                                                   f"after epoch {epoch}; continue it with --resume (the same --out "
                                                   f"folder)")


def test_command_errors_are_one_line(tmp_path):
    def run(*args):
        return subprocess.run([sys.executable, "-m", "lnn.tools.train", *map(str, args)], capture_output=True,
                              text=True, timeout=60)

    for args, fragment in [((MLP, "--data", "cifar:x", "--out", tmp_path / "a"), "--data must look like KIND:PATH"),
                           ((MLP, "--data", f"mnist:{tmp_path / 'none'}", "--out", tmp_path / "a"), "no such folder"),
                           ((tmp_path / "missing.json", "--data", "mnist:x", "--out", tmp_path / "a"), "no such file"),
                           ((MLP, "--data", "mnist:x", "--out", tmp_path / "a", "--epochs", 0), "--epochs must be"),
                           ((MLP, "--data", "mnist:x", "--out", tmp_path / "a", "--amp", "bf32"),
                            "argument --amp: invalid choice: 'bf32'")]:
        done = run(*args)
        assert done.returncode != 0
        lines = done.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("lnn-train: error: ") and fragment in lines[0], done.stderr


def test_a_run_folder_holding_the_init_model_is_refused_before_any_work(tmp_path, capsys):
    """`--init RUN/model.bin --out RUN` would replace the model fine-tuned from with the run's own model.bin at the
    end: refused before the data is read (this data does not even exist), the model left as it was."""
    from lnn.tools.train import main

    run = tmp_path / "run"
    run.mkdir()
    (run / "model.bin").write_bytes(b"the model to fine-tune")
    argv = [MLP, "--data", f"mnist:{tmp_path / 'no_data'}", "--out", run, "--init", run / "model.bin", "--quiet"]
    assert main([str(arg) for arg in argv]) == 1
    assert capsys.readouterr().err == (f"lnn-train: error: {run / 'model.bin'}: the output is the same file as the "
                                       f"input {run / 'model.bin'}; choose another output file (writing it would "
                                       f"replace the input)\n")
    assert (run / "model.bin").read_bytes() == b"the model to fine-tune" and sorted(run.iterdir()) == [run / "model.bin"]


def test_amp_alone_is_fp16_and_bf16_is_asked_for_by_name():
    from lnn.tools.train import build_parser

    parse = build_parser().parse_args
    base = [str(MLP), "--data", "mnist:x", "--out", "runs/x"]
    assert parse(base).amp is None
    assert parse(base + ["--amp"]).amp == "fp16"
    assert parse(base + ["--amp", "bf16"]).amp == "bf16"
    assert parse(base[:1] + ["--amp", "fp16"] + base[1:]).amp == "fp16"


def test_idx_reader_errors(tmp_path):
    good = np.arange(2 * 3 * 4, dtype=np.uint8).reshape(2, 3, 4)
    raw = (IDX_IMAGES).to_bytes(4, "big") + b"".join(d.to_bytes(4, "big") for d in good.shape) + good.tobytes()
    (tmp_path / "ok").write_bytes(raw)
    (tmp_path / "ok.gz").write_bytes(gzip.compress(raw))
    np.testing.assert_array_equal(read_idx(tmp_path / "ok", IDX_IMAGES), good)
    np.testing.assert_array_equal(read_idx(tmp_path / "ok.gz", IDX_IMAGES), good)
    (tmp_path / "short").write_bytes(raw[:-5])
    (tmp_path / "labels").write_bytes((2049).to_bytes(4, "big") + (2).to_bytes(4, "big") + b"\x01\x02")
    (tmp_path / "bad.gz").write_bytes(gzip.compress(raw)[:-12])
    for name, message in [("short", "truncated or damaged"), ("labels", "not an IDX images file"),
                          ("bad.gz", "damaged gzip data"), ("missing", "no such file")]:
        with pytest.raises(LnnInputError, match=message):
            read_idx(tmp_path / name, IDX_IMAGES)


def test_an_idx_gzip_bomb_is_refused_before_it_expands(tmp_path):
    """The header is read from the gzip stream first: a declared size over MAX_IDX_BYTES is refused, and a stream
    longer than its header declares is decompressed only that far (64 MB of zeros behind a 24-byte header)."""
    import tracemalloc

    def header(*shape):
        return IDX_IMAGES.to_bytes(4, "big") + b"".join(d.to_bytes(4, "big") for d in shape)

    (tmp_path / "huge.gz").write_bytes(gzip.compress(header(2600000, 28, 28) + bytes(1000)))
    with pytest.raises(LnnInputError, match=r"huge.gz: the data its IDX header declares \(\[2600000, 28, 28\]\) is "
                                            r"2,038,400,000 bytes, over the limit of .* \(MAX_IDX_BYTES in"):
        read_idx(tmp_path / "huge.gz", IDX_IMAGES)
    (tmp_path / "long.gz").write_bytes(gzip.compress(header(2, 3, 4) + bytes(64 << 20), compresslevel=1))
    tracemalloc.start()
    try:
        with pytest.raises(LnnInputError, match=r"declares \[2, 3, 4\] \(24 bytes\) but more bytes follow"):
            read_idx(tmp_path / "long.gz", IDX_IMAGES)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < (1 << 20) + (tmp_path / "long.gz").stat().st_size * 2


def test_checkpoint_errors(tmp_path):
    (tmp_path / "junk.npz").write_bytes(b"PK\x03\x04 not really")
    np.savez(tmp_path / "foreign.npz", a=np.zeros(3))
    for name, message in [("junk.npz", "not an lnn checkpoint"), ("foreign.npz", "no meta entry"),
                          ("missing.npz", "no such file")]:
        with pytest.raises(LnnFormatError, match=message):
            load_checkpoint(tmp_path / name)


def test_resume_from_a_damaged_checkpoint_is_one_line(tmp_path):
    import io
    import zipfile

    from lnn.formats.model import parse_model
    from lnn.train import Trainer

    model = parse_model({"input_shape": [4], "layers": [{"type": "linear", "out_features": 2}]})
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(32, 4)).astype(np.float32), rng.integers(0, 2, 32)

    def fit(resume, epochs):
        trainer = Trainer(model, device="cpu", seed=0, batch_size=16, log=lambda *a: None)
        trainer.fit((x, y), (x, y), epochs=epochs, out_dir=tmp_path / "run", resume=resume, progress=False,
                    export=False)

    fit(False, 1)
    checkpoint = tmp_path / "run" / "checkpoint.npz"
    with zipfile.ZipFile(checkpoint) as archive:
        members = {info.filename: archive.read(info) for info in archive.infolist()}
    for damage, fragment in [(lambda m: m.pop("step"), "the checkpoint is damaged (no 'step')"),
                             (lambda m: m.update(history=7), "the checkpoint is damaged ("),
                             (lambda m: m.update(description={"layers": 3}), "model description is unusable"),
                             (lambda m: m.update(best="x"), "damaged (best is \"x\", not null or the epoch"),
                             (lambda m: m.update(best={"epoch": 5, "score": 1}), "damaged (best is {"),
                             (lambda m: m.update(history=["x"]), "damaged (history is [\"x\"], not a list of epochs"),
                             (lambda m: m["history"][0].update(train_loss="x"), "damaged (history is"),
                             (lambda m: m.update(epoch=7), "damaged (epoch is 7, not the number of epochs"),
                             (lambda m: m.update(step=-1), "damaged (step is -1, not a non-negative integer)"),
                             (lambda m: m.update(lr=True), "damaged (lr is true, not a non-negative number)"),
                             (lambda m: m.update(loss_scale=0), "damaged (loss_scale is 0, not a positive number)"),
                             (lambda m: m.update(rng={"seed": "0", "dropout_calls": 0}), "damaged (rng is {"),
                             (lambda m: m.update(amp="fp8"), "damaged (amp is \"fp8\", not null, 'fp16' or 'bf16')")]:
        meta = json.loads(np.load(io.BytesIO(members["meta.npy"])).tobytes())
        damage(meta)
        buffer = io.BytesIO()
        np.save(buffer, np.frombuffer(json.dumps(meta).encode(), np.uint8))
        with zipfile.ZipFile(checkpoint, "w") as archive:
            for name, data in {**members, "meta.npy": buffer.getvalue()}.items():
                archive.writestr(name, data)
        with pytest.raises(LnnFormatError) as info:
            fit(True, 2)
        assert fragment in str(info.value) and "\n" not in str(info.value)
    weight = next(name for name in members if name.startswith("w/"))
    buffer = io.BytesIO()
    np.save(buffer, np.full(np.load(io.BytesIO(members[weight])).shape, np.nan, np.float32))
    with zipfile.ZipFile(checkpoint, "w") as archive:
        for name, data in {**members, weight: buffer.getvalue()}.items():
            archive.writestr(name, data)
    with pytest.raises(LnnFormatError, match=r"^\S+checkpoint\.npz: the checkpoint is damaged \(weights: "
                                             + re.escape(weight[2:-len(".npy")]) + r" contains NaN or infinity\)") as info:
        fit(True, 2)
    assert "\n" not in str(info.value)


def colour_photos(root, per_class=4):
    """Two classes of small photos: red ones and green ones."""
    import cv2

    rng = np.random.default_rng(0)
    for name, channel in (("green", 1), ("red", 2)):
        (root / name).mkdir(parents=True)
        for i in range(per_class):
            image = rng.integers(0, 60, (12, 12, 3), dtype=np.uint8)
            image[:, :, channel] = 200
            cv2.imwrite(str(root / name / f"{name}_{i}.png"), image)
    return root


COLOUR_MODEL = {"name": "colours", "input_shape": [3, 8, 8], "layers": [
    {"type": "global_avg_pool"}, {"type": "linear", "out_features": 2}]}


def test_a_batch_larger_than_the_data_is_cut_to_it_and_said_so(tmp_path, monkeypatch, capsys):
    from lnn.tools.train import main

    monkeypatch.setenv("LNN_CACHE_DIR", str(tmp_path / "cache"))
    (tmp_path / "m.json").write_text(json.dumps(COLOUR_MODEL))
    folder = colour_photos(tmp_path / "photos")
    code = main([str(tmp_path / "m.json"), "--data", f"folder:{folder}", "--out", str(tmp_path / "run"),
                 "--batch", "100000000", "--epochs", "1", "--device", "numpy", "--quiet", "--no-augment"])
    out = capsys.readouterr().out
    assert code == 0
    assert "batch 100,000,000 is more than the 6 training rows: training with batch 6" in out
    assert "batch 6 x 1 accumulated" in out


def test_wrong_optimizer_settings_are_refused_before_training_starts(tmp_path, monkeypatch, capsys):
    """Adam's betas [] passed the description's check and failed at the first step with a ValueError traceback."""
    from lnn.tools.train import main

    monkeypatch.setenv("LNN_CACHE_DIR", str(tmp_path / "cache"))
    folder = colour_photos(tmp_path / "photos")
    for optimizer in ({"type": "adam", "betas": []}, {"type": "sgd", "momentum": -5}):
        (tmp_path / "m.json").write_text(json.dumps({**COLOUR_MODEL, "optimizer": optimizer}))
        code = main([str(tmp_path / "m.json"), "--data", f"folder:{folder}", "--out", str(tmp_path / "run"),
                     "--epochs", "1", "--device", "numpy", "--quiet", "--no-augment"])
        lines = capsys.readouterr().err.strip().splitlines()
        assert code == 1 and len(lines) == 1, lines
        assert lines[0].startswith("lnn-train: error: ") and f"optimizer ({optimizer['type']}): " in lines[0]
        assert not (tmp_path / "run").exists()


def test_a_plan_bigger_than_the_free_memory_is_refused_before_allocating(tmp_path, monkeypatch, capsys):
    from lnn.formats.errors import LnnError
    from lnn.formats.model import parse_model
    from lnn.train import Trainer, device
    from lnn.train.plan import Plan

    model = parse_model({"input_shape": [4], "layers": [{"type": "linear", "out_features": 2}]})
    monkeypatch.setattr(device, "free_bytes", lambda xp: 1000)
    monkeypatch.setattr(Plan, "allocate", lambda *a: pytest.fail("allocated although it cannot fit"))
    planned = Plan(model, 256).memory_report()["peak"]
    with pytest.raises(LnnError) as info:
        Trainer(model, device="numpy", batch_size=256, log=lambda *a: None)
    assert str(info.value) == (f"training at batch 256 plans {planned / 2**20:.1f} MiB ({planned:,} bytes) of memory, "
                               "but the cpu has 0.0 MiB (1,000 bytes) free: choose a smaller --batch")


def test_running_out_of_memory_is_one_line_with_the_planned_figure(tmp_path, monkeypatch):
    from lnn.formats.errors import LnnError
    from lnn.formats.model import parse_model
    from lnn.train import Trainer
    from lnn.train.plan import Plan

    model = parse_model({"input_shape": [4], "layers": [{"type": "linear", "out_features": 2}]})
    real_allocate = Plan.allocate

    def no_memory(*args):
        raise MemoryError("Unable to allocate 578. GiB")

    monkeypatch.setattr(Plan, "allocate", no_memory)
    with pytest.raises(LnnError, match=r"^out of memory on the cpu while training at batch 16 \(the plan needs "
                                       r"[\d.]+ MiB \([\d,]+ bytes\).*choose a smaller --batch$"):
        Trainer(model, device="numpy", batch_size=16, log=lambda *a: None)
    monkeypatch.setattr(Plan, "allocate", real_allocate)
    trainer = Trainer(model, device="numpy", batch_size=16, log=lambda *a: None)
    monkeypatch.setattr(trainer, "_train_epoch", no_memory)
    x, y = np.zeros((32, 4), np.float32), np.zeros(32, np.int64)
    with pytest.raises(LnnError, match=r"^out of memory on the cpu while training at batch 16"):
        trainer.fit((x, y), (x, y), epochs=1, progress=False)


def test_model_bin_gets_its_card_trained_field_from_the_run(tmp_path):
    import datetime

    from lnn.formats.binfile import read_bin
    from lnn.formats.model import parse_model
    from lnn.train import Trainer

    model = parse_model({"input_shape": [4], "layers": [{"type": "linear", "out_features": 2}],
                         "optimizer": {"type": "sgd", "lr": 0.05, "momentum": 0.9, "nesterov": True},
                         "model_card": {"trained": "TO FILL", "task": "a test"}})
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(32, 4)).astype(np.float32), rng.integers(0, 2, 32)
    trainer = Trainer(model, device="numpy", seed=0, batch_size=16, log=lambda *a: None)
    history = trainer.fit((x, y), (x, y), epochs=3, out_dir=tmp_path / "run", progress=False)
    card = read_bin(tmp_path / "run" / "model.bin").metadata["model_card"]
    median = sorted(entry["epoch_s"] for entry in history)[1]
    assert card == {"task": "a test", "trained": (
        f"{datetime.date.today().isoformat()} with lnn-train {lnn.__version__} on the CPU (NumPy), 3 epochs, "
        f"batch 16, SGD nesterov momentum 0.9 lr 0.05 constant, about {median:.1f} s per epoch")}


def test_a_non_finite_figure_is_recorded_as_null_and_the_run_still_exports(tmp_path):
    """An inf validation loss (overflowed logits) must not make metrics.jsonl or the checkpoints unreadable."""
    from lnn.formats.model import parse_model
    from lnn.train import Trainer

    model = parse_model({"input_shape": [4], "layers": [{"type": "linear", "out_features": 2}],
                         "optimizer": {"type": "sgd", "lr": 0.05}})
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(32, 4)).astype(np.float32), rng.integers(0, 2, 32)
    messages = []
    trainer = Trainer(model, device="numpy", seed=0, batch_size=16, log=messages.append)
    evaluate, calls = trainer.evaluate, []

    def overflowing(dataset):
        calls.append(1)
        return {**evaluate(dataset), "loss": float("inf")} if len(calls) == 2 else evaluate(dataset)

    trainer.evaluate = overflowing
    trainer.fit((x, y), (x, y), epochs=3, out_dir=tmp_path / "run", progress=False)

    def refuse(constant):
        raise AssertionError(f"metrics.jsonl holds {constant}")

    lines = [json.loads(line, parse_constant=refuse) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [entry["val_loss"] is None for entry in lines] == [False, True, False]
    assert any("epoch 2: val_loss is inf; recorded as null" in m for m in messages)
    for name in ("best.npz", "checkpoint.npz"):
        assert len(read_checkpoint(tmp_path / "run" / name)[0]["history"]) >= 1
    assert (tmp_path / "run" / "model.bin").stat().st_size > 0
    resumed = Trainer(model, device="numpy", seed=0, batch_size=16, log=lambda *a: None)
    assert len(resumed.fit((x, y), (x, y), epochs=4, out_dir=tmp_path / "run", resume=True, progress=False)) == 4


def test_a_diverged_epoch_stops_in_one_line_and_leaves_the_run_as_it_was(tmp_path):
    """A training loss that becomes NaN or infinite stops the run at once, without NumPy's RuntimeWarnings, and
    nothing of that epoch reaches the run folder; a non-finite learning rate is refused before training."""
    import warnings

    from lnn.formats.errors import LnnError
    from lnn.formats.model import parse_model
    from lnn.train import Trainer
    from lnn.train.trainer import TrainingDiverged

    model = parse_model({"input_shape": [4], "layers": [{"type": "linear", "out_features": 2}],
                         "optimizer": {"type": "sgd", "lr": 0.05}})
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(32, 4)).astype(np.float32), rng.integers(0, 2, 32)
    with pytest.raises(LnnError, match="must be a positive finite number, not inf"):
        Trainer(model, device="numpy", lr=float("inf"))
    run = tmp_path / "run"
    Trainer(model, device="numpy", seed=0, batch_size=16, log=lambda *a: None).fit(
        (x, y), (x, y), epochs=1, out_dir=run, progress=False, export=False)
    def state():      # metrics.jsonl is rewritten from the checkpoint on resume: the same entries
        return {path.name: [json.loads(line) for line in path.read_text().splitlines()] if path.suffix == ".jsonl"
                else path.read_bytes() for path in run.iterdir()}

    before = state()
    diverging = Trainer(model, device="numpy", seed=0, batch_size=16, lr=1e38, log=lambda *a: None)
    with warnings.catch_warnings(), pytest.raises(TrainingDiverged) as info:
        warnings.simplefilter("error")                 # a RuntimeWarning would fail here
        diverging.fit((x, y), (x, y), epochs=3, out_dir=run, resume=True, progress=False)
    assert str(info.value) == (f"epoch 2: the training loss became infinite by step 4 (diverged): train with a lower "
                               f"learning rate (--lr) or set training.grad_clip; {run} keeps the run as it was after "
                               f"epoch 1")
    assert state() == before


def test_an_epoch_with_no_finite_score_is_still_a_readable_best(tmp_path):
    """An mse run whose first validation loss overflows scores lowest; best.npz must still read back (JSON has no
    -Infinity), and the next epoch takes its place."""
    from lnn.formats.model import parse_model
    from lnn.train import Trainer

    model = parse_model({"input_shape": [4], "layers": [{"type": "linear", "out_features": 2}], "loss": "mse"})
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(32, 4)).astype(np.float32), rng.normal(size=(32, 2)).astype(np.float32)
    trainer = Trainer(model, device="numpy", seed=0, batch_size=16, log=lambda *a: None)
    evaluate = trainer.evaluate
    trainer.evaluate = lambda data: {"loss": float("inf")}
    trainer.fit((x, y), (x, y), epochs=1, out_dir=tmp_path / "run", progress=False, export=False)
    assert read_checkpoint(tmp_path / "run" / "best.npz")[0]["best"] == {"epoch": 1, "score": None}
    trainer.evaluate = evaluate
    trainer.fit((x, y), (x, y), epochs=2, out_dir=tmp_path / "run", resume=True, progress=False)
    assert read_checkpoint(tmp_path / "run" / "best.npz")[0]["best"]["epoch"] == 2


def test_init_starts_from_the_given_models_weights(tmp_path):
    """--init: a run with a vanishing learning rate ends where the given .bin started; a model of other
    layers is one line."""
    need(DATA / "mnist")
    first = subprocess.run(_train_command(tmp_path / "first", "--epochs", 1, "--limit-train", 2000),
                           capture_output=True, text=True, timeout=300)
    assert first.returncode == 0, first.stderr
    tuned = subprocess.run(_train_command(tmp_path / "tuned", "--epochs", 1, "--limit-train", 500, "--lr", 1e-12,
                                          "--lr-schedule", "constant", "--init", tmp_path / "first" / "model.bin"),
                           capture_output=True, text=True, timeout=300)
    assert tuned.returncode == 0, tuned.stderr
    before = lnn.load(tmp_path / "first" / "model.bin", device="numpy").bin.weights_fp32()
    after = lnn.load(tmp_path / "tuned" / "model.bin", device="numpy").bin.weights_fp32()
    assert before.keys() == after.keys()
    assert max(float(np.abs(before[k] - after[k]).max()) for k in before) < 1e-5
    cnn = lnn.load(EXAMPLES / "trained" / "mnist_cnn.bin", device="numpy")
    assert cnn.model.name != "mnist_mlp"
    wrong = subprocess.run(_train_command(tmp_path / "wrong", "--epochs", 1, "--limit-train", 100,
                                          "--init", EXAMPLES / "trained" / "mnist_cnn.bin"),
                           capture_output=True, text=True, timeout=300)
    assert wrong.returncode != 0 and len(wrong.stderr.strip().splitlines()) == 1, wrong.stderr
    assert "lnn-train: error:" in wrong.stderr and "Traceback" not in wrong.stderr
