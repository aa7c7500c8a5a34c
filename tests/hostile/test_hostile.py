"""Hostile input through every entry point (issue 15): each case runs in its own process under a 1 GiB
address-space limit and a 10 s time limit (harness.py) and must

  - end by itself, under both limits, without a traceback;
  - "error": exit non-zero with stderr exactly ONE line `lnn-xxx: error: ...`;
  - "ok": exit 0 (good photos of unusual kinds, a model summary of 3,000 layers, ...);
  - "mixed": a folder of good and bad photos: exit 1, one error line per problem, and an answer for
    every good photo;
  - "either": exit 0 or 1 (a flipped byte may or may not matter), with the same rules on what it prints;
  - print only valid JSON lines under --json (NaN and Infinity are not JSON).

The corpus (corpus.py) is written to a temporary folder once per session. Cases run two at a time. The one
case on the Numba backend may take NUMBA_COMPILE_S: it may compile the kernels first, which is no hang.
LNN_CACHE_DIR points each lnn-eval / lnn-train case at its own fresh cache (the user's stays untouched).
"""

from __future__ import annotations

import re
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from corpus import build_corpus  # noqa: E402
from harness import MEMORY_LIMIT, SESSION_PROG, TIME_LIMIT_S, command, json_lines, run_limited, stderr_lines  # noqa: E402

POOL = 2                          # cases at a time (the CI has 2 cores)
NUMBA_COMPILE_S = 60              # a case on the Numba backend may compile its kernels first (7-10 s on a busy
                                  # 2-core machine when the per-user cache is cold): that is no hang
FULL_DISK = 4096                  # bytes a "full disk" case may write per file
FULL_EVAL_DISK = 16               # less than any lnn-eval --out file (confusion.csv of 2 classes is 36 bytes)


@dataclass
class Case:
    name: str
    prog: str
    args: list                    # strings; {name} is replaced by the corpus path of that name
    expect: str                   # error | ok | mixed | either
    says: tuple = ()              # fragments the error line must hold
    env: dict = field(default_factory=dict)
    file_size: int | None = None
    after: object = None          # after(corpus, outcome): checks of what the case left behind
    slow: bool = False
    seconds: float = TIME_LIMIT_S


def leaves_no_files_in(folder_key: str):
    """After a "full disk" of FULL_EVAL_DISK bytes per file, on which none of the command's outputs fits:
    any file left in the output folder is a partial one."""
    def check(corpus, _):
        folder = Path(corpus["root"]) / "out" / folder_key
        left = sorted(f"{p.name} ({p.stat().st_size} bytes)" for p in folder.glob("*")) if folder.exists() else []
        assert not left, f"partial files left behind: {left}"
    return check


def old_export_survives(corpus, _):
    old = Path(corpus["old.onnx"])
    assert old.read_bytes() == b"an older export that must survive a failed one", "the older .onnx was destroyed"
    leftovers = sorted(p.name for p in old.parent.iterdir() if p.name != old.name and p.name.startswith("old"))
    assert not leftovers, f"partial files left behind: {leftovers}"


def no_bin_written(corpus, _):
    assert not (Path(corpus["root"]) / "out" / "full.bin").exists(), "a partial .bin was left behind"


JSON = "--json"
NUMPY = ("--device", "numpy")
EVAL = ("{tiny.bin}", "--quiet", "--device", "numpy")
TRAIN = ("{tiny.json}", "--device", "cpu", "--quiet", "--epochs", "1")


def infer_image(name: str, expect: str, **extra) -> Case:
    return Case(f"infer_{name}", "lnn-infer", [JSON, f"{{{name}}}"], expect, **extra)


def session(name: str, expect: str, *lines, **extra) -> Case:
    return Case(f"session_{name}", SESSION_PROG, list(lines), expect, **extra)


TOMATO_SESSION = "s = lnn.load('{tomato}', device='numpy')"

CASES = [
    # ---- photos through lnn-infer: the bad are one line each, the good answered
    *(infer_image(name, "error") for name in (
        "truncated.jpg", "ended_early.jpg", "crc_damaged.png", "text.jpg", "empty.png", "garbage.png", "folder.jpg", "pipe.jpg", "dev_zero", "loop_a.jpg",
        "bomb33000.png", "bomb30000.png", "jpeg_bomb.jpg")),
    infer_image("bitflip.jpg", "either"),
    *(infer_image(name, "ok") for name in ("trailing.jpg", "png16.png", "gray.jpg", "cmyk.jpg", "exif.jpg")),
    Case("infer_mixed_folder", "lnn-infer", [JSON, *NUMPY, "{mixed}"], "mixed"),
    Case("infer_mixed_folder_numba", "lnn-infer", [JSON, "--device", "cpu", "{mixed}"], "mixed", slow=True,
         seconds=NUMBA_COMPILE_S),
    Case("infer_top_k_huge", "lnn-infer", [JSON, "--top-k", str(10**8), "{leaf}"], "ok"),
    # ---- models given to lnn-infer
    *(Case(f"infer_model_{name}", "lnn-infer", [JSON, "--model", f"{{{name}}}", "{leaf}"], "error") for name in (
        "truncated.bin", "random.bin", "flip_header.bin", "flip_table.bin", "flip_tensor.bin", "huge_input.bin",
        "tiny.json", "dev_zero", "pipe.jpg", "folder.jpg")),
    Case("infer_model_huge_input_numba", "lnn-infer", ["--device", "cpu", "--model", "{huge_input.bin}", "{leaf}"],
         "error"),
    Case("infer_model_checkpoint", "lnn-infer", ["--model", "{checkpoint.npz}", "{leaf}"], "error", says=("lnn-export",)),
    Case("infer_model_nan_output", "lnn-infer", [JSON, "--model", "{nan_output.bin}", "{leaf}"], "error"),
    # ---- lnn-field --cli is lnn-infer's code with its own name
    Case("field_cli_mixed_folder", "lnn-field", ["--cli", JSON, *NUMPY, "{mixed}"], "mixed"),
    *(Case(f"field_cli_{name}", "lnn-field", ["--cli", JSON, f"{{{name}}}"], "error")
      for name in ("bomb33000.png", "pipe.jpg", "truncated.jpg")),
    Case("field_cli_model_huge_input", "lnn-field", ["--cli", "--model", "{huge_input.bin}", "{leaf}"], "error"),
    # ---- descriptions and model files through lnn-summary
    *(Case(f"summary_{name}", "lnn-summary", [f"{{{name}}}"], "error") for name in (
        "out_features_huge.json", "deep.json", "deep_object.json", "wrong_types.json", "wrong_layer_types.json",
        "negative_shape.json", "huge_shape.json", "nan.json", "infinite.json", "not_utf8.json", "huge_input.bin",
        "random.bin", "truncated.bin", "dev_zero", "folder.jpg", "pipe.jpg")),
    Case("summary_many_layers", "lnn-summary", ["{many_layers.json}"], "ok"),
    Case("summary_checkpoint", "lnn-summary", ["{checkpoint.npz}"], "ok"),
    Case("summary_batch_huge", "lnn-summary", ["{tiny.json}", "--batch", str(10**8)], "either"),
    # ---- lnn-export
    Case("export_lying_npz", "lnn-export", ["{tiny.json}", "--weights", "{lying.npz}", "-o", "{root}/out/x.bin"], "error"),
    Case("export_weights_not_npz", "lnn-export", ["{tiny.json}", "--weights", "{text.jpg}", "-o", "{root}/out/x.bin"],
         "error"),
    Case("export_deep_description", "lnn-export", ["{deep_object.json}", "--weights", "{lying.npz}", "-o",
                                                   "{root}/out/x.bin"], "error"),
    Case("export_damaged_bin", "lnn-export", ["{flip_tensor.bin}", "-o", "{root}/out/x.bin"], "error"),
    Case("export_damaged_checkpoint", "lnn-export", ["{damaged_run}/checkpoint.npz", "-o", "{root}/out/x.bin"], "error"),
    Case("export_int8_to_onnx", "lnn-export", ["{int8.bin}", "--onnx", "{root}/out/int8.onnx"], "ok"),
    Case("export_onnx_full_disk", "lnn-export", ["{tomato}", "--onnx", "{old.onnx}"], "error", file_size=FULL_DISK,
         after=old_export_survives),
    Case("export_bin_full_disk", "lnn-export", ["{tomato}", "-o", "{root}/out/full.bin"], "error", file_size=FULL_DISK,
         after=no_bin_written),
    # ---- lnn-doctor MODEL.bin and lnn-bench (issue 16): a bad model or option is one line before any work
    *(Case(f"doctor_model_{name}", "lnn-doctor", [f"{{{name}}}"], "error")
      for name in ("truncated.bin", "flip_tensor.bin", "huge_input.bin", "pipe.jpg")),
    *(Case(f"bench_model_{name}", "lnn-bench", [f"{{{name}}}", "--device", "numpy"], "error")
      for name in ("truncated.bin", "huge_input.bin", "dev_zero")),
    Case("bench_batch_huge", "lnn-bench", ["{tomato}", "--batch", str(10**8)], "error"),
    Case("bench_images_bomb", "lnn-bench", ["{tiny.bin}", "--device", "numpy", "--images", "{bomb33000.png}"], "error"),
    # ---- lnn-import
    *(Case(f"import_{name}", "lnn-import", [f"{{{name}}}", "-o", "{root}/out/imported.bin"], "error")
      for name in ("garbage.onnx", "truncated.onnx", "huge_input.onnx", "text.jpg", "dev_zero", "pipe.jpg")),
    Case("import_tiny", "lnn-import", ["{tiny.onnx}", "-o", "{root}/out/tiny_imported.bin", "--labels", "a,b"], "ok"),
    # ---- lnn-eval
    Case("eval_seed_negative", "lnn-eval", [*EVAL, "--data", "folder:{data}", "--seed", "-1"], "either"),
    Case("eval_batch_huge", "lnn-eval", [*EVAL, "--data", "folder:{data}", "--batch", str(10**8)], "either"),
    Case("eval_bad_photos_in_data", "lnn-eval", [*EVAL, "--data", "folder:{bad_data}", "--split", "all"], "either"),
    Case("eval_unwritable_cache", "lnn-eval", [*EVAL, "--data", "folder:{data}"], "ok", env={"LNN_CACHE_DIR": "{unwritable}"}),
    Case("eval_out_full_disk", "lnn-eval", [*EVAL, "--data", "folder:{data}", "--out", "{root}/out/eval"], "error",
         env={"LNN_CACHE_DIR": "{warm_cache}"}, file_size=FULL_EVAL_DISK, after=leaves_no_files_in("eval")),
    Case("eval_damaged_model", "lnn-eval", ["{truncated.bin}", "--quiet", "--data", "folder:{data}"], "error"),
    Case("eval_data_is_a_photo", "lnn-eval", [*EVAL, "--data", "folder:{leaf}"], "error"),
    Case("eval_data_missing", "lnn-eval", [*EVAL, "--data", "folder:{root}/nowhere"], "error"),
    # ---- lnn-train (device cpu: NumPy)
    Case("train_batch_huge", "lnn-train", [*TRAIN, "--data", "folder:{data}", "--out", "{root}/out/t1", "--batch",
                                           str(10**8)], "either"),
    Case("train_out_features_huge", "lnn-train", ["{out_features_huge.json}", "--data", "folder:{data}", "--out",
                                                  "{root}/out/t2", "--quiet"], "error"),
    Case("train_deep_description", "lnn-train", ["{deep_object.json}", "--data", "folder:{data}", "--out",
                                                 "{root}/out/t3", "--quiet"], "error"),
    Case("train_bad_photos_in_data", "lnn-train", [*TRAIN, "--data", "folder:{bad_data}", "--out", "{root}/out/t4"],
         "either"),
    Case("train_unwritable_cache", "lnn-train", [*TRAIN, "--data", "folder:{data}", "--out", "{root}/out/t5"], "ok",
         env={"LNN_CACHE_DIR": "{unwritable}"}),
    Case("train_resume_damaged_checkpoint", "lnn-train", [*TRAIN, "--data", "folder:{data}", "--out", "{damaged_run}",
                                                          "--resume"], "error"),
    Case("train_seed_negative", "lnn-train", [*TRAIN, "--data", "folder:{data}", "--out", "{root}/out/t6", "--seed",
                                              "-1"], "error"),
    Case("train_data_missing", "lnn-train", [*TRAIN, "--data", "folder:{root}/nowhere", "--out", "{root}/out/t7"],
         "error"),
    # ---- Session methods (a snippet prints an LnnError as one line; anything else is a traceback)
    session("load_dev_zero", "error", "lnn.load('/dev/zero')"),
    session("load_pipe", "error", "lnn.load('{pipe.jpg}')"),
    session("load_huge_input", "error", "lnn.load('{huge_input.bin}', device='numpy')"),
    session("device_gpu", "error", "lnn.load('{tomato}', device='gpu')"),
    session("threads_on_numpy", "either", "lnn.load('{tomato}', device='numpy', threads=2)"),
    session("predict_wrong_shape", "error", TOMATO_SESSION, "s.predict(np.zeros((1, 3, 2, 2), np.float32))"),
    session("predict_image_empty", "error", TOMATO_SESSION, "s.predict_image(np.zeros((0, 0, 3), np.uint8))"),
    session("predict_image_4d", "error", TOMATO_SESSION, "s.predict_image(np.zeros((2, 8, 8, 3), np.uint8))"),
    session("predict_image_bool", "either", TOMATO_SESSION, "print(s.predict_image(np.ones((64, 64, 3), bool)))"),
    session("predict_image_int64", "either", TOMATO_SESSION,
            "print(s.predict_image(np.arange(64 * 64 * 3).reshape(64, 64, 3) % 256))"),
    session("predict_image_nan_array", "either", TOMATO_SESSION,
            "print(s.predict_image(np.full((64, 64, 3), np.nan, np.float32)))"),
    session("predict_image_bomb_bytes", "error", TOMATO_SESSION,
            "s.predict_image(open('{bomb33000.png}', 'rb').read())"),
    session("predict_image_pipe", "error", TOMATO_SESSION, "s.predict_image('{pipe.jpg}')"),
    session("predict_image_dev_zero", "error", TOMATO_SESSION, "s.predict_image('/dev/zero')"),
]


@pytest.fixture(scope="session")
def corpus(tmp_path_factory):
    return build_corpus(tmp_path_factory.mktemp("hostile"))


def resolve(text: str, corpus: dict) -> str:
    """{name} -> the corpus path of that name (names hold dots, so not str.format)."""
    return re.sub(r"\{([^{}]+)\}", lambda found: corpus[found.group(1)], text)


def run_case(case: Case, corpus: dict):
    env = {key: resolve(value, corpus) for key, value in case.env.items()}
    if case.prog in ("lnn-eval", "lnn-train"):
        env.setdefault("LNN_CACHE_DIR", str(Path(corpus["root"]) / "cache" / case.name))
    return run_limited(command(case.prog, [resolve(arg, corpus) for arg in case.args]), env=env,
                       cwd=corpus["root"], file_size=case.file_size, seconds=case.seconds)


@pytest.fixture(scope="session")
def outcomes(corpus, request):
    """Every selected case run once, POOL at a time: {case name: Outcome}."""
    selected = {item.callspec.params["case"].name for item in request.session.items
                if getattr(item, "callspec", None) and isinstance(item.callspec.params.get("case"), Case)}
    chosen = [case for case in CASES if case.name in selected]
    with ThreadPoolExecutor(POOL) as pool:
        return dict(zip((case.name for case in chosen), pool.map(lambda case: run_case(case, corpus), chosen)))


def check(case: Case, outcome, corpus: dict) -> None:
    where = f"{case.name}: exit {outcome.returncode}\nstdout: {outcome.stdout[-1500:]}\nstderr: {outcome.stderr[-3000:]}"
    assert not outcome.timed_out, f"{case.name}: still running after {case.seconds} s (killed)\n{where}"
    assert outcome.peak_rss < MEMORY_LIMIT, f"{case.name}: peak memory {outcome.peak_rss / 2**20:.0f} MiB\n{where}"
    assert "Traceback" not in outcome.stderr, where
    assert outcome.returncode >= 0, f"{case.name}: killed by signal {-outcome.returncode}\n{where}"
    errors, stray = stderr_lines(case.prog, outcome.stderr)
    assert not stray, f"{case.name}: stderr lines that are not {case.prog}'s own: {stray[:5]}\n{where}"
    answers = json_lines(outcome.stdout) if JSON in case.args else []
    if case.expect == "ok":
        assert outcome.returncode == 0 and not errors, where
    elif case.expect == "error":
        assert outcome.returncode != 0, where
        assert len(errors) == 1 and outcome.stderr.strip().splitlines()[-1] == errors[0], where
        for fragment in case.says:
            assert fragment in errors[0], (fragment, where)
    elif case.expect == "mixed":
        assert outcome.returncode == 1 and errors, where
        answered = {answer.get("file") for answer in answers if "label" in answer}
        missing = [path for path in corpus["mixed_good"] if path not in answered]
        assert not missing, f"good photos without an answer: {missing}\n{where}"
    else:
        assert outcome.returncode in (0, 1), where
        assert (outcome.returncode == 1) == bool(errors), where
    if case.after is not None:
        case.after(corpus, outcome)


@pytest.mark.parametrize("case", [pytest.param(case, id=case.name, marks=[pytest.mark.slow] if case.slow else [])
                                  for case in CASES])
def test_hostile_input(case, outcomes, corpus):
    check(case, outcomes[case.name], corpus)


def test_the_limits_bite(tmp_path):
    """The harness itself: a child's peak memory is its own, not the test runner's; a child that allocates 2 GiB
    fails, one that sleeps is killed after the time limit, one that writes past the "full disk" gets EFBIG."""
    ballast = bytearray(400 << 20)                      # the test runner grows (every page touched): the
    ballast[::4096] = b"\1" * len(ballast[::4096])      # child's figure must not (ru_maxrss alone would)
    small = run_limited([sys.executable, "-c", "b = bytearray(50 << 20)"])
    assert small.returncode == 0 and 50 << 20 < small.peak_rss < 200 << 20, small.peak_rss
    del ballast
    grab = run_limited([sys.executable, "-c", "b = bytearray(2 << 30)"])
    assert grab.returncode != 0 and "MemoryError" in grab.stderr and grab.peak_rss < MEMORY_LIMIT
    sleeper = run_limited([sys.executable, "-c", "import time; time.sleep(60)"])
    assert sleeper.timed_out and sleeper.seconds < TIME_LIMIT_S + 5
    writer = run_limited([sys.executable, "-c", "open('big', 'wb').write(bytes(10000))"], cwd=tmp_path,
                         file_size=FULL_DISK)
    assert writer.returncode != 0 and "File too large" in writer.stderr
