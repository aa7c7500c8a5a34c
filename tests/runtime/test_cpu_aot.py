"""The CPU backend's kernels compiled ahead of time (runtime/cpu/aot.py), as the packaged lnn-field uses them.

Slow (the two tests on the compiled module): compiles the kernel module with numba.pycc (about 8 s on 2 cores), then runs the CPU backend's own
tests on it in a fresh process with LNN_CPU_KERNELS=aot (only the Numba-cache tests are left out: the
compiled kernels have no cache). The argument check in front of every compiled kernel is what makes a
wrong call a TypeError instead of memory corruption, so it is tested with wrong arrays.
"""

import os
import subprocess
import sys

import pytest

from conftest import REPO


def test_every_kernel_has_a_signature_or_is_inline_only():
    pytest.importorskip("numba")
    from lnn.runtime.cpu.aot import jit_kernels, signatures

    assert set(jit_kernels()) == set(signatures())


def test_missing_compiler_needs_both_c_and_cxx(monkeypatch):
    """numba.pycc compiles Numba's runtime as C++: gcc without g++ must skip the AOT tests, not error in them."""
    import sysconfig

    from lnn.runtime.cpu import aot

    if os.name == "nt":
        pytest.skip("MSVC is not looked up on PATH")
    present = os.path.basename(sys.executable)            # a command that is on PATH ...
    monkeypatch.setenv("PATH", os.path.dirname(sys.executable))
    monkeypatch.setenv("CC", present)
    monkeypatch.setenv("CXX", present)
    assert aot.missing_compiler() is None
    monkeypatch.setenv("CXX", "no-such-g++")                 # ... and one that is not
    assert aot.missing_compiler().startswith("no C++ compiler: 'no-such-g++' is not on PATH")
    monkeypatch.setenv("CC", "no-such-gcc -pthread")
    assert aot.missing_compiler().startswith("no C compiler: 'no-such-gcc' is not on PATH")
    # Without $CXX, Python's own build setting (sysconfig's CXX) names the compiler.
    monkeypatch.setenv("CC", present)
    monkeypatch.delenv("CXX")
    real = sysconfig.get_config_var
    monkeypatch.setattr(sysconfig, "get_config_var",
                        lambda name: "absent-c++ -pthread" if name == "CXX" else real(name))
    assert aot.missing_compiler().startswith("no C++ compiler: 'absent-c++'")


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    pytest.importorskip("numba.pycc", reason="numba.pycc is not available")
    from lnn.runtime.cpu.aot import compile_kernels, missing_compiler

    if missing_compiler():
        pytest.skip(missing_compiler())
    folder = tmp_path_factory.mktemp("aot")
    compile_kernels(folder)
    return folder


def aot_env(folder):
    inherited = [os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else []    # lnn when not installed
    return {**os.environ, "LNN_CPU_KERNELS": "aot",
            "PYTHONPATH": os.pathsep.join([str(folder), str(REPO / "tests"), *inherited])}


@pytest.mark.slow
def test_cpu_backend_tests_pass_on_the_compiled_kernels(compiled):
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-k", "not cache",
                             "tests/runtime/test_cpu_backend.py"],
                            cwd=REPO, env=aot_env(compiled), capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]
    assert " passed" in result.stdout and "failed" not in result.stdout


CHECKS = """
import sys, numpy as np
import lnn
from lnn.tools.infer import DEFAULT_MODEL
from lnn.runtime.cpu.photo_measures import grey_copy_statistics
from lnn.runtime.cpu.pool import global_avg_pool
session = lnn.load(DEFAULT_MODEL, device="cpu")
x = np.random.default_rng(0).standard_normal((2, *session.input_shape)).astype(np.float32)
numpy_session = lnn.load(DEFAULT_MODEL, device="numpy")
print("max error", float(np.abs(session.run(x) - numpy_session.run(x)).max()))
photo = np.random.default_rng(1).integers(0, 256, (200, 220, 3), dtype=np.uint8)
mine, theirs = session.check_photo(photo).measures, numpy_session.check_photo(photo).measures
print("photo measures agree", all(abs(mine[k] - theirs[k]) <= 1e-5 * max(1.0, abs(theirs[k])) for k in theirs))
try:
    grey_copy_statistics(np.zeros((4, 4), np.float32), np.zeros((4, 4, 3), np.float32), np.zeros(256, np.int64),
                         np.zeros(3))
    print("accepted float32 photo")
except TypeError as err:
    print("refused float32 photo -", err)
print("numba imported", "numba" in sys.modules or "llvmlite" in sys.modules)
import threading
sys.setswitchinterval(30)               # no forced switch: the main thread runs only where the worker drops the GIL
big, sums, done = np.ones((2, 64, 1 << 18), np.float32), np.empty((2, 64), np.float32), threading.Event()
def pools():
    for _ in range(10):
        global_avg_pool(big, sums)
    done.set()
worker, turns = threading.Thread(target=pools), 0
worker.start()
while not done.wait(0.001):
    turns += 1
worker.join()
print("main thread turns during the kernels", turns)
good = np.ones((2, 3, 5), np.float32)
for name, bad in [("float64", good.astype(np.float64)), ("rank 2", good[0]), ("strided", good[:, :, ::2]),
                  ("list", good.tolist())]:
    try:
        global_avg_pool(bad, np.empty((2, 3), np.float32))
        print("accepted", name)
    except TypeError as err:
        print("refused", name, "-", err)
"""


@pytest.mark.slow
def test_compiled_kernels_match_numpy_without_numba_refuse_wrong_arrays_and_drop_the_gil(compiled):
    result = subprocess.run([sys.executable, "-c", CHECKS], env=aot_env(compiled), capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr
    assert float(result.stdout.split("max error")[1].split()[0]) <= 1e-4
    assert "numba imported False" in result.stdout
    assert result.stdout.count("refused") == 5 and "accepted" not in result.stdout, result.stdout
    assert "C-contiguous float32 array of rank 3" in result.stdout
    assert "C-contiguous uint8 array of rank 3" in result.stdout            # the compiled photo measures' BGR
    assert "photo measures agree True" in result.stdout
    assert int(result.stdout.split("main thread turns during the kernels")[1].split()[0]) >= 20   # they drop the GIL


def test_a_missing_compiled_module_makes_the_cpu_device_one_clear_error(tmp_path):
    code = ("import lnn\nfrom lnn.tools.infer import DEFAULT_MODEL\n"
            "try:\n    lnn.load(DEFAULT_MODEL, device='cpu')\nexcept lnn.LnnError as err:\n    print(err)\n")
    result = subprocess.run([sys.executable, "-c", code], env=aot_env(tmp_path), capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr
    assert "the cpu backend cannot load" in result.stdout and "lnn_cpu_kernels" in result.stdout, result.stdout


# --------------------------------------------------------------------------- the JIT as the fallback (issue 16)

HOOK = REPO / "packaging" / "hooks" / "rthook_lnn_field.py"
AFTER_HOOK = """
import os, runpy, sys
import numpy as np
os.environ.pop("LNN_CPU_KERNELS", None)
runpy.run_path(sys.argv[1])                        # what the frozen app runs before any of its code
import lnn
from lnn.runtime.cpu import jit
from lnn.tools.infer import DEFAULT_MODEL
session = lnn.load(DEFAULT_MODEL, device="auto")
x = np.random.default_rng(0).standard_normal((1, *session.input_shape)).astype(np.float32)
error = float(np.abs(session.run(x) - lnn.load(DEFAULT_MODEL, device="numpy").run(x)).max())
print(os.environ.get("LNN_CPU_KERNELS"), jit.KERNELS, session.device, error < 1e-4)
"""


def run_after_hook(env) -> list:
    result = subprocess.run([sys.executable, "-c", AFTER_HOOK, str(HOOK)], env=env, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    return result.stdout.split()


def test_without_the_compiled_kernels_the_app_falls_back_to_the_jit():
    pytest.importorskip("numba")
    env = {key: value for key, value in os.environ.items() if key != "LNN_CPU_KERNELS"}
    assert run_after_hook(env) == ["None", "jit", "cpu", "True"]


@pytest.mark.slow
def test_with_the_compiled_kernels_the_app_takes_them(compiled):
    assert run_after_hook(aot_env(compiled)) == ["aot", "aot", "cpu", "True"]


def test_a_numba_without_pycc_is_one_clear_build_error(monkeypatch, tmp_path):
    pytest.importorskip("numba")
    from lnn.runtime.cpu.aot import compile_kernels

    monkeypatch.setitem(sys.modules, "numba.pycc", None)          # as a Numba that dropped it
    with pytest.raises(RuntimeError, match=r"has no numba.pycc .* app extra pins"):
        compile_kernels(tmp_path)


def test_the_app_extra_pins_numba_below_the_first_release_that_could_drop_pycc():
    import re

    pin = re.search(r'^app = \[.*"numba>=[\d.]+,<([\d.]+)"', (REPO / "pyproject.toml").read_text(), re.MULTILINE)
    assert pin, "pyproject.toml's app extra pins numba with an upper bound"
    assert f"numba<{pin.group(1)}" in (REPO / "packaging" / "BUILD.md").read_text(encoding="utf-8")
