"""Helpers shared by the command tests: run a command as a process, check one-line errors, export reference models."""

import contextlib
import io
import subprocess
import sys

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
