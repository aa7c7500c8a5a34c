"""What every lnn command shares: its argument parser, its single error path and number formatting.

Each command is `main(argv=None) -> int` built as

    parser = command_parser("lnn-infer", "Classify images ...")
    ...
    return run_command(parser, body, argv)      # body(args) -> int

Errors reach a person as ONE line on stderr, `lnn-<cmd>: error: <message>`, never a traceback:
    usage errors (argparse)                -> exit 2
    LnnError (bad model, weights, image)   -> exit 1
    OSError (cannot read or write a file)  -> exit 1
    MemoryError                            -> exit 1 ("out of memory ...: give it less at once")
    Ctrl-C                                 -> exit 130, quietly
    a closed output pipe (`... | head`)    -> exit 1, quietly
This module imports only the standard library and lnn's errors, so `--help` stays cheap.
"""

from __future__ import annotations

import argparse
import os
import stat
import sys
from pathlib import Path

from lnn.formats.errors import LnnError, LnnInputError, ModelSpecError, one_line
from lnn.version import __version__

EXIT_OK, EXIT_BAD_INPUT, EXIT_USAGE, EXIT_INTERRUPTED = 0, 1, 2, 130


class CommandParser(argparse.ArgumentParser):
    """argparse, but a usage error is one line (argparse prints the usage block before it)."""

    def error(self, message: str):
        self.exit(EXIT_USAGE, error_text(self.prog, f"{message} (see {self.prog} --help)") + "\n")


def command_parser(prog: str, description: str, epilog: str | None = None) -> CommandParser:
    parser = CommandParser(prog=prog, description=description, epilog=epilog,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"%(prog)s (lnn) {__version__}")
    return parser


def error_text(prog: str, message) -> str:
    """The one error line every command prints: `prog: error: message`, one line whatever the message held."""
    return f"{prog}: error: {one_line(message)}"


def error_line(prog: str, message) -> None:
    """Print one error line to stderr (also used for a single bad file in batch mode)."""
    print(error_text(prog, message), file=sys.stderr, flush=True)


def run_command(parser: CommandParser, body, argv=None) -> int:
    """Parse `argv` and run `body(args)`, turning every expected failure into one line and an exit code."""
    prog = parser.prog
    try:
        args = parser.parse_args(argv)
        return body(args)
    except LnnError as err:
        error_line(prog, str(err))
        return EXIT_BAD_INPUT
    except BrokenPipeError:                           # the reader went away (`lnn-infer ... | head`): stop quietly
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())   # so the exit flush cannot fail again
        return EXIT_BAD_INPUT
    except OSError as err:                            # e.g. the output folder does not exist, a full disk
        where = f"{err.filename}: " if err.filename else ""
        error_line(prog, f"{where}{err.strerror or err}")
        return EXIT_BAD_INPUT
    except MemoryError as err:                        # what no limit foresaw: still one line
        detail = f" ({err})" if str(err) else ""
        error_line(prog, f"out of memory{detail}: give it less at once (a smaller --batch, fewer or smaller inputs)")
        return EXIT_BAD_INPUT
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return EXIT_INTERRUPTED


def is_regular_file(path: str | Path) -> bool:
    """Not a folder, device, pipe or socket: a file that can be opened without waiting (False when missing)."""
    try:
        return stat.S_ISREG(os.stat(path).st_mode)
    except OSError:
        return False


def is_bin_file(path: str | Path) -> bool:
    """True when the file starts with the `.bin` magic bytes (a missing file is judged by its suffix; a
    pipe or device is never opened here: the reader that follows refuses it in one line)."""
    from lnn.formats.binfile import MAGIC

    if not is_regular_file(path):
        return Path(path).suffix.lower() == ".bin" and not os.path.exists(path)
    try:
        with open(path, "rb") as f:
            return f.read(len(MAGIC)) == MAGIC
    except OSError:
        return Path(path).suffix.lower() == ".bin"


def is_npz_file(path: str | Path) -> bool:
    """True when the file is a zip archive: a NumPy .npz of weights or an lnn-train checkpoint."""
    from lnn.formats.npz import NPZ_MAGIC

    if not is_regular_file(path):
        return False
    try:
        with open(path, "rb") as f:
            return f.read(len(NPZ_MAGIC)) == NPZ_MAGIC
    except OSError:
        return False


def read_checkpoint_source(path: str | Path):
    """An lnn-train checkpoint (.npz) -> (Model, weights, state); a plain weights .npz is refused in one line."""
    import zipfile

    from lnn.formats.npz import CHECKPOINT_META

    try:
        with zipfile.ZipFile(path) as archive:
            is_checkpoint = CHECKPOINT_META in archive.namelist()
    except zipfile.BadZipFile:
        is_checkpoint = True                    # damaged: load_checkpoint names the problem
    if not is_checkpoint:
        raise LnnInputError(f"{path}: a NumPy .npz of weights, not a model; give the model's JSON description "
                            f"and this file with --weights (or a .bin, or a checkpoint written by lnn-train)")
    from lnn.train.checkpoint import load_checkpoint   # only here: the training package is not needed otherwise

    return load_checkpoint(path)


def read_model_source(path: str | Path):
    """A JSON description, a `.bin` or an lnn-train checkpoint, told apart by content -> (Model, BinModel or None)."""
    from lnn.formats.binfile import read_bin
    from lnn.formats.model import load_description, parse_model

    if is_bin_file(path):
        bin_model = read_bin(path)
        return bin_model.model, bin_model
    if is_npz_file(path):
        model, _weights, _state = read_checkpoint_source(path)
        return model, None
    description = load_description(path)            # its errors already name the file
    try:
        return parse_model(description), None
    except ModelSpecError as err:
        raise ModelSpecError(f"{path}: {err}") from None


# --------------------------------------------------------------------------- number formatting

def human_bytes(n: float) -> str:
    """1536 -> '1.5 KiB' (binary units; bytes below 1 KiB as is)."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024


def human_flops(n: float) -> str:
    """8482304 -> '8.48 MFLOPs' (decimal units)."""
    for unit in ("", "K", "M", "G", "T"):
        if abs(n) < 1000 or unit == "T":
            return f"{n:.0f} FLOPs" if unit == "" else f"{n:.2f} {unit}FLOPs"
        n /= 1000
