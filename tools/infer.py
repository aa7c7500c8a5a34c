"""lnn-infer: classify image files (or every image in a folder) with a .bin model.

    lnn-infer leaf.jpg                         # the bundled tomato-leaf model
    lnn-infer --model mnist_cnn.bin --top-k 5 --json digits/

Each image gets the best label's display name and confidence, then the top-k, and advice for a
diagnosis. An answer that is not a diagnosis is "uncertain", with a reason and what to do instead
(lnn.runtime.gate): the model's photo checks (too_small, too_dark, too_bright, blurred), its
out-of-distribution gate (not_a_leaf: "This does not look like a tomato leaf. Take a photo of one
leaf, filling the frame."), or a best confidence under thresholds.uncertain_below (low_confidence).
--json adds "reason" (null for a diagnosis) and "instruction"; --csv a reason column. A bad file (missing,
not an image, truncated) is reported on stderr as one line and skipped; the exit status is 1 at
the end if any image failed. --json prints one JSON object per image, one per line (JSON Lines);
--csv prints one row per image and rank.

Device "auto" picks by the number of images: up to 8 run on the NumPy backend, which starts at
once; more run on the Numba backend ("cpu"), whose one-off JIT compile (cached per user) pays back
over a batch of images, 32 at a time.
"""

from __future__ import annotations

import csv
import json
import sys
from pathlib import Path

import numpy as np

import lnn
from lnn.formats.errors import LnnInputError
from lnn.runtime.gate import DEFAULT_SUBJECT, INSTRUCTIONS, instruction
from lnn.tools.cli import command_parser, error_line, run_command

PROG = "lnn-infer"
DEFAULT_MODEL = Path(lnn.__file__).resolve().parent / "models" / "tomato_leaf.bin"
IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".bmp", ".tif", ".tiff", ".webp")
FEW_IMAGES = 8            # device auto: up to this many images use NumPy (no JIT compile to pay)
BATCH_SIZE = 32           # images per backend call
PROGRESS_FROM = 33        # show a progress bar (on a terminal) from this many images on
CLEARER_PHOTO = INSTRUCTIONS["low_confidence"]
CSV_COLUMNS = ("file", "rank", "label", "display", "probability", "uncertain", "reason")


def build_parser():
    parser = command_parser(PROG, __doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1])
    parser.add_argument("inputs", nargs="+", metavar="IMAGE|DIR", help="image files, or folders of images")
    parser.add_argument("--model", metavar="M.bin", help="the model file (default: the bundled models/tomato_leaf.bin)")
    parser.add_argument("--top-k", type=int, default=3, metavar="K", help="how many labels to list per image (default 3)")
    formats = parser.add_mutually_exclusive_group()
    formats.add_argument("--json", action="store_true", help="one JSON object per image (JSON Lines)")
    formats.add_argument("--csv", action="store_true", help="CSV: one row per image and rank")
    parser.add_argument("--device", choices=("auto", "cpu", "numpy", "cuda"), default="auto",
                        help="backend: auto (NumPy for up to 8 images, else Numba), cpu (Numba), numpy, cuda")
    parser.add_argument("--threads", type=int, metavar="N",
                        help="threads for the Numba backend (device cpu); the NumPy backend keeps BLAS's default")
    return parser


def choose_device(requested: str, image_count: int) -> str:
    """The device policy: a few images run on NumPy, so one photo never waits for Numba's JIT compile."""
    from lnn.runtime import resolve_device

    if requested == "auto" and image_count <= FEW_IMAGES:
        return "numpy"
    return resolve_device(requested)


def images_in_folder(folder: Path) -> list:
    """The folder's image files (by suffix), sorted by name; sub-folders are not searched."""
    return sorted(p for p in folder.iterdir() if p.is_file() and p.suffix.lower() in IMAGE_SUFFIXES)


def expand_inputs(inputs: list) -> tuple[list, int]:
    """Folders become their image files (sorted by name); other paths pass through to be read.

    Returns (paths, failures): a folder with no images is reported here and counts as a failure."""
    paths, failures = [], 0
    for given in inputs:
        path = Path(given)
        if path.is_dir():
            found = images_in_folder(path)
            if not found:
                error_line(PROG, f"{path}: the folder holds no image files ({', '.join(IMAGE_SUFFIXES)})")
                failures += 1
            paths.extend(found)
        else:
            paths.append(path)
    return paths, failures


class Answer:
    """One image's result: the labels ranked best first, and whether (and why) it is not a diagnosis.

    `reason` comes from the Session's decision (photo checks, the out-of-distribution gate, the
    confidence threshold: lnn.runtime.gate); without one, an answer whose confidence is under
    `uncertain_below` is "low_confidence", as before the gate existed. `instruction` is what to do instead."""

    def __init__(self, path: Path, probabilities: np.ndarray, labels: list, top_k: int, uncertain_below,
                 reason: str | None = None, instruction: str | None = None):
        order = np.argsort(-probabilities, kind="stable")[:top_k]
        self.file = str(path)
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
        return (f"{self.instruction} (The model's best guess would be {self.best['display']} at "
                f"{self.confidence:.0%}: not a diagnosis.)")

    def as_dict(self) -> dict:
        out = {"file": self.file, "label": self.best["name"], "display": self.best["display"],
               "confidence": self.confidence, "uncertain": self.uncertain, "reason": self.reason,
               "top_k": [{"label": label["name"], "display": label["display"], "probability": p}
                         for label, p in self.ranked]}
        if self.uncertain:
            out["instruction"] = self.instruction
        elif "advice" in self.best:
            out["advice"] = self.best["advice"]
        return out

    def human_lines(self) -> list:
        if self.reason == "low_confidence":
            threshold = f", under the model's {self.uncertain_below:.0%} threshold" if self.uncertain_below else ""
            lines = [f"{self.file}: uncertain (best guess {self.best['display']} at {self.confidence:.1%}{threshold})",
                     f"  {self.instruction}"]
        elif self.uncertain:
            lines = [f"{self.file}: uncertain ({self.reason.replace('_', ' ')}): {self.instruction}",
                     "  not a diagnosis; the model's best guesses would be:"]
        else:
            lines = [f"{self.file}: {self.best['display']} ({self.confidence:.1%})"]
        width = max(len(label["display"]) for label, _ in self.ranked)
        lines += [f"  {rank}. {label['display']:<{width}}  {p:6.1%}" for rank, (label, p) in enumerate(self.ranked, 1)]
        if "advice" in self.best and not self.uncertain:
            lines.append(f"  advice: {self.best['advice']}")
        return lines

    def csv_rows(self) -> list:
        return [(self.file, rank, label["name"], label["display"], f"{p:.6f}", int(self.uncertain), self.reason or "")
                for rank, (label, p) in enumerate(self.ranked, 1)]


def answers_for(session, prepared: list, top_k: int) -> list:
    """Answers for [(path, model input, photo check or None)]: one batch through the Session's decision."""
    checks = [check for _, _, check in prepared]
    judgement = session.judge(np.stack([x for _, x, _ in prepared]),
                              [check.reason if check is not None else None for check in checks])
    uncertain_below = session.judge_rules.uncertain_below
    answers = []
    for (path, _, check), row, reason in zip(prepared, judgement.probabilities, judgement.reasons):
        detail = check.detail if check is not None and reason == check.reason else None
        words = instruction(reason, session.judge_rules.subject, detail)
        answers.append(Answer(path, row, session.labels, top_k, uncertain_below, reason, words))
    return answers


class Output:
    """Writes answers in the chosen format; goes through tqdm when a progress bar is on screen."""

    def __init__(self, style: str, progress_bar=None):
        self.style = style
        self.bar = progress_bar
        if style == "csv":
            self.csv = csv.writer(sys.stdout, lineterminator="\n")
            self.csv.writerow(CSV_COLUMNS)

    def answer(self, answer: Answer) -> None:
        if self.style == "csv":
            self.csv.writerows(answer.csv_rows())
            return
        text = (json.dumps(answer.as_dict(), ensure_ascii=False) if self.style == "json"
                else "\n".join(answer.human_lines()))
        if self.bar is not None:
            self.bar.write(text, file=sys.stdout)
        else:
            print(text, flush=True)

    def failure(self, message: str) -> None:
        if self.bar is not None:
            self.bar.write(f"{PROG}: error: {' '.join(message.split())}", file=sys.stderr)
        else:
            error_line(PROG, message)


def progress_bar(total: int):
    """A tqdm bar for many images, shown only when stderr is a terminal (tqdm's disable=None)."""
    if total < PROGRESS_FROM:
        return None
    from tqdm import tqdm

    return tqdm(total=total, unit="img", disable=None, file=sys.stderr)


def load_session(model: str | None, device: str, threads: int | None):
    if model is None:
        if not DEFAULT_MODEL.exists():
            raise LnnInputError(f"no bundled default model found ({DEFAULT_MODEL}); pass --model M.bin")
        model = DEFAULT_MODEL
    backend_options = {"threads": threads} if threads is not None and device == "cpu" else {}
    session = lnn.load(model, device=device, **backend_options)      # an unavailable backend is one LnnError
    if session.model.preprocess is None:
        raise LnnInputError(f"{model}: model {session.model.name!r} takes no images "
                            f"(input shape {list(session.input_shape)})")
    return session


def infer(args) -> int:
    if args.top_k < 1:
        raise LnnInputError(f"--top-k must be at least 1, not {args.top_k}")
    if args.threads is not None and args.threads < 1:
        raise LnnInputError(f"--threads must be at least 1, not {args.threads}")
    paths, failures = expand_inputs(args.inputs)
    if not paths:
        return 1
    session = load_session(args.model, choose_device(args.device, len(paths)), args.threads)
    top_k = min(args.top_k, len(session.labels))

    bar = progress_bar(len(paths))
    output = Output("json" if args.json else "csv" if args.csv else "human", bar)
    try:
        for start in range(0, len(paths), BATCH_SIZE):
            prepared = []
            for path in paths[start:start + BATCH_SIZE]:
                try:
                    prepared.append((path, *session.prepare_and_check(path)))
                except LnnInputError as err:
                    output.failure(str(err))
                    failures += 1
                if bar is not None:
                    bar.update(1)
            if prepared:
                for answer in answers_for(session, prepared, top_k):
                    output.answer(answer)
    finally:
        if bar is not None:
            bar.close()
    return 1 if failures else 0


def main(argv=None) -> int:
    return run_command(build_parser(), infer, argv)


if __name__ == "__main__":
    sys.exit(main())
