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
    from lnn.runtime.cpu.aot import INLINE_ONLY, SIGNATURES, jit_kernels

    assert set(jit_kernels()) == set(SIGNATURES) | INLINE_ONLY


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
from lnn.runtime.cpu.pool import global_avg_pool
session = lnn.load(DEFAULT_MODEL, device="cpu")
x = np.random.default_rng(0).standard_normal((2, *session.input_shape)).astype(np.float32)
reference = lnn.load(DEFAULT_MODEL, device="numpy").run(x)
print("max error", float(np.abs(session.run(x) - reference).max()))
print("numba imported", "numba" in sys.modules or "llvmlite" in sys.modules)
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
def test_compiled_kernels_match_numpy_without_numba_and_refuse_wrong_arrays(compiled):
    result = subprocess.run([sys.executable, "-c", CHECKS], env=aot_env(compiled), capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr
    assert float(result.stdout.split("max error")[1].split()[0]) <= 1e-4
    assert "numba imported False" in result.stdout
    assert result.stdout.count("refused") == 4 and "accepted" not in result.stdout, result.stdout
    assert "C-contiguous float32 array of rank 3" in result.stdout


def test_a_missing_compiled_module_makes_the_cpu_device_one_clear_error(tmp_path):
    code = ("import lnn\nfrom lnn.tools.infer import DEFAULT_MODEL\n"
            "try:\n    lnn.load(DEFAULT_MODEL, device='cpu')\nexcept lnn.LnnError as err:\n    print(err)\n")
    result = subprocess.run([sys.executable, "-c", code], env=aot_env(tmp_path), capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr
    assert "the cpu backend cannot load" in result.stdout and "lnn_cpu_kernels" in result.stdout, result.stdout
