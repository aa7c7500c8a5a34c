"""lnn-infer: classify image files (or every image in a folder), series or table rows with a .bin model.

    lnn-infer leaf.jpg                         # the bundled tomato-leaf model
    lnn-infer --model mnist_cnn.bin --top-k 5 --json digits/
    lnn-infer --model series.bin readings.ts   # one line per series (.ts, .tsv, .arff)
    lnn-infer --model table.bin --json rows.csv   # one line per row of a CSV table

Series and table models take raw values: the model's own preprocessing (resampling to its length,
the normalisation fitted on its training data) is applied (lnn.runtime.series). Each series or row
gets one line: the file and row, the best class and its confidence, the top-k; --json one object
per row with "row". A CSV table needs the model's columns by name (others, such as the class, are
left unread). A file that cannot be read is one error line, and the other files are still answered.

Each image gets the best label's display name and confidence, then the top-k, and advice for a
diagnosis. An answer that is not a diagnosis is "uncertain", with a reason and what to do instead
(lnn.runtime.gate): the model's photo checks (too_small, too_dark, too_bright, blurred), its
out-of-distribution gate (not_a_leaf: "This does not look like a tomato leaf. Take a photo of one
leaf, filling the frame."), or a best confidence under thresholds.uncertain_below (low_confidence).
--json adds "reason" (null for a diagnosis) and "instruction"; --csv a reason column. A bad file
(missing, not an image, truncated, too large, a model output that is not a number) is reported on
stderr as one line and gets an error row in --json / --csv; the other images are still answered,
and the exit status is 1 at the end if any failed. --json prints one JSON object per image, one per
line (JSON Lines; {"file": ..., "error": ...} for a failed one); --csv prints one row per image and
rank (one with the error for a failed image). Remarks on an answer (a grey photo given to a colour
model) are its "notes". --recursive also answers the images in sub-folders.

Device "auto" picks by the number of images: up to 8 run on the NumPy backend, which starts at
once; more run on the Numba backend ("cpu"), whose one-off JIT compile (cached per user) pays back
over a batch of images, 32 at a time.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import numpy as np

import lnn
from lnn.formats.errors import LnnError, LnnInputError, escaped, one_line
from lnn.runtime.gate import DEFAULT_SUBJECT, INSTRUCTIONS, instruction
from lnn.runtime.preprocess import PHOTO_SUFFIXES, UNREADABLE_PHOTO_SUFFIXES
from lnn.runtime.series import SERIES_SUFFIXES, TABLE_SUFFIXES
from lnn.tools.cli import command_parser, error_text, run_command

PROG = "lnn-infer"
DEFAULT_MODEL = Path(lnn.__file__).resolve().parent / "models" / "tomato_leaf.bin"
# What lnn-infer and lnn-field take from a folder: the photos lnn reads, and those it cannot (an iPhone's HEIC), so that
# each of these gets its line saying what to do rather than being skipped unseen
IMAGE_SUFFIXES = PHOTO_SUFFIXES + UNREADABLE_PHOTO_SUFFIXES
RUNTIME_KEYS = ("device", "threads")        # --json records add these to the answer (lnn-serve's answers do not)
DATA_SUFFIXES = SERIES_SUFFIXES + TABLE_SUFFIXES          # series files and tables (lnn.runtime.series)
ROWS_PER_CALL = 256       # series or table rows per backend call
UNSURE_ROW = "The model is not confident about this row; check it another way."
FEW_IMAGES = 8            # device auto: up to this many images use NumPy (no JIT compile to pay)
BATCH_SIZE = 32           # images per backend call
PROGRESS_FROM = 33        # show a progress bar (on a terminal) from this many images on
CLEARER_PHOTO = INSTRUCTIONS["low_confidence"]
CSV_COLUMNS = ("file", "rank", "label", "display", "probability", "uncertain", "reason", "notes", "error")
NOT_A_NUMBER = "the model's output for this image is not a number (NaN or infinity): its weights may be damaged"


def build_parser(prog: str = PROG):
    parser = command_parser(prog, __doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1])
    parser.add_argument("inputs", nargs="+", metavar="IMAGE|DIR", help="image files, or folders of images")
    parser.add_argument("--recursive", "-r", action="store_true",
                        help="for a folder, also the images in its sub-folders (sorted by path)")
    parser.add_argument("--model", metavar="M.bin", help="the model file (default: the bundled models/tomato_leaf.bin)")
    parser.add_argument("--top-k", type=int, default=3, metavar="K", help="how many labels to list per image (default 3)")
    formats = parser.add_mutually_exclusive_group()
    formats.add_argument("--json", action="store_true", help="one JSON object per image (JSON Lines)")
    formats.add_argument("--csv", action="store_true", help="CSV: one row per image and rank")
    parser.add_argument("--device", choices=("auto", "cpu", "numpy", "cuda"), default="auto",
                        help="backend: auto (NumPy for up to 8 images, else Numba), cpu (Numba), numpy, cuda")
    parser.add_argument("--threads", default="auto", metavar="N|auto",
                        help="threads for the Numba backend (device cpu), one image's layers split over them; "
                             "default auto: the cores this process may use, one per physical core, big cores only. The NumPy backend keeps BLAS's default")
    parser.add_argument("--verbose", "-v", action="store_true",
                        help="say on stderr which backend and how many threads answer")
    parser.set_defaults(prog=prog)
    return parser


def threads_option(text) -> int | str:
    """--threads as the backend takes it: "auto", or a whole number of at least 1."""
    if text == "auto" or isinstance(text, int):
        return text
    if not str(text).isdecimal() or int(text) < 1:
        raise LnnInputError(f"--threads must be a whole number of at least 1, or auto; not {text!r}")
    from lnn.runtime import resolve_threads

    return resolve_threads(int(text))           # at most MAX_THREADS, on every device


def choose_device(requested: str, image_count: int) -> str:
    """The device policy: a few images run on NumPy, so one photo never waits for Numba's JIT compile."""
    from lnn.runtime import resolve_device

    if requested == "auto" and image_count <= FEW_IMAGES:
        return "numpy"
    return resolve_device(requested)


def is_image_name(path: Path) -> bool:
    return path.suffix.lower() in IMAGE_SUFFIXES


def images_in_folder(folder: Path, recursive: bool = False) -> list:
    """The folder's image files (by suffix; anything but a folder, so that a named pipe or a broken link
    is reported, not skipped), sorted by name; with recursive, those of every sub-folder too, sorted by path
    (links to folders are not followed)."""
    if not recursive:
        return sorted(p for p in folder.iterdir() if is_image_name(p) and not p.is_dir())
    found = []
    for top, folders, files in os.walk(folder):
        folders.sort()
        found += [Path(top) / name for name in files if is_image_name(Path(name))]
    return sorted(found, key=lambda path: path.relative_to(folder).parts)


def empty_folder_problem(folder: Path) -> str:
    """Why a folder gave no images, and what to do about it."""
    sub_folders = sorted(p.name for p in folder.iterdir() if p.is_dir())
    if sub_folders:
        shown = ", ".join(sub_folders[:3]) + (", ..." if len(sub_folders) > 3 else "")
        return (f"{folder}: the folder holds no image files, only {len(sub_folders)} sub-folder"
                f"{'s' if len(sub_folders) > 1 else ''} ({shown}); pass --recursive to answer the images in them")
    return f"{folder}: the folder holds no image files ({', '.join(IMAGE_SUFFIXES)})"


def expand_inputs(inputs: list, recursive: bool = False) -> tuple[list, list]:
    """Folders become their image files (sorted by name); other paths pass through to be read.

    Returns (paths, problems): problems are (folder, one-line message) for folders that gave no image."""
    paths, problems = [], []
    for given in inputs:
        path = Path(given)
        if path.is_dir():
            found = images_in_folder(path, recursive)
            if not found:
                problems.append((path, empty_folder_problem(path) if not recursive else
                                 f"{path}: the folder and its sub-folders hold no image files ({', '.join(IMAGE_SUFFIXES)})"))
            paths.extend(found)
        else:
            paths.append(path)
    return paths, problems


def failure_record(file, message: str) -> dict:
    """The record of an image that got no answer: what --json prints (and a server would return); the
    error is one line (errors.one_line), without the file name the message may start with (the record names the file)."""
    message, prefix = str(message), f"{file}: "
    return {"file": str(file), "error": one_line(message[len(prefix):] if message.startswith(prefix) else message)}


class Answer:
    """One image's result: the labels ranked best first, and whether (and why) it is not a diagnosis.

    `reason` comes from the Session's decision (photo checks, the out-of-distribution gate, the
    confidence threshold: lnn.runtime.gate); without one, an answer whose confidence is under
    `uncertain_below` is "low_confidence", as before the gate existed. `instruction` is what to do
    instead; `notes`, remarks on how the photo was read (a grey photo given to a colour model)."""

    def __init__(self, path: Path, probabilities: np.ndarray, labels: list, top_k: int, uncertain_below,
                 reason: str | None = None, instruction: str | None = None, notes: list | None = None):
        order = np.argsort(-probabilities, kind="stable")[:top_k]
        self.file = str(path)
        self.notes = list(notes or [])
        self.ranked = [(labels[i], float(probabilities[i])) for i in order]
        self.best, self.confidence = self.ranked[0]
        self.uncertain_below = uncertain_below
        if reason is None and uncertain_below is not None and self.confidence < uncertain_below:
            reason = "low_confidence"
        self.reason = reason
        self.uncertain = reason is not None
        self.instruction = instruction or (INSTRUCTIONS[reason].format(subject=DEFAULT_SUBJECT) if reason else None)

    @property
    def explanation(self) -> str:
        """For an answer that is not a diagnosis: what the model saw, then what to do."""
        if self.reason == "low_confidence":
            threshold = f", under the model's {self.uncertain_below:.0%} threshold" if self.uncertain_below else ""
            return f"Best guess {self.best['display']} at {self.confidence:.0%}{threshold}. {self.instruction}"
        return f"{self.instruction} No diagnosis is given for this photo."

    def as_dict(self) -> dict:
        out = {"file": self.file, "label": self.best["name"], "display": self.best["display"],
               "confidence": self.confidence, "uncertain": self.uncertain, "reason": self.reason,
               "top_k": [{"label": label["name"], "display": label["display"], "probability": p}
                         for label, p in self.ranked]}
        if self.uncertain:
            out["instruction"] = self.instruction
        elif "advice" in self.best:
            out["advice"] = self.best["advice"]
        out["notes"] = self.notes
        return out

    def human_lines(self) -> list:
        """The answer for people: its file named on the first line (a newline in the name escaped)."""
        name = escaped(self.file)
        if self.reason == "low_confidence":
            threshold = f", under the model's {self.uncertain_below:.0%} threshold" if self.uncertain_below else ""
            lines = [f"{name}: uncertain (best guess {self.best['display']} at {self.confidence:.1%}{threshold})",
                     f"  {self.instruction}"]
        elif self.uncertain:               # no ranking: a percentage beside a disease name reads as a diagnosis
            return [f"{name}: uncertain ({self.reason.replace('_', ' ')}): {self.instruction}",
                    "  not a diagnosis (--json still lists the model's scores)"] + [f"  note: {note}" for note in self.notes]
        else:
            lines = [f"{name}: {self.best['display']} ({self.confidence:.1%})"]
        width = max(len(label["display"]) for label, _ in self.ranked)
        lines += [f"  {rank}. {label['display']:<{width}}  {p:6.1%}" for rank, (label, p) in enumerate(self.ranked, 1)]
        if "advice" in self.best and not self.uncertain:
            lines.append(f"  advice: {self.best['advice']}")
        return lines + [f"  note: {note}" for note in self.notes]

    def csv_rows(self) -> list:
        return [(self.file, rank, label["name"], label["display"], f"{p:.6f}", int(self.uncertain), self.reason or "",
                 "; ".join(self.notes), "")
                for rank, (label, p) in enumerate(self.ranked, 1)]


class RowAnswer(Answer):
    """One series' or table row's answer: the file and its row (the N-th series of a .ts/.tsv/.arff file, the
    N-th row under a CSV table's header), on one line; --json adds "row"."""

    def __init__(self, path, row: int, probabilities: np.ndarray, labels: list, top_k: int, uncertain_below, reason):
        super().__init__(path, probabilities, labels, top_k, uncertain_below, reason, UNSURE_ROW if reason else None)
        self.row = row

    def as_dict(self) -> dict:
        record = super().as_dict()
        return {"file": record.pop("file"), "row": self.row, **record}

    def human_lines(self) -> list:
        ranked = ", ".join(f"{label['display']} {p:.1%}" for label, p in self.ranked)
        where = f"{escaped(self.file)} row {self.row}"
        if self.uncertain:
            threshold = f", under the model's {self.uncertain_below:.0%} threshold" if self.uncertain_below else ""
            return [f"{where}: uncertain (best guess {self.best['display']} at {self.confidence:.1%}{threshold}); "
                    f"top-{len(self.ranked)}: {ranked}"]
        return [f"{where}: {self.best['display']} ({self.confidence:.1%}); top-{len(self.ranked)}: {ranked}"]


def read_rows(session, path: Path):
    """A series file's series (list of [C, T_i]) or a CSV table's rows [N, F] in the model's column order."""
    from lnn.runtime.series import read_series_file, read_table

    table_model = len(session.input_shape) == 1
    if path.suffix.lower() not in (TABLE_SUFFIXES if table_model else SERIES_SUFFIXES):
        kind = f"a CSV table ({', '.join(TABLE_SUFFIXES)})" if table_model else f"series ({', '.join(SERIES_SUFFIXES)})"
        raise LnnInputError(f"{path}: model {session.model.name!r} takes {kind}{', not images' if is_image_name(path) else ''}")
    preprocess = session.model.preprocess
    if table_model:
        columns = (preprocess or {}).get("columns")
        return read_table(path, columns=columns, preprocess=preprocess if columns else None).values
    return read_series_file(path, preprocess).series


def infer_rows(args, output, bin_model, threads) -> int:
    """lnn-infer with a series or table model: one answer per series or row of its files, through
    Session.prepare_series (any other file is one error line). threads: --threads as threads_option resolved it."""
    if args.csv:
        raise LnnInputError("--csv is for images; series and table rows are answered as text or --json")
    session = load_session(bin_model, choose_device(args.device, 1), threads, images=False)
    top_k = min(args.top_k, len(session.labels))
    failures = 0
    for given in args.inputs:
        path = Path(given)
        try:
            rows = read_rows(session, path)
            for start in range(0, len(rows), ROWS_PER_CALL):
                with np.errstate(all="ignore"):
                    judgement = session.judge(session.prepare_series(rows[start:start + ROWS_PER_CALL]))
                for offset, (probabilities, reason) in enumerate(zip(judgement.probabilities, judgement.reasons)):
                    row = start + offset + 1
                    if not np.isfinite(probabilities).all():
                        output.failure(f"{path} row {row}", NOT_A_NUMBER.replace("image", "row"))
                        failures += 1
                        continue
                    output.answer(RowAnswer(path, row, probabilities, session.labels, top_k,
                                            session.judge_rules.uncertain_below, reason))
        except LnnError as err:
            output.failure(path, str(err) if str(err).startswith(str(path)) else f"{path}: {err}")
            failures += 1
    return 1 if failures else 0


def judge_images(session, images: list, checks: list) -> tuple:
    """(probabilities [N, K], reasons) for model inputs and their photo checks (None: not checked), as the
    Session decides: the photo checks, the gate, the confidence threshold."""
    with np.errstate(all="ignore"):              # a NaN or infinite output is that image's error (answer_for)
        judgement = session.judge(np.stack(images), [check.reason if check is not None else None for check in checks])
    return judgement.probabilities, judgement.reasons


def answer_for(session, path, probabilities: np.ndarray, reason, check, notes: list, top_k: int):
    """One image's Answer from the Session's decision on it, or, when the model's output for it is not
    a number, its one-line error (str). lnn-infer, lnn-field and lnn-serve all answer through here."""
    if not np.isfinite(probabilities).all():
        return f"{path}: {NOT_A_NUMBER}"
    detail = check.detail if check is not None and reason == check.reason else None
    words = instruction(reason, session.judge_rules.subject, detail)
    return Answer(path, probabilities, session.labels, top_k, session.judge_rules.uncertain_below, reason, words, notes)


def answers_for(session, prepared: list, top_k: int) -> list:
    """answer_for each of [(path, model input, photo check or None, notes)], judged as one batch."""
    if not prepared:
        return []
    probabilities, reasons = judge_images(session, [x for _, x, _, _ in prepared], [check for _, _, check, _ in prepared])
    return [answer_for(session, path, row, reason, check, notes, top_k)
            for (path, _, check, notes), row, reason in zip(prepared, probabilities, reasons)]


class Output:
    """Writes answers in the chosen format; goes through tqdm when a progress bar is on screen."""

    def __init__(self, style: str, progress_bar=None, prog: str = PROG):
        self.style = style
        self.bar = progress_bar
        self.prog = prog
        self.runtime = {}            # --json: the device and threads that answered (RUNTIME_KEYS), in every answer's record
        if style == "csv":
            import csv        # only for --csv: not on every start
            self.csv = csv.writer(sys.stdout, lineterminator="\n")
            self.csv.writerow(CSV_COLUMNS)

    def answer(self, answer: Answer) -> None:
        if self.style == "csv":
            self.csv.writerows(answer.csv_rows())
            return
        record = {**answer.as_dict(), **self.runtime} if self.style == "json" else None
        self._write(json_line(record) if record else "\n".join(answer.human_lines()), sys.stdout)

    def failure(self, file, message: str) -> None:
        """A file that got no answer: one line on stderr, and its row in --json / --csv."""
        record = failure_record(file, message)
        if self.style == "json":
            self._write(json_line(record), sys.stdout)
        elif self.style == "csv":
            self.csv.writerow([record["file"], *[""] * (len(CSV_COLUMNS) - 2), record["error"]])
        self._write(error_text(self.prog, f"{record['file']}: {record['error']}"), sys.stderr)

    def _write(self, text: str, stream) -> None:
        if self.bar is not None:
            self.bar.write(text, file=stream)
        else:
            print(text, file=stream, flush=True)


def json_line(record: dict) -> str:
    """One JSON Lines line; a NaN or infinity is an error here, never an invalid `NaN` in the output."""
    return json.dumps(record, ensure_ascii=False, allow_nan=False)


def progress_bar(total: int):
    """A tqdm bar for many images, shown only when stderr is a terminal (tqdm's disable=None)."""
    if total < PROGRESS_FROM:
        return None
    from tqdm import tqdm

    return tqdm(total=total, unit="img", disable=None, file=sys.stderr)


def read_model(model: str | None):
    """The model file (None: the bundled one), read and checked (a BinModel)."""
    from lnn.formats.binfile import read_bin

    if model is None:
        if not DEFAULT_MODEL.exists():
            raise LnnInputError(f"no bundled default model found ({DEFAULT_MODEL}); pass --model M.bin")
        model = DEFAULT_MODEL
    return read_bin(model)


def takes_rows(model) -> bool:
    """A series [C, T] or table [F] model: lnn-infer answers the rows of its data files, not photos."""
    return not model.takes_images and len(model.input_shape) in (1, 2)


def load_session(model, device: str, threads: int | str | None = "auto", images: bool = True):
    """A Session on `model`: a path (None: the bundled model) or the BinModel read_model gave; with `images`,
    a model that takes no images is refused."""
    from lnn.formats.binfile import BinModel
    from lnn.runtime import Session

    bin_model = model if isinstance(model, BinModel) else read_model(model)
    backend_options = {"threads": threads} if threads is not None and device == "cpu" else {}   # None: the default
    session = Session(bin_model, device=device, **backend_options)      # an unavailable backend is one LnnError
    if images and not session.model.takes_images:
        takes = {1: "table rows: pass .csv files", 2: "series: pass .ts, .tsv or .arff files"}
        raise LnnInputError(f"{bin_model.path}: model {session.model.name!r} takes no images (input shape "
                            f"{list(session.input_shape)}{'; it takes ' + takes[len(session.input_shape)] if len(session.input_shape) in takes else ''})")
    return session


def prepare_batch(session, batch: list, bar) -> tuple[dict, dict]:
    """Decode, check and preprocess a batch of files: ({index: (input, photo check, notes)}, {index: one-line error})."""
    images, errors = {}, {}
    for i, path in enumerate(batch):
        notes = []
        try:
            if path.suffix.lower() in DATA_SUFFIXES:
                raise LnnInputError(f"{path}: model {session.model.name!r} takes photos ({', '.join(PHOTO_SUFFIXES)}), "
                                    f"not series or table files")
            images[i] = (*session.prepare_and_check(path, notes=notes), notes)
        except LnnError as err:                   # the decoding errors name the file; say which for the others too
            errors[i] = str(err) if str(err).startswith(str(path)) else f"{path}: {err}"
        if bar is not None:
            bar.update(1)
    return images, errors


def infer(args) -> int:
    if args.top_k < 1:
        raise LnnInputError(f"--top-k must be at least 1, not {args.top_k}")
    threads = threads_option(args.threads)
    output = Output("json" if args.json else "csv" if args.csv else "human", prog=args.prog)
    bin_model = read_model(args.model)           # the model says what the inputs are: photos, or rows of data files
    if takes_rows(bin_model.model):
        return infer_rows(args, output, bin_model, threads)
    paths, problems = expand_inputs(args.inputs, args.recursive)
    for folder, message in problems:
        output.failure(folder, message)
    failures = len(problems)
    if not paths:
        return 1
    session = load_session(bin_model, choose_device(args.device, len(paths)), threads)
    top_k = min(args.top_k, len(session.labels))
    if args.verbose:
        print(f"{args.prog}: {session.describe_threads()}", file=sys.stderr, flush=True)
    output.runtime = dict(zip(RUNTIME_KEYS, (session.device, session.threads)))

    output.bar = bar = progress_bar(len(paths))
    try:
        for start in range(0, len(paths), BATCH_SIZE):
            batch = paths[start:start + BATCH_SIZE]
            images, errors = prepare_batch(session, batch, bar)
            answers = dict(zip(images, answers_for(session, [(batch[i], *images[i]) for i in images], top_k)))
            for i, path in enumerate(batch):                       # answers and failures in input order
                result = errors.get(i, answers.get(i))
                if isinstance(result, Answer):
                    output.answer(result)
                else:
                    output.failure(path, result)
                    failures += 1
    finally:
        if bar is not None:
            bar.close()
    return 1 if failures else 0


def main(argv=None, prog: str = PROG) -> int:
    """lnn-infer; lnn-field --cli runs it with its own program name, which every error line starts with."""
    return run_command(build_parser(prog), infer, argv)


if __name__ == "__main__":
    sys.exit(main())
