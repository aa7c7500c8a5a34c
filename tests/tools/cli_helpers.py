"""Helpers shared by the command tests: run a command as a process, check one-line errors, export reference models."""

import contextlib
import errno
import io
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import EXAMPLES, REFERENCE_MODELS, need


def run_command(module: str, *args, cwd=None) -> subprocess.CompletedProcess:
    """Run `python -m lnn.tools.<module> args...` as its own process (exit codes, stderr as a person sees them)."""
    return subprocess.run([sys.executable, "-m", f"lnn.tools.{module}", *map(str, args)], cwd=cwd,
                          capture_output=True, text=True, timeout=120)


def assert_one_line_error(stderr: str, prog: str, *fragments: str) -> None:
    """stderr is exactly one `prog: error: ...` line, naming each fragment, with no traceback."""
    lines = stderr.strip().splitlines()
    assert len(lines) == 1, stderr
    assert lines[0].startswith(f"{prog}: error: "), stderr
    assert "Traceback" not in stderr
    for fragment in fragments:
        assert fragment in lines[0], (fragment, lines[0])


@pytest.fixture(scope="session")
def reference_bin(tmp_path_factory):
    """name -> path of that reference model exported by lnn-export (fp32), made once per test session."""
    from lnn.tools.export import main as export_main

    made = {}

    def make(name: str):
        if name not in made:
            weights = need(REFERENCE_MODELS / f"{name}.weights.npz")
            out = tmp_path_factory.mktemp("bins") / f"{name}.bin"
            with contextlib.redirect_stdout(io.StringIO()):      # keep its summary out of the tests' capsys
                assert export_main([str(EXAMPLES / "reference" / f"{name}.json"), "--weights", str(weights),
                                    "-o", str(out)]) == 0
            made[name] = out
        return made[name]

    return make


class _FillingFile:
    """A file object whose first write stores half of its data, then fails as a full disk does."""

    def __init__(self, file):
        self._file = file

    def write(self, data):
        self._file.write(data[:len(data) // 2])
        self._file.flush()
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    def __getattr__(self, name):
        return getattr(self._file, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self._file.close()


@contextlib.contextmanager
def full_disk():
    """Inside the block, the disk fills up half-way through any file written through os.fdopen
    (atomic_output's temporary files)."""
    real_fdopen = os.fdopen
    os.fdopen = lambda *args, **kwargs: _FillingFile(real_fdopen(*args, **kwargs))
    try:
        yield
    finally:
        os.fdopen = real_fdopen


def temporaries(folder) -> list:
    """The temporary files atomic_output left in `folder` (there must be none)."""
    return sorted(p.name for p in Path(folder).iterdir() if p.name.endswith(".tmp"))
