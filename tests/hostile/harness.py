"""Run one hostile case in a child process with bounded memory and time, and judge what it printed.

Limits (the issue's targets): the child's address space is capped with RLIMIT_AS at MEMORY_LIMIT (Numba's
JIT, onnxruntime and OpenCV all start under it), its peak resident memory must stay under it too, and it
is killed, with its process group, after TIME_LIMIT_S. The peak is the rusage of a grandchild: a process's
ru_maxrss also takes in the address space it was forked from (the kernel records that one's peak at exec),
which here is the test runner's, so a small launcher process forks the command and reports its rusage. The thread-count variables
keep OpenBLAS and Numba from reserving address space per core on a many-core machine, and
MALLOC_ARENA_MAX keeps glibc from reserving 64 MiB per thread: both would count against RLIMIT_AS
without using memory. `file_size` caps the size of any file the child writes (RLIMIT_FSIZE, with
SIGXFSZ ignored, so a write past it fails with EFBIG): a full disk, cheaply.
"""

from __future__ import annotations

import json
import os
import re
import resource
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass

MEMORY_LIMIT = 1 << 30            # bytes: address space (RLIMIT_AS) and peak resident memory
TIME_LIMIT_S = 10
THREADS = str(min(2, os.cpu_count() or 1))
QUIET_THREADS = {"OPENBLAS_NUM_THREADS": THREADS, "OMP_NUM_THREADS": THREADS, "MKL_NUM_THREADS": THREADS,
                 "NUMBA_NUM_THREADS": THREADS, "MALLOC_ARENA_MAX": "2"}
MODULES = {"lnn-infer": "infer", "lnn-field": "field", "lnn-eval": "eval", "lnn-train": "train",
           "lnn-export": "export", "lnn-import": "import_onnx", "lnn-summary": "summary", "lnn-doctor": "doctor",
           "lnn-bench": "bench"}
SESSION_PROG = "lnn-session"      # the prefix the Session snippets below print LnnErrors with
SESSION_SNIPPET = """\
import sys
import numpy as np
import lnn
from lnn.formats.errors import LnnError
try:
{body}
except LnnError as err:
    print("{prog}: error: " + " ".join(str(err).split()), file=sys.stderr)
    sys.exit(1)
"""


@dataclass
class Outcome:
    returncode: int
    stdout: str
    stderr: str
    peak_rss: int                 # bytes
    seconds: float
    timed_out: bool


def command(prog: str, args: list) -> list:
    """The argv that runs one entry point: an lnn command as `python -m`, or a Session snippet."""
    if prog == SESSION_PROG:
        body = "\n".join(f"    {line}" for line in args)
        return [sys.executable, "-c", SESSION_SNIPPET.format(body=body, prog=SESSION_PROG)]
    return [sys.executable, "-m", f"lnn.tools.{MODULES[prog]}", *args]


# argv: the write end of a pipe, then the command. Forks it, waits, writes its peak (KiB) to the pipe, and ends as
# it ended (the same exit status, or killed by the same signal).
LAUNCHER = """
import os, signal, sys
pid = os.fork()
if pid == 0:
    os.close(int(sys.argv[1]))
    os.execv(sys.argv[2], sys.argv[2:])
_, status, usage = os.wait4(pid, 0)
os.write(int(sys.argv[1]), str(usage.ru_maxrss).encode())
if os.WIFSIGNALED(status):
    signal.signal(os.WTERMSIG(status), signal.SIG_DFL)
    os.kill(os.getpid(), os.WTERMSIG(status))
sys.exit(os.waitstatus_to_exitcode(status))
"""


def run_limited(argv: list, env: dict | None = None, cwd=None, file_size: int | None = None,
                seconds: float = TIME_LIMIT_S) -> Outcome:
    def limit():
        resource.setrlimit(resource.RLIMIT_AS, (MEMORY_LIMIT, MEMORY_LIMIT))
        if file_size is not None:
            signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
            resource.setrlimit(resource.RLIMIT_FSIZE, (file_size, file_size))

    child_env = {**os.environ, **QUIET_THREADS, **(env or {})}
    start = time.monotonic()
    peak_read, peak_write = os.pipe()
    executable = argv[0] if os.path.dirname(argv[0]) else shutil.which(argv[0]) or argv[0]
    proc = subprocess.Popen([sys.executable, "-c", LAUNCHER, str(peak_write), executable, *argv[1:]],
                            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env=child_env, cwd=cwd, preexec_fn=limit, start_new_session=True, pass_fds=(peak_write,))
    os.close(peak_write)
    captured = {}

    def drain(name, pipe):
        captured[name] = pipe.read().decode("utf-8", "replace")

    readers = [threading.Thread(target=drain, args=item) for item in (("out", proc.stdout), ("err", proc.stderr))]
    for reader in readers:
        reader.start()
    timed_out = threading.Event()

    def kill():
        timed_out.set()
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    timer = threading.Timer(seconds, kill)
    timer.start()
    _, status, _ = os.wait4(proc.pid, 0)
    seconds = time.monotonic() - start
    timer.cancel()
    proc.returncode = os.waitstatus_to_exitcode(status)
    try:
        os.killpg(proc.pid, signal.SIGKILL)              # anything it left behind, holding the pipes open
    except (ProcessLookupError, PermissionError):
        pass
    for reader in readers:
        reader.join()
    with os.fdopen(peak_read, "rb") as pipe:
        peak_kib = pipe.read().decode() or "0"         # nothing: the launcher was killed (timed out)
    return Outcome(proc.returncode, captured["out"], captured["err"], int(peak_kib) * 1024, seconds,
                   timed_out.is_set())


def _reject_constant(name: str):
    raise ValueError(f"{name} is not JSON")


def json_lines(stdout: str) -> list:
    """Every stdout line parsed as strict JSON (NaN and Infinity refused); an invalid line fails the test."""
    parsed = []
    for line in stdout.splitlines():
        try:
            parsed.append(json.loads(line, parse_constant=_reject_constant))
        except ValueError as err:
            raise AssertionError(f"not a JSON line ({err}): {line[:300]!r}") from None
    return parsed


CHATTY = ("lnn-eval", "lnn-train")   # say what they are doing on stderr ("decoding 8 images ...") before any error
RAW_OUTPUT = re.compile(r"^\s*(\[ ?(WARN|ERROR|INFO)\b|[\w.]*(Error|Exception|error)\b:?|File \")")


def stderr_lines(prog: str, stderr: str) -> tuple[list, list]:
    """-> (the `prog: error: ...` lines, the lines that should not be there). What should not: a Python
    exception or a library's own log line anywhere; from any command but lnn-eval and lnn-train, any other
    line that is not a warning."""
    errors, stray = [], []
    for line in (line for line in stderr.splitlines() if line.strip()):
        if line.startswith(f"{prog}: error: "):
            errors.append(line)
        elif RAW_OUTPUT.match(line) or not (prog in CHATTY or "warning" in line.lower()):
            stray.append(line)
    return errors, stray
