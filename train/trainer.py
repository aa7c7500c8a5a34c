"""The Trainer: a compiled plan, an optimizer, a loss and the training loop (the lnn-train engine).

    trainer = Trainer("examples/reference/mnist_mlp.json", device="auto", seed=0, batch_size=64)
    result = trainer.step(x, y)            # one optimizer step: result.loss, result.grad_norm
    trainer.gradients["fc1.weight"]        # views of the flat gradient buffer, by parameter name
    history = trainer.fit(train, test, epochs=2, out_dir="runs/mlp")

`step(x, y)`: x is uint8 images [R, C, H, W] (normalized inside the step with the description's
preprocess block) or float inputs already preprocessed; y integer labels (cross_entropy) or
targets (mse). R rows are run as micro-batches of at most batch_size rows, their gradients summed
with the loss normalized over all R rows, so `accumulate: k` with R = k * batch_size gives the
update of one batch of R rows. Then: global gradient norm, clipping, one optimizer step.
Mixed precision (amp="fp16" or True, amp="bf16"; CUDA only): float16 or bfloat16 activations and gradients,
float32 master weights and optimizer. fp16 multiplies the loss by a dynamic scale (start 2^16, halved on an
overflow, doubled after 2000 clean steps); bf16 has float32's range and keeps the scale at 1. Either way a
step whose gradients are not finite is skipped and counted, on the device. bf16 needs compute capability 8.0
(Ampere) or newer, fp16 7.0.
CUDA graph (cuda_graph="auto" | True | False): on the GPU, full batches of uint8 images run as one
replayed CUDA graph when every op is supported (train/cuda_graph.py); its StepResult numbers stay on
the device until read, and fit() reads them every 10 steps. Other batches run eagerly.
Outlier exposure (outliers=True, cross_entropy): rows labelled -1 are outlier photos whose target is
the uniform posterior; the step's loss is the mean CE over its labelled rows plus training.outliers'
weight times the mean over its outlier rows of mean_k(-log softmax_k) (Hendrycks et al. 2019), and
accuracy counts labelled rows only. Such steps run eagerly (not as a CUDA graph).
Inspection: `trainer.gradients`, `trainer.weights()` always; `trainer.activations["conv1"]`
(each layer's output of the last forward) only with inspect=True, because buffers are otherwise
shared by liveness and later buffers overwrite earlier ones within the step.
"""

from __future__ import annotations

import math
import time
from pathlib import Path

import numpy as np

from lnn.formats.errors import LnnError, ModelSpecError
from lnn.formats.limits import MAX_EPOCHS, refusal
from lnn.formats.model import Model, load_description, parse_model
from lnn.formats.ops import get_op
from lnn.runtime.cuda import blas
from lnn.train import kernels as K
from lnn.train.config import TrainingConfig, learning_rate
from lnn.train.data import ArrayDataset, DeviceFeeder, PinnedSlots, Prefetcher, epoch_order
from lnn.train.device import check_memory_fits, cuda_info, device_bytes_held, is_cupy, out_of_memory, select_device, to_numpy
from lnn.train.optim import clip_by_global_norm, global_norm, make_optimizer
from lnn.train.plan import Plan, amp_dtype, amp_precision

LOSS_SCALE_START, LOSS_SCALE_GROWTH_INTERVAL = 2.0 ** 16, 2000


STATS = ("loss", "correct", "grad_norm", "skipped", "labelled")


class StepResult:
    """One step's numbers, kept on the device until first read (then one copy for all)."""

    def __init__(self, stats, rows: int):
        self._stats, self.rows, self._values = stats, rows, None

    def _read(self) -> dict:
        if self._values is None:
            values = to_numpy(self._stats).astype(np.float64)
            self._values = dict(zip(STATS, values))
        return self._values

    loss = property(lambda self: float(self._read()["loss"]))             # mean loss over the step's rows
    grad_norm = property(lambda self: float(self._read()["grad_norm"]))   # global L2 norm before clipping
    correct = property(lambda self: int(round(self._read()["correct"])))  # rows whose argmax is the label
    skipped = property(lambda self: bool(self._read()["skipped"]))        # amp: the gradients overflowed, no update
    labelled = property(lambda self: int(round(self._read()["labelled"])))  # rows with a class label


class StepInputs:
    """The fixed buffers one step reads, for steps of `rows` rows: the inputs x, the targets y, and the
    per-step scalars (learning rate, dropout keys) as uint32 words, staged from the host before each
    step (on the GPU through a ring of pinned slots, so staging never waits for the device). A captured
    graph reads these same buffers at every replay; `stats` receives the step's numbers."""

    PINNED_SLOTS = 16

    def __init__(self, xp, rows, micro_batches, dropout_layers, x_dtype, sample_shape, target_shape, plan):
        self.xp, self.rows, self.micro_batches = xp, rows, micro_batches
        self.x = xp.empty((rows,) + sample_shape, x_dtype)
        self.y = xp.empty((rows,) + target_shape, np.int64 if target_shape == () else plan.stat_dtype)
        self.param_dtype = plan.param_dtype
        lr_words = self.param_dtype.itemsize // 4
        self.keys_shape = (micro_batches, max(dropout_layers, 1))
        self.words = xp.zeros(lr_words + math.prod(self.keys_shape), np.uint32)
        self.lr = self.words[:lr_words].view(self.param_dtype).reshape(())
        self.keys = self.words[lr_words:].reshape(self.keys_shape)
        self.stats = xp.zeros(len(STATS), plan.stat_dtype)
        self._pinned, self._events, self._slot = None, None, 0

    def scalars(self, lr: float, keys: np.ndarray) -> np.ndarray:
        """This step's learning rate and dropout keys [micro-batch, dropout layer] as the words to stage."""
        return np.concatenate([np.asarray([lr], self.param_dtype).view(np.uint32), keys.reshape(-1)])

    def stage(self, x, targets, host_words) -> None:
        """Copy this step's rows and scalars into the buffers, on the current stream."""
        xp = self.xp
        if xp is np:
            self.x[...] = x
            self.y[...] = targets
            self.words[...] = host_words
            return
        self.x.set(x) if isinstance(x, np.ndarray) else xp.copyto(self.x, x)
        xp.copyto(self.y, targets.reshape(self.y.shape), casting="unsafe")
        if self._pinned is None:
            import cupyx

            self._pinned = cupyx.empty_pinned((self.PINNED_SLOTS, host_words.size), np.uint32)
            self._events = [None] * self.PINNED_SLOTS
        slot = self._slot
        if self._events[slot] is not None:
            self._events[slot].synchronize()           # this slot's last copy has been read
        self._pinned[slot] = host_words
        self.words.set(self._pinned[slot], stream=xp.cuda.get_current_stream())
        self._events[slot] = xp.cuda.get_current_stream().record()
        self._slot = (slot + 1) % self.PINNED_SLOTS


def as_model(spec) -> Model:
    if isinstance(spec, Model):
        return spec
    if isinstance(spec, (str, Path)):
        description = load_description(spec)
        try:
            return parse_model(description)
        except ModelSpecError as err:
            raise ModelSpecError(f"{spec}: {err}") from None
    return parse_model(spec)


def hash32(value: int) -> int:
    """lowbias32 on a Python int (the dropout keys)."""
    value &= 0xFFFFFFFF
    value ^= value >> 16
    value = (value * 0x7FEB352D) & 0xFFFFFFFF
    value ^= value >> 15
    value = (value * 0x846CA68B) & 0xFFFFFFFF
    return value ^ (value >> 16)


def initial_weights(model: Model, seed: int, dtype=np.float64) -> dict:
    """PyTorch's default initialization, each op's as formats/ops.py Op.initial_weights draws it (U(-1/sqrt(fan_in),
    1/sqrt(fan_in)) for weights and biases; lstm and gru U(-1/sqrt(hidden_size), ...); batch norm weight 1, bias 0,
    running mean 0, running var 1), in the order of the layers and their parameters, drawn in float64 and given
    as `dtype` (float32: the weights a .bin holds)."""
    rng = np.random.default_rng(seed)
    return {node.param_key(name): value.astype(dtype, copy=False) for node in model.nodes
            for name, value in get_op(node.op).initial_weights(node.attrs, node.param_shapes, rng).items()}


class Trainer:
    def __init__(self, spec, device: str = "auto", seed: int | None = None, batch_size: int | None = None,
                 accumulate: int | None = None, grad_clip: float | None = None, lr: float | None = None,
                 amp=False, dtype: str = "float32", inspect: bool = False, log=None, cuda_graph="auto",
                 outliers: bool = False, tf32: bool = False):
        self.model = as_model(spec)
        self.log = log or (lambda message: print(message, flush=True))
        config = TrainingConfig.parse(self.model.extra.get("training"))
        for field_name, value in (("seed", seed), ("batch_size", batch_size), ("accumulate", accumulate),
                                  ("grad_clip", grad_clip)):
            if value is not None:
                setattr(config, field_name, value)
        self.config = config
        if outliers and self.model.loss != "cross_entropy":
            raise LnnError(f"outlier exposure needs the cross_entropy loss, not {self.model.loss}")
        self.outliers = bool(outliers)
        self.xp, self.device = select_device(device)
        self.amp = self._amp_possible(amp_precision(amp))        # None, "fp16" or "bf16"
        self.plan = Plan(self.model, config.batch_size, dtype=dtype, amp=self.amp, inspect=inspect,
                         implicit_conv=is_cupy(self.xp))
        self.memory_planned = self.plan.memory_report()["peak"]
        check_memory_fits(self.xp, self.memory_planned, config.batch_size, self.device)
        try:
            self.plan.allocate(self.xp)
        except MemoryError:
            raise self.out_of_memory() from None
        self.optimizer_config = dict(self.model.optimizer)
        if lr is not None:
            self.optimizer_config["lr"] = float(lr)
        if not (math.isfinite(self.optimizer_config["lr"]) and self.optimizer_config["lr"] > 0):
            raise LnnError(f"the learning rate (--lr, or the optimizer block's lr) must be a positive finite number, "
                           f"not {self.optimizer_config['lr']}")
        self.base_lr = self.lr = self.optimizer_config["lr"]
        self.optimizer = make_optimizer(self.xp, self.plan.params, self.optimizer_config)
        self.set_weights(initial_weights(self.model, config.seed))
        self.step_count = 0              # steps run (amp's skipped steps included)
        self.dropout_calls = 0
        self._dropout_layers = [i for i, node in enumerate(self.model.nodes) if node.op == "dropout"]
        # amp's loss scale [scale, clean steps in a row, overflowed steps], kept on the device (fp16: dynamic)
        self._amp_state = self.xp.asarray([self._loss_scale_start, 0, 0], np.float32)
        self.tf32 = bool(tf32) and self.device == "cuda" and self.plan.compute_dtype == np.float32
        self._normalizer = self._make_normalizer()
        self._device_data = {}
        self._last_rows = None
        self.gradients = self.plan.param_views(self.plan.grads)
        self._step_inputs = {}
        self._graphs = {}
        self.graph_mode = self._choose_graph_mode(cuda_graph)

    def _choose_graph_mode(self, wanted) -> bool:
        """Whether full steps on the GPU replay as a captured CUDA graph (train/cuda_graph.py)."""
        if wanted not in (True, False, "auto"):
            raise LnnError(f"cuda_graph must be True, False or 'auto', not {wanted!r}")
        if wanted is True and self.device != "cuda":
            raise LnnError("cuda graph: the device is the CPU")
        return wanted is not False and self.device == "cuda"

    # amp's loss-scale state, read from the device (a host sync: for logs and checkpoints)
    loss_scale = property(lambda self: float(self._amp_state[0]))
    overflow_steps = property(lambda self: int(self._amp_state[2]))
    _clean_steps = property(lambda self: int(self._amp_state[1]))

    # ------------------------------------------------------------------ setup

    def _amp_possible(self, precision: str | None) -> str | None:
        """The amp precision this device trains in: None on the CPU and, for fp16, before Volta (said in a log
        line; training goes on in float32); bf16 on a card without it is refused (amp_refusal)."""
        if precision is None:
            return None
        if self.device != "cuda":
            self.log("amp: mixed precision needs a CUDA GPU; training in float32 on the CPU")
            return None
        info = cuda_info(self.xp)
        if precision == "fp16" and not info["fast_fp16"]:
            self.log(f"amp: {info['name']} (compute capability {info['compute_capability']}) has no fast "
                     f"float16 (needs 7.0 or newer); training in float32")
            return None
        refusal = amp_refusal(precision, info, self.xp)
        if refusal:
            raise LnnError(refusal)
        return precision

    @property
    def _loss_scale_start(self) -> float:
        return LOSS_SCALE_START if self.amp == "fp16" else 1.0

    def _make_normalizer(self):
        pre = self.model.preprocess
        if not self.model.takes_images:          # series and tables come standardized (lnn.train.series)
            return None
        dtype = self.plan.compute_dtype
        channels = self.model.input_shape[0]
        std = np.asarray(pre["std"], np.float64)
        multiplier = (pre["scale"] / std).reshape(1, channels, 1, 1)
        offset = (np.asarray(pre["mean"], np.float64) / std).reshape(1, channels, 1, 1)
        return self.xp.asarray(multiplier, dtype=dtype), self.xp.asarray(offset, dtype=dtype)

    # ------------------------------------------------------------------ weights

    def set_weights(self, weights: dict) -> None:
        """Load weights keyed like the .bin (`fc1.weight`, `bn.running_mean`, ...)."""
        xp, plan = self.xp, self.plan
        targets = {**plan.param_views(plan.params), **plan.stat_views()}
        for key, view in targets.items():
            if key not in weights:
                raise LnnError(f"weights: missing {key!r}")
            value = np.asarray(weights[key])
            if value.shape != view.shape:
                raise LnnError(f"weights: {key} has shape {list(value.shape)}, the model expects {list(view.shape)}")
            view[...] = xp.asarray(value, dtype=view.dtype)
        self._sync_compute_params()

    def _sync_compute_params(self):
        if self.amp:
            self.plan.params_compute[...] = self.plan.params

    def weights(self) -> dict:
        """Every weight as a float32 NumPy array keyed like the .bin."""
        plan = self.plan
        views = {**plan.param_views(plan.params), **plan.stat_views()}
        return {key: to_numpy(views[key]).astype(np.float32) for key in self.model.param_shapes()}

    @property
    def activations(self) -> dict:
        """Layer name -> output of the last forward (NumPy). Needs Trainer(..., inspect=True)."""
        if not self.plan.inspect:
            raise LnnError("activations share memory by liveness; create the Trainer with inspect=True to keep them")
        if self._last_rows is None:
            raise LnnError("no forward has run yet: call step() first")
        n = self._last_rows
        views = self.plan.views(n)
        return {node.name: to_numpy(views[f"act:{i}"]).copy() for i, node in enumerate(self.model.nodes)}

    # ------------------------------------------------------------------ one step

    def _load_input(self, x, n: int):
        buffer = self.plan.input_buffer(n)
        x = x if is_cupy(self.xp) and not isinstance(x, np.ndarray) else self.xp.asarray(x)
        if x.dtype == np.uint8:
            if self._normalizer is None:
                raise LnnError("uint8 inputs need an image model with a preprocess block")
            multiplier, offset = self._normalizer
            self.xp.multiply(x, multiplier, out=buffer)
            buffer -= offset
        else:
            buffer[...] = x

    def _targets(self, y, n: int):
        xp = self.xp
        y = xp.asarray(y)
        if self.model.loss == "cross_entropy":
            return y.astype(np.int64) if y.dtype.kind != "i" else y
        out_shape = (n,) + tuple(self.model.output_shape)
        if y.ndim == 1 and len(out_shape) == 2 and y.dtype.kind in "iu":
            one_hot = xp.zeros(out_shape, np.float32)
            one_hot[xp.arange(n), y] = 1
            return one_hot
        return y.astype(self.plan.stat_dtype).reshape(out_shape)

    def _dropout_keys(self, shape: tuple) -> np.ndarray:
        """uint32 keys [micro-batch, dropout layer] of this step (lowbias32 of the seed and a call counter)."""
        keys = np.zeros(shape, np.uint32)
        for j in range(shape[0]):
            for slot in range(len(self._dropout_layers)):
                self.dropout_calls += 1
                keys[j, slot] = hash32(hash32(self.config.seed) ^ hash32(self.dropout_calls + 0x9E3779B9))
        return keys

    def step(self, x, y) -> StepResult:
        """One optimizer step over len(x) rows: the same device code runs eagerly or, for full steps on
        the GPU, as a replayed CUDA graph. Its numbers are read from the device when first used."""
        rows = len(x)
        if rows == 0:
            raise LnnError("step: the batch is empty")
        if len(y) != rows:
            raise LnnError(f"step: {rows} inputs but {len(y)} targets")
        if tuple(x.shape[1:]) != tuple(self.model.input_shape):
            raise LnnError(f"step: inputs of shape {list(x.shape[1:])}, the model takes {list(self.model.input_shape)}")
        if x.dtype == np.uint8 and self._normalizer is None:
            raise LnnError("uint8 inputs need an image model with a preprocess block")
        full = rows == self.plan.batch_size * self.config.accumulate
        inputs = self._inputs_for(rows, np.dtype(x.dtype))
        graph = self._graph_for(inputs) if self.graph_mode and full else None
        targets = self._targets(y, rows)
        scalars = inputs.scalars(self.lr, self._dropout_keys(inputs.keys_shape))
        replayed = graph is not None and graph.run(lambda: inputs.stage(x, targets, scalars),
                                                   lambda: self._device_step(inputs))
        if graph is not None and not replayed:           # the capture failed (logged): eager from now on
            self.graph_mode = False
            self._graphs.clear()
        if not replayed:
            inputs.stage(x, targets, scalars)
            with np.errstate(all="ignore"):            # a diverged step is reported below, not as warnings
                self._device_step(inputs)
        self.step_count += 1
        self._last_rows = min(rows - (inputs.micro_batches - 1) * self.plan.batch_size, self.plan.batch_size)
        result = StepResult(inputs.stats.copy(), rows)
        if not replayed:                                 # eager: report a diverged fp32 step at once
            self._check_finite(result)
        return result

    def graph_pool_bytes(self) -> int:
        """GPU bytes the captured steps' private memory pools hold (their temporaries)."""
        return sum(graph.pool.total_bytes() for graph in self._graphs.values())

    def memory_held(self) -> int | None:
        """GPU bytes CuPy's pools hold for this process (the default pool: the plan, parameters, optimizer state,
        workspaces, data kept on the device; plus the captured steps' pools); None on the CPU. The figure to
        set beside the plan's (memory_report()["peak"])."""
        held = device_bytes_held(self.xp)
        return None if held is None else held + self.graph_pool_bytes()

    def _check_finite(self, result) -> None:
        """Without amp, a step whose float32 loss or gradient norm is not finite has diverged (its update was
        withheld on the device, but the weights that led there stay): TrainingDiverged. With amp such a step
        overflowed the 16-bit range and stays skipped and counted (fp16 lowers the loss scale); there the epoch's
        loss decides (_train_epoch)."""
        if self.amp:
            return
        for what, value in (("training loss", result.loss), ("gradient norm", result.grad_norm)):
            if not math.isfinite(value):
                raise TrainingDiverged(f"the {what} became {_not_finite(value)} by step {self.step_count} (diverged): "
                                       f"train with a lower learning rate (--lr) or set training.grad_clip")

    def _inputs_for(self, rows: int, x_dtype) -> StepInputs:
        key = (rows, x_dtype)
        if key not in self._step_inputs:
            target_shape = () if self.model.loss == "cross_entropy" else tuple(self.model.output_shape)  # labels, or targets
            self._step_inputs[key] = StepInputs(self.xp, rows, math.ceil(rows / self.plan.batch_size),
                                                len(self._dropout_layers), x_dtype, tuple(self.model.input_shape),
                                                target_shape, self.plan)
        return self._step_inputs[key]

    def _graph_for(self, inputs):
        from lnn.train.cuda_graph import CapturedStep

        key = id(inputs)
        if key not in self._graphs:
            self._graphs[key] = CapturedStep(self.xp, self.log)
        return self._graphs[key]

    def _device_step(self, inputs: StepInputs) -> None:
        """The whole step on the device, reading only `inputs` and the plan: no host sync, no per-step
        Python values (lr, keys and the loss scale are device arrays), so it can be captured as is.
        Micro-batches of at most batch_size rows; gradients summed with the loss normalized over all rows
        (cross_entropy: over the labelled rows; outlier rows weigh training.outliers' weight in all);
        amp: the float32 gradients from the 16-bit ones, and fp16 unscales them; a non-finite gradient norm skips
        the update (fp16 also halves the scale, doubled after LOSS_SCALE_GROWTH_INTERVAL clean steps); then
        the global norm, clipping, the optimizer."""
        xp, plan = self.xp, self.plan
        rows = inputs.rows
        plan.grads_compute.fill(0)
        loss_scale = self._amp_state[0] if self.amp == "fp16" else 1.0
        if self.model.loss != "cross_entropy":
            labelled = divisor = rows * math.prod(self.model.output_shape)
            outlier_weight = 0.0
        elif self.outliers:
            outlier_rows = (inputs.y < 0).sum()
            labelled = rows - outlier_rows
            divisor = xp.maximum(labelled, 1).astype(plan.stat_dtype)
            outlier_weight = self.config.outliers["weight"] * divisor / xp.maximum(outlier_rows, 1)
        else:
            labelled = divisor = rows
            outlier_weight = 0.0
        scale = loss_scale / divisor
        loss_sum = correct = 0
        with blas.tf32(self.tf32):
            for j, start in enumerate(range(0, rows, plan.batch_size)):
                n = min(plan.batch_size, rows - start)
                self._load_input(inputs.x[start:start + n], n)
                targets = inputs.y[start:start + n]
                keys = {i: inputs.keys[j, slot] for slot, i in enumerate(self._dropout_layers)}
                out = plan.forward(n, training=True, dropout_keys=keys)
                dout = plan.output_grad_buffer(n)
                if self.model.loss == "cross_entropy":
                    part, right = K.softmax_cross_entropy_forward_backward(xp, out, targets, scale, dout,
                                                                           outlier_weight)
                    correct = correct + right
                else:
                    part = K.mse_forward_backward(xp, out, targets, scale, dout)
                loss_sum = loss_sum + part
                plan.backward(n, dropout_keys=keys)
        if self.amp:
            plan.grads[...] = plan.grads_compute
        if self.amp == "fp16":
            plan.grads /= loss_scale
        norm = global_norm(xp, plan.grads)
        skipped = ~xp.isfinite(norm)
        if self.config.grad_clip is not None:
            clip_by_global_norm(xp, plan.grads, norm, self.config.grad_clip)
        self.optimizer.update(plan.grads, inputs.lr, skip=skipped)
        self._sync_compute_params()
        if self.amp:
            self._update_loss_scale(skipped)
        stats = inputs.stats
        stats[0] = loss_sum / divisor
        stats[1] = correct
        stats[2] = norm
        stats[3] = skipped
        stats[4] = labelled

    def _update_loss_scale(self, skipped) -> None:
        """On the device: count an overflowed step; fp16 halves the scale on one, and doubles it after
        LOSS_SCALE_GROWTH_INTERVAL clean steps."""
        xp, state = self.xp, self._amp_state
        if self.amp != "fp16":
            state[2] += skipped
            return
        clean = xp.where(skipped, 0, state[1] + 1)
        grow = clean >= LOSS_SCALE_GROWTH_INTERVAL
        state[0] = xp.where(skipped, state[0] / 2, xp.where(grow, state[0] * 2, state[0]))
        state[1] = xp.where(grow, 0, clean)
        state[2] += skipped

    # ------------------------------------------------------------------ evaluation

    def _as_dataset(self, data, name: str) -> ArrayDataset:
        if data is None or isinstance(data, ArrayDataset):
            return data
        images, labels = data
        return ArrayDataset(images, labels, name)

    def _on_device(self, dataset: ArrayDataset):
        """(images, labels) on the device, moved once per dataset (in-memory datasets only)."""
        key = id(dataset)
        if key not in self._device_data:
            self._device_data[key] = (dataset, self.xp.asarray(dataset.images), self.xp.asarray(dataset.labels))
        return self._device_data[key][1:]

    def _batches(self, dataset: ArrayDataset, order: np.ndarray, rows: int):
        """Yield (images, labels, done) on the device for consecutive `rows`-sized slices of `order`.

        In-memory data is gathered on the device; other data is read by a prefetch thread (and on
        the GPU copied through pinned memory on a side stream). Call done() after using a batch."""
        slices = [order[i:i + rows] for i in range(0, len(order), rows)]
        if dataset.in_memory:
            images, labels = self._on_device(dataset)
            for indices in slices:
                device_indices = self.xp.asarray(indices)
                yield images.take(device_indices, axis=0), labels.take(device_indices, axis=0), (lambda: None)
            return
        if not is_cupy(self.xp):
            with Prefetcher(slices, dataset.batch, loaders=dataset.loads_at_once) as prefetcher:
                for images, labels in prefetcher:
                    yield images, labels, (lambda: None)
            return
        pinned = PinnedSlots(self.xp)
        feeder = DeviceFeeder(self.xp, pinned, rows, dataset.sample_shape)
        with Prefetcher(slices, dataset.batch, to_device=pinned, loaders=dataset.loads_at_once) as prefetcher:
            for host_images, host_labels, pinned_slot in prefetcher:
                images, labels, slot = feeder.put(host_images, host_labels, pinned_slot)
                yield images, labels, (lambda s=slot: feeder.done(s))

    def evaluate(self, data) -> dict:
        """Mean loss and accuracy (cross_entropy) over a dataset, in eval mode (running BN stats, no dropout)."""
        dataset = self._as_dataset(data, "evaluation data")
        xp, plan = self.xp, self.plan
        loss_sum, correct = 0.0, 0
        for images, labels, done in self._batches(dataset, np.arange(len(dataset)), plan.batch_size):
            n = len(images)
            self._load_input(images, n)
            with np.errstate(all="ignore"):          # an overflowed loss is reported as such (fit: recorded as null)
                out = plan.forward(n, training=False)
                targets = self._targets(labels, n)
                if self.model.loss == "cross_entropy":
                    part, right = K.softmax_cross_entropy_forward(xp, out, targets)
                    correct = correct + right
                else:
                    part = K.mse_forward(xp, out, targets)
                loss_sum = loss_sum + part
            done()
        rows = len(dataset)
        outputs = 1 if self.model.loss == "cross_entropy" else math.prod(self.model.output_shape)
        result = {"loss": float(loss_sum) / (rows * outputs)}
        if self.model.loss == "cross_entropy":
            result["accuracy"] = int(correct) / rows
        return result

    def predict(self, x) -> np.ndarray:
        """The model's outputs (with its final softmax, if any) for inputs x, in eval mode, as NumPy."""
        plan = self.plan
        outputs = []
        for start in range(0, len(x), plan.batch_size):
            part = x[start:start + plan.batch_size]
            self._load_input(part, len(part))
            outputs.append(to_numpy(plan.forward(len(part), training=False, predict=True)).copy())
        return np.concatenate(outputs)

    # ------------------------------------------------------------------ state for checkpoints

    def state_meta(self) -> dict:
        return {"description": self.model.to_description(), "step": self.step_count, "lr": self.lr,
                "base_lr": self.base_lr, "loss_scale": self.loss_scale, "overflow_steps": self.overflow_steps,
                "clean_steps": self._clean_steps, "device": self.device, "amp": self.amp,
                "rng": {"seed": self.config.seed, "dropout_calls": self.dropout_calls}}

    def optimizer_arrays(self) -> dict:
        state = self.optimizer.state_dict()
        return {key: (to_numpy(value) if not isinstance(value, int) else np.asarray(value))
                for key, value in state.items()}

    def load_state(self, meta: dict, weights: dict, optimizer_state: dict) -> None:
        self.set_weights(weights)
        self.optimizer.load_state_dict({key: np.asarray(v) for key, v in optimizer_state.items()})
        self.step_count = int(meta["step"])
        self.lr = float(meta["lr"])
        self._amp_state[...] = self.xp.asarray([float(meta["loss_scale"]) if self.amp == "fp16" else 1.0,
                                                float(meta["clean_steps"]), float(meta["overflow_steps"])], np.float32)
        self.dropout_calls = int(meta["rng"]["dropout_calls"])

    # ------------------------------------------------------------------ the loop

    def out_of_memory(self) -> LnnError:
        return out_of_memory(self.memory_planned, self.plan.batch_size, self.device)

    def fit(self, train_data, val_data=None, epochs: int | None = None, out_dir=None, resume: bool = False,
            patience: int | None = None, progress: bool = True, export: bool = True, options: dict | None = None) -> list:
        """Train for `epochs`; evaluate on val_data each epoch. With out_dir: checkpoints, metrics.jsonl,
        curves.png, best.npz and (export=True) model.bin there, and `options` (what the caller made the run from,
        lnn-train's) in run.json. Returns the per-epoch history.
        Running out of memory is one LnnError line naming the planned figure; a diverged run (TrainingDiverged:
        its rule) one line naming the epoch, with nothing of that epoch recorded."""
        try:
            return self._fit(train_data, val_data, epochs, out_dir, resume, patience, progress, export, options)
        except MemoryError:                          # CuPy's OutOfMemoryError is a MemoryError too
            raise self.out_of_memory() from None

    def _fit(self, train_data, val_data=None, epochs: int | None = None, out_dir=None, resume: bool = False,
             patience: int | None = None, progress: bool = True, export: bool = True, options: dict | None = None) -> list:
        from lnn.train.run import RunDirectory

        train = self._as_dataset(train_data, "training data")
        val = self._as_dataset(val_data, "validation data")
        if getattr(train, "has_outliers", False) and not self.outliers:
            raise LnnError(f"{train.name} holds outlier rows (label -1): create the Trainer with outliers=True")
        rows_per_step = self.plan.batch_size * self.config.accumulate
        steps_per_epoch = math.ceil(len(train) / rows_per_step)
        if not epochs:
            epochs = self.config.epochs_for(steps_per_epoch)
            if epochs > self.config.epochs:
                self.log(f"training.min_steps {self.config.min_steps}: {epochs} epochs of {steps_per_epoch} steps "
                         f"(training.epochs {self.config.epochs} would make {self.config.epochs * steps_per_epoch})")
        too_many = refusal("the run", epochs, MAX_EPOCHS, "MAX_EPOCHS", " epochs")
        if too_many:
            raise LnnError(too_many)
        patience = patience if patience is not None else self.config.patience
        run = RunDirectory(out_dir, self, resume, options) if out_dir is not None else None
        history = run.history if run else []
        first_epoch = len(history) + 1
        if run and run.stopped_early(patience):
            self.log(f"the run in {out_dir} already stopped early (patience {patience})")
            first_epoch = epochs + 1
        try:
            for epoch in range(first_epoch, epochs + 1):
                try:
                    entry = self._train_epoch(train, epoch, epochs, steps_per_epoch, rows_per_step, progress)
                except TrainingDiverged as err:                 # nothing of this epoch is recorded
                    kept = f"; {out_dir} keeps the run as it was after epoch {len(history)}" if run and history else ""
                    raise TrainingDiverged(f"epoch {epoch}: {err}{kept}") from None
                if val is not None:
                    entry.update({f"val_{k}": v for k, v in self.evaluate(val).items()})
                history.append(entry)
                self.log(_epoch_line(entry, epochs))
                if run:
                    run.end_epoch(entry)
                    if run.stopped_early(patience):
                        self.log(f"early stop: no better validation result for {patience} epochs")
                        break
        except KeyboardInterrupt:               # Ctrl-C, or lnn-train's SIGTERM: say what the run folder keeps
            if run:
                self.log(run.interrupted_line())
            raise
        if run:
            run.finish(export)
        return history

    def _train_epoch(self, train, epoch, epochs, steps_per_epoch, rows_per_step, progress) -> dict:
        from tqdm import tqdm

        order = epoch_order(len(train), self.config.seed, epoch)
        loss_sum = correct = rows_done = labelled_done = 0
        norms, pending = [], []
        started = time.perf_counter()
        bar = tqdm(total=len(train), desc=f"epoch {epoch}/{epochs}", unit="img", disable=None if progress else True,
                   leave=False, dynamic_ncols=True)
        with bar:
            batches = self._batches(train, order, rows_per_step)
            for index, (images, labels, done) in enumerate(batches):
                self.lr = learning_rate(self.base_lr, self.config.lr_schedule, self.step_count, steps_per_epoch,
                                        epochs)
                pending.append(self.step(images, labels))
                done()
                if index % 10 and rows_done + sum(r.rows for r in pending) < len(train):
                    continue                 # graph steps keep their numbers on the device until read here
                for result in pending:
                    self._check_finite(result)
                    loss_sum += result.loss * result.rows
                    correct += result.correct
                    rows_done += result.rows
                    labelled_done += result.labelled
                    if not result.skipped:          # an overflowed amp step's norm is inf: not a gradient
                        norms.append(result.grad_norm)
                    bar.update(result.rows)
                pending = []
                postfix = {"loss": f"{loss_sum / rows_done:.4f}", "img/s": f"{rows_done / (time.perf_counter() - started):.0f}"}
                if self.model.loss == "cross_entropy":
                    postfix["acc"] = f"{correct / max(labelled_done, 1):.4f}"
                if self.amp:
                    postfix["overflows"] = self.overflow_steps
                bar.set_postfix(postfix)
        seconds = time.perf_counter() - started
        entry = {"epoch": epoch, "train_loss": loss_sum / rows_done, "lr": self.lr, "epoch_s": round(seconds, 3),
                 "images_per_s": round(rows_done / seconds, 1),
                 "grad_norm": float(np.mean(norms)) if norms else None}
        if not math.isfinite(entry["train_loss"]):         # amp: its skipped steps' losses count too
            raise TrainingDiverged(f"the training loss of the epoch became {_not_finite(entry['train_loss'])} "
                                   f"(diverged): train with a lower learning rate (--lr), set training.grad_clip, "
                                   f"or train without --amp")
        if self.model.loss == "cross_entropy":
            entry["train_accuracy"] = correct / max(labelled_done, 1)
        if self.amp:
            entry.update(overflow_steps=self.overflow_steps, loss_scale=self.loss_scale)
        return entry


class TrainingDiverged(LnnError):
    """The training loss (or, without amp, a step's gradient norm) became NaN or infinite: the run stops, and
    fit() records nothing of the epoch, so the run folder stays as it was after the last good one.

    The rule: without amp, a step whose float32 loss or gradient norm is not finite (the device withholds its
    update; going on would repeat it at every step). With amp (fp16 or bf16) such a step overflowed the 16-bit
    range and is skipped and counted, as it should be; the run stops only when the float32 mean loss of a whole
    epoch (its skipped steps included) is not finite, i.e. the forward pass itself left the range."""


def _not_finite(value: float) -> str:
    return "NaN" if math.isnan(value) else "infinite"


def amp_refusal(precision: str, info: dict, xp) -> str | None:
    """Why this GPU (cuda_info) and array module cannot train in `precision`, in one line, or None."""
    if precision != "bf16":
        return None
    if not info["bfloat16"]:
        return (f"amp bf16: {info['name']} (compute capability {info['compute_capability']}) has no bfloat16 "
                f"tensor cores (needs 8.0, Ampere, or newer); use amp fp16 (--amp) or none")
    try:
        xp.zeros(1, amp_dtype("bf16")) + 1
    except LnnError as err:
        return str(err)
    except Exception as err:        # noqa: BLE001 - CuPy's refusals vary (dtype, kernel compile): each means no bf16
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        return (f"amp bf16: CuPy {getattr(xp, '__version__', '?')} cannot make bfloat16 arrays (needs CuPy 14 or "
                f"newer with ml_dtypes): {first}")
    return None


def _epoch_line(entry: dict, epochs: int) -> str:
    parts = [f"epoch {entry['epoch']}/{epochs}", f"loss {entry['train_loss']:.4f}"]
    if "train_accuracy" in entry:
        parts.append(f"acc {entry['train_accuracy']:.4f}")
    if "val_loss" in entry:
        parts.append(f"val_loss {entry['val_loss']:.4f}")
    if "val_accuracy" in entry:
        parts.append(f"val_acc {entry['val_accuracy']:.4f}")
    parts.append(f"{entry['images_per_s']:.0f} img/s")
    parts.append(f"{entry['epoch_s']:.1f} s")
    if "overflow_steps" in entry:
        parts.append(f"overflow steps {entry['overflow_steps']}")
    return "  ".join(parts)

