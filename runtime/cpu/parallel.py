"""Running one call on several cores: a plan step made of independent tasks, and the crew that runs them.

A `Parallel` step holds tasks (each a list of argument-free steps) that write disjoint parts of one
layer's output from scratch buffers of their own, so they may run at the same time, in any order,
on any thread, and give the same bytes. Called as a plain step it runs them one after the other (the
calling thread alone); `Crew.run` runs the first in the calling thread and the others on helper
threads (the kernels and BLAS release the GIL), and returns when all are done.

A crew's helpers block on locks between calls (no thread started per call); during a call they and
the caller wait for each other by spinning (Crew), and a hand-off still costs tens of microseconds,
which is why backend.py splits only layers with enough work per task, and keeps a split only where
it timed faster than one thread.

A `Claimed` step (linear.py's chain of small linear layers) hands work out without the GIL: its kernel
claims blocks with atomic counters, and the crew's first helper, lent to it (`Crew.lend`), waits for its
calls inside a kernel of its own and claims blocks too; whoever is there computes them.

A plan whose helpers' tasks are all Numba kernels gets, from its second crew call on, a program
(programs.py): each helper, lent it (`Crew.lend_to`), runs its tasks of every Parallel step inside one
compiled kernel, posted to it by the caller (`Crew.run_steps`), and takes no GIL during the call.
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import os
import sys
import threading
import weakref

import numpy as np

from lnn.runtime.cores import usable_cores
from lnn.runtime.cpu.jit import hand_off, spin_while_equal

# How long a helper keeps spinning after a call (the next one, back to back, finds it awake), in nanoseconds of the
# monotonic clock: a count of yields measured once at start made a process that started beside a busy one (every
# yield then lasting a time slice) linger one yield for life
LINGER_NS = 500_000
# CPython's GIL switch interval while a crew call runs (the default is 5 ms; see `short_switch_interval`)
SWITCH_INTERVAL_SECONDS = 5e-5
# Crew.run's hand-off: the caller waits without the GIL at most this long for the helpers to start their tasks,
# then this much more (at least one yield) while each drops the GIL again in its first kernel
HAND_OFF_WAIT_NS = 50_000
HAND_OFF_MARGIN_NS = 4_000
# A scratch buffer's worker (backend.Plan._new_buffer) when the tasks of several threads write and read it; else the
# index of the task that uses it (the thread that runs that task)
SHARED = "shared"
# Crew._flags: per helper its counts of tasks given, done and started (at these offsets), then HOT (the last)
GIVEN, DONE, STARTED = range(3)
FLAGS_PER_HELPER = 3


class Parallel:
    """A plan step of independent tasks [[step, ...], ...]."""

    def __init__(self, tasks: list):
        self.tasks = tasks

    def __call__(self) -> None:
        for task in self.tasks:
            run_steps(task)


class Claimed:
    """A plan step whose kernel shares out its own work: `run()` (argument-free) computes the call in the
    calling thread, claiming its blocks one at a time with atomic counters, and every block no other thread
    has claimed; `serve(crew_flags, given, taken)` is a helper's loop (no GIL, no Python between calls) that
    joins each new call of this step and claims blocks too, until it has waited LINGER_NS for one or
    the crew has given that helper other work (crew_flags[given] is no longer `taken`, its count of
    tasks). `flags[SERVED]` is 1 while a helper is in that loop. Called as a plain step it runs alone;
    Crew.run_steps lends it a helper first. The hand-off costs no GIL: a Parallel step's helper takes the
    GIL to start its task, and on the 2-core VM that cost ~12 us a layer (mnist_mlp split over 2 threads by
    Parallel steps: 53 against 17 us)."""

    def __init__(self, run, serve, flags: np.ndarray):
        self.run, self.serve, self.flags = run, serve, flags

    def __call__(self) -> None:
        self.run()


SERVED = 1      # Claimed.flags[SERVED]: 1 while a helper serves the step


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
    when the crew is garbage collected or closed.

    Hand-offs: counters in `_flags` say how many tasks each helper was given, has started and has done. With the JIT
    kernels, while `try_run` holds the crew (HOT set), a helper waits for its next task, and the caller
    for a helper's "done", by spinning on them without the GIL (jit.spin_while_equal, which yields the
    CPU between reads), so that no thread sleeps between two layers of a call: on the 2-core VM a
    sleeping thread took 30-80 us to wake (an idle vCPU halts), a hand-off of an empty task through
    locks alone 100-120 us in a model's process, and the tomato model had 9 split steps. `try_run`
    wakes the helpers when it starts; after its end they spin LINGER_NS more (a call right after
    finds them awake: 1.18 -> 1.28x on leaf_cnn, 1.30 -> 1.32 on tomato, 1.66 -> 1.69 on leaf_cnn224,
    2 threads / 1, interleaved), then block on their `go` lock again (an idle crew uses no CPU).
    A task is handed over without the GIL (`run`). During the call the GIL's switch interval is
    SWITCH_INTERVAL_SECONDS (`short_switch_interval`). A helper program's waits pause the CPU instead of
    yielding it where the crew `fits` (programs.py's header says why).
    Without the JIT (the app's compiled kernels have no spin intrinsics) the locks alone hand off."""

    def __init__(self, helpers: int, name: str = "lnn-cpu"):
        self._busy = threading.Lock()
        # flags: GIVEN, DONE, STARTED counts per helper, then HOT (1 while a call holds the crew)
        self._flags = np.zeros(FLAGS_PER_HELPER * helpers + 1, np.int64)
        self._jobs = [_Slot(self._flags, index) for index in range(helpers)]
        self.threads = [threading.Thread(target=_serve, args=(slot,), name=f"{name}-{index}", daemon=True)
                        for index, slot in enumerate(self._jobs)]
        for thread in self.threads:
            thread.start()
        self._finalizer = weakref.finalize(self, _stop, self._jobs)
        self._cpus = os.sched_getaffinity(0) if CURRENT_CPU is not None else set()
        self._helpers_off = None             # the CPU the helpers are kept off (the last caller's)
        # a usable core for each of the call's threads: their waits may keep their CPU (programs.py's pauses)
        self.fits = helpers + 1 <= usable_cores()

    @property
    def helpers(self) -> int:
        return len(self._jobs)

    def try_run(self, function, *args) -> bool:
        """function(self, *args) while holding the crew, or False at once when it is busy."""
        if not self._busy.acquire(blocking=False):
            return False
        try:
            if spin_while_equal is None:
                function(self, *args)
            else:
                self._flags[-1] = 1
                self._keep_helpers_off_my_cpu()
                for slot in self._jobs:
                    slot.wake()               # the helpers wake while the call's first steps run
                with short_switch_interval():
                    function(self, *args)
        finally:
            self._flags[-1] = 0
            self._busy.release()
        return True

    def _keep_helpers_off_my_cpu(self) -> None:
        """Let the helpers run on any of the process's CPUs but the calling thread's (Linux only).

        A helper blocked between calls is woken onto a CPU of the scheduler's choice, and after an idle
        gap that was often the caller's own: then both ran on one core until the scheduler moved one. The
        bundled model on 2 threads, calls 20 ms apart on the 2-core VM: in 6 of 12 the helper's tasks ran
        on the caller's CPU, 3.3-4.8 ms a call, against 2.0-3.2 on the other CPU and 1.7 back to back (by
        hand, each task's CPU from sched_getcpu). Kept off it, split calls 20 ms apart took 2.76 against
        3.28 ms (tomato), 5.92 against 7.49 (leaf_cnn224), 1.53 against 1.73 (leaf_cnn); back to back 1.48
        against 1.67, 4.81 against 4.97, 0.63 against 0.68 (by hand, medians of 4-5 interleaved rounds, the
        busy VM). The caller itself is never pinned; the helpers are re-pinned only when the caller's CPU
        has changed since the last call (one sched_setaffinity each)."""
        if not self._cpus:
            return
        cpu = CURRENT_CPU()
        if cpu == self._helpers_off:
            return
        others = self._cpus - {cpu}
        if not others:
            return
        try:
            for thread in self.threads:
                os.sched_setaffinity(thread.native_id, others)
        except OSError:                      # the process's CPUs changed under it: stop pinning
            self._cpus = set()
            return
        self._helpers_off = cpu

    def run(self, tasks: list) -> None:
        """Run each task (a list of steps), at most helpers + 1 of them, and wait for all; only while
        holding the crew (try_run).

        With the JIT the helpers' tasks are handed off without the GIL (jit.hand_off), and the caller starts
        its own task once they have started theirs: a helper that found the caller holding the GIL as it
        took its task slept until the caller's first kernel dropped it, and woke 15-30 us later on the
        2-core VM, each Parallel step (two tasks of 27 us on 2 threads: 53-64 us a step, 34-38 with the
        hand-off; by hand)."""
        given = list(zip(self._jobs, tasks[1:]))
        if hand_off is None:
            numbers = [slot.give(task) for slot, task in given]
        else:
            for slot, _ in given:
                slot.giving.acquire()
            try:
                for slot, task in given:
                    slot.tasks.append((task, False))
                    slot.wake()                  # a helper blocked on its lock takes it when it wakes
                hand_off(self._flags, len(given), FLAGS_PER_HELPER, GIVEN, STARTED, HAND_OFF_WAIT_NS, HAND_OFF_MARGIN_NS)
                numbers = [int(self._flags[slot.given]) for slot, _ in given]
            finally:
                for slot, _ in given:
                    slot.giving.release()
        try:
            run_steps(tasks[0])
        finally:
            errors = [slot.wait(number) for (slot, _), number in zip(given, numbers)]
        for error in errors:
            if error is not None:
                raise error

    def run_steps(self, steps: list, held: bool = True, program=None) -> None:
        """A plan's steps, each Parallel one spread over the crew when this call holds it (try_run; else the
        calling thread runs its tasks): its helpers' tasks posted to the plan's `program` (programs.py) where
        it has them, else handed over here; each Claimed one with a helper lent to it (holding or not). A program
        that runs the whole call runs it (programs.HelperProgram.run_all)."""
        if held and program is not None and program.runs(steps):
            program.run_all(self)
            return
        for step in steps:
            if type(step) is Parallel and held:
                if program is not None and id(step) in program.index:
                    program.run_step(step, self)
                else:
                    self.run(step.tasks)
            elif type(step) is Claimed:
                self.lend(step)
                step.run()
            else:
                step()

    def lend(self, step: Claimed) -> None:
        """The first helper to serve a Claimed step (its loop runs on after this call, so that the next call
        finds it there), unless it serves one already; with the JIT only (the app's compiled kernels keep
        the GIL). Needs no hold on the crew: whoever is there claims the blocks."""
        if spin_while_equal is None or step.flags[SERVED] or self._jobs[0].lent:
            return
        self.lend_to(0, step.serve)

    def lend_to(self, helper: int, task) -> None:
        """Gives helper `helper` the lent task task(crew_flags, given, taken), which runs until crew_flags[given] is
        no longer `taken` (this gives it to the helper, which leaves a lent task it runs: the crew's next task
        for it) or it ends by itself (Crew.lend, programs.HelperProgram.lend)."""
        self._keep_helpers_off_my_cpu()
        self._jobs[helper].give(task, lent=True)

    def close(self) -> None:
        self._finalizer()


class _SwitchInterval:
    """The process's GIL switch interval, lowered while any crew call runs and restored after the last.

    Every plan step takes the GIL to call its kernel and drops it inside. A thread that wants the GIL
    while another holds it sleeps until it is dropped, and on the 2-core VM a sleeping thread took
    30-80 us to run again: by then the caller, whose steps run for 10-200 us each, often held it again,
    and the helper got it only when CPython forced a switch after the interval, 5 ms by default (a
    call's timeline on leaf_cnn224: the helper's conv1 task started 2.9 ms after the caller's ended,
    its task of conv4's products only after the caller's had ended). With 50 us, split plan against the one-thread plan,
    interleaved in one process, 8 rounds of 50 calls, twice: median 3.51/3.52 -> 3.44/3.34 ms on the
    bundled tomato model (one thread 4.88/4.56), 8.72/8.54 -> 8.65/8.38 on leaf_cnn224 (14.37/13.49),
    1.43/1.45 -> 1.31/1.29 on leaf_cnn (1.58/1.91); mean 3.60/4.08 -> 3.47/3.36, 9.73/8.84 -> 8.91/8.64,
    1.52/1.53 -> 1.36/1.25. 20 and 5 us were no better. Only with the JIT: compiled kernels that keep
    the GIL would just switch more often."""

    def __init__(self):
        self._lock = threading.Lock()
        self._calls = 0
        self._saved = None

    @contextlib.contextmanager
    def __call__(self):
        with self._lock:
            if self._calls == 0:
                self._saved = sys.getswitchinterval()
                sys.setswitchinterval(min(self._saved, SWITCH_INTERVAL_SECONDS))
            self._calls += 1
        try:
            yield
        finally:
            with self._lock:
                self._calls -= 1
                if self._calls == 0:
                    sys.setswitchinterval(self._saved)


short_switch_interval = _SwitchInterval()


def _current_cpu_function():
    """The C library's sched_getcpu (the CPU the calling thread runs on), where threads can also be pinned
    (Linux: os.sched_setaffinity); else None."""
    if not hasattr(os, "sched_setaffinity"):
        return None
    try:
        function = ctypes.CDLL(None).sched_getcpu
    except (OSError, AttributeError):
        return None
    function.restype, function.argtypes = ctypes.c_int, []
    return function


CURRENT_CPU = _current_cpu_function()


class _Slot:
    """One helper's hand-off. The state is in counters: flags[3i] counts the tasks given, flags[3i + 1]
    those done, flags[3i + 2] those started (read by the spinning waits and jit.hand_off), `finished` the
    tasks over (set before `done` is released); `go` is only a wake-up call for a blocked helper (released
    for a task, a wake-up or the stop, at most once pending), and so is `done` for a caller waiting for its
    task (released after each task, at most once pending: a wait reads `finished`)."""

    def __init__(self, flags: np.ndarray, index: int):
        self.go = threading.Lock()
        self.done = threading.Lock()
        self.go.acquire()
        self.done.acquire()
        self.tasks = collections.deque()     # (task, lent) given and not yet taken, in order
        self.giving = threading.Lock()      # a lent task may be given while a crew call gives one
        self.lent = False                   # a lent task (Crew.lend) is given and not over: nobody waits for it
        self.error = None
        self.finished = 0                   # tasks over, lent ones included (wait)
        self.stopped = False
        self.flags = flags
        self.given, self.done_at, self.started_at = (FLAGS_PER_HELPER * index + offset for offset in (GIVEN, DONE, STARTED))

    def give(self, task, lent: bool = False) -> int:
        """Gives the helper its next task; the task's number (the helper's count of tasks given)."""
        with self.giving:
            if lent:
                self.lent = True
            self.tasks.append((task, lent))
            self.flags[self.given] += 1
            number = int(self.flags[self.given])
        self.wake()
        return number

    def wake(self) -> None:
        release_once(self.go)

    def wait(self, number: int):
        """Waits until the helper has done task `number` (not a lent one: those release no `done`); what it raised.
        The spin ends when the helper's count of tasks done leaves number - 1 (it counts every task in order), then
        `finished` says it is over (`done` wakes the wait); `number` is the caller's own, not the count of tasks
        given now: another thread may have lent the helper a task since (Crew.lend).

        A KeyboardInterrupt meanwhile (Ctrl-C in the main thread) waits for the task too, and is then returned as
        its error, for Crew.run to raise once every helper is done: raised at once, it left the helper writing into
        the buffers of a call that had ended, and `done` released with nobody to take it, so the helper's next
        release raised RuntimeError, its thread ended, and every later call on the crew waited for it for ever."""
        interrupted = None
        while self.finished < number:
            try:
                while self.finished < number:         # (in the try: an interrupt may be raised at a loop's turn)
                    if spin_while_equal is not None:
                        spin_while_equal(self.flags, self.done_at, number - 1, -1, -1, 0, 0)
                    self.done.acquire()
            except KeyboardInterrupt as interrupt:
                interrupted = interrupt
        error, self.error = self.error, None
        return interrupted or error


def release_once(lock: threading.Lock) -> None:
    """A wake-up call on `lock` (a _Slot's `go` or `done`): released, or left so when one is already pending."""
    try:
        lock.release()
    except RuntimeError:        # a wake-up call already pending
        pass


def _serve(slot: _Slot) -> None:
    flags, hot = slot.flags, len(slot.flags) - 1
    seen = 0                 # tasks taken
    done = -1                # flags index of a "done" not yet stored: the spin stores it
    while not slot.stopped:
        if flags[slot.given] == seen:
            if spin_while_equal is not None and (flags[hot] or done >= 0):
                spin_while_equal(flags, slot.given, seen, hot, done, seen, LINGER_NS)
                done = -1
            if flags[slot.given] == seen:
                slot.go.acquire()
                continue
        if done >= 0:            # the next task was there already (a lent one, given by another thread): the last
            flags[done] = seen   # one's "done" is said before it is taken
            done = -1
        seen += 1
        task, lent = slot.tasks.popleft()
        flags[slot.started_at] = seen                 # Crew.run's caller waits for this (jit.hand_off)
        try:
            if lent:
                task(flags, slot.given, seen)       # it leaves when flags[given] is no longer `seen`
            else:
                run_steps(task)
        except BaseException as error:        # noqa: BLE001 - handed to the calling thread, which raises it
            slot.error = error                # (a lent task's: to the next call that waits for this helper)
        if lent:
            slot.lent = False
        slot.finished = seen
        if not lent:
            release_once(slot.done)
        if spin_while_equal is None:
            flags[slot.done_at] = seen
        else:
            done = slot.done_at


def _stop(slots: list) -> None:
    for slot in slots:
        slot.stopped = True
        slot.wake()
