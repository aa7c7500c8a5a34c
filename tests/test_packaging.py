"""The user's top-level folders are installed as lnn.* (editable and wheel), and the runtime stays light."""

import os
import subprocess
import sys
import zipfile

import pytest

from conftest import REPO


def run_python(code: str, cwd, env=None) -> str:
    result = subprocess.run([sys.executable, "-c", code], cwd=cwd, env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    return result.stdout


def test_installed_package_maps_the_folders_under_lnn(tmp_path):
    # Run from elsewhere so the repo root is not on sys.path: only the installed mapping can answer.
    out = run_python("import lnn, lnn.formats.ops, lnn.runtime, lnn.runtime.cpu, lnn.tools; print(lnn.__file__)", tmp_path)
    assert out.strip().startswith(str(REPO)), out


@pytest.mark.parametrize("generic_name", ["formats", "runtime", "tools", "train", "tests"])
def test_generic_folder_names_are_not_top_level_modules(tmp_path, generic_name):
    out = run_python(f"import importlib.util; print(importlib.util.find_spec({generic_name!r}))", tmp_path)
    assert out.strip() == "None"


def test_import_runtime_pulls_in_no_gpu_compiler_or_training_code(tmp_path):
    out = run_python("import sys, lnn, lnn.runtime; "
                     "print(sorted(m for m in sys.modules if m.split('.')[0] in ('cupy', 'numba', 'cv2', 'torch') "
                     "or m.startswith('lnn.train')))", tmp_path)
    assert out.strip() == "[]"


@pytest.mark.slow
def test_wheel_installs_the_same_mapping(tmp_path):
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(tmp_path), str(REPO)],
                   check=True, capture_output=True, timeout=300)
    wheel = next(tmp_path.glob("lnn-*.whl"))
    names = zipfile.ZipFile(wheel).namelist()
    assert {"lnn/formats/SPEC.md", "lnn/runtime/cpu/__init__.py", "lnn/models/tomato_leaf.bin"} <= set(names)
    assert not any(name.startswith(("formats/", "runtime/", "tests/", "tools/")) for name in names), names
    # Installed into a folder put first on the path, ahead of this checkout's editable install.
    target = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-index", "--target", str(target), str(wheel)],
                   check=True, timeout=300)
    env = {**os.environ, "PYTHONPATH": str(target)}
    out = run_python("import lnn, lnn.formats.binfile, lnn.runtime.reference; print(lnn.__file__)", tmp_path, env)
    assert out.strip() == str(target / "lnn" / "__init__.py")
