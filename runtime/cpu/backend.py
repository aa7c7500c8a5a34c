"""The Numba CPU backend: turns a Model into a list of layers, then into a fixed plan per batch size.

Load time (once):
  - dropout is dropped (identity at inference);
  - a batch norm right after a conv2d / linear layer without an activation is folded into its weight
    and bias; an activation layer right after a layer with an epilogue and no activation of its own
    becomes that epilogue's activation;
  - a conv2d followed by a padded conv2d writes into the interior of that conv's zero-padded input
    (and the plan's input buffer is the first layer's padded input when it is a padded conv2d);
  - a max-pool right after a conv2d (a maxpool1d after a conv1d) whose activation is monotone runs inside
    the conv's output step (conv2d.py explains why that is exact); an activation after that pool still
    joins the conv's epilogue (which runs after the max), a batch norm does not fold into it (a
    negative scale does not commute with the max).
First call per batch size: every buffer is allocated and every kernel call is bound to its buffers
(`steps`, argument-free callables). Later calls with that batch size copy the input into the plan's
input buffer and run the steps: no allocation after the PROGRAM_AT_RUN'th, which (on one thread) makes the
steps' compiled program (programs.build_steps_program: all the steps in one call, the GIL taken back once for
them). A layer's scratch (a conv's V, M, acc, columns: written before it is read on each call, read by no
other layer) is a piece of one block that all the plan's layers reuse, as they run one after another
(Plan._new_buffer): the bundled model's buffers at batch 1 take 4.3 MB where separate scratch buffers took 8.7,
leaf_cnn224's 10.5 where they took 17.3, and the layers find their scratch still in cache (whole calls 0.78-0.89x
the time of separate buffers, by hand: docs/BENCHMARKS.md). A split plan has one such block per thread (and one for
what the tasks of several threads share): a thread never writes the other's scratch lines. keep=(node names):
fusion stops at those nodes and the plan copies their values into buffers of their own, which
run_with_features() returns (the out-of-distribution gate's features; runtime/features.py). run() returns the
plan's output buffer itself, which the next call of the same thread overwrites (Session.run copies it).

Threads: `threads` is a count or "auto" (the default: the cores this process may run on, one per
physical core, big cores only: runtime/cores.py; lnn.runtime.resolve_threads). With threads = N > 1 the
backend owns a Crew of N - 1 helper threads (parallel.py) and BLAS runs one thread per call, so every core
runs its own share of the work:
  - one image (any call not split by batch): the plan is made with parts = N. Each conv2d's output
    channels or output rows (or, for a batch of small images, the images; conv2d.py `_parts` says
    which) and each linear layer's output features are cut into parts, each part a task with its
    own scratch buffers writing a disjoint block of the output, when the layer has at least
    MIN_TASK_FLOPS of work per part (a hand-off to a helper costs tens of microseconds); the tasks of
    a layer run at the same time and the next layer waits for all of them (a Winograd conv cut by
    output channels: two such steps per band, V by input channels, then the rest). From such a plan's
    PROGRAM_AT_RUN'th call on the crew, its helpers run their tasks inside one compiled program
    (programs.py), without the GIL. Whether a batch
    size runs that split plan or the one-thread plan is timed on its first calls (`_choose`): a
    split is kept only where it was faster; the choice is timed again after REVIEW_FIRST calls, then
    REVIEW_GROWTH times later each time, so one noisy start does not decide for good. A part computes its
    outputs exactly as one thread does, up to where BLAS's blocking of a smaller product rounds
    differently (up to 2e-6 on the reference models' and the bundled model's outputs;
    tests/runtime/test_cpu_threads.py checks 1e-5).
  - a batch worth at least MIN_SPLIT_FLOPS is instead cut into units of SPLIT_UNIT images (fewer where the
    batch is too small to give each thread one), taken in order by whichever thread of the crew is free,
    each run on that thread's plan for its size (made with parts = 1): whole images per core needed no
    hand-off per layer and halved batch-32 times on 2 cores, and units taken as threads come free keep
    every core busy where a fixed share per thread waited for the slowest (`_run_split`).
A shared backend (so a Session) stays safe: each calling thread has its own plans and split outputs
(runtime/plans.py), so concurrent calls never touch each other's buffers and run in parallel (the
kernels and BLAS release the GIL). The crew serves one call at a time; a call that finds it busy
runs its tasks in its own thread one after the other, which gives the same bytes (a core is
already busy with the other call). The BLAS thread count is process-wide: overlapping calls share
one setting (BlasThreads below), which changes speed, never results.

Adding an op: its file here holds its layer class (`__init__(node, weights)`, `out_shape`,
`plan(src, new_buffer) -> (dst, steps)`) naming the ops it runs (`ops`), and its kernels' AOT_SIGNATURES
(aot.py); a new file is also one name in the modules LAYERS is built from below. A layer that can be split also has
`flops` (per image) and takes `plan(src, new_buffer, parts)`, returning Parallel steps (parallel.py).
tests/runtime/test_cpu_backend.py fails for an op of the registry without a layer here.
"""

from __future__ import annotations

import contextlib
import ctypes
import threading
import time
from functools import partial

import numpy as np

from lnn.formats.fold import folds_into_previous
from lnn.formats.model import Model
from lnn.formats.ops import ACTIVATIONS, layer_table
from lnn.runtime import resolve_threads, warm_up_batch
from lnn.runtime.cpu import (activations, batchnorm, cache, conv1d, conv2d, flatten, layernorm, linear, photo_measures,
                              pool, programs, recurrent)
from lnn.runtime.cpu.activations import NONE, ActivationLayer, is_monotone
from lnn.runtime.cpu.batchnorm import BatchNormLayer, scale_and_shift
from lnn.runtime.cpu.conv2d import Conv2dLayer
from lnn.runtime.cpu.jit import CACHE_ENABLED, blas_libraries
from lnn.runtime.cpu.linear import LinearLayer, chain_eligible, plan_chain
from lnn.runtime.cpu.padding import padded_buffer
from lnn.runtime.cpu.parallel import Claimed, Crew, Parallel, all_steps, run_steps
from lnn.runtime.cpu.winograd import STRIP_POSITIONS, blas_product, blas_products
from lnn.runtime.plans import PerThreadCache
from lnn.runtime.trial import AlternatingTrial, trial_length
from lnn.runtime.features import LayerOutputs, check_kept

LAYERS = layer_table("CPU", [vars(module) for module in (linear, conv1d, conv2d, pool, flatten, batchnorm, layernorm,
                                                         recurrent, activations)])
IDENTITY_AT_INFERENCE = {"dropout"}
PLANS_KEPT = 4          # batch sizes whose buffers stay allocated
MIN_SPLIT_FLOPS = 250e6  # a batch is split across threads from this much work on (measured on 2 cores)
# Images in each unit of a batch split over the crew (_run_split). lnn-serve on the 2-core VM, 16 clients, 3 rounds
# of 8 s, its batches whole (2026-12-06, by hand, a first version of _run_split): units of 2 took 484.5 answers/s at
# 3.51 ms of server CPU a request, of 3 471.2 and 3.63, of 4 468.3 and 3.70; one fixed share per thread in chunks of
# 8, 4, 2 and 1, 418.3 and 4.18. This version against that one, the same way: 469.9 and 3.64 against 438.4 and 3.98
# (2026-12-07, the Zen 3 VM, by hand, medians of 4 rounds: units of 1 272.4 answers/s at 6.43 ms against 302.9 at 5.85
# for units of 2, the rounds' ratios 1.08, 1.19, 0.97, 1.02; units of 2 but the last image per thread in a unit of 1, so
# the threads end closer together, 267.9 at 6.46, and in 3 more rounds 291.9 against 285.0: not kept)
SPLIT_UNIT = 2
MIN_TASK_FLOPS = 4e6     # a layer is split into parts of at least this much work each (mnist_cnn's 7 MFLOP conv: not)
# A batch size's choice: the split plan and the one-thread plan run in turns of TRIAL_BLOCK calls in a row,
# TRIAL_BLOCKS turns each, the first call of each turn untimed (`_choose` says why). Five turns each instead of
# three kept one thread in 3 of 12 fresh processes of the bundled model on 2 threads, three in 0 of 12 (by hand)
TRIAL_BLOCK = 3
TRIAL_BLOCKS = 3
TRIAL_LENGTH = trial_length(TRIAL_BLOCK, TRIAL_BLOCKS)     # calls before the choice
SPLIT_GAIN = 0.95        # ... the split plan is kept when its fastest is below this share of the other's
# A choice is timed again (the same turns) after this many calls of its batch size, then REVIEW_GROWTH times
# later each time, up to every REVIEW_MOST calls: decided once on a process's first calls, it flipped between
# processes on the quiet 2-core VM (the bundled model, 2 threads, 8 processes: 2 kept one thread, 5.5-5.7 ms a
# call; the split ran at 4.1 ms where kept). A review runs TRIAL_BLOCKS turns of the plan not chosen too.
REVIEW_FIRST = 50
REVIEW_GROWTH = 4
REVIEW_MOST = 3200
ALIGNMENT = 64          # bytes
READ_PAST = STRIP_POSITIONS   # floats a kernel may read past a buffer's end (_aligned)
BLAS_STEPS = (np.matmul, blas_products, blas_product)   # steps that call BLAS: a plan with one holds BLAS at 1 thread
# A split plan's helper program (programs.py) is built on its second run on the crew, a plan's one-thread program on
# its second run without it: loading the helper program from the cache took 40-70 ms (the bundled model, by hand),
# and the callers of a one-thread program's kinds of steps 0.08 s (3.2 s to compile on an empty cache), which a
# process answering one photo (lnn-infer) need not pay
PROGRAM_AT_RUN = 2


class Plan:
    """The steps of one batch size. parts > 1: layers with `flops` (conv2d, linear) are cut into up to
    that many tasks of at least `task_flops` each (Parallel steps). `scratch`: the block every layer's
    scratch is a piece of (None when no layer has any)."""

    def __init__(self, layers: list, input_shape: tuple, batch: int, kept_after: dict | None = None, parts: int = 1,
                 task_flops: float = MIN_TASK_FLOPS, chains: bool = True):
        """chains: consecutive small linear layers as one kernel call (linear.plan_chain); off for --profile,
        which times each layer."""
        self.scratch = None              # worker -> the block its scratch shares across the layers (_new_buffer)
        self._scratch_used, self._scratch_most = {}, {}
        planned = (layers, input_shape, batch, kept_after or {}, parts, task_flops, chains)
        self._plan_layers(*planned)      # every buffer its own; measures each worker's largest layer scratch
        if self._scratch_most:           # zeros: what a kernel reads past its data is finite
            self.scratch = {worker: _aligned(most, np.zeros) for worker, most in self._scratch_most.items()}
            self._plan_layers(*planned)
        self.uses_blas = any(getattr(step, "func", None) in BLAS_STEPS for step in all_steps(self.steps))
        self.splits = any(type(step) is Parallel for step in self.steps)      # else no crew needed
        self.claims = any(type(step) is Claimed for step in self.steps)       # a crew helper may serve these
        self.program = None              # the helpers' tasks compiled (programs.py), from the PROGRAM_AT_RUN'th split run
        self._helpers = parts - 1
        self._split_runs = 0
        self.alone = None                # the steps as one thread runs them, compiled (programs.StepsProgram)
        self._alone_runs = 0

    def _plan_layers(self, layers, input_shape, batch, kept_after, parts, task_flops, chains) -> None:
        first_padding = getattr(layers[0], "input_padding", (0, 0)) if layers else (0, 0)
        _, self.input = padded_buffer((batch, *input_shape), *first_padding, self._new_buffer)
        self.steps = []
        self.layer_steps = []            # per layer: (first, end) indices of its steps (lnn-bench --profile)
        self.kept = {}                   # kept node name -> its own buffer, filled right after its layer
        x = self.input
        index = 0
        while index < len(layers):
            layer = layers[index]
            self._scratch_used = {}      # each layer's scratch starts at its worker's block's start
            chained = chain_length(layers, index, batch, kept_after) if chains and x.flags.c_contiguous else 0
            if chained:
                x, steps = plan_chain(layers[index:index + chained], x, self._new_buffer, parts, task_flops)
            elif hasattr(layer, "flops"):
                layer_parts = int(min(parts, max(1, layer.flops * batch // task_flops) if task_flops else parts))
                x, steps = layer.plan(x, self._new_buffer, layer_parts)
            else:
                x, steps = layer.plan(x, self._new_buffer)
            planned = max(chained, 1)                    # layers these steps compute
            end = len(self.steps) + len(steps)
            self.layer_steps += [(len(self.steps), end)] + [(end, end)] * (planned - 1)   # a chain's: all on its first
            self.steps += steps
            index += planned
            for name in kept_after.get(index - 1, ()):
                copy = self.kept[name] = self._new_buffer(x.shape)
                self.steps.append(partial(np.copyto, copy, x))
        self.output = x

    def _new_buffer(self, shape, scratch: bool = False, worker=0) -> np.ndarray:
        """An uninitialized float32 buffer starting on a 64-byte boundary (a cache line; aligned vector
        stores in the kernels, and BLAS ran the first conv of leaf_cnn ~15% faster on it). scratch: a
        layer's own working buffer, written before it is read on every call and read by no other layer
        (conv2d.py's V, M, acc, ...): a piece of the block `worker`'s scratch shares across the plan's
        layers, after the layer's other scratch of that worker (the first pass gives it a buffer of its
        own and measures). worker: the index of the task (in its Parallel step) that uses it, 0 outside
        split steps, SHARED for what the tasks of several threads write and read (Winograd's V made by
        input channels): each thread's scratch in a block of its own, so that no line of it moves between
        the cores' caches (docs/ARCHITECTURE.md: where the two cores shared no L3, tomato's split calls took
        1.31-1.61 ms so, 1.80-2.05 with one block for all)."""
        size = int(np.prod(shape))
        if not scratch:
            return _aligned(size).reshape(shape)
        start = self._scratch_used.get(worker, 0)
        self._scratch_used[worker] = start + -(-size // (ALIGNMENT // 4)) * (ALIGNMENT // 4)
        self._scratch_most[worker] = max(self._scratch_most.get(worker, 0), self._scratch_used[worker])
        if self.scratch is None:
            return _aligned(size).reshape(shape)
        return self.scratch[worker][start:start + size].reshape(shape)

    def run(self, x: np.ndarray, crew: Crew | None = None, held: bool = True) -> np.ndarray:
        """The output buffer for input x; with `crew`, its first helper serves the Claimed steps and, when
        this call holds it (held), the Parallel steps' tasks spread over it (through the plan's program once
        it has one)."""
        np.copyto(self.input, x)
        if crew is None:
            if self._alone_runs < PROGRAM_AT_RUN:
                self._alone_runs += 1
                if self._alone_runs == PROGRAM_AT_RUN:
                    self.alone = programs.build_steps_program(list(all_steps(self.steps)))
            run_steps(self.steps if self.alone is None else self.alone.segments)
            return self.output
        if held and self._split_runs < PROGRAM_AT_RUN and self.splits:
            self._split_runs += 1
            if self._split_runs == PROGRAM_AT_RUN:
                self.program = programs.build(self.steps, self._helpers)
        crew.run_steps(self.steps, held, self.program)
        return self.output


def _aligned(size: int, make=np.empty) -> np.ndarray:
    """A float32 vector of `size` (made by np.empty or np.zeros) starting on an ALIGNMENT-byte boundary, with at
    least READ_PAST floats of its allocation after it (conv_direct.py's shifted rows read up to STRIP_POSITIONS - 1
    past an image into junk outputs)."""
    raw = make(size + ALIGNMENT // 4 + READ_PAST, np.float32)
    start = (-raw.ctypes.data % ALIGNMENT) // 4
    return raw[start:start + size]


def chain_length(layers: list, start: int, batch: int, kept_after: dict) -> int:
    """How many layers from `start` on run as one chain (linear.chain_eligible; a kept value ends it)."""
    end = start
    while end < len(layers) and chain_eligible(layers[end], batch) and (end == start or end - 1 not in kept_after):
        end += 1
    return end - start


def build_layers(model: Model, weights: dict, outputs: LayerOutputs | None = None) -> list:
    """The fused layers; `outputs` (when given) records which node each layer's output is the value of,
    and fusion stops at a layer whose output is kept."""
    outputs = outputs or LayerOutputs(frozenset())
    layers = []
    for node in model.nodes:
        previous = layers[-1] if layers and outputs.may_fuse() else None
        owner_of_epilogue = isinstance(previous, (Conv2dLayer, LinearLayer, BatchNormLayer, ActivationLayer))
        if node.op in IDENTITY_AT_INFERENCE:
            outputs.skipped(node)
            continue
        previous_op = "conv2d" if isinstance(previous, Conv2dLayer) else "linear" if isinstance(previous, LinearLayer) else None
        if folds_into_previous(node, previous_op, previous_op is not None and previous.epilogue.code == NONE
                               and not getattr(previous, "has_pool", False)):
            previous.fold(*scale_and_shift(node, weights))
            previous.epilogue.set_activation(node.attrs["activation"])
            outputs.fused(node)
            continue
        if node.op in ACTIVATIONS and owner_of_epilogue and previous.epilogue.code == NONE:
            previous.epilogue.set_activation(node.attrs)
            outputs.fused(node)
            continue
        if (node.op in ("maxpool2d", "maxpool1d") and isinstance(previous, Conv2dLayer) and not previous.has_pool
                and is_monotone(previous.epilogue.code, previous.epilogue.slope)
                and (previous.epilogue.scale >= 0).all()):
            previous.fuse_max_pool(LAYERS[node.op](node, weights))
            outputs.fused(node)
            continue
        layers.append(LAYERS[node.op](node, weights))
        outputs.added(node)
    for layer, following in zip(layers, layers[1:]):
        if isinstance(layer, Conv2dLayer) and isinstance(following, Conv2dLayer):
            layer.output_padding = following.input_padding
    return layers


class ThreadFlag(threading.local):
    """A flag each thread sets for itself: off in a thread until it sets it."""
    on = False


class CpuBackend:
    name = "cpu"
    photo_statistics = staticmethod(photo_measures.copy_statistics)    # Session.check_photo's measures, compiled

    def __init__(self, model: Model, weights: dict, threads: int | str | None = "auto", keep: tuple = ()):
        """threads: a positive count or "auto" (None is "auto")."""
        self.model = model
        self.threads = resolve_threads(threads)
        outputs = LayerOutputs(check_kept(model, keep))
        self.layers = build_layers(model, weights, outputs)
        self._kept_after = outputs.kept_after()
        self.layer_nodes = outputs.members          # the nodes each fused layer computes
        kept_shapes = {node.name: node.out_shape for node in model.nodes if node.name in outputs.keep}
        self._plans = PerThreadCache(                            # (batch, parts, part) -> Plan
            lambda key: Plan(self.layers, model.input_shape, key[0], self._kept_after, key[1], self.task_flops),
            PLANS_KEPT * self.threads)
        self.task_flops = MIN_TASK_FLOPS     # 0 splits every conv and linear layer (tests, lnn-doctor): set before a run
        self._outputs = PerThreadCache(                                    # batch -> (output, kept) of split runs
            lambda batch: (np.empty((batch, *model.output_shape), np.float32),
                           {name: np.empty((batch, *shape), np.float32) for name, shape in kept_shapes.items()}),
            PLANS_KEPT)
        self._flops_per_row = sum(node.flops for node in model.nodes)
        self._crew = Crew(self.threads - 1) if self.threads > 1 else None
        self._trials: dict = {}            # batch -> its AlternatingTrial (split, one thread) while unchosen
        self._chosen: dict = {}            # batch -> parts of its plan (threads, or 1 where splitting lost)
        self._reviews: dict = {}           # batch -> [calls until its choice is timed again, the next interval]
        self._doubted: set = set()         # batch sizes whose last trial alone found the split not faster
        self._nothing_to_split: set = set()   # batch sizes whose plan has no layer worth splitting (one thread runs it)
        self._alone = ThreadFlag()             # .on: this thread's calls run on it alone (one_thread)
        BLAS_THREADS.find_libraries()
        self.compile_seconds: float | None = None     # set by warmup(): first-call compile or cache load
        self._kernels_marked = False                  # whether a call has ended (cache.mark_cached)

    def _plan(self, batch: int, parts: int = 1, part: int = 0) -> Plan:
        return self._plans.get((batch, parts, part))

    def run(self, x: np.ndarray) -> np.ndarray:
        """x: C-contiguous float32 [N, *input_shape] -> the plan's output buffer [N, *output_shape]."""
        return self.run_with_features(x)[0]

    def run_with_features(self, x: np.ndarray) -> tuple:
        """(output, {kept node name: its value [N, ...]}), both the plan's buffers (overwritten by the next call).
        The first call to end records that this model's kernels are in the cache (lnn-bench's "from the cache")."""
        result = self._run_with_features(x)
        if not self._kernels_marked:
            self._kernels_marked = True
            if CACHE_ENABLED:
                cache.mark_cached(self.model)
        return result

    @contextlib.contextmanager
    def one_thread(self):
        """Within it, the calling thread's calls run on that thread alone, on the one-thread plan of their size,
        whatever _choose or splits_batch decided, and take no turn in a trial: for a caller that times for itself
        whether the split pays under its own load (lnn-serve's lone photos while others wait)."""
        outside = self._alone.on                # a warm-up inside one caller's one_thread() keeps it on
        self._alone.on = True
        try:
            yield
        finally:
            self._alone.on = outside

    def _run_with_features(self, x: np.ndarray) -> tuple:
        batch = x.shape[0]
        alone = self._alone.on
        if self.splits_batch(batch) and not alone:
            with BLAS_THREADS:
                return self._run_split(x)
        parts = 1 if alone else self._parts(batch)
        plan = self._plan(batch, parts)
        trial = None if alone else self._trials.get(batch)
        start = time.perf_counter() if trial is not None else 0.0
        if plan.uses_blas:                  # holding BLAS at one thread costs ~15 us of CPU a call
            with BLAS_THREADS:
                self._run_plan(plan, x)
        else:
            self._run_plan(plan, x)
        if trial is not None:
            trial.took(parts, time.perf_counter() - start)
        return plan.output, plan.kept

    def splits_batch(self, batch: int) -> bool:
        """Whether calls of this batch size cut the batch into units of images taken by the crew's threads
        (_run_split): then a call of any such size needs no plan of its own, only its units' plans."""
        return self._crew is not None and batch > 1 and batch >= self._first_split_batch()

    def _first_split_batch(self) -> int:
        """The smallest batch worth MIN_SPLIT_FLOPS, 2 at least: from it on, a batch's images are split (splits_batch)."""
        return max(2, -(-int(MIN_SPLIT_FLOPS) // max(1, self._flops_per_row)))

    def _unit(self, batch: int) -> int:
        """Images in each unit of a split batch (the last may have fewer): SPLIT_UNIT, or fewer where the batch
        would not give every thread one (a batch of 2 on 2 threads: one image each)."""
        return min(SPLIT_UNIT, -(-batch // self.threads))

    def _unit_plans(self, batch: int) -> dict:
        """{(images, part): plan} for the units of a split batch, every thread's (part's) plan for each unit
        size, planned here in the calling thread's cache, not in the workers."""
        unit = self._unit(batch)
        parts = min(self.threads, -(-batch // unit))
        return {(size, part): self._plan(size, 1, part) for size in {unit, batch % unit} - {0} for part in range(parts)}

    def _parts(self, batch: int) -> int:
        """The chosen parts of a one-image batch size, or _choose's turn while it is (again) being timed."""
        chosen = self._chosen.get(batch)
        if chosen is None or batch in self._trials:
            return self._choose(batch)
        review = self._reviews.get(batch)
        if review is not None:
            review[0] -= 1
            if review[0] <= 0:
                self._trials[batch] = self._new_trial()
                return self._choose(batch)
        return chosen

    def _choose(self, batch: int) -> int:
        """parts of the plan for this call of a one-image (unsplit-batch) size: `threads` when its plan
        splits no layer or the split is forced (task_flops 0); else the split plan and the one-thread plan
        take turns (an AlternatingTrial: TRIAL_BLOCK calls in a row, TRIAL_BLOCKS turns each, the split plan
        first, a turn's first call untimed), and the faster by its fastest call is kept (the split one only
        SPLIT_GAIN faster: its tasks cost more CPU in all). After the one-thread plan a turn's first call
        finds the crew's helpers asleep (they linger 0.5 ms). Turns of one call each, as before, judged the
        split by such calls only: the bundled model on 2 threads, fresh processes on the 2-core VM, alternating
        call by call, in 2 of 3 the split's calls ran about as slowly as the one-thread plan's (2.3-2.5 ms) for most
        of the trial, and the earlier trial kept one thread in 1 of 6 (2.0-2.2 ms a call after), while the
        split ran at 1.2-1.5 ms back to back; in turns of 3, a turn's later split calls were faster than
        the one-thread turns' in all 3 processes (1.2-1.9 against 1.9-2.5 ms). The fastest, not the
        median: what slows a plan's calls here comes from outside it and only adds time. So threads > 1 is
        never kept slower than one thread where hand-offs cost more than the split saves (measured:
        leaf_cnn's layers on the 2-core VM, docs/BENCHMARKS.md). One thread is kept only when two trials in
        a row find the split not faster: one trial alone did so in about 1 of 10 fresh processes of the
        bundled model on 2 threads, where it ran 1.7x faster back to back (by hand), and a process of
        benchmarks/cpu_peers.py ran one thread to its end in 2 of 5 rounds. The choice is reviewed the same
        way after REVIEW_FIRST calls, then REVIEW_GROWTH times later each time."""
        if self._crew is None:
            self._chosen[batch] = self.threads
            return self.threads
        split_plan = self._plan(batch, self.threads)
        if not (split_plan.splits or split_plan.claims):
            self._nothing_to_split.add(batch)
        if not self.task_flops or batch in self._nothing_to_split:
            self._chosen[batch] = self.threads
            return self.threads
        trial = self._trials.get(batch)
        if trial is None:
            trial = self._trials[batch] = self._new_trial()
        if trial.done:
            fastest_split, fastest_one = (min(trial.timed[parts]) for parts in trial.ways)
            chosen = self.threads if fastest_split < SPLIT_GAIN * fastest_one else 1
            if chosen == 1 and batch not in self._doubted:    # one thread only when a second trial agrees
                self._doubted.add(batch)
                self._trials[batch] = self._new_trial()
                return self.threads
            self._doubted.discard(batch)
            self._chosen[batch] = chosen
            self._trials.pop(batch, None)
            interval = self._reviews[batch][1] if batch in self._reviews else REVIEW_FIRST
            self._reviews[batch] = [interval, min(interval * REVIEW_GROWTH, REVIEW_MOST)]
            return chosen
        return trial.next_way()

    def _new_trial(self) -> AlternatingTrial:
        return AlternatingTrial((self.threads, 1), TRIAL_BLOCK, TRIAL_BLOCKS)

    def choosing(self, batch: int) -> bool:
        """Whether calls of this batch size are still timing the split plan against the one-thread plan
        (_choose's turns, TRIAL_LENGTH + 1 calls, twice as many when the first trial finds the split not
        faster; again at each review): a warm-up before timed calls runs until this is False, so those calls
        measure the chosen plan."""
        return batch in self._trials

    def split_choice(self) -> str | None:
        """What _choose decided, in words, for the one-image calls seen so far, then from which batch size the images
        are split instead (splits_batch); None with one thread."""
        if self._crew is None:
            return None
        decided = sorted(self._chosen.items())
        images = f"batches of {self._first_split_batch()} or more: their images split over {self.threads} threads"
        if not decided:
            return (f"one image's layers: split over {self.threads} threads where timed at least "
                    f"{1 - SPLIT_GAIN:.0%} faster than one (decided after {TRIAL_LENGTH // 2} calls of each, "
                    f"{TRIAL_LENGTH} before keeping one thread); {images}")
        return "; ".join([f"batch {batch}: " + ("one thread (no layer large enough to split)"
                                                if batch in self._nothing_to_split else
                                                f"layers split over {parts} threads" if parts > 1 else
                                                "one thread (the split was not faster)")
                          for batch, parts in decided] + [images])

    def _run_plan(self, plan: Plan, x: np.ndarray) -> None:
        if plan.splits and self._crew is not None and self._crew.try_run(lambda crew: plan.run(x, crew)):
            return
        plan.run(x, self._crew if plan.claims else None, held=False)      # Claimed steps need no hold on it

    def _run_split(self, x: np.ndarray) -> tuple:
        """A batch in units of `_unit` images, in order, each taken by whichever thread of the crew is free and
        run on that thread's plan for its size; the crew busy (another call holds it): all on this thread.
        One fixed share per thread waited for the slowest: in lnn-serve a decoding thread holding up one core
        left the other spinning, then idle, until that share was done. Each image is computed as its unit's
        plan computes it, whichever thread takes it, so a call's bytes do not depend on the threads' timing."""
        batch = x.shape[0]
        unit = self._unit(batch)
        plans = self._unit_plans(batch)
        output, kept = self._outputs.get(batch)
        starts = iter(range(0, batch, unit))             # shared by the threads: a next() is one step under the GIL

        def run_units(part: int) -> None:
            for start in starts:
                stop = min(start + unit, batch)
                plan = plans[(stop - start, part)]
                output[start:stop] = plan.run(x[start:stop])
                for name, value in plan.kept.items():
                    kept[name][start:stop] = value

        tasks = [[partial(run_units, part)] for part in sorted({part for _, part in plans})]
        if not self._crew.try_run(lambda crew: crew.run(tasks)):
            run_units(0)
        return output, kept

    def profile(self, x: np.ndarray, repeats: int) -> list:
        """[(the fused layer's nodes joined by "+", its kind, median seconds, threads)] over `repeats` whole runs
        of x on the plan this batch size's calls run: where the split of one image's layers was chosen (_choose),
        the split plan, each split layer's tasks on the crew as in a call (posted to its helper program where it
        has one); threads: the tasks that layer is cut into, 1 where it is not split. A batch split by images: the
        plan of one of its units, on one thread (the threads run every layer on their units at the same time)."""
        if self.splits_batch(x.shape[0]):
            x = x[:self._unit(x.shape[0])]
            parts = 1
        else:
            parts = self._chosen.get(x.shape[0], 1)
        batch = x.shape[0]
        plan = Plan(self.layers, self.model.input_shape, batch, self._kept_after, parts, self.task_flops, chains=False)
        program = programs.build(plan.steps, parts - 1) if parts > 1 else None
        times = np.zeros((repeats, len(self.layers)))

        def timed_runs(crew: Crew | None) -> None:
            for repeat in range(repeats):
                np.copyto(plan.input, x)
                for index, (first, end) in enumerate(plan.layer_steps):
                    start = time.perf_counter()
                    if crew is None:
                        run_steps(plan.steps[first:end])
                    else:
                        crew.run_steps(plan.steps[first:end], True, program)
                    times[repeat, index] = time.perf_counter() - start
                run_steps(plan.steps[plan.layer_steps[-1][1]:] if plan.layer_steps else ())

        with BLAS_THREADS:
            if parts == 1 or not self._crew.try_run(timed_runs):
                timed_runs(None)
        threads = [max([len(step.tasks) for step in plan.steps[first:end] if type(step) is Parallel], default=1)
                   for first, end in plan.layer_steps]
        return [("+".join(nodes), type(layer).__name__.removesuffix("Layer").lower(), float(np.median(column)), count)
                for nodes, layer, column, count in zip(self.layer_nodes, self.layers, times.T, threads)]

    def warmup(self, batch: int = 1) -> float:
        """Ready the calling thread's calls of this batch size: compile (or load from the cache) every kernel this
        model uses, plan the buffers, build the split plan's helper program (at its PROGRAM_AT_RUN'th run) and make
        the split choice (`choosing`) and ready the one-thread plan (one_thread's), or, for a batch split by images,
        build every thread's unit plans and their one-thread programs, so that later calls only compute. Without
        it that work fell on the first calls that needed it: inside lnn-serve, whose warm-up ran each chunk size
        once, a helper program compiled (uncached, seconds) in a batch's call during load. Returns and records
        the compile seconds: the first two runs (the second builds the program) minus twice a warm run's."""
        x = warm_up_batch(self.model.input_shape, batch)
        first_two = 0.0
        for _ in range(2):
            start = time.perf_counter()
            self.run(x)
            first_two += time.perf_counter() - start
        while self.choosing(batch):
            self.run(x)
        if self.splits_batch(batch):          # every thread's plan for each unit size, whichever thread takes which
            for (size, _), plan in self._unit_plans(batch).items():
                for _ in range(PROGRAM_AT_RUN):
                    plan.run(x[:size])
        elif self._crew is not None:          # the one-thread plan too, which calls within one_thread() run
            with self.one_thread():
                for _ in range(PROGRAM_AT_RUN):
                    self.run(x)
        start = time.perf_counter()
        self.run(x)
        self.compile_seconds = max(0.0, first_two - 2 * (time.perf_counter() - start))
        return self.compile_seconds


class BlasThreads:
    """`with BLAS_THREADS:` the BLAS libraries held at one thread, their count restored after it (a
    class's __enter__/__exit__, not a generator context: about 1 us less per call).

    The count is process-wide, so calls overlapping from several threads share it: the first to enter
    saves the count and sets 1 (nothing to set when it is already 1), the last to leave restores it
    (tests/runtime/test_threads.py checks that the results do not change). Each library's count is
    set directly (about 2 us a call): threadpoolctl's `limit()` context re-inspects the libraries
    each time (about 14 us), which is done here when a backend is made (`find_libraries`: a BLAS
    loaded later, by SciPy say, is then held too), with a setter that works from any thread
    (`any_thread_setter`)."""

    def __init__(self):
        self._lock = threading.Lock()
        self._libraries = None           # [(threadpoolctl's controller, any_thread_setter of it), ...]
        self._active = 0
        self._saved: list = []

    def find_libraries(self) -> None:
        with self._lock:
            if self._active == 0:                  # else the next backend made finds them
                self._libraries = [(library, any_thread_setter(library)) for library in blas_libraries()]

    def __enter__(self):
        if self._libraries is None:
            self.find_libraries()
        with self._lock:
            if self._active == 0:
                self._saved = [library.get_num_threads() for library, _ in self._libraries]
                for (_, set_threads), count in zip(self._libraries, self._saved):
                    if count != 1:
                        set_threads(1)
            self._active += 1

    def __exit__(self, *exception) -> None:
        with self._lock:
            self._active -= 1
            if self._active == 0:
                for (_, set_threads), count in zip(self._libraries, self._saved):
                    if count != 1:
                        set_threads(count)


# OpenBLAS's exported names in its builds: a prefix and a suffix on every symbol (NumPy's wheels:
# scipy_openblas_..64_), tried in threadpoolctl's order
OPENBLAS_AFFIXES = tuple((prefix, suffix) for prefix in ("", "scipy_") for suffix in ("", "64_", "_64"))


def any_thread_setter(library):
    """A function setting a BLAS library's thread count that works from any thread. For OpenBLAS with its own
    threads (pthreads), its C setter openblas_set_num_threads, under the affixes of the build's getter, called
    directly: threadpoolctl's setter (3.8) lets only the first thread that sets an OpenBLAS count set it (its
    "controlling thread", the main one inside threadpool_limits) and silently does nothing in any other, so a
    call on a worker thread ran its BLAS products on every thread (two such calls at once took 2.4x as long as
    one alone, the app's compiled kernels on the 2-core VM, by hand). OpenBLAS's own setter is process-wide and
    took effect from a worker thread with NumPy 2.4's OpenBLAS 0.3.31 and NumPy 2.5's 0.3.34 (by hand). Until
    2026-12-06 lnn called openblas_set_num_threads_local, which 0.3.31 exports without the wheels' affixes and
    0.3.34 does not export: with NumPy 2.5 (Python 3.12 on) the setter was threadpoolctl's again. Else
    threadpoolctl's setter: an OpenMP build's count is the calling thread's own (the shared hold above does not
    fit it), and the other libraries have no controlling thread."""
    if library.internal_api == "openblas" and getattr(library, "threading_layer", None) == "pthreads":
        try:
            handle = ctypes.CDLL(library.filepath)
        except OSError:
            return library.set_num_threads
        for prefix, suffix in OPENBLAS_AFFIXES:
            if hasattr(handle, f"{prefix}openblas_get_num_threads{suffix}"):
                setter = getattr(handle, f"{prefix}openblas_set_num_threads{suffix}", None)
                if setter is None:
                    break
                setter.argtypes, setter.restype = [ctypes.c_int], None
                return setter
    return library.set_num_threads


BLAS_THREADS = BlasThreads()
