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
"""

from __future__ import annotations


def global_norm(xp, grads) -> float:
    return float(xp.sqrt(xp.dot(grads, grads)))


def clip_by_global_norm(xp, grads, norm: float, max_norm: float) -> None:
    coefficient = max_norm / (norm + 1e-6)
    if coefficient < 1:
        grads *= grads.dtype.type(coefficient)


class Optimizer:
    state_names: tuple = ()

    def __init__(self, xp, params, config: dict):
        self.xp = xp
        self.params = params
        self.config = dict(config)
        self.steps = 0
        self.state = {name: xp.zeros_like(params) for name in self.state_names}

    def update(self, grads, lr: float) -> None:
        self.steps += 1
        self._update(grads, lr)

    def state_dict(self) -> dict:
        return {"steps": self.steps, **self.state}

    def load_state_dict(self, state: dict) -> None:
        self.steps = int(state["steps"])
        for name in self.state_names:
            self.state[name][...] = self.xp.asarray(state[name])


class SGD(Optimizer):
    def __init__(self, xp, params, config):
        self.state_names = ("momentum_buffer",) if config.get("momentum", 0) else ()
        super().__init__(xp, params, config)

    def _update(self, grads, lr):
        c, p, g = self.config, self.params, grads
        t = p.dtype.type
        if c["weight_decay"]:
            g = g + t(c["weight_decay"]) * p
        if c["momentum"]:
            buf = self.state["momentum_buffer"]
            if self.steps == 1:
                buf[...] = g
            else:
                buf *= t(c["momentum"])
                buf += g
            g = g + t(c["momentum"]) * buf if c["nesterov"] else buf
        p -= t(lr) * g


class Adam(Optimizer):
    state_names = ("exp_avg", "exp_avg_sq")
    decoupled = False

    def _update(self, grads, lr):
        c, p, g, xp = self.config, self.params, grads, self.xp
        t = p.dtype.type
        beta1, beta2 = c["betas"]
        if c["weight_decay"]:
            if self.decoupled:
                p *= t(1 - lr * c["weight_decay"])
            else:
                g = g + t(c["weight_decay"]) * p
        m, v = self.state["exp_avg"], self.state["exp_avg_sq"]
        m *= t(beta1)
        m += t(1 - beta1) * g
        v *= t(beta2)
        v += t(1 - beta2) * g * g
        bias1 = 1 - beta1 ** self.steps
        bias2 = 1 - beta2 ** self.steps
        denominator = xp.sqrt(v / t(bias2))
        denominator += t(c["eps"])
        p -= t(lr / bias1) * m / denominator


class AdamW(Adam):
    decoupled = True


OPTIMIZER_CLASSES = {"sgd": SGD, "adam": Adam, "adamw": AdamW}


def make_optimizer(xp, params, config: dict) -> Optimizer:
    return OPTIMIZER_CLASSES[config["type"]](xp, params, config)

