"""The CuPy GPU backend: turns a Model into a list of layers, then into a fixed plan per batch size.

Load time (once):
  - dropout is dropped (identity at inference);
  - a batch norm right after a conv2d / linear layer without an activation is folded into its weight
    and bias (formats/fold.py, as the CPU backend does); an activation layer right after a layer with
    an epilogue and no activation of its own becomes that epilogue's activation;
  - weights and epilogue vectors are uploaded to the GPU.
First call per batch size: every device buffer is allocated and every kernel call is bound to its
buffers (`steps`, argument-free callables). A call copies the input into the plan's input buffer,
runs the steps and copies the output back to the host (a new NumPy array); run_measured also takes each
input's lowest and highest value there, for Session's checks of a large batch (measures_on_device). Each
calling thread has its own plans (runtime/plans.py), so a backend is safe to share between threads. keep=(node names):
fusion stops at those nodes and their values are copied into buffers of their own, which
run_with_features() returns too (the out-of-distribution gate's features; runtime/features.py).

Kernels: the generic forward kernels of kernels.py (shared with the trainer), with fused.py's CuPy
kernels in their place where one launch beats several (conv1d is conv2d's layer on [N, C, 1, T] views):
a stride-1 conv2d that conv_gemm.supported() accepts is the trainer's implicit-GEMM kernel (bias and relu fused; conv_gemm.py), or where
winograd.chosen() its Winograd F(2x2, 3x3) kernels (winograd.py); another conv2d is
im2col (fused) + one grouped GEMM
(kernels.conv2d_gemm, cuBLAS) + one epilogue that moves the GEMM's [O, N, P] layout to [N, O, P] and
applies bias and activation (at batch 1 the GEMM writes the output directly and the epilogue runs in
place); linear is a GEMM + in-place epilogue; max pool is one kernel; avg pool, global average and max
pool, layer norm and softmax are the generic kernels; the 1-D pools are the 2-D layers on [N, C, 1, T] views;
lstm and gru are the trainer's generic forward (recurrent.py). `array_module=numpy` runs the same plan with the generic kernels
only (how the planning is tested where there is no GPU).
"""

from __future__ import annotations

import math
from functools import partial

import numpy as np

from lnn.formats.errors import LnnError
from lnn.formats.model import Model, as_rows
from lnn.formats.ops import ACTIVATIONS, conv1d_padded_length, get_op, layer_table
from lnn.runtime.cuda import conv_gemm, recurrent, winograd
from lnn.runtime.cuda import kernels as K
from lnn.runtime.plans import PerThreadCache
from lnn.formats.fold import fold_scale_and_shift, folds_into_previous, scale_and_shift
from lnn.runtime.features import LayerOutputs, check_kept

IDENTITY_AT_INFERENCE = {"dropout"}
PLANS_KEPT = 4          # batch sizes whose buffers stay allocated
# Session's checks take the extremes of a batch run in chunks of this many bytes or more on the GPU
# (measures_on_device, run_measured), of a smaller one on the host, where a pass costs about 0.125 ms a MiB
# (NumPy's min and max of 256 leaf_cnn224 inputs, 154 MB: 19 ms on the 2-core VM). gpu_infer on an H100, every
# batch's extremes on the GPU (344bf33): lnn at batch 1 at 1.36-2.31x PyTorch eager's time; with this threshold
# (bf0829b) at 1.50-1.96x, three of the four models lower, mnist_cnn higher (PyTorch's own times moved 0.02-0.14 ms
# between the runs)
DEVICE_EXTREMES_FROM_BYTES = 1 << 20
FLOAT = np.float32


class Device:
    """The array namespace a plan runs on and, on the GPU, the fused kernels (None on NumPy)."""

    def __init__(self, xp):
        self.xp = xp
        self.fused = None
        if xp is not np:
            from lnn.runtime.cuda import fused

            self.fused = fused

    def upload(self, array):
        return self.xp.asarray(np.ascontiguousarray(array, dtype=FLOAT))


class Epilogue:
    """y = act(y * scale[c] + shift[c]) over the channel axis (axis 1) of a layer's output."""

    def __init__(self, channels: int, shift=None, activation: dict | None = None):
        self.scale = np.ones(channels, FLOAT)
        self.shift = np.zeros(channels, FLOAT) if shift is None else np.array(shift, FLOAT)
        self.activation = activation

    def upload(self, device: Device) -> None:
        self.device = device
        self.scale_on_device = device.upload(self.scale)
        self.shift_on_device = device.upload(self.shift)

    @property
    def is_identity(self) -> bool:
        return self.activation is None and not self._affine

    @property
    def _affine(self) -> bool:
        return bool(self.shift.any() or (self.scale != 1).any())

    @property
    def _element_wise(self) -> dict | None:
        return None if self.activation is None or self.activation["type"] == "softmax" else self.activation

    def _softmax_steps(self, y) -> list:
        if self.activation is not None and self.activation["type"] == "softmax":
            return [partial(K.activation_forward, self.device.xp, self.activation, y, y)]
        return []

    def _fused_arguments(self, y) -> tuple:
        activation = self._element_wise
        code = self.device.fused.ACTIVATION_CODES[None if activation is None else activation["type"]]
        slope = float(activation.get("negative_slope", 0.0)) if activation else 0.0
        positions = int(np.prod(y.shape[2:], dtype=np.int64))
        return self.scale_on_device, self.shift_on_device, y.shape[1], positions, code, slope

    def steps_in_place(self, y) -> list:
        """Steps turning y [N, C, ...] into act(y * scale + shift)."""
        xp, fused = self.device.xp, self.device.fused
        steps = []
        if fused is not None:
            if self._affine or self._element_wise:
                steps.append(partial(fused.epilogue_in_place, *self._fused_arguments(y), y))
        else:
            if self._affine:
                steps += [partial(xp.multiply, y, K.per_channel(self.scale_on_device, y), out=y),
                          partial(xp.add, y, K.per_channel(self.shift_on_device, y), out=y)]
            if self._element_wise:
                steps.append(partial(K.activation_forward, xp, self.activation, y, y))
        return steps + self._softmax_steps(y)

    def steps_from_gemm(self, gemm_out, y) -> list:
        """Steps writing y [N, C, ...] = act(gemm_out [C, N, ...] transposed * scale + shift)."""
        fused = self.device.fused
        if fused is None:
            return [partial(np.copyto, y, gemm_out.swapaxes(0, 1))] + self.steps_in_place(y)
        scale, shift, channels, positions, code, slope = self._fused_arguments(y)
        launch = partial(fused.epilogue_from_gemm, gemm_out, scale, shift, y.shape[0], channels, positions, code, slope, y)
        return [launch] + self._softmax_steps(y)


class GemmLayer:
    """conv2d and linear: a weight, then an epilogue holding the bias (and a folded batch norm)."""

    def __init__(self, node, weights):
        self.attrs = node.attrs
        self.in_shape, self.out_shape = node.in_shape, node.out_shape
        self.weight = np.array(weights[node.param_key("weight")], FLOAT)
        bias = weights[node.param_key("bias")] if node.attrs["bias"] else None
        self.epilogue = Epilogue(self.out_shape[0], bias, node.attrs["activation"])

    def fold(self, scale, shift) -> None:
        self.weight, self.epilogue.shift = fold_scale_and_shift(self.weight, self.epilogue.shift, scale, shift)

    def upload(self, device: Device) -> None:
        self.weight_on_device = device.upload(self.weight)
        self.epilogue.upload(device)


class Conv2dLayer(GemmLayer):
    ops = ("conv2d",)

    @property
    def pointwise(self) -> bool:
        """A 1x1, stride-1, unpadded conv: its cols are its input, at batch 1 even in memory order."""
        a = self.attrs
        return a["kernel_size"] == (1, 1) and a["stride"] == (1, 1) and a["padding"] == (0, 0)

    @property
    def implicit_gemm(self) -> bool:
        return conv_gemm.supported(self.attrs)

    def padded_buffer(self, xp, src):
        return padded_buffer(xp, src, self.attrs)

    def plan(self, src, device: Device):
        xp, n = device.xp, src.shape[0]
        cin, (cout, oh, ow) = self.in_shape[0], self.out_shape
        kh, kw = self.attrs["kernel_size"]
        out = xp.empty((n, cout, oh, ow), FLOAT)
        if device.fused is not None and self.implicit_gemm:
            return out, self._implicit_gemm_steps(src, out, device)
        steps = []
        if self.pointwise and n == 1:
            cols = src.reshape(cin, 1, 1, 1, oh, ow)
        else:
            cols = xp.empty((cin, kh, kw, n, oh, ow), FLOAT)
            if device.fused is not None:
                steps.append(partial(device.fused.im2col, src, self.attrs, cols))
            else:
                steps.append(partial(K.im2col, xp, src, self.attrs, self.padded_buffer(xp, src), cols))
        gemm_out = out.reshape(cout, 1, oh, ow) if n == 1 else xp.empty((cout, n, oh, ow), FLOAT)
        steps.append(partial(K.conv2d_gemm, xp, self.weight_on_device, self.attrs["groups"], cols, gemm_out))
        if n > 1:
            steps += self.epilogue.steps_from_gemm(gemm_out, out)
        else:
            steps += self.epilogue.steps_in_place(out)
        return out, steps

    def _implicit_gemm_steps(self, src, out, device: Device) -> list:
        """The trainer's kernels: implicit GEMM (no im2col buffer), or Winograd where winograd.chosen()
        (weights transformed here, once); bias and relu in their epilogue, other activations
        (and a scale) by the fused epilogue afterwards."""
        if winograd.chosen(self.attrs, self.in_shape[0], self.out_shape[0]):
            kernels = winograd.WinogradKernels(self.attrs, self.in_shape, self.out_shape, backward=False)
            kernels.transform_weight(self.weight_on_device)
            shapes = winograd.workspace_shapes(self.in_shape[0], self.out_shape[0], self.in_shape[1:],
                                               self.out_shape[1:], src.shape[0])
            v, m = (device.xp.empty(shape, FLOAT) for shape in shapes)
            convolve = partial(kernels.forward, v=v, m=m, weight_ready=True)
        else:
            convolve = conv_gemm.ConvKernels(self.attrs, self.in_shape, self.out_shape, backward=False).forward
        activation = self.epilogue.activation
        in_kernel = (activation is None or activation["type"] == "relu") and (self.epilogue.scale == 1).all()
        if in_kernel:
            return [partial(convolve, src, self.weight_on_device, self.epilogue.shift_on_device, out,
                            relu=activation is not None)]
        return [partial(convolve, src, self.weight_on_device, None, out)] + self.epilogue.steps_in_place(out)


class OnRows:
    """A 1-D window layer (conv1d, the 1-D pools): its 2-D layer (the class this is mixed into) on the node
    formats/model.py as_rows gives, run on [N, C, 1, T] views."""

    def __init__(self, node, weights):
        super().__init__(as_rows(node), weights)

    def plan(self, src, device: Device):
        out, steps = super().plan(src.reshape(src.shape[0], src.shape[1], 1, -1), device)
        return out.reshape(out.shape[0], out.shape[1], -1), steps


class Conv1dLayer(OnRows, Conv2dLayer):
    """conv1d: the conv2d of height 1 of formats/ops.py conv1d_as_conv2d, on views [N, C, 1, T] -> [N, O, 1, OT]
    with the weight [O, C/g, 1, K]. Its 2-D padding is (0, left); a right padding that differs is read as
    zeros past the input by the fused im2col (the output width bounds the windows) and sized into the
    generic kernels' padded buffer; implicit GEMM (symmetric padding only) takes padding alike on both sides."""
    ops = ("conv1d",)

    def __init__(self, node, weights):
        super().__init__(node, weights)
        self.sides, self.padded_length = node.attrs["padding"], conv1d_padded_length(node.attrs, node.in_shape[1])
        self.weight = self.weight[:, :, None]

    @property
    def implicit_gemm(self) -> bool:
        return self.sides[0] == self.sides[1] and super().implicit_gemm

    def padded_buffer(self, xp, src):
        if not any(self.sides):
            return None
        n, c = src.shape[:2]
        return xp.empty((n, c, 1, self.padded_length), FLOAT)


class LinearLayer(GemmLayer):
    ops = ("linear",)

    def plan(self, src, device: Device):
        out = device.xp.empty((src.shape[0], *self.out_shape), FLOAT)
        steps = [partial(K.linear_forward, device.xp, src, self.weight_on_device, None, out)]
        return out, steps + self.epilogue.steps_in_place(out)


def padded_buffer(xp, src, attrs):
    """The generic window kernels' zero/-inf bordered copy of src, or None without padding."""
    ph, pw = attrs["padding"]
    if not ph and not pw:
        return None
    n, c, h, w = src.shape
    return xp.empty((n, c, h + 2 * ph, w + 2 * pw), FLOAT)


class AffineLayer:
    """A batch norm that could not be folded (scale, shift from the running statistics) or a stand-alone
    activation (scale 1, shift 0): one epilogue, in place on its input."""
    ops = ("batchnorm", *ACTIVATIONS)

    def __init__(self, node, weights):
        if node.op == "batchnorm":
            scale, shift = scale_and_shift(node, weights)
            self.epilogue = Epilogue(node.out_shape[0], shift, node.attrs["activation"])
            self.epilogue.scale = np.array(scale, FLOAT)
        else:
            self.epilogue = Epilogue(node.out_shape[0], None, node.attrs)

    def upload(self, device: Device) -> None:
        self.epilogue.upload(device)

    def plan(self, src, device: Device):
        return src, self.epilogue.steps_in_place(src)


class MaxPool2dLayer:
    ops = ("maxpool2d",)

    def __init__(self, node, weights):
        self.attrs, self.out_shape = node.attrs, node.out_shape

    def plan(self, src, device: Device):
        xp, n = device.xp, src.shape[0]
        out = xp.empty((n, *self.out_shape), FLOAT)
        if device.fused is not None:
            return out, [partial(device.fused.maxpool2d, src, self.attrs, out)]
        return out, [partial(K.maxpool2d_forward, xp, src, self.attrs, out, padded_buffer(xp, src, self.attrs))]


class AvgPool2dLayer:
    ops = ("avgpool2d",)

    def __init__(self, node, weights):
        self.attrs, self.in_shape, self.out_shape = node.attrs, node.in_shape, node.out_shape

    def plan(self, src, device: Device):
        xp, n = device.xp, src.shape[0]
        out = xp.empty((n, *self.out_shape), FLOAT)
        divisor = K.avgpool_divisor(xp, self.attrs, self.in_shape[1:], self.out_shape[1:], np.dtype(FLOAT))
        return out, [partial(K.avgpool2d_forward, xp, src, self.attrs, divisor, out, padded_buffer(xp, src, self.attrs))]


class MaxPool1dLayer(OnRows, MaxPool2dLayer):
    ops = ("maxpool1d",)


class AvgPool1dLayer(OnRows, AvgPool2dLayer):
    ops = ("avgpool1d",)


class GlobalPoolLayer:
    """global_avg_pool / global_max_pool over everything after the channel axis (the generic kernels)."""
    ops = ("global_avg_pool", "global_max_pool")

    def __init__(self, node, weights):
        self.out_shape = node.out_shape
        self.forward = K.global_avg_pool_forward if node.op == "global_avg_pool" else K.global_max_pool_forward

    def plan(self, src, device: Device):
        out = device.xp.empty((src.shape[0], *self.out_shape), FLOAT)
        return out, [partial(self.forward, device.xp, src, out)]


class LayerNormLayer:
    """layernorm: the generic kernel over rows of prod(normalized_shape) values."""
    ops = ("layernorm",)

    def __init__(self, node, weights):
        self.eps, self.count = node.attrs["eps"], math.prod(node.attrs["normalized_shape"])
        self.params = {p: np.array(weights[node.param_key(p)], FLOAT).reshape(-1) for p in node.param_shapes}

    def upload(self, device: Device) -> None:
        self.on_device = {p: device.upload(value) for p, value in self.params.items()}

    def plan(self, src, device: Device):
        out = device.xp.empty(src.shape, FLOAT)
        return out, [partial(K.layernorm_forward, device.xp, src, self.on_device.get("weight"),
                             self.on_device.get("bias"), self.eps, self.count, out)]


class RecurrentLayer:
    """lstm and gru: the trainer's forward (recurrent.py recurrent_forward: one GEMM for every step's input
    projections per layer and direction, then per step a recurrent GEMM and the gate arithmetic as
    in-place CuPy calls) on workspaces planned per batch size."""
    ops = ("lstm", "gru")

    def __init__(self, node, weights):
        self.op, self.attrs, self.in_shape, self.out_shape = get_op(node.op), node.attrs, node.in_shape, node.out_shape
        self.weights = {p: np.asarray(weights[node.param_key(p)], FLOAT) for p in node.param_shapes}

    def upload(self, device: Device) -> None:
        self.on_device = {p: device.upload(w) for p, w in self.weights.items()}

    def plan(self, src, device: Device):
        xp, n = device.xp, src.shape[0]
        out = xp.empty((n, *self.out_shape), FLOAT)
        ws = {name: xp.empty(shape, FLOAT) for name, shape, _ in recurrent.recurrent_workspaces(self.op, self.attrs, self.in_shape, n)}
        return out, [partial(recurrent.recurrent_forward, xp, self.op, src, self.on_device, self.attrs, out, ws)]


class FlattenLayer:
    """A view of its input: no buffer, no work."""
    ops = ("flatten",)

    def __init__(self, node, weights):
        pass

    def plan(self, src, device: Device):
        return src.reshape(src.shape[0], -1), []


LAYERS = layer_table("CUDA", [globals()])      # every op of the registry but dropout (tests/runtime/test_cuda_plan.py)


def build_layers(model: Model, weights: dict, outputs: LayerOutputs | None = None) -> list:
    """The fused layers; `outputs` (when given) records which node each layer's output is the value of,
    and fusion stops at a layer whose output is kept."""
    outputs = outputs or LayerOutputs(frozenset())
    layers = []
    for node in model.nodes:
        if node.op in IDENTITY_AT_INFERENCE:
            outputs.skipped(node)
            continue
        previous = layers[-1] if layers and outputs.may_fuse() else None
        open_epilogue = getattr(previous, "epilogue", None) is not None and previous.epilogue.activation is None
        previous_op = "conv2d" if isinstance(previous, Conv2dLayer) else "linear" if isinstance(previous, LinearLayer) else None
        if folds_into_previous(node, previous_op, open_epilogue):
            previous.fold(*scale_and_shift(node, weights))
            previous.epilogue.activation = node.attrs["activation"]
            outputs.fused(node)
            continue
        if node.op in ACTIVATIONS and open_epilogue:
            previous.epilogue.activation = node.attrs
            outputs.fused(node)
            continue
        layers.append(LAYERS[node.op](node, weights))
        outputs.added(node)
    return layers


class Plan:
    def __init__(self, layers: list, input_shape: tuple, batch: int, device: Device, kept_after: dict | None = None):
        self.device = device
        self.input = device.xp.empty((batch, *input_shape), FLOAT)
        self.steps = []
        self.kept = {}                   # kept node name -> its own device buffer, filled right after its layer
        x = self.input
        for index, layer in enumerate(layers):
            x, steps = layer.plan(x, device)
            self.steps += steps
            for name in (kept_after or {}).get(index, ()):
                copy = self.kept[name] = device.xp.empty(x.shape, FLOAT)
                self.steps.append(partial(device.xp.copyto, copy, x))
        self.output = x

    def run(self, x: np.ndarray, extremes_over: tuple = ()) -> tuple:
        """(output, {kept name: value}, (lowest, highest)) as new host arrays: with extremes_over (axes of the
        input), each input's lowest and highest value over them, taken from the uploaded input; else None."""
        if self.device.fused is None:
            np.copyto(self.input, x)
        else:
            self.input.set(x)
        extremes = None                 # taken before the steps: a step may overwrite the input buffer in place
        if extremes_over:
            extremes = (self.input.min(axis=extremes_over), self.input.max(axis=extremes_over))
        for step in self.steps:
            step()
        host = (lambda value: value.get()) if self.device.fused is not None else np.copy
        return (host(self.output), {name: host(value) for name, value in self.kept.items()},
                None if extremes is None else tuple(map(host, extremes)))


def _cupy_with_a_gpu():
    import cupy

    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except Exception as err:                         # noqa: BLE001 - any CUDA failure means: no usable GPU
        raise LnnError(f"the cuda backend finds no usable GPU ({err})") from None
    if count < 1:
        raise LnnError("the cuda backend finds no GPU")
    return cupy


class CudaBackend:
    name = "cuda"

    def __init__(self, model: Model, weights: dict, threads: int | None = None, array_module=None, keep: tuple = ()):
        """threads: accepted and ignored (the GPU is not threaded by the host), so that the same options
        work on every device; array_module=numpy runs the plans on NumPy (tests); keep: see the header."""
        self.model = model
        self.device = Device(array_module if array_module is not None else _cupy_with_a_gpu())
        outputs = LayerOutputs(check_kept(model, keep))
        self.layers = build_layers(model, weights, outputs)
        self._kept_after = outputs.kept_after()
        for layer in self.layers:
            if hasattr(layer, "upload"):
                layer.upload(self.device)
        self._plans = PerThreadCache(                   # per calling thread: a backend is safe to share
            lambda batch: Plan(self.layers, model.input_shape, batch, self.device, self._kept_after), PLANS_KEPT)

    def _plan(self, batch: int) -> Plan:
        return self._plans.get(batch)

    def run(self, x: np.ndarray) -> np.ndarray:
        """x: C-contiguous float32 [N, *input_shape] -> a new host array [N, *output_shape]."""
        return self._plan(x.shape[0]).run(x)[0]

    def run_with_features(self, x: np.ndarray) -> tuple:
        """(output, {kept node name: its value [N, ...]}), new host arrays."""
        return self._plan(x.shape[0]).run(x)[:2]

    def measures_on_device(self, chunk: np.ndarray) -> bool:
        """Whether Session's checks take the extremes of a batch run in chunks like this one here (run_measured):
        from DEVICE_EXTREMES_FROM_BYTES on; a smaller one's cost less on the host, before it runs."""
        return chunk.nbytes >= DEVICE_EXTREMES_FROM_BYTES

    def run_measured(self, x: np.ndarray, axes: tuple) -> tuple:
        """(output, {kept node name: value}, (lowest, highest)): run_with_features and each input's lowest and
        highest value over `axes`, taken on the GPU from the uploaded input for Session's checks (NaN, infinity,
        inputs no preprocessing makes; why: docs/ARCHITECTURE.md, Session's checks)."""
        return self._plan(x.shape[0]).run(x, axes)
