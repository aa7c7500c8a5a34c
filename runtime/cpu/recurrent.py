"""lstm and gru: x [N, C, T] -> y [N, H*D, T] ("return": "sequence") or [N, H*D] ("last"), D = 2 directions
when bidirectional. Reference: formats/ops.py _Recurrent, LSTM and GRU.forward (PyTorch's nn.LSTM / nn.GRU,
gates i, f, g, o and r, z, n; weights [G*H, in] and [G*H, H]).

Time-major inside. The input is copied once to seq [T, N, C]. Per layer and direction:
  - ONE GEMM for the input projections of all T steps: xw [T*N, G*H] = seq @ W_ih.T (numpy's BLAS into
    the planned buffer), then the bias folded into it in one pass: b_ih + b_hh for lstm; for gru b_ih
    and b_hr, b_hz (b_hn stays apart: it is multiplied by r);
  - per step ONE recurrent GEMM hw [N, G*H] = h_prev @ W_hh.T (skipped at the first step, where h is
    zero: hw is zeros), then ONE fused gate kernel (lstm_cell / gru_cell below) that reads xw[t] and hw,
    applies the gate nonlinearities, updates the state and writes h into the layer's output sequence
    out[t, :, d*H:(d+1)*H] (the next layer's input, or the model's output).
    Above SEQUENCE_KERNEL_MAX_BATCH rows the recurrent GEMM is numpy's BLAS, one Python-level call per
    step for it and one for the gate kernel. Up to it, the whole time loop runs in one kernel
    (lstm_sequence / gru_sequence) with its own recurrent product (recurrent_product: dot products of
    W_hh's rows with four rows of h, the sums in registers): at batch 1 a step is a 128 x 512
    matrix-vector product of a few microseconds, less than two Python-level calls cost. Measured with
    hidden 128 on the shared 2-core machine: the one kernel was faster than BLAS per step from batch 1
    to 24 (batch 1: 0.66 against 0.77 ms, 16: 11.2 against 14.6 ms) and slower at 32 (29 against 24 ms).
The gates' tanh and sigmoid are fast_tanh (a rational function, within 4e-7 of tanh) so that the gate
loops vectorize; libm's tanhf and expf were most of a step's time at batch 32. These kernels are
@ieee_kernel (jit.py): IEEE division and reassociated sums, without which neither loop vectorizes.
Directions run in their own time order (the backward one from T-1 down to 0). The output is out
transposed to [N, H*D, T], or for "last" the top layer's forward state after step T-1 and backward state
after step 0 (PyTorch's h_n).
"""

from __future__ import annotations

from functools import partial

import numpy as np

from lnn.formats.ops import get_op
from lnn.runtime.cpu.aot import A1, A2, A3, I
from lnn.runtime.cpu.jit import ieee_kernel, kernel

# Each kernel's ahead-of-time signature (aot.py): the argument types the backend passes; None: called
# only by other kernels, compiled into them.
AOT_SIGNATURES = {
    "fast_tanh": None,
    "fast_sigmoid": None,
    "recurrent_product": None,
    "lstm_cell": (A2, A2, A2, A2, I),
    "gru_cell": (A2, A2, A1, A2, A2, I),
    "lstm_sequence": (A3, A2, A2, A2, A3, I, I),
    "gru_sequence": (A3, A2, A1, A2, A2, A3, I, I),
}


@ieee_kernel
def fast_tanh(x):
    """tanh in float32 as a rational function (Eigen's generic_fast_tanh_float, also MLAS's): no library
    call, so the gate loops vectorize; within 4e-7 of tanh everywhere (tests/formats/test_recurrent.py)."""
    limit = np.float32(7.90531110763549805)
    x = limit if x > limit else x                    # (not min/max, which stop the vectorizing; NaN stays NaN)
    x = -limit if x < -limit else x
    x2 = x * x
    p = x2 * np.float32(-2.76076847742355e-16) + np.float32(2.00018790482477e-13)
    p = x2 * p + np.float32(-8.60467152213735e-11)
    p = x2 * p + np.float32(5.12229709037114e-08)
    p = x2 * p + np.float32(1.48572235717979e-05)
    p = x2 * p + np.float32(6.37261928875436e-04)
    p = x2 * p + np.float32(4.89352455891786e-03)
    q = x2 * np.float32(1.19825839466702e-06) + np.float32(1.18534705686654e-04)
    q = x2 * q + np.float32(2.26843463243900e-03)
    q = x2 * q + np.float32(4.89352518554385e-03)
    return x * p / q


@ieee_kernel
def fast_sigmoid(x):
    """sigmoid(x) = (1 + tanh(x / 2)) / 2, through fast_tanh."""
    return np.float32(0.5) + np.float32(0.5) * fast_tanh(np.float32(0.5) * x)


@ieee_kernel
def lstm_cell(xw, hw, c, out, offset):
    """The fused gate kernel of one step. xw, hw [N, 4H] (input and recurrent products, biases in xw),
    c [N, H] updated in place, h written to out[:, offset:offset + H]."""
    batch, hidden = c.shape
    for n in range(batch):
        for j in range(hidden):
            i = fast_sigmoid(xw[n, j] + hw[n, j])
            f = fast_sigmoid(xw[n, hidden + j] + hw[n, hidden + j])
            g = fast_tanh(xw[n, 2 * hidden + j] + hw[n, 2 * hidden + j])
            o = fast_sigmoid(xw[n, 3 * hidden + j] + hw[n, 3 * hidden + j])
            state = f * c[n, j] + i * g
            c[n, j] = state
            out[n, offset + j] = o * fast_tanh(state)


@ieee_kernel
def gru_cell(xw, hw, b_hn, prev, out, offset):
    """The fused gate kernel of one step. xw, hw [N, 3H] (biases but b_hn in xw), b_hn [H]; h_prev read
    from prev[:, offset:offset + H], h written to out[:, offset:offset + H]."""
    batch, hidden = out.shape[0], b_hn.shape[0]
    for n in range(batch):
        for j in range(hidden):
            r = fast_sigmoid(xw[n, j] + hw[n, j])
            z = fast_sigmoid(xw[n, hidden + j] + hw[n, hidden + j])
            candidate = fast_tanh(xw[n, 2 * hidden + j] + r * (hw[n, 2 * hidden + j] + b_hn[j]))
            out[n, offset + j] = candidate + z * (prev[n, offset + j] - candidate)


@ieee_kernel
def recurrent_product(h, offset, w, out):
    """The recurrent GEMM of one step for small batches: out [N, G*H] = h[:, offset:offset + H] @ w.T with
    w = W_hh [G*H, H], as dot products of w's rows with four rows of h at a time, the sums in registers
    (an axpy form over W_hh.T, storing into out for every j, was up to ten times slower for some
    buffer layouts and batches from 3 on: stores and loads 4 KiB apart stall each other)."""
    batch = out.shape[0]
    width, hidden = w.shape
    n = 0
    while n + 4 <= batch:
        h0 = h[n, offset:offset + hidden]
        h1 = h[n + 1, offset:offset + hidden]
        h2 = h[n + 2, offset:offset + hidden]
        h3 = h[n + 3, offset:offset + hidden]
        for k in range(width):
            weights = w[k]
            a0 = np.float32(0)
            a1 = np.float32(0)
            a2 = np.float32(0)
            a3 = np.float32(0)
            for j in range(hidden):
                v = weights[j]
                a0 += v * h0[j]
                a1 += v * h1[j]
                a2 += v * h2[j]
                a3 += v * h3[j]
            out[n, k] = a0
            out[n + 1, k] = a1
            out[n + 2, k] = a2
            out[n + 3, k] = a3
        n += 4
    while n < batch:
        h0 = h[n, offset:offset + hidden]
        for k in range(width):
            weights = w[k]
            a0 = np.float32(0)
            for j in range(hidden):
                a0 += weights[j] * h0[j]
            out[n, k] = a0
        n += 1


@kernel
def lstm_sequence(xw, w_hh, hw, c, out, offset, reverse):
    """A whole direction of one layer in one call (small batches, where a call per step would cost more
    than the step): per step recurrent_product then lstm_cell. xw [T, N, 4H], out [T, N, D*H]."""
    steps = xw.shape[0]
    c[:] = 0
    hw[:] = 0
    for s in range(steps):
        t = steps - 1 - s if reverse else s
        if s > 0:
            recurrent_product(out[t + 1 if reverse else t - 1], offset, w_hh, hw)
        lstm_cell(xw[t], hw, c, out[t], offset)


@kernel
def gru_sequence(xw, w_hh, b_hn, hw, zero_h, out, offset, reverse):
    """gru's counterpart of lstm_sequence; zero_h [N, D*H] is zeros (the state before the first step)."""
    steps = xw.shape[0]
    hw[:] = 0
    for s in range(steps):
        t = steps - 1 - s if reverse else s
        if s > 0:
            previous = out[t + 1 if reverse else t - 1]
            recurrent_product(previous, offset, w_hh, hw)
            gru_cell(xw[t], hw, b_hn, previous, out[t], offset)
        else:
            gru_cell(xw[t], hw, b_hn, zero_h, out[t], offset)


SEQUENCE_KERNEL_MAX_BATCH = 16    # up to this batch a direction runs as one lstm_sequence / gru_sequence call


class RecurrentLayer:
    ops = ("lstm", "gru")  # the registry ops this layer runs (backend.py LAYERS)

    def __init__(self, node, weights):
        op = get_op(node.op)
        self.op, self.attrs, self.out_shape = op, node.attrs, node.out_shape
        self.steps_count = node.in_shape[1]
        self.directions = op.directions(node.attrs)
        h, g = node.attrs["hidden_size"], op.gates
        self.hidden = h
        self.cells = []          # per layer, per direction: (W_ih.T [in, G*H], W_hh [G*H, H], W_hh.T, xw bias [G*H], b_hn [H])
        for layer in range(node.attrs["num_layers"]):
            cells = []
            for direction in range(self.directions):
                w_ih, w_hh, b_ih, b_hh = op.param_names(node.attrs, layer, direction)
                bias = np.zeros(g * h, np.float32)
                b_hn = np.zeros(h, np.float32)
                if node.attrs["bias"]:
                    b_ih = np.asarray(weights[node.param_key(b_ih)], np.float32)
                    b_hh = np.asarray(weights[node.param_key(b_hh)], np.float32)
                    bias = b_ih + b_hh
                    if node.op == "gru":
                        bias[2 * h:] = b_ih[2 * h:]
                        b_hn = b_hh[2 * h:].copy()
                w_hh = np.ascontiguousarray(weights[node.param_key(w_hh)], np.float32)
                cells.append((np.ascontiguousarray(np.asarray(weights[node.param_key(w_ih)], np.float32).T),
                              w_hh, np.ascontiguousarray(w_hh.T), bias, b_hn))
            self.cells.append(cells)

    def plan(self, src, new_buffer):
        n, steps, h, d = src.shape[0], self.steps_count, self.hidden, self.directions
        gate_width = self.op.gates * h
        seq = new_buffer((steps, n, src.shape[1]))
        plan = [partial(np.copyto, seq, src.transpose(2, 0, 1))]
        xw = new_buffer((steps, n, gate_width))
        hw = new_buffer((n, gate_width))
        state = new_buffer((n, h))                          # lstm's c
        zero_h = new_buffer((n, h * d))                     # gru's state before the first step
        zero_hw = new_buffer((n, gate_width))               # the recurrent product at the first step
        plan += [partial(zero_hw.fill, 0), partial(zero_h.fill, 0)]
        outputs = [new_buffer((steps, n, h * d)) for _ in range(min(2, len(self.cells)))]
        for layer, cells in enumerate(self.cells):
            out = outputs[layer % 2]
            for direction, (w_ih_t, w_hh, w_hh_t, bias, b_hn) in enumerate(cells):
                plan += [partial(np.matmul, seq.reshape(steps * n, -1), w_ih_t, out=xw.reshape(steps * n, -1)),
                         partial(np.add, xw, bias, out=xw)]
                offset = direction * h
                if n <= SEQUENCE_KERNEL_MAX_BATCH:
                    if self.op.name == "lstm":
                        plan.append(partial(lstm_sequence, xw, w_hh, hw, state, out, offset, direction))
                    else:
                        plan.append(partial(gru_sequence, xw, w_hh, b_hn, hw, zero_h, out, offset, direction))
                    continue
                if self.op.name == "lstm":
                    plan.append(partial(state.fill, 0))
                previous = None
                for t in (range(steps - 1, -1, -1) if direction else range(steps)):
                    recurrent = zero_hw
                    if previous is not None:
                        plan.append(partial(np.matmul, out[previous, :, offset:offset + h], w_hh_t, out=hw))
                        recurrent = hw
                    if self.op.name == "lstm":
                        plan.append(partial(lstm_cell, xw[t], recurrent, state, out[t], offset))
                    else:
                        prev = zero_h if previous is None else out[previous]
                        plan.append(partial(gru_cell, xw[t], recurrent, b_hn, prev, out[t], offset))
                    previous = t
            seq = out
        dst = new_buffer((n, *self.out_shape))
        if self.attrs["return"] == "sequence":
            plan.append(partial(np.copyto, dst, seq.transpose(1, 2, 0)))
        else:
            plan.append(partial(np.copyto, dst[:, :h], seq[steps - 1, :, :h]))
            if d == 2:
                plan.append(partial(np.copyto, dst[:, h:], seq[0, :, h:]))
        return dst, plan
