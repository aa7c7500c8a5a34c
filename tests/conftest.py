"""Shared test fixtures: where ../shared lies (or $LNN_SHARED: the GPU machine gets a copy), and
skipping cleanly when it does not."""

import importlib
import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
SHARED = Path(os.environ.get("LNN_SHARED") or REPO.parent / "shared").resolve()
REFERENCE_MODELS = SHARED / "reference_models"
DATA = SHARED / "data"
REFERENCE_NAMES = ["mnist_mlp", "mnist_cnn", "leaf_cnn", "leaf_cnn224"]
EXAMPLES = REPO / "examples"


def need(path: Path) -> Path:
    """Skip the calling test when a file or folder of ../shared is absent (a user's clone)."""
    if not path.exists():
        pytest.skip(f"{path} is absent (../shared is only beside the project's own checkouts)")
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
