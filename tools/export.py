"""lnn-export: a JSON model description plus weights (.npz), an existing .bin, or a training checkpoint -> a .bin.

    lnn-export examples/reference/mnist_cnn.json --weights mnist_cnn.weights.npz -o mnist_cnn.bin
    lnn-export runs/cnn/best.npz -o mnist_cnn.bin
    lnn-export mnist_cnn.bin -o mnist_cnn_fp16.bin --fp16
    lnn-export mnist_cnn.bin --onnx mnist_cnn.onnx

Weights are keyed `<layer name>.<param>` as in a PyTorch state_dict (weight, bias, running_mean,
running_var); batch norm's `num_batches_tracked` is ignored. Re-exporting a .bin keeps its metadata
and stored dtypes, so export -> load -> export gives a byte-identical file. A checkpoint written by
lnn-train (RUN_DIR/checkpoint.npz or best.npz) carries its description and weights; its .bin is the
one lnn-train itself writes (preprocessing, labels, epoch and best score in the metadata). --fp16 stores the conv
and linear weight matrices as float16 (biases and batch-norm statistics stay float32). --onnx also
(or instead) writes an ONNX file (opset 17, float32, batch norm folded; needs the onnx extra).
"""

from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path

import numpy as np

from lnn.formats.binfile import build_metadata, check_weights, fp16_dtypes, write_bin
from lnn.formats.errors import LnnInputError
from lnn.formats.npz import NPZ_READ_ERRORS, open_npz
from lnn.formats.model import Model
from lnn.tools.cli import (command_parser, human_bytes, is_npz_file, read_checkpoint_source, read_model_source,
                           run_command)

PROG = "lnn-export"
IGNORED_BATCHNORM_KEYS = ("num_batches_tracked",)     # a PyTorch counter, not a parameter


def build_parser():
    parser = command_parser(PROG, __doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1])
    parser.add_argument("source", metavar="MODEL", help="a JSON model description (with --weights), a .bin to re-export, or an lnn-train checkpoint .npz")
    parser.add_argument("--weights", metavar="W.npz", help="NumPy .npz of the weights, keyed <layer name>.<param>")
    parser.add_argument("-o", "--output", metavar="OUT.bin", help="the .bin file to write (atomically)")
    parser.add_argument("--fp16", action="store_true", help="in the .bin, store conv and linear weights as float16 (about half the size)")
    parser.add_argument("--onnx", metavar="OUT.onnx", help="also (or only) write the model as ONNX")
    return parser


def load_weights(path: str | Path, model: Model) -> dict:
    """Read an .npz of named arrays; drop batch norm's num_batches_tracked; refuse non-numeric arrays."""
    archive = open_npz(path, "weights file", "a NumPy .npz archive of named weight arrays", LnnInputError)
    ignored = {f"{node.name}.{key}" for node in model.nodes if node.op == "batchnorm" for key in IGNORED_BATCHNORM_KEYS}
    weights = {}
    with archive:
        for key in archive.files:
            if key in ignored:
                continue
            try:
                array = archive[key]
            except NPZ_READ_ERRORS as err:
                raise LnnInputError(f"{path}: cannot read array {key!r} ({err}); the archive is damaged") from None
            if array.dtype.kind not in "fiu":
                raise LnnInputError(f"{path}: {key} has dtype {array.dtype}, not numbers")
            weights[key] = array
    return weights


def read_source(args) -> tuple:
    """-> (model, weights, metadata, stored dtypes) from a checkpoint, a .bin, or a description and --weights."""
    if is_npz_file(args.source):
        if args.weights:
            raise LnnInputError(f"{args.source} is an .npz: a training checkpoint carries its own weights, "
                                f"and --weights is for a JSON description")
        model, weights, state = read_checkpoint_source(args.source)
        training = {"epoch": state.get("epoch"), "best": state.get("best")}     # as in lnn-train's own model.bin
        return model, weights, build_metadata(model, {"training": training}), {}
    model, bin_model = read_model_source(args.source)
    if bin_model is not None:
        if args.weights:
            raise LnnInputError(f"{args.source} is a .bin and carries its own weights; --weights is for a JSON description")
        return model, bin_model.tensors, bin_model.metadata, bin_model.stored_dtypes
    if not args.weights:
        raise LnnInputError(f"{args.source} is a model description: give its weights with --weights W.npz")
    return model, load_weights(args.weights, model), build_metadata(model), {}


def export(args) -> int:
    model, weights, metadata, dtypes = read_source(args)
    if args.output:
        write_bin_and_report(args.output, model, weights, metadata, dtypes, args.fp16)
    if args.onnx:
        from lnn.formats.onnx_export import export_onnx

        check_weights(model.param_shapes(), weights)
        export_onnx(model, {key: np.asarray(value, np.float32) for key, value in weights.items()}, args.onnx)
        size = Path(args.onnx).stat().st_size
        print(f"wrote {args.onnx}: {human_bytes(size)} ({size:,} bytes), ONNX, float32, {model.num_params:,} parameters")
    return 0


def write_bin_and_report(output, model: Model, weights: dict, metadata: dict, dtypes: dict, fp16: bool) -> None:
    if fp16:
        dtypes = {**dtypes, **fp16_dtypes(model)}
    try:
        size = write_bin(output, model, weights, metadata, dtypes)
    except OSError as err:
        raise LnnInputError(f"cannot write {output}: {err.strerror or err}") from None

    stored = Counter(dtypes.get(key, "float32") for key in model.param_shapes())
    kinds = ", ".join(f"{count} {dtype}" for dtype, count in sorted(stored.items()))
    print(f"wrote {output}: {human_bytes(size)} ({size:,} bytes), {sum(stored.values())} tensors ({kinds}), "
          f"{model.num_params:,} parameters")


def main(argv=None) -> int:
    parser = build_parser()

    def checked_export(args) -> int:
        if not (args.output or args.onnx):
            parser.error("give the output: -o OUT.bin, --onnx OUT.onnx, or both")
        if args.fp16 and not args.output:
            parser.error("--fp16 applies to the .bin: add -o OUT.bin")
        return export(args)

    return run_command(parser, checked_export, argv)


if __name__ == "__main__":
    sys.exit(main())
