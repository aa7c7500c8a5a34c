"""lnn-import: an ONNX model (e.g. exported by PyTorch) -> a .bin model file.

    lnn-import leaf.onnx -o leaf.bin --labels healthy,blight,mold,spot --color rgb \\
        --mean 0.485 0.456 0.406 --std 0.229 0.224 0.225
    lnn-import digits.onnx -o digits.bin --labels-file digits.txt --color gray --mean 0.1307 --std 0.3081

The graph must be a chain of ops lnn has: Conv, Gemm, MatMul+Add, Relu, Clip (relu / relu6), Sigmoid,
Tanh, LeakyRelu, MaxPool, AveragePool, GlobalAveragePool, Flatten, Reshape (as a flatten),
BatchNormalization, Softmax, Dropout, Identity. Anything else is reported naming the node.
Preprocessing (image models): pixels * scale (default 1/255), then (x - mean) / std per channel.
Labels and preprocessing stored by lnn-export --onnx are kept unless given here.
"""

from __future__ import annotations

import sys
from pathlib import Path

from lnn.formats.errors import LnnInputError
from lnn.tools.cli import command_parser, human_bytes, run_command

PROG = "lnn-import"


def build_parser():
    parser = command_parser(PROG, __doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1])
    parser.add_argument("source", metavar="MODEL.onnx", help="the ONNX model to convert")
    parser.add_argument("-o", "--output", metavar="OUT.bin", required=True, help="the .bin file to write (atomically)")
    labels = parser.add_mutually_exclusive_group()
    labels.add_argument("--labels", metavar="A,B,C", help="class names, comma-separated, in output order")
    labels.add_argument("--labels-file", metavar="FILE", help="class names, one per line, in output order")
    parser.add_argument("--color", choices=("rgb", "bgr", "gray"), help="channel order the model expects")
    parser.add_argument("--mean", type=float, nargs="+", metavar="M", help="per-channel mean, after scaling")
    parser.add_argument("--std", type=float, nargs="+", metavar="S", help="per-channel standard deviation")
    parser.add_argument("--scale", type=float, metavar="F", help="pixel multiplier before mean/std (default 1/255)")
    parser.add_argument("--name", help="model name (default: the file's name)")
    return parser


def read_labels(args) -> list | None:
    if args.labels is not None:
        names = [name.strip() for name in args.labels.split(",")]
    elif args.labels_file is not None:
        path = Path(args.labels_file)
        try:
            text = path.read_text(encoding="utf-8")
        except FileNotFoundError:
            raise LnnInputError(f"{path}: no such labels file") from None
        except (OSError, UnicodeDecodeError) as err:
            raise LnnInputError(f"{path}: cannot read the labels file ({err})") from None
        names = [line.strip() for line in text.splitlines() if line.strip()]
        if not names:
            raise LnnInputError(f"{path}: holds no label names (one per line)")
    else:
        return None
    if not all(names):
        raise LnnInputError("--labels: a label name is empty")
    return names


def read_preprocess(args) -> dict:
    given = {"color": args.color, "mean": args.mean, "std": args.std, "scale": args.scale}
    return {key: value for key, value in given.items() if value is not None}


def convert(args) -> int:
    from lnn.formats.binfile import build_metadata, refuse_writing_over_inputs, write_bin
    from lnn.formats.onnx_import import import_onnx

    refuse_writing_over_inputs([args.output], [args.source, args.labels_file])
    model, weights = import_onnx(args.source, name=args.name, labels=read_labels(args),
                                 preprocess=read_preprocess(args))
    try:
        size = write_bin(args.output, model, weights, build_metadata(model))
    except OSError as err:
        raise LnnInputError(f"cannot write {args.output}: {err.strerror or err}") from None
    print(f"wrote {args.output}: {human_bytes(size)} ({size:,} bytes), {len(model.nodes)} layers, "
          f"{model.num_params:,} parameters, input [N, {', '.join(map(str, model.input_shape))}], "
          f"output [N, {', '.join(map(str, model.output_shape))}]")
    return 0


def main(argv=None) -> int:
    return run_command(build_parser(), convert, argv)


if __name__ == "__main__":
    sys.exit(main())
