"""lnn-summary: a model's layers, parameters, FLOPs, and memory for inference and training.

    lnn-summary examples/reference/mnist_cnn.json
    lnn-summary model.bin --batch 64
    lnn-summary mnist_cnn.json --max-batch --memory 6GiB

Per layer: output shape, parameters, FLOPs per image (a multiply-add counts 2) and activation bytes
at the batch size. Then totals, and memory estimates at that batch for inference and for training
with SGD (momentum) and Adam; the footer states the formula. Next to it, the training memory of the
real plan lnn-train would build (pooled activations against their naive sum, parameters, gradients,
the description's optimizer state), computed without allocating. --max-batch --memory SIZE answers
the largest batch whose planned training memory fits a card of SIZE, keeping 10% of the card and
300 MiB (CUDA context, library workspaces) free. Sizes: 512MB, 6GB (decimal: 6 x 10^9 bytes) or
6GiB (binary: 6 x 2^30 bytes). A .bin or an lnn-train checkpoint also works as MODEL. The plan's
memory is also given per layer (activations, gradients, optimizer state); for a series model
(input [C, T]) --length T gives every figure, --max-batch too, at another sequence length. --amp (fp16) or
--amp bf16 plans as lnn-train --amp does (16-bit activations and weight copies: bf16 counts as fp16).
"""

from __future__ import annotations

import argparse
import math
import os
import re
import sys
from collections import Counter

from lnn.formats.errors import LnnError, LnnInputError
from lnn.formats.model import FLOAT_BYTES, Model
from lnn.formats.ops import get_op
from lnn.runtime.cuda.float16 import AMP_PRECISIONS
from lnn.formats.vectors import TENSOR_PREFIX as VECTOR_TENSORS
from lnn.tools.cli import command_parser, human_bytes, human_flops, read_model_source, run_command

PROG = "lnn-summary"
OPTIMIZER_STATE = {"SGD (momentum)": 1, "Adam": 2}     # optimizer state, in copies of the trainable parameters
FORMULA = """\
estimate (float32): inference = P + max_i(A[i-1] + A[i]);
  training = P + G + S + sum_i A[i] + max_i(A[i-1] + A[i]),
  where P = parameter bytes, G = gradient bytes (trainable parameters; batch-norm statistics excluded),
  S = optimizer state (SGD momentum 1x, Adam 2x the trainable parameters), A[i] = bytes of layer i's output
  at the batch size (A[0] the input; an lstm / gru: with its gates and states at every step), all saved for
  the backward pass; max_i(A[i-1] + A[i]) is the largest
  pair of live activations (and of activation gradients). Workspace buffers of a backend are not included."""
SIZE_UNITS = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
              "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}
CARD_RESERVE_FRACTION = 0.10            # of the card, kept free by --max-batch (fragmentation, other processes)
CARD_RESERVE_BYTES = 300 * 2**20        # also kept free: the CUDA context and library workspaces
LARGEST_BATCH = 2**24      # the largest --batch figured, and --max-batch tried: even at MAX_ACTIVATION_BYTES a sample,
                           # its byte counts stay within the plan's 64-bit integers


def build_parser():
    parser = command_parser(PROG, __doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1])
    parser.add_argument("source", metavar="MODEL", help="a JSON model description or a .bin")
    parser.add_argument("--batch", type=int, default=1, metavar="N", help="batch size for activation and memory figures (default 1)")
    parser.add_argument("--max-batch", action="store_true",
                        help="print the largest training batch whose planned memory fits a card of --memory SIZE")
    parser.add_argument("--memory", type=parse_size, metavar="SIZE",
                        help="the card's memory for --max-batch: e.g. 6GB (10^9 bytes each), 6GiB (2^30), 512MB")
    parser.add_argument("--length", type=int, metavar="T",
                        help="a series model ([C, T] input) at this sequence length instead of its own: every figure, "
                             "--max-batch too (the layers must fit the length, e.g. a pool's window)")
    parser.add_argument("--amp", nargs="?", const="fp16", choices=tuple(AMP_PRECISIONS), metavar="fp16|bf16",
                        help="the training plan's figures with lnn-train --amp: 16-bit activations (--amp alone: fp16)")
    return parser


def parse_size(text: str) -> int:
    """'6GB' -> 6_000_000_000, '6GiB' -> 6 * 2**30, '1.5 GB', '512MB' (units case-insensitive); argparse type."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-zA-Z]+)\s*", text)
    unit = match and match.group(2).upper()
    if not match or unit not in SIZE_UNITS:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size: write a number and a unit, e.g. 6GB (10^9 bytes), "
                                         f"6GiB (2^30 bytes), 512MB")
    size = int(float(match.group(1)) * SIZE_UNITS[unit])
    if size <= 0:
        raise argparse.ArgumentTypeError(f"{text!r}: the size must be more than 0 bytes")
    return size


def usable_card_bytes(card: int) -> int:
    """What --max-batch lets a training plan use on a card of `card` bytes (see CARD_RESERVE_*)."""
    return int(card * (1 - CARD_RESERVE_FRACTION)) - CARD_RESERVE_BYTES


def planned_peak(model: Model, batch: int, amp=None) -> int:
    from lnn.train.plan import plan_memory      # only here: the rest of lnn-summary does not need lnn.train

    return plan_memory(model, batch, amp=amp)["peak"]


def largest_batch(model: Model, usable: int, amp=None) -> int:
    """The largest batch whose planned training memory is at most `usable` bytes (0 when batch 1 does not fit)."""
    if planned_peak(model, 1, amp) > usable:
        return 0
    fits, too_big = 1, 2
    while planned_peak(model, too_big, amp) <= usable:    # double until it does not fit
        fits, too_big = too_big, too_big * 2
        if too_big > LARGEST_BATCH:
            return fits
    while too_big - fits > 1:                             # then halve the gap
        middle = (fits + too_big) // 2
        fits, too_big = (middle, too_big) if planned_peak(model, middle, amp) <= usable else (fits, middle)
    return fits


def plan_lines(model: Model, batch: int, amp=None) -> list:
    """The training memory of the real plan (lnn.train) at `batch` (with `amp`: "fp16" or "bf16"), line by line."""
    from lnn.train.plan import plan_memory

    try:
        report = plan_memory(model, batch, amp=amp)
    except LnnError as err:
        return [f"training plan at batch {batch}: not available ({err})"]
    optimizer = model.optimizer["type"]
    parts = [("activations, their gradients and layer scratch, pooled", report["activations_pooled"]),
             ("parameters", report["params"]), ("batch-norm running statistics", report["running_stats"]),
             ("gradients", report["grads"]), (f"optimizer state ({optimizer})", report["optimizer_state"]),
             *([(f"{amp} copies of the parameters and gradients", report["amp_copies"])] if amp else []),
             ("convolution tables and arranged weights", report["conv_scratch"]),
             ("cuBLAS workspace", report["gemm_workspace"]),
             ("batch data (inputs: uint8 images, float32 series or rows; int64 labels)", report["batch_data"]), ("total", report["peak"])]
    width = max(len(what) for what, _ in parts)
    naive, pooled = report["activations_naive"], report["activations_pooled"]
    precision = f"amp {amp}: {AMP_PRECISIONS[amp]} activations, float32 master weights" if amp else "float32"
    lines = [f"training memory of the plan lnn-train builds on the GPU, at batch {batch} ({precision}, {optimizer} "
             f"from the description; measured peak: lnn-train prints it after training):"]
    lines += [f"  {what:<{width}}  {human_bytes(size):>10}  ({size:,} bytes)" for what, size in parts]
    lines.append(f"  pooled activations {human_bytes(pooled)} against a naive sum of {human_bytes(naive)} "
                 f"({naive:,} bytes): {naive / max(pooled, 1):.1f}x less")
    return lines + [""] + plan_layer_lines(report, batch, model)


def plan_layer_lines(report: dict, batch: int, model: Model) -> list:
    """The plan's memory per layer: activations (with saved workspaces), gradients (of the output and of the
    parameters), optimizer state; activations and their gradients grow with batch x length, the rest does not."""
    header = ("layer", "activations", "gradients", "optimizer state")
    rows = [(row["name"], row["activations"], row["gradients"], row["optimizer_state"]) for row in report["layers"]]
    totals = ("sum", *(sum(row[i] for row in rows) for i in (1, 2, 3)))
    cells = [header] + [(name, *(human_bytes(v) for v in values)) for name, *values in rows + [totals]]
    widths = [max(len(row[i]) for row in cells) for i in range(4)]
    scale = f"batch {batch}" + (f", length {model.input_shape[1]}" if len(model.input_shape) == 2 else "")
    lines = [f"per layer in that plan ({scale}; the activation columns scale with batch"
             f"{' x length' if len(model.input_shape) == 2 else ''}, parameter gradients and optimizer state do not; "
             f"the pool holds only what is alive at once):"]
    lines += ["  " + "  ".join(cell.ljust(w) if i == 0 else cell.rjust(w) for i, (cell, w) in enumerate(zip(row, widths)))
              for row in cells[:-1]]
    lines.append("  " + "  ".join("-" * w for w in widths))
    lines.append("  " + "  ".join(cell.ljust(w) if i == 0 else cell.rjust(w) for i, (cell, w) in enumerate(zip(cells[-1], widths))))
    return lines


def at_length(model: Model, length: int | None) -> Model:
    """--length T: the same series model with input [C, T] (its preprocessing's length too)."""
    if length is None:
        return model
    from lnn.formats.errors import ModelSpecError
    from lnn.formats.model import parse_model

    if length < 1:
        raise LnnInputError(f"--length must be at least 1, not {length}")
    if len(model.input_shape) != 2:
        raise LnnInputError(f"--length is for series models (input [C, T]); {model.name} takes "
                            f"{shape_text(model.input_shape)}")
    description = model.to_description()
    description["input_shape"] = [model.input_shape[0], length]
    if model.preprocess is not None:
        description["preprocess"] = {**model.preprocess, "length": length}
    try:
        return parse_model(description)
    except ModelSpecError as err:
        raise LnnInputError(f"--length {length}: {err}") from None


def max_batch_lines(model: Model, card: int, amp=None) -> list:
    usable = usable_card_bytes(card)
    margin = (f"a card of {card:,} bytes ({human_bytes(card)}), keeping {CARD_RESERVE_FRACTION:.0%} of it and "
              f"{human_bytes(CARD_RESERVE_BYTES)} (CUDA context, workspaces) free: {max(usable, 0):,} bytes for training")
    if usable <= 0:
        raise LnnInputError(f"{margin.split(':')[0]} leaves nothing for training")
    batch = largest_batch(model, usable, amp)
    if batch == 0:
        raise LnnInputError(f"batch 1 needs {planned_peak(model, 1, amp):,} bytes of training memory; {margin}")
    capped = " (the largest tried; it may fit more)" if batch == LARGEST_BATCH else ""
    peak = planned_peak(model, batch, amp)
    return [f"largest training batch: {batch}{capped}{f' with amp {amp}' if amp else ''}, planned {human_bytes(peak)} "
            f"({peak:,} bytes)", f"  on {margin}"]


def layer_type(node) -> str:
    activation = node.attrs.get("activation")
    return f"{node.op}+{activation['type']}" if isinstance(activation, dict) else node.op


def shape_text(shape) -> str:
    return "[" + ", ".join(map(str, shape)) + "]"


def layer_table(model: Model, batch: int) -> list:
    header = ("#", "name", "type", "output shape", "params", "FLOPs", f"activations (batch {batch})")
    input_bytes = math.prod(model.input_shape) * FLOAT_BYTES * batch
    rows = [("", "input", "", shape_text(model.input_shape), "", "", human_bytes(input_bytes))]
    for node in model.nodes:
        rows.append((str(node.index), node.name, layer_type(node), shape_text(node.out_shape), f"{node.num_params:,}",
                     f"{node.flops:,}", human_bytes(node.activation_bytes * batch)))
    widths = [max(len(row[i]) for row in (header, *rows)) for i in range(len(header))]
    right_aligned = {0, 4, 5, 6}

    def line(row):
        return "  ".join(cell.rjust(w) if i in right_aligned else cell.ljust(w)
                         for i, (cell, w) in enumerate(zip(row, widths))).rstrip()

    rule = "-" * len(line(header))
    return [line(header), rule, *[line(row) for row in rows], rule]


def memory_estimates(model: Model, batch: int) -> dict:
    """Bytes at `batch` for inference and training (see FORMULA)."""
    activations = [math.prod(model.input_shape) * FLOAT_BYTES * batch] + [n.activation_bytes * batch for n in model.nodes]
    live_pair = max(a + b for a, b in zip(activations, activations[1:]))
    parameters = model.num_params * FLOAT_BYTES
    buffers = sum(math.prod(shape) for node in model.nodes for p, shape in node.param_shapes.items()
                  if p in get_op(node.op).buffer_names())
    trainable = (model.num_params - buffers) * FLOAT_BYTES
    out = {"inference": parameters + live_pair}
    for optimizer, copies in OPTIMIZER_STATE.items():
        out[f"training, {optimizer}"] = parameters + trainable + copies * trainable + sum(activations) + live_pair
    return out


def metadata_lines(bin_model) -> list:
    meta = bin_model.metadata
    tensors = [t for key, t in bin_model.tensors.items() if not key.startswith(VECTOR_TENSORS)]   # vectors: below
    stored = Counter(t.dtype.name for t in tensors)
    size = os.path.getsize(bin_model.path)
    lines = [f"file: {human_bytes(size)} ({size:,} bytes), format {bin_model.version[0]}.{bin_model.version[1]}, "
             f"written by {meta.get('producer')} {meta.get('producer_version')}",
             f"stored: {len(tensors)} tensors ({', '.join(f'{c} {d}' for d, c in sorted(stored.items()))})"]
    labels = bin_model.model.labels
    shown = ", ".join(label["display"] for label in labels[:6]) + (", ..." if len(labels) > 6 else "")
    lines.append(f"labels: {len(labels)} ({shown})")
    pre = meta.get("preprocess")
    if pre and pre.get("kind") in ("series", "table"):
        fit = {"linear": "resampled (linear)", "pad_mean": "shorter ones padded with their mean, longer ones resampled"}
        what = (f"{pre['length']} steps ({fit[pre['resample']]}), per channel" if pre["kind"] == "series"
                else f"columns {', '.join(pre['columns'])}, per column")
        lines.append(f"preprocess: {pre['kind']}, {what} (x - mean) / std, mean {[round(v, 6) for v in pre['mean']]}, "
                     f"std {[round(v, 6) for v in pre['std']]}")
    elif pre:
        lines.append(f"preprocess: {pre['color']}, resize to {pre['resize'][0]}x{pre['resize'][1]}, x * {pre['scale']:.6g}, "
                     f"mean {pre['mean']}, std {pre['std']}")
    thresholds = meta.get("thresholds")
    if thresholds:
        lines.append(f"thresholds: {thresholds}")
    vectors = meta.get("test_vectors")
    lines.append(f"test vectors: {vectors['count']} ({vectors['inputs']}; outputs by {vectors['outputs']}); "
                 f"lnn-doctor MODEL.bin runs them" if vectors else "test vectors: none (lnn-export adds them)")
    return lines


def summarize(args) -> int:
    if not 1 <= args.batch <= LARGEST_BATCH:
        raise LnnInputError(f"--batch must be at least 1 and at most {LARGEST_BATCH:,} (the largest lnn-summary "
                            f"figures: a larger one could overflow the plan's 64-bit byte counts), not {args.batch:,}")
    model, bin_model = read_model_source(args.source)
    model = at_length(model, args.length)
    if args.max_batch:
        print("\n".join(max_batch_lines(model, args.memory, args.amp)))
        return 0
    batch = args.batch
    flops = sum(node.flops for node in model.nodes)
    activation_sum = sum(node.activation_bytes for node in model.nodes) * batch

    print(f"{model.name}: input {shape_text(model.input_shape)}, output {shape_text(model.output_shape)}, "
          f"{len(model.nodes)} layers ({args.source})")
    if bin_model is not None:
        print("\n".join(metadata_lines(bin_model)))
    print()
    print("\n".join(layer_table(model, batch)))
    print(f"parameters:  {model.num_params:,} ({human_bytes(model.num_params * FLOAT_BYTES)} as float32)")
    print(f"FLOPs:       {flops:,} per image ({human_flops(flops)}); {human_flops(flops * batch)} at batch {batch}")
    print(f"activations: {activation_sum:,} bytes of layer outputs at batch {batch} ({human_bytes(activation_sum)})")
    print()
    print(f"memory at batch {batch}:")
    estimates = memory_estimates(model, batch)
    width = max(map(len, estimates))
    for what, size in estimates.items():
        print(f"  {what:<{width}}  {human_bytes(size):>10}  ({size:,} bytes)")
    print(FORMULA)
    print()
    print("\n".join(plan_lines(model, batch, args.amp)))
    return 0


def main(argv=None) -> int:
    parser = build_parser()

    def checked_summary(args) -> int:
        if args.max_batch != (args.memory is not None):
            parser.error("--max-batch and --memory SIZE go together (e.g. --max-batch --memory 6GB)")
        return summarize(args)

    return run_command(parser, checked_summary, argv)


if __name__ == "__main__":
    sys.exit(main())
