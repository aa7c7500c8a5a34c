"""lnn-train: train a JSON model description on a dataset, on the GPU (CuPy) or the CPU (NumPy).

    lnn-train examples/reference/mnist_mlp.json --data mnist:data/mnist --epochs 5 --batch 64 --out runs/mlp
    lnn-train model.json --data mnist:data/mnist --out runs/mlp --resume      # after an interruption

--resume continues the run in RUN_DIR with the options it was started with (RUN_DIR/run.json: --data, --epochs,
--batch, --lr, --lr-schedule, --seed, --patience, --limit-train, --val-fraction, --target, --no-augment,
--outliers, --amp, --tf32); one left out is taken from there, one given again must say the same. --device,
--threads, --cuda-graph and --quiet may change.

Ctrl-C or SIGTERM stops a run with one line naming the epoch its checkpoint keeps (exit 130).

Writes into the --out folder: checkpoint.npz (every epoch, atomically), best.npz, metrics.jsonl,
curves.png and, at the end, model.bin (the best epoch, with preprocessing and labels). Settings
come from the description's "training" block (see lnn.train.config); options given here win.
Data: mnist:FOLDER (the four MNIST IDX files, gzipped or raw); training uses the 60,000 training
images (--limit-train keeps the first N), evaluation the 10,000 test images after every epoch.
ucr:DIR (one UCR/UEA dataset: NAME_TRAIN and NAME_TEST as .ts, .tsv or .arff; see lnn.train.series)
trains on NAME_TRAIN without validation (the test split is lnn-eval's), shorter series padded with their mean to the
longest training length; csv:FILE --target COLUMN trains on a numeric table, --val-fraction of each class kept
for validation (seed 0). Both store the per-channel / per-column normalisation fitted on the training
rows as the model's preprocessing, and fill "input_shape": "from_data" and "out_features": "from_data"
(the class count) of the description. folder:DIR (one sub-folder of photos per class; see lnn.train.images): decoded once into a cache at
the model's input size, split by leaf into training and validation (--val-fraction, seed 0, the
split lnn-eval --split val uses), classes balanced, training images augmented as the description's
training.augment says (--no-augment: not). --outliers DIR (folder data only): outlier exposure with
the "fit" part of DIR's photos (lnn.train.outliers), mixed in as training.outliers says (default 1
per 4 training rows, uniform-posterior loss weight 0.5); validation accuracy stays on the folder's
own photos. --init MODEL starts from a .bin's or a checkpoint's weights (fine-tuning).
A batch larger than the training rows is cut to their number (said so). Before allocating, the
plan's memory is compared with what the device has free, and running out of memory later is one
line with the planned figure: choose a smaller --batch then.
"""

from __future__ import annotations

import copy
import signal
from pathlib import Path

from lnn.formats.binfile import refuse_writing_over_inputs
from lnn.formats.errors import LnnError, LnnInputError, ModelSpecError
from lnn.formats.model import load_description, parse_model
from lnn.runtime.cuda.float16 import AMP_PRECISIONS
from lnn.train.data import DEFAULT_SPLIT_SEED, DEFAULT_VAL_FRACTION
from lnn.train.run import CHECKPOINT, RUN_FILES
from lnn.tools.cli import command_parser, human_bytes, is_bin_file, is_npz_file, read_checkpoint_source, run_command

PROG = "lnn-train"
DATA_KINDS = ("mnist", "folder", "ucr", "csv")
CPU_BLAS_THREADS = 1
# The options that decide what a run computes, kept in RUN_DIR/run.json and taken again by --resume; None: not
# given (the description's training block decides). The flags' None is their default, False.
RUN_OPTIONS = ("data", "epochs", "batch", "lr", "lr_schedule", "seed", "patience", "limit_train", "val_fraction",
               "target", "no_augment", "outliers", "amp", "tf32")


def build_parser():
    parser = command_parser(PROG, __doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1])
    parser.add_argument("model", metavar="MODEL.json", help="the JSON model description to train")
    parser.add_argument("--data", required=True, metavar="KIND:PATH", help="the dataset, e.g. mnist:data/mnist")
    parser.add_argument("--out", required=True, metavar="RUN_DIR", help="folder for checkpoints, metrics and model.bin")
    parser.add_argument("--epochs", type=int, help="passes over the training data (training.epochs)")
    parser.add_argument("--batch", type=int, help="rows per forward/backward (training.batch_size)")
    parser.add_argument("--lr", type=float, help="base learning rate (the optimizer block's lr)")
    parser.add_argument("--lr-schedule", choices=("constant", "cosine", "step"),
                        help="learning-rate schedule type, with its default settings (training.lr_schedule)")
    parser.add_argument("--device", default="auto", choices=("auto", "cuda", "numpy", "cpu"),
                        help="cuda (CuPy), numpy (NumPy on the CPU) or auto: cuda when CuPy sees a GPU (default); "
                             "cpu is another name for numpy here (training has no Numba path; elsewhere cpu is Numba)")
    parser.add_argument("--threads", type=int, default=CPU_BLAS_THREADS, metavar="N",
                        help=f"BLAS threads when training on the CPU (default {CPU_BLAS_THREADS}: on the shared 2-core "
                             f"machine two threads made a series model's steps 4-15x slower, spinning on small products)")
    parser.add_argument("--cuda-graph", dest="cuda_graph", action="store_true", default=None,
                        help="replay each step as a captured CUDA graph (an error when the model cannot); "
                             "default: whenever the model, optimizer and device allow it")
    parser.add_argument("--no-cuda-graph", dest="cuda_graph", action="store_false",
                        help="run every step eagerly on the GPU")
    parser.add_argument("--amp", nargs="?", const="fp16", choices=tuple(AMP_PRECISIONS), metavar="fp16|bf16",
                        help="mixed precision on the GPU: 16-bit activations, float32 master weights; --amp alone is "
                             "fp16 (dynamic loss scaling, compute capability 7.0+), --amp bf16 is bfloat16 (float32's "
                             "range, no loss scaling, 8.0+: Ampere or newer)")
    parser.add_argument("--tf32", action="store_true", default=None,
                        help="float32 GEMMs on TF32 tensor cores (GPU; 10-bit mantissa inputs; off by default)")
    parser.add_argument("--resume", action="store_true", help="continue the run in RUN_DIR after its last checkpoint, with the options it was started with")
    parser.add_argument("--init", metavar="MODEL", help="start from this model's weights (a .bin or an lnn-train "
                        "checkpoint of the same layers) instead of a random initialization: fine-tuning")
    parser.add_argument("--seed", type=int, help="seed of weights, shuffling and dropout (training.seed)")
    parser.add_argument("--patience", type=int,
                        help="stop after this many epochs without a better validation accuracy (for mnist:, "
                             "measured on the test set)")
    parser.add_argument("--limit-train", type=int, metavar="N", help="train on the first N training images only")
    parser.add_argument("--quiet", action="store_true", help="no progress bar (one line per epoch stays)")
    parser.add_argument("--val-fraction", type=float,
                        help=f"folder, csv: share of each class kept for validation (default {DEFAULT_VAL_FRACTION})")
    parser.add_argument("--target", metavar="COLUMN", help="csv: the column holding the class")
    parser.add_argument("--no-augment", action="store_true", default=None,
                        help="folder: train on the photos as they are")
    parser.add_argument("--outliers", metavar="DIR",
                        help="folder: outlier exposure with the fit part of these non-leaf photos (training.outliers)")
    return parser


def load_data(spec: str, description: dict, args):
    """`mnist:FOLDER` -> (train, test, description with MNIST's labels);
    `folder:DIR` -> (train, validation, description with the class folders as labels);
    `ucr:DIR` -> (train, None, description completed from the data: lnn.train.series);
    `csv:FILE` (with --target) -> (train, validation, the completed description)."""
    kind, sep, path = spec.partition(":")
    if not sep or not path or kind not in DATA_KINDS:
        raise LnnInputError(f"--data must look like KIND:PATH with KIND one of {', '.join(DATA_KINDS)}, not {spec!r}")
    if kind == "folder":
        from lnn.train.images import check_split, folder_datasets

        check_split(args.val_fraction, DEFAULT_SPLIT_SEED)          # before decoding anything

        return folder_datasets(path, description, augment=not args.no_augment, val_fraction=args.val_fraction,
                               progress=not args.quiet, outliers=args.outliers)
    if args.outliers:
        raise LnnInputError("--outliers needs --data folder:DIR (outlier exposure trains an image-folder model)")
    if kind != "csv" and args.target:
        raise LnnInputError("--target COLUMN goes with --data csv:FILE")
    if kind == "ucr":
        from lnn.train.series import ucr_datasets

        return ucr_datasets(path, description)
    if kind == "csv":
        from lnn.train.series import csv_datasets

        return csv_datasets(path, args.target, description, args.val_fraction, DEFAULT_SPLIT_SEED)
    from lnn.train.data import load_mnist

    train, test = load_mnist(path)
    return train, test, mnist_description(description)


def mnist_description(description: dict) -> dict:
    """MNIST's labels ("0".."9", shown as "digit 0"...) unless the description names its own."""
    description = copy.deepcopy(description)
    description.setdefault("labels", [{"name": str(i), "display": f"digit {i}"} for i in range(10)])
    return description


def cpu_blas_threads(device: str, threads: int):
    """On the CPU, NumPy's BLAS limited to `threads` for the run (threadpoolctl); on the GPU nothing."""
    import contextlib

    if device == "cuda":
        return contextlib.nullcontext()
    from threadpoolctl import threadpool_limits

    return threadpool_limits(limits=threads, user_api="blas")


def initial_weights_from(path: str) -> dict:
    """--init: the float32 weights of a .bin or of an lnn-train checkpoint (set_weights checks names and shapes)."""
    from lnn.formats.binfile import read_bin

    if is_bin_file(path):
        return read_bin(path).weights_fp32()
    if is_npz_file(path):
        return read_checkpoint_source(path)[1]
    raise LnnInputError(f"--init {path}: neither a .bin nor an lnn-train checkpoint")


def option_words(name: str, value) -> str:
    """An option as typed: "--epochs 5", "--no-augment"."""
    flag = "--" + name.replace("_", "-")
    return flag if value is True else f"{flag} {value}"


def data_with_absolute_path(spec: str) -> str:
    """KIND:PATH with PATH absolute (run.json's --data: the same data from another working folder)."""
    kind, sep, path = spec.partition(":")
    return f"{kind}:{Path(path).resolve()}" if sep and path and kind in DATA_KINDS else spec


def run_options(args) -> dict:
    """The run's options (RUN_OPTIONS) from this command; with --resume in a folder holding a run, those it was
    started with: one left out is taken from there, one given again must say the same (one LnnInputError line
    naming it). Sets them on args."""
    from lnn.train.run import OPTIONS, saved_options

    given = {name: getattr(args, name) for name in RUN_OPTIONS}
    given["data"] = data_with_absolute_path(args.data)
    if args.outliers:
        given["outliers"] = str(Path(args.outliers).resolve())
    saved = saved_options(args.out) if args.resume else None
    if saved == {}:
        print(f"{args.out} has no {OPTIONS} (its run was started by an lnn-train that did not keep its options): "
              f"resuming with the options given now", flush=True)
    if saved:
        for name, value in given.items():
            if value is None or value == saved.get(name):
                continue
            was = "without it" if saved.get(name) in (None, False) else f"with {option_words(name, saved[name])}"
            raise LnnInputError(f"{option_words(name, value)}: the run in {args.out} was started {was}, and --resume "
                                f"continues it as it was ({Path(args.out) / OPTIONS}); leave the option out, "
                                f"or start a new run in another --out folder")
        given = {name: saved.get(name) if value is None else value for name, value in given.items()}
    given["val_fraction"] = DEFAULT_VAL_FRACTION if given["val_fraction"] is None else given["val_fraction"]
    given["no_augment"], given["tf32"] = bool(given["no_augment"]), bool(given["tf32"])
    for name, value in given.items():
        setattr(args, name, value)
    if saved:
        taken = [option_words(name, value) for name, value in given.items()
                 if value not in (None, False) and name != "data"]
        print(f"resuming with the run's options: {' '.join(taken) or 'none beyond --data'}", flush=True)
    return given


def stop_as_interrupted(signum, frame):
    """SIGTERM (`kill`, a job scheduler's time limit, a shutdown) stops training as Ctrl-C does: the run says what
    its folder keeps and how to continue it, and exits with 130, where it ended without a word."""
    raise KeyboardInterrupt


def _positive(name, value):
    if value is not None and value < 1:
        raise LnnError(f"{name} must be at least 1, not {value}")


def body(args) -> int:
    for name in ("epochs", "batch", "patience", "limit_train", "threads"):
        _positive(f"--{name.replace('_', '-')}", getattr(args, name))
    if args.seed is not None and args.seed < 0:
        raise LnnError(f"--seed must be non-negative, not {args.seed}")
    options = run_options(args)
    resumed = args.resume and (Path(args.out) / CHECKPOINT).exists()
    init = None if resumed else args.init                # a resumed run goes on from its own checkpoint
    refuse_writing_over_inputs([Path(args.out) / name for name in RUN_FILES],
                               [args.model, init, args.data.partition(":")[2], args.outliers])
    description = load_description(args.model)
    if args.lr_schedule:
        description = copy.deepcopy(description)
        training = dict(description.get("training") or {})
        training["lr_schedule"] = {"type": args.lr_schedule}
        description["training"] = training
    train, test, description = load_data(args.data, description, args)
    try:
        model = parse_model(description)
    except ModelSpecError as err:
        raise ModelSpecError(f"{args.model}: {err}") from None
    if tuple(train.sample_shape) != tuple(model.input_shape):
        raise LnnInputError(f"{args.model}: the model takes inputs of shape {list(model.input_shape)} but the "
                            f"{args.data} images are {list(train.sample_shape)}")

    from lnn.train.config import TrainingConfig
    from lnn.train.trainer import Trainer

    train = train.limit(args.limit_train)
    batch = args.batch or TrainingConfig.parse(model.extra.get("training")).batch_size
    if batch > len(train):
        print(f"batch {batch:,} is more than the {len(train):,} training rows: training with batch {len(train):,}",
              flush=True)
        batch = len(train)
    trainer = Trainer(model, device=args.device, seed=args.seed, batch_size=batch, lr=args.lr, amp=args.amp, tf32=args.tf32,
                      cuda_graph="auto" if args.cuda_graph is None else args.cuda_graph,
                      outliers=args.outliers is not None)
    if init:
        trainer.set_weights(initial_weights_from(init))
    memory = trainer.plan.memory_report()
    print(f"{model.name}: {model.num_params:,} parameters on {trainer.device}"
          f"{f' (amp {trainer.amp})' if trainer.amp else ''}{' (tf32)' if trainer.tf32 else ''}{', cuda graph' if trainer.graph_mode else ''}, batch {trainer.plan.batch_size}"
          f" x {trainer.config.accumulate} accumulated; plan memory {human_bytes(memory['peak'])} "
          f"(activations pooled {human_bytes(memory['activations_pooled'])}, naive "
          f"{human_bytes(memory['activations_naive'])})", flush=True)
    signal.signal(signal.SIGTERM, stop_as_interrupted)
    with cpu_blas_threads(trainer.device, args.threads):
        trainer.fit(train, test, epochs=args.epochs, out_dir=args.out, resume=args.resume,
                    patience=args.patience, progress=not args.quiet, options=options)
    held = trainer.memory_held()
    if held is not None:
        graphs = trainer.graph_pool_bytes()
        print(f"GPU memory: planned {human_bytes(memory['peak'])}, measured {human_bytes(held)} held by CuPy's "
              f"pools after training ({human_bytes(graphs)} of it the captured steps' temporaries; also the data "
              f"kept on the GPU)", flush=True)
    return 0


def main(argv=None) -> int:
    return run_command(build_parser(), body, argv)


if __name__ == "__main__":
    raise SystemExit(main())
