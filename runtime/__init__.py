"""Load a `.bin` model and run it: `lnn.load(path, device=...)` returns a Session.

Backends are found by name and imported only when asked for:
    "numpy" -> lnn.runtime.reference  (pure NumPy; the oracle and the fallback)
    "cpu"   -> lnn.runtime.cpu        (Numba kernels, compiled lazily, cached per user)
    "cuda"  -> lnn.runtime.cuda       (CuPy)
    "auto"  -> "cpu" when Numba is installed, else "numpy"
Backend options: `threads=N` or "auto" (the cpu backend's threads, by default "auto": the cores this
process may run on, one per physical core, big cores only: runtime/cores.py, `resolve_threads`; accepted
and ignored by numpy and cuda, so that code written for device="auto" runs on every install).
`Session.threads` says what was chosen (None where the backend ignores it). Unknown devices and options are
one LnnInputError line. A Session is safe to share between threads (see Session).
Importing this module imports neither CuPy, Numba, OpenCV nor the training side.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import inspect
from pathlib import Path

import numpy as np

from lnn.formats.binfile import BinModel, read_bin
from lnn.formats.errors import LnnError, LnnInputError
from lnn.formats.limits import MAX_THREADS
from lnn.runtime.cores import cores_in_words, usable_cores

BACKENDS = {"numpy": "lnn.runtime.reference", "cpu": "lnn.runtime.cpu", "cuda": "lnn.runtime.cuda"}


def resolve_device(device: str) -> str:
    if device == "auto":
        from lnn.runtime.cpu.aot import MODULE as COMPILED_KERNELS    # the packaged app's kernels, without Numba

        kernels = (importlib.util.find_spec(name) is not None for name in ("numba", COMPILED_KERNELS))
        return "cpu" if any(kernels) else "numpy"
    if device not in BACKENDS:
        raise LnnInputError(f"device must be one of auto, {', '.join(BACKENDS)}; not {device!r}")
    return device


THREADS_OF = {"numpy": "NumPy's BLAS picks its own", "cuda": "the GPU's"}
# A Session computes a batch in chunks of at most this many inputs per backend call: the cpu backend keeps each
# batch size's planned buffers for the next call, and the numpy backend's temporaries grow with the batch (for the
# bundled model about 1.4 and 6 MB an image), so one call of thousands would take gigabytes. On a CPU a larger
# batch costs no less an image (the bundled model, 1 thread, Zen 4: 1.62 ms at batch 1, 1.93 at 16); the GPU's
# kernels are fed larger ones.
RUN_CHUNK = {"numpy": 32, "cpu": 32, "cuda": 256}
# Session.judge and predict of an image model answer only inputs its preprocessing could have made (within each
# channel's range, preprocess.input_range, and this share of its width beyond either end): raw 0..255 pixels, or
# another normalisation, got a confident diagnosis (the bundled model, inputs x 1000: 100%, reason None).
PREPARED_MARGIN = 0.05
INSTALL_HINTS = {"cpu": "pip install numba", "cuda": "pip install 'lnn[cuda]' on a machine with an NVIDIA GPU"}


def backend_class(device: str):
    """The backend class for a device name; an unavailable backend is one LnnError saying why."""
    try:
        module = importlib.import_module(BACKENDS[device])
        backend = getattr(module, "BACKEND", None)      # resolved lazily: this is where CuPy / Numba import
    except ImportError as err:
        raise LnnError(f"the {device} backend cannot load ({err}); {INSTALL_HINTS.get(device, '')}") from None
    if backend is None:
        raise LnnError(f"the {device} backend is not part of this lnn version")
    return backend


def resolve_threads(threads) -> int:
    """A threads option as a count: "auto" (or None) is usable_cores(); anything but a positive whole
    number or "auto" is one LnnInputError line."""
    if threads is None or (isinstance(threads, str) and threads == "auto"):
        return usable_cores()
    if isinstance(threads, bool) or not isinstance(threads, (int, np.integer)) or threads < 1:
        raise LnnInputError(f"threads must be a positive whole number or 'auto', not {threads!r}")
    if threads > MAX_THREADS:
        raise LnnInputError(f"threads must be at most {MAX_THREADS} (formats/limits.py MAX_THREADS), not {threads}")
    return int(threads)


def check_backend_options(device: str, backend, options: dict) -> None:
    """One LnnInputError line for an option the backend does not take or a threads value that is not a count."""
    known = [name for name in list(inspect.signature(backend).parameters)[2:]     # after model, weights
             if name != "keep"]                                                # the Session's own
    unknown = sorted(set(options) - set(known))
    if unknown:
        raise LnnInputError(f"the {device} backend takes no option {unknown[0]!r}; "
                            f"its options: {', '.join(known) or 'none'}")
    if "threads" in options:
        resolve_threads(options["threads"])


def load(path, device: str = "auto", **options) -> "Session":
    """Load and validate a `.bin` (raises LnnFormatError when it is bad) and prepare a backend
    (options: Session's `features`, and the backend's own, such as the cpu backend's `threads`)."""
    return Session(read_bin(path), device, **options)


def warm_up_batch(input_shape: tuple, size: int) -> np.ndarray:
    """The inputs a warm-up runs (Session.warm_up, the cpu backend's warmup): `size` of random normal values, always
    the same ones."""
    return np.random.default_rng(0).standard_normal((size, *input_shape)).astype(np.float32)


class Session:
    """A loaded model on one backend. run() gives raw outputs, predict() (calibrated) probabilities,
    judge() the probabilities with a reason per photo, predict_image() one photo's Prediction.

    A Session is safe to share between threads: calls from several threads at once give exactly the
    answers each would get alone (the cpu and cuda backends keep their planned buffers per calling
    thread; tests/runtime/test_threads.py), and on the cpu backend they run in parallel."""

    def __init__(self, bin_model: BinModel, device: str = "auto", features: str | None = None, **backend_options):
        """features: a node whose output run_with_features() returns (default: the gate's feature node);
        for fitting a gate to a model that has none yet."""
        from lnn.runtime.gate import Judge
        from lnn.runtime.preprocess import input_range

        self.bin = bin_model
        self.model = bin_model.model
        self.metadata = bin_model.metadata
        self.labels = self.model.labels
        self.device = resolve_device(device)
        backend = backend_class(self.device)
        check_backend_options(self.device, backend, backend_options)
        self.judge_rules = Judge(self.model, self.metadata, bin_model.gate_tensors)
        self.feature = features or self.judge_rules.feature
        keep = (self.feature,) if self.feature else ()
        self.backend = backend(self.model, bin_model.weights_fp32(), keep=keep, **backend_options)
        self.threads = getattr(self.backend, "threads", None)    # the cpu backend's count; None: it has none
        self.threads_asked = backend_options.get("threads", "auto")
        # per channel, the lowest and highest input an image model's preprocessing makes (_check_prepared)
        self.prepared_range = input_range(self.model.preprocess) if self.model.takes_images else None

    def describe_threads(self) -> str:
        """The threads choice in words: 'cpu backend, 2 threads (auto: 2 usable cores)'."""
        if self.threads is None:
            return f"{self.device} backend (no thread count of its own: {THREADS_OF[self.device]})"
        how = f"auto: {cores_in_words()}" if self.threads_asked in (None, "auto") else "as asked"
        choice = getattr(self.backend, "split_choice", lambda: None)()
        return (f"{self.device} backend, {self.threads} thread{'s' if self.threads > 1 else ''} ({how})"
                + (f"; {choice}" if choice else ""))

    @property
    def input_shape(self) -> tuple:
        return self.model.input_shape

    def one_thread(self):
        """A context in which the calling thread's calls run on that thread alone (the cpu backend's one_thread;
        another backend has no threads of its own to leave out and runs as ever)."""
        return getattr(self.backend, "one_thread", contextlib.nullcontext)()

    def warm_up(self, size: int = 1) -> None:
        """Ready the calling thread's calls of `size` images (random inputs): the cpu backend compiles or loads its
        kernels, plans its buffers (for each chunk size such a call runs in: RUN_CHUNK), builds its helper program
        and makes its split choice (CpuBackend.warmup); another backend makes its first call."""
        if isinstance(size, bool) or not isinstance(size, (int, np.integer)) or size < 1:
            raise LnnInputError(f"warm_up takes a batch size of at least 1, not {size!r}")
        warmup = getattr(self.backend, "warmup", None)
        if warmup is None:
            self.run(warm_up_batch(self.input_shape, size))
            return
        chunk = RUN_CHUNK[self.device]
        for chunk_size in sorted({min(size, chunk), size % chunk} - {0}):
            warmup(chunk_size)

    def _as_batch(self, batch) -> np.ndarray:
        """The batch as contiguous float32, refused in one line unless it is [N, *input_shape] numbers."""
        try:
            batch = np.asarray(batch)
        except ValueError:                      # nested lists of different lengths
            raise LnnInputError("a batch must be one array of numbers; its rows here differ in length") from None
        if batch.shape[1:] != self.model.input_shape or batch.ndim != len(self.model.input_shape) + 1:
            raise LnnInputError(f"expected a batch of shape [N, {', '.join(map(str, self.model.input_shape))}], "
                                f"got {list(batch.shape)}")
        if batch.shape[0] == 0:
            raise LnnInputError("the batch is empty")
        if batch.dtype.kind not in "iuf":
            raise LnnInputError(f"a batch must hold numbers (float32, already preprocessed), not {batch.dtype}")
        with np.errstate(over="ignore"):
            return np.ascontiguousarray(batch, dtype=np.float32)

    def _extreme_axes(self, batch: np.ndarray, prepared: bool) -> tuple:
        """The axes over which the checks take each input's lowest and highest value: per channel where an image
        model's inputs must be ones its preprocessing makes (`prepared`: predict, judge), else the whole input."""
        return tuple(range(2 if prepared and self.prepared_range is not None else 1, batch.ndim))

    def _check_extremes(self, lowest: np.ndarray, highest: np.ndarray, prepared: bool) -> None:
        """Refused in one line unless every input is finite and, `prepared`, one the preprocessing could make, from
        each input's lowest and highest value over _extreme_axes ([N] or [N, C]; NaN propagates through min and
        max, and an infinity is a bound, so they show a non-finite value too)."""
        lowest, highest = lowest.reshape(len(lowest), -1), highest.reshape(len(highest), -1)
        finite = np.isfinite(lowest).all(axis=1) & np.isfinite(highest).all(axis=1)
        if not finite.all():                    # (the backends differ on NaN: the cpu kernels' ReLU makes it 0)
            raise LnnInputError(f"input {int(np.flatnonzero(~finite)[0])} of the batch holds NaN or infinity "
                                f"(or a value beyond float32's range)")
        if prepared and self.prepared_range is not None:
            self._check_prepared(lowest, highest)

    def _run_in_chunks(self, batch, with_features: bool, prepared: bool = False) -> tuple:
        """(outputs, the gate's features or None) for a batch (_as_batch), checked (_check_extremes) and computed
        RUN_CHUNK inputs at a time; copies (the backends return their buffers, which the next call overwrites).
        A backend that measures chunks this large on its device (cuda, from DEVICE_EXTREMES_FROM_BYTES on:
        measures_on_device) takes each chunk's extremes where its input is, after the upload (run_measured), and
        the batch is checked once all have run (why: docs/ARCHITECTURE.md, Session's checks); any other batch's
        are taken here, before anything runs."""
        axes = self._extreme_axes(batch, prepared)
        chunk = RUN_CHUNK[self.device]
        measures_on_device = getattr(self.backend, "measures_on_device", None)
        on_device = measures_on_device is not None and measures_on_device(batch[:chunk])
        if not on_device:
            self._check_extremes(batch.min(axis=axes), batch.max(axis=axes), prepared)
        parts, measured = [], []
        for start in range(0, len(batch), chunk):
            part = batch[start:start + chunk]
            if on_device:
                outputs, kept, extremes = self.backend.run_measured(part, axes)
                measured.append(extremes)
            elif with_features:
                outputs, kept = self.backend.run_with_features(part)
            else:
                outputs = self.backend.run(part)
            parts.append((np.array(outputs, copy=True),
                          np.array(kept[self.feature], copy=True) if with_features else None))
        if on_device:
            self._check_extremes(*(np.concatenate(values) for values in zip(*measured)), prepared)
        if len(parts) == 1:
            return parts[0]
        outputs, features = zip(*parts)
        return np.concatenate(outputs), (np.concatenate(features) if with_features else None)

    def run(self, batch) -> np.ndarray:
        """[N, *input_shape] float32 (already preprocessed) -> the last layer's outputs (e.g. logits). NaN or
        infinite inputs are one LnnInputError line."""
        return self._run_in_chunks(self._as_batch(batch), with_features=False)[0]

    def run_with_features(self, batch) -> tuple:
        """(the last layer's outputs, the gate's feature vectors [N, D] or None without a gate), both copies."""
        return self._run_in_chunks(self._as_batch(batch), with_features=self.feature is not None)

    @property
    def outputs_probabilities(self) -> bool:
        return self.judge_rules.outputs_probabilities

    def _check_prepared(self, lowest: np.ndarray, highest: np.ndarray) -> None:
        """An image model's batch, from its finite lowest and highest value per input and channel ([N, C]: see
        _check_extremes), refused in one line unless every input is one its preprocessing could make
        (PREPARED_MARGIN); run() and run_with_features() take any numbers."""
        low, high = self.prepared_range
        margin = PREPARED_MARGIN * (high - low)
        outside = (lowest < low - margin) | (highest > high + margin)
        if outside.any():
            n, c = (int(i) for i in np.argwhere(outside)[0])
            c_low, c_high = low[c % len(low)], high[c % len(high)]
            raise LnnInputError(f"input {n} is not a photo prepared for this model: its channel {c} runs from "
                                f"{lowest[n, c]:.4g} to {highest[n, c]:.4g}, while the model's preprocessing makes "
                                f"{c_low:.4g} to {c_high:.4g}; give photos to predict_image, or prepare_image them")

    def predict(self, batch) -> np.ndarray:
        """Class probabilities: a softmax of the outputs (divided by the model's calibration temperature,
        metadata.calibration) unless the model already ends in a softmax. An image model's inputs must be photos
        its preprocessing made (_check_prepared)."""
        outputs = self._run_in_chunks(self._as_batch(batch), with_features=False, prepared=True)[0]
        return self.judge_rules.probabilities(outputs)

    def judge(self, batch, photo_reasons=None):
        """Probabilities, gate scores and a reason (None: a diagnosis) per photo: a runtime.gate.Judgement.
        `photo_reasons`: each photo's photo-check reason (check_photo), when the photos were checked. An image
        model's inputs must be photos its preprocessing made (_check_prepared)."""
        if self.judge_rules.gate is not None and self.feature != self.judge_rules.feature:
            raise LnnError(f"this session keeps node {self.feature!r}, but the model's gate uses "
                           f"{self.judge_rules.feature!r}: load it without features= to judge photos")
        outputs, features = self._run_in_chunks(self._as_batch(batch), with_features=self.feature is not None,
                                                prepared=True)
        return self.judge_rules.judge(outputs, features if self.judge_rules.gate else None, photo_reasons)

    def check_photo(self, image, color: str = "bgr"):
        """The model's photo checks (gate.photo_checks) on a decoded photo: a PhotoCheck, or None when
        the model has none."""
        from lnn.runtime.photo_checks import check_photo, copy_statistics
        from lnn.runtime.preprocess import photo_array

        if self.judge_rules.photo_checks is None:
            return None
        return check_photo(photo_array(image, color), self.judge_rules.photo_checks,
                           getattr(self.backend, "photo_statistics", copy_statistics))   # the cpu backend's: compiled

    def prepare_image(self, image, color: str = "bgr", notes: list | None = None) -> np.ndarray:
        """A path, encoded bytes or an HxW[x3|x4] array -> [C, H, W] float32 with the model's preprocessing.

        Arrays: uint8 0..255, or float 0..255, or float 0..1 (taken as such when every value is within
        0..1, with a note); anything else (bool, NaN, values out of range, wrong shape) is one LnnInputError.
        notes: a list that receives one-line remarks on the conversion (a grey photo given to a colour
        model, a float image read as 0..1); without it they are issued as lnn.LnnWarning."""
        return self.prepare_and_check(image, color, notes, check=False)[0]

    def decode_side(self) -> int:
        """The fewest pixels a side of a photo needs for this model: its input size, and its photo checks'
        copy and smallest photo (photo_checks.DEFAULTS, overridden by the model's). A larger baseline JPEG is
        decoded reduced by libjpeg to no less (preprocess.decode_image's keep_side): the same resize to the
        input then gives nearly the same pixels, at a fraction of the decoding and resizing."""
        from lnn.runtime.photo_checks import DEFAULTS

        if not self.model.takes_images:
            return 0                                   # (prepare_and_check says why it takes no photo)
        sides = list(self.model.preprocess["resize"])
        if self.judge_rules.photo_checks is not None:
            thresholds = {**DEFAULTS, **self.judge_rules.photo_checks}
            sides += [int(thresholds["check_size"]), int(thresholds["min_side"])]
        return max(sides)

    def decode_photo(self, source, name: str | None = None, notes: list | None = None,
                     pixel_limit=None, before_decoding=None) -> np.ndarray:
        """A path or encoded bytes -> the decoded photo (preprocess.decode_image), a big baseline JPEG reduced to
        no less than decode_side(); name: what its error lines call it (default: the path, or "<bytes>");
        notes: a list that receives one-line remarks on the decoding; pixel_limit: the caller's own limit
        (preprocess.PixelLimit), checked as the header is read; before_decoding: decode_image's."""
        from lnn.runtime.preprocess import decode_image

        return decode_image(source, name, self.decode_side(), notes, pixel_limit, before_decoding)

    def prepare_and_check(self, image, color: str = "bgr", notes: list | None = None, check: bool = True) -> tuple:
        """(the model's input [C, H, W], the photo check or None): the photo is decoded once for both;
        arguments as for prepare_image."""
        from lnn.runtime.preprocess import preprocess_image

        if not self.model.takes_images:
            raise LnnInputError(f"model {self.model.name!r} takes no images (input shape {list(self.model.input_shape)})")
        if isinstance(image, (str, Path, bytes, bytearray, memoryview)):
            image, color = self.decode_photo(image, notes=notes), "bgr"
        x = preprocess_image(image, self.model.preprocess, color, notes)      # checks the array first
        return x, (self.check_photo(image, color) if check else None)

    def predict_image(self, image, top_k: int | None = None, color: str = "bgr", notes: list | None = None):
        """A runtime.gate.Prediction: labels ranked best first [(display, probability), ...], `uncertain`,
        `reason` and `instruction` (the photo checks, the gate and the confidence threshold of the model).
        It iterates, indexes and compares as the ranked list that this method returned before.

        `image` is a path, encoded bytes, or an array (BGR as OpenCV decodes it, or pass color="rgb");
        notes as for prepare_image."""
        from lnn.runtime.gate import Prediction, instruction

        x, checked = self.prepare_and_check(image, color, notes)
        photo_reason = checked.reason if checked is not None else None
        judgement = self.judge(x[None], [photo_reason])
        reason = judgement.reasons[0]
        detail = checked.detail if checked is not None and reason == photo_reason else None
        return Prediction(self.ranked(judgement.probabilities[0], top_k), reason,
                          instruction(reason, self.judge_rules.subject, detail),
                          {name: float(values[0]) for name, values in judgement.scores.items()})

    def prepare_series(self, values) -> np.ndarray:
        """Raw values for a series model ([T], [C, T'], [N, C, T'] or a list of [C, T_i] or [T_i]) or a table model ([F],
        [N, F]) -> [N, *input_shape] float32 with the model's preprocessing (lnn.runtime.series: brought to
        the model's length as its preprocessing says, standardized as fitted on the training data)."""
        from lnn.runtime.series import model_inputs

        if len(self.model.input_shape) not in (1, 2):
            raise LnnInputError(f"model {self.model.name!r} takes input {list(self.model.input_shape)}, not series "
                                f"[C, T] or table rows [F]")
        return model_inputs(self.model, values)

    def predict_series(self, values, top_k: int | None = None):
        """A series or table row -> its runtime.gate.Prediction (labels ranked best first, `reason`
        "low_confidence" under the model's thresholds.uncertain_below); a batch ([N, C, T], a list of
        series, [N, F]) -> a list of them. Values are raw: the model's preprocessing is applied here."""
        from lnn.runtime.gate import Prediction
        from lnn.runtime.series import is_series_list

        judgement = self.judge(self.prepare_series(values))
        single = not is_series_list(values, self.model) and np.ndim(values) < len(self.model.input_shape) + 1
        answers = [Prediction(self.ranked(p, top_k), reason) for p, reason in zip(judgement.probabilities,
                                                                                judgement.reasons)]
        return answers[0] if single else answers

    def ranked(self, probabilities: np.ndarray, top_k: int | None = None) -> list:
        order = np.argsort(-probabilities, kind="stable")[:top_k]
        return [(self.labels[i]["display"], float(probabilities[i])) for i in order]
