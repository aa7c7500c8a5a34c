"""One class per op of formats/ops.py: which buffers its kernels need and how the plan calls them.

A layer states, for a batch of n samples,
  - its workspaces: (name, shape, dtype, phase) with phase "forward" (scratch of the forward),
    "backward" (scratch of the backward), "input_gradient" (scratch of the backward, only when it
    computes dx) or "saved" (written by the forward, read by the backward);
  - whether its backward reads its input (`needs_input`) or its output (`needs_output`);
  - `alias`: the output is the input reshaped (flatten): no buffer, no work.
The plan (train/plan.py) places every buffer in one pool and hands each call a `Call` holding
views: x, y, dy, dx, params, grads, stats, ws. Fused activations ("activation": "relu" on a
linear, conv or batch norm layer) run in place on the output and are undone in place on dy.
"""

from __future__ import annotations

import math

import numpy as np

from lnn.formats.errors import ModelSpecError
from lnn.formats.model import as_rows
from lnn.formats.ops import ACTIVATIONS, conv1d_padded_length, get_op, layer_table
from lnn.runtime.cuda import conv_gemm           # the partial sums' size here; CuPy only once a ConvKernels is made
from lnn.runtime.cuda import recurrent          # lstm and gru: forward and backward (no CuPy import)
from lnn.runtime.cuda import winograd           # the rule and the sizing only: importing it imports no CuPy
from lnn.train import kernels as K

COMPUTE = "compute"        # a workspace dtype meaning: the plan's activation dtype


class Call:
    """The views one layer call works on (a plain bag of attributes)."""

    def __init__(self, xp, **views):
        self.xp = xp
        self.__dict__.update(views)


class Layer:
    ops: tuple = ()                 # the ops of the registry a subclass trains (its own, not inherited: LAYERS)
    needs_input = False
    needs_output = False
    alias = False
    relu_undone_by_next = False     # the next layer (a pool) undoes this layer's relu (see PoolUndoingRelu)
    fuses_relu = False              # forward(c, training, relu=True) runs a following relu in its own pass

    def __init__(self, node):
        self.node = node
        self.attrs = node.attrs
        self.name = node.name
        self.activation = node.attrs.get("activation") if isinstance(node.attrs.get("activation"), dict) else None
        if self.activation and self.activation["type"] == "leaky_relu" and self.activation["negative_slope"] < 0:
            raise ModelSpecError(f"layer {node.index} ({node.op}): training needs leaky_relu negative_slope >= 0, "
                                 f"not {self.activation['negative_slope']}")
        self.needs_output = self.activation is not None

    def workspaces(self, n: int) -> list:
        return []

    def run_forward(self, c, training: bool, activate: bool = True):
        if activate and self.activation is not None and self.activation["type"] == "relu" and self.fuses_relu:
            self.forward(c, training, relu=True)
            return
        self.forward(c, training)
        if self.activation is not None and activate:
            K.activation_forward(c.xp, self.activation, c.y, c.y)

    def run_backward(self, c, activate: bool = True):
        if self.activation is not None and activate and not self.relu_undone_by_next:
            K.activation_backward(c.xp, self.activation, c.dy, c.y, c.dy)
        self.backward(c)

    def forward(self, c, training):
        raise NotImplementedError

    def backward(self, c):
        raise NotImplementedError


def _padded_shape(n, in_shape, padding):
    c, h, w = in_shape
    return (n, c, h + 2 * padding[0], w + 2 * padding[1])


class LinearLayer(Layer):
    ops = ("linear",)
    needs_input = True

    def forward(self, c, training):
        K.linear_forward(c.xp, c.x, c.params["weight"], c.params.get("bias"), c.y)

    def backward(self, c):
        K.linear_backward(c.xp, c.dy, c.x, c.params["weight"], c.grads["weight"], c.grads.get("bias"), c.dx)


class Conv2dLayer(Layer):
    """im2col + GEMM (kernels.py), or on the GPU when the plan asks for it and the convolution qualifies:
    implicit GEMM (runtime/cuda/conv_gemm.py: its weight gradient's partial sums are a workspace; float32,
    float16 or bfloat16), or in float32 where winograd.chosen() ("winograd", or "auto" with >= 32 channels
    in and out) Winograd F(2x2, 3x3) for the forward and the input gradient, and for the weight gradient
    where winograd.weight_gradient_chosen() (runtime/cuda/winograd.py: its transforms and products are
    workspaces)."""
    ops = ("conv2d",)
    needs_input = True
    implicit = False            # GPU kernels (set by the plan)
    dtype = np.dtype(np.float32)
    winograd = winograd_weight_gradient = False

    def __init__(self, node):
        super().__init__(node)
        self._implicit = self._winograd = None

    def use_implicit_gemm(self, dtype) -> None:
        """dtype: the plan's activations (float32; float16 or bfloat16 with amp, where Winograd, float32 only, is not chosen)."""
        self.implicit = True
        self.dtype = np.dtype(dtype)
        channels = (self.node.in_shape[0], self.node.out_shape[0])
        self.winograd = self.dtype == np.float32 and winograd.chosen(self.attrs, *channels)
        self.winograd_weight_gradient = self.winograd and winograd.weight_gradient_chosen(self.attrs, *channels)

    def implicit_kernels(self):
        """The layer's ConvKernels (made on first use: imports CuPy, allocates tables and scratch)."""
        if self._implicit is None:
            self._implicit = conv_gemm.ConvKernels(self.attrs, self.node.in_shape, self.node.out_shape, dtype=self.dtype)
        return self._implicit

    def winograd_kernels(self):
        if self._winograd is None:
            from lnn.runtime.cuda.winograd import WinogradKernels

            self._winograd = WinogradKernels(self.attrs, self.node.in_shape, self.node.out_shape)
        return self._winograd

    def workspaces(self, n):
        cin, h, w = self.node.in_shape
        cout, oh, ow = self.node.out_shape
        spaces = []
        if self.implicit and not self.winograd_weight_gradient:   # the weight gradient's partial sums: pooled
            partials = conv_gemm.partial_sums_elements(self.attrs, self.node.in_shape, self.node.out_shape, self.dtype)
            spaces.append(("wgrad_partial", (partials,), np.float32, "backward"))
        if self.winograd:
            v, m = winograd.workspace_shapes(cin, cout, (h, w), (oh, ow), n)
            spaces += [("winograd_v", v, COMPUTE, "forward"), ("winograd_m", m, COMPUTE, "forward")]
            if not self.winograd_weight_gradient:
                v_b, m_b = winograd.workspace_shapes(cout, cin, (oh, ow), (h, w), n)
                return spaces + [("winograd_v_b", v_b, COMPUTE, "input_gradient"),
                                 ("winograd_m_b", m_b, COMPUTE, "input_gradient")]
            # the backward's buffers serve the weight gradient, then the input gradient
            v_b, m_b, products = winograd.backward_workspace_shapes(cin, cout, (h, w), (oh, ow), n)
            return spaces + [("winograd_v_b", v_b, COMPUTE, "backward"), ("winograd_m_b", m_b, COMPUTE, "backward"),
                             ("winograd_products", products, COMPUTE, "backward")]
        if self.implicit:
            return spaces
        kh, kw = self.attrs["kernel_size"]
        spaces = [("cols", (cin, kh, kw, n, oh, ow), COMPUTE, "forward"),
                  ("cols_b", (cin, kh, kw, n, oh, ow), COMPUTE, "backward"),
                  ("gemm", (cout, n, oh, ow), COMPUTE, "forward"),
                  ("gemm_b", (cout, n, oh, ow), COMPUTE, "backward")]
        if any(self.attrs["padding"]):
            padded = self.padded_shape(n)
            spaces += [("padded", padded, COMPUTE, "forward"), ("padded_b", padded, COMPUTE, "backward")]
        return spaces

    def padded_shape(self, n: int) -> tuple:
        return _padded_shape(n, self.node.in_shape, self.attrs["padding"])

    @property
    def fuses_relu(self) -> bool:
        """On the GPU kernels a relu after the convolution runs inside its output step (no pass of its own)."""
        return self.implicit

    def forward(self, c, training, relu: bool = False):
        weight, bias = c.params["weight"], c.params.get("bias")
        if self.winograd:
            self.winograd_kernels().forward(c.x, weight, bias, c.y, c.ws["winograd_v"], c.ws["winograd_m"], relu)
        elif self.implicit:
            self.implicit_kernels().forward(c.x, weight, bias, c.y, relu)
        else:
            K.conv2d_forward(c.xp, c.x, weight, bias, self.attrs, c.y, c.ws.get("padded"), c.ws["cols"], c.ws["gemm"])

    def backward(self, c):
        weight = c.params["weight"]
        if not self.implicit:
            K.conv2d_backward(c.xp, c.dy, c.x, weight, self.attrs, c.grads["weight"], c.grads.get("bias"),
                              c.dx, c.ws.get("padded_b"), c.ws["cols_b"], c.ws["gemm_b"])
            return
        if self.winograd_weight_gradient:
            self.winograd_kernels().weight_gradient(c.dy, c.x, c.grads["weight"], c.grads.get("bias"), True,
                                                    c.ws["winograd_v_b"], c.ws["winograd_m_b"],
                                                    c.ws["winograd_products"])
        else:
            self.implicit_kernels().weight_gradient(c.dy, c.x, c.grads["weight"], c.grads.get("bias"),
                                                    accumulate=True, partial=c.ws["wgrad_partial"])
        if c.dx is None:
            return
        if self.winograd:
            self.winograd_kernels().input_gradient(c.dy, weight, c.dx, c.ws["winograd_v_b"], c.ws["winograd_m_b"])
        else:
            self.implicit_kernels().input_gradient(c.dy, weight, c.dx)


def _rows(array):
    """[N, C, T] -> the [N, C, 1, T] view the 2-D window kernels take (None stays None)."""
    return None if array is None else array.reshape(array.shape[0], array.shape[1], 1, array.shape[2])


class OnRows:
    """A 1-D window layer (conv1d, the 1-D pools): its 2-D layer (the class this is mixed into) on the node
    formats/model.py as_rows gives, its kernels called on [N, C, 1, T] views of x, y, dy and dx."""

    def __init__(self, node):
        super().__init__(as_rows(node))

    @staticmethod
    def on_rows(c) -> Call:
        views = {**vars(c), **{name: _rows(getattr(c, name, None)) for name in ("x", "y", "dy", "dx")}}
        return Call(**views)

    def forward(self, c, training):
        super().forward(self.on_rows(c), training)

    def backward(self, c):
        super().backward(self.on_rows(c))


class Conv1dLayer(OnRows, Conv2dLayer):
    """conv1d: the conv2d of height 1 of formats/ops.py conv1d_as_conv2d, with the weight [O, C/g, K] as it is
    (the kernels group it as [g, O/g, C/g*K]). The 2-D padding is (0, left) and the padded workspaces are
    T + left + right long, which is how a right padding other than the left one is made (pad_into /
    unpad_into place the input at `left` and leave the rest of the row zero). im2col + GEMM on the CPU and
    the GPU (no implicit GEMM yet)."""
    ops = ("conv1d",)

    def __init__(self, node):
        super().__init__(node)
        self.length = conv1d_padded_length(node.attrs, node.in_shape[1])

    def padded_shape(self, n):
        return (n, self.node.in_shape[0], 1, self.length)


class PoolUndoingRelu(Layer):
    """A pool whose backward also undoes the relu the layer right before it ends in (make_layers): that
    layer then skips its relu backward and need not keep its output for it. `relu_mask_from` names the
    buffer that shows where the relu let values through: "output" (a max pool: relu and max commute, so
    the pool's output is the winning input) or "input" (a global average pool: the relu's own output)."""
    takes_relu_backward = False
    relu_mask_from = "output"

    def take_relu_backward_of(self, previous: Layer) -> None:
        self.takes_relu_backward = True
        if self.relu_mask_from == "output":
            self.needs_output = True
        else:
            self.needs_input = True
        previous.relu_undone_by_next = True
        previous.needs_output = False


class MaxPoolLayer(PoolUndoingRelu):
    ops = ("maxpool2d",)

    def workspaces(self, n):
        index_dtype = np.uint8 if math.prod(self.attrs["kernel_size"]) <= 255 else np.int32
        spaces = [("argmax", (n,) + tuple(self.node.out_shape), index_dtype, "saved")]
        if any(self.attrs["padding"]):
            padded = _padded_shape(n, self.node.in_shape, self.attrs["padding"])
            spaces += [("padded", padded, COMPUTE, "forward"), ("padded_b", padded, COMPUTE, "backward")]
        return spaces

    def forward(self, c, training):
        K.maxpool2d_forward(c.xp, c.x, self.attrs, c.y, c.ws.get("padded"), c.ws["argmax"])

    def backward(self, c):
        K.maxpool2d_backward(c.xp, c.dy, self.attrs, c.ws["argmax"], c.dx, c.ws.get("padded_b"),
                             relu_output=c.y if self.takes_relu_backward else None)


class AvgPoolLayer(Layer):
    ops = ("avgpool2d",)

    def __init__(self, node):
        super().__init__(node)
        self._divisor = {}

    def divisor(self, xp, dtype):
        key = (xp.__name__, np.dtype(dtype).name)
        if key not in self._divisor:
            self._divisor[key] = K.avgpool_divisor(xp, self.attrs, self.node.in_shape[1:], self.node.out_shape[1:],
                                                   np.dtype(dtype))
        return self._divisor[key]

    def workspaces(self, n):
        if not any(self.attrs["padding"]):
            return []
        padded = _padded_shape(n, self.node.in_shape, self.attrs["padding"])
        return [("padded", padded, COMPUTE, "forward"), ("padded_b", padded, COMPUTE, "backward")]

    def forward(self, c, training):
        K.avgpool2d_forward(c.xp, c.x, self.attrs, self.divisor(c.xp, c.y.dtype), c.y, c.ws.get("padded"))

    def backward(self, c):
        K.avgpool2d_backward(c.xp, c.dy, self.attrs, self.divisor(c.xp, c.dy.dtype), c.dx, c.ws.get("padded_b"))


class GlobalAvgPoolLayer(PoolUndoingRelu):
    ops = ("global_avg_pool",)
    relu_mask_from = "input"

    def forward(self, c, training):
        K.global_avg_pool_forward(c.xp, c.x, c.y)

    def backward(self, c):
        K.global_avg_pool_backward(c.xp, c.dy, c.dx, relu_input=c.x if self.takes_relu_backward else None)


class MaxPool1dLayer(OnRows, MaxPoolLayer):
    ops = ("maxpool1d",)


class AvgPool1dLayer(OnRows, AvgPoolLayer):
    ops = ("avgpool1d",)


class GlobalMaxPoolLayer(Layer):
    """The winning position of each (sample, channel) is saved by the forward; the backward routes dy to it
    through `positions` (0..P-1, made once per array module, as AvgPoolLayer makes its divisor)."""
    ops = ("global_max_pool",)

    def __init__(self, node):
        super().__init__(node)
        self._positions = {}

    def positions(self, xp):
        if xp.__name__ not in self._positions:
            self._positions[xp.__name__] = xp.arange(math.prod(self.node.in_shape[1:]), dtype=np.int32)
        return self._positions[xp.__name__]

    def workspaces(self, n):
        return [("argmax", (n, self.node.in_shape[0]), np.int32, "saved")]

    def forward(self, c, training):
        K.global_max_pool_forward(c.xp, c.x, c.y, c.ws["argmax"])

    def backward(self, c):
        K.global_max_pool_backward(c.xp, c.dy, c.ws["argmax"], self.positions(c.xp), c.dx)


class FlattenLayer(Layer):
    ops = ("flatten",)
    alias = True


class BatchNormLayer(Layer):
    ops = ("batchnorm",)
    needs_input = True
    fuses_relu = True               # a relu after the batch norm runs inside its affine pass

    def workspaces(self, n):
        return [("saved", (2, self.attrs["num_features"]), "float32", "saved")]

    def forward(self, c, training, relu: bool = False):
        p, s = c.params, c.stats
        if training:
            K.batchnorm_train_forward(c.xp, c.x, p["weight"], p["bias"], s["running_mean"], s["running_var"],
                                      self.attrs, c.y, c.ws["saved"], relu)
        else:
            K.batchnorm_eval_forward(c.xp, c.x, p["weight"], p["bias"], s["running_mean"], s["running_var"],
                                     self.attrs, c.y, relu)

    def backward(self, c):
        K.batchnorm_backward(c.xp, c.dy, c.x, c.params["weight"], c.ws["saved"], c.grads["weight"],
                             c.grads["bias"], c.dx)


class LayerNormLayer(Layer):
    """Rows of prod(normalized_shape) values; the forward saves each row's mean and 1/sqrt(var + eps)."""
    ops = ("layernorm",)
    needs_input = True

    def __init__(self, node):
        super().__init__(node)
        self.count = math.prod(node.attrs["normalized_shape"])
        self.rows_per_sample = math.prod(node.in_shape) // self.count

    def workspaces(self, n):
        return [("saved", (2, n * self.rows_per_sample), "float32", "saved")]

    def forward(self, c, training):
        K.layernorm_forward(c.xp, c.x, c.params.get("weight"), c.params.get("bias"), self.attrs["eps"], self.count,
                            c.y, c.ws["saved"])

    def backward(self, c):
        K.layernorm_backward(c.xp, c.dy, c.x, c.params.get("weight"), c.ws["saved"], self.count,
                             c.grads.get("weight"), c.grads.get("bias"), c.dx)


class RecurrentLayer(Layer):
    """lstm and gru (runtime/cuda/recurrent.py): the forward, shared with GPU inference, keeps the gates and
    states of every step in "saved" workspaces, which the backward (backpropagation through time) reads; it
    needs neither x nor y themselves."""
    ops = ("lstm", "gru")

    def __init__(self, node):
        super().__init__(node)
        self.op = get_op(node.op)

    def workspaces(self, n):
        args = (self.op, self.attrs, self.node.in_shape, n)
        return [(name, shape, COMPUTE, phase) for name, shape, phase in
                recurrent.recurrent_workspaces(*args) + recurrent.recurrent_backward_workspaces(*args)]

    def forward(self, c, training):
        recurrent.recurrent_forward(c.xp, self.op, c.x, c.params, self.attrs, c.y, c.ws)

    def backward(self, c):
        recurrent.recurrent_backward(c.xp, self.op, c.dy, c.params, c.grads, self.attrs, c.dx, c.ws)


class DropoutLayer(Layer):
    """Needs the key the forward used (the plan passes it as c.key) and the uint32 index buffer."""
    ops = ("dropout",)

    def forward(self, c, training):
        if training and self.attrs["p"] > 0:
            K.dropout_forward(c.xp, c.x, self.attrs["p"], c.key, c.index, c.y)
        else:
            c.y[...] = c.x

    def backward(self, c):
        if self.attrs["p"] > 0:
            K.dropout_backward(c.xp, c.dy, self.attrs["p"], c.key, c.index, c.dx)
        else:
            c.dx[...] = c.dy


class ActivationLayer(Layer):
    """A stand-alone activation layer: its attrs are the activation itself."""
    ops = tuple(ACTIVATIONS)

    def __init__(self, node):
        super().__init__(node)
        self.function = dict(node.attrs, type=node.op)
        if node.op == "leaky_relu" and self.function["negative_slope"] < 0:
            raise ModelSpecError(f"layer {node.index} (leaky_relu): training needs negative_slope >= 0, "
                                 f"not {self.function['negative_slope']}")
        self.needs_output = True

    def forward(self, c, training):
        K.activation_forward(c.xp, self.function, c.x, c.y)

    def backward(self, c):
        K.activation_backward(c.xp, self.function, c.dy, c.y, c.dx)


LAYERS = layer_table("training", [globals()])      # every op of the registry (tests/train/test_plan_and_step.py)


def make_layer(node) -> Layer:
    return LAYERS[node.op](node)


def make_layers(nodes) -> list:
    """The layers of a model, a relu right before a max pool or global average pool undone by the
    pool's backward."""
    layers = [make_layer(node) for node in nodes]
    for previous, layer in zip(layers, layers[1:]):
        if isinstance(layer, PoolUndoingRelu) and (previous.activation or {}).get("type") == "relu":
            layer.take_relu_backward_of(previous)
    return layers
