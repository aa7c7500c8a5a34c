"""lstm and gru on the GPU and in training: the forward (shared by GPU inference, runtime/cuda/backend.py, and
the trainer, train/layers.py) and the backward (backpropagation through time), side by side.

Array-namespace code as runtime/cuda/kernels.py (`xp` numpy or cupy first, every GEMM through blas.matmul,
out= into planned workspaces only: no allocation, no host synchronization, no branch on array values, so
the calls can be captured in a CUDA graph); tested on NumPy against formats/ops.py's reference and by finite
differences. The backward follows train/kernels.py's contract: it ADDS parameter gradients and WRITES dx.
"""

from __future__ import annotations

from lnn.runtime.cuda.blas import matmul
from lnn.runtime.cuda.kernels import gpu_kernels


# --------------------------------------------------------------------------- forward
# x [N, C, T] -> y [N, H*D, T] ("return": "sequence") or [N, H*D] ("last": the top layer's forward state
# after step T-1 and backward state after step 0); formats/ops.py _Recurrent / LSTM / GRU (PyTorch's).
# Parameters `params[name]` as op.param_names gives them (weight_ih_l0 [G*H, in], weight_hh_l0 [G*H, H],
# bias_ih_l0, bias_hh_l0 [G*H], ..._reverse). Time-major workspaces (recurrent_workspaces):
#   seq_in  [T, N, C]           the input
#   gates   [L, D, T, N, G*H]   per layer and direction the input projections of every step (one GEMM),
#                               then, step by step, the activated gates (lstm i, f, g, o; gru r, z, n)
#   states  [L, D, T, N, H]     lstm: the cell state after each step; gru: W_hn h_prev + b_hn
#   hdir    [L, D, T, N, H]     each direction's hidden state after each step (contiguous rows for GEMMs)
#   hidden  [L, T, N, D*H]      bidirectional only: each layer's output, both directions side by side
#   hw      [N, G*H], tmp [N, H]  per-step scratch
# Per step: one recurrent GEMM (hw = h_prev @ W_hh.T, from hdir), then the gate arithmetic in place (on CuPy
# both in one launch, runtime/cuda/fused.py lstm_/gru_step_forward and _backward, the backward's product with
# W_hh and output-gradient add included; the code here is their reference).
# Only out= calls on planned buffers, sigmoid as (1 + tanh(x/2)) / 2 in place: no allocation, no
# host synchronization, no branch on array values (the same calls can be captured in a CUDA graph).

def recurrent_workspaces(op, attrs: dict, in_shape: tuple, n: int) -> list:
    """(name, shape, phase) of the forward's buffers: "saved" ones the backward reads, "forward" scratch."""
    h, steps, d, layers, g = attrs["hidden_size"], in_shape[1], op.directions(attrs), attrs["num_layers"], op.gates
    spaces = [("seq_in", (steps, n, in_shape[0]), "saved"), ("gates", (layers, d, steps, n, g * h), "saved"),
              ("states", (layers, d, steps, n, h), "saved"), ("hdir", (layers, d, steps, n, h), "saved"),
              ("hw", (n, g * h), "forward"), ("tmp", (n, h), "forward")]
    if d == 2:
        spaces.append(("hidden", (layers, steps, n, d * h), "saved"))
    return spaces


def step_order(steps: int, direction: int) -> list:
    """The time steps of a direction in the order it runs them (the backward direction from T-1 down)."""
    return list(range(steps - 1, -1, -1)) if direction else list(range(steps))


def layer_output(ws: dict, layer: int):
    """A layer's output sequence [T, N, D*H]: hidden[layer], or with one direction hdir[layer, 0]."""
    return ws["hidden"][layer] if "hidden" in ws else ws["hdir"][layer, 0]


def sigmoid_in_place(xp, a):
    """a = sigmoid(a) as 0.5 + 0.5 * tanh(a / 2): stable for any a, every step in place."""
    a *= 0.5
    xp.tanh(a, out=a)
    a *= 0.5
    a += 0.5
    return a


def recurrent_forward(xp, op, x, params: dict, attrs: dict, out, ws: dict):
    h, lstm = attrs["hidden_size"], op.name == "lstm"
    d = op.directions(attrs)
    steps, n = ws["seq_in"].shape[:2]
    ws["seq_in"][...] = x.transpose(2, 0, 1)
    hw, tmp = ws["hw"], ws["tmp"]
    layer_in = ws["seq_in"]
    for layer in range(attrs["num_layers"]):
        for direction in range(d):
            w_ih, w_hh, b_ih, b_hh = (params.get(key) for key in op.param_names(attrs, layer, direction))
            gates, states, hdir = ws["gates"][layer, direction], ws["states"][layer, direction], ws["hdir"][layer, direction]
            matmul(xp, layer_in.reshape(steps * n, -1), w_ih.T, gates.reshape(steps * n, -1))
            if b_ih is not None:
                gates += b_ih
                if lstm:
                    gates += b_hh
            previous = None
            fused = gpu_kernels(xp, gates, w_hh, states, hdir)      # (a step's rows of these are C-contiguous too)
            for t in step_order(steps, direction):
                g = gates[t]
                if fused is not None:                  # the recurrent product and the arithmetic below, one launch
                    h_prev = None if previous is None else hdir[previous]
                    if lstm:
                        fused.lstm_step_forward(g, h_prev, w_hh, None if previous is None else states[previous],
                                                states[t], hdir[t])
                    else:
                        fused.gru_step_forward(g, h_prev, w_hh, b_hh, states[t], hdir[t])
                    previous = t
                    continue
                if previous is None:
                    hw.fill(0)
                else:
                    matmul(xp, hdir[previous], w_hh.T, hw)
                if lstm:
                    g += hw
                    sigmoid_in_place(xp, g[:, :2 * h])
                    xp.tanh(g[:, 2 * h:3 * h], out=g[:, 2 * h:3 * h])
                    sigmoid_in_place(xp, g[:, 3 * h:])
                    c = states[t]
                    xp.multiply(g[:, :h], g[:, 2 * h:3 * h], out=c)              # i * g
                    if previous is not None:
                        xp.multiply(g[:, h:2 * h], states[previous], out=tmp)     # f * c_prev
                        c += tmp
                    xp.tanh(c, out=tmp)
                    xp.multiply(g[:, 3 * h:], tmp, out=hdir[t])                  # h = o * tanh(c)
                else:
                    if b_hh is not None:
                        hw += b_hh
                    g[:, :2 * h] += hw[:, :2 * h]
                    sigmoid_in_place(xp, g[:, :2 * h])                           # r, z
                    states[t][...] = hw[:, 2 * h:]                               # W_hn h_prev + b_hn
                    xp.multiply(g[:, :h], hw[:, 2 * h:], out=tmp)
                    g[:, 2 * h:] += tmp
                    xp.tanh(g[:, 2 * h:], out=g[:, 2 * h:])                      # n
                    if previous is None:                                         # h = n + z * (h_prev - n)
                        xp.multiply(g[:, h:2 * h], g[:, 2 * h:], out=tmp)
                        xp.subtract(g[:, 2 * h:], tmp, out=hdir[t])
                    else:
                        xp.subtract(hdir[previous], g[:, 2 * h:], out=tmp)
                        tmp *= g[:, h:2 * h]
                        xp.add(g[:, 2 * h:], tmp, out=hdir[t])
                previous = t
            if d == 2:
                ws["hidden"][layer][:, :, direction * h:(direction + 1) * h] = hdir
        layer_in = layer_output(ws, layer)
    top = layer_output(ws, attrs["num_layers"] - 1)
    if attrs["return"] == "sequence":
        out[...] = top.transpose(1, 2, 0)
    else:
        out[:, :h] = top[steps - 1, :, :h]
        if d == 2:
            out[:, h:] = top[0, :, h:]
    return out


# --------------------------------------------------------------------------- backward (backpropagation through time)
# The forward (recurrent_forward above) saves, per layer and direction, the activated
# gates, the states (lstm: c; gru: W_hn h_prev + b_hn) and the hidden states of every step. The backward
# walks the layers top down and each direction's steps in the reverse of its order, carrying dh (and
# lstm's dc) from step to step; per step the gate gradients are written into dgates[t] (pre-activation,
# input side) and for gru also dgh[t] (recurrent side: they differ in the n block, r * da_n), and
# dh_prev = dgh[t] @ W_hh is one GEMM. After a direction's steps, three GEMMs over all steps at once:
# dW_ih += dgates^T @ layer input, dW_hh += dgh^T @ h_prev, d(layer input) (+)= dgates @ W_ih.
# lstm (a: pre-activation):  dh = dH[t] + dh_next;  da_o = dh tanh(c) o (1 - o);
#   dc += dh o (1 - tanh(c)^2);  da_i = dc g i (1 - i);  da_g = dc i (1 - g^2);  da_f = dc c_prev f (1 - f);
#   dc_next = dc f
# gru: dn = dh (1 - z); da_z = dh (h_prev - n) z (1 - z); da_n = dn (1 - n^2); da_r = da_n ghn r (1 - r);
#   dgh = (da_r, da_z, da_n r); dh_next = dh z + dgh @ W_hh
# Workspaces (recurrent_backward_workspaces): out= everywhere, no allocation, no host synchronization.

def recurrent_backward_workspaces(op, attrs: dict, in_shape: tuple, n: int) -> list:
    h, steps, d, layers, g = attrs["hidden_size"], in_shape[1], op.directions(attrs), attrs["num_layers"], op.gates
    spaces = [("dlayer_a", (steps, n, d * h), "backward"), ("dgates", (steps, n, g * h), "backward"),
              ("dh", (n, h), "backward"), ("dc", (n, h), "backward"), ("s1", (n, h), "backward"),
              ("s2", (n, h), "backward"), ("dw_ih0", (g * h, in_shape[0]), "backward"),
              ("dw_hh", (g * h, h), "backward"), ("db", (g * h,), "backward"),
              ("dseq_in", (steps, n, in_shape[0]), "input_gradient")]
    if layers > 1:
        spaces += [("dlayer_b", (steps, n, d * h), "backward"), ("dw_ih", (g * h, d * h), "backward")]
    if op.name == "gru":
        spaces.append(("dgh", (steps, n, g * h), "backward"))
    if d == 2:
        spaces.append(("dx_scratch", (steps * n * max(in_shape[0], d * h),), "backward"))   # flat: both widths
    return spaces


def _one_minus(xp, a, out):
    return xp.subtract(1, a, out=out)


def _lstm_step_backward(xp, h, g, c, c_prev, dh, dc, dg, s):
    """One step: dh [N, H] (this step's total), dc carried; writes dg [N, 4H] and leaves dc for the step before."""
    s0, s1 = s
    i, f, gg, o = g[:, :h], g[:, h:2 * h], g[:, 2 * h:3 * h], g[:, 3 * h:]
    di, df, dgg, do = dg[:, :h], dg[:, h:2 * h], dg[:, 2 * h:3 * h], dg[:, 3 * h:]
    xp.tanh(c, out=s0)
    xp.multiply(dh, s0, out=do)                   # do = dh tanh(c), then * o (1 - o)
    do *= o
    _one_minus(xp, o, s1)
    do *= s1
    xp.multiply(s0, s0, out=s0)               # dc += dh o (1 - tanh(c)^2)
    _one_minus(xp, s0, s0)
    s0 *= o
    s0 *= dh
    dc += s0
    xp.multiply(dc, gg, out=di)                     # di = dc g i (1 - i)
    di *= i
    _one_minus(xp, i, s1)
    di *= s1
    xp.multiply(gg, gg, out=s1)                   # dg = dc i (1 - g^2)
    _one_minus(xp, s1, s1)
    xp.multiply(dc, i, out=dgg)
    dgg *= s1
    if c_prev is None:
        df.fill(0)
    else:                                           # df = dc c_prev f (1 - f)
        xp.multiply(dc, c_prev, out=df)
        df *= f
        _one_minus(xp, f, s1)
        df *= s1
    dc *= f


def _gru_step_backward(xp, h, g, ghn, h_prev, dh, dg, dgh, s):
    """One step: dh [N, H] (this step's total) -> dg, dgh [N, 3H]; leaves dh * z in dh (the direct part of dh_prev)."""
    s0 = s[0]
    r, z, n = g[:, :h], g[:, h:2 * h], g[:, 2 * h:]
    dr, dz, dn = dg[:, :h], dg[:, h:2 * h], dg[:, 2 * h:]
    _one_minus(xp, z, s0)                         # da_n = dh (1 - z) (1 - n^2)
    xp.multiply(dh, s0, out=dn)
    xp.multiply(n, n, out=s0)
    _one_minus(xp, s0, s0)
    dn *= s0
    if h_prev is None:                              # da_z = dh (h_prev - n) z (1 - z)
        xp.negative(n, out=dz)
    else:
        xp.subtract(h_prev, n, out=dz)
    dz *= dh
    dz *= z
    _one_minus(xp, z, s0)
    dz *= s0
    xp.multiply(dn, ghn, out=dr)                    # da_r = da_n ghn r (1 - r)
    dr *= r
    _one_minus(xp, r, s0)
    dr *= s0
    dgh[:, :2 * h] = dg[:, :2 * h]
    xp.multiply(dn, r, out=dgh[:, 2 * h:])
    dh *= z


def recurrent_backward(xp, op, dy, params: dict, grads: dict, attrs: dict, dx, ws: dict):
    h, lstm = attrs["hidden_size"], op.name == "lstm"
    d, layers = op.directions(attrs), attrs["num_layers"]
    steps, n = ws["seq_in"].shape[:2]
    s = (ws["s1"], ws["s2"])
    dh, dc, dgates = ws["dh"], ws["dc"], ws["dgates"]
    drec = dgates if lstm else ws["dgh"]            # gradients on the recurrent side of the gates
    dlayer = ws["dlayer_a"]                         # d(loss) / d(this layer's output sequence)
    if attrs["return"] == "sequence":
        dlayer[...] = dy.transpose(2, 0, 1)
    else:
        dlayer.fill(0)
        dlayer[steps - 1, :, :h] = dy[:, :h]
        if d == 2:
            dlayer[0, :, h:] = dy[:, h:]
    for layer in reversed(range(layers)):
        layer_in = ws["seq_in"] if layer == 0 else layer_output(ws, layer - 1)
        if layer > 0:
            dlayer_in = ws["dlayer_b"] if dlayer is ws["dlayer_a"] else ws["dlayer_a"]
        else:
            dlayer_in = ws.get("dseq_in") if dx is not None else None
        in_2d = layer_in.reshape(steps * n, -1)
        for direction in range(d):
            w_ih, w_hh, b_ih, b_hh = op.param_names(attrs, layer, direction)
            gates, states, hdir = ws["gates"][layer, direction], ws["states"][layer, direction], ws["hdir"][layer, direction]
            dh.fill(0)
            dc.fill(0)
            order = step_order(steps, direction)
            after = None                            # the step after t in time, walked before it
            fused = gpu_kernels(xp, gates, states, dh, dc, dgates, drec, dlayer, params[w_hh])
            for k in reversed(range(steps)):
                t, previous = order[k], (order[k - 1] if k else None)
                before = None if previous is None else (states if lstm else hdir)[previous]   # lstm: c; gru: h
                if fused is not None and lstm:   # dh = output gradient + dgates[after] @ W_hh, the cell's backward
                    fused.lstm_step_backward(gates[t], states[t], before, None if after is None else dgates[after],
                                             params[w_hh], dlayer[t], direction * h, dc, dgates[t])
                elif fused is not None:          # dh = output gradient + carried dh z + dgh[after] @ W_hh, the cell's
                    fused.gru_step_backward(gates[t], states[t], before, None if after is None else drec[after],
                                            params[w_hh], dlayer[t], direction * h, dh, dgates[t], drec[t])
                else:
                    dh += dlayer[t][:, direction * h:(direction + 1) * h]
                    if lstm:
                        _lstm_step_backward(xp, h, gates[t], states[t], before, dh, dc, dgates[t], s)
                        if previous is not None:
                            matmul(xp, dgates[t], params[w_hh], dh)
                    else:
                        _gru_step_backward(xp, h, gates[t], states[t], before, dh, dgates[t], drec[t], s)
                        if previous is not None:
                            matmul(xp, drec[t], params[w_hh], s[0])
                            dh += s[0]
                after = t
            dg_2d = dgates.reshape(steps * n, -1)
            dw_ih = ws["dw_ih0"] if layer == 0 else ws["dw_ih"]
            matmul(xp, dg_2d.T, in_2d, dw_ih)
            grads[w_ih] += dw_ih
            later, earlier = (slice(0, steps - 1), slice(1, steps)) if direction else (slice(1, steps), slice(0, steps - 1))
            if steps > 1:                           # h_prev of every step but the first
                matmul(xp, drec[later].reshape(-1, drec.shape[-1]).T, hdir[earlier].reshape(-1, h), ws["dw_hh"])
                grads[w_hh] += ws["dw_hh"]
            if b_ih is not None:
                xp.sum(dgates, axis=(0, 1), out=ws["db"])
                grads[b_ih] += ws["db"]
                xp.sum(drec, axis=(0, 1), out=ws["db"])
                grads[b_hh] += ws["db"]
            if dlayer_in is not None:
                target = dlayer_in.reshape(steps * n, -1)
                if direction == 0:
                    matmul(xp, dg_2d, params[w_ih], target)
                else:
                    scratch = ws["dx_scratch"][:target.size].reshape(target.shape)
                    matmul(xp, dg_2d, params[w_ih], scratch)
                    target += scratch
        dlayer = dlayer_in
    if dx is not None:
        dx[...] = ws["dseq_in"].transpose(1, 2, 0)
    return dx
