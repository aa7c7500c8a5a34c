"""One Session shared by threads: images per second on the Numba CPU backend, against a session per thread.

    python benchmarks/shared_session.py          (about half a minute)

The bundled tomato model, batch-1 calls on random-normal inputs (a server answering one photo per
request), CALLS calls in all, spread over 1 or 2 threads:
  - one thread, one session                  (the baseline),
  - 2 threads sharing one session            (lnn's plans are per thread: runtime/plans.py),
  - 2 threads with a session each            (the peer: what a caller had to do before),
and the same at batch 8. Every answer is checked against the single-thread one (bit-identical).
Writes the "shared_session" section of docs/BENCHMARKS.md.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "benchmarks"))
from report import machine_line, markdown_table, update_section  # noqa: E402

import lnn  # noqa: E402
from lnn.tools.infer import DEFAULT_MODEL  # noqa: E402

CALLS = 96
COMMAND = "python benchmarks/shared_session.py"


def images_per_second(sessions: list, inputs: list, expected: list) -> float:
    """Run inputs[i] on sessions[i % len(sessions)] from len(sessions) threads; check every answer."""
    threads = len(sessions)
    wrong = []
    start_together = threading.Barrier(threads + 1)

    def work(t):
        start_together.wait()
        for i in range(t, len(inputs), threads):
            if not np.array_equal(sessions[t].run(inputs[i]), expected[i]):
                wrong.append(i)

    workers = [threading.Thread(target=work, args=(t,)) for t in range(threads)]
    for worker in workers:
        worker.start()
    start_together.wait()
    start = time.perf_counter()
    for worker in workers:
        worker.join()
    seconds = time.perf_counter() - start
    assert not wrong, f"{len(wrong)} answers differ from one thread's"
    return sum(len(x) for x in inputs) / seconds


def main() -> None:
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")     # other work on the machine
    rows = []
    for batch in (1, 8):
        shared = lnn.load(DEFAULT_MODEL, device="cpu", threads=1)
        own = [shared, lnn.load(DEFAULT_MODEL, device="cpu", threads=1)]
        rng = np.random.default_rng(0)
        inputs = [rng.standard_normal((batch, *shared.input_shape)).astype(np.float32) for _ in range(CALLS // batch * 2)]
        expected = [shared.run(x) for x in inputs]            # also the warm-up (compile, plans of the main thread)
        for session in own:
            session.run(inputs[0])
        cases = [("1 thread, 1 session", [shared]), ("2 threads, 1 shared session", [shared, shared]),
                 ("2 threads, a session each (peer)", own)]
        for _ in range(2):                                     # the first round also plans the new threads' buffers
            measured = [(name, images_per_second(sessions, inputs, expected)) for name, sessions in cases]
        base = measured[0][1]
        rows += [(batch, name, f"{rate:.0f}", f"{rate / base:.2f}x") for name, rate in measured]
        print(*rows[-3:], sep="\n", flush=True)
    body = (f"## shared_session\n\nOne Session shared by threads (`{COMMAND}`): images per second on the Numba "
            f"CPU backend, bundled tomato model (threads=1 each), {CALLS}+ calls, every answer bit-identical to one "
            f"thread's. {machine_line()}; load average {load:.1f} when it started (other work on the machine "
            f"skews these figures).\n\n" + markdown_table(["batch", "threads / sessions", "images/s", "vs 1 thread"], rows))
    update_section("shared_session", body)


if __name__ == "__main__":
    main()
