"""lstm and gru: x [N, C, T] -> y [N, H*D, T] ("return": "sequence") or [N, H*D] ("last"), D = 2 directions
when bidirectional. Reference: formats/ops.py _Recurrent, LSTM and GRU.forward (PyTorch's nn.LSTM / nn.GRU,
gates i, f, g, o and r, z, n; weights [G*H, in] and [G*H, H]).

Time-major inside. The input is copied once to seq [T, N, C]. At load, each layer and direction's W_hh and
W_ih are packed once into panels (gate_panels: per 8 hidden units, [H + C, 32], the 4 gate groups side by
side). Then one kernel call per layer and direction runs all T steps (recurrent_sequence), no
Python-level call per step. Per step and group of GROUP_ROWS rows of the batch:
  - [h_prev, x_t] copied into hx [rows, H + C] (stack_inputs; h_prev zero at the first step);
  - ONE product hw [rows, 4W] = hx @ panels, the input projection included (so no separate GEMM and no
    buffer of all steps' projections), panel by panel (one stays in L1 for the group), in tiles of 3 rows
    x 32 columns whose sums stay in 12 vector registers (panel_product; a single row two panels at a time,
    panel_pair_product_row). numpy's BLAS (OpenBLAS), called per step, packed W_hh again at every call: at batch 32, hidden
    128 it took as long as onnxruntime's whole call (MLAS on weights packed once). The tiles are written
    as tuples of 8 scalars that LLVM's SLP vectorizer packs into registers (jit.tile_kernel);
  - ONE fused gate kernel on those rows (lstm_cell / gru_cell) that adds the biases (b_ih + b_hh for
    lstm; for gru b_ih + b_hh for r and z, b_in for n, and b_hn apart: it is multiplied by r), applies
    the gate nonlinearities, updates the state and writes h into the layer's output sequence
    out[t, :, d*H:(d+1)*H] (the next layer's input, or the model's output), the products still in L1.
The gates' tanh and sigmoid are rational functions (tanh_ratio, within 4e-7 of tanh) so that the gate
loops vectorize (libm's tanhf and expf were most of a step's time at batch 32), kept as numerator and
denominator until they meet over common denominators (lstm_cell). These are @ieee_kernel (jit.py): IEEE
division and reassociated sums, without which the gate loops do not vectorize.
Directions run in their own time order (the backward one from T-1 down to 0). The output is out
transposed to [N, H*D, T], or for "last" the top layer's forward state after step T-1 and backward state
after step 0 (PyTorch's h_n).
"""

from __future__ import annotations

from functools import partial

import numpy as np

from lnn.formats.ops import get_op
from lnn.runtime.cpu.aot import A1, A2, A3, I
from lnn.runtime.cpu.jit import ieee_kernel, tile_kernel

# Each kernel's ahead-of-time signature (aot.py): the argument types the backend passes; None: called
# only by other kernels, compiled into them.
AOT_SIGNATURES = {
    "tanh_ratio": None,
    "sigmoid_ratio": None,
    "lstm_cell": None,
    "gru_cell": None,
    "fma8": None,
    "store8": None,
    "panel_product": None,
    "panel_product_row": None,
    "panel_pair_product_row": None,
    "stack_inputs": None,
    "recurrent_product": None,
    "recurrent_sequence": (A3, A3, A1, A1, A2, A2, A2, A3, I, I, I),
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
def lstm_cell(hw, bias, c, out, offset):
    """The fused gate kernel of one step. hw [N, 4W] (the gates' pre-activations less the biases, gate
    blocks W >= H columns apart: recurrent_product's; o's block is overwritten), bias [4H] (b_ih + b_hh),
    c [N, H] updated in place, h written to out[:, offset:offset + H].
    The gates stay as ratios and meet over common denominators: c' = f c + i g takes one division for
    three nonlinearities (five divisions were half of the kernel's time at batch 32); every denominator is
    at least 0.0048, so their products stay normal floats. Two loops per row, c' and o in the first,
    h = o tanh(c') in the second: in one loop (and one division fewer), an iteration's chain of dependent
    operations (two polynomials and two divisions long) was more than the processor overlapped (13
    against 10.5 us at batch 32, hidden 128).
    Each gate's block is a slice of its own, indexed from 0: with an index like hidden + j, which Numba
    checks for being negative, LLVM loaded those values one by one (the kernel took twice as long)."""
    batch, hidden = c.shape
    width = hw.shape[1] // 4
    bi, bf, bg, bo = bias[:hidden], bias[hidden:2 * hidden], bias[2 * hidden:3 * hidden], bias[3 * hidden:]
    for n in range(batch):
        si, sf, sg, so = hw[n, :width], hw[n, width:2 * width], hw[n, 2 * width:3 * width], hw[n, 3 * width:]
        state, h = c[n], out[n, offset:offset + hidden]
        for j in range(hidden):
            ni, di = sigmoid_ratio(si[j] + bi[j])
            nf, df = sigmoid_ratio(sf[j] + bf[j])
            ng, dg = tanh_ratio(sg[j] + bg[j])
            no, do = sigmoid_ratio(so[j] + bo[j])
            dig = di * dg
            state[j] = (nf * state[j] * dig + ni * ng * df) / (df * dig)
            so[j] = no / do
        for j in range(hidden):
            ns, ds = tanh_ratio(state[j])
            h[j] = so[j] * ns / ds


@ieee_kernel
def gru_cell(hw, bias, b_hn, prev, out, offset):
    """The fused gate kernel of one step. hw [N, 4W] as in lstm_cell, its blocks r, z, W_hn h and W_in x
    (gate_panels: n's two parts apart, since r multiplies one of them); bias [3H] (b_ih + b_hh for r and
    z, b_in for n), b_hn [H]; h_prev read from prev[:, :H], h written to out[:, offset:offset + H]. As in
    lstm_cell, h = n + z (h_prev - n) over one common denominator (two divisions, r's and this one,
    instead of three)."""
    batch, hidden = out.shape[0], b_hn.shape[0]
    width = hw.shape[1] // 4
    br, bz, bn = bias[:hidden], bias[hidden:2 * hidden], bias[2 * hidden:]
    for n in range(batch):
        sr, sz, sh, sx = hw[n, :width], hw[n, width:2 * width], hw[n, 2 * width:3 * width], hw[n, 3 * width:]
        before, h = prev[n, :hidden], out[n, offset:offset + hidden]
        for j in range(hidden):
            nr, dr = sigmoid_ratio(sr[j] + br[j])
            nz, dz = sigmoid_ratio(sz[j] + bz[j])
            nc, dc = tanh_ratio(sx[j] + bn[j] + nr * (sh[j] + b_hn[j]) / dr)
            h[j] = (nc * dz + nz * (before[j] * dc - nc)) / (dc * dz)


@tile_kernel
def fma8(a, x, w, k, o):
    """a + x * w[k, o:o + 8], a and the result 8-tuples (one vector register)."""
    return (a[0] + x * w[k, o], a[1] + x * w[k, o + 1], a[2] + x * w[k, o + 2], a[3] + x * w[k, o + 3],
            a[4] + x * w[k, o + 4], a[5] + x * w[k, o + 5], a[6] + x * w[k, o + 6], a[7] + x * w[k, o + 7])


@tile_kernel
def store8(a, out, n, o):
    """out[n, o:o + 8] = a, through a slice indexed 0..7: with indices like o + 1, which Numba checks for being
    negative, LLVM stored the 8 lanes one by one through the stack (a tenth of a step's time at batch 32)."""
    row = out[n, o:o + 8]
    row[0], row[1], row[2], row[3], row[4], row[5], row[6], row[7] = a


@tile_kernel
def panel_product(hx, w, out, column):
    """One panel's part of a step's product for up to three rows: the sums over k of hx[m, k] * w[k],
    w [H + C, 32] one panel (gate_panels), group g's 8 written to out[m, g * W + column:][:8], out [rows, 4W].
    The 3 x 32 sums stay in twelve vector registers for the whole loop over k (eight are too few to hide
    the multiply-adds' latency; with sixteen some spill), each step one broadcast of hx per row and one
    load of w per 8 columns. With two rows the second is computed twice (recurrent_product gives it at
    most one block of two per group)."""
    depth, width, last = w.shape[0], out.shape[1] // 4, out.shape[0] - 1
    r1, r2 = min(1, last), min(2, last)
    z = np.float32(0)
    a0 = a1 = a2 = a3 = b0 = b1 = b2 = b3 = c0 = c1 = c2 = c3 = (z, z, z, z, z, z, z, z)
    for k in range(depth):
        x, y, q = hx[0, k], hx[r1, k], hx[r2, k]
        a0, b0, c0 = fma8(a0, x, w, k, 0), fma8(b0, y, w, k, 0), fma8(c0, q, w, k, 0)      # (w's column groups
        a1, b1, c1 = fma8(a1, x, w, k, 8), fma8(b1, y, w, k, 8), fma8(c1, q, w, k, 8)      # in the outer order:
        a2, b2, c2 = fma8(a2, x, w, k, 16), fma8(b2, y, w, k, 16), fma8(c2, q, w, k, 16)   # fewer registers live)
        a3, b3, c3 = fma8(a3, x, w, k, 24), fma8(b3, y, w, k, 24), fma8(c3, q, w, k, 24)
    store8(a0, out, 0, column), store8(a1, out, 0, width + column)
    store8(a2, out, 0, 2 * width + column), store8(a3, out, 0, 3 * width + column)
    store8(b0, out, r1, column), store8(b1, out, r1, width + column)
    store8(b2, out, r1, 2 * width + column), store8(b3, out, r1, 3 * width + column)
    store8(c0, out, r2, column), store8(c1, out, r2, width + column)
    store8(c2, out, r2, 2 * width + column), store8(c3, out, r2, 3 * width + column)


@tile_kernel
def panel_product_row(hx, w, out, column):
    """panel_product for one row: four sums in registers (their multiply-adds wait on each other, about as
    long as reading w from L2 takes). Batch 1, hidden 128, 128 steps: 0.54-0.63 ms a call against
    0.85-0.99 with the row computed three times."""
    depth, width = w.shape[0], out.shape[1] // 4
    z = np.float32(0)
    a0 = a1 = a2 = a3 = (z, z, z, z, z, z, z, z)
    for k in range(depth):
        x = hx[0, k]
        a0, a1, a2, a3 = fma8(a0, x, w, k, 0), fma8(a1, x, w, k, 8), fma8(a2, x, w, k, 16), fma8(a3, x, w, k, 24)
    store8(a0, out, 0, column), store8(a1, out, 0, width + column)
    store8(a2, out, 0, 2 * width + column), store8(a3, out, 0, 3 * width + column)


@tile_kernel
def panel_pair_product_row(hx, w, v, out, column):
    """panel_product_row over two neighbouring panels at once (w for `column`, v for column + 8): eight sums in
    registers, so twice the multiply-adds in flight while each waits on its own chain."""
    depth, width = w.shape[0], out.shape[1] // 4
    z = np.float32(0)
    a0 = a1 = a2 = a3 = b0 = b1 = b2 = b3 = (z, z, z, z, z, z, z, z)
    for k in range(depth):
        x = hx[0, k]
        a0, a1, a2, a3 = fma8(a0, x, w, k, 0), fma8(a1, x, w, k, 8), fma8(a2, x, w, k, 16), fma8(a3, x, w, k, 24)
        b0, b1, b2, b3 = fma8(b0, x, v, k, 0), fma8(b1, x, v, k, 8), fma8(b2, x, v, k, 16), fma8(b3, x, v, k, 24)
    store8(a0, out, 0, column), store8(a1, out, 0, width + column)
    store8(a2, out, 0, 2 * width + column), store8(a3, out, 0, 3 * width + column)
    store8(b0, out, 0, column + 8), store8(b1, out, 0, width + column + 8)
    store8(b2, out, 0, 2 * width + column + 8), store8(b3, out, 0, 3 * width + column + 8)


@tile_kernel
def recurrent_product(hx, panels, out):
    """One step's product for a group of rows: out [rows, 4W] = hx @ the panels (W = 8 * len(panels) >= H;
    gate g's block at columns g * W..), panel by panel (it stays in L1 for the group's blocks), blocks of
    3 rows (or 2); a last single row by itself afterwards, two panels at a time."""
    rows, count = out.shape[0], panels.shape[0]
    single = rows - 1 if rows % ROW_BLOCK == 1 else rows
    for b in range(count):
        row = 0
        while row < single:
            end = min(row + ROW_BLOCK, single)
            panel_product(hx[row:end], panels[b], out[row:end], PANEL_UNITS * b)
            row = end
    if single < rows:
        for b in range(0, count - 1, 2):
            panel_pair_product_row(hx[single:], panels[b], panels[b + 1], out[single:], PANEL_UNITS * b)
        if count % 2:
            panel_product_row(hx[single:], panels[count - 1], out[single:], PANEL_UNITS * (count - 1))


@tile_kernel
def stack_inputs(hx, h, x, first):
    """hx [rows, H + C] = [h, x] row by row (h [rows, H] the previous step's state, zeros at the first step;
    x [rows, C] this step's input): a loop per row part (slice assignment's general copy took 5-10% of a step)."""
    hidden = h.shape[1]
    for m in range(hx.shape[0]):
        target, state, value = hx[m, :hidden], h[m], x[m]
        for k in range(hidden):
            target[k] = 0 if first else state[k]
        target = hx[m, hidden:]
        for k in range(value.shape[0]):
            target[k] = value[k]


PANEL_UNITS = 8                   # hidden units per panel: 4 groups of 8 columns
ROW_BLOCK = 3                     # rows of the batch per panel_product
GROUP_ROWS = 12                   # rows of the batch per product-then-gates group (4 blocks; 3 to 33 measured alike)


def gate_panels(w_hh: np.ndarray, w_ih: np.ndarray, gru: bool) -> np.ndarray:
    """W_hh [G*H, H] and W_ih [G*H, C] (gate blocks of H rows) as panels [ceil(H/8), H + C, 32] for
    panel_product, which multiplies them with [h_prev, x_t]: row k of panel b, column 8*g + u, is the weight
    of input k (h_prev's H, then x_t's C) in group g of hidden unit 8*b + u. The groups are lstm's gates i, f,
    g, o; for gru r, z, then n's recurrent part W_hn and its input part W_in apart (r multiplies one only).
    Units past H are zeros."""
    hidden, features = w_hh.shape[1], w_ih.shape[1]
    units = -(-hidden // PANEL_UNITS) * PANEL_UNITS
    blocks = np.zeros((4, units, hidden + features), np.float32)
    gates = 3 if gru else 4
    blocks[:gates, :hidden, :hidden] = w_hh.reshape(gates, hidden, hidden)
    blocks[:gates, :hidden, hidden:] = w_ih.reshape(gates, hidden, features)
    if gru:
        blocks[3, :hidden, hidden:] = blocks[2, :hidden, hidden:]
        blocks[2, :hidden, hidden:] = 0
    panels = blocks.reshape(4, units // PANEL_UNITS, PANEL_UNITS, hidden + features).transpose(1, 3, 0, 2)
    return np.ascontiguousarray(panels.reshape(units // PANEL_UNITS, hidden + features, 4 * PANEL_UNITS))


@tile_kernel
def recurrent_sequence(seq, panels, bias, b_hn, hx, hw, c, out, offset, reverse, gru):
    """One layer's direction over all T steps in one call (in its time order), no Python-level call per
    step: per step and group of GROUP_ROWS rows, [h_prev, x_t] copied into hx [GROUP_ROWS, H + C], its
    product with the panels (the input projection included) into hw [GROUP_ROWS, 4 * 8 * len(panels)], then
    the gate kernel on those rows (lstm_cell, or gru_cell when `gru`: its state is h itself, hx's first H
    columns; b_hn and c are the other cell's and not read). The first step (0, or T-1 when reverse) starts
    from zero state. seq [T, N, C] (the layer's input), c [N, H] (lstm's cell state), b_hn [H], out [T, N, D*H];
    hx and hw may have fewer rows when N does."""
    steps, batch = seq.shape[0], seq.shape[1]
    hidden = b_hn.shape[0]
    c[:] = 0
    for s in range(steps):
        t = steps - 1 - s if reverse else s
        for row in range(0, batch, GROUP_ROWS):
            end = min(row + GROUP_ROWS, batch)
            block, products = hx[:end - row], hw[:end - row]
            previous = out[t + 1 if reverse else t - 1] if s else out[t]
            stack_inputs(block, previous[row:end, offset:offset + hidden], seq[t, row:end], s == 0)
            recurrent_product(block, panels, products)
            if gru:
                gru_cell(products, bias, b_hn, block, out[t, row:end], offset)
            else:
                lstm_cell(products, bias, c[row:end], out[t, row:end], offset)


class RecurrentLayer:
    ops = ("lstm", "gru")  # the registry ops this layer runs (backend.py LAYERS)

    def __init__(self, node, weights):
        op = get_op(node.op)
        self.op, self.attrs, self.out_shape = op, node.attrs, node.out_shape
        self.steps_count = node.in_shape[1]
        self.directions = op.directions(node.attrs)
        h, g = node.attrs["hidden_size"], op.gates
        self.hidden = h
        self.cells = []          # per layer, per direction: (gate_panels, gate bias [G*H], b_hn [H])
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
                panels = gate_panels(np.asarray(weights[node.param_key(w_hh)], np.float32),
                                     np.asarray(weights[node.param_key(w_ih)], np.float32), node.op == "gru")
                cells.append((panels, bias, b_hn))
            self.cells.append(cells)

    def plan(self, src, new_buffer):
        n, steps, h, d = src.shape[0], self.steps_count, self.hidden, self.directions
        seq = new_buffer((steps, n, src.shape[1]))
        plan = [partial(np.copyto, seq, src.transpose(2, 0, 1))]
        state = new_buffer((n, h))                          # lstm's c
        hw = new_buffer((min(n, GROUP_ROWS), 4 * PANEL_UNITS * self.cells[0][0][0].shape[0]))   # a group's products
        outputs = [new_buffer((steps, n, h * d)) for _ in range(min(2, len(self.cells)))]
        for layer, cells in enumerate(self.cells):
            out = outputs[layer % 2]
            block = new_buffer((min(n, GROUP_ROWS), h + seq.shape[2]))      # a group's [h_prev, x_t]
            for direction, (panels, bias, b_hn) in enumerate(cells):
                plan.append(partial(recurrent_sequence, seq, panels, bias, b_hn, block, hw, state, out, direction * h,
                                    direction, int(self.op.name == "gru")))
            seq = out
        dst = new_buffer((n, *self.out_shape))
        if self.attrs["return"] == "sequence":
            plan.append(partial(np.copyto, dst, seq.transpose(1, 2, 0)))
        else:
            plan.append(partial(np.copyto, dst[:, :h], seq[steps - 1, :, :h]))
            if d == 2:
                plan.append(partial(np.copyto, dst[:, h:], seq[0, :, h:]))
        return dst, plan
