"""Image-folder datasets: one sub-folder per class, decoded once into a memory-mapped uint8 cache.

    folder = ImageFolder.load("data/tomato", input_shape=(3, 128, 128), color="rgb")
    train, val = folder.datasets(augmenter=Augmenter(color="rgb"))     # for Trainer.fit(train, val)
    train, val, description = folder_datasets("data/tomato", description)   # what lnn-train does

Classes are the sorted names of the sub-folders holding images; files other than images
(by extension) and hidden files are ignored. Every image is decoded with
lnn.runtime.preprocess.read_image and brought to the model's colour order and size with
preprocess_image (so training sees exactly the pixels `lnn-infer` would), kept as uint8
[N, C, H, W] in a MemmapDataset. A file that cannot be decoded is reported, counted and skipped; lnn-train
refuses a class none of whose files could be (folder_datasets).
Colour images also get their leaf mask (lnn.train.segment.leaf_mask, uint8 [N, H, W], 255 = leaf) in
`masks.npy` beside them, computed once here for the augmentation's background replacement.

Cache: `<cache root>/datasets/<key>/` where the cache root is $LNN_CACHE_DIR, else the per-user
cache folder (~/.cache/lnn on Linux; see lnn.runtime.cpu.cache.default_cache_root). The key
hashes every source file's relative path, size, mtime and ctime with the image size and colour order,
so an edited, added or removed photo makes a new cache (ctime: a photo copied over another of the same size with
its old mtime kept, as `cp -p` does, still changes it; a chmod does too, and costs one decoding). It is built in a temporary folder beside
it and renamed into place, so a killed run never leaves a half-written cache; the next run with
the same files and size opens it at once without decoding anything. A folder keeps one cache per size and
colour order: the one made before its photos changed is removed once the new one is open
(_replace_older_cache). When the cache folder cannot
be written (read-only, on a full or missing disk), the images are decoded into a temporary folder
removed at exit, with one warning, as the Numba kernel cache falls back (runtime/cpu/jit.py).

Split (`split_by_leaf`): deterministic from a seed, stratified per class (the validation share
of every class is at most, and with small groups left exactly, `val_fraction` of its images,
rounded), and all photos of one leaf fall on one side. PlantVillage file names carry the leaf: photos whose names hold the same
`Leaf <number>` within a class are one leaf (`..._GH_HL_Leaf_259.jpg` and `..._Leaf_259.1.jpg`;
`GHLB_PS_Leaf_24_Day_13` and `..._Day_16`), the rule ../shared/data/tomato/README.md states;
any other file is its own group.

Unequal classes (`balanced_rows`): the training rows are resampled so every class appears as
often as the largest one (the smaller classes' images repeated, each repeat a different
augmentation), which the Trainer then shuffles per epoch as usual. No loss weights are needed.
"""

from __future__ import annotations

import atexit
import hashlib
import json
import os
import re
import shutil
import tempfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import numpy as np

from lnn.formats.errors import LnnInputError, ModelSpecError, one_line
from lnn.runtime import preprocess as image_io
from lnn.runtime.cpu.cache import default_cache_root as lnn_cache_root, ensure_writable   # no Numba import
from lnn.train.data import DEFAULT_SPLIT_SEED, DEFAULT_VAL_FRACTION, ArrayDataset, MemmapDataset, reserved_memmap

CACHE_VERSION = 2                 # bump when the cached pixels would change for the same files (2: leaf masks)
CACHE_KEY = re.compile(r"[0-9a-f]{24}")     # a cache folder's name (cache_key)
LATEST_CACHES = "latest"          # under the cache root: per (folder, size, colour), the key of its cache now
LEAF_NUMBER = re.compile(r"leaf[ _]+(\d+)", re.IGNORECASE)


# --------------------------------------------------------------------------- finding the files

class FolderScan(NamedTuple):
    """What one walk of an image folder finds (scan_folder), in a fixed order."""

    classes: list       # names of the sub-folders holding image files, sorted
    files: list         # the image files, as paths relative to the folder
    labels: list        # class index per file
    empty: list         # names of the sub-folders without image files (no class), sorted


def scan_folder(folder) -> FolderScan:
    """The classes, files and labels of an image folder, and its sub-folders left out for holding no image file."""
    folder = Path(folder)
    if not folder.is_dir():
        what = "not a folder" if folder.exists() else "no such folder"
        raise LnnInputError(f"{folder}: {what} (pass --data folder:DIR with one sub-folder per class)")
    classes, files, labels, empty = [], [], [], []
    for sub in sorted(p for p in folder.iterdir() if p.is_dir() and not p.name.startswith(".")):
        images = sorted(p for p in sub.iterdir()     # anything but a folder, as lnn-infer: a named pipe, a link to a
                        if p.suffix.lower() in image_io.PHOTO_SUFFIXES and not p.name.startswith(".")   # device, a broken
                        and not p.is_dir())         # or looping link is then skipped and counted, not ignored
        if not images:
            empty.append(sub.name)
            continue
        for path in images:
            files.append(path.relative_to(folder).as_posix())
            labels.append(len(classes))
        classes.append(sub.name)
    if not classes:
        raise LnnInputError(f"{folder}: holds no class sub-folders with images (expected DIR/<class>/<photo>.jpg)")
    return FolderScan(classes, files, labels, empty)


def default_cache_root() -> Path:
    return lnn_cache_root() / "datasets"


def cache_key(folder: Path, files: list, size: tuple, color: str) -> str:
    stamps = []
    for name in files:
        try:
            stat = (folder / name).stat()
        except OSError:                     # a broken or looping link: its own stamp (decoding skips it)
            stat = (folder / name).lstat()
        stamps.append([name, stat.st_size, stat.st_mtime_ns, stat.st_ctime_ns])
    blob = json.dumps([CACHE_VERSION, list(size), color, stamps])
    return hashlib.sha256(blob.encode()).hexdigest()[:24]


# --------------------------------------------------------------------------- decoding

def decode_for_model(path: Path, size: tuple, color: str, notes: list | None = None) -> np.ndarray:
    """A file -> uint8 [C, H, W] in the model's colour order and size, as lnn-infer would see it; lnn-infer's
    remarks on the decoding (a JPEG whose data ran on after its image) go to notes (read_image's)."""
    height, width = size
    channels = 1 if color == "gray" else 3
    identity = {"color": color, "resize": [height, width], "scale": 1.0,
                "mean": [0.0] * channels, "std": [1.0] * channels}
    pixels = image_io.preprocess_image(image_io.read_image(path, notes=notes), identity)   # integer values in float32
    return pixels.astype(np.uint8)


def _build_cache(folder: Path, files: list, labels: list, size: tuple, color: str, target: Path,
                 workers: int, log, progress: bool) -> None:
    """Decode every file into a new cache folder, then rename it to `target` (atomic)."""
    from tqdm import tqdm

    from lnn.train.segment import leaf_mask

    channels = 1 if color == "gray" else 3
    target.parent.mkdir(parents=True, exist_ok=True)
    building = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        data = MemmapDataset.create(building / "all", len(files), (channels,) + tuple(size))
        masks = (reserved_memmap(building / "all.masks.npy", np.uint8, (len(files),) + tuple(size))
                 if channels == 3 else None)
        decoded = np.zeros(len(files), bool)
        skipped, noted = [], []

        def decode(i):
            try:
                notes = []
                data.images[i] = decode_for_model(folder / files[i], size, color, notes)
                if masks is not None:
                    masks[i] = leaf_mask(data.images[i], color)
                decoded[i] = True
                if notes:
                    noted.append((files[i], notes[0]))
            except LnnInputError as err:
                skipped.append((files[i], str(err)))

        with ThreadPoolExecutor(max_workers=workers) as pool, \
                tqdm(total=len(files), desc=f"decoding {folder.name}", unit="img", disable=None if progress else True,
                     leave=False, dynamic_ncols=True) as bar:
            for _ in pool.map(decode, range(len(files))):
                bar.update(1)
        kept = np.flatnonzero(decoded)
        if len(kept) == 0:
            raise LnnInputError(f"{folder}: none of its {len(files)} image files could be decoded")
        data.labels[...] = labels
        data.flush()
        if masks is not None:
            masks.flush()
        parts = ("images", "labels", "masks") if masks is not None else ("images", "labels")
        if len(kept) < len(files):                  # compact: the cache holds decoded images only
            compact = MemmapDataset.create(building / "images", len(kept), data.sample_shape)
            compact.images[...] = data.images[kept]
            compact.labels[...] = data.labels[kept]
            compact.flush()
            if masks is not None:
                np.save(building / "images.masks.npy", masks[kept])
            del data, compact, masks                # unmap before removing (Windows keeps mapped files)
            for part in parts:
                (building / f"all.{part}.npy").unlink()
        else:
            del data, masks
            for part in parts:
                os.replace(building / f"all.{part}.npy", building / f"images.{part}.npy")
        index = {"files": [files[i] for i in kept], "skipped": sorted(skipped), "noted": sorted(noted),
                 "size": list(size), "color": color}
        (building / "index.json").write_text(json.dumps(index))
        for problem in sorted(skipped):
            log(f"skipped {one_line(problem[1])}")
        try:
            os.rename(building, target)
        except OSError:
            if not (target / "index.json").exists():       # not "another process finished first"
                raise
    finally:
        shutil.rmtree(building, ignore_errors=True)


def _scratch_target(target: Path, problem: str, advice: str, log) -> Path:
    """Where to build `target` instead, when the cache cannot be written: in a temporary folder removed when
    the process ends; logs the one warning (`problem`: why; `advice`: what to do, before "LNN_CACHE_DIR")."""
    scratch = Path(tempfile.mkdtemp(prefix="lnn-images-"))
    atexit.register(shutil.rmtree, scratch, ignore_errors=True)
    log(f"warning: cannot write the image cache: {problem}; decoding into the temporary folder {scratch} for this "
        f"run only ({advice} LNN_CACHE_DIR to a writable folder to decode once)")
    return scratch / target.name


def _read_cache(target: Path, name: str, size: tuple, color: str) -> tuple:
    """(index, MemmapDataset, leaf masks or None) of a built cache folder; LnnInputError saying what is wrong
    when a part of it is missing, unreadable or disagrees with the others."""
    channels = 1 if color == "gray" else 3
    try:
        index = json.loads((target / "index.json").read_text(encoding="utf-8"))
        if not (isinstance(index, dict) and isinstance(index.get("files"), list)
                and isinstance(index.get("skipped"), list) and all(len(item) == 2 for item in index["skipped"])):
            raise ValueError("index.json is not a cache index")
        data = MemmapDataset.open(target / "images", name=name)
        shape = (len(index["files"]), channels) + tuple(size)
        if data.images.shape != shape or data.labels.shape != shape[:1]:
            raise ValueError(f"images.images.npy holds {list(data.images.shape)}, the index {list(shape)}")
        masks = None
        if channels == 3:
            masks = np.load(target / "images.masks.npy", mmap_mode="r")
            if masks.shape != (shape[0],) + tuple(size) or masks.dtype != np.uint8:
                raise ValueError(f"images.masks.npy holds {masks.dtype} {list(masks.shape)}")
    except LnnInputError:
        raise
    except (OSError, ValueError, EOFError, TypeError) as err:
        raise LnnInputError(f"{target}: {err}") from None
    return index, data, masks


def _replace_older_cache(root: Path, folder: Path, size: tuple, color: str, key: str, log) -> None:
    """One cache per (folder, size, colour): remember that `key` is this folder's cache now (a file under
    root/LATEST_CACHES), and remove the one remembered before, made before a photo was added, edited or removed,
    which no run opens again (the 3,839 shared tomato photos' cache at 128x128 is 241 MB: without this, each
    change to the folder left one behind). It is renamed away first (atomic), so a run that looks for it
    decodes again rather than reading half of it; one another run still reads stays readable by that run on
    Linux and macOS (its open maps are kept), and on Windows, where it cannot be renamed while mapped, stays."""
    identity = json.dumps([str(folder.resolve()), list(size), color])
    latest = root / LATEST_CACHES / hashlib.sha256(identity.encode()).hexdigest()[:24]
    try:
        previous = latest.read_text(encoding="ascii").strip()
    except (OSError, UnicodeDecodeError):
        previous = None
    if previous == key:
        return
    try:
        latest.parent.mkdir(exist_ok=True)
        written = latest.with_name(f".{latest.name}.{os.getpid()}")
        written.write_text(key, encoding="ascii")
        os.replace(written, latest)
    except OSError:                     # the cache root turned read-only: nothing remembered, nothing removed
        return
    if previous is None or not CACHE_KEY.fullmatch(previous) or not (root / previous).is_dir():
        return
    leaving = root / f".{previous}.replaced-{os.getpid()}"
    try:
        os.rename(root / previous, leaving)
    except OSError:
        return
    shutil.rmtree(leaving, ignore_errors=True)
    log(f"{folder}: removed its cache from before its photos changed ({root / previous})")


def _unwritable(err: OSError) -> LnnInputError:
    where = f" ({err.filename})" if err.filename else ""
    return LnnInputError(f"cannot write the decoded photos{where}: {err.strerror or err}; free some space, or set "
                         f"LNN_CACHE_DIR (and TMPDIR) to a folder with room")


def open_cache(folder, files: list, labels: list, size: tuple, color: str, cache_root=None, workers=None,
               log=None, progress: bool = True, what: str = "images"):
    """(cache folder, its index, MemmapDataset of the decoded files, leaf masks or None) for the given files
    of `folder` (paths relative to it) at `size` (H, W) in `color` order, decoding them first when no cache
    for exactly these files exists (into a temporary folder, with one warning, when the cache root cannot
    be written)."""
    log = log or (lambda message: print(message, flush=True))
    folder = Path(folder)
    root = Path(cache_root) if cache_root is not None else default_cache_root()
    target = root / cache_key(folder, files, size, color)
    opened, problem = None, None
    if (target / "index.json").exists():
        try:
            opened = _read_cache(target, folder.name, size, color)
        except LnnInputError as damage:             # lnn builds it atomically: a disk error, a hand, a bad copy
            log(f"warning: the image cache is damaged ({one_line(damage)}): decoding the photos again")
            shutil.rmtree(target, ignore_errors=True)
            if target.exists():                     # cannot be removed: decode beside it, for this run
                problem = f"the damaged {target} cannot be removed"
    if opened is None:
        problem = problem or ensure_writable(root)
        if problem:
            target = _scratch_target(target, problem, "set", log)
        log(f"{folder}: decoding {len(files)} {what} at {size[0]}x{size[1]} into {target} (once)")
        workers = workers or min(8, os.cpu_count() or 1)
        while True:
            try:
                _build_cache(folder, files, labels, size, color, target, workers, log, progress)
                break
            except OSError as err:              # the cache folder filled up or became unwritable on the way
                if problem:                     # already the temporary folder
                    raise _unwritable(err) from None
                problem = f"{err.strerror or err} ({err.filename or root})"
                target = _scratch_target(target, problem, "free some space or set", log)
        opened = _read_cache(target, folder.name, size, color)
    if target.parent == root:                       # not a temporary folder of this run
        _replace_older_cache(root, folder, size, color, target.name, log)
    index, data, masks = opened
    if index["skipped"]:
        log(f"{folder}: {len(index['skipped'])} of {len(files)} image files could not be decoded and are "
            f"left out (first: {one_line(index['skipped'][0][1])})")
    if index.get("noted"):                  # one line for the folder: a drone's photos may all carry the note
        file, note = index["noted"][0]
        log(f"{folder}: {len(index['noted'])} of {len(files)} image files were decoded with a note (first: "
            f"{file}: {note})")
    return target, index, data, masks


# --------------------------------------------------------------------------- leaves and the split

def leaf_group(file_name: str) -> str:
    """The group of a photo within its class: `leaf <number>` when the name carries one, else the file itself."""
    name = Path(file_name).name
    name = name.split("___", 1)[-1]              # PlantVillage: <uuid>___<session and leaf>
    match = LEAF_NUMBER.search(name)
    return f"leaf {int(match.group(1))}" if match else f"file {Path(file_name).name}"


def check_split(val_fraction: float, seed: int) -> None:
    """Refuse (one line) a validation fraction outside (0, 1) or a seed that is not a non-negative integer."""
    if not 0 < val_fraction < 1:
        raise LnnInputError(f"the validation fraction must be between 0 and 1, not {val_fraction}")
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
        raise LnnInputError(f"the split seed must be a non-negative integer, not {seed}")


def split_by_leaf(files: list, labels, val_fraction: float = DEFAULT_VAL_FRACTION,
                  seed: int = DEFAULT_SPLIT_SEED) -> tuple[np.ndarray, np.ndarray]:
    """(train rows, validation rows), sorted. Per class the leaf groups are shuffled from (seed, class)
    and, in that order, each group that still fits goes to validation, up to round(val_fraction *
    class size) images (exactly that many when small groups remain to fill up)."""
    check_split(val_fraction, seed)
    labels = np.asarray(labels)
    val = []
    for label in np.unique(labels):
        rows = np.flatnonzero(labels == label)
        groups = {}
        for row in rows:
            groups.setdefault(leaf_group(files[row]), []).append(row)
        keys = sorted(groups)
        order = np.random.default_rng([seed, int(label)]).permutation(len(keys))
        want, taken = round(val_fraction * len(rows)), 0
        for k in order:
            if taken + len(groups[keys[k]]) <= want:
                val.extend(groups[keys[k]])
                taken += len(groups[keys[k]])
    is_val = np.zeros(len(labels), bool)
    is_val[val] = True
    return np.flatnonzero(~is_val), np.flatnonzero(is_val)


def balanced_rows(rows: np.ndarray, labels, seed: int = DEFAULT_SPLIT_SEED) -> np.ndarray:
    """`rows` resampled so every class has as many as the largest: each class's rows once, then a
    seeded draw without repeats (as far as possible) of its rows to fill up. Sorted by row."""
    labels = np.asarray(labels)[rows]
    classes, counts = np.unique(labels, return_counts=True)
    largest = counts.max()
    out = []
    for label, count in zip(classes, counts):
        mine = rows[labels == label]
        rng = np.random.default_rng([seed, int(label), 1])
        extra = np.concatenate([rng.permutation(mine) for _ in range(-(-(largest - count) // count))] or [mine[:0]])
        out.append(np.concatenate([mine, extra[:largest - count]]))
    return np.sort(np.concatenate(out))


# --------------------------------------------------------------------------- the folder

@dataclass
class ImageFolder:
    """A decoded image folder: `data` (uint8 [N, C, H, W] and labels, memory-mapped), its classes and files,
    `masks` (uint8 [N, H, W] leaf masks, memory-mapped; None for gray images)."""

    folder: Path
    classes: list
    files: list
    skipped: list
    data: MemmapDataset
    cache_dir: Path
    masks: np.ndarray | None = None

    @classmethod
    def load(cls, folder, input_shape, color: str, cache_root=None, workers: int | None = None,
             log=None, progress: bool = True, scan: FolderScan | None = None) -> "ImageFolder":
        """Open the cache for (folder, size, colour), building it first when it does not exist. `scan`: the
        folder's scan_folder, when the caller has it already (to check the classes before anything is decoded)."""
        log = log or (lambda message: print(message, flush=True))
        folder = Path(folder)
        channels, height, width = input_shape
        if channels != (1 if color == "gray" else 3):
            raise LnnInputError(f"a {color} model needs {1 if color == 'gray' else 3} input channels, "
                                f"the model takes {channels}")
        classes, files, labels, empty = scan_folder(folder) if scan is None else scan
        if empty:
            log(f"{folder}: {len(empty)} sub-folder{'s' if len(empty) > 1 else ''} without image files left out "
                f"(no class of that name): {one_line(', '.join(empty[:5]))}{', ...' if len(empty) > 5 else ''}")
        target, index, data, masks = open_cache(folder, files, labels, (height, width), color, cache_root, workers,
                                                log, progress, what=f"images of {len(classes)} classes")
        return cls(folder, classes, index["files"], index["skipped"], data, target, masks)

    @property
    def labels(self) -> np.ndarray:
        return np.asarray(self.data.labels)

    def split(self, val_fraction: float = DEFAULT_VAL_FRACTION, seed: int = DEFAULT_SPLIT_SEED,
              hint: str | None = None):
        """(train rows, validation rows) of this folder; see split_by_leaf. With a `hint` (what the user can do
        about it), a split that leaves no photo on the validation side is refused in one line ending in it."""
        train_rows, val_rows = split_by_leaf(self.files, self.labels, val_fraction, seed)
        if hint is not None and len(val_rows) == 0:
            raise self.empty_side("validation", val_fraction, seed, hint)
        return train_rows, val_rows

    def empty_side(self, side: str, val_fraction: float, seed: int, hint: str) -> LnnInputError:
        """The one-line error for a split that leaves no photo on `side` ("validation" or "training")."""
        return LnnInputError(f"{self.folder}: no photo falls on the {side} side of the split ({val_fraction:.0%} "
                             f"of each class for validation, whole leaves only, seed {seed}) of its "
                             f"{len(self.files)} photos: {hint}")

    def subset(self, rows: np.ndarray, name: str) -> ArrayDataset:
        """The given rows, read into memory (a training set on the GPU is then moved there once)."""
        return ArrayDataset(np.asarray(self.data.images[rows]), self.labels[rows], name)

    def datasets(self, val_fraction: float = DEFAULT_VAL_FRACTION, seed: int = DEFAULT_SPLIT_SEED,
                 augmenter=None, balance: bool = True, augment_seed: int = 0):
        """(training, validation) datasets for Trainer.fit. Training rows are class-balanced (balance=True)
        and, with an Augmenter, augmented on worker threads as the trainer's prefetch thread reads them."""
        from lnn.train.augment import AugmentedDataset

        train_rows, val_rows = self.split(val_fraction, seed,
                                          "add photos to the classes, or choose a larger --val-fraction")
        if len(train_rows) == 0:
            raise self.empty_side("training", val_fraction, seed,
                                  "add photos to the classes, or choose a smaller --val-fraction")
        if balance:
            train_rows = balanced_rows(train_rows, self.labels, seed)
        val = self.subset(val_rows, f"{self.folder.name} validation")
        if augmenter is None:
            return self.subset(train_rows, f"{self.folder.name} training"), val
        return AugmentedDataset(self.data, train_rows, augmenter, augment_seed, f"{self.folder.name} training",
                                masks=self.masks), val


def class_labels(folder, classes: list, described=None) -> list:
    """The label list for a model of the folder's classes: the description's (checked against the class folders),
    else the folder names (display names are then made from them by the model description)."""
    if not described:
        return list(classes)
    names = [item if isinstance(item, str) else item.get("name") for item in described]
    if names != classes:
        missing = [c for c in classes if c not in names]
        extra = [n for n in names if n not in classes]
        detail = (f"folder classes missing from the labels: {', '.join(missing)}" if missing else
                  f"labels without a folder: {', '.join(map(str, extra))}" if extra else
                  "the labels must list the classes in sorted folder order: " + ", ".join(classes))
        raise LnnInputError(f"{folder}: the description's labels do not match the class folders ({detail})")
    return described


def folder_datasets(folder, description: dict, augment: bool = True, val_fraction: float = DEFAULT_VAL_FRACTION,
                    seed: int = DEFAULT_SPLIT_SEED, log=None, progress: bool = True, outliers=None):
    """lnn-train's `--data folder:DIR`: (training, validation, the description with the folder's labels).

    The images are decoded at the description's input size and colour order (its preprocess block);
    training rows are class-balanced and, with augment=True, augmented as the description's
    training.augment says (lnn.train.augment), in worker processes on machines of more than
    PROCESSES_ABOVE cores, else threads ($LNN_AUGMENT_PROCESSES=1 or 0 forces either). With `outliers` (a folder), the fit part of
    its photos is mixed into the training rows for outlier exposure (lnn.train.exposure; training.outliers
    sets the ratio); validation stays the folder's own photos."""
    from lnn.formats.model import parse_model
    from lnn.train.augment import PROCESSES_ABOVE, AugmentedDataset, augmenter_from_block
    from lnn.train.config import TrainingConfig

    log = log or print
    model = parse_model({key: value for key, value in description.items() if key != "labels"})
    if not model.takes_images:
        raise LnnInputError("an image folder needs an image model: give the description a preprocess block "
                            "and an input_shape [C, H, W]")
    config = TrainingConfig.parse(model.extra.get("training"))
    color = model.preprocess["color"]
    scan = scan_folder(folder)
    if len(scan.classes) < 2:
        raise LnnInputError(f"{folder}: holds photos of one class only ({one_line(scan.classes[0])}): a classifier "
                            f"learns from two or more class sub-folders (DIR/<class>/<photo>.jpg)")
    described = dict(description, labels=class_labels(folder, scan.classes, description.get("labels")))
    try:                # before decoding: a run must not decode every photo, or train, to be refused at its end
        parse_model(described)
    except ModelSpecError as err:
        raise LnnInputError(f"{folder}: the model's labels for its class sub-folders: {err}") from None
    wanted = os.environ.get("LNN_AUGMENT_PROCESSES", "").strip()       # "1"/"0" forces processes/threads
    processes = wanted == "1" if wanted in ("0", "1") else (os.cpu_count() or 1) > PROCESSES_ABOVE
    augmenter = augmenter_from_block(config.augment, color, processes=processes) if augment else None
    images = ImageFolder.load(folder, model.input_shape, color, log=log, progress=progress, scan=scan)
    unseen = [name for label, name in enumerate(images.classes) if not np.any(images.labels == label)]
    if unseen:          # the model would have an output for it that no photo ever trained
        raise LnnInputError(f"{folder}: no photo of class {one_line(unseen[0])} could be decoded"
                            f"{f' (nor of {len(unseen) - 1} other classes)' if len(unseen) > 1 else ''}: replace "
                            f"its photos, or move the class folder out")
    train, val = images.datasets(val_fraction, seed, augmenter)
    log(f"{images.folder}: {len(images.classes)} classes, {len(train)} training rows (classes balanced), "
        f"{len(val)} validation images (split seed {seed}, leaves kept on one side)"
        f"{', augmented' if augmenter else ''}"
        f"{' with background replacement' if augmenter and augmenter.uses_masks else ''}")
    if outliers is not None:
        from lnn.train.exposure import OutlierMix, outlier_images

        photos = outlier_images(outliers, model.input_shape, color, log=log, progress=progress)
        if augmenter is not None:
            photos = AugmentedDataset(photos, np.arange(len(photos)), augmenter, seed=1, name="outliers")
        train = OutlierMix(train, photos, config.outliers["ratio"], train.name)
        log(f"{outliers}: outlier exposure with {len(photos)} photos (the fit part), {train.outlier_rows} outlier "
            f"rows per epoch ({config.outliers['ratio']:g} per training row), loss weight {config.outliers['weight']:g}")
    return train, val, described
