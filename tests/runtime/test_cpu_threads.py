"""One image split over threads (runtime/cpu/backend.py, parallel.py) gives the one-thread answer.

Each conv (im2col, Winograd, pooled, odd sizes) and linear layer is forced to split (task_flops = 0)
at 2 and 3 threads and compared with the same model at one thread (1e-5, the issue's bound) and the
NumPy reference; the split must really happen (Parallel steps with as many tasks). threads="auto" is
the process's usable cores, and the choice is reported (Session, lnn-infer --verbose and --json).
"""

from __future__ import annotations

import json
import os
import sys
import time

import numpy as np
import pytest

from conftest import REPO, answers_in_threads, runtime_devices
from lnn.formats.binfile import build_metadata, encode_bin, parse_bin_bytes, read_bin
from lnn.formats.model import parse_model
from lnn.runtime import Session, resolve_threads, usable_cores
from lnn.runtime.reference import NumpyBackend

sys.path.insert(0, str(REPO / "benchmarks"))
from report import busy_seconds, cpu_seconds  # noqa: E402  (benchmarks/report.py: /proc's CPU times)
from lnn.tests.model_weights import random_weights

pytestmark = pytest.mark.skipif("cpu" not in runtime_devices(), reason="the Numba backend is not available")

SPLIT_TOLERANCE = 1e-5


def conv(out_channels, kernel_size=3, **attrs):
    return {"type": "conv2d", "out_channels": out_channels, "kernel_size": kernel_size, **attrs}


CASES = {
    "conv_im2col_pool": ([3, 23, 19], [conv(8, padding=1, activation="relu"), {"type": "maxpool2d", "kernel_size": 2}]),
    # more tiles than weights (C·O < (C + O)·tiles): Winograd cut by tile rows
    "conv_winograd_odd_rows": ([16, 13, 11], [conv(24, padding=1, algorithm="winograd", activation="relu")]),
    "conv_winograd_rows_pool": ([16, 24, 20], [conv(16, padding=1, algorithm="winograd", activation="relu"),
                                               {"type": "maxpool2d", "kernel_size": 2}]),
    "conv_stride2_3x3pool": ([5, 17, 15], [conv(12, stride=2, padding=1, activation="relu"),
                                           {"type": "maxpool2d", "kernel_size": 3, "stride": 2, "padding": 1}]),
    # more output channels than positions (Winograd: tiles): cut by output channels
    "conv_winograd_channels_pool": ([16, 8, 8], [conv(64, padding=1, algorithm="winograd", activation="relu"),
                                                 {"type": "maxpool2d", "kernel_size": 2}]),
    "conv_im2col_channels": ([8, 4, 5], [conv(48, padding=1, algorithm="im2col", activation="relu")]),
    # the same by "auto": direct where the narrow tiles run (conv2d.narrow_tiles_pay), cut by output channels
    "conv_thin_channels": ([8, 4, 5], [conv(48, padding=1, activation="relu")]),
    "conv_depthwise_channels": ([32, 9, 7], [conv(32, groups=32, padding=1, activation="relu")]),
    "conv_chain_then_linear": ([4, 12, 12], [conv(16, padding=1, activation="relu"), conv(16, padding=1),
                                             {"type": "flatten"}, {"type": "linear", "out_features": 97,
                                                                   "activation": "relu"},
                                             {"type": "linear", "out_features": 80},
                                             {"type": "linear", "out_features": 9}]),     # narrow: linear_dots
}


def split_backend(model, weights, threads):
    from lnn.runtime.cpu import BACKEND

    backend = BACKEND(model, weights, threads=threads)
    backend.task_flops = 0                  # split every conv and linear layer, however small
    return backend


def splittable(layers) -> list:
    """The conv and linear layers that can be cut into parts: a linear layer of fewer than 32 outputs
    is one block of 16 (split_range's alignment), left whole as one fused kernel."""
    from lnn.runtime.cpu.linear import LinearLayer

    return [layer for layer in layers if hasattr(layer, "flops")
            and not (isinstance(layer, LinearLayer) and layer.out_shape[0] <= 16)]


def split_layers(layers, plan) -> list:
    """The layers the plan cuts into parts: Parallel steps, or blocks of a linear chain (a Claimed step,
    given to the chain's first layer, whose layout says each of its layers' blocks)."""
    from lnn.runtime.cpu.parallel import Claimed, Parallel

    found = []
    for index, (layer, (first, end)) in enumerate(zip(layers, plan.layer_steps)):
        steps = plan.steps[first:end]
        if any(type(step) is Parallel for step in steps):
            found.append(layer)
        for step in steps:
            if type(step) is Claimed:
                layout = step.run.args[5]
                found += [chained for chained, blocks in zip(layers[index:], layout[:, 7]) if blocks >= 2]
    return found


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("threads", [2, 3])
def test_a_split_image_gives_the_one_thread_answer(case, threads):
    from lnn.runtime.cpu.parallel import Parallel

    input_shape, layers = CASES[case]
    model = parse_model({"input_shape": input_shape, "layers": layers})
    weights = random_weights(model, np.random.default_rng(7))
    one, split = split_backend(model, weights, 1), split_backend(model, weights, threads)
    for batch in (1, 2):                     # batch 2 is under MIN_SPLIT_FLOPS: its layers split too
        x = np.random.default_rng(batch).standard_normal((batch, *input_shape)).astype(np.float32)
        expected = one.run(x).copy()
        got = split.run(x)
        np.testing.assert_allclose(got, expected, rtol=0, atol=SPLIT_TOLERANCE)
        np.testing.assert_allclose(got, NumpyBackend(model, weights).run(x), rtol=0, atol=1e-4)
        plan = split._plan(batch, threads)
        assert split_layers(split.layers, plan) == splittable(split.layers), \
            "every conv and linear layer should have been split"
        assert all(len(step.tasks) >= 2 for step in plan.steps if type(step) is Parallel)
    layer = split.layers[0]
    cuts = [channels for _, channels in layer._parts(1, input_shape[2] + 2, threads)]
    if "_channels" in case:                  # cut by output channels, not by rows
        assert all(channels != (0, layer.conv_shape[0]) for channels in cuts)
    if "_rows" in case:                      # cut by rows: every task all of the channels
        assert len(cuts) == threads and all(channels == (0, layer.conv_shape[0]) for channels in cuts)


def test_tasks_write_disjoint_outputs_in_any_order():
    """The tasks of a split layer may run in any order (or on any thread) and give the same bytes."""
    from lnn.runtime.cpu.parallel import Parallel

    input_shape, layers = CASES["conv_chain_then_linear"]
    model = parse_model({"input_shape": input_shape, "layers": layers})
    backend = split_backend(model, random_weights(model, np.random.default_rng(3)), 3)
    x = np.random.default_rng(4).standard_normal((1, *input_shape)).astype(np.float32)
    expected = backend.run(x).copy()
    plan = backend._plan(1, 3)
    for step in plan.steps:
        if type(step) is Parallel:
            step.tasks.reverse()
    np.testing.assert_array_equal(plan.run(x), expected)       # the calling thread alone, reversed


def test_winograd_cut_by_channels_band_by_band(monkeypatch):
    """A Winograd conv cut by output channels over several bands: per band, V by input channels, then
    the products by output channels (two Parallel steps a band), the one-thread answer."""
    from lnn.runtime.cpu import conv2d
    from lnn.runtime.cpu.parallel import Parallel

    monkeypatch.setattr(conv2d, "CHUNK_BYTES", 2048)
    monkeypatch.setattr(conv2d, "WINOGRAD_BAND_PER_U", 0)
    input_shape, layers = [32, 12, 10], [conv(64, padding=1, algorithm="winograd", activation="relu"),
                                         {"type": "maxpool2d", "kernel_size": 2}]
    model = parse_model({"input_shape": input_shape, "layers": layers})
    weights = random_weights(model, np.random.default_rng(8))
    one, split = split_backend(model, weights, 1), split_backend(model, weights, 3)
    x = np.random.default_rng(9).standard_normal((1, *input_shape)).astype(np.float32)
    np.testing.assert_allclose(split.run(x), one.run(x), rtol=0, atol=SPLIT_TOLERANCE)
    bands = len(one.layers[0]._bands(1, input_shape[2] + 2)[0])
    parallel = [step for step in split._plan(1, 3).steps if type(step) is Parallel]
    assert bands > 1 and len(parallel) == 2 * bands and all(len(step.tasks) == 3 for step in parallel)


def test_split_range_cuts_evenly_on_aligned_bounds():
    from lnn.runtime.cpu.parallel import split_range

    assert split_range(0, 10, 3) == [(0, 3), (3, 6), (6, 10)]
    assert split_range(0, 13, 2, align=2) == [(0, 6), (6, 13)]
    assert split_range(0, 5, 2, align=16) == [(0, 5)]                     # one block of 16 holds all 5
    assert split_range(0, 1, 4) == [(0, 1)]


@pytest.mark.parametrize("lent_before_the_wait", [False, True])
def test_a_call_waits_for_its_task_not_for_a_lent_one_given_after_it(lent_before_the_wait):
    """A lent task given to a helper by another thread (Crew.lend: a Claimed step of a call that found the crew busy)
    while a call's task runs there delays that call's wait by nothing: the helper says the call's task is done
    before it takes the lent one, and the call waits for its own task's number, not for the helper's count of tasks
    given when it starts waiting. Either way, before, the call spun on a whole core until the lent task ended (a
    linear chain's lingers on while that thread's calls keep coming), whether it started waiting before the
    lending (no "done" said) or after it (the count it waited on included the lent task)."""
    import threading
    import time

    from lnn.runtime.cpu.parallel import Crew

    crew = Crew(1)
    lent_started, lent_ends = threading.Event(), threading.Event()

    def lent(flags, given, taken):                      # runs until the crew gives that helper other work, or 10 s
        lent_started.set()
        end = time.monotonic() + 10
        while flags[given] == taken and time.monotonic() < end and not lent_ends.is_set():
            time.sleep(0.001)

    def helper_task():                                  # another thread lends while this task runs
        lender = threading.Thread(target=crew.lend_to, args=(0, lent))
        lender.start()
        lender.join()

    def caller_task():
        if lent_before_the_wait:
            assert lent_started.wait(5)

    try:
        start = time.monotonic()
        assert crew.try_run(lambda c: c.run([[caller_task], [helper_task]]))
        assert time.monotonic() - start < 5, "the call waited for the lent task"
    finally:
        lent_ends.set()
        crew.close()


def test_an_error_in_a_helper_reaches_the_caller_and_the_crew_still_works():
    from lnn.runtime.cpu.parallel import Crew

    crew = Crew(2)
    seen = []

    def fail():
        raise ZeroDivisionError("in a helper")

    with pytest.raises(ZeroDivisionError, match="in a helper"):
        crew.try_run(lambda c: c.run([[lambda: seen.append(0)], [fail], [lambda: seen.append(2)]]))
    assert crew.try_run(lambda c: c.run([[lambda: seen.append(3)], [lambda: seen.append(4)]]))
    assert sorted(seen) == [0, 2, 3, 4]
    crew.close()


def test_an_interrupt_while_a_call_waits_for_its_helper_waits_for_it_and_the_crew_still_works():
    """Ctrl-C in the main thread while its call waits for a helper's task (here raised by the helper as that call
    waits): the KeyboardInterrupt reaches the caller once the task is over, and the crew's next calls run. Before,
    it was raised as the wait ended, before its lock was taken: the helper's next task released that lock again,
    RuntimeError ended the helper's thread, and the next call waited for it for ever (a Session on 2 threads,
    interrupted during a batch's call and called again: hung)."""
    import _thread
    import threading
    import time

    from lnn.runtime.cpu.parallel import Crew

    crew = Crew(1)
    caller_waits, done = threading.Event(), []

    def helper_task():
        assert caller_waits.wait(10)
        time.sleep(0.02)                                 # the caller is in its wait for this task
        _thread.interrupt_main()
        time.sleep(0.02)
        done.append("helper")

    with pytest.raises(KeyboardInterrupt):
        crew.try_run(lambda c: c.run([[caller_waits.set], [helper_task]]))
    assert done == ["helper"]                            # raised once the helper's task was over
    next_calls = threading.Thread(target=lambda: [crew.try_run(lambda c: c.run([[], [lambda: done.append(call)]]))
                                                  for call in range(3)], daemon=True)
    next_calls.start()
    next_calls.join(10)
    try:
        assert not next_calls.is_alive(), "the crew's next call waited for a helper that had ended"
        assert done == ["helper", 0, 1, 2] and crew.threads[0].is_alive()
    finally:
        crew.close()


def test_a_task_is_handed_off_without_the_gil_and_counted_as_started():
    """jit.hand_off gives each helper its next task (its count of tasks given + 1) and waits, without the GIL, until
    each has started it, a bounded time at most (a helper that never starts costs the caller a
    wait, not a hang); a crew's helpers count the tasks they start."""
    from lnn.runtime.cpu.jit import hand_off
    from lnn.runtime.cpu.parallel import FLAGS_PER_HELPER, GIVEN, STARTED, Crew

    if hand_off is None:
        pytest.skip("no hand-off without the JIT")
    flags = np.zeros(2 * FLAGS_PER_HELPER + 1, np.int64)
    flags[[0, 3]] = 4, 7                                  # tasks given so far to helpers 0 and 1
    flags[[2, 5]] = 5, 8                                  # ... already started: nothing to wait for
    hand_off(flags, 2, FLAGS_PER_HELPER, GIVEN, STARTED, 10**9, 1)
    assert flags.tolist() == [5, 0, 5, 8, 0, 8, 0]
    hand_off(flags, 1, FLAGS_PER_HELPER, GIVEN, STARTED, 1_000_000, 1)     # helper 0 never starts task 6: 1 ms
    assert flags.tolist() == [6, 0, 5, 8, 0, 8, 0]
    crew = Crew(2)
    ran = []
    assert crew.try_run(lambda c: [c.run([[lambda: ran.append(0)], [lambda: ran.append(1)], [lambda: ran.append(2)]])
                                   for _ in range(20)])
    assert sorted(ran) == [0] * 20 + [1] * 20 + [2] * 20
    for slot in crew._jobs:
        assert crew._flags[slot.started_at] == crew._flags[slot.given] == 20
    crew.close()


def test_helpers_spin_only_during_a_call():
    """Within a call the helpers wait for tasks by spinning (no sleep between layers); after it they block:
    an idle crew uses no CPU."""
    import time

    from lnn.runtime.cpu.parallel import Crew

    crew = Crew(1)
    ran = []
    tasks = [[lambda: ran.append("caller")], [lambda: ran.append("helper")]]
    assert crew.try_run(lambda c: [c.run(tasks) for _ in range(50)])
    assert ran.count("helper") == 50 and ran.count("caller") == 50
    clock = time.pthread_getcpuclockid(crew.threads[0].ident)
    time.sleep(0.05)                         # the helper has seen the end of the call, and its linger is over
    before = time.clock_gettime(clock)
    time.sleep(0.3)
    assert time.clock_gettime(clock) - before < 0.03, "an idle helper should block, not spin"
    crew.close()


def test_the_switch_interval_is_short_only_during_crew_calls():
    """While a crew call runs, on any of its threads, the GIL switch interval is SWITCH_INTERVAL_SECONDS;
    after the last of two overlapping calls (two crews) it is the process's own again."""
    import sys
    import threading

    from lnn.runtime.cpu import parallel
    from lnn.runtime.cpu.jit import spin_while_equal

    if spin_while_equal is None:
        pytest.skip("without the JIT the interval is left alone")
    own = sys.getswitchinterval()
    first, second = parallel.Crew(1), parallel.Crew(1)
    seen, inside, release = [], threading.Event(), threading.Event()

    def hold_second():
        second.try_run(lambda c: c.run([[inside.set, release.wait], [lambda: seen.append(sys.getswitchinterval())]]))

    short = pytest.approx(parallel.SWITCH_INTERVAL_SECONDS)      # CPython keeps it in whole microseconds
    other = threading.Thread(target=hold_second, daemon=True)
    other.start()
    try:
        assert inside.wait(5)
        assert first.try_run(lambda c: c.run([[lambda: seen.append(sys.getswitchinterval())],
                                              [lambda: seen.append(sys.getswitchinterval())]]))
        assert sys.getswitchinterval() == short         # the second crew's call still runs
    finally:
        release.set()
        other.join(5)
    assert seen == [short] * 3
    assert sys.getswitchinterval() == own
    first.close()
    second.close()


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < 2,
                    reason="pins threads (Linux) on at least 2 CPUs")
def test_helpers_are_kept_off_the_callers_cpu():
    """A crew call lets its helpers run on every CPU of the process but the caller's, and again after the
    caller has moved; the caller's own CPUs are left as they were."""
    from lnn.runtime.cpu import parallel

    if parallel.CURRENT_CPU is None:
        pytest.skip("no sched_getcpu in this C library")
    model, weights, x = chain_case()
    backend = split_backend(model, weights, 2)
    cpus = os.sched_getaffinity(0)
    expected = backend.run(x).copy()
    assert os.sched_getaffinity(0) == cpus                 # the caller is never pinned
    try:
        for cpu in sorted(cpus)[:2]:
            os.sched_setaffinity(0, {cpu})           # this thread only (Linux): the caller on `cpu`
            np.testing.assert_array_equal(backend.run(x), expected)
            assert os.sched_getaffinity(0) == {cpu}
            for thread in backend._crew.threads:
                assert os.sched_getaffinity(thread.native_id) == cpus - {cpu}
    finally:
        os.sched_setaffinity(0, cpus)


def cpu_seconds_of_others(also_ours: int) -> float:
    """CPU seconds every process but this one and process `also_ours` has used since boot (Linux /proc; the
    benchmarks' own measures, benchmarks/report.py)."""
    everyone, ours = busy_seconds()
    return everyone - ours - cpu_seconds(also_ours)


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < 2,
                    reason="pins threads (Linux) on at least 2 CPUs")
def test_a_helper_program_keeps_its_cpu_beside_a_busy_process():
    """During a call (and PAUSE_NS after it) a helper's program waits for its next step by pausing the CPU, not
    by yielding it: a yield hands the CPU to any other runnable thread there for its time slice, and with a busy
    process on the helper's CPU the caller then ran most of the helper's steps itself (the bundled model on 2
    threads beside a nice-10 loop: the helper ran 16% of its steps, 3.3-4.6 ms a call against 1.2 alone; by hand,
    the 2-core VM). Here such a loop shares the helper's CPU, and the helper still runs most of its steps, judged
    in windows of 1 s in which no third process took CPU (one beside the two did: the helper then ran 8% of them)."""
    import subprocess
    import sys
    import time

    programs = programs_or_skip()
    from lnn.runtime.cpu import parallel
    from lnn.runtime.cpu.backend import PROGRAM_AT_RUN

    if parallel.CURRENT_CPU is None:
        pytest.skip("no sched_getcpu in this C library")
    cpus = os.sched_getaffinity(0)
    caller_cpu, helper_cpu = sorted(cpus)[:2]
    source = read_bin(REPO / "models" / "tomato_leaf.bin")
    x = np.random.default_rng(9).standard_normal((1, *source.model.input_shape)).astype(np.float32)
    expected = split_backend(source.model, source.weights_fp32(), 1).run(x).copy()
    split = split_backend(source.model, source.weights_fp32(), 2)
    if not split._crew.fits:
        pytest.skip("a crew of 2 threads pauses only with 2 usable cores")
    busy = subprocess.Popen([sys.executable, "-c", f"import os\nos.sched_setaffinity(0, {{{helper_cpu}}})\n"
                             "os.nice(10)\nwhile True:\n    pass"])
    try:
        os.sched_setaffinity(0, {caller_cpu})                 # this thread (Linux): its helper runs on helper_cpu
        for _ in range(PROGRAM_AT_RUN + 20):
            split.run(x)
        plan = split._plan(1, 2)
        if plan.program is None:          # a host whose split tasks call BLAS (np.matmul): the Python hand-off
            pytest.skip("this host's split plan of the bundled model has no helper program")
        assert plan.program.runs(plan.steps)
        control = plan.program.control
        shares = []                     # the helper's share of its steps in each window of 1 s with no third process
        for _ in range(3):
            posted, ran = control[programs.POSTED], control[programs.RAN]
            others_before, started = cpu_seconds_of_others(busy.pid), time.monotonic()
            while time.monotonic() < started + 1.0:
                split.run(x)
            if cpu_seconds_of_others(busy.pid) - others_before < 0.25:
                shares.append((control[programs.RAN] - ran) / (control[programs.POSTED] - posted))
            if shares and shares[-1] > 0.5:
                break
        np.testing.assert_allclose(split.run(x), expected, rtol=0, atol=SPLIT_TOLERANCE)
        if not shares:
            pytest.skip("other processes than the busy one took the cores throughout")
        assert shares[-1] > 0.5, f"the helper ran {shares[-1]:.0%} of its steps beside a busy process"
    finally:
        busy.kill()
        busy.wait()
        os.sched_setaffinity(0, cpus)


def test_a_crew_without_a_core_for_each_thread_lends_programs_that_never_pause():
    """A helper that pauses keeps its CPU from the other threads there for its time slice: a crew with more threads
    than usable cores (Crew.fits false) lends its programs no pauses, so their waits yield the CPU at once."""
    from functools import partial

    programs = programs_or_skip()
    from lnn.runtime.cpu.parallel import Crew

    crowded = Crew(usable_cores())
    assert not crowded.fits
    crowded.close()
    if usable_cores() >= 2:
        fitting = Crew(1)
        assert fitting.fits
        fitting.close()
    values = np.zeros(4, np.float32)
    program = programs.build([parallel_step_of(programs.copy_into, [partial(np.copyto, values[:2], values[2:])],
                                               (values[2:], values[:2]))], 1)
    assert program is not None

    class Lender:
        def __init__(self, fits):
            self.fits, self.lent = fits, []

        def lend_to(self, helper, task):
            self.lent.append(task.keywords["pause_ns"])

    for fits, pauses in ((True, programs.PAUSE_NS), (False, 0)):
        lender = Lender(fits)
        program.control[programs.SERVING] = 0
        program.lend(lender)
        assert lender.lent == [pauses]


def test_the_spins_time_limits_are_time_whatever_a_yield_costs():
    """A helper's linger after a call and the hand-off's wait are times on the monotonic clock: a count of yields,
    measured once when the process started, left a process that started beside a busy one (a yield then lasting a
    time slice) lingering one yield for life (its lnn-serve answered 298 photos/s against 351, by hand)."""
    import time

    from lnn.runtime.cpu.jit import hand_off, monotonic_ns, spin_while_equal
    from lnn.runtime.cpu.parallel import FLAGS_PER_HELPER, GIVEN, STARTED

    if spin_while_equal is None:
        pytest.skip("the crew spins only with the JIT")
    from numba import njit

    clock = njit(lambda: monotonic_ns())
    assert abs(clock() - time.monotonic_ns()) < 50_000_000      # the clock of time.monotonic
    flags = np.zeros(2, np.int64)                              # flags[1] (hot) 0: the call is over, only the linger
    spin_while_equal(flags, 0, 0, 1, -1, 0, 1)                 # compiled or loaded first
    for linger_ns in (5_000_000, 30_000_000):
        start = time.monotonic()
        assert not spin_while_equal(flags, 0, 0, 1, -1, 0, linger_ns)
        assert linger_ns * 1e-9 <= time.monotonic() - start < linger_ns * 1e-9 + 0.5
    flags = np.zeros(FLAGS_PER_HELPER + 1, np.int64)
    start = time.monotonic()
    hand_off(flags, 1, FLAGS_PER_HELPER, GIVEN, STARTED, 20_000_000, 1_000)  # the helper never starts: 20 ms
    assert 0.02 <= time.monotonic() - start < 0.5
    assert flags[GIVEN] == 1


def chain_case() -> tuple:
    """(model, weights, one input) of the conv + linear chain the split-choice tests time."""
    input_shape, layers = CASES["conv_chain_then_linear"]
    model = parse_model({"input_shape": input_shape, "layers": layers})
    weights = random_weights(model, np.random.default_rng(5))
    return model, weights, np.random.default_rng(6).standard_normal((1, *input_shape)).astype(np.float32)


class TrialClock:
    """The clock the backend's trials read (its module's time.perf_counter), standing still but for what a test adds
    (`later`), so that a plan the test slows down is the slower one whatever else this machine runs (with sleeps of
    3 ms instead, the split plan's calls beside another test process on the 2-core VM took longer still)."""

    def __init__(self):
        self.now = 0.0

    def perf_counter(self) -> float:
        return self.now

    def later(self, seconds: float) -> None:
        self.now += seconds


def trial_clock(monkeypatch, cpu_backend) -> TrialClock:
    clock = TrialClock()
    monkeypatch.setattr(cpu_backend, "time", clock)
    return clock


def test_a_split_that_does_not_pay_is_dropped(monkeypatch):
    """threads > 1 times its split plan against the one-thread plan on the first calls of a batch size and
    keeps the faster: with every hand-off a second slower (trial_clock), the one-thread plan; with the one-thread
    plan a second slower, the split one; same answers throughout."""
    from lnn.runtime.cpu import backend as cpu_backend

    model, weights, x = chain_case()
    expected = cpu_backend.CpuBackend(model, weights, threads=1).run(x).copy()
    clock = trial_clock(monkeypatch, cpu_backend)
    slow = cpu_backend.CpuBackend(model, weights, threads=2)
    slow.task_flops = 1                      # the default rule, but every layer worth splitting
    run = slow._crew.run
    monkeypatch.setattr(slow._crew, "run", lambda tasks: (clock.later(1), run(tasks)))
    for _ in range(2 * cpu_backend.TRIAL_LENGTH + 1):           # one thread: two trials in a row say so
        np.testing.assert_allclose(slow.run(x), expected, rtol=0, atol=SPLIT_TOLERANCE)
    assert slow._chosen == {1: 1} and slow.split_choice().startswith("batch 1: one thread (the split was not faster); batches of ")
    paying = cpu_backend.CpuBackend(model, weights, threads=2)
    paying.task_flops = 1
    whole = paying._plan(1, 1)
    whole_run = whole.run
    monkeypatch.setattr(whole, "run", lambda x, crew=None, held=True: (clock.later(1), whole_run(x))[1])
    for _ in range(cpu_backend.TRIAL_LENGTH + 1):
        np.testing.assert_allclose(paying.run(x), expected, rtol=0, atol=SPLIT_TOLERANCE)
    assert paying._chosen == {1: 2} and paying.split_choice().startswith("batch 1: layers split over 2 threads; batches of ")
    forced = split_backend(model, weights, 2)          # task_flops 0: always split, no trial
    forced.run(x)
    assert forced._chosen == {1: 2} and forced.split_choice().startswith("batch 1: layers split over 2 threads; batches of ")
    tiny = parse_model({"input_shape": [2, 4, 4], "layers": [conv(4, padding=1), {"type": "flatten"},
                                                            {"type": "linear", "out_features": 16}]})
    small = cpu_backend.CpuBackend(tiny, random_weights(tiny, np.random.default_rng(5)), threads=2)
    small.run(np.ones((1, 2, 4, 4), np.float32))          # the default rule: no layer here is worth it
    assert not small._plan(1, 2).splits and not small._plan(1, 2).claims
    assert small.split_choice().startswith("batch 1: one thread (no layer large enough to split); batches of ")


def choice_case() -> tuple:
    """(a 2-thread backend of chain_case that splits every layer worth it, one input, its split plan, its
    one-thread plan) for the split-choice tests."""
    from lnn.runtime.cpu import backend as cpu_backend

    model, weights, x = chain_case()
    backend = cpu_backend.CpuBackend(model, weights, threads=2)
    backend.task_flops = 1
    return backend, x, backend._plan(1, 2), backend._plan(1, 1)


def test_a_split_slow_only_at_first_is_kept(monkeypatch):
    """The split plan is judged by its fastest trial call: slowed on its first timed calls (as a second
    core was seen to be, in some fresh processes), then faster than the one-thread plan, it is kept;
    by median it was not."""
    from lnn.runtime.cpu import backend as cpu_backend

    clock = trial_clock(monkeypatch, cpu_backend)
    backend, x, split, whole = choice_case()
    split_run, whole_run = split.run, whole.run
    split_calls = []
    slow_first = cpu_backend.TRIAL_BLOCK * (cpu_backend.TRIAL_BLOCKS - 1)      # all its turns but the last

    def slow_at_first(x, crew=None, held=True):
        split_calls.append(1)
        clock.later(2 if len(split_calls) <= slow_first else 0)
        return split_run(x, crew, held)

    monkeypatch.setattr(split, "run", slow_at_first)
    monkeypatch.setattr(whole, "run", lambda x, crew=None, held=True: (clock.later(1), whole_run(x))[1])
    for _ in range(cpu_backend.TRIAL_LENGTH + 1):
        backend.run(x)
    assert backend._chosen == {1: 2}


def test_the_trial_runs_each_plan_in_turns_and_times_not_a_turns_first_call(monkeypatch):
    """The trial runs the split and the one-thread plan in turns of TRIAL_BLOCK calls (the split first),
    and a turn's first call is not timed: a split slow on each turn's first call only (its helpers asleep
    after the one-thread turn), faster on the others than the one-thread plan, is kept."""
    from lnn.runtime.cpu import backend as cpu_backend

    clock = trial_clock(monkeypatch, cpu_backend)
    backend, x, split, whole = choice_case()
    split_run, whole_run = split.run, whole.run
    order = []

    def split_slow_first_in_turn(x, crew=None, held=True):
        clock.later(3 if not order or order[-1] == "whole" else 0)
        order.append("split")
        return split_run(x, crew, held)

    def whole_slower(x, crew=None, held=True):
        clock.later(1)
        order.append("whole")
        return whole_run(x)

    monkeypatch.setattr(split, "run", split_slow_first_in_turn)
    monkeypatch.setattr(whole, "run", whole_slower)
    for _ in range(cpu_backend.TRIAL_LENGTH + 1):
        backend.run(x)
    turn = cpu_backend.TRIAL_BLOCK
    assert order[:cpu_backend.TRIAL_LENGTH] == (["split"] * turn + ["whole"] * turn) * cpu_backend.TRIAL_BLOCKS
    assert backend._chosen == {1: 2} and order[-1] == "split"


def test_one_thread_is_kept_only_when_two_trials_in_a_row_say_so(monkeypatch):
    """A trial that finds the split not faster is followed at once by another: one noisy trial keeps the split
    (the plan asked for); two in a row keep one thread."""
    from lnn.runtime.cpu import backend as cpu_backend

    clock = trial_clock(monkeypatch, cpu_backend)
    backend, x, split, whole = choice_case()
    split_run = split.run
    split_delays = [2] * (cpu_backend.TRIAL_LENGTH // 2)        # its calls in the first trial only

    def split_slow_in_the_first_trial(x, crew=None, held=True):
        clock.later(split_delays.pop(0) if split_delays else 0)
        return split_run(x, crew, held)

    monkeypatch.setattr(split, "run", split_slow_in_the_first_trial)
    whole_run = whole.run
    monkeypatch.setattr(whole, "run", lambda x, crew=None, held=True: (clock.later(1), whole_run(x))[1])
    for _ in range(2 * cpu_backend.TRIAL_LENGTH + 1):
        backend.run(x)
    assert backend._chosen == {1: 2} and not backend.choosing(1)

    backend, x, split, whole = choice_case()
    split_run = split.run
    monkeypatch.setattr(split, "run", lambda x, crew=None, held=True: (clock.later(2), split_run(x, crew, held))[1])
    for _ in range(2 * cpu_backend.TRIAL_LENGTH + 1):
        assert backend._chosen == {}                            # undecided until the second trial ends
        backend.run(x)
    assert backend._chosen == {1: 1}


def test_a_choice_is_timed_again_later(monkeypatch):
    """A choice made on a process's first calls is timed again after REVIEW_FIRST calls: hand-offs slow at
    first keep one thread; once the one-thread plan is the slow one, the review keeps the split, and the
    next review comes REVIEW_GROWTH times later."""
    from lnn.runtime.cpu import backend as cpu_backend

    model, weights, x = chain_case()
    clock = trial_clock(monkeypatch, cpu_backend)
    backend = cpu_backend.CpuBackend(model, weights, threads=2)
    backend.task_flops = 1
    slow = {"split": True}

    def slower(plan: str) -> None:
        clock.later(slow["split"] == (plan == "split"))

    run = backend._crew.run
    monkeypatch.setattr(backend._crew, "run", lambda tasks: (slower("split"), run(tasks)))
    whole = backend._plan(1, 1)
    whole_run = whole.run
    monkeypatch.setattr(whole, "run", lambda x, crew=None, held=True: (slower("whole"), whole_run(x))[1])
    trial = cpu_backend.TRIAL_LENGTH + 1                       # both plans' turns and the deciding call
    for call in range(2 * trial - 1):                          # one thread: two trials in a row say so
        assert backend.choosing(1) == (0 < call)                 # from its first call until it decides
        backend.run(x)
    assert backend._chosen == {1: 1} and not backend.choosing(1)
    slow["split"] = False
    for _ in range(cpu_backend.REVIEW_FIRST - 1):
        backend.run(x)
    assert backend._chosen == {1: 1} and not backend._trials
    for _ in range(trial):
        backend.run(x)
    assert backend._chosen == {1: 2}
    assert backend._reviews[1] == [cpu_backend.REVIEW_FIRST * cpu_backend.REVIEW_GROWTH,
                                   cpu_backend.REVIEW_FIRST * cpu_backend.REVIEW_GROWTH ** 2]


def test_a_fresh_backend_whose_first_calls_all_start_at_once_still_chooses(monkeypatch):
    """TRIAL_LENGTH threads' first calls on one fresh backend (a shared Session), each started before any ended
    (forced: each waits for all the others before it runs its plan), all take the trial's first way, the split
    plan. The next call of that batch size, and every one after it, raised ValueError (the fastest of the
    one-thread plan's timings, of which there were none); now the trial goes on until both plans are timed, then
    chooses, and every answer is the one-thread backend's."""
    import threading

    from lnn.runtime.cpu import backend as cpu_backend

    backend, x, _, _ = choice_case()
    expected = cpu_backend.CpuBackend(*chain_case()[:2], threads=1).run(x).copy()
    callers = cpu_backend.TRIAL_LENGTH
    all_started = threading.Barrier(callers, timeout=60)
    run_plan = backend._run_plan
    monkeypatch.setattr(backend, "_run_plan", lambda plan, x: (all_started.wait(), run_plan(plan, x)))
    answers, errors = [], []

    def first_call():
        try:
            answers.append(backend.run(x).copy())
        except Exception as error:          # noqa: BLE001 - reported below
            errors.append(error)

    threads = [threading.Thread(target=first_call) for _ in range(callers)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert not errors and len(answers) == callers
    monkeypatch.setattr(backend, "_run_plan", run_plan)
    for _ in range(2 * cpu_backend.TRIAL_LENGTH + 1):
        answers.append(backend.run(x).copy())
    assert not backend.choosing(1) and backend._chosen[1] in (1, 2)
    for answer in answers:
        np.testing.assert_allclose(answer, expected, rtol=0, atol=SPLIT_TOLERANCE)


def test_calls_within_one_thread_run_on_the_calling_thread_alone(monkeypatch):
    """Within one_thread() (lnn-serve's lone photo while others wait, where the server found it faster), a call runs
    the one-thread plan of its size on the calling thread: no task reaches the crew, the bytes are a one-thread
    backend's, the split choice takes no turn from it; another thread's calls meanwhile, and this thread's after
    it, split again. A batch split by images outside it runs whole on the calling thread inside it."""
    import threading

    from lnn.runtime.cpu import backend as cpu_backend

    monkeypatch.setattr(cpu_backend, "MIN_SPLIT_FLOPS", 0)             # batches of 2 or more split by images
    model, weights, x = chain_case()
    one, split = split_backend(model, weights, 1), split_backend(model, weights, 2)
    handed = []
    for name in ("run", "run_steps"):
        original = getattr(split._crew, name)
        monkeypatch.setattr(split._crew, name, lambda *args, original=original, **kw: (handed.append(1), original(*args, **kw))[1])
    batch = np.random.default_rng(3).standard_normal((4, *x.shape[1:])).astype(np.float32)
    with split.one_thread():
        with split.one_thread():
            pass                                       # nested (a warm-up inside it): still alone after
        np.testing.assert_array_equal(split.run(x), one.run(x))
        np.testing.assert_array_equal(split.run(batch), one.run(batch))
        assert handed == [] and split._chosen == {} and not split.choosing(1)
        elsewhere = threading.Thread(target=split.run, args=(x,))
        elsewhere.start()
        elsewhere.join(30)
        assert handed                                  # the other thread's call split
    handed.clear()
    split.run(x)
    assert handed and split._chosen == {1: 2}


def test_a_warm_up_readies_the_one_thread_plan_of_a_split_size(monkeypatch):
    """After warmup, a call within one_thread() only computes: its plan and its one-thread program were made by the
    warm-up, even where the split was kept without a trial (here forced) and the one-thread plan never ran."""
    from lnn.runtime.cpu import programs

    model, weights, x = chain_case()
    split = split_backend(model, weights, 2)
    split.warmup(1)
    built = []
    monkeypatch.setattr(programs, "build_steps_program", lambda steps: built.append(1))
    planned = len(split._plans.keys())
    with split.one_thread():
        split.run(x)
    assert built == [] and len(split._plans.keys()) == planned


def fake_cpus(root, cores: list, capacities: list | None = None) -> None:
    """A sysfs cpu folder: cores[i] the logical CPUs of physical core i ("0,4"), capacities[i] its cpu_capacity."""
    for core, cpus in enumerate(cores):
        for cpu in cpus.split(","):
            topology = root / f"cpu{cpu}" / "topology"
            topology.mkdir(parents=True)
            (topology / "thread_siblings_list").write_text(cpus + "\n")
            if capacities:
                (root / f"cpu{cpu}" / "cpu_capacity").write_text(f"{capacities[core]}\n")


def test_auto_counts_physical_big_cores(tmp_path):
    """threads="auto" counts one thread per physical core (a hardware thread's sibling shares its arithmetic units)
    and, where cores differ in cpu_capacity (big.LITTLE), only the biggest among those the process may use; where
    the topology cannot be read, every allowed CPU (usable_cores' fallback)."""
    from lnn.runtime.cores import big_physical_cores

    smt = tmp_path / "smt"
    fake_cpus(smt, ["0,4", "1,5", "2,6", "3,7"])
    assert big_physical_cores(range(8), smt) == 4
    assert big_physical_cores({0, 4}, smt) == 1                  # taskset to one core's two hardware threads
    assert big_physical_cores({0, 1, 5}, smt) == 2
    hybrid = tmp_path / "hybrid"                                  # an RK3588: 4 little (A55), 4 big (A76)
    fake_cpus(hybrid, ["0", "1", "2", "3", "4", "5", "6", "7"], [414, 414, 414, 414, 1024, 1024, 1024, 1024])
    assert big_physical_cores(range(8), hybrid) == 4
    assert big_physical_cores({0, 1}, hybrid) == 2                # only little cores allowed: those
    assert big_physical_cores({0, 1, 7}, hybrid) == 1
    phone = tmp_path / "phone"                                    # one prime core, three big, four little
    fake_cpus(phone, ["0", "1", "2", "3", "4", "5", "6", "7"], [400, 400, 400, 400, 870, 870, 870, 1024])
    assert big_physical_cores(range(8), phone) == 4
    favoured = tmp_path / "favoured"                              # performance cores a little apart, SMT pairs
    fake_cpus(favoured, ["0,1", "2,3", "4,5", "6,7", "8", "9"], [1024, 1024, 1000, 1000, 600, 600])
    assert big_physical_cores(range(10), favoured) == 4
    assert big_physical_cores(range(2), tmp_path / "absent") == 0


def test_auto_keeps_within_the_cgroup_cpu_quota(tmp_path, monkeypatch):
    """A CPU quota (docker --cpus, a Kubernetes limit) caps threads="auto" at the CPUs' worth of time it grants,
    rounded up, the smallest along the cgroup's path; a container sees its own cgroup as the root."""
    from lnn.runtime import cores

    def cgroup(lines: str, files: dict):
        folder = tmp_path / str(len(list(tmp_path.iterdir())))
        for name, text in files.items():
            (folder / "fs" / name).parent.mkdir(parents=True, exist_ok=True)
            (folder / "fs" / name).write_text(text)
        (folder / "cgroup").write_text(lines)
        return cores.cgroup_cpu_quota(folder / "cgroup", folder / "fs")

    assert cgroup("0::/kubepods/pod1/c1\n", {"kubepods/pod1/c1/cpu.max": "max 100000\n",
                                              "kubepods/pod1/cpu.max": "150000 100000\n",
                                              "kubepods/cpu.max": "400000 100000\n"}) == 2
    assert cgroup("0::/\n", {"cpu.max": "200000 100000\n"}) == 2               # v2, inside the container
    assert cgroup("0::/user.slice\n", {"cpu.max": "max 100000\n"}) is None
    assert cgroup("4:cpu,cpuacct:/docker/abc\n3:memory:/docker/abc\n",        # v1: the container's own root
                  {"cpu,cpuacct/cpu.cfs_quota_us": "300000\n", "cpu,cpuacct/cpu.cfs_period_us": "100000\n"}) == 3
    assert cgroup("4:cpu,cpuacct:/\n", {"cpu,cpuacct/cpu.cfs_quota_us": "-1\n",
                                         "cpu,cpuacct/cpu.cfs_period_us": "100000\n"}) is None
    assert cgroup("0::/\n", {"cpu.max": "50000 100000\n"}) == 1                 # half a CPU: one thread
    assert cores.cgroup_cpu_quota(tmp_path / "absent", tmp_path) is None
    monkeypatch.setattr(cores, "cgroup_cpu_quota", lambda: 1)
    assert cores.usable_cores() == cores.usable_cpus() == 1                 # lnn-serve's decode pool too
    if cores.allowed_cpus() > 1:
        assert cores.cores_in_words().endswith("; a CPU quota of 1)")


def test_threads_auto_is_the_usable_cores():
    from lnn.runtime.cores import big_physical_cores, cgroup_cpu_quota, cores_in_words

    allowed = os.sched_getaffinity(0)
    assert usable_cores() == min(big_physical_cores(allowed) or len(allowed), cgroup_cpu_quota() or len(allowed))
    assert 1 <= usable_cores() <= len(allowed)
    assert resolve_threads("auto") == resolve_threads(None) == usable_cores()
    assert resolve_threads(3) == 3
    tiny = parse_model({"input_shape": [2, 5, 5], "layers": [conv(3, padding=1), {"type": "flatten"},
                                                             {"type": "linear", "out_features": 4}]})
    source = parse_bin_bytes(encode_bin(tiny, random_weights(tiny, np.random.default_rng(0)), build_metadata(tiny)))
    auto = Session(source, "cpu")
    assert auto.threads == auto.backend.threads == usable_cores()
    assert auto.describe_threads().startswith(f"cpu backend, {usable_cores()} thread{'s' if usable_cores() > 1 else ''} "
                                              f"(auto: {cores_in_words()})")
    three = Session(source, "cpu", threads=3)
    words = three.describe_threads()
    assert words.startswith("cpu backend, 3 threads (as asked); one image's layers: split over 3 threads where timed at "
                            "least 5% faster than one (decided after 9 calls of each, 18 before keeping one thread); "
                            "batches of ")
    by_images = int(words.split("; batches of ")[1].split()[0])           # the smallest batch split by its images
    assert words.endswith(f"batches of {by_images} or more: their images split over 3 threads")
    assert three.backend.splits_batch(by_images) and not three.backend.splits_batch(by_images - 1)
    assert Session(source, "cpu", threads=1).describe_threads() == "cpu backend, 1 thread (as asked)"
    numpy_session = Session(source, "numpy")
    assert numpy_session.threads is None and "no thread count of its own" in numpy_session.describe_threads()


def test_lnn_infer_reports_the_threads(capsys):
    from lnn.tools import infer

    leaf = REPO / "examples" / "leaves"
    photo = sorted(p for p in leaf.rglob("*") if p.suffix.lower() in (".jpg", ".jpeg", ".png"))[:1]
    if not photo:
        pytest.skip("no sample leaf photo")
    assert infer.main(["--device", "cpu", "--threads", "2", "--verbose", "--json", str(photo[0])]) == 0
    captured = capsys.readouterr()
    assert "lnn-infer: cpu backend, 2 threads (as asked)" in captured.err
    record = json.loads(captured.out.splitlines()[0])
    assert record["device"] == "cpu" and record["threads"] == 2
    assert infer.main(["--device", "cpu", "--threads", "0", str(photo[0])]) == 1
    assert "--threads must be a whole number of at least 1, or auto; not '0'" in capsys.readouterr().err


def test_the_bundled_model_split_matches_one_thread():
    source = read_bin(REPO / "models" / "tomato_leaf.bin")
    x = np.random.default_rng(9).standard_normal((1, *source.model.input_shape)).astype(np.float32)
    from lnn.runtime.cpu.parallel import Parallel

    one = Session(source, "cpu", threads=1).run(x)
    two = Session(source, "cpu", threads=2)
    np.testing.assert_allclose(two.run(x), one, rtol=0, atol=SPLIT_TOLERANCE)
    assert sum(type(step) is Parallel for step in two.backend._plan(1, 2).steps) >= 5    # its five convs at least


@pytest.mark.parametrize("threads", [2, 3])
def test_a_batch_split_by_images_runs_in_units_that_give_the_same_bytes_whoever_takes_them(threads, monkeypatch):
    """A split batch is cut into units of SPLIT_UNIT images (1 each where the batch is too small to give every
    thread one): each image's bytes are those of a one-thread run of its unit, whichever thread took it; any batch
    size runs on the units' plans alone."""
    from lnn.runtime.cpu import backend

    monkeypatch.setattr(backend, "MIN_SPLIT_FLOPS", 0)                  # any batch of 2 or more split by images
    input_shape, layers = CASES["conv_chain_then_linear"]
    model = parse_model({"input_shape": input_shape, "layers": layers})
    weights = random_weights(model, np.random.default_rng(11))
    one, split = split_backend(model, weights, 1), split_backend(model, weights, threads)
    for batch in (2, 3, 5, 8, 13):
        x = np.random.default_rng(batch).standard_normal((batch, *input_shape)).astype(np.float32)
        unit = min(backend.SPLIT_UNIT, -(-batch // threads))
        by_units = np.concatenate([one.run(x[start:start + unit]).copy() for start in range(0, batch, unit)])
        np.testing.assert_array_equal(split.run(x), by_units)
        np.testing.assert_allclose(split.run(x), one.run(x), rtol=0, atol=SPLIT_TOLERANCE)
    assert {rows for rows, _, _ in split._plans.keys()} <= {1, 2}      # no plan of 3, 5, 8 or 13 images


def test_a_thread_held_up_leaves_the_other_units_to_the_threads_that_are_free(monkeypatch):
    """The units of a split batch are taken as threads come free: with the helper held up 0.2 s in its first
    unit, the calling thread ran all the others (with a fixed share per thread, the helper ran half of them)."""
    from lnn.runtime.cpu import backend

    monkeypatch.setattr(backend, "MIN_SPLIT_FLOPS", 0)                  # any batch of 2 or more split by images
    input_shape, layers = CASES["conv_chain_then_linear"]
    model = parse_model({"input_shape": input_shape, "layers": layers})
    split = split_backend(model, random_weights(model, np.random.default_rng(12)), 2)
    batch = 2 * 8                                                       # 8 units of 2
    x = np.random.default_rng(13).standard_normal((batch, *input_shape)).astype(np.float32)
    expected = split.run(x).copy()
    ran = []
    for (_, part), plan in split._unit_plans(batch).items():
        def run(images, plan=plan, part=part, plain=plan.run):
            ran.append(part)
            time.sleep(0.2 if part == 1 else 0.002)
            return plain(images)
        plan.run = run
    np.testing.assert_array_equal(split.run(x), expected)
    assert sorted(ran) in ([0] * 7 + [1], [0] * 8), ran     # 8 zeros: the helper had not started when all were taken


@pytest.mark.parametrize("threads", [2, 3])
def test_the_profile_times_the_layers_as_the_calls_split_them(threads, monkeypatch):
    """lnn-bench --profile on a split plan: each layer timed with its tasks on the crew, the threads it is cut into
    reported (1 for a layer left whole); a batch split by images is profiled on one of its units' plans, one thread."""
    input_shape, layers = CASES["conv_chain_then_linear"]
    model = parse_model({"input_shape": input_shape, "layers": layers})
    split = split_backend(model, random_weights(model, np.random.default_rng(3)), threads)
    x = np.random.default_rng(4).standard_normal((1, *input_shape)).astype(np.float32)
    split.run(x)
    rows = split.profile(x, 3)
    assert [name for name, *_ in rows] == ["+".join(nodes) for nodes in split.layer_nodes]
    cut = [layer in splittable(split.layers) for layer in split.layers]
    assert [count for *_, count in rows] == [threads if each else 1 for each in cut] and any(cut)
    assert all(seconds > 0 for _, _, seconds, _ in rows)
    from lnn.runtime.cpu import backend

    monkeypatch.setattr(backend, "MIN_SPLIT_FLOPS", 0)      # any batch of 2 or more split by images
    assert split.splits_batch(4)
    planned, plan_class = [], backend.Plan
    monkeypatch.setattr(backend, "Plan", lambda *args, **options: planned.append(args[2]) or plan_class(*args, **options))
    assert [count for *_, count in split.profile(np.repeat(x, 5, axis=0), 2)] == [1] * len(rows)
    assert planned == [backend.SPLIT_UNIT]                   # a unit: 2 of the 5 images


def programs_or_skip():
    from lnn.runtime.cpu import programs

    if not programs.AVAILABLE:
        pytest.skip("helper programs need the JIT's spins and call_at")
    return programs


@pytest.mark.parametrize("case", ["conv_winograd_odd_rows", "conv_winograd_channels_pool", "conv_depthwise_channels"])
@pytest.mark.parametrize("threads", [2, 3])
def test_a_helper_program_gives_the_same_bytes_as_the_python_hand_off(case, threads):
    """From a split plan's PROGRAM_AT_RUN'th run its helpers run their tasks in the compiled program (programs.py):
    the same kernels on the same buffers, so the same bytes, and the helpers really ran some of them."""
    import time

    programs = programs_or_skip()
    from lnn.runtime.cpu.backend import PROGRAM_AT_RUN

    input_shape, layers = CASES[case]
    model = parse_model({"input_shape": input_shape, "layers": layers})
    weights = random_weights(model, np.random.default_rng(5))
    split = split_backend(model, weights, threads)
    x = np.random.default_rng(6).standard_normal((1, *input_shape)).astype(np.float32)
    handed_off = split.run(x).copy()
    plan = split._plan(1, threads)
    assert plan.program is None
    for _ in range(PROGRAM_AT_RUN + 200):
        np.testing.assert_array_equal(split.run(x), handed_off)
    program = plan.program
    assert program is not None
    ran = program.control[programs.RAN::programs.CONTROL_WORDS]
    deadline = time.monotonic() + 20            # a loaded machine may keep the helper off its CPU for a while
    while ran.sum() == 0 and time.monotonic() < deadline:
        np.testing.assert_array_equal(split.run(x), handed_off)
    assert ran.sum() > 0, "no helper ran a task of its program"
    assert (program.control[programs.DONE::programs.CONTROL_WORDS]
            == program.control[programs.POSTED::programs.CONTROL_WORDS]).all()


def im2col_conv_plan(monkeypatch, sgemm: bool):
    """(its 2-thread plan after PROGRAM_AT_RUN + 1 runs, the last run's output) of the im2col conv case split over
    2 threads, its products through blas_product (sgemm) or np.matmul."""
    from lnn.runtime.cpu import conv2d
    from lnn.runtime.cpu.backend import PROGRAM_AT_RUN

    if not sgemm:
        monkeypatch.setattr(conv2d, "blas_products_sgemm", lambda: None)
    input_shape, layers = CASES["conv_im2col_channels"]
    model = parse_model({"input_shape": input_shape, "layers": layers})
    split = split_backend(model, random_weights(model, np.random.default_rng(5)), 2)
    x = np.random.default_rng(6).standard_normal((1, *input_shape)).astype(np.float32)
    for _ in range(PROGRAM_AT_RUN + 1):
        output = split.run(x).copy()
    monkeypatch.undo()
    return split._plan(1, 2), output


def test_a_plan_whose_helper_tasks_call_np_matmul_gets_no_program(monkeypatch):
    """np.matmul (the im2col conv's product where NumPy's BLAS has no sgemm address) is no kernel a program can
    call: that plan keeps the Python hand-off."""
    programs = programs_or_skip()
    from lnn.runtime.cpu.parallel import all_steps

    plan, _ = im2col_conv_plan(monkeypatch, sgemm=False)
    assert np.matmul in [getattr(step, "func", None) for step in all_steps(plan.steps)]
    assert plan.splits and plan.uses_blas and plan.program is None
    assert programs.build(plan.steps, 1) is None


def test_im2col_products_through_blas_run_in_the_helper_program(monkeypatch):
    """Where NumPy's BLAS has an sgemm address, the im2col conv's products are winograd.blas_product, a kernel
    calling sgemm: the plan gets its helper program (on arm64 and on x86 without FMA the bundled model's first
    conv is such a conv), and gives the bytes of np.matmul's plan."""
    programs_or_skip()
    from lnn.runtime.cpu import winograd
    from lnn.runtime.cpu.jit import sgemm_address
    from lnn.runtime.cpu.parallel import all_steps

    if sgemm_address() is None:
        pytest.skip("NumPy's BLAS here has no ILP64 cblas_sgemm")
    plan, output = im2col_conv_plan(monkeypatch, sgemm=True)
    assert winograd.blas_product in [getattr(step, "func", None) for step in all_steps(plan.steps)]
    assert plan.splits and plan.uses_blas and plan.program is not None
    _, through_matmul = im2col_conv_plan(monkeypatch, sgemm=False)
    np.testing.assert_array_equal(output, through_matmul)


def test_winograd_products_through_blas_run_in_the_helper_program(monkeypatch):
    """Where the Winograd products go to BLAS (an AVX-512 host whose OpenBLAS has AVX-512 kernels), they are
    blas_products, a kernel calling sgemm: the plan holds BLAS at one thread, gets its helper program, and gives the
    bytes of the Python hand-off."""
    programs = programs_or_skip()
    from lnn.runtime.cpu import conv2d, winograd
    from lnn.runtime.cpu.backend import PROGRAM_AT_RUN
    from lnn.runtime.cpu.jit import sgemm_address
    from lnn.runtime.cpu.parallel import all_steps

    if sgemm_address() is None:
        pytest.skip("NumPy's BLAS here has no ILP64 cblas_sgemm")
    monkeypatch.setattr(conv2d, "small_products_pay", lambda: False)
    monkeypatch.setattr(conv2d, "narrow_tiles_pay", lambda: False)
    input_shape, layers = CASES["conv_winograd_rows_pool"]
    model = parse_model({"input_shape": input_shape, "layers": layers})
    weights = random_weights(model, np.random.default_rng(5))
    split = split_backend(model, weights, 2)
    x = np.random.default_rng(6).standard_normal((1, *input_shape)).astype(np.float32)
    handed_off = split.run(x).copy()
    for _ in range(PROGRAM_AT_RUN + 20):
        np.testing.assert_array_equal(split.run(x), handed_off)
    plan = split._plan(1, 2)
    assert winograd.blas_products in [getattr(step, "func", None) for step in all_steps(plan.steps)]
    assert plan.uses_blas and plan.program is not None
    np.testing.assert_allclose(handed_off, split_backend(model, weights, 1).run(x), rtol=0, atol=SPLIT_TOLERANCE)
    assert programs.build(plan.steps, 1) is not None


def parallel_step_of(kernel, caller_task, helper_args):
    from functools import partial

    from lnn.runtime.cpu.parallel import Parallel

    return Parallel([caller_task, [partial(kernel, *helper_args)]])


def test_a_program_left_alone_has_its_tasks_run_by_the_caller():
    """A post no helper claims (the program never lent, as when the helper is away or busy) is claimed and run by
    the caller itself: the same answer, no wait."""
    programs = programs_or_skip()
    import numba

    @numba.njit(nogil=True)
    def add_one(values, first, end):
        for i in range(first, end):
            values[i] += 1.0

    values = np.zeros(8, np.float32)
    steps = [parallel_step_of(add_one, [lambda: add_one(values, 0, 4)], (values, 4, 8)) for _ in range(3)]
    program = programs.build(steps, 1)
    assert program is not None
    for step in steps:
        program.control[programs.SERVING] = 1    # as if lent to a helper that never came: nobody claims the posts
        program.run_step(step, crew=None)
    assert values.tolist() == [3.0] * 8
    assert program.control[programs.RAN] == 0 and program.control[programs.DONE] == 3


def add_or_refuse_kernel():
    """A kernel add_or_refuse(values, index): values[index] += 1, or ValueError where it is negative."""
    import numba

    @numba.njit(nogil=True)
    def add_or_refuse(values, index):
        if values[index] < 0:
            raise ValueError("a negative value")
        values[index] += 1.0

    return add_or_refuse


def test_an_error_in_a_helper_program_reaches_the_caller_and_the_next_call_works():
    """A kernel that raises inside a helper's program: the call raises that error (RuntimeError from it), nothing
    hangs, and later calls of the same program give their answers."""
    programs = programs_or_skip()
    import time

    from lnn.runtime.cpu.parallel import Crew

    add_or_refuse = add_or_refuse_kernel()

    def until_the_helper_claims():                      # the caller's own task: so the helper, not it, runs the other
        deadline = time.monotonic() + 1
        while program.control[programs.CLAIMED] != program.control[programs.POSTED] and time.monotonic() < deadline:
            time.sleep(0.001)

    values = np.zeros(2, np.float32)
    step = parallel_step_of(add_or_refuse, [until_the_helper_claims], (values, 1))
    program = programs.build([step], 1)
    crew = Crew(1)

    def call():
        return crew.try_run(lambda c: c.run_steps([step], True, program))

    try:
        raised = None
        for _ in range(50):
            values[1] = -5.0
            try:
                call()
            except RuntimeError as error:           # raised in the helper, reported by the caller
                raised = error
                break
            except ValueError:                      # the helper had just left its program: the caller ran the task
                continue
        assert raised is not None and "a negative value" in str(raised)
        values[1] = 0.0
        for _ in range(3):
            assert call()
        assert values[1] == 3.0
    finally:
        crew.close()


def test_a_program_of_kernels_only_runs_the_whole_call_compiled():
    """A split plan whose every step is a kernel gets run_call: the caller's side of the whole call compiled too
    (run_all), the same bytes as the Python hand-off and as one thread, and the helpers ran their tasks in it."""
    import time

    programs = programs_or_skip()
    from lnn.runtime.cpu.backend import PROGRAM_AT_RUN

    input_shape, layers = CASES["conv_winograd_channels_pool"]
    model = parse_model({"input_shape": input_shape, "layers": layers + [{"type": "global_avg_pool"}]})
    weights = random_weights(model, np.random.default_rng(5))
    split = split_backend(model, weights, 2)
    x = np.random.default_rng(6).standard_normal((1, *input_shape)).astype(np.float32)
    handed_off = split.run(x).copy()
    for _ in range(PROGRAM_AT_RUN):
        split.run(x)
    plan = split._plan(1, 2)
    program = plan.program
    assert program is not None and program.runs(plan.steps)
    assert not program.runs(plan.steps[1:])
    ran = program.control[programs.RAN]
    deadline = time.monotonic() + 20
    while program.control[programs.RAN] == ran and time.monotonic() < deadline:
        np.testing.assert_array_equal(split.run(x), handed_off)
    assert program.control[programs.RAN] > ran, "no helper ran a task of the program"
    assert program.control[programs.DONE] == program.control[programs.POSTED]
    np.testing.assert_allclose(handed_off, split_backend(model, weights, 1).run(x), rtol=0, atol=SPLIT_TOLERANCE)


def test_a_compiled_call_whose_helper_never_comes_runs_its_tasks_and_goes_on():
    """run_all where no helper claims a post (as when the helper is away): run_call stops at each such step, the
    caller runs the helper's task, and run_call goes on from the next step: every step once, in order."""
    programs = programs_or_skip()
    from functools import partial

    import numba

    @numba.njit(nogil=True)
    def scale_and_add(values, first, end, factor, term):
        for i in range(first, end):
            values[i] = values[i] * factor + term

    values = np.ones(8, np.float32)

    def halves_scaled(factor):                   # the caller's half, and the helper's
        return parallel_step_of(scale_and_add, [partial(scale_and_add, values, 0, 4, factor, 0.0)],
                                (values, 4, 8, factor, 0.0))

    steps = [halves_scaled(2.0), partial(scale_and_add, values, 0, 8, 1.0, 1.0), halves_scaled(3.0)]
    program = programs.build(steps, 1)
    assert program is not None and program.runs(steps)
    program.control[programs.SERVING] = 1        # as if lent to a helper that never came: nobody claims the posts
    program.run_all(crew=None)
    assert values.tolist() == [9.0] * 8          # (1 * 2 + 1) * 3, each step once, in order
    assert program.control[programs.RAN] == 0 and program.control[programs.DONE] == 2


def test_an_error_in_a_compiled_call_reaches_the_caller_and_the_next_call_works():
    """run_all with a kernel that raises, in the caller's own task or in the helper's: the call raises (the
    kernel's ValueError where the caller ran it, RuntimeError from it where the helper did), every post is
    settled (nothing hangs, no helper is left working), and later calls give their answers."""
    programs = programs_or_skip()
    from functools import partial

    from lnn.runtime.cpu.parallel import Crew

    add_or_refuse = add_or_refuse_kernel()

    values = np.zeros(2, np.float32)
    steps = [parallel_step_of(add_or_refuse, [partial(add_or_refuse, values, 0)], (values, 1)),
             partial(add_or_refuse, values, 0)]
    program = programs.build(steps, 1)
    assert program is not None and program.runs(steps)
    crew = Crew(1)

    def call():
        return crew.try_run(lambda c: c.run_steps(steps, True, program))

    try:
        for refused in (0, 1):
            for _ in range(5):
                values[:] = 0.0
                values[refused] = -5.0
                with pytest.raises((ValueError, RuntimeError), match="a negative value"):
                    call()
                assert (program.control[programs.DONE::programs.CONTROL_WORDS]
                        == program.control[programs.POSTED::programs.CONTROL_WORDS]).all()
                assert program.errors == [None]
        values[:] = 0.0
        for _ in range(3):
            assert call()
        assert values.tolist() == [6.0, 3.0]
    finally:
        crew.close()


PROGRAM_IN_A_FRESH_PROCESS = """
import json, warnings
import numpy as np
warnings.simplefilter("error")
from lnn.formats.model import parse_model
from lnn.runtime.cpu import BACKEND
model = parse_model({"input_shape": [16, 8, 8], "layers": [
    {"type": "conv2d", "out_channels": 64, "kernel_size": 3, "padding": 1, "algorithm": "winograd", "activation": "relu"}]})
weights = {key: np.full(shape, 0.01, np.float32) for key, shape in model.param_shapes().items()}
backend = BACKEND(model, weights, threads=2)
backend.task_flops = 0
x = np.ones((1, 16, 8, 8), np.float32)
answers = [backend.run(x).copy() for _ in range(3)]
program = backend._plan(1, 2).program
print(json.dumps({"program": program is not None and program.run_call is not None,
                  "loaded": len(program.serve.stats.cache_hits) + len(program.run_call.stats.cache_hits),
                  "same": all((answer == answers[0]).all() for answer in answers)}))
"""


@pytest.mark.slow
def test_a_helper_program_is_cached_and_loaded_by_a_later_process(tmp_path):
    """The second process finds the program the first compiled (Numba's cache, the source file in the kernel cache
    folder) and loads it without error or warning (a cached program once named a module no later process could
    import). An empty cache folder: the first process compiles the conv's kernels too (about 14 s)."""
    programs_or_skip()
    import subprocess
    import sys

    env = {**os.environ, "LNN_CACHE_DIR": str(tmp_path)}
    env.pop("NUMBA_CACHE_DIR", None)
    runs = [subprocess.run([sys.executable, "-c", PROGRAM_IN_A_FRESH_PROCESS], env=env, capture_output=True,
                           text=True, timeout=300) for _ in range(2)]
    for run in runs:
        assert run.returncode == 0, run.stderr
    first, second = (json.loads(run.stdout.splitlines()[-1]) for run in runs)
    assert first["program"] and second["program"] and first["same"] and second["same"]
    assert first["loaded"] == 0 and second["loaded"] == 2
    assert len(list((tmp_path / "numba" / "lnn-programs").glob("lnn_program_*.py"))) == 2     # serve and run_call


def test_a_program_that_cannot_be_built_leaves_the_python_hand_off(monkeypatch):
    programs = programs_or_skip()
    from lnn.runtime.cpu.backend import PROGRAM_AT_RUN

    def broken(*source_and_function_or_kind):
        raise OSError("no room left")

    monkeypatch.setattr(programs, "_compiled", broken)
    monkeypatch.setattr(programs, "step_caller", broken)      # (a kind's caller compiled before is kept in a cache)
    input_shape, layers = CASES["conv_winograd_channels_pool"]
    model = parse_model({"input_shape": input_shape, "layers": layers})
    weights = random_weights(model, np.random.default_rng(5))
    split, one = split_backend(model, weights, 2), split_backend(model, weights, 1)
    x = np.random.default_rng(6).standard_normal((1, *input_shape)).astype(np.float32)
    with pytest.warns(RuntimeWarning, match="one-thread program could not be built .*no room left"):
        with pytest.warns(RuntimeWarning, match="helper program could not be built .*no room left"):
            for _ in range(PROGRAM_AT_RUN + 1):
                np.testing.assert_allclose(split.run(x), one.run(x), rtol=0, atol=SPLIT_TOLERANCE)
    assert split._plan(1, 2).program is None and one._plan(1, 1).alone is None


def test_helper_programs_of_threads_sharing_a_backend_give_each_its_own_answers():
    """Four threads call one 2-thread backend of Winograd convs: each thread's plans have their own program, the one
    helper is lent to whichever thread's call holds the crew (leaving another thread's program), and a call that
    finds the crew busy runs its tasks itself. Every answer is that thread's own."""
    programs_or_skip()
    input_shape, layers = CASES["conv_winograd_channels_pool"]
    model = parse_model({"input_shape": input_shape, "layers": layers + [{"type": "flatten"},
                                                                       {"type": "linear", "out_features": 10}]})
    weights = random_weights(model, np.random.default_rng(11))
    shared = split_backend(model, weights, 2)
    alone = split_backend(model, weights, 1)
    per_thread = [[np.random.default_rng(100 * t + c).standard_normal((1, *input_shape)).astype(np.float32)
                   for c in range(60)] for t in range(4)]
    expected = [[alone.run(x).copy() for x in xs] for xs in per_thread]
    wrong, errors, split_plans = answers_in_threads(shared.run, per_thread, expected,
                                                    after=lambda: shared._plan(1, 2))     # each thread's own
    assert not errors and not wrong, (errors, wrong[:5])
    assert any(plan.program is not None for plan in split_plans), "no thread's plan got a program"


@pytest.mark.parametrize("case", ["conv_im2col_pool", "conv_winograd_rows_pool", "conv_depthwise_channels",
                                  "conv_chain_then_linear"])
@pytest.mark.parametrize("batch", [1, 3])
def test_a_one_thread_plan_runs_as_one_program_with_the_same_bytes(case, batch):
    """From a one-thread plan's PROGRAM_AT_RUN'th run its steps run in one compiled call (programs.StepsProgram): the
    same kernels on the same buffers, so the same bytes as the steps called one by one from Python; where every step
    is a kernel, the whole plan is one segment."""
    programs_or_skip()
    from lnn.runtime.cpu.backend import PROGRAM_AT_RUN
    from lnn.runtime.cpu.parallel import Claimed, all_steps

    input_shape, layers = CASES[case]
    model = parse_model({"input_shape": input_shape, "layers": layers})
    backend = split_backend(model, random_weights(model, np.random.default_rng(5)), 1)
    inputs = np.random.default_rng(6).standard_normal((4, batch, *input_shape)).astype(np.float32)
    one_by_one = [backend.run(x).copy() for x in inputs[:PROGRAM_AT_RUN - 1]]
    plan = backend._plan(batch, 1)
    assert plan.alone is None
    one_by_one += [backend.run(x).copy() for x in inputs[PROGRAM_AT_RUN - 1:]]
    program = plan.alone
    assert program is not None
    plan.alone = None
    for x, answer in zip(inputs, one_by_one):
        np.testing.assert_array_equal(answer, backend.run(x))       # the steps from Python again: the same bytes
    if not any(type(step) is Claimed for step in all_steps(plan.steps)):
        assert len(program.segments) == 1 and program.segments[0].func == program.run


def test_a_one_thread_program_runs_python_steps_between_its_kernels():
    """A step that is no kernel (a Python function) runs from Python between the program's runs of kernels, in
    order."""
    programs = programs_or_skip()
    from functools import partial

    add_or_refuse = add_or_refuse_kernel()
    values, seen = np.zeros(2, np.float32), []
    steps = [partial(add_or_refuse, values, 0), lambda: seen.append(values.tolist()), partial(add_or_refuse, values, 1)]
    program = programs.build_steps_program(steps)
    assert [segment.args for segment in program.segments[::2]] == [(0, 1), (1, 2)]
    assert program.segments[1] is steps[1]
    for segment in program.segments:
        segment()
    assert seen == [[1.0, 0.0]] and values.tolist() == [1.0, 1.0]


def test_a_one_thread_program_passes_each_kind_of_argument_as_a_direct_call_does():
    """Arrays of several dtypes and dimensions, a strided view, a read-only array, and int32, int64, float32,
    float64 and bool scalars reach the kernel as they do called from Python: the same values written."""
    programs = programs_or_skip()
    from functools import partial

    import numba

    @numba.njit(nogil=True)
    def masked_add(out, mask, table, count, scale, shift, flip):
        for i in range(out.shape[0]):
            if mask[i]:
                value = table[i % table.shape[0], i % table.shape[1]] * count * scale + shift
                out[i] += -value if flip else value

    table = np.arange(6, dtype=np.float64).reshape(2, 3)
    table.flags.writeable = False
    mask = np.array([True, False, True, True, False, True])

    def steps(out):
        return [partial(masked_add, out, mask, table, np.int32(3), np.float32(0.5), 0.25, False),
                partial(masked_add, out[::2], mask[1:4], table[:, ::2], 7, np.float32(-1.5), -2.0, np.bool_(True))]

    direct, programmed = np.zeros(6, np.float32), np.zeros(6, np.float32)
    for step in steps(direct):
        step()
    program = programs.build_steps_program(steps(programmed))
    assert [segment.func for segment in program.segments] == [program.run]
    for segment in program.segments:
        segment()
    assert direct.any()
    np.testing.assert_array_equal(programmed, direct)


def test_an_error_in_a_one_thread_program_is_raised_and_the_next_run_works():
    programs = programs_or_skip()
    from functools import partial

    add_or_refuse = add_or_refuse_kernel()
    values = np.zeros(2, np.float32)
    program = programs.build_steps_program([partial(add_or_refuse, values, 0), partial(add_or_refuse, values, 1)])
    values[1] = -5.0
    with pytest.raises(ValueError, match="a negative value"):
        program.run(0, 2)
    assert values.tolist() == [1.0, -5.0]
    values[1] = 0.0
    program.run(0, 2)
    assert values.tolist() == [2.0, 1.0]


def test_a_one_thread_call_takes_the_gil_a_few_times_not_once_a_step():
    """Beside a thread running Python, a call waits for the GIL each time it takes it back (up to a switch interval,
    here 20 ms). With its steps called one by one from Python that was once a step (the bundled model's batch of 8,
    116 steps: 616 ms a call against 16 alone, by hand); in one program it is a few times a call."""
    programs_or_skip()
    import threading
    import time

    from lnn.runtime.cpu.backend import PROGRAM_AT_RUN

    input_shape = [8, 12, 12]
    model = parse_model({"input_shape": input_shape, "layers": [conv(8, padding=1, activation="relu")] * 12})
    backend = split_backend(model, random_weights(model, np.random.default_rng(5)), 1)
    x = np.random.default_rng(6).standard_normal((2, *input_shape)).astype(np.float32)
    for _ in range(PROGRAM_AT_RUN):
        backend.run(x)
    plan = backend._plan(2, 1)
    assert plan.alone is not None and len(plan.steps) >= 24
    stop, interval = threading.Event(), sys.getswitchinterval()

    def python_loop():
        while not stop.is_set():
            sum(range(1000))

    def slowest_of_three_calls() -> float:
        seconds = []
        for _ in range(3):
            start = time.perf_counter()
            backend.run(x)
            seconds.append(time.perf_counter() - start)
        return max(seconds)

    program = plan.alone
    sys.setswitchinterval(0.02)
    busy = threading.Thread(target=python_loop)
    busy.start()
    try:
        for _ in range(5):              # a loaded machine may keep the loop off its CPU: then nothing waits
            plan.alone = program
            in_one_program = slowest_of_three_calls()
            plan.alone = None
            step_by_step = slowest_of_three_calls()
            if step_by_step > 0.3:
                break
    finally:
        plan.alone = program
        stop.set()
        busy.join()
        sys.setswitchinterval(interval)
    if step_by_step <= 0.3:
        pytest.skip("the Python loop never held the steps called from Python up: this machine shows nothing here")
    assert in_one_program < 0.2, (in_one_program, step_by_step)
