"""lnn-summary: a model's layers, parameters, FLOPs, and memory for inference and training.

    lnn-summary examples/reference/mnist_cnn.json
    lnn-summary model.bin --batch 64

Per layer: output shape, parameters, FLOPs per image (a multiply-add counts 2) and activation bytes
at the batch size. Then totals, and memory estimates at that batch for inference and for training
with SGD (momentum) and Adam; the footer states the formula. A .bin also shows its metadata.
"""

from __future__ import annotations

import math
import os
import sys
from collections import Counter

from lnn.formats.errors import LnnInputError
from lnn.formats.model import FLOAT_BYTES, Model
from lnn.formats.ops import get_op
from lnn.tools.cli import command_parser, human_bytes, human_flops, read_model_source, run_command

PROG = "lnn-summary"
OPTIMIZER_STATE = {"SGD (momentum)": 1, "Adam": 2}     # optimizer state, in copies of the trainable parameters
FORMULA = """\
estimate (float32): inference = P + max_i(A[i-1] + A[i]);
  training = P + G + S + sum_i A[i] + max_i(A[i-1] + A[i]),
  where P = parameter bytes, G = gradient bytes (trainable parameters; batch-norm statistics excluded),
  S = optimizer state (SGD momentum 1x, Adam 2x the trainable parameters), A[i] = bytes of layer i's output
  at the batch size (A[0] the input), all saved for the backward pass; max_i(A[i-1] + A[i]) is the largest
  pair of live activations (and of activation gradients). Workspace buffers of a backend are not included."""


def build_parser():
    parser = command_parser(PROG, __doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1])
    parser.add_argument("source", metavar="MODEL", help="a JSON model description or a .bin")
    parser.add_argument("--batch", type=int, default=1, metavar="N", help="batch size for activation and memory figures (default 1)")
    return parser


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
    stored = Counter(t.dtype.name for t in bin_model.tensors.values())
    size = os.path.getsize(bin_model.path)
    lines = [f"file: {human_bytes(size)} ({size:,} bytes), format {bin_model.version[0]}.{bin_model.version[1]}, "
             f"written by {meta.get('producer')} {meta.get('producer_version')}",
             f"stored: {len(bin_model.tensors)} tensors ({', '.join(f'{c} {d}' for d, c in sorted(stored.items()))})"]
    labels = bin_model.model.labels
    shown = ", ".join(label["display"] for label in labels[:6]) + (", ..." if len(labels) > 6 else "")
    lines.append(f"labels: {len(labels)} ({shown})")
    pre = meta.get("preprocess")
    if pre:
        lines.append(f"preprocess: {pre['color']}, resize to {pre['resize'][0]}x{pre['resize'][1]}, x * {pre['scale']:.6g}, "
                     f"mean {pre['mean']}, std {pre['std']}")
    thresholds = meta.get("thresholds")
    if thresholds:
        lines.append(f"thresholds: {thresholds}")
    return lines


def summarize(args) -> int:
    if args.batch < 1:
        raise LnnInputError(f"--batch must be at least 1, not {args.batch}")
    model, bin_model = read_model_source(args.source)
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
    return 0


def main(argv=None) -> int:
    return run_command(build_parser(), summarize, argv)


if __name__ == "__main__":
    sys.exit(main())
