"""Optimizers over the plan's flat parameter and gradient buffers: one pass each, PyTorch semantics.

p, g: flat arrays (the same layout; padding between parameters stays zero). g is not modified
(the trainer's gradients stay inspectable after the step). Per step:
  SGD:   g += wd * p;  buf = momentum * buf + g  (buf = g on the first step);
         g = g + momentum * buf (nesterov) or buf;  p -= lr * g
  Adam:  g += wd * p (L2);  m = b1 m + (1-b1) g;  v = b2 v + (1-b2) g^2;
         p -= lr * (m / (1 - b1^t)) / (sqrt(v / (1 - b2^t)) + eps)
  AdamW: p *= 1 - lr * wd (decoupled decay), then Adam without the L2 term.
Weight decay applies to every learned parameter (biases and batch-norm scales too, as PyTorch's
default); batch-norm running statistics are not in these buffers.
`clip_by_global_norm` scales g in place so that ||g||_2 <= max_norm (PyTorch's clip_grad_norm_).
Everything stays on the device: the learning rate, the step count (Adam's bias corrections), the norm
and amp's "skip this step" flag are arrays, so a step can be captured as a CUDA graph and replayed.
On the GPU each update and the norm is one kernel of runtime/cuda/fused.py with this arithmetic (no
parameter-sized temporaries in a captured step); the NumPy code below is the reference and the CPU path.
"""

from __future__ import annotations

import numpy as np


def _fused(xp, *arrays):
    """runtime/cuda/fused.py's optimizer kernels when xp is CuPy and they take these arrays, else None."""
    if xp is np:
        return None
    from lnn.runtime.cuda import fused

    return fused if fused.optimizer_fits(*arrays) else None


def global_norm(xp, grads):
    """||grads||_2 as a 0-d array on the device (no host sync)."""
    fused = _fused(xp, grads)
    if fused is not None:
        return fused.global_norm(grads)                  # one reduction, no squared copy
    return xp.sqrt((grads * grads).sum())


def clip_by_global_norm(xp, grads, norm, max_norm: float) -> None:
    """grads *= min(1, max_norm / (norm + 1e-6)), with norm a 0-d device array."""
    grads *= xp.minimum(max_norm / (norm + 1e-6), 1).astype(grads.dtype)


class Optimizer:
    state_names: tuple = ()

    def __init__(self, xp, params, config: dict):
        self.xp = xp
        self.params = params
        self.config = dict(config)
        self.step_number = xp.zeros((), params.dtype)        # steps taken (skipped ones not counted), on the device
        self.state = {name: xp.zeros_like(params) for name in self.state_names}

    @property
    def steps(self) -> int:
        return int(self.step_number)

    def update(self, grads, lr, skip=None) -> None:
        """One step at learning rate `lr` (a number or a 0-d array). `skip`: a 0-d boolean array; where
        it is true, nothing changes (amp's overflowed step), decided on the device without a host sync."""
        xp = self.xp
        lr = xp.asarray(lr, dtype=self.params.dtype)
        keep = None if skip is None else ~skip
        self.step_number += 1 if keep is None else keep.astype(self.step_number.dtype)
        fused = _fused(xp, self.params, grads, *self.state.values())
        if fused is None:
            self._update(grads, lr, keep)
        else:                                            # one launch over the parameters, no temporaries
            self._fused_update(fused, grads, lr, xp.ones((), bool) if keep is None else keep)

    def _write(self, target, value, keep) -> None:
        if keep is None:
            target[...] = value
        else:
            self.xp.copyto(target, value, where=keep)

    def state_dict(self) -> dict:
        return {"steps": self.steps, **self.state}

    def load_state_dict(self, state: dict) -> None:
        self.step_number[...] = int(state["steps"])
        for name in self.state_names:
            self.state[name][...] = self.xp.asarray(state[name])


class SGD(Optimizer):
    def __init__(self, xp, params, config):
        self.state_names = ("momentum_buffer",) if config.get("momentum", 0) else ()
        super().__init__(xp, params, config)

    def _update(self, grads, lr, keep):
        c, p, g = self.config, self.params, grads
        t = p.dtype.type
        if c["weight_decay"]:
            g = g + t(c["weight_decay"]) * p
        if c["momentum"]:
            buf = t(c["momentum"]) * self.state["momentum_buffer"] + g     # the buffer starts at 0: buf = g first
            self._write(self.state["momentum_buffer"], buf, keep)
            g = g + t(c["momentum"]) * buf if c["nesterov"] else buf
        self._write(p, p - lr * g, keep)

    def _fused_update(self, fused, grads, lr, keep):
        c = self.config
        fused.sgd(self.params, grads, lr, keep, c["weight_decay"], c["momentum"], c["nesterov"],
                  self.state.get("momentum_buffer"))


class Adam(Optimizer):
    state_names = ("exp_avg", "exp_avg_sq")
    decoupled = False

    def _update(self, grads, lr, keep):
        c, p, g, xp = self.config, self.params, grads, self.xp
        t = p.dtype.type
        beta1, beta2 = c["betas"]
        param = p
        if c["weight_decay"]:
            if self.decoupled:
                param = p * (1 - lr * t(c["weight_decay"]))
            else:
                g = g + t(c["weight_decay"]) * p
        m = t(beta1) * self.state["exp_avg"] + t(1 - beta1) * g
        v = t(beta2) * self.state["exp_avg_sq"] + t(1 - beta2) * g * g
        step = xp.maximum(self.step_number, 1)                # a skipped first step divides by nothing
        bias1 = 1 - t(beta1) ** step
        bias2 = 1 - t(beta2) ** step
        self._write(self.state["exp_avg"], m, keep)
        self._write(self.state["exp_avg_sq"], v, keep)
        self._write(p, param - (lr / bias1) * m / (xp.sqrt(v / bias2) + t(c["eps"])), keep)

    def _fused_update(self, fused, grads, lr, keep):
        c = self.config
        fused.adam(self.params, grads, self.state["exp_avg"], self.state["exp_avg_sq"], lr, self.step_number, keep,
                   c["weight_decay"], self.decoupled, c["betas"], c["eps"])


class AdamW(Adam):
    decoupled = True


OPTIMIZER_CLASSES = {"sgd": SGD, "adam": Adam, "adamw": AdamW}


def make_optimizer(xp, params, config: dict) -> Optimizer:
    return OPTIMIZER_CLASSES[config["type"]](xp, params, config)
