"""lnn-export: a JSON model description plus weights (.npz), or an existing .bin, -> a .bin model file.

    lnn-export examples/reference/mnist_cnn.json --weights mnist_cnn.weights.npz -o mnist_cnn.bin
    lnn-export mnist_cnn.bin -o mnist_cnn_fp16.bin --fp16

Weights are keyed `<layer name>.<param>` as in a PyTorch state_dict (weight, bias, running_mean,
running_var); batch norm's `num_batches_tracked` is ignored. Re-exporting a .bin keeps its metadata
and stored dtypes, so export -> load -> export gives a byte-identical file. --fp16 stores the conv
and linear weight matrices as float16 (biases and batch-norm statistics stay float32).
"""

from __future__ import annotations

import sys
import zipfile
from collections import Counter
from pathlib import Path

import numpy as np

from lnn.formats.binfile import build_metadata, write_bin
from lnn.formats.errors import LnnInputError
from lnn.formats.model import Model
from lnn.tools.cli import command_parser, human_bytes, read_model_source, run_command

PROG = "lnn-export"
FP16_MAX = float(np.finfo(np.float16).max)
IGNORED_BATCHNORM_KEYS = ("num_batches_tracked",)     # a PyTorch counter, not a parameter


def build_parser():
    parser = command_parser(PROG, __doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1])
    parser.add_argument("source", metavar="MODEL", help="a JSON model description (with --weights) or a .bin to re-export")
    parser.add_argument("--weights", metavar="W.npz", help="NumPy .npz of the weights, keyed <layer name>.<param>")
    parser.add_argument("-o", "--output", metavar="OUT.bin", required=True, help="the .bin file to write (atomically)")
    parser.add_argument("--fp16", action="store_true", help="store conv and linear weights as float16 (about half the size)")
    return parser


def load_weights(path: str | Path, model: Model) -> dict:
    """Read an .npz of named arrays; drop batch norm's num_batches_tracked; refuse non-numeric arrays."""
    path = Path(path)
    try:
        archive = np.load(path, allow_pickle=False)
    except FileNotFoundError:
        raise LnnInputError(f"{path}: no such weights file") from None
    except IsADirectoryError:
        raise LnnInputError(f"{path}: is a folder, not a weights file") from None
    except (ValueError, EOFError, zipfile.BadZipFile, OSError):
        raise LnnInputError(f"{path}: not a NumPy .npz archive of named weight arrays") from None
    if not isinstance(archive, np.lib.npyio.NpzFile):
        raise LnnInputError(f"{path}: holds a single array (.npy), not an .npz archive of named weight arrays")
    ignored = {f"{node.name}.{key}" for node in model.nodes if node.op == "batchnorm" for key in IGNORED_BATCHNORM_KEYS}
    weights = {}
    with archive:
        for key in archive.files:
            if key in ignored:
                continue
            try:
                array = archive[key]
            except (ValueError, EOFError, zipfile.BadZipFile, OSError) as err:
                raise LnnInputError(f"{path}: cannot read array {key!r} ({err}); the archive is damaged") from None
            if array.dtype.kind not in "fiu":
                raise LnnInputError(f"{path}: {key} has dtype {array.dtype}, not numbers")
            weights[key] = array
    return weights


def fp16_dtypes(model: Model) -> dict:
    """Which tensors --fp16 stores as float16: the weight matrices of conv2d and linear layers."""
    return {node.param_key("weight"): "float16" for node in model.nodes if node.op in ("conv2d", "linear")}


def check_fp16_range(weights: dict, dtypes: dict) -> None:
    for key, dtype in dtypes.items():
        if dtype == "float16":
            largest = float(np.max(np.abs(weights[key]))) if np.size(weights[key]) else 0.0
            if largest > FP16_MAX:
                raise LnnInputError(f"weights: {key} holds {largest:g}, beyond float16's range (±{FP16_MAX:g}); export without --fp16")


def export(args) -> int:
    model, bin_model = read_model_source(args.source)
    if bin_model is not None:
        if args.weights:
            raise LnnInputError(f"{args.source} is a .bin and carries its own weights; --weights is for a JSON description")
        weights, metadata, dtypes = bin_model.tensors, bin_model.metadata, bin_model.stored_dtypes
    else:
        if not args.weights:
            raise LnnInputError(f"{args.source} is a model description: give its weights with --weights W.npz")
        weights, metadata, dtypes = load_weights(args.weights, model), build_metadata(model), {}
    if args.fp16:
        dtypes = {**dtypes, **fp16_dtypes(model)}
        check_fp16_range(weights, dtypes)
    try:
        size = write_bin(args.output, model, weights, metadata, dtypes)
    except OSError as err:
        raise LnnInputError(f"cannot write {args.output}: {err.strerror or err}") from None

    stored = Counter(dtypes.get(key, "float32") for key in model.param_shapes())
    kinds = ", ".join(f"{count} {dtype}" for dtype, count in sorted(stored.items()))
    print(f"wrote {args.output}: {human_bytes(size)} ({size:,} bytes), {sum(stored.values())} tensors ({kinds}), "
          f"{model.num_params:,} parameters")
    return 0


def main(argv=None) -> int:
    return run_command(build_parser(), export, argv)


if __name__ == "__main__":
    sys.exit(main())
