"""linear: x [N, in], weight [out, in], bias [out] -> y [N, out] = x @ weight.T + bias, then the activation.

Reference: formats/ops.py Linear.forward. On small batches (FUSED_MAX_BATCH) of a layer without softmax
(`LinearLayer.fused`), one kernel does it all, `linear_dots` (product, bias and
activation; no BLAS call, so a plan of such layers does not touch BLAS's thread count either): each
output is the dot product of x's row with the weight's row [in] (read in place, contiguous), four
outputs at a time, summed in vector lanes (reassociated, fused multiply-adds). With parts > 1
(backend.py) each task computes a block of the output features with it. mnist_mlp's 784 -> 256 layer at
batch 1, 1 thread (2-core AVX2 EPYC VM): 18-22 us, against 26-34 one output at a time and 27-37 for the
earlier k-outer loop that added each input's weight row into all 256 outputs (a load and a store of
each output per input). Larger batches: numpy's
BLAS (`np.matmul` into the planned output buffer) computes x @ a contiguous copy of weight.T made at
plan time (x @ the view weight.T at batch 1), one product per block of output features when split,
then the epilogue of activations.py. Batch norm after a linear layer is folded into weight and bias
at load.

Where the JIT has AVX-512 (PACKED), the small batches run `packed_dots` instead of linear_dots: the weights
packed once into blocks of 64 outputs, each block [K, 64] (`pack_weight`), so that a step over k broadcasts
x[k] and loads 64 weights from one contiguous stream into 4 registers of sums, with no sums to reduce
across lanes at the end (measures: packed_dots), and four rows of x a step where there are four (sums64x4:
each load then feeds 16 multiply-adds). It beats one-thread BLAS at every batch measured (8 to 256), so its
fused batches go up to 256 (FUSED_MAX_BATCH).
"""

from __future__ import annotations

from functools import partial

import numpy as np

from lnn.formats.fold import fold_scale_and_shift
from lnn.runtime.cpu.activations import SOFTMAX, Epilogue, activate, as_channels_positions
from lnn.runtime.cpu.aot import A1, A2, F, I
from lnn.runtime.cpu.jit import (WIDE_VECTORS, compare_and_swap, fetch_add, ieee_kernel, kernel, load16, load_acquire,
                                 monotonic_ns, sched_yield, spin_while_equal, store_release, wide_tile_kernel)
from lnn.runtime.cpu.parallel import LINGER_NS, SERVED, Claimed, parallel_steps, split_range
from lnn.runtime.cpu.winograd import fma16, zeros16

# Each kernel's ahead-of-time signature (aot.py): the argument types the backend passes; None: called
# only by other kernels, compiled into them. The chain's kernels are the JIT's only (CHAINS): the
# compiled app runs linear_dots layer by layer.
AOT_SIGNATURES = {"linear_dots": (A2, A2, A1, A1, I, F, I, I, A2), "claim_block": None, "chain_part": None,
                  "run_chain": None, "serve_chain": None,
                  # the JIT on an AVX-512 host only (PACKED)
                  "packed_dots": None, "sums64": None, "sums64x4": None, "sums16": None, "finish16": None,
                  "finish64": None}

PACKED = WIDE_VECTORS         # the fused batches' weights packed in blocks (packed_dots): the JIT on an AVX-512 host
PACK = 64                     # outputs a block (4 AVX-512 registers of sums)
# DOTS on batches this small (linear_dots: 4; packed_dots: 2.0-3.2x faster than one-thread BLAS (OpenBLAS's
# Haswell kernels here) on mnist_mlp's layers at batches 8 to 256, by hand) ...
FUSED_MAX_BATCH = 256 if PACKED else 4
# ... of any layer where DOTS reads its own weights (linear_dots), and of layers of at most this many weights
# where it reads a packed copy (PACKED) or where a chain reads a concatenated one (4 MiB; mnist_mlp's largest:
# 0.2 M): a copy of a larger layer's weights would cost more memory than BLAS's product costs time
FUSED_MAX_WEIGHTS = 1 << 20


@ieee_kernel
def linear_dots(x, weight, scale, shift, code, slope, first, end, dst):
    """x [N, K], weight [O, K] -> dst[:, first:end] = act((x @ weight[first:end].T) * scale + shift); act is
    not softmax. Outputs four at a time: each value of x's row is loaded once for four dot products over
    k (one load per product was the limit), their sums reassociated into vector lanes (@ieee_kernel). A
    last group of fewer than four reads its last row again and stores only its own outputs."""
    batch, inputs = x.shape
    last = end - 1
    for o in range(first, end, 4):
        w0, w1, w2, w3 = weight[o], weight[min(o + 1, last)], weight[min(o + 2, last)], weight[min(o + 3, last)]
        for n in range(batch):
            source = x[n]
            t0 = t1 = t2 = t3 = np.float32(0)
            for k in range(inputs):
                v = source[k]
                t0 += w0[k] * v
                t1 += w1[k] * v
                t2 += w2[k] * v
                t3 += w3[k] * v
            for i, total in enumerate((t0, t1, t2, t3)):
                if o + i < end:
                    dst[n, o + i] = activate(total * scale[o + i] + shift[o + i], code, slope)


def pack_weight(weight: np.ndarray) -> np.ndarray:
    """weight [O, K] -> packed_dots's flat blocks: outputs o..o + 63 as one [K, 64] block (row k: those outputs'
    weights for input k), the last block as wide as the outputs left, padded with zero rows to a multiple of 16."""
    outputs, inputs = weight.shape
    padded = np.zeros((-(-outputs // 16) * 16, inputs), np.float32)
    padded[:outputs] = weight
    return np.concatenate([padded[o:o + PACK].T.ravel() for o in range(0, len(padded), PACK)])


@wide_tile_kernel
def sums64(x, block):
    """x [K], block [K, 64] -> x @ block as 4 sums of 16 (registers): a step of k, one broadcast of x[k] and 4
    loads of the block's row, all from one contiguous stream."""
    a = b = c = d = zeros16()
    for k in range(x.shape[0]):
        v, row = x[k], block[k]
        a, b = fma16(a, v, load16(row, 0)), fma16(b, v, load16(row, 16))
        c, d = fma16(c, v, load16(row, 32)), fma16(d, v, load16(row, 48))
    return a, b, c, d


@wide_tile_kernel
def sums64x4(x, n, block):
    """sums64 for rows n..n + 3 of x at once: 16 registers of sums, each step's 4 loads of the block's row used
    by 4 rows (4 broadcasts), so that the multiply-adds, not the loads, set the pace."""
    a0 = b0 = c0 = d0 = a1 = b1 = c1 = d1 = a2 = b2 = c2 = d2 = a3 = b3 = c3 = d3 = zeros16()
    x0, x1, x2, x3 = x[n], x[n + 1], x[n + 2], x[n + 3]
    for k in range(block.shape[0]):
        row = block[k]
        w0, w1, w2, w3 = load16(row, 0), load16(row, 16), load16(row, 32), load16(row, 48)
        v = x0[k]
        a0, b0, c0, d0 = fma16(a0, v, w0), fma16(b0, v, w1), fma16(c0, v, w2), fma16(d0, v, w3)
        v = x1[k]
        a1, b1, c1, d1 = fma16(a1, v, w0), fma16(b1, v, w1), fma16(c1, v, w2), fma16(d1, v, w3)
        v = x2[k]
        a2, b2, c2, d2 = fma16(a2, v, w0), fma16(b2, v, w1), fma16(c2, v, w2), fma16(d2, v, w3)
        v = x3[k]
        a3, b3, c3, d3 = fma16(a3, v, w0), fma16(b3, v, w1), fma16(c3, v, w2), fma16(d3, v, w3)
    return (a0, b0, c0, d0), (a1, b1, c1, d1), (a2, b2, c2, d2), (a3, b3, c3, d3)


@wide_tile_kernel
def sums16(x, block, column):
    """x [K], block [K, width] -> x @ block[:, column:column + 16], one register."""
    a = zeros16()
    for k in range(x.shape[0]):
        a = fma16(a, x[k], load16(block[k], column))
    return a


@wide_tile_kernel
def finish16(sums, o, end, scale, shift, code, slope, target):
    """target[o + i] = act(sums[i] * scale + shift) for the outputs o + i < end."""
    for i in range(16):
        if o + i < end:
            target[o + i] = activate(sums[i] * scale[o + i] + shift[o + i], code, slope)


@wide_tile_kernel
def finish64(sums, o, end, scale, shift, code, slope, target):
    """finish16 for the 4 registers of a block's 64 sums (sums64)."""
    for i in range(4):
        finish16(sums[i], o + 16 * i, end, scale, shift, code, slope, target)


@wide_tile_kernel
def packed_dots(x, packed, scale, shift, code, slope, first, end, dst):
    """linear_dots on the weights in blocks (pack_weight): a whole block's 64 outputs at once (sums64; four rows
    at a time where there are four, sums64x4), a block's outputs first..end cuts 16 at a time (sums16). Each
    output's sum runs over k in order, the same on any split. mnist_mlp's 784 -> 256 layer (the 2-core AVX-512 VM, by hand): batch 1 6.7-7.3 us against
    linear_dots's 10.5-10.9; batch 2 and 4 (each row reads the blocks again) 14.2-14.7 against 15.8-16.8 and
    27.6-30.2 against 28.0-29.3."""
    rows, inputs = x.shape
    padded = packed.shape[0] // inputs                     # the outputs padded to 16 (pack_weight)
    for o in range(first // PACK * PACK, end, PACK):
        width = min(PACK, padded - o)
        block = packed[o * inputs:(o + width) * inputs].reshape((inputs, width))
        low, high = max(first, o) - o, min(end, o + width) - o
        whole = high - low == PACK
        quads = rows // 4 * 4 if whole else 0                  # rows four at a time (sums64x4)
        for n in range(0, quads, 4):
            for i, sums in enumerate(sums64x4(x, n, block)):
                finish64(sums, o, end, scale, shift, code, slope, dst[n + i])
        for n in range(quads, rows):
            if whole:
                finish64(sums64(x[n], block), o, end, scale, shift, code, slope, dst[n])
            else:
                for column in range(low, high, 16):
                    finish16(sums16(x[n], block, column), o + column, end, scale, shift, code, slope, dst[n])


DOTS = packed_dots if PACKED else linear_dots      # the fused batches' kernel (its weights: LinearLayer.dots_weight)


class LinearLayer:
    ops = ("linear",)  # the registry ops this layer runs (backend.py LAYERS)

    def __init__(self, node, weights):
        self.out_shape = node.out_shape
        self.weight = np.array(weights[node.param_key("weight")], dtype=np.float32)   # own copy: folding edits it
        self.epilogue = Epilogue.identity(node.attrs["out_features"])
        if node.attrs["bias"]:
            self.epilogue.shift = np.array(weights[node.param_key("bias")], dtype=np.float32)
        self.epilogue.set_activation(node.attrs["activation"])
        self.chains = {}           # chain_parameters of the chains this layer starts, by their length
        self._dots_weight = None   # dots_weight, made on first use (after any fold)

    def fold(self, scale: np.ndarray, shift: np.ndarray) -> None:
        """Absorb y -> y * scale + shift per output feature (a batch norm) into weight and bias."""
        self.weight, self.epilogue.shift = fold_scale_and_shift(self.weight, self.epilogue.shift, scale, shift)
        self._dots_weight = None

    @property
    def dots_weight(self) -> np.ndarray:
        """The weights as DOTS reads them: packed in blocks (pack_weight) where PACKED, else weight [O, K]; made
        once, shared by every plan (a second copy of the weights beside `weight`, which BLAS reads for larger
        batches)."""
        if self._dots_weight is None:
            self._dots_weight = pack_weight(self.weight) if PACKED else self.weight
        return self._dots_weight

    def fused(self, batch: int) -> bool:
        """Whether DOTS computes this layer at this batch size, else BLAS (FUSED_MAX_BATCH, FUSED_MAX_WEIGHTS): on
        the layer's own weights linear_dots reads each weight once for up to 4 rows, as one-thread OpenBLAS does
        at batch 1 and faster at 2 (by hand, the 2-core AVX2 EPYC VM, 1024x1024 / 2048x2048 / 8192->512 weights:
        batch 1 81 / 381 / 268 us against 78 / 358 / 294; batch 2 139 / 615 / 509 against 342 / 1465 / 1375;
        batch 4 228 / 1077 / 966 against 233 / 1097 / 1070), and a split plan of such layers gets its helper
        program (programs.py: an np.matmul step has none)."""
        return (batch <= FUSED_MAX_BATCH and self.epilogue.code != SOFTMAX
                and (not PACKED or self.weight.size <= FUSED_MAX_WEIGHTS))

    @property
    def flops(self) -> int:
        """Per row, a multiply-add counted 2: what backend.py weighs before splitting the layer."""
        return 2 * self.weight.size

    def plan(self, src, new_buffer, parts: int = 1):
        dst = new_buffer((src.shape[0], *self.out_shape))
        e = self.epilogue
        blocks = split_range(0, self.weight.shape[0], parts, align=16)
        if self.fused(src.shape[0]):
            return dst, parallel_steps([[partial(DOTS, src, self.dots_weight, e.scale, e.shift, e.code, e.slope,
                                                 first, end, dst)] for first, end in blocks])
        # [in, out]: for batches BLAS runs x @ a contiguous weight.T ~1.5x faster than x @ the view weight.T
        weight_t = self.weight.T if src.shape[0] == 1 else np.ascontiguousarray(self.weight.T)
        steps = parallel_steps([[partial(np.matmul, src, weight_t[:, first:end], out=dst[:, first:end])]
                                for first, end in blocks])
        if not self.epilogue.is_identity:
            dst3 = as_channels_positions(dst)
            steps.append(partial(self.epilogue.run, dst3, dst3))
        return dst, steps


# --------------------------------------------------------------------------- a chain of linear layers

# Consecutive linear layers of a small batch (linear_dots's) run as ONE kernel call, `run_chain`: no Python
# between layers (mnist_mlp's three layers: 3 calls and the steps around them cost ~4 of its ~17 us). With
# parts > 1 each layer's outputs are cut into two blocks (`bounds`, split_range) and the crew's first helper
# serves the chain (parallel.Claimed): the caller claims blocks from the first, the helper from the last (so
# that each core keeps reading its own half of the weights), by a compare-and-swap on the layer's claims
# word; the layer's last block done lets both go on to the next. The words are tagged with the call's number
# (call * TAG + a bit per block claimed, or + the blocks done), so a helper that comes late to a call finds
# nothing to claim and waits for the next. Calls count from 1: a fresh chain's words (0) are no call to join (a
# helper lent before the first call joined "call 0", claimed a block and computed it as that call began, its count
# of blocks done landing on the first call's: the call went on before the helper's block was computed, and the
# helper waited for a count it had passed, for ever, holding up every crew call after it). A block computes its outputs exactly as one thread does: the same
# bytes on any number of threads.
CHAINS = spin_while_equal is not None      # the JIT with sched_yield (not the compiled app; not Windows)
CHAIN_TASK_FLOPS = 5e4     # a layer of the chain is cut into blocks from this much work per row on
CHAIN_BLOCKS = 2           # the caller and one helper
TAG = 1 << 20              # chain flags: [call number, SERVED, then per layer: claims, blocks done]
GO = 0
# layout [layers, 8]: weight offset, inputs, outputs, scale/shift offset, source offset, target offset (into
# acts), activation code, blocks; bounds [layers, CHAIN_BLOCKS + 1]: the blocks' first outputs, then the end


@kernel
def claim_block(flags, index, call, blocks, from_end):
    """The block of flags[index]'s layer this thread takes next (the first one free, or the last one free
    when from_end), or -1: all taken, or `call` is over. flags[index] = call * TAG + a bit per block taken."""
    while True:
        word = load_acquire(flags, index)
        if word // TAG != call:
            return -1
        taken = word % TAG
        block = -1
        for step in range(blocks):
            candidate = blocks - 1 - step if from_end else step
            if not (taken >> candidate) & 1:
                block = candidate
                break
        if block < 0:
            return -1
        if compare_and_swap(flags, index, word, word | (1 << block)):
            return block


@ieee_kernel
def chain_part(x, weights, scales, shifts, slopes, layout, bounds, acts, flags, call, from_end):
    """This thread's share of call `call`: x [N, K] -> each layer's blocks it claims (linear_dots, into the
    layer's [N, outputs] rows of acts), then waiting for the layer's other blocks. False when the call ended
    without it (a helper that came late)."""
    rows, layers = x.shape[0], layout.shape[0]
    for layer in range(layers):
        weight_at, inputs, outputs, vector_at, source_at, target_at, code, blocks = layout[layer]
        source = x if layer == 0 else acts[source_at:source_at + rows * inputs].reshape((rows, inputs))
        target = acts[target_at:target_at + rows * outputs].reshape((rows, outputs))
        weight = weights[weight_at:layout[layer + 1, 0] if layer + 1 < layers else weights.shape[0]]   # dots_weight
        scale, shift = scales[vector_at:vector_at + outputs], shifts[vector_at:vector_at + outputs]
        claims, done = 2 + 2 * layer, 3 + 2 * layer
        block = claim_block(flags, claims, call, blocks, from_end)
        while block >= 0:
            if PACKED:
                packed_dots(source, weight, scale, shift, code, slopes[layer], bounds[layer, block],
                            bounds[layer, block + 1], target)
            else:
                linear_dots(source, weight.reshape((outputs, inputs)), scale, shift, code, slopes[layer],
                            bounds[layer, block], bounds[layer, block + 1], target)
            fetch_add(flags, done, 1)
            block = claim_block(flags, claims, call, blocks, from_end)
        while True:
            word = load_acquire(flags, done)
            if word // TAG != call:
                return False
            if word % TAG == blocks:
                break
            sched_yield()
    return True


@kernel
def run_chain(x, weights, scales, shifts, slopes, layout, bounds, acts, flags):
    """The calling thread's side: a new call (its counters reset, then its number published), computed with
    whichever helper joins."""
    call = flags[GO] + 1
    for index in range(2, flags.shape[0]):
        store_release(flags, index, call * TAG)
    store_release(flags, GO, call)
    chain_part(x, weights, scales, shifts, slopes, layout, bounds, acts, flags, call, False)


@kernel
def serve_chain(x, weights, scales, shifts, slopes, layout, bounds, acts, flags, linger_ns, crew_flags, given, taken):
    """A helper's side (parallel.Claimed.serve): joins each new call until `linger_ns` nanoseconds pass without one
    or crew_flags[given] is no longer `taken` (the crew has other work for it)."""
    store_release(flags, SERVED, 1)
    seen = max(load_acquire(flags, GO) - 1, 0)   # the call going on now, if any, is joined (calls count from 1)
    idle_since = monotonic_ns()
    while monotonic_ns() - idle_since < linger_ns and load_acquire(crew_flags, given) == taken:
        call = load_acquire(flags, GO)
        if call != seen:
            seen = call
            chain_part(x, weights, scales, shifts, slopes, layout, bounds, acts, flags, call, True)
            idle_since = monotonic_ns()
        else:
            sched_yield()
    store_release(flags, SERVED, 0)


def chain_eligible(layer, batch: int) -> bool:
    """Whether `layer` joins a chain at this batch size: a linear layer that linear_dots computes."""
    return CHAINS and isinstance(layer, LinearLayer) and layer.fused(batch) and layer.weight.size <= FUSED_MAX_WEIGHTS


def chain_parameters(layers: list) -> tuple:
    """(weights, scales, shifts, slopes) of the chain's layers, each layer's after the last's: made once and
    shared by every plan of the backend (kept on the chain's first layer; a chain from a given layer is
    the same in each plan that has one), not copied per batch size and thread."""
    made = layers[0].chains.get(len(layers))
    if made is None:
        made = layers[0].chains[len(layers)] = (
            np.concatenate([layer.dots_weight.ravel() for layer in layers]),
            np.concatenate([layer.epilogue.scale for layer in layers]).astype(np.float32),
            np.concatenate([layer.epilogue.shift for layer in layers]).astype(np.float32),
            np.array([layer.epilogue.slope for layer in layers], np.float32))
    return made


def plan_chain(layers: list, src, new_buffer, parts: int, task_flops: float):
    """(dst, [one step]) for consecutive chain_eligible layers: a Claimed step when some layer is cut into
    blocks (parts > 1 and at least CHAIN_TASK_FLOPS a row, or any size when task_flops is 0), else run_chain
    alone."""
    rows = src.shape[0]
    sizes = [(layer.weight.shape[1], layer.weight.shape[0]) for layer in layers]
    weights, scales, shifts, slopes = chain_parameters(layers)
    acts = new_buffer((sum(rows * outputs for _, outputs in sizes),))
    layout = np.zeros((len(layers), 8), np.int64)
    bounds = np.zeros((len(layers), CHAIN_BLOCKS + 1), np.int64)
    weight_at = vector_at = target_at = source_at = 0
    for index, (layer, (inputs, outputs)) in enumerate(zip(layers, sizes)):
        cut = min(parts, CHAIN_BLOCKS) if not task_flops or layer.flops >= CHAIN_TASK_FLOPS else 1
        blocks = split_range(0, outputs, cut, align=16)
        layout[index] = weight_at, inputs, outputs, vector_at, source_at, target_at, layer.epilogue.code, len(blocks)
        bounds[index] = [first for first, _ in blocks] + [outputs] * (CHAIN_BLOCKS + 1 - len(blocks))
        weight_at, vector_at, source_at = weight_at + layer.dots_weight.size, vector_at + outputs, target_at
        target_at += rows * outputs
    flags = np.zeros(2 + 2 * len(layers), np.int64)
    arguments = (src.reshape(rows, -1), weights, scales, shifts, slopes, layout, bounds, acts)
    dst = acts[layout[-1, 5]:].reshape(rows, sizes[-1][1])
    run = partial(run_chain, *arguments, flags)
    if (layout[:, 7] == 1).all():                # no layer cut: nothing to share
        return dst, [run]
    serve = partial(serve_chain, *arguments, flags, LINGER_NS)
    serve(flags, GO, -1)       # compiled (or loaded) here, while planning: no wait on a helper's first lending
    return dst, [Claimed(run, serve, flags)]
