"""lnn-export: a JSON model description plus weights (.npz), an existing .bin, or a training checkpoint -> a .bin.

    lnn-export examples/reference/mnist_cnn.json --weights mnist_cnn.weights.npz -o mnist_cnn.bin
    lnn-export runs/cnn/best.npz -o mnist_cnn.bin
    lnn-export mnist_cnn.bin -o mnist_cnn_fp16.bin --fp16
    lnn-export mnist_cnn.bin -o mnist_cnn_int8.bin --int8 --calibration mnist:data/mnist
    lnn-export mnist_cnn.bin --onnx mnist_cnn.onnx

Weights are keyed `<layer name>.<param>` as in a PyTorch state_dict (weight, bias, running_mean,
running_var); batch norm's `num_batches_tracked` is ignored. Re-exporting a .bin keeps its metadata
and stored dtypes, so export -> load -> export gives a byte-identical file. A checkpoint written by
lnn-train (RUN_DIR/checkpoint.npz or best.npz) carries its description and weights; its .bin is the
one lnn-train itself writes (preprocessing, labels, epoch and best score in the metadata). --fp16 stores the conv
and linear weight matrices as float16 (biases and batch-norm statistics stay float32). --onnx also
(or instead) writes an ONNX file (opset 17, float32, batch norm folded; needs the onnx extra).

--int8 stores the same matrices as int8, symmetric, with a float32 scale per output channel (about a
quarter of the float32 size; formats/SPEC.md). Before writing, it measures the top-1 accuracy of the
model as given and of its int8 version on --calibration data, and refuses when int8 loses more than
0.5 points: folder:DIR is the validation side of lnn-train's split of an image folder (the photos
lnn-eval evaluates by default), mnist:DIR the 10,000 MNIST test images, ucr:DIR a series model's UCR/UEA
dataset's NAME_TEST (the split lnn-eval --split test measures), csv:FILE with --target COLUMN the validation
rows of lnn-train's split of a table model's table (as lnn-eval --data csv:FILE). Without --calibration it
refuses too, since nothing was checked. --force writes the int8 file anyway (after the check, when
there is calibration data).

Every .bin gets test vectors (formats/SPEC.md "Test vector rules"): a few inputs and this machine's
outputs for them (NumPy reference backend), which lnn-doctor MODEL.bin and the field app run to check
that a computer computes the same. By default seeded normal inputs (4, or as many as fit in 512 KiB,
at least 1); --test-photos uses photos
(preprocessed as the model says); --test-vectors 0 leaves them out. Re-exporting a .bin keeps its
vectors (their outputs recomputed when --fp16 or --int8 changes the weights).
"""

from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path

import numpy as np

from lnn.formats.binfile import (build_metadata, check_weight_shapes, encode_bin, float32_weights, fp16_dtypes,
                                 int8_dtypes, parse_bin_bytes, refuse_writing_over_inputs, write_atomic)
from lnn.formats.errors import LnnError, LnnInputError, ModelSpecError
from lnn.formats.gate import TENSOR_PREFIX as GATE_TENSORS
from lnn.formats.npz import NPZ_READ_ERRORS, array_headers, open_npz
from lnn.formats.model import Model
from lnn.formats.limits import MAX_TEST_VECTORS
from lnn.formats.vectors import INPUTS, METADATA_KEY as VECTORS
from lnn.runtime.vectors import DEFAULT_INPUT_BYTES, normal_inputs, photo_inputs, with_test_vectors, without_test_vectors
from lnn.tools.eval import class_columns, probabilities, row_outputs
from lnn.tools.cli import (command_parser, human_bytes, is_npz_file, read_checkpoint_source, read_model_source,
                           run_command)

PROG = "lnn-export"
IGNORED_BATCHNORM_KEYS = ("num_batches_tracked",)     # a PyTorch counter, not a parameter
ONNX_LEFT_OUT = ("calibration", "gate", "thresholds")   # .bin metadata ONNX does not carry
MAX_INT8_LOSS = 0.005                                # top-1 accuracy int8 may lose: half a percentage point


def build_parser():
    parser = command_parser(PROG, __doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1])
    parser.add_argument("source", metavar="MODEL", help="a JSON model description (with --weights), a .bin to re-export, or an lnn-train checkpoint .npz")
    parser.add_argument("--weights", metavar="W.npz", help="NumPy .npz of the weights, keyed <layer name>.<param>")
    parser.add_argument("-o", "--output", metavar="OUT.bin", help="the .bin file to write (atomically)")
    parser.add_argument("--fp16", action="store_true", help="in the .bin, store conv and linear weights as float16 (about half the size)")
    parser.add_argument("--int8", action="store_true",
                        help="in the .bin, store conv and linear weights as int8 with per-channel scales (about a quarter)")
    parser.add_argument("--calibration", metavar="KIND:PATH",
                        help="with --int8: folder:DIR (its validation split), mnist:DIR (the test set), for a "
                             "series model ucr:DIR (NAME_TEST), or for a table model csv:FILE with --target (its "
                             "validation rows) to compare accuracy on")
    parser.add_argument("--target", metavar="COLUMN", help="with --calibration csv:FILE: the column holding the class")
    parser.add_argument("--force", action="store_true",
                        help="with --int8: write it even if it loses more than 0.5 points, or without --calibration")
    parser.add_argument("--onnx", metavar="OUT.onnx", help="also (or only) write the model as ONNX")
    parser.add_argument("--test-vectors", metavar="N", type=int,
                        help=f"store N seeded normal inputs and this machine's outputs for them (default: up to 4, as "
                             f"many as fit in {DEFAULT_INPUT_BYTES >> 10} KiB, or the .bin's own; 0: none; at most "
                             f"{MAX_TEST_VECTORS})")
    parser.add_argument("--test-photos", metavar="PHOTO|DIR", nargs="+",
                        help="store these photos (a folder: its photos), preprocessed, as the test inputs")
    return parser


def load_weights(path: str | Path, model: Model) -> dict:
    """Read an .npz of named arrays; drop batch norm's num_batches_tracked; refuse non-numeric arrays.
    Names, shapes and dtypes are checked against the model from the .npy headers before any array is read."""
    archive = open_npz(path, "weights file", "a NumPy .npz archive of named weight arrays", LnnInputError)
    ignored = {f"{node.name}.{key}" for node in model.nodes if node.op == "batchnorm" for key in IGNORED_BATCHNORM_KEYS}
    weights = {}
    with archive:
        headers = {key: header for key, header in array_headers(archive, path, LnnInputError).items()
                   if key not in ignored}
        for key, (_shape, dtype) in headers.items():
            if dtype.kind not in "fiu":
                raise LnnInputError(f"{path}: {key} has dtype {dtype}, not numbers")
        try:
            check_weight_shapes(model.param_shapes(), {key: shape for key, (shape, _dtype) in headers.items()})
        except ModelSpecError as err:
            raise LnnInputError(f"{path}: {err}") from None
        for key in headers:
            try:
                weights[key] = archive[key]
            except NPZ_READ_ERRORS as err:
                raise LnnInputError(f"{path}: cannot read array {key!r} ({err}); the archive is damaged") from None
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


def input_files(args) -> list:
    """The files (and folders) this export reads: the model, --weights, --calibration's data, --test-photos."""
    calibration = args.calibration.partition(":")[2] if args.calibration else None
    return [args.source, args.weights, calibration, *(args.test_photos or ())]


def export(args) -> int:
    refuse_writing_over_inputs([args.output, args.onnx], input_files(args))
    model, weights, metadata, dtypes = read_source(args)
    if args.output:
        write_bin_and_report(args, model, weights, metadata, dtypes)
    if args.onnx:
        from lnn.formats.onnx_export import export_onnx

        network = {key: value for key, value in without_test_vectors(weights, metadata)[0].items()
                   if not key.startswith(GATE_TENSORS)}                   # not the gate's nor the test vectors
        export_onnx(model, float32_weights(model, network), args.onnx)      # int8 and float16 widened
        size = Path(args.onnx).stat().st_size
        print(f"wrote {args.onnx}: {human_bytes(size)} ({size:,} bytes), ONNX, float32, {model.num_params:,} parameters")
        left_out = [key for key in ONNX_LEFT_OUT if key in metadata]
        if left_out:          # lnn-import of this file gives a model that never says "uncertain" or "not a leaf"
            print(f"warning: {args.onnx} holds the network, labels and preprocessing, not this model's "
                  f"{', '.join(left_out)} (its uncertain answers); a .bin imported from it answers every input",
                  file=sys.stderr)
    return 0


def write_bin_and_report(args, model: Model, weights: dict, metadata: dict, dtypes: dict) -> None:
    source_dtypes = dtypes
    if args.fp16:
        dtypes = {**dtypes, **fp16_dtypes(model)}
    if args.int8:
        dtypes = {**dtypes, **int8_dtypes(model)}
    weights, metadata = test_vectors(args, model, weights, metadata, dtypes, source_dtypes)
    data = encode_bin(model, weights, metadata, dtypes)
    if args.int8:
        check_int8_accuracy(encode_bin(model, *without_test_vectors(weights, metadata), source_dtypes), data,
                            args.calibration, args.target, args.force)
    try:
        write_atomic(args.output, data)
    except OSError as err:
        raise LnnInputError(f"cannot write {args.output}: {err.strerror or err}") from None

    stored = Counter(dtypes.get(key, "float32") for key in model.param_shapes())
    kinds = ", ".join(f"{count} {dtype}" for dtype, count in sorted(stored.items()))
    scales = f" + {stored['int8']} scale tensors" if stored["int8"] else ""
    vectors = f", {metadata[VECTORS]['count']} test vectors" if VECTORS in metadata else ", no test vectors"
    print(f"wrote {args.output}: {human_bytes(len(data))} ({len(data):,} bytes), {sum(stored.values())} tensors "
          f"({kinds}){scales}, {model.num_params:,} parameters{vectors}")


def test_vectors(args, model: Model, weights: dict, metadata: dict, dtypes: dict, source_dtypes: dict) -> tuple:
    """(weights, metadata) with the test vectors this export stores (see the module's help)."""
    if args.test_vectors == 0:
        return without_test_vectors(weights, metadata)
    if args.test_photos:
        return with_test_vectors(model, weights, metadata, dtypes, *photo_inputs(model, photo_paths(args.test_photos)))
    if args.test_vectors is None and VECTORS in metadata:        # a .bin's own vectors
        if dtypes == source_dtypes:
            return weights, metadata                              # the same weights: the same outputs
        return with_test_vectors(model, weights, metadata, dtypes, weights[INPUTS], metadata[VECTORS]["inputs"])
    return with_test_vectors(model, weights, metadata, dtypes, *normal_inputs(model, args.test_vectors))


def photo_paths(given: list) -> list:
    """Files as given, folders as their photos (sorted by name)."""
    from lnn.tools.infer import images_in_folder

    paths = []
    for name in given:
        path = Path(name)
        if path.is_dir():
            found = images_in_folder(path)
            if not found:
                raise LnnInputError(f"{path}: no photos in this folder (--test-photos)")
            paths += found
        else:
            paths.append(path)
    return paths


# --------------------------------------------------------------------------- the int8 accuracy gate

CALIBRATION_KINDS = "folder:DIR, mnist:DIR, (a series model) ucr:DIR or (a table model) csv:FILE with --target"
CALIBRATION_FOR = {"images": ("folder", "mnist"), "series": ("ucr",), "table rows": ("csv",)}   # what each model takes


def model_takes(model: Model) -> str:
    """What a model's inputs are: "images", "series" or "table rows"."""
    return "images" if model.takes_images else "series" if len(model.input_shape) == 2 else "table rows"


def calibration_set(spec: str, model: Model, target: str | None = None) -> tuple:
    """`folder:DIR`, `mnist:DIR`, `ucr:DIR` or `csv:FILE` (with target, its class column) -> (the inputs: uint8
    images [N, C, H, W] in the model's colour order and size, a series model's raw series, or a table model's raw
    rows [N, F]; the model output index each should get [N]; what they are). folder and csv: the validation side of
    lnn-train's split with its default seed and share, as lnn-eval evaluates; mnist: the test set; ucr:
    NAME_TEST, as lnn-eval --split test."""
    kind, sep, path = spec.partition(":")
    if kind not in ("folder", "mnist", "ucr", "csv") or not sep or not path:
        raise LnnInputError(f"--calibration must look like {CALIBRATION_KINDS}, not {spec!r}")
    takes = model_takes(model)
    if kind not in CALIBRATION_FOR[takes]:
        hint = " or ".join(f"{fitting}:{'FILE' if fitting == 'csv' else 'DIR'}" for fitting in CALIBRATION_FOR[takes])
        raise LnnInputError(f"model {model.name!r} takes {takes}, so {spec} cannot calibrate it; give {hint}")
    from lnn.train.data import DEFAULT_SPLIT_SEED, DEFAULT_VAL_FRACTION, validation_split_words

    if kind == "csv":
        from lnn.train.series import read_target_table, split_rows

        table = read_target_table(path, target, model.preprocess, given=f"--calibration {spec}")
        rows = split_rows(table.labels, DEFAULT_VAL_FRACTION, DEFAULT_SPLIT_SEED)[1]
        if len(rows) == 0:
            raise LnnInputError(f"{table.path}: no row falls on the validation side of the split of its "
                                f"{len(table.values)} rows, so int8 cannot be checked on it")
        return (table.values[rows], class_columns([table.labels[i] for i in rows], model.labels, table.path),
                f"{table.path} ({validation_split_words(DEFAULT_SPLIT_SEED, DEFAULT_VAL_FRACTION)})")
    if kind == "ucr":
        from lnn.train.series import ucr_split

        data, source = ucr_split(path, "test", model.preprocess)
        return list(data.series), class_columns(data.labels, model.labels, source), f"{source} (test split)"
    if kind == "mnist":
        from lnn.train.data import load_mnist

        if tuple(model.input_shape) != (1, 28, 28):
            raise LnnInputError(f"model {model.name!r} takes {list(model.input_shape)}, not MNIST's [1, 28, 28]")
        test = load_mnist(path)[1]
        folder_classes = [str(digit) for digit in range(10)]
        columns = class_columns(folder_classes, model.labels, path)
        return test.images, columns[test.labels], f"{path} (MNIST test set)"
    from lnn.train.images import ImageFolder, scan_folder

    scan = scan_folder(path)
    columns = class_columns(scan.classes, model.labels, path)         # before decoding
    folder = ImageFolder.load(path, model.input_shape, model.preprocess["color"], progress=True,
                              log=lambda message: print(message, file=sys.stderr, flush=True), scan=scan)
    rows = folder.split(DEFAULT_VAL_FRACTION, DEFAULT_SPLIT_SEED,     # too few photos per class for a 20% share
                        "int8 cannot be checked on it; give --calibration a folder with more photos per class")[1]
    return (folder.data.images[rows], columns[folder.labels[rows]],
            f"{path} ({validation_split_words(DEFAULT_SPLIT_SEED, DEFAULT_VAL_FRACTION)})")


def accuracy(session, inputs, true_columns, batch: int = 256) -> float:
    """Top-1 accuracy of a Session on calibration_set's inputs, with the model's own preprocessing."""
    if session.model.takes_images:
        probs = probabilities(session, inputs, batch, progress=True)
    else:
        probs = session.judge_rules.probabilities(row_outputs(session, inputs, batch))
    return float(np.mean(probs.argmax(axis=1) == true_columns))


def check_int8_accuracy(reference: bytes, quantized: bytes, calibration: str | None, target: str | None,
                        force: bool) -> None:
    """Refuse (LnnError) when the int8 model loses more than MAX_INT8_LOSS of top-1 accuracy on the
    calibration data, or when there is none to check with; --force turns the refusal into a warning."""
    from lnn.runtime import Session

    if calibration is None:
        if not force:
            raise LnnError(f"--int8 needs --calibration {CALIBRATION_KINDS} to check that int8 keeps the "
                           "accuracy (or --force to write it unchecked)")
        print("warning: int8 accuracy not checked (no --calibration)", file=sys.stderr)
        return
    reference_bin = parse_bin_bytes(reference, "the model as given")
    inputs, true_columns, what = calibration_set(calibration, reference_bin.model, target)
    before = accuracy(Session(reference_bin), inputs, true_columns)
    after = accuracy(Session(parse_bin_bytes(quantized, "the int8 model")), inputs, true_columns)
    takes = model_takes(reference_bin.model)
    unit = "rows" if takes == "table rows" else takes
    summary = (f"int8 accuracy {after:.2%} vs {before:.2%} as given ({(after - before) * 100:+.2f} points) "
               f"on {len(inputs):,} {unit} of {what}")
    if before - after > MAX_INT8_LOSS + 1e-12:
        if not force:
            raise LnnError(f"{summary}: loses more than {MAX_INT8_LOSS * 100:.1f} points, not written "
                           f"(--force writes it anyway)")
        print(f"warning: {summary}: loses more than {MAX_INT8_LOSS * 100:.1f} points; written because of --force",
              file=sys.stderr)
    else:
        print(summary)


def main(argv=None) -> int:
    parser = build_parser()

    def checked_export(args) -> int:
        if not (args.output or args.onnx):
            parser.error("give the output: -o OUT.bin, --onnx OUT.onnx, or both")
        if (args.fp16 or args.int8) and not args.output:
            parser.error(f"--{'fp16' if args.fp16 else 'int8'} applies to the .bin: add -o OUT.bin")
        if args.fp16 and args.int8:
            parser.error("choose one of --fp16 and --int8")
        if (args.calibration or args.force) and not args.int8:
            parser.error("--calibration and --force go with --int8")
        if args.target and not (args.calibration or "").startswith("csv:"):
            parser.error("--target COLUMN goes with --calibration csv:FILE")
        if args.test_vectors is not None and not 0 <= args.test_vectors <= MAX_TEST_VECTORS:
            parser.error(f"--test-vectors must be 0 to {MAX_TEST_VECTORS}, not {args.test_vectors}")
        if args.test_photos and args.test_vectors is not None:
            parser.error("choose one of --test-vectors and --test-photos")
        if (args.test_photos or args.test_vectors is not None) and not args.output:
            parser.error("--test-vectors and --test-photos apply to the .bin: add -o OUT.bin")
        if args.output and args.onnx and Path(args.output).resolve() == Path(args.onnx).resolve():
            parser.error(f"-o and --onnx name the same file ({args.onnx}): the ONNX file would replace the .bin")
        return export(args)

    return run_command(parser, checked_export, argv)


if __name__ == "__main__":
    sys.exit(main())
