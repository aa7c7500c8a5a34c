"""Shared test fixtures: where ../shared lies (or $LNN_SHARED: the GPU machine gets a copy), and
skipping cleanly when it does not."""

import importlib
import os
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parent.parent
SHARED = Path(os.environ.get("LNN_SHARED") or REPO.parent / "shared").resolve()
REFERENCE_MODELS = SHARED / "reference_models"
DATA = SHARED / "data"
REFERENCE_NAMES = ["mnist_mlp", "mnist_cnn", "leaf_cnn", "leaf_cnn224"]
EXAMPLES = REPO / "examples"


# What each part of the shared data folder holds, for the message of a test that skips without it.
SHARED_CONTENTS = {
    "data/mnist": "the MNIST IDX files (train/t10k-images/labels-idx*-ubyte.gz, from yann.lecun.com or any mirror)",
    "data/tomato": "the PlantVillage tomato-leaf photos (one folder per class, manifest.csv)",
    "data/outliers": "photos that are not tomato leaves (everyday/, plants_not_tomato/, textures_and_ground/)",
    "data/ucr": "UCR/UEA time-series files (.ts)",
    "reference_models": "the PyTorch-made reference models (ONNX, weights .npz, samples with expected outputs)",
}


def prepared_photos(model, count: int, seed: int = 0):
    """[count, *input_shape] float32 as an image model's preprocessing makes them from photos of random 0..255
    pixels: what Session.judge and predict take from an image model (runtime Session._check_prepared)."""
    pre = model.preprocess
    pixels = np.random.default_rng(seed).integers(0, 256, (count, *model.input_shape)).astype(np.float32)
    mean = np.asarray(pre["mean"], np.float32).reshape(-1, 1, 1)
    return ((pixels * np.float32(pre["scale"]) - mean) / np.asarray(pre["std"], np.float32).reshape(-1, 1, 1))


def qr_code_text(image) -> str:
    """The text of the QR code in an image (an array as OpenCV reads it), by OpenCV's QR reader: an independent
    reader of what segno drew; "" when it finds none."""
    import cv2

    return cv2.QRCodeDetector().detectAndDecode(image)[0]


def need(path: Path) -> Path:
    """Skip the calling test when a file or folder of the shared data folder is absent (a user's clone),
    saying what it needs and how to point the tests at it."""
    if not path.exists():
        try:
            relative = path.resolve().relative_to(SHARED).as_posix()
        except ValueError:
            relative = None
        part = relative and next((key for key in SHARED_CONTENTS if relative == key or relative.startswith(key + "/")), None)
        what = f"{SHARED_CONTENTS[part]}, as {relative} in the shared data folder" if part else "a file of its own"
        pytest.skip(f"{path} is absent: this test needs {what}; set LNN_SHARED to a folder holding "
                    f"{relative or path.name} (now {SHARED}) to run it")
    return path


@pytest.fixture
def reference_models() -> Path:
    return need(REFERENCE_MODELS)


def gpu_cupy():
    """CuPy when it imports and sees a GPU; otherwise the calling test (or, called at import, the whole
    test module) is skipped with the reason."""
    cupy = pytest.importorskip("cupy")
    try:
        if cupy.cuda.runtime.getDeviceCount() < 1:
            pytest.skip("CuPy sees no GPU", allow_module_level=True)
    except Exception as err:                               # noqa: BLE001 - any CUDA failure means: no GPU here
        pytest.skip(f"CuPy sees no GPU ({err})", allow_module_level=True)
    return cupy


def runtime_devices() -> list:
    """numpy always; cpu (Numba) when lnn.runtime.cpu is there and imports."""
    try:
        importlib.import_module("lnn.runtime.cpu").BACKEND
    except (ImportError, AttributeError):
        return ["numpy"]
    return ["numpy", "cpu"]


def answers_in_threads(run, per_thread: list, expected: list, after=None) -> tuple:
    """Each list of inputs in per_thread run through `run` by a thread of its own, all started at once: (the
    (thread, call) pairs whose answer differed from expected[thread][call] (np.array_equal), the errors raised,
    and what after() returned in each thread once its calls were done). Fails a test whose threads do not finish
    within 120 s."""
    import threading

    import numpy as np

    wrong, errors, afterwards = [], [], []
    start = threading.Barrier(len(per_thread))

    def worker(t):
        try:
            start.wait()
            for c, x in enumerate(per_thread[t]):
                if not np.array_equal(run(x), expected[t][c]):
                    wrong.append((t, c))
            if after is not None:
                afterwards.append(after())
        except Exception as err:             # noqa: BLE001 - reported to the test
            errors.append(err)

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(len(per_thread))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert not any(thread.is_alive() for thread in threads), "a thread's calls did not finish"
    return wrong, errors, afterwards
