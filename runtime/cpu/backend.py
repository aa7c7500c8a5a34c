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
input buffer and run the steps: no allocation. keep=(node names): fusion stops at those nodes and
the plan copies their values into buffers of their own, which run_with_features() returns (the
out-of-distribution gate's features; runtime/features.py). run() returns the plan's output buffer
itself, which the next call of the same thread overwrites (Session.run copies it).

Threads: a backend (so a Session) is safe to share. Each calling thread has its own plans and split
outputs (runtime/plans.py), so concurrent calls never touch each other's buffers and run in parallel
(the kernels and BLAS release the GIL). The BLAS thread count is process-wide: overlapping calls
share one setting (BlasThreads below), which changes speed, never results.

threads=N > 1: a batch worth at least MIN_SPLIT_FLOPS is split into up to N parts, each run by its
own plan on its own worker thread with one BLAS thread (the kernels release the GIL). On these small
products multi-threaded BLAS gained little, while splitting the batch scales with the cores (2 cores:
leaf_cnn at batch 4 took 4.2 ms instead of 7.3). Smaller calls, where thread hand-offs cost more than
they save (mnist_cnn at batch 32), run on one plan with N BLAS threads.

Adding an op: one file here with a layer class (`__init__(node, weights)`, `out_shape`,
`plan(src, new_buffer) -> (dst, steps)`) and one line in LAYERS.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from functools import partial

import numpy as np

from lnn.formats.model import Model
from lnn.formats.ops import ACTIVATIONS
from lnn.runtime.cpu import cache
from lnn.runtime.cpu.activations import NONE, ActivationLayer, is_monotone
from lnn.runtime.cpu.batchnorm import BatchNormLayer, scale_and_shift
from lnn.runtime.cpu.conv1d import Conv1dLayer
from lnn.runtime.cpu.conv2d import Conv2dLayer
from lnn.runtime.cpu.flatten import FlattenLayer
from lnn.runtime.cpu.jit import CACHE_ENABLED
from lnn.runtime.cpu.linear import LinearLayer
from lnn.runtime.cpu.padding import padded_buffer
from lnn.runtime.cpu.pool import (AvgPool1dLayer, AvgPool2dLayer, GlobalAvgPoolLayer, GlobalMaxPoolLayer,
                                  MaxPool1dLayer, MaxPool2dLayer)
from lnn.runtime.plans import PerThreadCache
from lnn.runtime.features import LayerOutputs, check_kept

LAYERS = {
    "linear": LinearLayer,
    "conv1d": Conv1dLayer,
    "conv2d": Conv2dLayer,
    "maxpool1d": MaxPool1dLayer,
    "avgpool1d": AvgPool1dLayer,
    "maxpool2d": MaxPool2dLayer,
    "avgpool2d": AvgPool2dLayer,
    "global_avg_pool": GlobalAvgPoolLayer,
    "global_max_pool": GlobalMaxPoolLayer,
    "flatten": FlattenLayer,
    "batchnorm": BatchNormLayer,
    **{kind: ActivationLayer for kind in ACTIVATIONS},
}
IDENTITY_AT_INFERENCE = {"dropout"}
PLANS_KEPT = 4          # batch sizes whose buffers stay allocated
MIN_SPLIT_FLOPS = 250e6  # a call is split across threads from this much work on (measured on 2 cores)
ALIGNMENT = 64          # bytes


class Plan:
    def __init__(self, layers: list, input_shape: tuple, batch: int, kept_after: dict | None = None):
        first_padding = getattr(layers[0], "input_padding", (0, 0)) if layers else (0, 0)
        _, self.input = padded_buffer((batch, *input_shape), *first_padding, self._new_buffer)
        self.steps = []
        self.kept = {}                   # kept node name -> its own buffer, filled right after its layer
        x = self.input
        for index, layer in enumerate(layers):
            x, steps = layer.plan(x, self._new_buffer)
            self.steps += steps
            for name in (kept_after or {}).get(index, ()):
                copy = self.kept[name] = self._new_buffer(x.shape)
                self.steps.append(partial(np.copyto, copy, x))
        self.output = x

    @staticmethod
    def _new_buffer(shape) -> np.ndarray:
        """An uninitialized float32 buffer starting on a 64-byte boundary (a cache line; aligned vector
        stores in the kernels, and BLAS ran the first conv of leaf_cnn ~15% faster on it)."""
        size = int(np.prod(shape))
        raw = np.empty(size + ALIGNMENT // 4, np.float32)
        start = (-raw.ctypes.data % ALIGNMENT) // 4
        return raw[start:start + size].reshape(shape)

    def run(self, x: np.ndarray) -> np.ndarray:
        np.copyto(self.input, x)
        for step in self.steps:
            step()
        return self.output


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
        if (node.op == "batchnorm" and isinstance(previous, (Conv2dLayer, LinearLayer))
                and previous.epilogue.code == NONE and not getattr(previous, "has_pool", False)):
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


class CpuBackend:
    name = "cpu"

    def __init__(self, model: Model, weights: dict, threads: int | None = None, keep: tuple = ()):
        self.model = model
        self.threads = threads
        outputs = LayerOutputs(check_kept(model, keep))
        self.layers = build_layers(model, weights, outputs)
        self._kept_after = outputs.kept_after()
        kept_shapes = {node.name: node.out_shape for node in model.nodes if node.name in outputs.keep}
        self._plans = PerThreadCache(lambda key: Plan(self.layers, model.input_shape, key[0], self._kept_after),
                                     PLANS_KEPT * (threads or 1))                                  # (batch, part)
        self._outputs = PerThreadCache(                                    # batch -> (output, kept) of split runs
            lambda batch: (np.empty((batch, *model.output_shape), np.float32),
                           {name: np.empty((batch, *shape), np.float32) for name, shape in kept_shapes.items()}),
            PLANS_KEPT)
        self._flops_per_row = sum(node.flops for node in model.nodes)
        self._blas_limit = _blas_thread_limit(threads)
        self._blas_single = _blas_thread_limit(1) if threads and threads > 1 else None
        self._workers = ThreadPoolExecutor(threads, thread_name_prefix="lnn-cpu") if self._blas_single else None
        self.compile_seconds: float | None = None     # set by warmup(): first-call compile or cache load

    def _plan(self, batch: int, part: int = 0) -> Plan:
        return self._plans.get((batch, part))

    def run(self, x: np.ndarray) -> np.ndarray:
        """x: C-contiguous float32 [N, *input_shape] -> the plan's output buffer [N, *output_shape]."""
        return self.run_with_features(x)[0]

    def run_with_features(self, x: np.ndarray) -> tuple:
        """(output, {kept node name: its value [N, ...]}), both the plan's buffers (overwritten by the next call)."""
        batch = x.shape[0]
        if self._workers is not None and batch > 1 and batch * self._flops_per_row >= MIN_SPLIT_FLOPS:
            return self._run_split(x)
        plan = self._plan(batch)
        if self._blas_limit is None:
            return plan.run(x), plan.kept
        with self._blas_limit():
            return plan.run(x), plan.kept

    def _run_split(self, x: np.ndarray) -> tuple:
        batch = x.shape[0]
        bounds = np.linspace(0, batch, min(self.threads, batch) + 1).astype(int)
        parts = [(self._plan(stop - start, part), start, stop)            # planned here, not in the workers
                 for part, (start, stop) in enumerate(zip(bounds[:-1], bounds[1:]))]
        output, kept = self._outputs.get(batch)

        def run_part(plan: Plan, start: int, stop: int) -> None:
            output[start:stop] = plan.run(x[start:stop])
            for name, value in plan.kept.items():
                kept[name][start:stop] = value

        with self._blas_single():
            for done in [self._workers.submit(run_part, *part) for part in parts]:
                done.result()
        return output, kept

    def warmup(self, batch: int = 1) -> float:
        """Compile (or load from the cache) every kernel this model uses; return and record the seconds it took.

        Measured as the first run minus a second, warm run, so it excludes the inference itself."""
        x = np.random.default_rng(0).standard_normal((batch, *self.model.input_shape)).astype(np.float32)
        start = time.perf_counter()
        self.run(x)
        first = time.perf_counter() - start
        start = time.perf_counter()
        self.run(x)
        self.compile_seconds = max(0.0, first - (time.perf_counter() - start))
        if CACHE_ENABLED:
            cache.mark_cached(self.model)
        return self.compile_seconds


def _blas_thread_limit(threads: int | None):
    """A context-manager factory limiting BLAS to `threads` (None: leave BLAS alone)."""
    if threads is None:
        return None
    if threads < 1:
        raise ValueError(f"threads must be a positive integer, not {threads!r}")
    return partial(BLAS_THREADS.limit, threads)


class BlasThreads:
    """The BLAS libraries' thread count, set for the length of a call and restored after it.

    It sets and restores each library's count directly (about 2 us a call): threadpoolctl's `limit()`
    context re-inspects the libraries each time (about 14 us). The count is process-wide, so calls
    overlapping from several threads share it: the first to enter saves the count, the last to leave
    restores it, each entry sets its own count meanwhile (tests/runtime/test_threads.py checks that
    the results do not change)."""

    def __init__(self):
        self._lock = threading.Lock()
        self._libraries = None
        self._active = 0
        self._saved: list = []

    @contextmanager
    def limit(self, threads: int):
        with self._lock:
            if self._libraries is None:
                from threadpoolctl import ThreadpoolController

                self._libraries = ThreadpoolController().select(user_api="blas").lib_controllers
            if self._active == 0:
                self._saved = [library.get_num_threads() for library in self._libraries]
            self._active += 1
            for library in self._libraries:
                library.set_num_threads(threads)
        try:
            yield
        finally:
            with self._lock:
                self._active -= 1
                if self._active == 0:
                    for library, count in zip(self._libraries, self._saved):
                        library.set_num_threads(count)


BLAS_THREADS = BlasThreads()
