"""Folding a batch norm (inference) into the layer before it; shared by the CPU and CUDA backends and
the ONNX export, which all decide by `folds_into_previous`.

At inference a batch norm is a per-channel y = x * scale + shift (formats/ops.py BatchNorm.forward).
After a conv1d [O, C/g, K], conv2d [O, C/g, KH, KW] or linear [O, I] layer without an activation it folds into that
layer: weight[o] *= scale[o], bias[o] = bias[o] * scale[o] + shift[o].
"""

from __future__ import annotations

import numpy as np


def scale_and_shift(node, weights) -> tuple[np.ndarray, np.ndarray]:
    """The batch norm of `node` as float32 (scale, shift) per channel, computed in float64."""
    param = {name: np.asarray(weights[node.param_key(name)], dtype=np.float64)
             for name in ("weight", "bias", "running_mean", "running_var")}
    scale = param["weight"] / np.sqrt(param["running_var"] + node.attrs["eps"])
    shift = param["bias"] - param["running_mean"] * scale
    return scale.astype(np.float32), shift.astype(np.float32)


def fold_scale_and_shift(weight: np.ndarray, bias: np.ndarray | None, scale: np.ndarray, shift: np.ndarray):
    """(weight, bias) of a layer followed by y * scale + shift per output channel; new float32 arrays."""
    per_output = scale.reshape((-1,) + (1,) * (weight.ndim - 1))
    bias = np.zeros(weight.shape[0], np.float32) if bias is None else bias
    return (weight * per_output).astype(np.float32), (bias * scale + shift).astype(np.float32)


FOLD_TARGETS = ("conv1d", "conv2d", "linear")


def folds_into_previous(node, previous_op: str | None, previous_is_open: bool) -> bool:
    """The one rule: a batch norm folds into the layer right before it when that layer is a conv2d or linear
    (conv1d: a conv2d of height 1) whose output nothing has transformed yet (`previous_is_open`: no activation, no fused pool)."""
    return node.op == "batchnorm" and previous_op in FOLD_TARGETS and previous_is_open
