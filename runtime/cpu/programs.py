"""A plan's helper tasks as one compiled program: a crew helper runs its share of a whole call without the GIL; and
one thread's steps as one compiled call.

Why: a Parallel step handed to a helper through Python (parallel.Crew.run) makes the helper take the GIL
to start its task and again between its steps, while the caller takes it between its own steps; whichever
thread then wants the GIL while the other holds it sleeps, and on the 2-core VM woke 30-80 us later. The
bundled model's 2-thread plan has 7 split steps. With its helper's tasks run by a program instead (by hand,
9 interleaved rounds of 200 calls, one process, the same bytes): tomato 1.04 against 1.70 ms a call (the VM
in a noisy minute; one thread 1.87), leaf_cnn 0.349 against 0.492 (0.588), leaf_cnn224 2.64 against 2.76.

What: `build(steps, helpers)` writes the source of one function, `serve`, that holds, for each split step
and helper, a call of each of that helper's steps' kernels in order: through the address of the code Numba
compiled for exactly those argument types (jit.call_at; the machine code a call from Python runs, so the
same bytes), the step's integer and float arguments written into the source, its arrays passed once in one
tuple. A helper lent the program (`HelperProgram.lend`, at each split step that finds it away) loops in it: it
waits for the caller to post a step, claims it, runs it, says it is done; it leaves after PAUSE_NS
and parallel.LINGER_NS more without a post, or when the crew gives that helper other work (like linear.py's
serve_chain). While a call holds the crew, its waits pause the CPU between reads (jit.spin_pause), and after
the call for PAUSE_NS more (a call right after, back to back, finds it there), then yield it
(sched_yield), so that a thread woken on that CPU runs. A yield under Linux's EEVDF scheduler hands the CPU to
any other runnable thread there for its time slice: when every wait yielded, a helper beside a busy process (a
loop on its CPU) lost that CPU at each wait for its next step, and the caller ran most of its steps itself
(beside a nice-10 loop, the bundled model's helper ran 16% of its steps, 3.3-4.6 ms a 2-thread call against
1.2 alone; with the pauses 99.9%, 1.45-1.50 ms; by hand, the 2-core VM). A crew with more threads than its
usable cores never pauses (a pausing helper would keep a CPU from another of the call's threads for its time
slice). The caller (`run_step`) posts a step to each helper with a task in it, runs its own task, then claims
each posted task itself if its helper has not (a helper that is away, late or busy elsewhere costs time, never
an answer: the caller runs the same steps through Python), else waits until it is done; an error raised in a
helper's task is raised in the caller (the call fails; nothing waits for good).

Where every step of the plan is a kernel a program can call, a second source holds `run_call`, the caller's
side of a whole call: each split step posted to the helpers with a task in it, the caller's task, then each
post claimed (and run there) or waited for, and the steps of one thread between them, with no Python in
between (`HelperProgram.run_all`; Crew.run_steps takes it for exactly the plan's steps). The machinery of
tomato's 7 split steps, with kernels that do nothing, took 39 us a call through Python (by hand); tomato's
2-thread call 1.19-1.28 ms against 1.23-1.34 (by hand, alternating in one process). Compiled the first time
(an empty program cache, the kernels cached), tomato's serve took 1.7 s and its run_call 2.1 (in serve's source,
the two took 7.2 s), leaf_cnn's 1.3 and 1.5 (by hand).

One thread's steps (`build_steps_program`, a StepsProgram): a plan run on one thread (a one-thread backend, each
unit of a batch split by images, a split plan whose crew another call holds) called its kernels one by one from
Python, taking the GIL back after each. Beside a thread running Python (lnn-serve's event loop and photo decoding
beside its inference), each take waits for that thread to let go, up to the switch interval (5 ms): the bundled
model's batch of 8 (116 steps) took 616 ms a call beside a Python loop against 16 alone (by hand). From such a
plan's PROGRAM_AT_RUN'th run, its steps run in one compiled call, `run_step_range`, which reads each step from
tables: its kernel's address, its integers and floats, and its arrays as addresses with shapes and strides (a
tuple of typed lists of the arrays took 39 us to pass, a call). For each step it calls the compiled caller of the
step's kind (the types of its arguments: `step_caller`), which makes the arrays' views (jit.array_at, without a
reference to the owner) and calls the kernel (call_at). Nothing of a plan is compiled, only a caller per kind,
which every plan and model with such steps shares: the bundled model's 11 kinds took 3.2 s to compile the first
time, 0.08 s to load from the cache in a new process (by hand), and its batch-1 plan then needed none more; a
source per plan with its values written in (as `serve`'s) took 8.5 s to compile for its batch of 8 alone. A step
that is no kernel (np.matmul, a Claimed chain, any Python function) runs from Python between the program's runs.

Control words, CONTROL_WORDS per helper: STEP (the split step posted), POSTED (steps posted), CLAIMED
(steps claimed, by the helper or by the caller), DONE (steps finished), SERVING (1 from the lending until
the helper's program has returned), RAN (steps the helper ran).

A step is in a program only when it is a partial of a Numba kernel that returns nothing, with ints, floats,
bools and arrays as arguments (or np.copyto, as `copy_into`); a plan with any other split step gets no
program (the Python hand-off runs it), and so does a plan with a Claimed step (the helper serves that). The
source is content-addressed, written once into the kernel cache folder (jit.CACHE_DIR/lnn-programs), so
Numba caches the compiled program as it does a kernel file; the addresses are an argument, not constants,
so a new process passes its own. By hand, the bundled model's program compiled in 2.5 s the first time.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import math
import os
import sys
import tempfile
import types
import warnings
from functools import partial
from pathlib import Path

import numpy as np

from lnn.runtime.cpu import cache, jit
from lnn.runtime.cpu.jit import (CACHE_ENABLED, call_at, compare_and_swap, compiled_address, kernel, load_acquire,
                                 sched_yield, store_release)
from lnn.runtime.cpu.parallel import LINGER_NS, Claimed, Parallel, run_steps

AOT_SIGNATURES = {"copy_into": None, "post": None, "claim_or_wait": None, "run_step_range": None}   # the JIT's only

PAUSE_NS = 100_000       # after a call, a helper's waits pause the CPU this long (monotonic clock) before they yield it
AVAILABLE = call_at is not None            # the JIT, where the crew spins (not the compiled app; not Windows)
STEP, POSTED, CLAIMED, DONE, SERVING, RAN = range(6)
CONTROL_WORDS = 6
PROGRAM_DIR = "lnn-programs"               # in the kernel cache folder
# claim_or_wait's answers
HELPER_DID_IT, CALLER_RUNS_IT, HELPER_FAILED = range(3)
CLAIMED_STEP = 1 << 20                     # run_call's answer: a step's position times this, + claimed helpers' mask
VIEW_DIMS = 8                              # a one-thread program's arrays have at most this many dimensions


@kernel
def copy_into(dst, src):
    """np.copyto(dst, src) of arrays of one shape, as a program's step."""
    dst[...] = src


@kernel
def post(control, base, step):
    """Posts split step `step` to the helper whose words start at control[base]; its number (POSTED after)."""
    control[base + STEP] = step
    posted = control[base + POSTED] + 1
    store_release(control, base + POSTED, posted)
    return posted


@kernel
def claim_or_wait(control, base, posted):
    """The caller's end of post `posted` to a helper: CALLER_RUNS_IT when the caller claimed it (the helper
    had not: its DONE is set here, as the helper would), else, once the helper has finished it,
    HELPER_DID_IT, or HELPER_FAILED when the helper left its program without finishing it (an error)."""
    if compare_and_swap(control, base + CLAIMED, posted - 1, posted):
        store_release(control, base + DONE, posted)
        return CALLER_RUNS_IT
    while load_acquire(control, base + DONE) != posted:
        if load_acquire(control, base + SERVING) == 0:
            if load_acquire(control, base + DONE) == posted:
                break
            store_release(control, base + DONE, posted)      # the next post starts from a consistent count
            return HELPER_FAILED
        sched_yield()
    return HELPER_DID_IT


class HelperProgram:
    """The compiled `serve` of one plan, the arrays and kernel addresses it is called with, and its control
    words; `index[id(step)]` is a Parallel step's number in it. `run_call`, where every step of the plan is a
    kernel a program can call: the caller's side of a whole call, compiled too (`run_all`), else None."""

    def __init__(self, serve, arrays: tuple, run_call, call_arrays: tuple, addresses: np.ndarray, index: dict,
                 helpers: int, steps: list):
        self.serve, self.arrays, self.addresses, self.index = serve, arrays, addresses, index
        self.run_call, self.call_arrays, self.steps = run_call, call_arrays, steps
        self.control = np.zeros(CONTROL_WORDS * helpers, np.int64)
        self.errors = [None] * helpers         # what a helper's program raised, for the caller to raise
        # compiled (or loaded) here, and the caller's kernels too: compiled at the first post, they kept the
        # caller longer than a helper waits for a post (LINGER_NS), and the helper had left
        serve(np.zeros(1, np.int64), 0, -1, self.control, 0, 0, 0, addresses, arrays)
        scratch = np.zeros(CONTROL_WORDS, np.int64)
        claim_or_wait(scratch, 0, post(scratch, 0, 0))
        if run_call is not None:             # (only with the JIT, so Numba is there)
            from numba import typeof
            run_call.compile(tuple(typeof(value) for value in (self.control, addresses, call_arrays, 0)))

    def runs(self, steps: list) -> bool:
        """Whether run_all computes exactly these steps."""
        return self.run_call is not None and steps is self.steps

    def run_all(self, crew) -> None:
        """The plan's whole call: its steps in order in the compiled run_call, which posts each split step to the
        helpers, runs the caller's task, then claims or waits for theirs (and runs the steps of one thread),
        with no Python between them (the machinery alone, tomato's 7 split steps of kernels that do nothing:
        39 us a call through run_step, by hand). The program is lent first to each helper that is away; a
        helper's task the caller claimed (that helper away or late) runs here, and run_call goes on after it."""
        self.lend(crew)
        resume = 0
        while True:
            try:
                answer = self.run_call(self.control, self.addresses, self.call_arrays, resume)
            except BaseException:
                self._settle()
                raise
            if answer == -1:
                return
            if answer <= -2:
                helper = -2 - answer
                error, self.errors[helper] = self.errors[helper], None
                raise RuntimeError(f"a helper thread's part of a layer failed: {error!r}") from error
            position, claimed = divmod(answer, CLAIMED_STEP)
            for helper, task in enumerate(self.steps[position].tasks[1:]):
                if claimed >> helper & 1:
                    run_steps(task)
            resume = position + 1

    def _settle(self) -> None:
        """After a kernel of the caller's raised inside run_call: each post still open is waited for (or claimed
        and left undone: the call fails anyway), so that no helper still works on this call's buffers."""
        for helper in range(len(self.errors)):
            base = CONTROL_WORDS * helper
            posted = self.control[base + POSTED]
            if self.control[base + DONE] != posted:
                claim_or_wait(self.control, base, posted)
            self.errors[helper] = None

    def lend(self, crew) -> None:
        """Gives the program to each helper that is not serving it (Crew.lend_to); its waits pause only where the
        crew's threads have a usable core each (Crew.fits)."""
        for helper in range(len(self.control) // CONTROL_WORDS):
            base = CONTROL_WORDS * helper
            if not self.control[base + SERVING]:
                self.control[base + SERVING] = 1
                crew.lend_to(helper, functools.partial(self._serve, helper=helper,
                                                       pause_ns=PAUSE_NS if crew.fits else 0))

    def _serve(self, crew_flags, given: int, taken: int, *, helper: int, pause_ns: int) -> None:
        """A helper's lent task: the program until it returns; what it raised is kept for the caller."""
        try:
            self.serve(crew_flags, given, taken, self.control, helper, LINGER_NS, pause_ns, self.addresses,
                       self.arrays)
        except BaseException as error:        # noqa: BLE001 - raised by the caller waiting for this task
            self.errors[helper] = error
        finally:
            self.control[CONTROL_WORDS * helper + SERVING] = 0

    def run_step(self, step: Parallel, crew) -> None:
        """The Parallel step `step` with its helpers' tasks posted to the program, lent first to each helper that
        is away (also one that left during this call: its wait for a post ran out as the caller was held up)."""
        self.lend(crew)
        number = self.index[id(step)]
        posts = [(helper, CONTROL_WORDS * helper, task) for helper, task in enumerate(step.tasks[1:]) if task]
        posts = [(helper, base, task, post(self.control, base, number)) for helper, base, task in posts]
        try:
            run_steps(step.tasks[0])
        finally:
            failed = []
            for helper, base, task, posted in posts:
                answer = claim_or_wait(self.control, base, posted)
                if answer == CALLER_RUNS_IT:
                    run_steps(task)
                elif answer == HELPER_FAILED:
                    failed.append(self.errors[helper])
                    self.errors[helper] = None
        for error in failed:
            raise RuntimeError(f"a helper thread's part of a layer failed: {error!r}") from error


def native_call(step):
    """(the address of its kernel's compiled code for call_at, arguments) of a step a program can call, or None."""
    function, args = getattr(step, "func", None), getattr(step, "args", None)
    if args is None or step.keywords:
        return None
    if function is np.copyto and len(args) == 2:
        function = copy_into
    if not all(isinstance(value, (np.ndarray, bool, int, float, np.bool_, np.integer, np.floating)) for value in args):
        return None
    if any(isinstance(value, (float, np.floating)) and not math.isfinite(value) for value in args):
        return None
    address = compiled_address(function, args)
    return None if address is None else (address, args)


def _literal(value) -> str:
    """Source text of a scalar argument, typed as numba.typeof types it (a Python int is int64, a float
    float64)."""
    if isinstance(value, (bool, np.bool_)):
        return f"np.bool_({bool(value)})"
    if isinstance(value, int):
        return f"np.int64({value})"
    if isinstance(value, float):
        return f"np.float64({value!r})"
    return f"np.{value.dtype.name}({value.item()!r})"


def build(steps: list, helpers: int):
    """The HelperProgram of a plan's steps with `helpers` helpers, or None where there is nothing to post or a
    split step's task cannot be called from one (see the module's header), or where it could not be built (a
    warning says why: the plan's Python hand-off still gives every answer)."""
    split = [step for step in steps if type(step) is Parallel]
    if not AVAILABLE or not split or any(type(step) is Claimed for step in steps):
        return None
    try:
        return _built(steps, split, helpers)
    except Exception as error:            # noqa: BLE001 - a program only saves time; the plan runs without it
        warnings.warn(f"lnn: the CPU backend's helper program could not be built ({error!r}); its split layers are "
                      f"handed to the helper threads through Python instead", RuntimeWarning, stacklevel=2)
        return None


def _built(steps: list, split: list, helpers: int):
    addresses = []

    def calls(task, arrays: list, array_names: dict) -> list | None:
        """The source lines calling a task's steps, or None where one is no kernel a program can call; the arrays
        they pass are added to `arrays` (a0, a1, ... in the source: array_names, by id)."""
        lines = []
        for part in task:
            call = native_call(part)
            if call is None:
                return None
            address, arguments = call
            names = []
            for value in arguments:
                if isinstance(value, np.ndarray):
                    if id(value) not in array_names:
                        array_names[id(value)] = f"a{len(arrays)}"
                        arrays.append(value)
                    names.append(array_names[id(value)])
                else:
                    names.append(_literal(value))
            lines.append(f"call_at(addresses[{len(addresses)}], ({', '.join(names)},))")
            addresses.append(address)
        return lines

    branches, arrays, array_names = [], [], {}
    for number, step in enumerate(split):
        for helper, task in enumerate(step.tasks[1:helpers + 1]):
            lines = calls(task, arrays, array_names)
            if lines is None:
                return None
            if lines:
                branches.append((helper, number, lines))
    index = {id(step): number for number, step in enumerate(split)}
    call_arrays, call_array_names = [], {}
    whole_call = _caller_source(steps, index, helpers, partial(calls, arrays=call_arrays, array_names=call_array_names))
    serve = _compiled(_source(branches, len(arrays)), "serve")
    run_call = None if whole_call is None else _compiled(_call_source(whole_call, len(call_arrays)), "run_call")
    return HelperProgram(serve, tuple(arrays), run_call, tuple(call_arrays), np.array(addresses, np.int64), index,
                         helpers, steps)


def _caller_source(steps: list, index: dict, helpers: int, calls) -> list | None:
    """The body of run_call for the plan's steps from step `resume` on: each split step posted to the helpers with
    a task in it, the caller's task, then each post claimed or waited for; the other steps in between. Returns
    -1 when done; -2 - h when helper h's task failed in its program; or, where the caller claimed helper tasks
    (their helper away or late), position * CLAIMED_STEP + the mask of those helpers, for run_all to run them
    and call again from the next step (that case is rare; their calls are not compiled in a second time). None
    where a step cannot be called from a program, or a split step has more tasks than the crew's threads."""
    body = []
    for position, step in enumerate(steps):
        if type(step) is not Parallel:
            lines = calls([step])
            if lines is None:
                return None
            body += [f"if answer == -1 and resume <= {position}:", *(f"    {line}" for line in lines)]
            continue
        own = calls(step.tasks[0])
        if own is None or len(step.tasks) > helpers + 1:
            return None
        posted = [(helper, CONTROL_WORDS * helper) for helper, task in enumerate(step.tasks[1:]) if task]
        block = [f"posted{helper} = post(control, np.int64({base}), np.int64({index[id(step)]}))"
                 for helper, base in posted]
        block += own + ["failed = np.int64(-1)", "claimed = np.int64(0)"]
        for helper, base in posted:
            block += [f"answer = claim_or_wait(control, np.int64({base}), posted{helper})",
                      f"if answer == {CALLER_RUNS_IT}:", f"    claimed |= np.int64({1 << helper})",
                      f"elif answer == {HELPER_FAILED}:", f"    failed = np.int64({helper})"]
        block += ["if failed >= 0:", "    answer = -2 - failed",
                  "elif claimed:", f"    answer = np.int64({position * CLAIMED_STEP}) + claimed",
                  "else:", "    answer = np.int64(-1)"]
        body += [f"if answer == -1 and resume <= {position}:", *(f"    {line}" for line in block)]
    return body


class StepsProgram:
    """One thread's run of plan steps in one compiled call, without the GIL: `run_step_range` calls, for each step, the
    compiled caller of its kind (the types of its arguments: `step_caller`), which reads the step's arguments from
    the tables (its integers and floats; its arrays, each an address with its shape and strides, made views by
    jit.array_at) and calls the step's kernel at its address. Nothing of a plan is compiled: a kind's caller serves
    every step of that kind in every plan and model. `segments` are what a plan runs in order: a run of such steps
    as one call of `run(first, end)`, any other step (a Python function, a Claimed step) as itself. The arrays are
    the plan's, which outlives the program."""

    def __init__(self, tables: tuple, arrays: list):
        self.tables, self.arrays = tables, arrays
        self.segments = []

    def run(self, first: int, end: int) -> None:
        run_step_range(first, end, *self.tables)


@kernel
def run_step_range(first, end, callers, addresses, ints, floats, views):
    """Steps first..end-1 of a StepsProgram's tables: each step's kind's caller, given the step's kernel address."""
    for step in range(first, end):
        call_at(callers[step], (addresses[step], step, ints, floats, views))


def build_steps_program(steps: list):
    """The StepsProgram of one thread's steps (run in order), or None where none is a kernel a program can call
    (see the module's header) or it could not be built (a warning says why: the steps still run one by one from
    Python)."""
    if not AVAILABLE:
        return None
    try:
        return _built_steps(steps)
    except Exception as error:            # noqa: BLE001 - a program only saves time; the steps run without it
        warnings.warn(f"lnn: the CPU backend's one-thread program could not be built ({error!r}); its steps run "
                      f"one by one from Python instead", RuntimeWarning, stacklevel=2)
        return None


def _built_steps(steps: list):
    from numba import typeof

    native = []                               # (step, kernel address, arguments, their numba types) or (step,)
    for step in steps:
        call = native_call(step)
        if call is None or any(isinstance(value, np.ndarray) and value.ndim > VIEW_DIMS for value in call[1]):
            native.append((step,))
        else:
            native.append((step, *call, tuple(typeof(value) for value in call[1])))
    if all(len(entry) == 1 for entry in native):
        return None
    width = max(len(entry[2]) for entry in native if len(entry) > 1)
    arrays, positions = [], {}                # the steps' arrays, and id(array) -> its row of `views`
    rows, segments = [], []                   # segments: (first, end) of a run of rows, or a step run from Python
    for step, *call in native:
        if not call:
            segments.append(step)
            continue
        address, arguments, kind = call
        ints, floats = [0] * width, [0.0] * width
        for column, value in enumerate(arguments):
            if isinstance(value, np.ndarray):
                if id(value) not in positions:
                    positions[id(value)] = len(arrays)
                    arrays.append(value)
                ints[column] = positions[id(value)]
            elif isinstance(value, (float, np.floating)):
                floats[column] = float(value)
            else:
                ints[column] = int(value)
        if segments and type(segments[-1]) is tuple:
            segments[-1] = (segments[-1][0], len(rows) + 1)
        else:
            segments.append((len(rows), len(rows) + 1))
        rows.append((kind, address, ints, floats))
    views = np.zeros((max(1, len(arrays)), 1 + 2 * VIEW_DIMS), np.int64)    # address, shape, strides (bytes)
    for row, array in zip(views, arrays):
        row[0] = array.ctypes.data
        row[1:1 + array.ndim], row[1 + VIEW_DIMS:1 + VIEW_DIMS + array.ndim] = array.shape, array.strides
    kinds, addresses, ints, floats = zip(*rows)
    ints, floats = np.array(ints, np.int64), np.array(floats, np.float64)
    callers = np.array([step_caller(kind) for kind in kinds], np.int64)
    program = StepsProgram((callers, np.array(addresses, np.int64), ints, floats, views), arrays)
    program.segments = [partial(program.run, *segment) if type(segment) is tuple else segment for segment in segments]
    return program


@functools.cache
def step_caller(kind: tuple) -> int:
    """The address of the compiled caller of steps of this kind (their arguments' numba types), for run_step_range:
    it takes (kernel address, step, ints, floats, views: int64, int64 and the three 2-D tables) and calls the kernel
    with the step's arguments read from the tables. Compiled once per kind (a kind's source, named by its digest,
    is cached as a kernel is)."""
    from numba import types

    array_types = sorted({value for value in kind if isinstance(value, types.Array)}, key=str)

    def argument(column: int, value_type) -> str:
        if isinstance(value_type, types.Array):
            row, dims = f"views[ints[step, {column}]", range(value_type.ndim)
            return (f"array_at({row}, 0], ({''.join(f'{row}, {1 + d}], ' for d in dims)}), "
                    f"({''.join(f'{row}, {1 + VIEW_DIMS + d}], ' for d in dims)}), T{array_types.index(value_type)})")
        if isinstance(value_type, types.Boolean):
            return f"ints[step, {column}] != 0"
        return f"np.{value_type}({'floats' if isinstance(value_type, types.Float) else 'ints'}[step, {column}])"

    source = STEP_CALLER.format(
        kernels=cache.kernel_sources_digest(), kind=", ".join(map(str, kind)),
        types="\n".join(f"T{number} = types.Array(from_dtype(np.dtype('{array_type.dtype}')), {array_type.ndim}, "
                        f"{array_type.layout!r}, "
                        f"readonly={not array_type.mutable}, aligned={array_type.aligned})"
                        for number, array_type in enumerate(array_types)),
        arguments="".join(f"{argument(column, value_type)}, " for column, value_type in enumerate(kind)))
    tables = (np.zeros((1, 1), np.int64), np.zeros((1, 1), np.float64), np.zeros((1, 1), np.int64))
    return compiled_address(_compiled(source, "call_step"), (np.int64(0), np.int64(0), *tables))


SERVE = """\
# lnn helper program (runtime/cpu/programs.py; kernel sources {kernels})
import numpy as np
from lnn.runtime.cpu.jit import call_at, compare_and_swap, load_acquire, monotonic_ns, sched_yield, spin_pause, store_release


def serve(crew_flags, given, taken, control, helper, linger_ns, pause_ns, addresses, arrays):
    ({arrays}) = arrays
    base = {words} * helper
    hot = crew_flags.shape[0] - 1
    idle_since = np.int64(-1)
    while load_acquire(crew_flags, given) == taken:
        posted = load_acquire(control, base + {posted})
        claimed = load_acquire(control, base + {claimed})
        if posted == claimed or not compare_and_swap(control, base + {claimed}, posted - 1, posted):
            if pause_ns and load_acquire(crew_flags, hot):
                idle_since = -1                     # the pauses and the linger count from the call's end
                spin_pause()
                continue
            now = monotonic_ns()
            if idle_since < 0:
                idle_since = now
            elif now - idle_since >= pause_ns + linger_ns:
                break
            if now - idle_since < pause_ns:
                spin_pause()
            else:
                sched_yield()
            continue
        step = control[base + {step}]
{calls}
        control[base + {ran}] += 1
        store_release(control, base + {done}, posted)
        idle_since = -1
"""

STEP_CALLER = """\
# lnn step caller (runtime/cpu/programs.py; kernel sources {kernels}) for steps of the kind: {kind}
import numpy as np
from numba import from_dtype, types
from lnn.runtime.cpu.jit import array_at, call_at

{types}


def call_step(address, step, ints, floats, views):
    call_at(address, ({arguments}))
"""

RUN_CALL = """\
# lnn caller program (runtime/cpu/programs.py; kernel sources {kernels})
import numpy as np
from lnn.runtime.cpu.jit import call_at
from lnn.runtime.cpu.programs import claim_or_wait, post


def run_call(control, addresses, arrays, resume):
    ({arrays}) = arrays
    answer = np.int64(-1)
{body}
    return answer
"""


def _source(branches: list, array_count: int) -> str:
    """SERVE with each helper's calls of each split step: branches [(helper, step number, [call, ...])]."""
    calls = []
    for helper in sorted({helper for helper, _, _ in branches}):
        calls.append(f"        if helper == {helper}:")
        steps = [(number, lines) for owner, number, lines in branches if owner == helper]
        for index, (number, lines) in enumerate(steps):
            calls.append(f"            {'elif' if index else 'if'} step == {number}:")
            calls += [f"                {line}" for line in lines]
    return SERVE.format(kernels=cache.kernel_sources_digest(), arrays="".join(f"a{i}, " for i in range(array_count)),
                        words=CONTROL_WORDS, posted=POSTED, claimed=CLAIMED, step=STEP, ran=RAN, done=DONE,
                        calls="\n".join(calls))


def _call_source(body: list, array_count: int) -> str:
    """RUN_CALL with the lines of _caller_source, a module of its own (see the module's header)."""
    return RUN_CALL.format(kernels=cache.kernel_sources_digest(), arrays="".join(f"a{i}, " for i in range(array_count)),
                           body="\n".join(f"    {line}" for line in body))


@functools.cache
def _compiled(source: str, function: str):
    """The @kernel `function` of `source` (once per source in a process): from a file named by its digest in the
    kernel cache folder (Numba caches it there), or, without a writable cache, compiled from memory."""
    name = f"lnn_program_{hashlib.sha256(source.encode()).hexdigest()[:24]}"
    module = None
    if CACHE_ENABLED:
        try:
            module = _imported(name, _written(Path(jit.CACHE_DIR) / PROGRAM_DIR / f"{name}.py", source))
        except OSError:
            module = None                    # (the cache folder turned unwritable: compiled from memory below)
    if module is None:
        module = types.ModuleType(name)
        exec(compile(source, name, "exec"), vars(module))        # noqa: S102 - our own generated source
    sys.modules[name] = module        # Numba's cached program names its module, imported again when loaded
    return kernel(getattr(module, function))


def _written(path: Path, source: str) -> Path:
    """path, holding `source` (written once, whole: another process may read it at any time)."""
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", encoding="utf-8", dir=path.parent, suffix=".tmp", delete=False) as file:
            file.write(source)
        os.replace(file.name, path)
    return path


def _imported(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
