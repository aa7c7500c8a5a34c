"""Activations and the per-channel epilogue every compute layer ends with.

affine_activation: src [N, C, P] float32 -> dst [N, C, P] (dst may be src)
    dst[n, c, p] = act(src[n, c, p] * scale[c] + shift[c])
    act is one of formats/ops.py ACTIVATIONS; softmax normalizes over C for each (n, p), as the
    reference's softmax over axis 1 does. A linear layer's [N, F] output is the case P = 1.
The same kernel is a conv's or linear's bias + activation (scale = 1), a stand-alone batch norm
(scale, shift from the running statistics) and a stand-alone activation layer (scale 1, shift 0).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import partial

import numpy as np

from lnn.formats.ops import ACTIVATIONS
from lnn.runtime.cpu.aot import A1, A3, F, I
from lnn.runtime.cpu.jit import kernel

# Each kernel's ahead-of-time signature (aot.py): the argument types the backend passes; None: called
# only by other kernels, compiled into them.
AOT_SIGNATURES = {
    "activate": None,
    "affine_activation": (A3, A1, A1, I, F, A3),
}

# Activation codes, passed to kernels as integers.
NONE, RELU, RELU6, LEAKY_RELU, SIGMOID, TANH, SOFTMAX = range(7)
CODES = {None: NONE, "relu": RELU, "relu6": RELU6, "leaky_relu": LEAKY_RELU, "sigmoid": SIGMOID,
         "tanh": TANH, "softmax": SOFTMAX}


def is_monotone(code: int, slope: float) -> bool:
    """Element-wise and non-decreasing: max-pooling commutes with it (and with adding a bias).
    Softmax mixes channels; a leaky relu with a negative slope decreases below 0."""
    return code != SOFTMAX and not (code == LEAKY_RELU and slope < 0)


@dataclass
class Epilogue:
    """act(x * scale[c] + shift[c]) over channels; float32 arrays of length C."""

    scale: np.ndarray
    shift: np.ndarray
    code: int = NONE
    slope: float = 0.0

    @classmethod
    def identity(cls, channels: int) -> "Epilogue":
        return cls(np.ones(channels, np.float32), np.zeros(channels, np.float32))

    def set_activation(self, activation: dict | None) -> None:
        self.code = CODES[None if activation is None else activation["type"]]
        self.slope = float(activation.get("negative_slope", 0.0)) if activation else 0.0

    @property
    def is_identity(self) -> bool:
        return self.code == NONE and not self.shift.any() and (self.scale == 1).all()

    def run(self, src3: np.ndarray, dst3: np.ndarray) -> None:
        affine_activation(src3, self.scale, self.shift, self.code, self.slope, dst3)


@kernel
def activate(v, code, slope):
    """One element of a non-softmax activation, float32 in and out."""
    if code == RELU:
        return v if v > 0 else np.float32(0)
    if code == RELU6:
        return min(max(v, np.float32(0)), np.float32(6))
    if code == LEAKY_RELU:
        return v if v >= 0 else v * np.float32(slope)
    if code == SIGMOID:
        e = np.float32(math.exp(-abs(v)))
        return np.float32(1) / (np.float32(1) + e) if v >= 0 else e / (np.float32(1) + e)
    if code == TANH:
        return np.float32(math.tanh(v))
    return v


@kernel
def affine_activation(src, scale, shift, code, slope, dst):
    batch, channels, positions = src.shape
    if code == SOFTMAX:
        for n in range(batch):
            for p in range(positions):
                largest = np.float32(-np.inf)
                for c in range(channels):
                    v = src[n, c, p] * scale[c] + shift[c]
                    dst[n, c, p] = v
                    largest = max(largest, v)
                total = np.float32(0)
                for c in range(channels):
                    e = np.float32(math.exp(dst[n, c, p] - largest))
                    dst[n, c, p] = e
                    total += e
                for c in range(channels):
                    dst[n, c, p] /= total
        return
    for n in range(batch):
        for c in range(channels):
            a = scale[c]
            b = shift[c]
            if code == NONE:
                for p in range(positions):
                    dst[n, c, p] = src[n, c, p] * a + b
            elif code == RELU:
                for p in range(positions):
                    dst[n, c, p] = max(src[n, c, p] * a + b, np.float32(0))
            else:
                for p in range(positions):
                    dst[n, c, p] = activate(src[n, c, p] * a + b, code, slope)


class ActivationLayer:
    """A stand-alone activation layer (when it could not be fused into the layer before it)."""
    ops = tuple(ACTIVATIONS)  # the registry ops this layer runs (backend.py LAYERS)

    def __init__(self, node, weights):
        self.out_shape = node.out_shape
        channels = node.in_shape[0]
        self.epilogue = Epilogue.identity(channels)
        self.epilogue.set_activation(node.attrs)

    def plan(self, src, new_buffer):
        dst = new_buffer(src.shape)
        return dst, [partial(self.epilogue.run, as_channels_positions(src), as_channels_positions(dst))]


def as_channels_positions(array: np.ndarray) -> np.ndarray:
    """[N, C, ...] -> a [N, C, P] view (P = 1 for [N, C])."""
    return array.reshape(array.shape[0], array.shape[1], -1)
