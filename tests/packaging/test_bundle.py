"""The packaged lnn-field (PyInstaller, one folder) answers from a read-only install and any working
directory, and keeps Numba's compiled kernels in the per-user cache, so the second start is warm.

Slow: builds the bundle with packaging/build.sh (about 40 s on the 2-core CI machine) into a tmp folder.
Skips when PyInstaller is not installed; run it with
    pip install -e '.[app]' && python -m pytest tests/packaging/test_bundle.py -s
"""

import os
import shutil
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import EXAMPLES, REPO

pytestmark = pytest.mark.slow
EXE = "lnn-field.exe" if os.name == "nt" else "lnn-field"


@pytest.fixture(scope="module")
def read_only_install(tmp_path_factory):
    pytest.importorskip("PyInstaller", reason="PyInstaller is not installed (pip install -e '.[app]')")
    work = tmp_path_factory.mktemp("bundle")
    env = {**os.environ, "PYTHON": sys.executable, "LNN_BUILD_DIR": str(work / "build"), "LNN_DIST_DIR": str(work / "dist")}
    subprocess.run(["bash", str(REPO / "packaging" / "build.sh")], env=env, check=True, capture_output=True, timeout=900)
    install = work / "install"
    shutil.copytree(work / "dist" / "lnn-field", install, symlinks=True)
    subprocess.run(["chmod", "-R", "a-w", str(install)], check=True)
    yield install
    subprocess.run(["chmod", "-R", "u+w", str(install)], check=True)   # so pytest can clean up


def run_cli(install, cwd, env, *args):
    started = time.perf_counter()
    result = subprocess.run([str(install / EXE), "--cli", *args], cwd=cwd, env=env, capture_output=True, text=True,
                            timeout=300)
    return result, time.perf_counter() - started


def kernel_files(cache):
    return {p: p.stat().st_mtime_ns for p in cache.rglob("*.nbc")}


def test_frozen_cli_from_a_read_only_install_twice_second_warm(read_only_install, tmp_path):
    elsewhere = tmp_path / "elsewhere"                  # the working directory, not writable either
    elsewhere.mkdir()
    elsewhere.chmod(stat.S_IRUSR | stat.S_IXUSR)
    user_cache = tmp_path / "user-cache"                # a user whose cache is empty: the first run compiles
    env = {k: v for k, v in os.environ.items() if k not in ("NUMBA_CACHE_DIR", "LNN_CACHE_DIR")}
    env["XDG_CACHE_HOME"] = str(user_cache)
    leaf = EXAMPLES / "leaves" / "late_blight.jpg"
    try:
        first, first_s = run_cli(read_only_install, elsewhere, env, "--device", "cpu", str(leaf))
        assert first.returncode == 0, first.stderr
        assert first.stdout.startswith(f"{leaf}: Late blight ("), first.stdout
        assert "warning" not in first.stderr.lower(), first.stderr
        compiled = kernel_files(user_cache / "lnn" / "numba")
        assert compiled, "no kernels were cached in the per-user folder"

        second, second_s = run_cli(read_only_install, elsewhere, env, "--device", "cpu", str(leaf))
        assert second.returncode == 0, second.stderr
        assert second.stdout == first.stdout
        assert kernel_files(user_cache / "lnn" / "numba") == compiled, "the second run compiled again"
        print(f"\nfrozen lnn-field --cli --device cpu: first run {first_s:.2f} s (empty cache), second {second_s:.2f} s (warm)")
        assert second_s < first_s
    finally:
        elsewhere.chmod(stat.S_IRWXU)


def test_frozen_cli_reports_a_bad_file_in_one_line(read_only_install, tmp_path):
    result, _ = run_cli(read_only_install, tmp_path, None, str(tmp_path / "missing.jpg"))
    assert result.returncode == 1
    assert result.stderr.strip().count("\n") == 0 and "no such file" in result.stderr, result.stderr
