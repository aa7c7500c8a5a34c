"""Running one call on several cores: a plan step made of independent tasks, and the crew that runs them.

A `Parallel` step holds tasks (each a list of argument-free steps) that write disjoint parts of one
layer's output from scratch buffers of their own, so they may run at the same time, in any order,
on any thread, and give the same bytes. Called as a plain step it runs them one after the other (the
calling thread alone); `Crew.run` runs the first in the calling thread and the others on helper
threads (the kernels and BLAS release the GIL), and returns when all are done.

A crew's helpers wait on locks (no polling, no thread started per call); a hand-off costs tens of
microseconds, which is why backend.py splits only layers with enough work per task.
"""

from __future__ import annotations

import threading
import weakref


class Parallel:
    """A plan step of independent tasks [[step, ...], ...]."""

    def __init__(self, tasks: list):
        self.tasks = tasks

    def __call__(self) -> None:
        for task in self.tasks:
            run_steps(task)


def run_steps(steps) -> None:
    for step in steps:
        step()


def all_steps(steps: list):
    """Every step, those inside Parallel steps' tasks too."""
    for step in steps:
        if type(step) is Parallel:
            for task in step.tasks:
                yield from task
        else:
            yield step


def parallel_steps(tasks: list) -> list:
    """The steps that run `tasks`: the task itself when there is one, else one Parallel step."""
    return list(tasks[0]) if len(tasks) == 1 else [Parallel(tasks)]


def split_range(first: int, end: int, parts: int, align: int = 1) -> list:
    """[(start, stop), ...]: first..end cut into at most `parts` nearly equal runs whose inner bounds are
    multiples of `align` (from `first`); empty runs are left out."""
    units = -(-(end - first) // align)
    bounds = [first + min(units * i // parts * align, end - first) for i in range(parts + 1)]
    return [(start, stop) for start, stop in zip(bounds, bounds[1:]) if stop > start]


class Crew:
    """`helpers` daemon threads that run the tasks of Parallel steps beside the calling thread.

    One call at a time: `try_run` returns False, running nothing, when another thread's call holds
    the crew (that caller then runs its tasks itself: same results, its own core). The helpers end
    when the crew is garbage collected or closed."""

    def __init__(self, helpers: int, name: str = "lnn-cpu"):
        self._busy = threading.Lock()
        self._jobs = [_Slot() for _ in range(helpers)]
        self.threads = [threading.Thread(target=_serve, args=(slot,), name=f"{name}-{index}", daemon=True)
                        for index, slot in enumerate(self._jobs)]
        for thread in self.threads:
            thread.start()
        self._finalizer = weakref.finalize(self, _stop, self._jobs)

    @property
    def helpers(self) -> int:
        return len(self._jobs)

    def try_run(self, function, *args) -> bool:
        """function(self, *args) while holding the crew, or False at once when it is busy."""
        if not self._busy.acquire(blocking=False):
            return False
        try:
            function(self, *args)
        finally:
            self._busy.release()
        return True

    def run(self, tasks: list) -> None:
        """Run each task (a list of steps), at most helpers + 1 of them, and wait for all; only while
        holding the crew (try_run)."""
        for slot, task in zip(self._jobs, tasks[1:]):
            slot.give(task)
        try:
            run_steps(tasks[0])
        finally:
            errors = [slot.wait() for slot in self._jobs[:len(tasks) - 1]]
        for error in errors:
            if error is not None:
                raise error

    def run_steps(self, steps: list) -> None:
        """A plan's steps, each Parallel one spread over the crew."""
        for step in steps:
            if type(step) is Parallel:
                self.run(step.tasks)
            else:
                step()

    def close(self) -> None:
        self._finalizer()


class _Slot:
    """One helper's hand-off: `go` is released when a task is given, `done` when it has run."""

    def __init__(self):
        self.go = threading.Lock()
        self.done = threading.Lock()
        self.go.acquire()
        self.done.acquire()
        self.task = None
        self.error = None

    def give(self, task) -> None:
        self.task = task
        self.go.release()

    def wait(self):
        self.done.acquire()
        error, self.error = self.error, None
        return error


def _serve(slot: _Slot) -> None:
    while True:
        slot.go.acquire()
        task, slot.task = slot.task, None
        if task is None:
            return
        try:
            run_steps(task)
        except BaseException as error:        # noqa: BLE001 - handed to the calling thread, which raises it
            slot.error = error
        slot.done.release()


def _stop(slots: list) -> None:
    for slot in slots:
        slot.give(None)
