"""The static training plan: a model description compiled into fixed buffers and a fixed schedule.

Built once for a batch size N (smaller last batches use the first rows of the same memory):
  - every learned parameter is a view into ONE flat buffer, every gradient a view into another
    (optimizer update and global-norm clipping are single passes); batch-norm running statistics
    live in a third flat buffer (never touched by the optimizer or weight decay);
  - the schedule is forward 0..L-1 (time 0..L-1), loss (time L), backward L-1..0 (time 2L-i);
  - every activation, activation gradient and kernel workspace gets a lifetime [first, last] from
    that schedule and a place in ONE pool, assigned greedily (largest first, lowest offset that
    does not overlap a buffer alive at the same time). `memory_report()` gives the pooled size
    next to the naive sum, and the plan's total; `plan_memory()` computes it without allocating.
Flatten costs nothing (its output is a reshaped view of its input). Layers before the first one
with parameters get no backward, and the first layer with parameters computes no input gradient.
With cross-entropy, a final softmax (a last softmax layer or a softmax activation on the last
layer) is folded into the loss during training (the loss wants logits); prediction applies it.
Mixed precision (amp "fp16" or "bf16"; True means "fp16"): activations, their gradients and a 16-bit copy of
the parameters in float16 or bfloat16 (ml_dtypes' dtype: NumPy has none), the same kernels and the same bytes
for both; master parameters, gradients for the optimizer and all statistics in float32.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import partial

import numpy as np

from lnn.formats.errors import LnnError
from lnn.formats.model import Model
from lnn.formats.ops import get_op
from lnn.runtime.cuda import blas, conv_gemm    # the rules and the sizing only: importing them imports no CuPy
from lnn.runtime.cuda.float16 import AMP_PRECISIONS, HALF_TYPES, bfloat16
from lnn.train.layers import COMPUTE, Call, make_layers

POOL_ALIGN = 256            # bytes: every pooled buffer starts on this boundary
PARAM_ALIGN = 64            # elements: every parameter starts on this boundary in the flat buffers


def _align(n: int, a: int) -> int:
    return (n + a - 1) // a * a


@dataclass
class Slot:
    """Where a parameter lives in its flat buffer."""
    key: str
    offset: int
    shape: tuple

    @property
    def size(self) -> int:
        return math.prod(self.shape)


@dataclass
class BufferSpec:
    name: str
    shape_of: object         # n -> shape
    dtype: np.dtype
    first: int
    last: int
    offset: int = 0

    def nbytes(self, n: int) -> int:
        return math.prod(self.shape_of(n)) * self.dtype.itemsize


def _batched(shape: tuple, n: int) -> tuple:
    return (n,) + tuple(shape)


def _workspace_shape(layer, ws_name: str, n: int) -> tuple:
    return next(shape for name, shape, _, _ in layer.workspaces(n) if name == ws_name)


def assign_offsets(buffers: list, n: int) -> int:
    """Greedy interval placement; returns the pool size in bytes. Sets each buffer's offset.

    Largest buffer first, each at the lowest offset where it overlaps no placed buffer whose lifetime
    overlaps its own (first fit). Every buffer is compared with all placed before it, as in TFLite's
    arena planner; the comparison and the gap search run in NumPy over sizes computed once, so a
    2,000-layer model plans in a fraction of a second (it took 14 s in Python loops)."""
    sizes = {id(buf): _align(buf.nbytes(n), POOL_ALIGN) for buf in buffers}
    order = sorted(buffers, key=lambda b: (-sizes[id(b)], b.name))
    firsts, lasts = np.empty(len(order), np.int64), np.empty(len(order), np.int64)
    starts, ends = np.empty(len(order), np.int64), np.empty(len(order), np.int64)
    for count, buf in enumerate(order):
        size = sizes[id(buf)]
        live = (firsts[:count] <= buf.last) & (lasts[:count] >= buf.first)
        busy_starts, busy_ends = starts[:count][live], ends[:count][live]
        offset = 0
        if busy_starts.size:
            by_start = np.lexsort((busy_ends, busy_starts))
            busy_starts, busy_ends = busy_starts[by_start], busy_ends[by_start]
            lowest = np.concatenate(([0], np.maximum.accumulate(busy_ends)))   # lowest free offset before gap i
            fits = lowest[:-1] + size <= busy_starts
            offset = int(lowest[np.argmax(fits)] if fits.any() else lowest[-1])
        buf.offset = offset
        firsts[count], lasts[count], starts[count], ends[count] = buf.first, buf.last, offset, offset + size
    return int(ends.max(initial=0))


def amp_precision(amp) -> str | None:
    """The amp precision asked for: None (no amp) for False or None, "fp16" for True or "fp16", "bf16" for "bf16"."""
    if amp is None or amp is False:
        return None
    if amp is True:
        return "fp16"
    if isinstance(amp, str) and amp in AMP_PRECISIONS:
        return amp
    raise LnnError(f"amp must be one of {', '.join(AMP_PRECISIONS)} (True means fp16), not {amp!r}")


def amp_dtype(precision: str) -> np.dtype:
    """The activations' dtype of an amp precision."""
    if AMP_PRECISIONS[precision] == "float16":
        return np.dtype(np.float16)
    dtype = bfloat16()
    if dtype is None:
        raise LnnError("amp bf16 needs the ml_dtypes package for bfloat16 arrays (NumPy has none): "
                       "pip install ml_dtypes")
    return dtype


OPTIMIZER_STATE_COPIES = {"sgd": lambda cfg: 1 if cfg.get("momentum", 0) else 0, "adam": lambda cfg: 2,
                          "adamw": lambda cfg: 2}


class Plan:
    def __init__(self, model: Model, batch_size: int, dtype="float32", amp=False, inspect: bool = False,
                 input_gradient: bool = False, implicit_conv: bool = False):
        if batch_size < 1:
            raise ValueError("batch_size must be at least 1")
        self.model = model
        self.batch_size = batch_size
        self.param_dtype = np.dtype(dtype)
        self.amp = amp_precision(amp)                  # None, "fp16" or "bf16"
        self.compute_dtype = amp_dtype(self.amp) if self.amp else self.param_dtype
        self.stat_dtype = np.dtype(np.float64 if self.param_dtype == np.float64 else np.float32)   # losses, norms, targets
        self.inspect = inspect
        self.input_gradient = input_gradient       # also compute dL/d(input) into "grad:-1" (tests, saliency)
        self.layers = make_layers(model.nodes)
        self.num_layers = len(self.layers)
        self.conv_scratch = 0           # bytes the implicit-GEMM convolutions hold outside the pool
        self.gemm_workspace = blas.WORKSPACE_BYTES if implicit_conv else 0    # GPU: cuBLAS's own (runtime/cuda/blas.py)
        # NumPy's dropout hashes a uint32 element index it is given; the GPU kernel hashes its own thread's index
        dropout_sizes = [math.prod(node.out_shape) for node in model.nodes if node.op == "dropout"]
        self.dropout_index_size = 0 if implicit_conv else batch_size * max(dropout_sizes, default=0)
        if implicit_conv and self.compute_dtype.name in ("float32",) + HALF_TYPES:
            self._use_implicit_conv()
        self._layout_parameters()
        self._fold_final_softmax()
        self._schedule()
        self.pool_bytes = assign_offsets(list(self.buffers.values()), batch_size)
        self.xp = None

    # ------------------------------------------------------------------ layout

    def _layout_parameters(self):
        self.param_slots, self.stat_slots = {}, {}
        self.layer_params, self.layer_stats = [], []
        params_size = stats_size = 0
        for node in self.model.nodes:
            buffers = set(get_op(node.op).buffer_names())
            mine_p, mine_s = {}, {}
            for name, shape in node.param_shapes.items():
                key = node.param_key(name)
                if name in buffers:
                    self.stat_slots[key] = mine_s[name] = Slot(key, stats_size, shape)
                    stats_size = _align(stats_size + math.prod(shape), PARAM_ALIGN)
                else:
                    self.param_slots[key] = mine_p[name] = Slot(key, params_size, shape)
                    params_size = _align(params_size + math.prod(shape), PARAM_ALIGN)
            self.layer_params.append(mine_p)
            self.layer_stats.append(mine_s)
        self.params_size, self.stats_size = max(params_size, 1), max(stats_size, 1)
        self.num_learned = sum(s.size for s in self.param_slots.values())

    def _use_implicit_conv(self):
        """GPU float32, float16 or bfloat16: convolutions that qualify run as implicit GEMM (no im2col workspaces)."""
        for node, layer in zip(self.model.nodes, self.layers):
            if node.op == "conv2d" and conv_gemm.supported(node.attrs):
                layer.use_implicit_gemm(self.compute_dtype)
                self.conv_scratch += conv_gemm.scratch_bytes(node.attrs, node.in_shape, node.out_shape,
                                                            self.compute_dtype)

    def _fold_final_softmax(self):
        """With cross-entropy the loss takes the logits: a trailing softmax is skipped in training."""
        last = self.model.nodes[-1]
        self.final_softmax_layer = self.final_softmax_activation = False
        if self.model.loss == "cross_entropy":
            if last.op == "softmax":
                self.final_softmax_layer = True
            elif (last.attrs.get("activation") or {}).get("type") == "softmax":
                self.final_softmax_activation = True

    def _schedule(self):
        L = self.num_layers
        has_params = [bool(p) for p in self.layer_params]
        # backward of layer i runs when some layer <= i learns; it computes dx when some layer < i learns
        self.runs_backward = [self.input_gradient or any(has_params[:i + 1]) for i in range(L)]
        self.computes_dx = [self.input_gradient or any(has_params[:i]) for i in range(L)]
        self.trains_alias = [layer.alias or (i == L - 1 and self.final_softmax_layer)
                             for i, layer in enumerate(self.layers)]

        # base buffer of every activation / gradient name (aliases resolved)
        base = {}
        specs = {name: (partial(_batched, self.model.input_shape), self.compute_dtype) for name in ("act:-1", "grad:-1")}
        for i, node in enumerate(self.model.nodes):
            specs[f"act:{i}"] = specs[f"grad:{i}"] = (partial(_batched, node.out_shape), self.compute_dtype)
        for i in range(L):
            if self.trains_alias[i]:
                base[f"act:{i}"] = base.get(f"act:{i - 1}", f"act:{i - 1}")
        for i in reversed(range(L)):
            if self.trains_alias[i] and (self.runs_backward[i - 1] if i > 0 else self.input_gradient):
                base[f"grad:{i - 1}"] = base.get(f"grad:{i}", f"grad:{i}")
        self.base = base

        touches = {}

        def touch(name, t):
            name = base.get(name, name)
            first, last = touches.get(name, (t, t))
            touches[name] = (min(first, t), max(last, t))

        touch("act:-1", 0)                       # the normalized input batch, written before layer 0
        self.workspace_names = []
        for i, layer in enumerate(self.layers):
            t_fwd, t_bwd = i, 2 * L - i
            names = {}
            for ws_name, shape, dtype, phase in layer.workspaces(self.batch_size):
                full = f"ws:{i}:{ws_name}"
                names[ws_name] = full
                ws_dtype = self.compute_dtype if dtype == COMPUTE else np.dtype(dtype)
                specs[full] = (partial(_workspace_shape, layer, ws_name), ws_dtype)
                if phase in ("forward", "saved"):
                    touch(full, t_fwd)
                if phase in ("backward", "saved") and self.runs_backward[i]:
                    touch(full, t_bwd)
                if phase == "input_gradient" and self.computes_dx[i]:
                    touch(full, t_bwd)
            self.workspace_names.append(names)
            if self.trains_alias[i]:
                continue
            touch(f"act:{i - 1}", t_fwd)
            touch(f"act:{i}", t_fwd)
            if self.runs_backward[i]:
                touch(f"grad:{i}", t_bwd)
                if self.computes_dx[i]:
                    touch(f"grad:{i - 1}", t_bwd)
                if layer.needs_input:
                    touch(f"act:{i - 1}", t_bwd)
                if layer.needs_output:
                    touch(f"act:{i}", t_bwd)
        last = base.get(f"act:{L - 1}", f"act:{L - 1}")
        touch(last, L)
        if self.runs_backward[L - 1]:
            touch(f"grad:{L - 1}", L)

        self.buffers = {}
        for name, (first, last_t) in touches.items():
            if self.inspect:                      # keep everything alive: inspectable after the step
                first, last_t = 0, 2 * L
            shape_of, dtype = specs[name]
            self.buffers[name] = BufferSpec(name, shape_of, np.dtype(dtype), first, last_t)

    # ------------------------------------------------------------------ memory

    def memory_report(self, optimizer: dict | None = None) -> dict:
        """Bytes of everything the plan allocates at its batch size (numbers, no allocation)."""
        optimizer = optimizer or self.model.optimizer
        n = self.batch_size
        p_item = self.param_dtype.itemsize
        params = self.params_size * p_item
        stats = self.stats_size * p_item
        grads = self.params_size * p_item
        state = OPTIMIZER_STATE_COPIES[optimizer["type"]](optimizer) * self.params_size * p_item
        compute_copies = 2 * self.params_size * self.compute_dtype.itemsize if self.amp else 0
        naive = sum(b.nbytes(n) for b in self.buffers.values())
        input_item = 1 if self.model.takes_images else self.compute_dtype.itemsize     # uint8 images, float series
        batch_data = n * math.prod(self.model.input_shape) * input_item + n * 8      # + int64 labels
        report = {
            "batch_size": n,
            "params": params,
            "running_stats": stats,
            "grads": grads,
            "optimizer_state": state,
            "amp_copies": compute_copies,
            "activations_naive": naive,
            "activations_pooled": self.pool_bytes,
            "conv_scratch": self.conv_scratch,
            "gemm_workspace": self.gemm_workspace,
            "dropout_index": 4 * self.dropout_index_size,
            "batch_data": batch_data,
        }
        report["peak"] = (params + stats + grads + state + compute_copies + self.pool_bytes + self.conv_scratch
                          + self.gemm_workspace + report["dropout_index"] + batch_data)
        report["layers"] = self.layer_memory(optimizer)
        return report

    def layer_memory(self, optimizer: dict) -> list:
        """Per layer ("input" first), bytes at the plan's batch size: `activations` (its output as the plan holds
        it, none for a layer whose output is its input's view, plus its saved workspaces), `gradients` (the
        gradient of its output, and of its parameters), `optimizer_state` (of its parameters). The pool holds
        only the buffers alive at once, so the pooled total is less than the sum of the columns."""
        n, p_item = self.batch_size, self.param_dtype.itemsize
        copies = OPTIMIZER_STATE_COPIES[optimizer["type"]](optimizer)

        def held(name):
            return self.buffers[name].nbytes(n) if name in self.buffers and self.base.get(name, name) == name else 0

        rows = [{"name": "input", "activations": held("act:-1"), "gradients": held("grad:-1"), "optimizer_state": 0}]
        for i, node in enumerate(self.model.nodes):
            learned = sum(slot.size for slot in self.layer_params[i].values()) * p_item
            workspaces = sum(held(full) for full in self.workspace_names[i].values())
            rows.append({"name": node.name, "activations": held(f"act:{i}") + workspaces,
                         "gradients": held(f"grad:{i}") + learned, "optimizer_state": copies * learned})
        return rows

    # ------------------------------------------------------------------ allocation and views

    def allocate(self, xp):
        """Allocate the pool and the flat buffers on `xp` (numpy or cupy). Parameters start at zero."""
        self.xp = xp
        self.pool = xp.empty(max(self.pool_bytes, POOL_ALIGN), dtype=np.uint8)
        self.params = xp.zeros(self.params_size, dtype=self.param_dtype)
        self.grads = xp.zeros(self.params_size, dtype=self.param_dtype)
        self.stats = xp.zeros(self.stats_size, dtype=self.param_dtype)
        if self.amp:
            self.params_compute = xp.zeros(self.params_size, dtype=self.compute_dtype)
            self.grads_compute = xp.zeros(self.params_size, dtype=self.compute_dtype)
        else:
            self.params_compute, self.grads_compute = self.params, self.grads
        self.dropout_index = xp.arange(self.dropout_index_size, dtype=np.uint32) if self.dropout_index_size else None
        self._views = {}

    @staticmethod
    def _slot_views(flat, slots: dict) -> dict:
        return {name: flat[s.offset:s.offset + s.size].reshape(s.shape) for name, s in slots.items()}

    def param_views(self, flat) -> dict:
        """key -> view of a flat parameter-shaped buffer (params, grads, or optimizer state)."""
        return self._slot_views(flat, self.param_slots)

    def stat_views(self) -> dict:
        return self._slot_views(self.stats, self.stat_slots)

    def views(self, n: int) -> dict:
        """name -> view of the pool for a batch of n rows (cached for the last two n seen)."""
        if n in self._views:
            return self._views[n]
        if not 1 <= n <= self.batch_size:
            raise ValueError(f"a batch of {n} rows does not fit the plan's batch size {self.batch_size}")
        out = {}
        for name, buf in self.buffers.items():
            shape = tuple(buf.shape_of(n))
            nbytes = math.prod(shape) * buf.dtype.itemsize
            out[name] = self.pool[buf.offset:buf.offset + nbytes].view(buf.dtype).reshape(shape)
        nodes = self.model.nodes
        for i in range(self.num_layers):               # forward aliases: reshaped input
            if self.trains_alias[i]:
                out[f"act:{i}"] = out[f"act:{i - 1}"].reshape((n,) + tuple(nodes[i].out_shape))
        for i in reversed(range(self.num_layers)):      # backward aliases: reshaped output gradient
            if self.trains_alias[i] and f"grad:{i}" in out and (self.runs_backward[i - 1] if i > 0 else self.input_gradient):
                out[f"grad:{i - 1}"] = out[f"grad:{i}"].reshape((n,) + tuple(nodes[i].in_shape))
        layer_calls = []
        p_views = [self._slot_views(self.params_compute, s) for s in self.layer_params]
        g_views = [self._slot_views(self.grads_compute, s) for s in self.layer_params]
        s_views = [self._slot_views(self.stats, s) for s in self.layer_stats]
        for i in range(self.num_layers):
            layer_calls.append(dict(
                x=out[f"act:{i - 1}"], y=out[f"act:{i}"], dy=out.get(f"grad:{i}"),
                dx=out.get(f"grad:{i - 1}") if self.computes_dx[i] else None,
                params=p_views[i], grads=g_views[i], stats=s_views[i],
                ws={w: out[full] for w, full in self.workspace_names[i].items() if full in out}))
        out["calls"] = layer_calls
        if len(self._views) >= 2:
            self._views.pop(next(iter(self._views)))
        self._views[n] = out
        return out

    # ------------------------------------------------------------------ running

    def input_buffer(self, n: int):
        return self.views(n)["act:-1"]

    def output_buffer(self, n: int):
        return self.views(n)[f"act:{self.num_layers - 1}"]

    def output_grad_buffer(self, n: int):
        return self.views(n)[f"grad:{self.num_layers - 1}"]

    def forward(self, n: int, training: bool, dropout_keys: dict | None = None, predict: bool = False):
        """Run the layers on the input buffer's first n rows. predict=True applies a folded softmax."""
        views = self.views(n)
        xp = self.xp
        last = self.num_layers - 1
        for i, layer in enumerate(self.layers):
            if self.trains_alias[i] and not (predict and i == last and self.final_softmax_layer):
                continue
            call = Call(xp, key=(dropout_keys or {}).get(i, 0), index=self.dropout_index, **views["calls"][i])
            activate = not (i == last and self.final_softmax_activation and not predict)
            layer.run_forward(call, training, activate)
        return views[f"act:{last}"]

    def backward(self, n: int, dropout_keys: dict | None = None):
        """Backward from the output-gradient buffer; parameter gradients are ADDED to grads_compute."""
        views = self.views(n)
        xp = self.xp
        last = self.num_layers - 1
        for i in reversed(range(self.num_layers)):
            if not self.runs_backward[i]:
                break
            if self.trains_alias[i]:
                continue
            call = Call(xp, key=(dropout_keys or {}).get(i, 0), index=self.dropout_index, **views["calls"][i])
            layer = self.layers[i]
            layer.run_backward(call, activate=not (i == last and self.final_softmax_activation))


def plan_memory(model: Model, batch_size: int, amp=False, dtype="float32", gpu: bool = True) -> dict:
    """The training memory of `model` at `batch_size`, from the real plan, allocating nothing; `gpu`
    plans as the trainer does on the GPU (implicit-GEMM convolutions), else as on the CPU."""
    return Plan(model, batch_size, dtype=dtype, amp=amp, implicit_conv=gpu).memory_report()
