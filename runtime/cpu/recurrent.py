"""lstm and gru: x [N, C, T] -> y [N, H*D, T] ("return": "sequence") or [N, H*D] ("last"), D = 2 directions
when bidirectional. Reference: formats/ops.py _Recurrent, LSTM and GRU.forward (PyTorch's nn.LSTM / nn.GRU,
gates i, f, g, o and r, z, n; weights [G*H, in] and [G*H, H]).

Time-major inside. The input is copied once to seq [T, N, C]. Per layer and direction:
  - ONE GEMM for the input projections of a chunk of steps: xw [steps*N, G*H] = seq[steps] @ W_ih.T
    (numpy's BLAS into the planned buffer), the chunk as many steps as fit XW_CHUNK_BYTES (all T at
    small batches; 4 steps at batch 32, hidden 128): the gate kernel then reads xw from L2 (about 7%
    of the time at batch 32 here, against one GEMM for all T steps) and xw does not grow with T. The
    biases are not added to xw (a pass over it) but read by the gate kernel: b_ih + b_hh for lstm; for
    gru b_ih + b_hh for r and z, b_in for n, and b_hn apart (it is multiplied by r);
  - per step ONE recurrent GEMM hw [N, G*H] = h_prev @ W_hh.T (skipped at the first step, where h is
    zero: hw is zeros), then ONE fused gate kernel (lstm_cell / gru_cell below) that reads xw[t] and hw,
    applies the gate nonlinearities, updates the state and writes h into the layer's output sequence
    out[t, :, d*H:(d+1)*H] (the next layer's input, or the model's output).
    Above SEQUENCE_KERNEL_MAX_BATCH rows the recurrent GEMM is numpy's BLAS, one Python-level call per
    step for it and one for the gate kernel. Up to it, the whole time loop runs in one kernel
    (lstm_sequence / gru_sequence) with its own recurrent product (recurrent_product: dot products of
    W_hh's rows with up to six rows of h, the sums in registers), block by block of ROW_BLOCK rows: at
    batch 1 a step is a 128 x 512 matrix-vector product of a few microseconds, less than two
    Python-level calls cost. Measured with hidden 128 on the shared 2-core machine (CPU time of the
    thread): the one kernel beat BLAS per step at batch 16 (6.3 against 6.9 ms), was level with it at
    32 (12.3 against 12.6) and behind at 64 (28 against 23).
The gates' tanh and sigmoid are rational functions (tanh_ratio, within 4e-7 of tanh) so that the gate
loops vectorize (libm's tanhf and expf were most of a step's time at batch 32), kept as numerator and
denominator until the state update, which divides once (lstm_cell). These kernels are @ieee_kernel
(jit.py): IEEE division and reassociated sums, without which neither loop vectorizes.
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
    "tanh_ratio": None,
    "sigmoid_ratio": None,
    "recurrent_product": None,
    "lstm_cell": (A2, A2, A1, A2, A2, I),
    "gru_cell": (A2, A2, A1, A1, A2, A2, I),
    "lstm_sequence": (A3, I, A2, A1, A2, A2, A3, I, I),
    "gru_sequence": (A3, I, A2, A1, A1, A2, A2, A3, I, I),
}


@ieee_kernel
def tanh_ratio(x):
    """tanh(x) in float32 as numerator / denominator of a rational function (Eigen's generic_fast_tanh_float,
    also MLAS's), the division left to the caller: no library call, so the gate loops vectorize; the ratio
    is within 4e-7 of tanh everywhere (tests/formats/test_recurrent.py). The denominator lies in
    [0.0048, 0.91]."""
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
    return x * p, q


@ieee_kernel
def sigmoid_ratio(x):
    """sigmoid(x) = (1 + tanh(x / 2)) / 2 as numerator / denominator, through tanh_ratio."""
    p, q = tanh_ratio(np.float32(0.5) * x)
    return q + p, q + q


@ieee_kernel
def lstm_cell(xw, hw, bias, c, out, offset):
    """The fused gate kernel of one step. xw, hw [N, 4H] (input and recurrent products), bias [4H]
    (b_ih + b_hh), c [N, H] updated in place, h written to out[:, offset:offset + H].
    The gates stay as ratios and meet over common denominators: c' = f c + i g and h = o tanh(c') take
    one division each instead of five for the five nonlinearities (the divisions were half of the
    kernel's time at batch 32); every denominator is at least 0.0048, so their products stay normal floats."""
    batch, hidden = c.shape
    for n in range(batch):
        for j in range(hidden):
            ni, di = sigmoid_ratio(xw[n, j] + hw[n, j] + bias[j])
            nf, df = sigmoid_ratio(xw[n, hidden + j] + hw[n, hidden + j] + bias[hidden + j])
            ng, dg = tanh_ratio(xw[n, 2 * hidden + j] + hw[n, 2 * hidden + j] + bias[2 * hidden + j])
            no, do = sigmoid_ratio(xw[n, 3 * hidden + j] + hw[n, 3 * hidden + j] + bias[3 * hidden + j])
            dig = di * dg
            state = (nf * c[n, j] * dig + ni * ng * df) / (df * dig)
            c[n, j] = state
            ns, ds = tanh_ratio(state)
            out[n, offset + j] = no * ns / (do * ds)


@ieee_kernel
def gru_cell(xw, hw, bias, b_hn, prev, out, offset):
    """The fused gate kernel of one step. xw, hw [N, 3H] (input and recurrent products), bias [3H]
    (b_ih + b_hh for r and z, b_in for n), b_hn [H]; h_prev read from prev[:, offset:offset + H], h written
    to out[:, offset:offset + H]. As in lstm_cell, h = n + z (h_prev - n) over one common denominator (two
    divisions, r's and this one, instead of three)."""
    batch, hidden = out.shape[0], b_hn.shape[0]
    for n in range(batch):
        for j in range(hidden):
            nr, dr = sigmoid_ratio(xw[n, j] + hw[n, j] + bias[j])
            nz, dz = sigmoid_ratio(xw[n, hidden + j] + hw[n, hidden + j] + bias[hidden + j])
            nc, dc = tanh_ratio(xw[n, 2 * hidden + j] + bias[2 * hidden + j] + nr * (hw[n, 2 * hidden + j] + b_hn[j]) / dr)
            out[n, offset + j] = (nc * dz + nz * (prev[n, offset + j] * dc - nc)) / (dc * dz)


@ieee_kernel
def recurrent_product(h, offset, w, out):
    """The recurrent GEMM of one step for the one-kernel time loop: out [N, G*H] = h[:, offset:offset + H] @ w.T
    with w = W_hh [G*H, H], as dot products of w's rows with rows of h, the sums in registers. Tiles of
    six rows of h by two rows of w (twelve sums: enough independent multiply-adds to hide their latency,
    eight loads per twelve of them), the rows left over in tiles of two by four, then one by eight (batch
    1: with four sums the chains of dependent multiply-adds set the pace). w's rows are padded with zero
    rows to a multiple of 8 (RecurrentLayer), and out has as many columns.
    (An axpy form over W_hh.T, storing into out for every j, was up to ten times slower for some buffer
    layouts and batches from 3 on: stores and loads 4 KiB apart stall each other.)"""
    batch = out.shape[0]
    width, hidden = w.shape
    n = 0
    while n + 6 <= batch:
        h0 = h[n, offset:offset + hidden]
        h1 = h[n + 1, offset:offset + hidden]
        h2 = h[n + 2, offset:offset + hidden]
        h3 = h[n + 3, offset:offset + hidden]
        h4 = h[n + 4, offset:offset + hidden]
        h5 = h[n + 5, offset:offset + hidden]
        for k in range(0, width, 2):
            w0 = w[k]
            w1 = w[k + 1]
            a00 = a01 = a10 = a11 = a20 = a21 = a30 = a31 = a40 = a41 = a50 = a51 = np.float32(0)
            for j in range(hidden):
                u = w0[j]
                v = w1[j]
                a00 += u * h0[j]
                a01 += v * h0[j]
                a10 += u * h1[j]
                a11 += v * h1[j]
                a20 += u * h2[j]
                a21 += v * h2[j]
                a30 += u * h3[j]
                a31 += v * h3[j]
                a40 += u * h4[j]
                a41 += v * h4[j]
                a50 += u * h5[j]
                a51 += v * h5[j]
            out[n, k], out[n, k + 1] = a00, a01
            out[n + 1, k], out[n + 1, k + 1] = a10, a11
            out[n + 2, k], out[n + 2, k + 1] = a20, a21
            out[n + 3, k], out[n + 3, k + 1] = a30, a31
            out[n + 4, k], out[n + 4, k + 1] = a40, a41
            out[n + 5, k], out[n + 5, k + 1] = a50, a51
        n += 6
    while n + 2 <= batch:
        h0 = h[n, offset:offset + hidden]
        h1 = h[n + 1, offset:offset + hidden]
        for k in range(0, width, 4):
            w0, w1, w2, w3 = w[k], w[k + 1], w[k + 2], w[k + 3]
            a00 = a01 = a02 = a03 = a10 = a11 = a12 = a13 = np.float32(0)
            for j in range(hidden):
                x0 = h0[j]
                x1 = h1[j]
                a00 += w0[j] * x0
                a01 += w1[j] * x0
                a02 += w2[j] * x0
                a03 += w3[j] * x0
                a10 += w0[j] * x1
                a11 += w1[j] * x1
                a12 += w2[j] * x1
                a13 += w3[j] * x1
            out[n, k], out[n, k + 1], out[n, k + 2], out[n, k + 3] = a00, a01, a02, a03
            out[n + 1, k], out[n + 1, k + 1], out[n + 1, k + 2], out[n + 1, k + 3] = a10, a11, a12, a13
        n += 2
    if n < batch:
        h0 = h[n, offset:offset + hidden]
        for k in range(0, width, 8):
            w0, w1, w2, w3, w4, w5, w6, w7 = w[k], w[k + 1], w[k + 2], w[k + 3], w[k + 4], w[k + 5], w[k + 6], w[k + 7]
            a0 = a1 = a2 = a3 = a4 = a5 = a6 = a7 = np.float32(0)
            for j in range(hidden):
                x0 = h0[j]
                a0 += w0[j] * x0
                a1 += w1[j] * x0
                a2 += w2[j] * x0
                a3 += w3[j] * x0
                a4 += w4[j] * x0
                a5 += w5[j] * x0
                a6 += w6[j] * x0
                a7 += w7[j] * x0
            out[n, k], out[n, k + 1], out[n, k + 2], out[n, k + 3] = a0, a1, a2, a3
            out[n, k + 4], out[n, k + 5], out[n, k + 6], out[n, k + 7] = a4, a5, a6, a7


SEQUENCE_KERNEL_MAX_BATCH = 16    # up to this batch a direction runs as one lstm_sequence / gru_sequence call
ROW_BLOCK = 6                     # rows of the batch per product-then-gates block of that one kernel
XW_CHUNK_BYTES = 256 * 1024       # the input projections are computed this many bytes of steps at a time


@kernel
def lstm_sequence(xw, first, w_hh, bias, hw, c, out, offset, reverse):
    """Steps first .. first + len(xw) - 1 of one layer's direction in one call (in its time order), no
    Python-level call per step: per step and block of ROW_BLOCK rows, recurrent_product then lstm_cell
    on those rows (their products still in L1). The state carries over from the previous call; the
    direction's first step (0, or T-1 when reverse) starts it at zero. xw [steps, N, 4H] (the input
    projections of those steps), w_hh [4H rounded up to 8, H] (zero rows past 4H), hw [N, w_hh rows],
    out [T, N, D*H]."""
    steps, batch = xw.shape[0], xw.shape[1]
    start = out.shape[0] - 1 if reverse else 0
    for s in range(steps):
        t = first + (steps - 1 - s if reverse else s)
        if t == start:
            c[:] = 0
            hw[:] = 0
        for row in range(0, batch, ROW_BLOCK):
            rows = slice(row, min(row + ROW_BLOCK, batch))
            if t != start:
                recurrent_product(out[t + 1 if reverse else t - 1, rows], offset, w_hh, hw[rows])
            lstm_cell(xw[t - first, rows], hw[rows], bias, c[rows], out[t, rows], offset)


@kernel
def gru_sequence(xw, first, w_hh, bias, b_hn, hw, zero_h, out, offset, reverse):
    """gru's counterpart of lstm_sequence; zero_h [N, D*H] is zeros (the state before the first step)."""
    steps, batch = xw.shape[0], xw.shape[1]
    start = out.shape[0] - 1 if reverse else 0
    for s in range(steps):
        t = first + (steps - 1 - s if reverse else s)
        if t == start:
            hw[:] = 0
        for row in range(0, batch, ROW_BLOCK):
            rows = slice(row, min(row + ROW_BLOCK, batch))
            if t != start:
                previous = out[t + 1 if reverse else t - 1, rows]
                recurrent_product(previous, offset, w_hh, hw[rows])
                gru_cell(xw[t - first, rows], hw[rows], bias, b_hn, previous, out[t, rows], offset)
            else:
                gru_cell(xw[t - first, rows], hw[rows], bias, b_hn, zero_h[rows], out[t, rows], offset)


def step_chunks(steps: int, chunk: int, reverse: int) -> list:
    """(first, end) ranges of at most `chunk` steps covering 0 .. steps - 1, in the direction's order."""
    chunks = [(first, min(first + chunk, steps)) for first in range(0, steps, chunk)]
    return chunks[::-1] if reverse else chunks


class RecurrentLayer:
    ops = ("lstm", "gru")  # the registry ops this layer runs (backend.py LAYERS)

    def __init__(self, node, weights):
        op = get_op(node.op)
        self.op, self.attrs, self.out_shape = op, node.attrs, node.out_shape
        self.steps_count = node.in_shape[1]
        self.directions = op.directions(node.attrs)
        h, g = node.attrs["hidden_size"], op.gates
        self.hidden = h
        self.cells = []          # per layer, per direction: (W_ih.T [in, G*H], W_hh [G*H rounded up to 8, H], W_hh.T, gate bias [G*H], b_hn [H])
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
                w_hh = np.asarray(weights[node.param_key(w_hh)], np.float32)
                w_hh_padded = np.zeros((-(-g * h // 8) * 8, h), np.float32)    # recurrent_product's tiles: up to 8 rows
                w_hh_padded[:g * h] = w_hh
                cells.append((np.ascontiguousarray(np.asarray(weights[node.param_key(w_ih)], np.float32).T),
                              w_hh_padded, np.ascontiguousarray(w_hh.T), bias, b_hn))
            self.cells.append(cells)

    def plan(self, src, new_buffer):
        n, steps, h, d = src.shape[0], self.steps_count, self.hidden, self.directions
        gate_width = self.op.gates * h
        chunk = max(1, min(steps, XW_CHUNK_BYTES // (4 * n * gate_width)))      # steps per input-projection GEMM
        seq = new_buffer((steps, n, src.shape[1]))
        plan = [partial(np.copyto, seq, src.transpose(2, 0, 1))]
        xw = new_buffer((chunk, n, gate_width))
        state = new_buffer((n, h))                          # lstm's c
        zero_h = new_buffer((n, h * d))                     # gru's state before the first step
        zero_hw = new_buffer((n, gate_width))               # the recurrent product at the first step
        plan += [partial(zero_hw.fill, 0), partial(zero_h.fill, 0)]
        outputs = [new_buffer((steps, n, h * d)) for _ in range(min(2, len(self.cells)))]
        one_kernel = n <= SEQUENCE_KERNEL_MAX_BATCH
        hw = new_buffer((n, self.cells[0][0][1].shape[0] if one_kernel else gate_width))
        for layer, cells in enumerate(self.cells):
            out = outputs[layer % 2]
            for direction, (w_ih_t, w_hh, w_hh_t, bias, b_hn) in enumerate(cells):
                offset = direction * h
                previous = None
                for first, end in step_chunks(steps, chunk, direction):
                    part = xw[:end - first]
                    plan.append(partial(np.matmul, seq[first:end].reshape((end - first) * n, -1), w_ih_t,
                                        out=part.reshape((end - first) * n, -1)))
                    if one_kernel:
                        if self.op.name == "lstm":
                            plan.append(partial(lstm_sequence, part, first, w_hh, bias, hw, state, out, offset, direction))
                        else:
                            plan.append(partial(gru_sequence, part, first, w_hh, bias, b_hn, hw, zero_h, out, offset,
                                                direction))
                        continue
                    for t in (range(end - 1, first - 1, -1) if direction else range(first, end)):
                        recurrent = zero_hw
                        if previous is None:
                            if self.op.name == "lstm":
                                plan.append(partial(state.fill, 0))
                        else:
                            plan.append(partial(np.matmul, out[previous, :, offset:offset + h], w_hh_t, out=hw))
                            recurrent = hw
                        if self.op.name == "lstm":
                            plan.append(partial(lstm_cell, part[t - first], recurrent, bias, state, out[t], offset))
                        else:
                            prev = zero_h if previous is None else out[previous]
                            plan.append(partial(gru_cell, part[t - first], recurrent, bias, b_hn, prev, out[t], offset))
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
