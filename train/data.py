"""Training data: MNIST IDX files, in-memory and memory-mapped uint8 datasets, a prefetch thread.

Images are kept as uint8 [N, C, H, W] with integer labels [N]; the trainer normalizes them
inside the step (scale, mean, std of the description's preprocess block), so a small dataset
costs one byte per pixel and is moved to the device once.
  - `load_mnist(folder)` -> (train, test) ArrayDatasets from the four IDX files (gzipped or raw).
  - `ArrayDataset(images, labels)`: in memory.
  - `MemmapDataset.create(path, count, shape)` / `.open(path)`: a uint8 cache on disk for data that
    does not fit in memory (filled once, e.g. from decoded images), read batch by batch.
  - `Prefetcher(batches, load, to_device, loaders)`: a background thread that reads the next batches
    while the current one trains (generic: any `load(indices)`; with `loaders` > 1 that many batches
    are loaded at once, handed on in order); on the GPU, `PinnedSlots` stages them in page-locked
    memory in that thread and `DeviceFeeder` copies them on a second stream.
"""

from __future__ import annotations

import collections
import gzip
import io
import math
import os
import queue
import struct
import threading
import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from lnn.formats.errors import LnnInputError
from lnn.formats.files import read_regular_file
from lnn.formats.limits import MAX_DATA_FILE_BYTES, MAX_IDX_BYTES, refusal

IDX_IMAGES, IDX_LABELS = 2051, 2049
DEFAULT_VAL_FRACTION, DEFAULT_SPLIT_SEED = 0.2, 0     # lnn-train's validation share of each class, and the seed of
                                                      # its split (image folders and tables alike)


def validation_split_words(seed: int, val_fraction: float) -> str:
    """How reports name the validation side of lnn-train's split (lnn-eval's and lnn-export's)."""
    return f"validation split: seed {seed}, {val_fraction:.0%} per class"


MNIST_FILES = {
    "train_images": ("train-images-idx3-ubyte", "train-images.idx3-ubyte"),
    "train_labels": ("train-labels-idx1-ubyte", "train-labels.idx1-ubyte"),
    "test_images": ("t10k-images-idx3-ubyte", "t10k-images.idx3-ubyte"),
    "test_labels": ("t10k-labels-idx1-ubyte", "t10k-labels.idx1-ubyte"),
}


# --------------------------------------------------------------------------- datasets

class ArrayDataset:
    """uint8 images [N, C, H, W] (or float [N, ...] already preprocessed) and labels [N]."""

    in_memory = True
    loads_at_once = 1                    # batches the trainer's Prefetcher reads at once (Prefetcher's loaders)

    def __init__(self, images, labels, name: str = "data"):
        images = images if isinstance(images, np.ndarray) else np.asarray(images)     # keeps a np.memmap
        labels = labels if isinstance(labels, np.ndarray) else np.asarray(labels)
        if images.ndim < 2:
            raise LnnInputError(f"{name}: images must be [N, ...], got shape {list(images.shape)}")
        if len(labels) != len(images):
            raise LnnInputError(f"{name}: {len(images)} images but {len(labels)} labels")
        if len(images) == 0:
            raise LnnInputError(f"{name}: the dataset is empty")
        self.images, self.labels, self.name = images, labels, name

    def __len__(self) -> int:
        return len(self.images)

    @property
    def sample_shape(self) -> tuple:
        return tuple(self.images.shape[1:])

    def limit(self, count: int | None) -> "ArrayDataset":
        """The first `count` samples (all when None)."""
        if count is None or count >= len(self):
            return self
        return type(self)(self.images[:count], self.labels[:count], self.name)

    def batch(self, indices: np.ndarray):
        return self.images[indices], self.labels[indices]


class MemmapDataset(ArrayDataset):
    """A uint8 image cache in `<path>.images.npy` / `<path>.labels.npy`, memory-mapped, not loaded."""

    in_memory = False

    @classmethod
    def create(cls, path, count: int, sample_shape: tuple, name: str = "cache") -> "MemmapDataset":
        """An empty writable cache; fill `.images[i]` and `.labels[i]`, then `.flush()`."""
        path = Path(path)
        images = reserved_memmap(f"{path}.images.npy", np.uint8, (count,) + tuple(sample_shape))
        labels = reserved_memmap(f"{path}.labels.npy", np.int32, (count,))
        return cls(images, labels, name)

    @classmethod
    def open(cls, path, name: str | None = None) -> "MemmapDataset":
        path = Path(path)
        try:
            images = np.load(f"{path}.images.npy", mmap_mode="r")
            labels = np.load(f"{path}.labels.npy", mmap_mode="r")
        except FileNotFoundError as err:
            raise LnnInputError(f"{err.filename}: no such cache file") from None
        except ValueError as err:
            raise LnnInputError(f"{path}: not a readable dataset cache ({err})") from None
        if images.dtype != np.uint8:
            raise LnnInputError(f"{path}.images.npy: holds {images.dtype}, a cache holds uint8")
        return cls(images, labels, name or path.name)

    def flush(self):
        self.images.flush()
        self.labels.flush()

    def batch(self, indices: np.ndarray):
        order = np.argsort(indices, kind="stable")        # read the file forwards, then restore order
        images = np.empty((len(indices),) + self.sample_shape, np.uint8)
        images[order] = self.images[indices[order]]
        return images, np.asarray(self.labels[indices])


def reserved_memmap(path, dtype, shape: tuple) -> np.memmap:
    """A new writable .npy memmap (np.lib.format.open_memmap) whose disk space is reserved at once
    (os.posix_fallocate). The file is created sparse and its pages are written later through the mapping;
    on a full disk such a write is a SIGBUS that kills the process without a word (exit 135, the temporary
    files left behind). Reserved, a full disk is an OSError (ENOSPC, naming the file) here, before anything
    is written."""
    array = np.lib.format.open_memmap(path, mode="w+", dtype=dtype, shape=tuple(shape))
    if hasattr(os, "posix_fallocate"):
        descriptor = os.open(path, os.O_RDWR)
        try:
            os.posix_fallocate(descriptor, 0, os.fstat(descriptor).st_size)
        except OSError as err:
            del array
            raise OSError(err.errno, err.strerror, str(path)) from None
        finally:
            os.close(descriptor)
    return array


def epoch_order(count: int, seed: int, epoch: int) -> np.ndarray:
    """The sample order of an epoch: a permutation drawn from (seed, epoch), so a resumed run repeats it."""
    return np.random.default_rng([seed, epoch]).permutation(count)


# --------------------------------------------------------------------------- MNIST IDX

def read_idx(path, expected_magic: int) -> np.ndarray:
    """An IDX file (gzip or raw) of unsigned bytes -> uint8 array of its declared shape. The header is read first
    and a declared size over MAX_IDX_BYTES refused; a gzip stream is decompressed only as far as the header
    declares, plus one byte to see a longer (damaged) one."""
    path = Path(path)
    raw = read_regular_file(path, "an IDX file", MAX_DATA_FILE_BYTES, "MAX_DATA_FILE_BYTES")
    stream = gzip.GzipFile(fileobj=io.BytesIO(raw)) if raw[:2] == b"\x1f\x8b" else io.BytesIO(raw)
    try:
        return _read_idx_stream(stream, path, expected_magic)
    except (OSError, EOFError, zlib.error) as err:
        raise LnnInputError(f"{path}: damaged gzip data ({err})") from None


def _read_idx_stream(stream, path: Path, expected_magic: int) -> np.ndarray:
    kind = "images" if expected_magic == IDX_IMAGES else "labels"
    start = stream.read(8)
    if len(start) < 8:
        raise LnnInputError(f"{path}: {len(start)} bytes is too short for an IDX {kind} file")
    (magic,) = struct.unpack(">I", start[:4])
    if magic != expected_magic:
        raise LnnInputError(f"{path}: not an IDX {kind} file (magic number {magic}, expected {expected_magic})")
    ndim = magic & 0xFF
    dims = start[4:] + stream.read(4 * ndim - 4)
    if len(dims) < 4 * ndim:
        raise LnnInputError(f"{path}: truncated IDX header")
    shape = struct.unpack(f">{ndim}I", dims)
    size = math.prod(shape)
    too_big = refusal(f"{path}: the data its IDX header declares ({list(shape)})", size, MAX_IDX_BYTES,
                      "MAX_IDX_BYTES", " bytes")
    if too_big:
        raise LnnInputError(too_big)
    data = stream.read(size + 1)
    if len(data) != size:
        follow = "more" if len(data) > size else f"only {len(data):,}"
        raise LnnInputError(f"{path}: the header declares {list(shape)} ({size:,} bytes) but {follow} bytes follow: "
                            f"the file is truncated or damaged")
    return np.frombuffer(data, np.uint8).reshape(shape)


def _find(folder: Path, names: tuple) -> Path:
    for name in names:
        for candidate in (folder / name, folder / f"{name}.gz"):
            if candidate.is_file():
                return candidate
    raise LnnInputError(f"{folder}: no {names[0]}[.gz] file (an MNIST folder holds train-images-idx3-ubyte.gz, "
                        f"train-labels-idx1-ubyte.gz, t10k-images-idx3-ubyte.gz, t10k-labels-idx1-ubyte.gz)")


def load_mnist(folder) -> tuple[ArrayDataset, ArrayDataset]:
    """(train, test): images uint8 [N, 1, 28, 28], labels uint8 [N]."""
    folder = Path(folder)
    if not folder.is_dir():
        raise LnnInputError(f"{folder}: no such folder (pass --data mnist:FOLDER with the MNIST IDX files)")
    parts = {key: read_idx(_find(folder, names), IDX_IMAGES if key.endswith("images") else IDX_LABELS)
             for key, names in MNIST_FILES.items()}
    out = []
    for split in ("train", "test"):
        images, labels = parts[f"{split}_images"], parts[f"{split}_labels"]
        if images.ndim != 3:
            raise LnnInputError(f"{folder}: {split} images have shape {list(images.shape)}, expected [N, H, W]")
        if labels.max(initial=0) > 9:
            raise LnnInputError(f"{folder}: {split} labels hold {labels.max()}, MNIST labels are 0-9")
        out.append(ArrayDataset(images[:, None], labels, f"mnist {split}"))
    return out[0], out[1]


# --------------------------------------------------------------------------- prefetching

class Prefetcher:
    """Iterate over `load(indices)` for every index array in `batches`, `depth` batches ahead.

    `load` runs in a background thread (reading a memory-mapped cache, decoding images, ...), or with
    `loaders` > 1 in that many threads, one batch each, so a load that waits on worker processes
    (augmentation) keeps several batches in flight; batches still come out in order, and a load
    depends only on its indices, so the data is the same for any `loaders`.
    `to_device(images, labels)` is applied in the background thread, in order (on the GPU: a PinnedSlots).
    Errors in the thread surface in the consumer.
    Use as an iterator; `close()` (or leaving a `with` block) stops the thread early.
    """

    _DONE = object()

    def __init__(self, batches, load, to_device=None, depth: int = 2, loaders: int = 1):
        self._queue = queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        self._loaders = ThreadPoolExecutor(loaders, thread_name_prefix="lnn-load") if loaders > 1 else None
        self._in_flight = max(1, loaders)
        self._thread = threading.Thread(target=self._run, args=(list(batches), load, to_device), daemon=True)
        self._thread.start()

    def _put(self, item) -> bool:
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def _loaded(self, batches, load):
        """load(indices) of each batch in order, up to `loaders` of them computed at once."""
        if self._loaders is None:
            yield from map(load, batches)
            return
        pending = collections.deque()
        for indices in batches:
            pending.append(self._loaders.submit(load, indices))
            if len(pending) >= self._in_flight:
                yield pending.popleft().result()
        while pending:
            yield pending.popleft().result()

    def _run(self, batches, load, to_device):
        try:
            for item in self._loaded(batches, load):
                if self._stop.is_set():
                    return
                if to_device is not None:
                    item = to_device(*item)
                if not self._put(("item", item)):
                    return
            self._put(("done", None))
        except BaseException as err:                    # handed to the consumer, raised there
            self._put(("error", err))

    def __iter__(self):
        return self

    def __next__(self):
        kind, value = self._queue.get()
        if kind == "item":
            return value
        self._stop.set()
        if kind == "error":
            raise value
        raise StopIteration

    def close(self):
        self._stop.set()
        self._thread.join(timeout=5)
        if self._loaders is not None:
            self._loaders.shutdown(wait=False, cancel_futures=True)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class PinnedSlots:
    """A `to_device`-stage for Prefetcher on the GPU: copies each host batch into page-locked memory.

    `count` slots rotate; a slot is reused only after the consumer released it (its copy to the
    device finished), so the thread never overwrites memory a copy is still reading."""

    def __init__(self, cupy, count: int = 4):
        self.cupy = cupy
        self.free = queue.Queue()
        for slot in range(count):
            self.free.put(slot)
        self.buffers = {}

    def __call__(self, images, labels):
        slot = self.free.get()
        out = []
        for part, array in (("images", np.asarray(images)), ("labels", np.asarray(labels, np.int32))):
            key = (slot, part)
            if key not in self.buffers or self.buffers[key][0] < array.nbytes:
                self.buffers[key] = (array.nbytes, self.cupy.cuda.alloc_pinned_memory(array.nbytes))
            host = np.frombuffer(self.buffers[key][1], array.dtype, array.size).reshape(array.shape)
            host[...] = array
            out.append(host)
        return out[0], out[1], slot

    def release(self, slot: int):
        self.free.put(slot)


class DeviceFeeder:
    """Consumer side on the GPU: pinned batch -> one of two device slots, copied on a side stream.

    The copy of batch k+1 overlaps the compute of batch k: the side stream waits until the compute
    stream finished with the slot it overwrites (an event), and the compute stream waits for the
    copy (another event). Device slots are allocated once, at the largest batch size."""

    def __init__(self, cupy, pinned: PinnedSlots, batch_size: int, sample_shape: tuple):
        self.cupy, self.pinned = cupy, pinned
        self.stream = cupy.cuda.Stream(non_blocking=True)
        self.images = [cupy.empty((batch_size,) + tuple(sample_shape), cupy.uint8) for _ in range(2)]
        self.labels = [cupy.empty(batch_size, cupy.int32) for _ in range(2)]
        self.released = [None, None]          # compute-stream events: slot free again
        self.turn = 0

    def put(self, host_images, host_labels, pinned_slot):
        """Start the copy; returns (device images, device labels) valid on the compute stream."""
        cupy, slot = self.cupy, self.turn
        self.turn ^= 1
        n = len(host_images)
        images, labels = self.images[slot][:n], self.labels[slot][:n]
        if self.released[slot] is not None:
            self.stream.wait_event(self.released[slot])
        images.set(host_images, stream=self.stream)
        labels.set(host_labels, stream=self.stream)
        copied = self.stream.record()
        cupy.cuda.get_current_stream().wait_event(copied)
        copied.synchronize()                 # the pinned slot may be refilled once its copy is done
        self.pinned.release(pinned_slot)
        return images, labels, slot

    def done(self, slot: int):
        """Call after the compute for a batch was issued: its device slot may be overwritten after it."""
        self.released[slot] = self.cupy.cuda.get_current_stream().record()
