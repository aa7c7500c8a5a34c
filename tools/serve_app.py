"""lnn-serve's web application (Starlette, run by uvicorn): the phone page, the classify API, health and metrics.

    POST /v1/classify[?top_k=K]   an image as the body, or multipart/form-data with a `file` field
                                  -> lnn-infer --json's object for it (answer_record, below)
    GET  /v1/model                the model's name, labels, input and checksum, and how it runs now
    GET  /healthz, /readyz        alive; model loaded and warmed up
    GET  /metrics                 Prometheus text: requests by status, latency, batch sizes, queue depth, rejections
    GET  /                        the page for phones (serve_page.html, shipped in the package)
    GET  /address.png             the QR code of the page's address, for another phone to open it

A request's path: the body (one sent compressed -> 415) read up to --max-body (413), admission (more than --queue
uploads in the server -> 503 with Retry-After), decode + preprocessing on a thread pool, or for a photo that decodes
large on a heavy lane of one thread (400 with lnn-infer's one-line reason), then the Batcher, which merges the images waiting into one batch (up to
--max-batch images, waiting at most --max-delay-ms after the first while other photos are still being decoded)
computed on ONE inference thread, so decoding the next requests runs while a batch is computed. No answer
within --timeout -> 504. Every request gets exactly one of 200 / 4xx / 503 / 504 (500 only for a fault of the
server itself), and each is counted in /metrics.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import io
import logging
import os
import re
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import numpy as np
import segno
from prometheus_client import (CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram,
                               disable_created_metrics, generate_latest)
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.formparsers import MultiPartException, MultiPartParser
from starlette.requests import ClientDisconnect, Request
from starlette.responses import HTMLResponse, JSONResponse, Response
from starlette.routing import Route

from lnn.formats.errors import LnnInputError
from lnn.runtime.cpu import cache
from lnn.tools.cli import error_line
from lnn.runtime.preprocess import PixelLimit
from lnn.runtime.trial import AlternatingTrial
from lnn.tools.infer import answer_for, judge_images
from lnn.tools.serve import ERROR_TYPE, PROG, RETRY_AFTER_S, ServeConfig, error_body, phones_can_open

ENDPOINTS = ("POST /v1/classify, GET /v1/model, /healthz, /readyz, /metrics and the phone page at / (its QR code: "
             "/address.png)")
RETRY_LATER = {"Retry-After": str(RETRY_AFTER_S)}       # a 503's header: when the phone should try again
STARTING_RETRY_AFTER_S = 30             # ... while the model's kernels compile (Batcher.refusal_while_starting)
HEAVY_DECODE_PIXELS = 4_000_000         # a photo decoded to more pixels (a progressive 12 MP photo, a big PNG or TIFF:
                                        # 0.1-2 s each) is decoded on the heavy lane, one at a time (create_app)
UPLOAD_NAME = "upload"                  # the answer's "file" for a raw-body upload (multipart gives its filename)
LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0)
HOST_HEADER = re.compile(r"(\[[0-9A-Fa-f:.]{2,45}\]|[A-Za-z0-9.-]{1,253})(:[0-9]{1,5})?")   # a name or address, a port
QR_SCALE = 6                            # image pixels a QR module: a 25-module code and its margin, 198 pixels
BATCH_BUCKETS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)
disable_created_metrics()               # no *_created series: only what a station's dashboard reads
for _name in ("python_multipart", "multipart"):     # its warnings on a malformed form ("Expected boundary
    logging.getLogger(_name).setLevel(logging.ERROR)  # character 45, got 0 at index 2") went to stderr, one line
    # per hostile request; the form's 400 already says what was wrong with it


def address_qr(url: str, kind: str) -> bytes:
    """The QR code of the address phones open, as an image file of segno's `kind` ("png" for the page, "ppm" for
    lnn-field's Tk): a phone's camera app reads it and offers to open the page, so nobody types an IP address
    on a phone. Error correction M (about 15% of the code may be misread, by glare on a screen or a smudge, and
    it still reads; segno raises it where the symbol's size has room for more); QR_SCALE pixels a module, and
    the 4-module margin readers need."""
    image = io.BytesIO()
    segno.make(url, error="m", micro=False).save(image, kind=kind, scale=QR_SCALE, border=4)
    return image.getvalue()


# --------------------------------------------------------------------------- one image: decode, answer

class HeavyPhoto(Exception):
    """Raised on the decode pool before decoding a photo over HEAVY_DECODE_PIXELS: it goes to the heavy lane."""


def not_heavy(header) -> None:
    """prepare_upload's check on the decode pool: a photo that decodes to more than HEAVY_DECODE_PIXELS is
    HeavyPhoto."""
    if header.decoded_pixels > HEAVY_DECODE_PIXELS:
        raise HeavyPhoto


def prepare_upload(session, data: bytes, max_pixels: int, name: str = UPLOAD_NAME,
                   on_decode_pool: bool = False) -> tuple:
    """Encoded image bytes -> (the model's input [C, H, W], its photo check, notes): lnn-infer's decoding,
    photo checks and preprocessing; bad bytes raise LnnInputError with lnn-infer's one-line reason, the
    upload's name (its multipart filename, or UPLOAD_NAME) where lnn-infer names the file. An image whose
    header declares more than max_pixels (--max-pixels: a decompression bomb, a small file that would expand
    into gigabytes) is refused before anything decodes it, from the same reading of the header as lnn's own
    limits. Runs on the decode pool (on_decode_pool: a photo that decodes large is HeavyPhoto there, once its header
    is read), or on the heavy lane."""
    notes: list = []
    limit = PixelLimit(max_pixels, "the server's limit", "send a smaller photo")
    image = session.decode_photo(data, name, notes, limit, not_heavy if on_decode_pool else None)
    return (*session.prepare_and_check(image, notes=notes), notes)


def load_image_libraries() -> None:
    """Import the decoder at startup, so the first photo does not pay for it (OpenCV's import is ~0.2 s)."""
    from lnn.runtime.preprocess import image_library

    image_library()


def answer_record(session, judged: tuple, prepared: tuple, name: str, top_k: int) -> dict:
    """THE one place a request's answer is made: lnn-infer --json's object for one image, from the batch's
    decision on it (probabilities, reason) and its prepare_upload (input, photo check, notes)."""
    probabilities, reason = judged
    _, check, notes = prepared
    answer = answer_for(session, name, probabilities, reason, check, notes, top_k)
    if isinstance(answer, str):                       # the model's output is not a number: a fault of the model
        raise RuntimeError(answer)
    return answer.as_dict()


def model_record(session) -> dict:
    """GET /v1/model: what a client needs to know about the model answering it."""
    checksum = hashlib.sha256(Path(session.bin.path).read_bytes()).hexdigest()
    return {"name": session.model.name, "file": os.path.basename(session.bin.path), "sha256": checksum,
            "device": session.device, "threads": session.threads,          # threads: None where the backend has none
            "input": {"shape": list(session.input_shape), "preprocess": session.model.preprocess},
            "labels": [{"label": label["name"], "display": label["display"]} for label in session.labels],
            "uncertain_below": session.judge_rules.uncertain_below, "upload_side": upload_side(session)}


def upload_side(session) -> int:
    """The short side, in pixels, that a client shrinks a photo to before sending it (the phone page does): twice
    Session.decode_side, so the server's reduced decoding still averages it down to what the model and its photo
    checks need, as for any bigger photo. 40 photos of 4032x3024 shrunk by the page in Chromium
    (benchmarks/page_shrink.py) kept their reasons (8 blurred and 8 too dark among them) and every probability
    within 0.08, as at the 1600 pixels the page sent before; shrunk to decode_side itself, a blurred one was
    diagnosed. 0 for a model that takes no photos."""
    return 2 * session.decode_side()


# --------------------------------------------------------------------------- metrics

class Metrics:
    """The Prometheus series, in a registry of their own (one per app, so tests can build several)."""

    def __init__(self):
        self.registry = CollectorRegistry()
        self.requests = Counter("lnn_serve_requests", "classify requests answered, by HTTP status",
                                ["status"], registry=self.registry)
        self.latency = Histogram("lnn_serve_request_seconds", "classify request time, arrival to answer",
                                 buckets=LATENCY_BUCKETS, registry=self.registry)
        self.batch_size = Histogram("lnn_serve_batch_size", "images per Session call",
                                    buckets=BATCH_BUCKETS, registry=self.registry)
        self.queue_depth = Gauge("lnn_serve_queue_depth", "images decoded and waiting for a batch",
                                 registry=self.registry)
        self.in_flight = Gauge("lnn_serve_requests_in_flight", "classify requests in the server now",
                               registry=self.registry)
        self.rejected = Counter("lnn_serve_rejected", "classify requests refused, by reason",
                                ["reason"], registry=self.registry)
        self.unserved = Counter("lnn_serve_unserved", "requests answered before reaching an endpoint, by HTTP "
                                "status and reason: bad_http, head_too_large, head_timeout, too_many_connections, pipeline_full, "
                                "stopping (the protocol's, lnn.tools.serve.guarded_protocol), not_found, "
                                "method_not_allowed", ["status", "reason"], registry=self.registry)
        self.connections = Gauge("lnn_serve_connections", "connections open now", registry=self.registry)

    def text(self) -> bytes:
        return generate_latest(self.registry)


# --------------------------------------------------------------------------- dynamic batching

# A lone photo computed while other photos wait (LoneCalls): each way takes LONE_TURNS turns of LONE_TURN calls in a
# row (runtime/trial.py's AlternatingTrial, a turn's first call untimed), then the faster by median is kept for
# LONE_REVIEW such calls and timed again
LONE_TURN = 8
LONE_TURNS = 3
LONE_REVIEW = 2000


class LoneCalls:
    """How the inference thread computes a lone photo while other photos wait for the model (every photo of an
    unbatched server under load; a batch of one whose delay ran out): as the session chose (the CPU backend splits
    its layers over the cores where that timed faster, by the fastest of its first calls) or on one thread
    (Session.one_thread). Under load the split is fast only while no other thread holds one of its cores: on 4
    cores of a Xeon the unbatched server answered 199.4 photos/s at --threads auto against 377.9 at --threads 1,
    while leaf_cnn224's unbatched server on the 2-core VM lost by a fixed rule of one thread (73.6 against 106.0:
    docs/BENCHMARKS.md). So the two ways are timed here, under the server's own load, by the median time from one
    lone call's end to the next one's (slow calls are the load's effect, not noise), and timed again every
    LONE_REVIEW calls. From end to end, not the call alone: the split's helpers also take the cores the event loop
    needs between the calls (on 4 Xeon cores a review that timed the calls alone kept a split 2.76 against 3.08 ms
    a call, and the server then answered 243.6 photos/s at 10.7 ms of CPU each, against 326.7 at 5.0 on one
    thread). Only two lone calls in a row give a time: a call whose last one was not lone is run but not counted."""

    def __init__(self, threads: int | None):
        self.timing = (threads or 1) > 1            # one thread anyway: nothing to choose
        self.trial = self._new_trial()              # ways: on one thread? (the session's way first)
        self.medians = None                         # the last trial's (as the session chose, one thread) ms
        self.until_review = 0
        self.last_lone_end = None                   # when the last call ended, if a lone one while others waited

    @staticmethod
    def _new_trial() -> AlternatingTrial:
        return AlternatingTrial((False, True), LONE_TURN, LONE_TURNS)

    @property
    def one_thread(self) -> bool:
        """The way kept by the last trial (False until one has ended)."""
        return self.medians is not None and self.medians[1] < self.medians[0]

    def next_on_one_thread(self) -> bool:
        """Whether the next lone photo while others wait runs on one thread."""
        if not self.timing:
            return False
        if self.until_review > 0:
            return self.one_thread
        return self.trial.next_way()

    def other_call_ended(self) -> None:
        """The inference thread's call, not a lone photo while others waited (a batch, a photo with none waiting,
        a failure), ended: the next lone call's time would hold it, so that one is not counted."""
        self.last_lone_end = None

    def ended(self, one_thread: bool, at: float) -> None:
        """The inference thread's call of a lone photo while others waited, on one thread or not, ended at `at`
        (perf_counter seconds)."""
        since, self.last_lone_end = self.last_lone_end, at
        if not self.timing or since is None:
            return
        if self.until_review > 0:
            self.until_review -= 1
            return
        self.trial.took(one_thread, at - since)
        if self.trial.done:
            self.medians = tuple(1000 * float(np.median(self.trial.timed[way])) for way in self.trial.ways)
            self.trial, self.until_review = self._new_trial(), LONE_REVIEW

    def describe(self) -> str:
        if not self.timing:
            return "not timed: the session has no threads to leave out"
        if self.medians is None:
            return "as the session chose, until timed under load against one thread"
        way = "one thread" if self.one_thread else "as the session chose"
        return (f"{way} (timed under load: {self.medians[1]:.2f} ms from a call's end to the next on one thread, "
                f"{self.medians[0]:.2f} as the session chose)")


@dataclass
class Job:
    image: np.ndarray
    check: object                        # its photo check (runtime/photo_checks.PhotoCheck) or None
    answer: asyncio.Future               # -> (this image's row of probabilities, its reason)
    waiting_since: float                 # the event loop's time when it was put in the queue


class Batcher:
    """Merges the images waiting into one Session call on a single inference thread.

    A batch takes every image waiting, up to max_batch. While other requests are still being decoded it waits
    for them until max_delay_s after it began collecting: when its first image was ready, or, for images that
    waited behind a computing batch, when that batch ended. With none on the way it runs at once (waiting could
    gain nothing, so a lone phone never pays the delay). Under load the requests that a batch's answers bring
    back are then merged with the images that waited behind it, and the server stays in step: one batch of
    nearly every client's photo, decoded before it runs. Counted from the first image's readiness instead, the
    waiting images ran at once, and a server at 16 clients fell into two halves that alternate, each decoded
    while the other computes, the decoding slowing the model's threads (docs/BENCHMARKS.md, serve_load, by
    hand). A job whose request gave up (timeout) is dropped unrun."""

    def __init__(self, session, max_batch: int, max_delay_s: float, metrics: Metrics):
        self.session = session
        self.max_batch = max_batch
        self.max_delay_s = max_delay_s
        self.metrics = metrics
        self.waiting: asyncio.Queue = asyncio.Queue()
        self.being_decoded = 0               # requests whose image is on the decode pool: soon waiting here
        self.inference = ThreadPoolExecutor(1, thread_name_prefix="lnn-serve-inference")
        self.lone_calls = LoneCalls(session.threads)
        self.ready = asyncio.Event()
        self.compiling = False               # the warm-up compiles the model's kernels (about 40 s here)
        self.failed = None                   # why the warm-up failed, if it did
        self._task = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._serve())

    async def warm_up(self) -> None:
        """Ready every chunk size on the inference thread (Session.warm_up: the CPU backend's compile or cache
        load, buffers, helper program and split choice, per calling thread; on several threads, batches of 8 and
        2 ready every thread's plans for the units of 2 and 1 that split batches of any size run in), then be
        ready. The NumPy backend has none of these: one call does. A first start compiles apart
        (compile_in_a_child); while kernels compile, or once the warm-up has failed, requests are refused at once
        (refusal_while_starting)."""
        try:
            if kernels_to_compile(self.session):
                self.compiling = True
                self.compiling = not await compile_in_a_child(self.session)    # failed: compiled here instead
            for size in warm_up_sizes(self.session):
                await asyncio.get_running_loop().run_in_executor(self.inference, self.session.warm_up, size)
        except Exception as err:                # noqa: BLE001 - the server stays up to say so to every request
            self.failed = " ".join(str(err).split()) or type(err).__name__
            error_line(PROG, f"the model failed its warm-up and answers nothing: {self.failed}")
            return
        self.compiling = False
        self.ready.set()

    def refusal_while_starting(self):
        """A Refused for a request that arrives while the model cannot answer soon: its kernels are being
        compiled (a first start: about 40 s on the 2-core VM, more on a slower CPU; held until --timeout, such
        a request got a 504 saying only that no answer came) or its warm-up failed. None otherwise: a warm-up
        that only loads the cache takes about 2 s, and a request meanwhile waits for it."""
        if self.failed is not None:
            return Refused(503, f"the server's model failed to start ({self.failed}); whoever runs the server "
                                f"should read its log", "model_failed")
        if self.compiling:
            return Refused(503, "the server is still preparing its model (its first start compiles it); try "
                                "again shortly", "starting",
                           {"Retry-After": str(STARTING_RETRY_AFTER_S)})
        return None

    @contextlib.contextmanager
    def decoding(self):
        """Around a request's decoding: the batcher knows an image is on its way."""
        self.being_decoded += 1
        try:
            yield
        finally:
            self.being_decoded -= 1

    async def classify(self, image: np.ndarray, check) -> tuple:
        loop = asyncio.get_running_loop()
        job = Job(image, check, loop.create_future(), loop.time())
        self.waiting.put_nowait(job)
        self.metrics.queue_depth.inc()
        return await job.answer

    async def _next_batch(self) -> list:
        loop = asyncio.get_running_loop()
        collecting_since = loop.time()                    # free: the batch before, if any, has ended
        batch = [await self.waiting.get()]
        deadline = max(batch[0].waiting_since, collecting_since) + self.max_delay_s
        while len(batch) < self.max_batch:
            if not self.waiting.empty():
                batch.append(self.waiting.get_nowait())
                continue
            left = deadline - loop.time()
            if left <= 0 or self.being_decoded == 0:
                break
            try:
                batch.append(await asyncio.wait_for(self.waiting.get(), left))
            except asyncio.TimeoutError:
                break
        self.metrics.queue_depth.dec(len(batch))
        return [job for job in batch if not job.answer.done()]       # done = its request gave up

    async def _serve(self) -> None:
        await self.ready.wait()
        while True:
            jobs = await self._next_batch()
            if jobs:
                self.metrics.batch_size.observe(len(jobs))
                await self._answer(jobs)

    async def _answer(self, jobs: list) -> None:
        """Compute a batch and answer its jobs. A batch that fails is computed again one image at a time, so
        one image the model fails on gets its 500 and the others in its batch still get their answers. A lone
        photo while others wait runs as LoneCalls has found faster under this load."""
        others_wait = len(jobs) == 1 and (self.being_decoded > 0 or not self.waiting.empty())
        one_thread = others_wait and self.lone_calls.next_on_one_thread()
        try:
            probabilities, reasons, ended = await asyncio.get_running_loop().run_in_executor(
                self.inference, self._judge, [job.image for job in jobs], [job.check for job in jobs], one_thread)
        except Exception as err:                  # noqa: BLE001 - each waiting request answers, none hangs
            self.lone_calls.other_call_ended()
            if len(jobs) > 1:
                for job in jobs:
                    await self._answer([job])
            elif not jobs[0].answer.done():
                jobs[0].answer.set_exception(err)
            return
        if others_wait:
            self.lone_calls.ended(one_thread, ended)
        else:
            self.lone_calls.other_call_ended()
        for job, row, reason in zip(jobs, probabilities, reasons):
            if not job.answer.done():
                job.answer.set_result((row, reason))

    def _judge(self, images: list, checks: list, one_thread: bool) -> tuple:
        """judge_in_chunks on the inference thread -> (probabilities, reasons, when it ended: perf_counter)."""
        with self.session.one_thread() if one_thread else contextlib.nullcontext():
            probabilities, reasons = judge_in_chunks(self.session, images, checks)
        return probabilities, reasons, time.perf_counter()

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        self.inference.shutdown(wait=self.ready.is_set())   # not ready: inside a compile (see serve.serve)


# The child's work (compile_in_a_child): the server's warm-up and a photo check, on the same model and threads
COMPILE_IN_A_CHILD = ("import sys; from lnn.tools.serve_app import warm_up_alone; "
                      "warm_up_alone(sys.argv[1], int(sys.argv[2]))")


def kernels_to_compile(session) -> bool:
    """The session's warm-up will compile kernels: Numba's (not the ahead-of-time module's), and this model's are
    not in the cache yet (a first start after an install or upgrade, or every start where the cache is not
    writable)."""
    if session.device != "cpu":
        return False
    from lnn.runtime.cpu import jit

    return jit.KERNELS == "jit" and not cache.kernels_cached(session.model)


async def compile_in_a_child(session) -> bool:
    """When kernels_to_compile, compile them in a child process, which fills the cache and exits; the warm-up
    here then loads them. -> whether the child did. Compiled in the server itself, Numba's compiler kept its
    memory for the server's whole life (about 170 MiB more for the bundled model: ARCHITECTURE.md, the phone
    server), a lot on a 1 GB Raspberry Pi. Nothing to do where the cache is not writable; a child that fails
    leaves the compile to this process, as before, after one line saying why. Stopped during it (the warm-up
    cancelled), the child is killed."""
    from lnn.runtime.cpu import jit

    if not jit.CACHE_ENABLED:
        return False
    print(f"{PROG}: a first start with this model: compiling its kernels in a child process (later starts "
          f"load them from {cache.numba_cache_dir()})", file=sys.stderr, flush=True)
    try:
        child = await asyncio.create_subprocess_exec(sys.executable, "-c", COMPILE_IN_A_CHILD, str(session.bin.path),
                                                     str(session.threads), stdin=subprocess.DEVNULL,
                                                     stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    except (OSError, NotImplementedError) as err:       # no process may be started here, or not from this loop
        why = f"{type(err).__name__}: {err}"
    else:
        try:
            _, errors = await child.communicate()
        except asyncio.CancelledError:
            child.kill()
            raise
        if child.returncode == 0:
            return True
        why = (errors.decode(errors="replace").strip().splitlines() or [f"exit status {child.returncode}"])[-1]
    print(f"{PROG}: compiling the kernels in a child process failed ({why}); compiling them in this one",
          file=sys.stderr, flush=True)
    return False


def warm_up_alone(model_path: str, threads: int) -> None:
    """compile_in_a_child's child: what the server's warm-up compiles, and the photo checks' kernel."""
    from lnn.tools.infer import load_session

    session = load_session(model_path, "cpu", threads)
    for size in warm_up_sizes(session):
        session.warm_up(size)
    session.check_photo(np.random.default_rng(0).integers(0, 256, (64, 64, 3), dtype=np.uint8))


CHUNK_SIZES = (8, 4, 2, 1)      # the CPU backend keeps buffers for 4 batch sizes (PLANS_KEPT): these four


def warm_up_sizes(session) -> tuple:
    """The batch sizes a server's warm-up readies (Batcher.warm_up, and compile_in_a_child's child): every chunk
    size on the CPU backend; elsewhere one call does."""
    return CHUNK_SIZES if session.device == "cpu" else (1,)


def chunk_sizes(count: int) -> list:
    """A batch of `count` images as Session calls of CHUNK_SIZES, largest first (13 -> 8, 4, 1)."""
    sizes = []
    for size in CHUNK_SIZES:
        sizes += [size] * (count // size)
        count %= size
    return sizes


def judge_in_chunks(session, images: list, checks: list) -> tuple:
    """(probabilities, reasons) for a batch of model inputs (lnn-infer's judge_images, which stacks each call's
    images: they are copied once). A batch the CPU backend splits over its threads by images is one call: it runs
    in units of images taken by whichever thread is free, on plans of the units' sizes, so any batch size is
    ready (CpuBackend.splits_batch); cutting it into chunks, as below, ended most batches in a lone image split
    by its layers, and each chunk waited for its slowest thread (2-core VM, 16 clients, by hand: 489.9 against
    445.7 answers/s with the same units). Otherwise the batch is computed in chunks of CHUNK_SIZES: that backend
    plans buffers per batch size and keeps 4, and a batch of any other size re-planned on every call (about 2x
    slower when sizes varied from 1 to 16); padding to those sizes instead wasted up to half the work. On one
    thread an image costs about the same in a chunk of 8 as in one of 16 (BENCHMARKS serve_load), so nothing is
    lost by not calling it with 16."""
    splits = getattr(session.backend, "splits_batch", None)
    sizes = [len(images)] if splits is not None and splits(len(images)) else chunk_sizes(len(images))
    rows, reasons, start = [], [], 0
    for size in sizes:
        chunk_rows, chunk_reasons = judge_images(session, images[start:start + size], checks[start:start + size])
        rows.append(chunk_rows)
        reasons += chunk_reasons
        start += size
    return np.concatenate(rows), reasons


# --------------------------------------------------------------------------- the application

def error_response(status: int, message: str, headers: dict | None = None) -> Response:
    """The API's one-line JSON error, the same for every endpoint and for the protocol's own refusals
    (serve.error_body)."""
    return Response(error_body(status, message), status, headers, media_type=ERROR_TYPE)


class Refused(Exception):
    """A request answered with an error status and a one-line reason."""

    def __init__(self, status: int, reason: str, kind: str, headers: dict | None = None):
        super().__init__(reason)
        self.status, self.reason, self.kind, self.headers = status, reason, kind, headers or {}


class UploadMemory:
    """The bytes of uploads the server holds at once (bodies being read or decoded), at most `budget`
    (--upload-memory): without it --queue uploads of --max-body each (64 x 10 MB) took the server to 839 MB (by
    hand, on the 2-core VM), most of a small Raspberry Pi's memory. Used on the event loop only, so no lock."""

    def __init__(self, budget: int):
        self.budget, self.held = budget, 0

    @contextlib.contextmanager
    def share(self):
        """One request's share: take(n) before it holds n more bytes (503 with Retry-After past the budget, as a
        full queue); all of it given back when the request ends."""
        taken = 0

        def take(nbytes: int) -> None:
            nonlocal taken
            if self.held + nbytes > self.budget:
                raise Refused(503, f"the server holds {self.held:,} bytes of other uploads, near its limit of "
                                   f"{self.budget:,} (--upload-memory); try again in a moment", "uploads_full",
                              RETRY_LATER)
            self.held += nbytes
            taken += nbytes

        try:
            yield take
        finally:
            self.held -= taken


class QueuePlaces:
    """The --queue: requests whose upload has arrived (being decoded, waiting for a batch or in one), at most
    `size`. A place is taken only once the upload is in: counted from a request's start, 64 phones uploading
    slowly over a weak Wi-Fi (or clients trickling their bodies a byte a second) held every place until their
    --timeout, and every other phone got 503 while the model sat idle (by hand: 40 of 123 photos refused).
    Uploads still arriving are bounded by --max-connections, --upload-memory and --timeout instead. Used on the
    event loop only, so no lock."""

    def __init__(self, size: int):
        self.size, self.taken = size, 0

    @contextlib.contextmanager
    def place(self):
        """One request's place: take() once its upload is in (503 with Retry-After when none is free); given back
        when the request ends."""
        held = False

        def take() -> None:
            nonlocal held
            if self.taken >= self.size:
                raise Refused(503, f"the server is busy ({self.size} requests waiting); try again in a moment",
                              "queue_full", RETRY_LATER)
            self.taken += 1
            held = True

        try:
            yield take
        finally:
            self.taken -= held


async def read_body(request: Request, max_body: int, take) -> bytearray:
    """The request body, refused with 413 as soon as it is known to pass max_body (its Content-Length, or
    the bytes received so far), so an oversized upload is never held whole; take(n) (UploadMemory.share)
    before each chunk's n bytes are held (so a client that declares a length and sends nothing holds nothing)."""
    too_large = Refused(413, f"the upload is over the server's limit of {max_body:,} bytes; send a smaller photo",
                        "too_large")
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdecimal() and int(declared) > max_body:
        raise too_large
    body = bytearray()                  # grown in place: not chunks then joined (twice the body at the join)
    try:
        async for chunk in request.stream():
            if len(body) + len(chunk) > max_body:
                raise too_large
            take(len(chunk))
            body += chunk
    except ClientDisconnect:            # the client closed mid-upload, or uvicorn refused its chunked encoding
        raise Refused(400, "the upload ended before its end (the connection closed, or its chunked encoding is "
                           "broken)", "incomplete_upload") from None     # (400 is what uvicorn sent the latter)
    return body


async def upload_from(request: Request, max_body: int, take) -> tuple[bytes | bytearray, str]:
    """(image bytes, name) from a raw body or a multipart form's `file` field; take: read_body's. A body sent
    compressed (Content-Encoding: gzip, ...) is refused before it is read: 415 naming its coding, where it was
    read as a photo and answered "not an image" (undoing it would be a decompression bomb's door, and a photo
    is compressed already)."""
    codings = [coding.strip().lower() for value in request.headers.getlist("content-encoding")
               for coding in value.split(",") if coding.strip().lower() not in ("", "identity")]
    if codings:
        raise Refused(415, f"the upload is sent compressed (Content-Encoding: {', '.join(codings)[:60]}), which "
                           f"lnn-serve does not undo; send the photo's own bytes", "encoded_upload",
                      {"Accept-Encoding": "identity"})
    body = await read_body(request, max_body, take)
    media_type = request.headers.get("content-type", "").split(";", 1)[0].strip().lower()    # case-insensitive
    if media_type != "multipart/form-data":
        return body, UPLOAD_NAME

    async def once():
        yield body

    try:
        form = await MultiPartParser(request.headers, once(), max_files=1, max_fields=8, max_part_size=max_body).parse()
    except MultiPartException as err:
        raise Refused(400, f"the multipart form cannot be read ({err.message})", "bad_form") from None
    upload = form.get("file")
    if upload is None or isinstance(upload, str):
        raise Refused(400, "the multipart form has no `file` field holding the photo", "bad_form")
    data = await upload.read()
    await upload.close()
    return data, upload.filename or UPLOAD_NAME


def requested_top_k(request: Request, default: int, labels: int) -> int:
    """The query's top_k, at most the model's labels. ASCII digits only, counted rather than converted when
    long: int() refuses over 4,300 digits (a ValueError, answered 500), and any number that long is over
    every model's labels anyway. Given twice with different values: 400, not one of them picked silently."""
    values = request.query_params.getlist("top_k")
    if not values:
        return min(default, labels)
    given = values[0]
    if len(set(values)) > 1:
        raise Refused(400, f"top_k is given {len(values)} times with different values ({', '.join(map(repr, values))}); "
                           f"give it once", "bad_query")
    significant = given.lstrip("0")
    if not (given.isascii() and given.isdigit()) or not significant:
        raise Refused(400, f"top_k must be a whole number of at least 1, not {given!r}", "bad_query")
    return labels if len(significant) > len(str(labels)) else min(int(significant), labels)


def create_app(session, config: ServeConfig) -> Starlette:
    """The application for one loaded Session; the Batcher lives from startup to shutdown (the lifespan)."""
    metrics = Metrics()
    decoders = ThreadPoolExecutor(config.decode_threads, thread_name_prefix="lnn-serve-decode")
    # The heavy lane: photos that decode large, one at a time, so that they cannot hold every decoding thread (ten
    # 7000x7000 progressive JPEGs, 2 s of decoding each, left the ordinary photos sent with them to time out)
    heavy_decoder = ThreadPoolExecutor(1, thread_name_prefix="lnn-serve-decode-heavy")
    queue = QueuePlaces(config.queue)
    uploads = UploadMemory(config.upload_memory)
    page = resources.files("lnn.tools").joinpath("serve_page.html").read_text(encoding="utf-8")
    model_info = model_record(session)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        batcher = Batcher(session, config.max_batch, config.max_delay_s, metrics)
        app.state.batcher = batcher
        batcher.start()
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(decoders, load_image_libraries)
        warming = loop.create_task(batcher.warm_up())           # /healthz answers meanwhile; /readyz once done
        try:
            yield
        finally:
            warming.cancel()
            await batcher.close()
            for pool in (decoders, heavy_decoder):
                pool.shutdown(wait=False, cancel_futures=True)

    async def decoded(data, name: str) -> tuple:
        """prepare_upload on the decode pool, or, for a photo that decodes large, on the heavy lane."""
        loop = asyncio.get_running_loop()
        try:
            return await loop.run_in_executor(decoders, prepare_upload, session, data, config.max_pixels, name, True)
        except HeavyPhoto:
            return await loop.run_in_executor(heavy_decoder, prepare_upload, session, data, config.max_pixels, name)

    async def answer(request: Request) -> dict:
        with queue.place() as take_place:
            with uploads.share() as take:               # the upload's bytes count until decoded
                data, name = await upload_from(request, config.max_body, take)
                top_k = requested_top_k(request, config.top_k, len(session.labels))
                take_place()                            # a place in the --queue, once the upload is in
                batcher = request.app.state.batcher
                try:
                    with batcher.decoding():
                        prepared = await decoded(data, name)
                except LnnInputError as err:
                    raise Refused(400, " ".join(str(err).split()), "bad_image") from None
                del data                                # not held while the batch computes
            judged = await batcher.classify(prepared[0], prepared[1])
        return answer_record(session, judged, prepared, name, top_k)

    async def respond(request: Request) -> Response:
        """answer() as a Response; a refusal or a fault is answered here, inside wait_for's task: an exception
        let out of it is held, with its traceback's frames and the upload's bytes in them, in the reference
        cycle wait_for's frame makes with its task, until the next garbage collection (by hand, --upload-memory
        256 MB: 64 uploads of 10 MB that were no photos took the server to 631-654 MB; answered here, 350-378)."""
        try:
            return JSONResponse(await answer(request))
        except Refused as refused:
            return refusal(refused)
        except Exception as err:                      # noqa: BLE001 - a fault of the server, still one answer
            return refusal(Refused(500, f"the server failed on this photo ({type(err).__name__}: "
                                        f"{' '.join(str(err).split())})", "server_error"))

    async def classify(request: Request) -> Response:
        started = time.perf_counter()
        starting = request.app.state.batcher.refusal_while_starting()
        if starting is not None:
            response = refusal(starting)
        else:
            metrics.in_flight.inc()
            try:
                response = await asyncio.wait_for(respond(request), config.timeout_s)
            except asyncio.TimeoutError:
                response = refusal(Refused(504, f"no answer within {config.timeout_s:g} s; try again", "timeout"))
            finally:
                metrics.in_flight.dec()
        metrics.requests.labels(str(response.status_code)).inc()
        metrics.latency.observe(time.perf_counter() - started)
        return response

    def refusal(refused: Refused) -> Response:
        metrics.rejected.labels(refused.kind).inc()
        return error_response(refused.status, refused.reason, refused.headers)

    async def healthz(request: Request) -> Response:
        return JSONResponse({"alive": True})

    async def readyz(request: Request) -> Response:
        ready = request.app.state.batcher.ready.is_set()
        return JSONResponse({"ready": ready}, 200 if ready else 503)

    async def model(request: Request) -> Response:
        # the threads choices as they stand: the cpu backend times, per batch size, splitting a lone photo's
        # layers over its threads against one thread, and the batcher times the two again under load (LoneCalls);
        # both review their choice as calls go on
        return JSONResponse({**model_info, "threads_choice": session.describe_threads(),
                             "lone_photos_under_load": request.app.state.batcher.lone_calls.describe()})

    async def metrics_page(request: Request) -> Response:
        return Response(metrics.text(), media_type=CONTENT_TYPE_LATEST)

    async def home(request: Request) -> Response:
        return HTMLResponse(page)

    async def address_code(request: Request) -> Response:
        """The QR code of the page's address, which the page shows for another phone to scan: the address this
        browser used (its Host header), or, where that is this computer's loopback (a browser on the station's
        own computer), the one phones open (serve.phone_url, when the server listens beyond this computer)."""
        given = request.headers.get("host", "")
        if not HOST_HEADER.fullmatch(given):
            return error_response(400, f"the Host header {given[:80]!r} is not an address")
        url = f"http://{given}/"
        if not phones_can_open(url):
            url = request.app.state.phone_url
            if url is None or not phones_can_open(url):
                return error_response(404, "this server answers this computer only, so no phone can open its page; "
                                           "start it with --host 0.0.0.0 for the station's Wi-Fi")
        return Response(address_qr(url, "png"), media_type="image/png", headers={"Cache-Control": "no-store"})

    async def not_an_endpoint(request: Request, error: HTTPException) -> Response:
        """The router's 404 and 405 (and any other HTTPException) as the API's one-line JSON error, counted."""
        if error.status_code == 404:
            reason, message = "not_found", f"nothing here; lnn-serve answers {ENDPOINTS}"
        elif error.status_code == 405:
            reason = "method_not_allowed"
            message = (f"{request.method} is not answered at this address, only {error.headers['Allow']} "
                       f"(lnn-serve answers {ENDPOINTS})")
        else:
            reason, message = "bad_request", error.detail
        metrics.unserved.labels(str(error.status_code), reason).inc()
        return error_response(error.status_code, message, error.headers)

    routes = [Route("/", home), Route("/address.png", address_code), Route("/v1/classify", classify, methods=["POST"]),
              Route("/v1/model", model), Route("/healthz", healthz), Route("/readyz", readyz),
              Route("/metrics", metrics_page)]
    app = Starlette(routes=routes, lifespan=lifespan, exception_handlers={HTTPException: not_an_endpoint})
    # POST /v1/classify/ is a 404 naming the endpoints, not Starlette's 307 to the Host header's address (the
    # phone's upload sent twice, and to wherever that header says)
    app.router.redirect_slashes = False
    app.state.session, app.state.metrics = session, metrics
    app.state.phone_url = None              # the address phones open: serve.server_for sets it once it listens
    return app
