"""The packaged lnn-field (PyInstaller, one folder) answers from a read-only install and any working
directory, with its CPU kernels compiled ahead of time: no Numba, LLVM or OpenCV inside, nothing compiled
or cached at run time, so the first start is as warm as the second; and the folder stays under 200 MB.

Slow: builds the bundle with packaging/build.sh (about 25 s on the 2-core CI machine) into a tmp folder.
Skips when PyInstaller is not installed; run it with
    pip install -e '.[app]' && python -m pytest tests/packaging/test_bundle.py -s
"""

import os
import shutil
import stat
import subprocess
import sys
import time

import pytest

from conftest import EXAMPLES, REPO

pytestmark = pytest.mark.slow
EXE = "lnn-field.exe" if os.name == "nt" else "lnn-field"
SIZE_LIMIT = 200e6          # bytes on disk (issue 7)


@pytest.fixture(scope="module")
def read_only_install(tmp_path_factory):
    pytest.importorskip("PyInstaller", reason="PyInstaller is not installed (pip install -e '.[app]')")
    from lnn.runtime.cpu.aot import missing_compiler

    if missing_compiler():
        pytest.skip(missing_compiler())
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


def disk_bytes(folder):
    return sum(p.lstat().st_blocks * 512 for p in [folder, *folder.rglob("*")])


def test_the_bundle_is_small_and_holds_compiled_kernels_not_numba_or_opencv(read_only_install):
    size = disk_bytes(read_only_install)
    print(f"\nbundle on disk: {size / 2**20:.0f} MiB ({size / 1e6:.0f} MB)")
    assert size < SIZE_LIMIT
    internal = read_only_install / "_internal"
    assert list(internal.glob("lnn_cpu_kernels*")), "the compiled kernels are missing"
    assert not [p.name for p in internal.iterdir() if p.name.split(".")[0] in ("numba", "llvmlite", "cv2")
                and p.is_dir() and not p.name.endswith(".dist-info")]


def test_the_bundle_holds_the_phones_menus_server(read_only_install):
    """The Phones menu imports lnn-serve's stack when it starts the server, not when the app starts: a bundle
    without it would say so only then, on the station."""
    from PyInstaller.archive.readers import CArchiveReader

    modules = set(CArchiveReader(str(read_only_install / EXE)).open_embedded_archive("PYZ.pyz").toc)
    wanted = {"lnn.tools.serve", "lnn.tools.serve_app", "uvicorn", "starlette", "multipart", "prometheus_client",
              "segno"}
    assert wanted <= modules, f"missing from the bundle: {sorted(wanted - modules)}"


def test_frozen_cli_from_a_read_only_install_twice_nothing_compiled(read_only_install, tmp_path):
    elsewhere = tmp_path / "elsewhere"                  # the working directory, not writable either
    elsewhere.mkdir()
    elsewhere.chmod(stat.S_IRUSR | stat.S_IXUSR)
    home = tmp_path / "home"                            # a new user: nothing cached anywhere
    home.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("NUMBA_CACHE_DIR", "LNN_CACHE_DIR", "PYTHONPATH")}
    env.update(XDG_CACHE_HOME=str(home / ".cache"), HOME=str(home))
    leaf = EXAMPLES / "leaves" / "late_blight.jpg"
    try:
        first, first_s = run_cli(read_only_install, elsewhere, env, "--device", "cpu", str(leaf))
        assert first.returncode == 0, first.stderr
        assert first.stdout.startswith(f"{leaf}: Late blight ("), first.stdout
        assert first.stderr == "", first.stderr
        second, second_s = run_cli(read_only_install, elsewhere, env, "--device", "cpu", str(leaf))
        assert second.returncode == 0, second.stderr
        assert second.stdout == first.stdout
        assert not list(home.rglob("*")), "the app wrote files for the user (nothing should be compiled or cached)"
        print(f"\nfrozen lnn-field --cli --device cpu: first run {first_s:.2f} s (new user), second {second_s:.2f} s")
    finally:
        elsewhere.chmod(stat.S_IRWXU)


def test_frozen_cli_reports_a_bad_file_in_one_line(read_only_install, tmp_path):
    result, _ = run_cli(read_only_install, tmp_path, None, str(tmp_path / "missing.jpg"))
    assert result.returncode == 1
    assert result.stderr.strip().count("\n") == 0 and "no such file" in result.stderr, result.stderr
