"""lnn-serve: answers equal lnn-infer's, batches really merge (each request still gets its own image's
answer), bad and excess input gets 400 / 413 / 503 / 504 with a one-line reason, metrics count what was
sent, SIGTERM drains a request in flight and exits 0, and the command's own errors are one line.

In-process tests run the app under uvicorn on a thread of the test, on a free loopback port, on the NumPy
backend (no JIT compile); the process tests start the real command the same way."""

import asyncio
import contextlib
import hashlib
import json
import os
import signal
import struct
import sys
import threading
import time
import zlib

import cv2
import numpy as np
import pytest

pytest.importorskip("uvicorn")
pytest.importorskip("starlette")
httpx = pytest.importorskip("httpx")
import uvicorn  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

import lnn  # noqa: E402
from cli_helpers import assert_one_line_error, run_command  # noqa: E402
from conftest import EXAMPLES, REPO, qr_code_text  # noqa: E402
from hostile_images import HEIC_START, with_data_left_over  # noqa: E402
from lnn.formats import limits  # noqa: E402
from lnn.tools import infer, serve_app  # noqa: E402
from lnn.tools.infer import DEFAULT_MODEL, answers_for  # noqa: E402
from lnn.tools.serve import ServeConfig, launch_process, listening_socket  # noqa: E402
from lnn.tools.serve_app import chunk_sizes, compile_in_a_child, create_app, judge_in_chunks  # noqa: E402

LEAVES = sorted((EXAMPLES / "leaves").glob("*.jpg"))


@pytest.fixture(scope="module")
def session():
    return lnn.load(DEFAULT_MODEL, device="numpy")


def reference_answer(session, path, name, top_k=3) -> dict:
    """lnn-infer's JSON object for one photo (photo checks, gate and all), computed without the server."""
    notes: list = []
    [answer] = answers_for(session, [(name, *session.prepare_and_check(path, notes=notes), notes)], top_k)
    return answer.as_dict()


def assert_same_answer(got: dict, want: dict) -> None:
    assert {k: v for k, v in got.items() if k not in ("confidence", "top_k")} == \
        {k: v for k, v in want.items() if k not in ("confidence", "top_k")}
    assert got["confidence"] == pytest.approx(want["confidence"], abs=1e-5)
    assert [t["label"] for t in got["top_k"]] == [t["label"] for t in want["top_k"]]
    assert [t["probability"] for t in got["top_k"]] == pytest.approx([t["probability"] for t in want["top_k"]], abs=1e-5)


def wait_ready(client, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while client.get("/readyz").status_code != 200:
        assert time.monotonic() < deadline, "the server never became ready"
        time.sleep(0.05)


@contextlib.contextmanager
def client_for(session, phone_url=None, ready=True, **settings):
    """An httpx client of the app, served by uvicorn on a thread, on a free loopback port, once it is ready
    (ready=False: once it has started); phone_url: the address phones open, as serve.server_for tells the app
    when it listens on a network."""
    sock = listening_socket("127.0.0.1", 0)
    app = create_app(session, ServeConfig(decode_threads=2, **settings))
    app.state.phone_url = phone_url
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on"))
    with running(server, sock), httpx.Client(base_url=f"http://127.0.0.1:{sock.getsockname()[1]}",
                                             timeout=60) as client:
        assert client.get("/healthz").json() == {"alive": True}
        if ready:
            wait_ready(client)
        yield client


@contextlib.contextmanager
def running(server, sock):
    """A uvicorn.Server on a thread of the test, serving on sock, from its start to its stop."""
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 30
        while not server.started:
            assert time.monotonic() < deadline, "uvicorn did not start"
            time.sleep(0.02)
        yield
    finally:
        server.should_exit = True
        thread.join(30)


@contextlib.contextmanager
def ended_at_exit(process):
    """Around a test's use of a lnn-serve process (launch_process): killed if it still runs at the end (an
    assertion failed first), so no test leaves a server behind."""
    try:
        yield process
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


def metric_samples(client) -> dict:
    """(name, sorted label items) -> value, from /metrics parsed as Prometheus text."""
    text = client.get("/metrics").text
    return {(sample.name, tuple(sorted(sample.labels.items()))): sample.value
            for family in text_string_to_metric_families(text) for sample in family.samples}


@pytest.fixture(scope="module")
def served(session):
    """One server for the tests that need no settings of their own (max batch 4, at most 1 megapixel)."""
    with client_for(session, max_batch=4, max_pixels=1_000_000) as client:
        yield client


def counted(before: dict, after: dict, name: str, **labels) -> float:
    key = (name, tuple(sorted(labels.items())))
    return after.get(key, 0) - before.get(key, 0)


def png_declaring(width: int, height: int) -> bytes:
    """A small, valid-looking PNG whose header declares width x height (a decompression bomb's shape)."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    header = struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(b"\0" * 1024)) + chunk(b"IEND", b"")


def test_answers_equal_lnn_infer_for_raw_and_multipart_uploads(session, served):
    for path in LEAVES[:3]:
        raw = served.post("/v1/classify", content=path.read_bytes())
        assert raw.status_code == 200, raw.text
        assert_same_answer(raw.json(), reference_answer(session, path, "upload"))
        form = served.post("/v1/classify?top_k=5", files={"file": (path.name, path.read_bytes(), "image/jpeg")})
        assert form.status_code == 200, form.text
        assert_same_answer(form.json(), reference_answer(session, path, path.name, top_k=5))


def test_the_load_scripts_client_sends_its_requests_on_one_connection(served, monkeypatch):
    """benchmarks/serve_load.py measures servers over keep-alive connections: its client must reuse one while the
    server keeps it open (it reconnected for every request while it asked httptools after the message, where
    should_keep_alive() is always False), and reconnect after a response that says `Connection: close`."""
    import asyncio

    monkeypatch.syspath_prepend(str(REPO / "benchmarks"))
    from serve_load import KeepAliveClient, Response

    async def three_posts() -> tuple[list, list]:
        client = KeepAliveClient(str(served.base_url))
        statuses, connections = [], []
        try:
            for path in LEAVES[:3]:
                status, _, _ = await client.post("/v1/classify", path.read_bytes(), "image/jpeg")
                statuses.append(status)
                connections.append(client.writer)
        finally:
            client.close()
        return statuses, connections

    statuses, connections = asyncio.run(three_posts())
    assert statuses == [200] * 3
    assert connections[0] is not None and all(writer is connections[0] for writer in connections)
    for head, keeps in ((b"HTTP/1.1 200 OK\r\n", True), (b"HTTP/1.1 200 OK\r\nConnection: close\r\n", False),
                        (b"HTTP/1.0 200 OK\r\n", False)):
        response = Response()
        response.parser.feed_data(head + b"Content-Length: 2\r\n\r\nok")
        assert (response.complete, response.keep_alive) == (True, keeps), head


def test_photos_that_are_not_diagnoses_get_lnn_infers_reason(session, served, tmp_path):
    """A dark photo (photo checks) and a photo of no leaf at all (the gate) answer as lnn-infer does."""
    leaf = cv2.imread(str(LEAVES[0]))
    dark = cv2.imencode(".jpg", (leaf * 0.1).astype(np.uint8))[1].tobytes()
    stripes = np.zeros((256, 256, 3), np.uint8)
    stripes[:, ::16] = (40, 90, 200)                               # orange and white stripes: no leaf
    stripes[:, 8::16] = 255
    for name, data in (("dark.jpg", dark), ("stripes.jpg", cv2.imencode(".jpg", stripes)[1].tobytes())):
        (tmp_path / name).write_bytes(data)
        got = served.post("/v1/classify", files={"file": (name, data, "image/jpeg")}).json()
        cli = json.loads(run_command("infer", "--json", "--device", "numpy", tmp_path / name).stdout)
        assert got["uncertain"] and got["reason"] is not None and "advice" not in got, got
        assert got["reason"] == cli["reason"] and got["instruction"] == cli["instruction"]
        assert_same_answer(got, reference_answer(session, tmp_path / name, name))


def test_a_jpeg_with_data_left_over_after_its_image_carries_lnn_infers_note(served, session, tmp_path):
    """Bytes before the end marker that no block uses (DJI drones write them; most damage ends so): answered,
    with the note lnn-infer gives (the page shows it)."""
    (tmp_path / "drone.jpg").write_bytes(with_data_left_over(LEAVES[0].read_bytes()))
    got = served.post("/v1/classify", content=(tmp_path / "drone.jpg").read_bytes()).json()
    assert len(got["notes"]) == 1 and "ran on after its image ended" in got["notes"][0]
    assert_same_answer(got, reference_answer(session, tmp_path / "drone.jpg", "upload"))


def test_lnn_infer_json_line_is_the_servers_object(served):
    """Against the command itself: the same keys and values as `lnn-infer --json`."""
    path = LEAVES[0]
    result = run_command("infer", "--json", "--device", "numpy", path)
    assert result.returncode == 0, result.stderr
    answer = served.post("/v1/classify", files={"file": (str(path), path.read_bytes())}).json()
    record = json.loads(result.stdout)
    runtime = {key: record.pop(key) for key in infer.RUNTIME_KEYS}        # lnn-infer's own: which backend answered
    assert runtime["device"] == "numpy" and set(answer).isdisjoint(infer.RUNTIME_KEYS)
    assert_same_answer(answer, record)


def test_batches_merge_and_each_request_gets_its_own_answer(session):
    """Eight different photos sent at once, max batch 4: they are computed in merged batches, and each
    answer is its own photo's (not a neighbour's in the batch)."""
    with client_for(session, max_batch=4, max_delay_s=2.0) as client:
        answers = {}

        def send(path):
            answers[path] = client.post("/v1/classify", files={"file": (path.name, path.read_bytes())})

        threads = [threading.Thread(target=send, args=(path,)) for path in LEAVES]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)
        for path in LEAVES:
            assert answers[path].status_code == 200
            assert_same_answer(answers[path].json(), reference_answer(session, path, path.name))
        assert len({answers[p].json()["label"] for p in LEAVES}) >= 6        # really different photos
        metrics = metric_samples(client)
    batches = metrics[("lnn_serve_batch_size_count", ())]
    assert metrics[("lnn_serve_batch_size_sum", ())] == 8 and batches < 8
    assert metrics[("lnn_serve_batch_size_bucket", (("le", "2.0"),))] < batches      # a batch of 3 or 4
    assert metrics[("lnn_serve_requests_total", (("status", "200"),))] == 8


def hold_first_batch(monkeypatch, before_each=None) -> tuple:
    """serve_app.judge_images patched so that its first call, once begun (the Event `computing`), waits for the
    Event `release`: a batch held on the inference thread while the test sends more. before_each(images): run at
    the start of every call (it may raise, as a model's fault would). -> (computing, release)"""
    judge_images = serve_app.judge_images
    computing, release = threading.Event(), threading.Event()

    def held_at_first(session_, images, checks):
        if before_each is not None:
            before_each(images)
        if not computing.is_set():
            computing.set()
            assert release.wait(30)
        return judge_images(session_, images, checks)

    monkeypatch.setattr(serve_app, "judge_images", held_at_first)
    return computing, release


def test_an_image_the_model_fails_on_costs_only_its_own_answer(session, monkeypatch):
    """One image whose computation fails (a fault, here made on purpose) gets 500; the others merged into its
    batch are computed again without it and get their answers, not the batch's 500. A first photo holds the
    inference thread until the poisoned one and two others wait, so those three make one batch."""
    poisoned = session.prepare_image(LEAVES[0])

    def failing_on_the_poisoned(images):
        if any(np.array_equal(image, poisoned) for image in images):
            raise RuntimeError("the model failed on this image")

    computing, release = hold_first_batch(monkeypatch, failing_on_the_poisoned)
    with client_for(session, max_batch=4) as client:
        answers = {}

        def send(path):
            answers[path] = client.post("/v1/classify", content=path.read_bytes())

        first = threading.Thread(target=send, args=(LEAVES[1],))
        first.start()
        assert computing.wait(30)
        others = [threading.Thread(target=send, args=(path,)) for path in (LEAVES[0], LEAVES[2], LEAVES[3])]
        for thread in others:
            thread.start()
        time.sleep(1.0)                                 # decoded and waiting behind the first
        release.set()
        for thread in [first, *others]:
            thread.join(60)
        metrics = metric_samples(client)
    assert metrics[("lnn_serve_batch_size_count", ())] == 2 and metrics[("lnn_serve_batch_size_sum", ())] == 4
    assert answers[LEAVES[0]].status_code == 500 and "failed on this image" in answers[LEAVES[0]].json()["error"]
    for path in LEAVES[1:4]:
        assert answers[path].status_code == 200
        assert_same_answer(answers[path].json(), reference_answer(session, path, "upload"))


def test_a_lone_request_does_not_wait_for_a_batch(session):
    """With nobody else on the way the batch runs at once: a 5 s --max-delay-ms costs a lone phone nothing."""
    photo = LEAVES[0].read_bytes()
    with client_for(session, max_batch=16, max_delay_s=5.0) as client:
        client.post("/v1/classify", content=photo)
        started = time.perf_counter()
        assert client.post("/v1/classify", content=photo).status_code == 200
        assert time.perf_counter() - started < 2.5


@contextlib.contextmanager
def photos_behind_a_batch_and_one_decoding(session, monkeypatch, max_delay_s):
    """A server whose first photo's batch holds the inference thread while a second photo is decoded and waits
    behind it, longer than max_delay_s, and a third is still being decoded (until the Event `decoded` is set).
    The batch is then released. -> (client, answered: {path: (response, perf_counter when answered)}, the
    senders' threads by path, when released, decoded); on leaving, the third photo is decoded and every request
    has ended."""
    prepare_upload = serve_app.prepare_upload
    computing, release = hold_first_batch(monkeypatch)
    decoded = threading.Event()
    slow_photo = LEAVES[2].read_bytes()

    def slow_for_one_photo(session_, data, *args):
        if bytes(data) == slow_photo:
            decoded.wait(30)
        return prepare_upload(session_, data, *args)

    monkeypatch.setattr(serve_app, "prepare_upload", slow_for_one_photo)
    with client_for(session, max_batch=16, max_delay_s=max_delay_s) as client:
        answered = {}

        def send(path):
            answered[path] = (client.post("/v1/classify", content=path.read_bytes()), time.perf_counter())

        threads = {path: threading.Thread(target=send, args=(path,)) for path in LEAVES[:3]}
        threads[LEAVES[0]].start()
        assert computing.wait(30)                      # the first photo's batch holds the inference thread
        threads[LEAVES[1]].start()                     # decoded, then waiting
        time.sleep(0.3)
        threads[LEAVES[2]].start()                     # still being decoded until `decoded`
        time.sleep(max_delay_s + 0.3)                  # the waiting photo's delay from its readiness has passed
        released = time.perf_counter()
        release.set()
        try:
            yield client, answered, threads, released, decoded
        finally:
            decoded.set()
            for thread in threads.values():
                thread.join(30)


def test_photos_that_waited_behind_a_batch_wait_for_those_still_decoding(session, monkeypatch):
    """--max-delay-ms counts from when the batcher began collecting: for a photo that waited behind a computing
    batch, from that batch's end, not from when the photo was ready. So it is merged with a photo still being
    decoded then (under load: the requests the batch's answers bring back), which keeps a busy server in step
    (each batch nearly every client's photo) instead of in two alternating halves (Batcher)."""
    with photos_behind_a_batch_and_one_decoding(session, monkeypatch, max_delay_s=2.0) as (
            client, answered, threads, released, decoded):
        time.sleep(0.5)
        assert LEAVES[1] not in answered               # waiting for the photo being decoded
        decoded.set()
        for thread in threads.values():
            thread.join(30)
        metrics = metric_samples(client)
    assert all(answered[path][0].status_code == 200 for path in LEAVES[:3])
    assert answered[LEAVES[1]][1] - released < 1.9                  # at once when the other was ready
    assert metrics[("lnn_serve_batch_size_count", ())] == 2 and metrics[("lnn_serve_batch_size_sum", ())] == 3


def test_a_photo_that_waited_behind_a_batch_waits_at_most_the_delay_more(session, monkeypatch):
    """The wait stays bounded: with the other photo's decoding stuck, the one that waited behind a batch runs
    alone once --max-delay-ms has passed from that batch's end."""
    with photos_behind_a_batch_and_one_decoding(session, monkeypatch, max_delay_s=1.0) as (
            _, answered, threads, released, _decoded):
        threads[LEAVES[1]].join(30)
        assert LEAVES[2] not in answered
    response, at = answered[LEAVES[1]]
    assert response.status_code == 200 and 0.9 < at - released < 2.2
    assert all(answered[path][0].status_code == 200 for path in LEAVES[:3])


def test_a_cpu_server_is_ready_only_once_its_calls_only_compute(monkeypatch):
    """Before /readyz says ready, the warm-up readies every chunk size on the inference thread (Session.warm_up):
    the CPU backend's kernels, buffers, split choice and the split plan's helper program, which compiles for
    seconds the first time. Warmed by one call of each size, lone photos built that program inside a request (a
    batch held for seconds under load). Here no program is built and no split is still being timed once the
    server is ready, whatever photos come."""
    from lnn.runtime.cpu import programs

    if not programs.AVAILABLE:
        pytest.skip("helper programs need the JIT")
    built = []
    build = programs.build
    monkeypatch.setattr(programs, "build", lambda *args: built.append(1) or build(*args))
    session = lnn.load(DEFAULT_MODEL, device="cpu", threads=2)
    with client_for(session, max_batch=4, max_delay_s=0.0) as client:
        ready = len(built)
        assert ready >= 1 and not session.backend.choosing(1)
        choice = client.get("/v1/model").json()["threads_choice"]       # decided: what lone photos run on
        assert choice == session.describe_threads() and "; batch 1: " in choice, choice
        for path in LEAVES[:4]:                                    # lone photos: batches of one
            assert client.post("/v1/classify", content=path.read_bytes()).status_code == 200
        assert len(built) == ready and not session.backend.choosing(1)


def test_lone_photos_under_load_are_timed_both_ways_and_the_faster_kept(monkeypatch):
    """LoneCalls: the session's own way and one thread take turns of LONE_TURN calls (the session's first), each
    timed from the last lone call's end to its own, a turn's first call untimed (counted, these would reverse the
    choice); the lower median is kept for LONE_REVIEW calls, then both are timed again. A lone call after any other
    call (a batch, a photo with none waiting, a failure) runs but is not counted. A session of one thread is never
    timed."""
    monkeypatch.setattr(serve_app, "LONE_TURN", 2)
    monkeypatch.setattr(serve_app, "LONE_TURNS", 2)
    monkeypatch.setattr(serve_app, "LONE_REVIEW", 5)
    lone = serve_app.LoneCalls(threads=4)
    assert lone.describe() == "as the session chose, until timed under load against one thread"
    clock = [0.0]

    def call(one_thread, seconds: float) -> None:
        clock[0] += seconds
        lone.ended(one_thread, clock[0])

    def trial(seconds_as_chosen: float, seconds_one_thread: float) -> list:
        ways = []
        for number in range(8):
            one_thread = lone.next_on_one_thread()
            ways.append(one_thread)
            if number % 2 == 0:                              # a turn's first call
                call(one_thread, 9.0 if one_thread else 0.0)
            else:
                call(one_thread, seconds_one_thread if one_thread else seconds_as_chosen)
        return ways

    call(False, 0.0)                                       # the first lone call: nothing before it to time from
    clock[0] += 5.0
    lone.other_call_ended()                                # a batch: the lone call after it is not counted either
    call(False, 5.0)
    assert trial(0.004, 0.002) == [False, False, True, True] * 2
    assert lone.describe() == ("one thread (timed under load: 2.00 ms from a call's end to the next on one thread, "
                               "4.00 as the session chose)")
    for _ in range(5):                                     # LONE_REVIEW calls of the way kept, then timed again
        assert lone.next_on_one_thread()
        call(True, 1.0)
    assert trial(0.002, 0.003) == [False, False, True, True] * 2
    assert lone.one_thread is False and lone.describe().startswith(
        "as the session chose (timed under load: 3.00 ms from a call's end to the next on one thread, 2.00 as the "
        "session chose)")
    alone = serve_app.LoneCalls(threads=1)
    alone.ended(False, 1.0)
    alone.ended(False, 2.0)
    assert not alone.next_on_one_thread() and alone.describe().startswith("not timed")


def test_an_unbatched_server_times_its_lone_photos_while_others_wait(session, monkeypatch):
    """--max-batch 1 under load: each photo computed while others wait, after another such photo, takes its turn in
    LoneCalls' trial (the session's way, then one thread through Session.one_thread); the first photo (none
    waiting), the one after it (nothing to time from) and the last (none waiting) run the session's way and are not
    counted. One thread made slower here, the session's way is kept; every answer is lnn-infer's."""
    monkeypatch.setattr(serve_app, "LONE_TURN", 2)
    monkeypatch.setattr(serve_app, "LONE_TURNS", 1)
    monkeypatch.setattr(session, "threads", 2)                 # as a cpu session on 2 cores
    inside, ways = [False], []

    @contextlib.contextmanager
    def slow_one_thread():
        inside[0] = True
        try:
            time.sleep(0.3)                             # slower than any jitter of the NumPy model's call
            yield
        finally:
            inside[0] = False

    monkeypatch.setattr(session, "one_thread", slow_one_thread)
    computing, release = hold_first_batch(monkeypatch, lambda images: ways.append(inside[0]))
    with client_for(session, max_batch=1) as client:
        answers = {}

        def send(path):
            answers[path] = client.post("/v1/classify", content=path.read_bytes())

        threads = [threading.Thread(target=send, args=(path,)) for path in LEAVES[:7]]
        threads[0].start()
        assert computing.wait(30)
        for thread in threads[1:]:
            thread.start()
        time.sleep(1.0)                                  # decoded and waiting behind the first
        release.set()
        for thread in threads:
            thread.join(60)
        described = client.get("/v1/model").json()["lone_photos_under_load"]
    assert ways == [False, False, False, False, True, True, False]
    assert described.startswith("as the session chose (timed under load: "), described
    for path in LEAVES[:7]:
        assert answers[path].status_code == 200
        assert_same_answer(answers[path].json(), reference_answer(session, path, "upload"))


def slow_upload(photo: bytes, pause_s: float):
    """A photo sent in two parts with a pause between (a phone on a weak Wi-Fi): the request stays in flight."""
    yield photo[:1000]
    time.sleep(pause_s)
    yield photo[1000:]


def test_batches_computed_in_chunks_give_the_whole_batchs_answers(session):
    images = np.stack([session.prepare_image(path) for path in LEAVES] + [session.prepare_image(LEAVES[0])] * 5)
    assert chunk_sizes(13) == [8, 4, 1] and chunk_sizes(16) == [8, 8] and chunk_sizes(7) == [4, 2, 1]
    chunked, reasons = judge_in_chunks(session, images, [None] * len(images))
    assert chunked.shape == (13, len(session.labels))
    whole = session.judge(images)
    np.testing.assert_allclose(chunked, whole.probabilities, rtol=1e-5, atol=1e-6)
    assert reasons == whole.reasons


@pytest.mark.parametrize("threads", [1, 2])
def test_a_batch_split_over_threads_is_one_call_and_one_thread_runs_chunks(session, threads):
    """On several threads the CPU backend splits a batch into units of images (any batch size is ready): the
    batcher's 13 images are one call, whose answers are the one-thread session's. On one thread: chunks of 8, 4
    and 1, the batch sizes whose buffers it keeps."""
    pytest.importorskip("numba")
    cpu = lnn.load(DEFAULT_MODEL, device="cpu", threads=threads)
    images = np.stack([session.prepare_image(path) for path in LEAVES] + [session.prepare_image(LEAVES[0])] * 5)
    assert cpu.backend.splits_batch(13) == (threads > 1)
    calls, run = [], cpu.backend.run_with_features
    cpu.backend.run_with_features = lambda x: calls.append(len(x)) or run(x)
    probabilities, reasons = judge_in_chunks(cpu, images, [None] * len(images))
    assert calls == ([13] if threads > 1 else [8, 4, 1])
    whole = session.judge(images)
    np.testing.assert_allclose(probabilities, whole.probabilities, rtol=1e-4, atol=1e-5)
    assert reasons == whole.reasons


def test_bad_images_get_400_with_lnn_infers_reason(served, tmp_path):
    truncated = LEAVES[0].read_bytes()[:2000]
    (tmp_path / "cut.jpg").write_bytes(truncated)
    cli = run_command("infer", "--device", "numpy", tmp_path / "cut.jpg")
    cli_reason = cli.stderr.split("cut.jpg: ", 1)[1].strip()
    before = metric_samples(served)
    leaf = LEAVES[0].read_bytes()
    cases = {"not an image": b"hello, not a photo", "truncated": truncated, "empty": b"",
             "a HEIC photo (an iPhone's own format), which lnn cannot read": HEIC_START + bytes(500),
             "over the server's limit of 1,000,000 pixels": png_declaring(5000, 5000),
             "the JPEG's data is damaged": leaf[:len(leaf) // 2] + b"\xff\xd9",   # half, its end marker pasted on
             f"more than {limits.MAX_JPEG_SEGMENTS} segments":             # refused as its header is read
             leaf[:2] + b"\xff\xfe\x00\x02" * (limits.MAX_JPEG_SEGMENTS + 1) + leaf[2:]}
    for fragment, body in cases.items():
        response = served.post("/v1/classify", content=body)
        assert response.status_code == 400, (fragment, response.text)
        reason = response.json()["error"]
        assert "\n" not in reason and (fragment in reason or fragment == "empty" and "empty" in reason), reason
        assert reason.startswith("upload: "), reason                       # the upload named, as lnn-infer names a file
    assert served.post("/v1/classify", content=truncated).json()["error"] == f"upload: {cli_reason}"
    named = served.post("/v1/classify", files={"file": ("IMG_0042.jpg", truncated)})      # as lnn-infer names the file
    assert named.status_code == 400 and named.json()["error"] == f"IMG_0042.jpg: {cli_reason}"
    no_field = served.post("/v1/classify", files={"photo": ("leaf.jpg", LEAVES[0].read_bytes())})
    assert no_field.status_code == 400 and "`file` field" in no_field.json()["error"]
    for k in ("0", "%C2%B2"):                      # ², which str.isdigit accepts and int() does not
        bad_k = served.post(f"/v1/classify?top_k={k}", content=LEAVES[0].read_bytes())
        assert bad_k.status_code == 400 and "top_k" in bad_k.json()["error"]
    after = metric_samples(served)
    assert counted(before, after, "lnn_serve_requests_total", status="400") == 12
    assert counted(before, after, "lnn_serve_rejected_total", reason="bad_image") == 9


def test_odd_top_k_queries_get_400_or_an_answer_never_500(served):
    """top_k of 5,000 digits answered 500 (int() refuses over 4,300 digits: a ValueError); a huge number is
    more than the labels: all of them. Given twice with different values: 400, not the last one silently."""
    photo = LEAVES[0].read_bytes()
    labels = len(served.get("/v1/model").json()["labels"])
    for k in ("9" * 5000, "99999999999999999999", "0" * 5000 + "2", "2&top_k=2"):
        response = served.post(f"/v1/classify?top_k={k}", content=photo)
        assert response.status_code == 200, (k[:30], response.text[:200])
        assert len(response.json()["top_k"]) == (2 if k.endswith("2") else labels)
    for k in ("-1", "1e3", "", "0" * 5000, "%D9%A3", "2&top_k=5"):          # %D9%A3: an Arabic-Indic 3
        response = served.post(f"/v1/classify?top_k={k}", content=photo)
        assert response.status_code == 400 and "top_k" in response.json()["error"], (k[:30], response.text[:200])


def test_uploads_cut_short_are_counted_as_400_not_as_server_faults(served):
    """A client that closes mid-upload, or whose chunked encoding uvicorn refuses (it answers 400 itself):
    /metrics counted each as a 500 server_error (starlette's ClientDisconnect reached the catch-all). Now
    each is one 400, reason incomplete_upload."""
    import socket

    photo = LEAVES[0].read_bytes()
    head = f"POST /v1/classify HTTP/1.1\r\nHost: x\r\nContent-Length: {len(photo)}\r\n\r\n".encode()
    chunked = b"POST /v1/classify HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
    before = metric_samples(served)
    for request in (head + photo[:3000], chunked + b"zz\r\nhello\r\n0\r\n\r\n", chunked + b"-5\r\nhello\r\n"):
        with socket.create_connection((served.base_url.host, served.base_url.port), timeout=10) as sock:
            sock.sendall(request)
            if request.startswith(head):
                sock.shutdown(socket.SHUT_WR)
            if not request.startswith(head):
                assert sock.recv(100).startswith(b"HTTP/1.1 400")
    deadline = time.monotonic() + 10
    while counted(before, metric_samples(served), "lnn_serve_requests_total", status="400") < 3:
        assert time.monotonic() < deadline, metric_samples(served)
        time.sleep(0.05)
    after = metric_samples(served)
    assert counted(before, after, "lnn_serve_rejected_total", reason="incomplete_upload") == 3
    assert counted(before, after, "lnn_serve_requests_total", status="500") == 0
    assert counted(before, after, "lnn_serve_request_seconds_count") == 3


def read_qr_code(png: bytes) -> str:
    return qr_code_text(cv2.imdecode(np.frombuffer(png, np.uint8), cv2.IMREAD_COLOR))


def test_the_pages_qr_code_is_the_address_this_phone_used(served):
    for host, address in (("192.168.1.23:8080", "http://192.168.1.23:8080/"), ("station.local", "http://station.local/"),
                          ("[fe80::1]:8080", "http://[fe80::1]:8080/")):
        code = served.get("/address.png", headers={"Host": host})
        assert code.status_code == 200 and code.headers["content-type"] == "image/png", code.text
        assert read_qr_code(code.content) == address
    alone = served.get("/address.png")                      # loopback, from a server that listens on loopback only
    assert alone.status_code == 404 and "this computer only" in alone.json()["error"], alone.text
    for host in ("two words", "a/b", "x" * 300, "host:port"):
        refused = served.get("/address.png", headers={"Host": host})
        assert refused.status_code == 400 and "Host header" in refused.json()["error"], (host, refused.text)


def test_a_browser_on_the_servers_own_computer_gets_the_code_phones_open(session):
    """A browser on the station's computer opens the page at 127.0.0.1: the code it shows is the address phones
    on the network open (serve.phone_url), not that loopback one, which would take a phone to itself."""
    with client_for(session, phone_url="http://192.168.1.23:8080/") as client:
        code = client.get("/address.png")
        assert code.status_code == 200 and read_qr_code(code.content) == "http://192.168.1.23:8080/"
        used = client.get("/address.png", headers={"Host": "10.0.0.5:8080"})
        assert read_qr_code(used.content) == "http://10.0.0.5:8080/"


def test_compressed_uploads_get_415_naming_their_coding(served):
    """Content-Encoding: gzip was read as the photo's bytes: 400 "not an image", a reason that sent the
    phone's developer looking at the photo."""
    import gzip

    photo = LEAVES[0].read_bytes()
    before = metric_samples(served)
    for coding in ("gzip", "identity, br", "Deflate"):
        refused = served.post("/v1/classify", content=gzip.compress(photo), headers={"Content-Encoding": coding})
        assert refused.status_code == 415 and refused.headers["accept-encoding"] == "identity", refused.text
        error = refused.json()["error"]
        assert "compressed" in error and coding.split(",")[-1].strip().lower() in error, error
    assert counted(before, metric_samples(served), "lnn_serve_rejected_total", reason="encoded_upload") == 3
    plain = served.post("/v1/classify", content=photo, headers={"Content-Encoding": "identity"})
    assert plain.status_code == 200, plain.text


def test_multipart_media_type_is_case_insensitive_and_bad_forms_leave_no_log_lines(served, caplog):
    """MULTIPART/FORM-DATA (media types are case-insensitive) was read as a raw body: 400, not an image.
    python-multipart's warnings on a malformed form reached stderr, a line per hostile request."""
    import logging

    photo = LEAVES[0].read_bytes()
    form = b"--B\r\nContent-Disposition: form-data; name=\"file\"; filename=\"leaf.jpg\"\r\n\r\n" + photo + b"\r\n--B--\r\n"
    response = served.post("/v1/classify", content=form, headers={"Content-Type": "Multipart/Form-Data; boundary=B"})
    assert response.status_code == 200 and response.json()["file"] == "leaf.jpg", response.text
    with caplog.at_level(logging.WARNING):
        for body in (b"\x00\xff" * 100, form.replace(b"--B", b"--C")):
            bad = served.post("/v1/classify", content=body, headers={"Content-Type": "multipart/form-data; boundary=B"})
            assert bad.status_code == 400 and "multipart form" in bad.json()["error"]
    assert not [record for record in caplog.records if "multipart" in record.name], caplog.text


def test_oversized_body_gets_413_declared_or_streamed(session):
    photo = LEAVES[0].read_bytes()
    with client_for(session, max_body=len(photo) - 1) as client:
        declared = client.post("/v1/classify", content=photo)
        streamed = client.post("/v1/classify", content=iter([photo[:1000], photo[1000:]]))   # chunked, no length
        assert declared.status_code == streamed.status_code == 413
        assert "limit" in declared.json()["error"]
        assert client.post("/v1/classify", content=photo[:-2000]).status_code == 400        # under it: decoded


def test_photos_that_decode_large_cannot_hold_up_the_ordinary_ones(session, monkeypatch):
    """A photo that decodes to more than HEAVY_DECODE_PIXELS is decoded on a lane of its own, one at a time: ten
    7000x7000 progressive JPEGs (2 s of decoding each) held every decoding thread, and ordinary photos sent with them
    got 504. Here three large photos' decoding is held until the ordinary ones sent after them are answered."""
    from lnn.runtime import preprocess

    large = cv2.imencode(".png", np.full((2048, 2048, 3), 90, np.uint8))[1].tobytes()     # 4.2 M pixels
    decode, release = preprocess._decode, threading.Event()

    def held_when_large(data, header, remarks):
        if header.decoded_pixels > serve_app.HEAVY_DECODE_PIXELS:
            release.wait(30)
        return decode(data, header, remarks)

    monkeypatch.setattr(preprocess, "_decode", held_when_large)
    with client_for(session, timeout_s=5.0) as client:
        answered = {}
        senders = [threading.Thread(target=lambda i=i: answered.setdefault(i, client.post("/v1/classify", content=large)))
                   for i in range(3)]
        for sender in senders:
            sender.start()
        time.sleep(0.5)                                 # the large photos are in, their decoding held
        ordinary = [client.post("/v1/classify", content=path.read_bytes()).status_code for path in LEAVES]
        release.set()
        for sender in senders:
            sender.join(30)
    assert ordinary == [200] * len(LEAVES)
    assert [answered[i].status_code for i in range(3)] == [200] * 3


def test_full_queue_gets_503_with_retry_after_and_slow_answers_504(session, monkeypatch):
    """--queue counts uploads that have arrived: one held in the model fills a queue of 1 (503 with Retry-After),
    while an upload still arriving takes no place (slow phones, or clients trickling their bodies, held every place
    until their --timeout, and the others got 503 with the model idle)."""
    photo = LEAVES[0].read_bytes()
    computing, release = hold_first_batch(monkeypatch)
    with client_for(session, queue=1, timeout_s=10) as client:
        answered = {}
        uploading = threading.Thread(target=lambda: answered.setdefault(
            "slow", client.post("/v1/classify", content=slow_upload(photo, 3.0))))
        uploading.start()
        time.sleep(0.5)                                 # still uploading: no place taken
        holder = threading.Thread(target=lambda: answered.setdefault("held", client.post("/v1/classify", content=photo)))
        holder.start()
        assert computing.wait(30)                       # the place is taken, by a photo held in the model
        refused = client.post("/v1/classify", content=photo)
        release.set()
        holder.join(30)
        uploading.join(30)
        assert refused.status_code == 503 and refused.headers["Retry-After"] == "1"
        assert "busy" in refused.json()["error"]
        assert answered["held"].status_code == answered["slow"].status_code == 200
        assert client.post("/v1/classify", content=photo).status_code == 200        # the place is free again
    with client_for(session, timeout_s=2.0) as client:
        late = client.post("/v1/classify", content=slow_upload(photo, 3.0))
        assert late.status_code == 504 and "2 s" in late.json()["error"]
        assert client.post("/v1/classify", content=photo).status_code == 200
        metrics = metric_samples(client)
    assert metrics[("lnn_serve_rejected_total", (("reason", "timeout"),))] == 1
    assert metrics[("lnn_serve_requests_total", (("status", "504"),))] == 1


def test_uploads_past_the_upload_memory_get_503_and_the_memory_comes_back(session):
    """--upload-memory bounds the bytes of uploads held at once: --queue uploads of --max-body each (64 x 10 MB)
    took 839 MB of a Raspberry Pi's memory. One past it gets 503 with Retry-After; the bytes are given back
    when a request's photo is decoded."""
    photo = LEAVES[0].read_bytes()
    with client_for(session, upload_memory=len(photo) + 500) as client:
        first = {}
        holder = threading.Thread(target=lambda: first.setdefault(
            "r", client.post("/v1/classify", content=slow_upload(photo, 1.5))))
        holder.start()
        time.sleep(0.5)                                 # the first holds 1000 bytes while it uploads
        refused = client.post("/v1/classify", content=photo)
        holder.join(30)
        assert refused.status_code == 503 and refused.headers["Retry-After"] == "1", refused.text
        assert "--upload-memory" in refused.json()["error"]
        assert first["r"].status_code == 200
        assert client.post("/v1/classify", content=photo).status_code == 200        # given back
        metrics = metric_samples(client)
    assert metrics[("lnn_serve_rejected_total", (("reason", "uploads_full"),))] == 1


def test_refused_uploads_are_not_held_after_their_answer(session):
    """A refusal raised out of wait_for's task stayed, with its traceback's frames and the upload's bytes in
    them, in a reference cycle until the next garbage collection: 64 uploads of 10 MB that were no photos took
    the server to 631-654 MB under a 256 MB --upload-memory. With the collector off, ten refused 2 MB uploads
    leave nothing behind."""
    import gc
    import tracemalloc

    junk = b"\xff\xd8" + bytes(2_000_000)              # a JPEG's first bytes, then no image
    with client_for(session) as client:
        assert client.post("/v1/classify", content=junk).status_code == 400
        gc.collect()
        gc.disable()
        tracemalloc.start()
        try:
            for chunked in [False] * 5 + [True] * 5:                         # declared length, then chunked
                body = iter([junk[:1000], junk[1000:]]) if chunked else junk
                assert client.post("/v1/classify", content=body).status_code == 400
            held = tracemalloc.get_traced_memory()[0]
        finally:
            tracemalloc.stop()
            gc.enable()
    assert held < 4_000_000, held


def test_uploads_that_time_out_are_not_held_after_their_504(session):
    """A request past --timeout is cancelled inside wait_for, whose frame and task hold its exception (a refusal
    raised out of that task kept the upload until the next garbage collection: the test above). With the
    collector off, five 2 MB uploads stalled past --timeout leave nothing behind (a body kept by the server
    fails it: 11 MB held)."""
    import gc
    import tracemalloc

    def stalled_upload():
        yield bytes(2_000_000)
        time.sleep(0.5)                                 # past --timeout: answered 504 meanwhile
        yield b"rest"

    with client_for(session, timeout_s=0.25) as client:
        assert client.post("/v1/classify", content=stalled_upload()).status_code == 504
        gc.collect()
        gc.disable()
        tracemalloc.start()
        try:
            for _ in range(5):
                assert client.post("/v1/classify", content=stalled_upload()).status_code == 504
            held = tracemalloc.get_traced_memory()[0]
        finally:
            tracemalloc.stop()
            gc.enable()
    assert held < 4_000_000, held


def test_blas_is_held_at_one_thread_while_a_background_server_runs():
    """A threaded BLAS call beside the server's own threads (decode pool, inference) left OpenBLAS's helper
    busy-waiting: lnn-field's BackgroundServer holds BLAS at one thread from start to stop, then gives the
    count back (lnn-serve's serve() holds it for the life of its process)."""
    from threadpoolctl import threadpool_info, threadpool_limits

    from lnn.tools.serve import BackgroundServer

    def blas_threads():          # {library: threads}; a BLAS loaded later (SciPy's, by Numba's kernels) is not compared
        return {library["filepath"]: library["num_threads"] for library in threadpool_info() if library["user_api"] == "blas"}

    with threadpool_limits(2, user_api="blas"):
        before = blas_threads()
        if not before:
            pytest.skip("NumPy found no BLAS library to hold")
        server = BackgroundServer(DEFAULT_MODEL, "127.0.0.1", 0)
        try:
            during = blas_threads()
            with httpx.Client(base_url=server.url) as client:
                wait_ready(client)
        finally:
            server.stop()
        after = blas_threads()
    assert {path: during[path] for path in before} == dict.fromkeys(before, 1)
    assert {path: after[path] for path in before} == before


def test_a_cpu_server_runs_on_the_usable_cores_by_default():
    """--threads auto, as lnn-infer: on the 2-core VM batching answered 1.18-1.43x the photos a second of one
    thread at 4 to 64 clients (docs/ARCHITECTURE.md, lnn-serve)."""
    from lnn.runtime import usable_cores
    from lnn.tools.serve import build_parser, server_for

    pytest.importorskip("numba")
    assert build_parser().parse_args([]).threads == "auto"
    server, sock = server_for(DEFAULT_MODEL, "127.0.0.1", 0, "cpu")
    sock.close()
    session = server.config.app.state.session
    assert session.threads == usable_cores() and session.threads_asked == "auto"


def test_model_page_and_metrics_endpoints(session, served):
    info = served.get("/v1/model").json()
    assert info["device"] == "numpy" and info["threads"] is None          # the NumPy backend has no count
    assert info["threads_choice"] == session.describe_threads()
    assert info["lone_photos_under_load"] == "not timed: the session has no threads to leave out"
    page = served.get("/")
    metrics = served.get("/metrics")
    assert info["sha256"] == hashlib.sha256(DEFAULT_MODEL.read_bytes()).hexdigest()
    assert [label["label"] for label in info["labels"]] == [label["name"] for label in session.labels]
    assert info["input"]["shape"] == list(session.input_shape) and info["name"] == session.model.name
    assert info["upload_side"] == 2 * session.decode_side() == 512    # the short side the page shrinks photos to
    assert page.status_code == 200 and 'capture="environment"' in page.text and "http" not in page.text.split("<script>")[1]
    assert metrics.headers["content-type"].startswith("text/plain")
    assert "lnn_serve_queue_depth" in metrics.text and "lnn_serve_request_seconds_bucket" in metrics.text


@contextlib.contextmanager
def guarded_server(keep_alive_s: float | None = None, **settings):
    """lnn-serve's whole server (server_for: the guarded protocol, NumPy backend) on a thread, on a free
    loopback port -> (its (host, port), the uvicorn.Server), once uvicorn has started. keep_alive_s: uvicorn's
    idle keep-alive timeout, when not its default (5 s)."""
    from lnn.tools.serve import server_for

    server, sock = server_for(DEFAULT_MODEL, "127.0.0.1", 0, "numpy", **settings)
    if keep_alive_s is not None:
        server.config.timeout_keep_alive = keep_alive_s
    with running(server, sock):
        yield sock.getsockname(), server


def test_endless_request_heads_get_431_and_idle_connections_are_closed():
    """uvicorn's httptools protocol has no limit on a request's headers (100 MB of one header took the
    server's memory up 146 MB) and never closes a connection that sends nothing (enough of them use up the
    open files and every other phone is refused). The server's protocol (serve.guarded_protocol): a head
    over HEAD_LIMIT is 431; no whole head within --timeout closes the connection, with 408 where part came."""
    import http.client
    import socket

    from lnn.tools.serve import HEAD_LIMIT

    with guarded_server(timeout_s=1.0) as (address, server):
        with socket.create_connection(address, timeout=10) as big:
            big.sendall(b"GET /healthz HTTP/1.1\r\nX-Big: " + b"a" * (HEAD_LIMIT // 2))
            time.sleep(0.1)
            big.sendall(b"a" * (HEAD_LIMIT // 2))
            assert refusal_of(read_to_end(big), 431) == f"the request's line and headers are over {HEAD_LIMIT:,} bytes"
        idle = [socket.create_connection(address, timeout=10) for _ in range(50)]
        idle[0].sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n")                      # a head that never ends
        kept = http.client.HTTPConnection(*address, timeout=10)
        for pause in (0, 0.6):                                       # a kept-alive connection is not cut short
            time.sleep(pause)
            kept.request("GET", "/healthz")
            assert kept.getresponse().read() == b'{"alive":true}'
        kept.close()
        assert idle[0].recv(100).startswith(b"HTTP/1.1 408 ")
        assert [connection.recv(100) for connection in idle[1:]] == [b""] * 49       # closed by the server
        for connection in idle:
            connection.close()
        metrics = metric_samples(httpx.Client(base_url=f"http://{address[0]}:{address[1]}"))
    assert counted({}, metrics, "lnn_serve_unserved_total", status="431", reason="head_too_large") == 1
    assert counted({}, metrics, "lnn_serve_unserved_total", status="408", reason="head_timeout") == 1


def refusal_of(answer: bytes, status: int) -> str:
    """The message of one refusal the protocol wrote (the whole of what came), checked to be the API's JSON error
    with that status, as the application's errors are."""
    head, body = answer.split(b"\r\n\r\n", 1)
    assert head.startswith(b"HTTP/1.1 %d " % status) and b"\r\ncontent-type: application/json\r\n" in head, head
    error = json.loads(body)
    assert set(error) == {"error", "status"} and error["status"] == status, error
    return error["error"]


def read_to_end(connection) -> bytes:
    """What the server sends on a raw socket until it shuts its side (or the socket's timeout passes)."""
    received = b""
    with contextlib.suppress(OSError):
        while chunk := connection.recv(65536):
            received += chunk
    return received


def test_an_answer_before_the_body_is_in_says_close_and_the_rest_is_dropped_for_the_timeout():
    """An answer sent before its request's body was all in (413 here) did not say `connection: close`: a client
    that skipped the rest of its body (curl after Expect: 100-continue) had its next request read as that body,
    and uvicorn read and dropped an endless body for ever. Now the answer says close, the server shuts its side
    once the answer is out, drops what still comes until the client closes or --timeout passes (not uvicorn's
    shorter keep-alive timeout), then closes (at once, with bytes unread, the reset could cost the client the
    answer); nothing after it is answered."""
    import socket

    with guarded_server(timeout_s=1.0, max_body=1000, keep_alive_s=0.2) as (address, server):
        with socket.create_connection(address, timeout=10) as endless:
            endless.sendall(b"POST /v1/classify HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n")
            endless.settimeout(0.02)
            answer = b""
            while b"}" not in answer:
                endless.sendall(b"400\r\n" + b"a" * 1024 + b"\r\n")
                with contextlib.suppress(socket.timeout):
                    answer += endless.recv(4096)
            answered = time.monotonic()
            assert answer.startswith(b"HTTP/1.1 413 ") and b"connection: close\r\n" in answer, answer
            assert endless.recv(4096) == b""                                  # the server's side shut
            with contextlib.suppress(OSError):                                # reset once the server closes
                while time.monotonic() - answered < 5:
                    endless.sendall(b"400\r\n" + b"a" * 1024 + b"\r\n")
                    time.sleep(0.02)
            cut_after = time.monotonic() - answered
        assert 0.9 < cut_after < 3, cut_after
        client = httpx.Client(base_url=f"http://{address[0]}:{address[1]}")
        for request in (b"Content-Length: 2000\r\n\r\n" + b"a" * 500,          # declared over --max-body
                        b"Content-Length: 2000\r\nExpect: 100-continue\r\n\r\n"):   # the body never sent
            with socket.create_connection(address, timeout=10) as finite:
                finite.sendall(b"POST /v1/classify HTTP/1.1\r\nHost: x\r\n" + request)
                answer = read_to_end(finite)
                assert answer.startswith(b"HTTP/1.1 413 ") and b"connection: close\r\n" in answer, answer
                assert answer.count(b"HTTP/1.1 ") == 1                      # no 100 Continue
                finite.sendall(b"a" * 1500 + b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
                time.sleep(0.2)
                finite.shutdown(socket.SHUT_WR)                              # the client closes: so does the server
                closed_after, started = None, time.monotonic()
                while closed_after is None and time.monotonic() - started < 3:
                    if metric_samples(client)[("lnn_serve_connections", ())] == 1:     # the metrics client's own
                        closed_after = time.monotonic() - started
                assert finite.recv(4096) == b""                             # the healthz request: no answer
            assert closed_after is not None and closed_after < 0.8, closed_after
        assert client.get("/healthz").status_code == 200
        client.close()


def test_connections_over_the_limit_get_503_and_malformed_http_is_counted_without_log_lines(capfd):
    """More than --max-connections open: 503 with Retry-After before any request is read (each connection is an
    open file; past the process's limit accept() failed and new phones were left hanging). uvicorn's own 400
    for bytes that are not HTTP is counted in /metrics (bad_http), without its warning line per request, and
    comes as soon as they cannot begin a request's head."""
    import socket

    with guarded_server(max_connections=4) as (address, server):
        client = httpx.Client(base_url=f"http://{address[0]}:{address[1]}")
        assert client.get("/healthz").status_code == 200                    # the client's own connection: 1
        held = [socket.create_connection(address, timeout=10) for _ in range(3)]
        over = [socket.create_connection(address, timeout=10) for _ in range(2)]
        for connection in over:
            answer = read_to_end(connection)                                  # and closed
            assert b"\r\nretry-after: 1\r\n" in answer and "4 connections" in refusal_of(answer, 503)
        for connection in held + over:
            connection.close()
        time.sleep(0.2)
        # a TLS hello (a phone that tried https://), a head whose lines end in LF alone (httptools refuses them),
        # something that is no HTTP but ends like a head: 400 at once, not a 408 after --timeout (10 s)
        for not_http in (bytes.fromhex("160301020001000200") + bytes(100), b"\r\n\x00\x01 binary",
                         b"POST /v1/classify HTTP/1.1\nHost: x\nContent-Length: 3\n\nabc",
                         b"\x16\x03\x01\x02\x00 not HTTP\r\n\r\n"):
            with socket.create_connection(address, timeout=10) as garbage:
                started = time.monotonic()
                garbage.sendall(not_http)
                assert garbage.recv(4096).startswith(b"HTTP/1.1 400 "), not_http
                assert time.monotonic() - started < 2, not_http
        metrics = metric_samples(client)
        client.close()
    assert counted({}, metrics, "lnn_serve_unserved_total", status="503", reason="too_many_connections") == 2
    assert counted({}, metrics, "lnn_serve_unserved_total", status="400", reason="bad_http") == 4
    assert metrics[("lnn_serve_connections", ())] == 1
    assert "Invalid HTTP request" not in capfd.readouterr().err


def test_a_broken_chunked_upload_gets_the_json_error_of_every_other_answer():
    """A chunked body the parser cannot read (a chunk size that is no number, or data past its size) was answered
    by uvicorn's own 400 in plain text; lnn-serve's protocol answers it with the API's one-line JSON error."""
    import socket

    chunked = b"POST /v1/classify HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
    with guarded_server() as (address, server):
        for body in (b"zz\r\nhello\r\n0\r\n\r\n", b"5\r\nhelloXX\r\n0\r\n\r\n", b"ffffffffffffffffffff\r\nhi"):
            with socket.create_connection(address, timeout=10) as connection:
                connection.sendall(chunked + body)
                assert "chunked encoding is broken" in refusal_of(read_to_end(connection), 400), body


def raw_exchange(address, data: bytes, half_close: bool = False, wait_s: float = 10) -> list:
    """Send bytes on a new connection (then shutdown(SHUT_WR) if half_close), read until the server closes it
    or wait_s passes -> the statuses of the answers, in the order they came."""
    import re
    import socket

    with socket.create_connection(address, timeout=wait_s) as connection:
        connection.sendall(data)
        if half_close:
            connection.shutdown(socket.SHUT_WR)
        received = read_to_end(connection)
    return [int(status) for status in re.findall(rb"HTTP/1\.1 (\d{3}) ", received)]


def classify_request(photo: bytes, *headers: bytes) -> bytes:
    return (b"POST /v1/classify HTTP/1.1\r\nHost: x\r\n" + b"".join(h + b"\r\n" for h in headers) +
            b"Content-Length: %d\r\n\r\n" % len(photo) + photo)


def test_the_protocol_answers_in_order_and_keeps_its_answers_for_clients_that_stop_sending():
    """The protocol's own refusals came out of turn: garbage pipelined behind a photo got its 400 written
    first, and the photo's answer was lost; a client that half-closed after its request (nc -N) got no answer
    at all; a stalled upload pipelined behind another request lost its 504 (the wrong request's body was
    watched); an h2c Upgrade header (curl --http2, Java's HttpClient) made httptools skip the photo."""
    photo = LEAVES[0].read_bytes()
    healthz = b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n"
    with guarded_server(timeout_s=1.0) as (address, server):
        assert raw_exchange(address, classify_request(photo) + b"\x16\x03 not HTTP\r\n\r\n") == [200, 400]
        assert raw_exchange(address, classify_request(photo) + healthz, half_close=True) == [200, 200]
        stalled = b"POST /v1/classify HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % len(photo) + photo[:500]
        assert raw_exchange(address, healthz + stalled) == [200, 504]
        upgrade = classify_request(photo, b"Connection: Upgrade, HTTP2-Settings", b"Upgrade: h2c",
                                   b"HTTP2-Settings: AAMAAABkAAQAAP__", b"Connection: close")
        assert raw_exchange(address, upgrade) == [200]
        metrics = metric_samples(httpx.Client(base_url=f"http://{address[0]}:{address[1]}"))
    assert counted({}, metrics, "lnn_serve_requests_total", status="200") == 3
    assert counted({}, metrics, "lnn_serve_requests_total", status="504") == 1
    assert counted({}, metrics, "lnn_serve_unserved_total", status="400", reason="bad_http") == 1


def test_a_client_that_pipelines_without_reading_is_bounded_and_cut_off():
    """uvicorn parsed each read whole into its queue of pipelined requests and read on after every answer: one
    client pipelining GET /healthz without reading its answers took the server to 790 MB in 7 s, and a client
    that never reads held its connection (and the slot under --max-connections) for ever. Now at most
    PIPELINE_LIMIT wait (then 503 and the connection closed), and answers unread for --timeout close it."""
    import socket

    from lnn.tools.serve import PIPELINE_LIMIT

    with guarded_server(timeout_s=1.0) as (address, server):
        client = httpx.Client(base_url=f"http://{address[0]}:{address[1]}")
        statuses = raw_exchange(address, b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n" * (PIPELINE_LIMIT * 4))
        assert statuses == [200] * (PIPELINE_LIMIT + 1) + [503], statuses
        # A client whose answers are left unread: the transport pauses the protocol's writes once its buffer
        # is full (the kernel's buffers on loopback hold megabytes first, so the pause is made here)
        with socket.create_connection(address, timeout=10) as stalled:
            stalled.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
            assert stalled.recv(4096).startswith(b"HTTP/1.1 200 ")
            [protocol] = [p for p in server.server_state.connections if p.transport.get_extra_info("peername")
                          == stalled.getsockname()]
            protocol.loop.call_soon_threadsafe(protocol.pause_writing)
            time.sleep(0.5)
            assert stalled.getsockname() in [p.transport.get_extra_info("peername")
                                             for p in server.server_state.connections]
            time.sleep(1.0)                             # past --timeout, still paused: closed
            assert stalled.recv(100) == b""
        metrics = metric_samples(client)
        client.close()
    assert metrics[("lnn_serve_connections", ())] == 1
    assert counted({}, metrics, "lnn_serve_unserved_total", status="503", reason="pipeline_full") == 1


def test_unknown_addresses_and_methods_get_the_apis_json_error_and_are_counted(served):
    before = metric_samples(served)
    missing = served.get("/v1/clasify")
    slash = served.post("/v1/classify/", content=b"photo", headers={"Host": "elsewhere.example"})
    assert slash.status_code == 404 and "location" not in slash.headers       # was a 307 to elsewhere.example
    wrong_method = served.get("/v1/classify")
    assert missing.status_code == 404 and "POST /v1/classify" in missing.json()["error"]
    assert wrong_method.status_code == 405 and wrong_method.headers["Allow"] == "POST"
    assert wrong_method.json() == {"status": 405, "error": wrong_method.json()["error"]}
    assert wrong_method.json()["error"].startswith("GET is not answered at this address, only POST")
    after = metric_samples(served)
    assert counted(before, after, "lnn_serve_unserved_total", status="404", reason="not_found") == 2
    assert counted(before, after, "lnn_serve_unserved_total", status="405", reason="method_not_allowed") == 1


def test_the_command_raises_its_open_files_limit_to_the_hard_one():
    """Each connection is a file: under a soft limit of 1,024, about 1,000 open connections got every further
    phone's connection reset. lnn-serve raises its soft limit to the hard one at start."""
    resource = pytest.importorskip("resource")
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or min(soft, hard) <= 256:
        pytest.skip("no finite hard limit over 256 to raise a low soft limit to")
    process, _ = launch_process("--port", "0", "--device", "numpy",
                                preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (256, hard)))
    try:
        limits = open(f"/proc/{process.pid}/limits").read() if sys.platform == "linux" else None
    finally:
        process.terminate()
        process.wait(timeout=30)
    if limits is not None:
        [line] = [line for line in limits.splitlines() if line.startswith("Max open files")]
        assert line.split()[3:5] == [str(hard), str(hard)], line


def test_max_connections_stays_under_the_open_files_limit():
    """Past the open-files limit accept() fails and a new phone is left hanging, unanswered: --max-connections is
    held under it (the limit less FILES_KEPT_FREE), so the connection after the last gets 503 instead."""
    import socket

    resource = pytest.importorskip("resource")
    from lnn.tools.serve import FILES_KEPT_FREE

    files = 300
    process, url = launch_process("--port", "0", "--device", "numpy",
                                  preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (files, files)))
    cap = files - FILES_KEPT_FREE
    address = httpx.URL(url).host, httpx.URL(url).port
    try:
        held = [socket.create_connection(address, timeout=10) for _ in range(cap)]
        with socket.create_connection(address, timeout=10) as over:
            answer = over.recv(4096)
        assert answer.startswith(b"HTTP/1.1 503 ") and f"{cap:,} connections".encode() in answer, answer
        for connection in held:
            connection.close()
    finally:
        process.terminate()
        process.wait(timeout=30)


def test_a_request_head_half_sent_at_sigterm_gets_503():
    """uvicorn closed a connection whose request head was still arriving when SIGTERM came, unanswered."""
    import socket

    process, url = launch_process("--port", "0", "--device", "numpy")
    with ended_at_exit(process):
        with httpx.Client(base_url=url) as client:
            wait_ready(client)
        with socket.create_connection((httpx.URL(url).host, httpx.URL(url).port), timeout=10) as sock:
            sock.sendall(b"POST /v1/classify HTTP/1.1\r\nHost: x\r\n")
            time.sleep(0.2)
            process.send_signal(signal.SIGTERM)
            answer = sock.recv(200)
        assert answer.startswith(b"HTTP/1.1 503 ") and b"retry-after: 1" in answer, answer
        assert process.wait(timeout=30) == 0


def test_sigterm_right_after_the_banner_stops_the_server():
    """A SIGTERM between the banner and uvicorn's own handler was swallowed by lnn-serve's no-op handler:
    the server ran on and ignored it. Now it stops the server once started, exit 0."""
    for _ in range(2):
        process, _ = launch_process("--port", "0", "--device", "numpy")
        process.send_signal(signal.SIGTERM)
        with ended_at_exit(process):
            assert process.wait(timeout=30) == 0, "".join(process.stderr_lines)


@pytest.mark.parametrize("stop, exit_code", [(signal.SIGTERM, 0), (signal.SIGINT, 130)], ids=["SIGTERM", "Ctrl-C"])
def test_stopping_during_the_warm_up_exits_at_once(stop, exit_code):
    """A SIGTERM or Ctrl-C while the model still warmed up (a first start compiles its kernels for seconds)
    waited, silently, for the compile to end: 12 and 14 s on a fresh machine. Now the server leaves at once
    (exit 0, or 130 after Ctrl-C, as every lnn command), saying so. (A warm-up that sleeps stands in for the
    compile.)"""
    slow_warm_up = ("import sys, time; import lnn.runtime as runtime; "
                    "runtime.Session.warm_up = lambda self, *a, **k: time.sleep(60); "
                    "from lnn.tools.serve import main; sys.exit(main())")
    process, url = launch_process("--port", "0", "--device", "numpy", program=("-c", slow_warm_up))
    with ended_at_exit(process):
        with httpx.Client(base_url=url) as client:
            assert client.get("/readyz").status_code == 503
        sent = time.monotonic()
        process.send_signal(stop)
        assert process.wait(timeout=30) == exit_code, "".join(process.stderr_lines)
        assert time.monotonic() - sent < 5
        process.stderr_reader.join(10)                 # every line of its stderr read
        assert "stopped during the model's warm-up" in "".join(process.stderr_lines)
        assert "Traceback" not in "".join(process.stderr_lines)


TINY_PHOTO_MODEL = {"name": "tiny", "input_shape": [3, 16, 16], "labels": ["one", "two"],
                    "preprocess": {"color": "rgb", "scale": 1 / 255, "mean": [0.5] * 3, "std": [0.25] * 3},
                    "layers": [{"type": "conv2d", "out_channels": 4, "kernel_size": 3, "padding": 1,
                                "activation": "relu"}, {"type": "flatten"}, {"type": "linear", "out_features": 2}]}
# lnn-serve with Numba's cache log (NUMBA_DEBUG_CACHE prints to stdout, which launch_process drops) on stderr
SERVE_WITH_CACHE_LOG = "import sys; sys.stdout = sys.stderr; from lnn.tools.serve import main; sys.exit(main())"


@pytest.fixture
def tiny_photo_model(tmp_path):
    """A photo model whose kernels compile in seconds, with random weights, as a .bin."""
    from lnn.tests.model_weights import random_weights
    from lnn.formats.binfile import write_bin
    from lnn.formats.model import parse_model

    model = parse_model(TINY_PHOTO_MODEL)
    path = tmp_path / "tiny.bin"
    write_bin(path, model, random_weights(model))
    return path


def child_processes(pid: int, timeout_s: float = 30.0) -> list:
    """The children of process pid, once it has some."""
    deadline = time.monotonic() + timeout_s
    while not (children := open(f"/proc/{pid}/task/{pid}/children").read().split()):
        assert time.monotonic() < deadline, "no child process was started"
        time.sleep(0.02)
    return [int(child) for child in children]


def is_running(pid: int) -> bool:
    """pid is a process that has not ended (not gone, not a zombie)."""
    try:
        return open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads the process tree in /proc")
def test_a_first_start_compiles_in_a_child_process_and_the_server_only_loads_the_cache(tiny_photo_model, tmp_path):
    """Compiled in the server itself, Numba's compiler kept its memory for the server's life (about 170 MiB
    for the bundled model). A first start compiles in a child process, which a SIGTERM meanwhile kills with the
    server; the server itself then only loads what the child saved (Numba's cache log), answers, and a later
    start starts no child."""
    env = {**{k: v for k, v in os.environ.items() if k != "NUMBA_CACHE_DIR"},
           "LNN_CACHE_DIR": str(tmp_path / "cache"), "NUMBA_DEBUG_CACHE": "1"}
    options = ("--model", tiny_photo_model, "--port", "0", "--threads", "1")

    process, _ = launch_process(*options, program=("-c", SERVE_WITH_CACHE_LOG), env=env)
    with ended_at_exit(process):
        [compiling] = child_processes(process.pid)
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=30) == 0, "".join(process.stderr_lines)
        deadline = time.monotonic() + 5
        while is_running(compiling):
            assert time.monotonic() < deadline, "the compile's child process outlived the server"
            time.sleep(0.02)

    for start in ("first", "later"):
        process, url = launch_process(*options, program=("-c", SERVE_WITH_CACHE_LOG), env=env)
        with ended_at_exit(process):
            with httpx.Client(base_url=url, timeout=60) as client:
                wait_ready(client)
                answer = client.post("/v1/classify", content=LEAVES[0].read_bytes())
                assert answer.status_code == 200 and answer.json()["label"] in TINY_PHOTO_MODEL["labels"]
            process.send_signal(signal.SIGTERM)
            assert process.wait(timeout=30) == 0
            process.stderr_reader.join(10)                 # every line of its stderr read
        log = "".join(process.stderr_lines)
        assert ("compiling its kernels in a child process" in log) == (start == "first"), log
        assert "[cache] data loaded from" in log and "[cache] data saved to" not in log, log


@pytest.mark.parametrize("failure, why", [
    ("child", "MemoryError: the child ran out"),
    ("no child", "FileNotFoundError: [Errno 2] No such file or directory: '/no/such/python'")])
def test_a_compile_in_a_child_process_that_fails_is_left_to_the_server(tiny_photo_model, monkeypatch, capfd,
                                                                       failure, why):
    """The child's last line, or why no child could start, says why; the server goes on to compile in its own
    process."""
    from lnn.runtime.cpu import jit

    monkeypatch.setattr(jit, "CACHE_ENABLED", True)
    if failure == "child":
        monkeypatch.setattr(serve_app, "COMPILE_IN_A_CHILD", "import sys; sys.exit('MemoryError: the child ran out')")
    else:
        monkeypatch.setattr(sys, "executable", "/no/such/python")
    session = lnn.load(tiny_photo_model, device="cpu", threads=1)
    assert asyncio.run(compile_in_a_child(session)) is False
    assert capfd.readouterr().err.splitlines()[-1] == (f"lnn-serve: compiling the kernels in a child process failed "
                                                       f"({why}); compiling them in this one")


def test_requests_while_the_kernels_compile_get_503_at_once_then_answers(monkeypatch):
    """A first start compiles for about 40 s on the 2-core VM, more on a slower CPU: a request meanwhile gets
    503 at once, with Retry-After and the reason (held until --timeout, it got a 504 saying only that no answer
    came); once the compile is done the server answers. (A child that sleeps stands in for the compile.)"""
    from lnn.runtime.cpu import cache, jit

    monkeypatch.setattr(jit, "KERNELS", "jit")
    monkeypatch.setattr(jit, "CACHE_ENABLED", True)
    monkeypatch.setattr(cache, "kernels_cached", lambda model: False)
    monkeypatch.setattr(serve_app, "COMPILE_IN_A_CHILD", "import time; time.sleep(2)")
    session = lnn.load(DEFAULT_MODEL, device="cpu", threads=1)
    with client_for(session, ready=False) as client:
        sent = time.monotonic()
        answer = client.post("/v1/classify", content=LEAVES[0].read_bytes())
        assert time.monotonic() - sent < 1
        assert answer.status_code == 503 and answer.headers["Retry-After"] == "30"
        assert answer.json()["error"].startswith("the server is still preparing its model")
        assert client.get("/readyz").status_code == 503
        wait_ready(client)
        assert client.post("/v1/classify", content=LEAVES[0].read_bytes()).status_code == 200
        assert metric_samples(client)[("lnn_serve_rejected_total", (("reason", "starting"),))] == 1


def test_a_failed_warm_up_is_said_to_every_request():
    """Not a 504 after --timeout for each request, as if the server were only slow."""
    session = lnn.load(DEFAULT_MODEL, device="numpy")
    session.warm_up = lambda size: (_ for _ in ()).throw(MemoryError("no memory left"))
    with client_for(session, ready=False, timeout_s=2) as client:
        deadline = time.monotonic() + 10
        while (answer := client.post("/v1/classify", content=LEAVES[0].read_bytes())).status_code != 503:
            assert time.monotonic() < deadline, answer.status_code
        assert answer.json()["error"] == ("the server's model failed to start (no memory left); whoever runs the "
                                          "server should read its log")
        assert "Retry-After" not in answer.headers and client.get("/readyz").status_code == 503


def test_sigterm_drains_the_request_in_flight_and_exits_0():
    """A real lnn-serve on a free loopback port: a request still uploading when SIGTERM arrives gets its
    answer, and the process then exits 0."""
    process, url = launch_process("--port", "0", "--device", "numpy")
    with ended_at_exit(process):
        with httpx.Client(base_url=url) as client:
            wait_ready(client)
        result = {}
        sender = threading.Thread(target=lambda: result.setdefault(
            "r", httpx.post(url + "v1/classify", content=slow_upload(LEAVES[0].read_bytes(), 1.5), timeout=30)))
        sender.start()
        time.sleep(0.5)
        process.send_signal(signal.SIGTERM)
        sender.join(30)
        assert process.wait(timeout=30) == 0, "".join(process.stderr_lines)
        assert result["r"].status_code == 200 and result["r"].json()["label"]
        process.stderr_reader.join(10)                 # every line of its stderr read
        assert "Traceback" not in "".join(process.stderr_lines)


def test_the_systemd_unit_runs_a_valid_command_that_stops_with_its_drain():
    """packaging/lnn-serve.service (the station's box starts the server at boot): its ExecStart is lnn-serve with
    options the command takes, on the station's network; systemd stops it with SIGTERM (the drain) and waits
    longer than a request in flight may take (--timeout) before it kills it; it restarts after a failure."""
    import configparser
    import shlex

    from lnn.tools.serve import build_parser

    unit = configparser.ConfigParser(interpolation=None)
    unit.optionxform = str                                   # systemd's keys are case-sensitive
    unit.read(REPO / "packaging" / "lnn-serve.service")
    program, *arguments = shlex.split(unit["Service"]["ExecStart"])
    options = build_parser().parse_args(arguments)
    assert program.endswith("/bin/lnn-serve") and options.host == "0.0.0.0"
    assert unit["Service"]["KillSignal"] == "SIGTERM" and unit["Service"]["Restart"] == "on-failure"
    assert float(unit["Service"]["TimeoutStopSec"]) >= options.timeout + 10
    assert unit["Install"]["WantedBy"] == "multi-user.target" and "network-online.target" in unit["Unit"]["After"]


def test_command_errors_are_one_line(tmp_path):
    process, url = launch_process("--port", "0", "--device", "numpy")
    assert "numpy backend" in process.stderr_lines[0]            # the banner says what answers
    try:
        port = url.rsplit(":", 1)[1].strip("/")
        taken = run_command("serve", "--port", port, "--device", "numpy")
        assert taken.returncode == 1
        assert_one_line_error(taken.stderr, "lnn-serve", f"cannot listen on 127.0.0.1:{port}")
    finally:
        process.terminate()
        process.wait(timeout=30)
    (tmp_path / "broken.bin").write_bytes(b"LNN1 not really")
    broken = run_command("serve", "--model", tmp_path / "broken.bin", "--port", "0")
    assert broken.returncode == 1 and broken.stderr.count("\n") == 1 and "Traceback" not in broken.stderr
    bad_batch = run_command("serve", "--max-batch", "0")
    assert_one_line_error(bad_batch.stderr, "lnn-serve", "--max-batch must be at least 1")
    small_memory = run_command("serve", "--upload-memory", "1000", "--max-body", "2000")
    assert_one_line_error(small_memory.stderr, "lnn-serve", "--upload-memory (1000) must be at least --max-body (2000)")
    bad_threads = run_command("serve", "--threads", "many")
    assert_one_line_error(bad_threads.stderr, "lnn-serve", "--threads must be a whole number of at least 1, or auto")
    for option, value in (("--timeout", "nan"), ("--max-delay-ms", "inf")):    # nan: each connection's timer failed
        not_a_number = run_command("serve", option, value)
        assert_one_line_error(not_a_number.stderr, "lnn-serve", f"{option} must be a number")


def test_answers_on_a_kept_alive_connection_do_not_wait_for_delayed_acks(served):
    """The listening socket is TCP, so each connection gets TCP_NODELAY: without it every answer (headers,
    then body) waited for the client's delayed ACK, about 40 ms, even for /healthz."""
    import http.client

    host, port = served.base_url.host, served.base_url.port
    connection = http.client.HTTPConnection(host, port, timeout=30)
    connection.request("GET", "/healthz")
    connection.getresponse().read()
    started = time.perf_counter()
    for _ in range(10):
        connection.request("GET", "/healthz")
        assert connection.getresponse().read() == b'{"alive":true}'
    assert time.perf_counter() - started < 0.3                  # 10 x 40 ms before
    connection.close()
