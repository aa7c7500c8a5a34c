"""lnn-serve under load, on loopback only: dynamic batching on and off, against onnxruntime behind the same
Starlette + uvicorn stack without batching (the server a user would otherwise write), side by side.

    python benchmarks/serve_load.py                    # clients 1, 4, 16, 64 (+ an overload row), ~8 minutes
    python benchmarks/serve_load.py --soak 300         # also the 5-minute soak at 16 clients (RSS growth)

Each server is its own process on 127.0.0.1 (a free port); this script is the clients: closed-loop, each
on its own keep-alive connection (KeepAliveClient: asyncio streams and httptools, on uvloop, about 0.1-0.3 ms
of CPU per request against httpx's 1.1-2.3), sends a 256x256 JPEG of a real tomato leaf (from
../shared/data/tomato, else examples/leaves) as the body, waits for the answer, sends the next; a 503 waits
its Retry-After. Every run is bounded in time and in
requests, and the servers are stopped at the end. Reported per server and client count: throughput (answers
per second), p50/p95/p99 latency of the answers, the batch-size distribution (lnn's /metrics), refusals
(503), requests without an answer (none expected) and answers that differ from lnn's own for that photo.
After the table, --target-rounds rounds alternate the batching and unbatched servers at 16 clients (the
issue's target) and give the median of the rounds' ratios. Then the batching and unbatched servers at 16
clients on uploads of the phone page's size (a 4:3 photo at the server's upload_side, 683x512 for the
bundled model) and of 1600x1200 (photo_sizes.py's photos), and on the reference leaf_cnn224 where ../shared
has it.
Writes the `serve_load` (and `serve_soak`) sections of docs/BENCHMARKS.md and docs/images/serve_load.png.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import re
import sys
import time
from functools import partial
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from report import SHARED, cpu_seconds, machine_line, markdown_table, update_section  # noqa: E402
from photo_sizes import photos_of_size  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
MODEL = REPO / "models" / "tomato_leaf.bin"
SHARED = SHARED
TOMATO = SHARED / "data" / "tomato"
REFERENCE_MODELS = SHARED / "reference_models"
PICTURE = REPO / "docs" / "images" / "serve_load.png"
UPLOAD_SIDE = 256
LARGE_UPLOAD = (1600, 1200)              # what the phone page sent until 2026-12-07 (serve_page.html MAX_SIDE)
PHOTOS = 64
WARMUP_S = 3.0
BATCH_EDGES = (1, 2, 4, 8, 16)           # batch-size histogram buckets shown (from lnn's /metrics)
STAGE_ROUNDS = 5                         # stage costs: medians over rounds, the stages interleaved in each


# --------------------------------------------------------------------------- the onnxruntime anchor server

def onnx_server(onnx_path: str, model_path: str, host: str, port: int) -> None:
    """onnxruntime behind Starlette + uvicorn, one InferenceSession call per request on Starlette's thread
    pool (onnxruntime releases the GIL, so requests compute side by side, one intra-op thread each), lnn's
    decoding, preprocessing and answer: no batching."""
    import onnxruntime
    import uvicorn
    from starlette.applications import Starlette
    from starlette.concurrency import run_in_threadpool
    from starlette.responses import JSONResponse
    from starlette.routing import Route

    import lnn
    from lnn.formats.errors import LnnInputError
    from lnn.runtime.gate import softmax
    from lnn.tools.serve import listening_socket, print_banner
    from lnn.tools.serve_app import answer_record

    session = lnn.load(model_path, device="numpy")          # labels and preprocessing only
    options = onnxruntime.SessionOptions()
    options.intra_op_num_threads = 1            # requests run side by side on the pool: one thread each
    ort = onnxruntime.InferenceSession(onnx_path, options, providers=["CPUExecutionProvider"])
    input_name = ort.get_inputs()[0].name

    def probabilities(image):
        out = ort.run(None, {input_name: image[None]})[0]
        return out[0] if session.outputs_probabilities else softmax(out)[0]

    async def classify(request):
        try:
            image = await run_in_threadpool(session.prepare_image, await request.body())
        except LnnInputError as err:
            return JSONResponse({"error": str(err), "status": 400}, 400)
        judged = (await run_in_threadpool(probabilities, image), None)      # no gate: what a plain ONNX server has
        return JSONResponse(answer_record(session, judged, (image, None, []), "upload", 3))

    async def ready(request):
        return JSONResponse({"ready": True})

    app = Starlette(routes=[Route("/v1/classify", classify, methods=["POST"]), Route("/readyz", ready)])
    sock = listening_socket(host, port)
    print_banner(host, sock)
    uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False)).run(sockets=[sock])


# --------------------------------------------------------------------------- photos and clients

def upload_photos(count: int) -> list:
    """`count` real leaf photos, each resized to 256x256 and encoded as JPEG (quality 90), in memory only."""
    import cv2

    paths = sorted(TOMATO.rglob("*.jpg")) if TOMATO.is_dir() else []
    paths = paths[::max(1, len(paths) // count)][:count] or sorted((REPO / "examples" / "leaves").glob("*.jpg"))
    photos = []
    for path in paths:
        image = cv2.resize(cv2.imread(str(path)), (UPLOAD_SIDE, UPLOAD_SIDE), interpolation=cv2.INTER_AREA)
        photos.append(cv2.imencode(".jpg", image, [cv2.IMWRITE_JPEG_QUALITY, 90])[1].tobytes())
    return photos


def expected_labels(photos: list, model: Path = MODEL) -> list:
    """lnn's own answer for each upload, computed here without a server."""
    import lnn

    session = lnn.load(model, device="numpy")
    batch = np.stack([session.prepare_image(photo) for photo in photos])
    return [session.labels[i]["name"] for i in session.predict(batch).argmax(axis=1)]


class Tally:
    def __init__(self):
        self.latencies, self.statuses, self.no_answer, self.mismatched = [], collections.Counter(), 0, 0


class Response:
    """One HTTP response read by its own httptools parser (`parser`, fed by the caller): its headers and body,
    whether it is complete, and whether the server keeps the connection open after it. httptools answers that
    only while the message is being completed: read after feed_data returns, should_keep_alive() is False for
    every response (httptools 0.9), and the client reconnected for every request until 2026-12-06."""

    def __init__(self):
        import httptools

        self.headers, self.body, self.complete, self.keep_alive = {}, [], False, False
        self.parser = httptools.HttpResponseParser(self)

    def on_header(self, name: bytes, value: bytes):
        self.headers[name.decode("latin-1").lower()] = value.decode("latin-1")

    def on_body(self, body: bytes):
        self.body.append(body)

    def on_message_complete(self):
        self.complete, self.keep_alive = True, self.parser.should_keep_alive()


class KeepAliveClient:
    """One HTTP/1.1 keep-alive connection on asyncio streams, its responses parsed by httptools (the parser
    uvicorn uses). A lean client: this script shares the 2 cores with the server it measures, where httpx's
    AsyncClient took 1.2-2.3 ms of CPU per request (the serve_load runs of 2026-12-02), as much as the
    server's decoding, photo checks and HTTP together; phones at a station take none of the box's CPU."""

    def __init__(self, url: str):
        from urllib.parse import urlsplit

        parts = urlsplit(url)
        self.host, self.port = parts.hostname, parts.port
        self.reader = self.writer = None

    async def post(self, path: str, body: bytes, content_type: str) -> tuple[int, dict, bytes]:
        """(status, headers, body); an OSError or httptools.HttpParserError closes the connection."""
        try:
            if self.writer is None:
                self.reader, self.writer = await asyncio.open_connection(self.host, self.port)
            self.writer.write(f"POST {path} HTTP/1.1\r\nHost: {self.host}:{self.port}\r\nContent-Type: "
                              f"{content_type}\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body)
            response = Response()
            while not response.complete:
                data = await self.reader.read(1 << 16)
                if not data:
                    raise ConnectionResetError("the server closed the connection before answering")
                response.parser.feed_data(data)
            if not response.keep_alive:                  # the server closes it: the next request reconnects
                self.close()
            return response.parser.get_status_code(), response.headers, b"".join(response.body)
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
        self.reader = self.writer = None


async def closed_loop(url: str, photos: list, labels: list, clients: int, seconds: float, max_requests: int,
                      tally: Tally | None) -> None:
    """`clients` clients, each on its own connection sending a photo and waiting for its answer, for `seconds`
    or `max_requests`; a request that fails (connection lost, unparsable answer, none within 60 s) counts as
    unanswered."""
    import httptools

    end = time.perf_counter() + seconds
    sent = 0

    async def one_client(number: int):
        nonlocal sent
        index = number
        client = KeepAliveClient(url)
        try:
            while time.perf_counter() < end and sent < max_requests:
                sent += 1
                photo = index % len(photos)
                index += clients
                started = time.perf_counter()
                try:
                    async with asyncio.timeout(60):
                        status, headers, body = await client.post("/v1/classify", photos[photo], "image/jpeg")
                except (OSError, TimeoutError, httptools.HttpParserError):
                    if tally is not None:
                        tally.no_answer += 1
                    continue
                elapsed = time.perf_counter() - started
                if tally is not None:
                    tally.statuses[status] += 1
                    if status == 200:
                        tally.latencies.append(elapsed)
                        tally.mismatched += json.loads(body)["label"] != labels[photo]
                if status == 503:
                    await asyncio.sleep(float(headers.get("retry-after", 1)))
        finally:
            client.close()

    await asyncio.gather(*(one_client(number) for number in range(clients)))


def run_clients(coroutine) -> None:
    """Run the clients' coroutine on uvloop where it is installed (lnn's serve extra has it; less CPU per
    request than asyncio's own loop), else on asyncio's."""
    try:
        import uvloop
    except ImportError:
        asyncio.run(coroutine)
    else:
        uvloop.run(coroutine)


def batch_buckets(url: str) -> dict | None:
    """lnn_serve_batch_size's cumulative bucket counts from /metrics (None for a server without them)."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    response = httpx.get(url + "metrics")
    if response.status_code != 200:
        return None
    return {float(sample.labels["le"]): sample.value for family in text_string_to_metric_families(response.text)
            for sample in family.samples if sample.name == "lnn_serve_batch_size_bucket"}


def batch_distribution(before: dict | None, after: dict | None) -> str:
    if before is None:
        return "— (no batching)"
    counts = {edge: after[edge] - before[edge] for edge in after}
    total = counts[float("inf")]
    if not total:
        return "—"
    parts, previous, low = [], 0.0, 1
    for edge in BATCH_EDGES:
        share = (counts[float(edge)] - previous) / total
        previous = counts[float(edge)]
        if share >= 0.005:
            parts.append(f"{low if low == edge else f'{low}–{edge}'}: {share:.0%}")
        low = edge + 1
    return ", ".join(parts)


def lone_photo_plan(url: str) -> str | None:
    """What the lnn server's lone photos run on now: the "batch 1" clause of its /v1/model threads_choice ("layers
    split over 2 threads", "one thread (the split was not faster)"), then, while others wait, its
    lone_photos_under_load (serve_app.LoneCalls: "one thread (timed under load: ...)"); None for a server without
    them (onnxruntime's) or one whose backend has not decided."""
    import httpx

    response = httpx.get(url + "v1/model")
    info = response.json() if response.status_code == 200 else {}
    found = re.search(r"batch 1: ([^;]+)", info.get("threads_choice", ""))
    under_load = info.get("lone_photos_under_load")
    return f"{found.group(1)}, while others wait {under_load}" if found and under_load else None


def rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) / 1024


def wait_ready(url: str, timeout_s: float = 300) -> None:
    import httpx

    deadline = time.monotonic() + timeout_s
    while httpx.get(url + "readyz").status_code != 200:
        if time.monotonic() > deadline:
            raise SystemExit(f"{url} never became ready")
        time.sleep(0.1)


def measure(url, pid, photos, labels, clients, seconds, max_requests) -> dict:
    run_clients(closed_loop(url, photos, labels, clients, WARMUP_S, max_requests, None))
    before = batch_buckets(url)
    tally = Tally()
    server_cpu, client_cpu, started = cpu_seconds(pid), time.process_time(), time.perf_counter()
    run_clients(closed_loop(url, photos, labels, clients, seconds, max_requests, tally))
    elapsed = time.perf_counter() - started
    server_cpu, client_cpu = cpu_seconds(pid) - server_cpu, time.process_time() - client_cpu
    requests = sum(tally.statuses.values()) or 1
    latencies = np.array(tally.latencies) * 1000
    p50, p95, p99 = np.percentile(latencies, [50, 95, 99]) if len(latencies) else (float("nan"),) * 3
    return {"clients": clients, "throughput": len(latencies) / elapsed, "p50": p50, "p95": p95, "p99": p99,
            "batches": batch_distribution(before, batch_buckets(url)), "refused": tally.statuses[503],
            "errors": sum(n for status, n in tally.statuses.items() if status not in (200, 503)),
            "no_answer": tally.no_answer, "mismatched": tally.mismatched, "answers": len(latencies),
            "lone_photos": lone_photo_plan(url),
            "server_cpu_ms": 1000 * server_cpu / requests, "client_cpu_ms": 1000 * client_cpu / requests}


# --------------------------------------------------------------------------- where a request's CPU goes

def stage_costs(photos: list) -> dict:
    """{stage: CPU ms per photo} of a request's stages, run here on one thread (time.thread_time; BLAS and the
    Numba backend at one thread, as in lnn-serve): the server's own functions on the same uploads, each stage
    over every photo in turn, medians over STAGE_ROUNDS rounds with the stages interleaved. What a server's
    CPU per request has beyond their sum is HTTP, Starlette, the event loop and the hand-offs between threads."""
    from starlette.responses import JSONResponse
    from threadpoolctl import threadpool_limits

    import lnn
    from lnn.runtime.preprocess import decode_image, preprocess_image
    from lnn.tools.serve_app import answer_record, judge_in_chunks, prepare_upload

    session = lnn.load(MODEL, device="cpu", threads=1)
    with threadpool_limits(1, user_api="blas"):
        decoded = [decode_image(photo) for photo in photos]
        prepared = [prepare_upload(session, photo, 50_000_000) for photo in photos]
        images, checks = [x for x, _, _ in prepared], [check for _, check, _ in prepared]
        judged = list(zip(*judge_in_chunks(session, images, checks)))
        batches = {size: [(images[i:i + size], checks[i:i + size]) for i in range(0, len(photos) - size + 1, size)]
                   for size in (1, 8, 16)}
        stages = {
            "decode (header walk and checks + JPEG 256×256)": lambda: [decode_image(photo) for photo in photos],
            "preprocessing (resize to 128×128, normalize)": lambda: [preprocess_image(image, session.model.preprocess)
                                                                     for image in decoded],
            "photo checks": lambda: [session.check_photo(image) for image in decoded],
            **{f"model + gate, batch {size} (lnn-serve's chunks)": partial(judge_batches, session, batches[size])
               for size in batches},
            "answer object + JSON": lambda: [JSONResponse(answer_record(session, judged[i], prepared[i], "upload", 3))
                                             for i in range(len(photos))],
        }
        for stage in stages.values():                       # warm: Numba's plans for each batch size
            stage()
        rounds = {name: [] for name in stages}
        for _ in range(STAGE_ROUNDS):
            for name, stage in stages.items():
                started = time.thread_time()
                stage()
                rounds[name].append(1000 * (time.thread_time() - started) / len(photos))
    return {name: float(np.median(times)) for name, times in rounds.items()}


def judge_batches(session, batches: list) -> None:
    from lnn.tools.serve_app import judge_in_chunks

    for images, checks in batches:
        judge_in_chunks(session, images, checks)


def breakdown_part(stages: dict, by: dict, servers: list) -> str:
    """The serve_load section's breakdown: the stage costs, what the servers spend beyond them, and the bound
    that the model's own cost at batch 1 and 16 sets on the batched / unbatched throughput."""
    batched, unbatched = by[(servers[0], 16)], by[(servers[1], 16)]
    unbatched_one = by[("lnn, no batching, --threads 1", 16)]
    common = sum(ms for name, ms in stages.items() if not name.startswith("model"))
    model = {size: stages[f"model + gate, batch {size} (lnn-serve's chunks)"] for size in (1, 8, 16)}
    gain = model[1] / min(model[8], model[16])
    rows = [[name, f"{ms:.2f}"] for name, ms in stages.items()]
    for row, size in ((batched, 16), (unbatched, 1)):
        rest = row["server_cpu_ms"] - common - model[size]
        rows.append([f"{row['server']}, 16 clients: server CPU per request", f"{row['server_cpu_ms']:.2f} "
                     f"(beyond the stages, with the model at batch {size}: {rest:.2f}: HTTP, Starlette, event loop, "
                     f"thread hand-offs)"])
        rows.append([f"{row['server']}, 16 clients: this script's client CPU per request", f"{row['client_cpu_ms']:.2f}"])
    total = {name: row["server_cpu_ms"] + row["client_cpu_ms"] for name, row in (("b", batched), ("u", unbatched))}
    cores = {name: total[name] * row["throughput"] / 1000 for name, row in (("b", batched), ("u", unbatched))}
    return "\n\n".join([
        "### Where a request's CPU goes (16 clients)",
        f"Each stage is lnn-serve's own function on the same {PHOTOS} uploads, run in this script on one thread (CPU time; BLAS and Numba at one thread, as the server runs "
        f"them; medians of {STAGE_ROUNDS} interleaved rounds), in ms per photo; the server rows are the 16-client "
        f"rows of the table above (CPU of all the server's threads, over the requests sent).",
        markdown_table(["stage", "CPU ms per photo"], rows),
        f"The server and this script's clients share the 2 cores, so throughput is at most 2 cores over the CPU "
        f"per request, {total['b']:.1f} ms with batching and {total['u']:.1f} ms without: were both CPU-bound, at "
        f"most {total['u'] / total['b']:.2f}× apart. At 16 clients they used {cores['b']:.2f} and {cores['u']:.2f} "
        f"of the 2 cores (answers/s × that CPU). Batching changes the model's "
        f"work per image ({model[1]:.2f} ms at batch 1, {model[8]:.2f} at 8, {model[16]:.2f} at 16 on one thread: "
        f"{gain:.2f}× at best), the hand-offs per request and how a call is shared over the cores: a batch by "
        f"images, a lone photo by its layers, whose waits between the layers cost CPU (the unbatched server's "
        f"{unbatched['server_cpu_ms']:.1f} ms of server CPU per request against {unbatched_one['server_cpu_ms']:.1f} "
        f"with --threads 1), CPU the other threads miss only when the cores are full. Decoding, preprocessing, "
        f"photo checks, HTTP and the answer ({common:.2f} ms of stages, plus the server's rest and the client) are "
        f"paid per photo either way. Were everything but the model free, batching could cut the model's work per "
        f"image by at most {gain:.2f}×, as this CPU's kernels run one image nearly as efficiently as a batch "
        f"(lnn-bench models/tomato_leaf.bin --batch 1 / 16 --threads 1 says the same). A ratio above the "
        f"{total['u'] / total['b']:.2f}× that the CPU per request allows comes from how fully each server used the "
        f"cores and from the machine's drift between rounds, not from cheaper work per photo.",
        "Found with py-spy and each thread's CPU in /proc (2026-12-01, 16 clients): OpenBLAS's helper thread took "
        "1.6-3.8 ms of CPU per request in the batching server, about as much as the model. The gate's products "
        "at batch 8 and over are threaded BLAS calls; after each the helper busy-waits for more work, beside "
        "the decode pool on the 2 cores. lnn-serve now holds BLAS at one thread while it serves "
        "(tools/serve.py one_blas_thread). With that, preprocessing on whole channel planes (0.56 → 0.12 ms) and "
        "leaner photo checks (the same measures), in one run of 3 interleaved rounds at 16 clients (load average "
        "about 6): the batching server's CPU per request went from 9.6 to 6.5 ms, the unbatched one's from 9.2 to "
        "8.1 ms; 2 cores over server + client CPU, 175 → 247 answers/s batching and 174 → 197 without.",
        "Each thread's CPU in /proc at 16 clients, seventh session, by hand (8 s): in the batching server the inference "
        "thread used 0.70-0.73 of a core, each of the two decode threads 0.18-0.19, the event loop 0.11-0.12; without "
        "batching 0.67-0.71, 0.13-0.15 and 0.15. No thread is saturated, and what keeps the rest of the cores idle was "
        "not found (an inference thread taking its own batches, without the event loop between batches, was tried: "
        "161 against 155 answers/s over 7 interleaved rounds, within the noise, not kept)."])


# --------------------------------------------------------------------------- the runs

def start_servers(onnx_path: Path) -> dict:
    from lnn.tools.serve import launch_process

    common = ("--model", MODEL, "--port", "0", "--device", "cpu")
    return {"lnn, batching (max 16, 10 ms)": launch_process(*common),
            "lnn, no batching (max 1)": launch_process(*common, "--max-batch", "1"),
            "onnxruntime, no batching": launch_process("--onnx-server", onnx_path, "--port", "0",
                                                       program=(__file__,)),
            "lnn, batching, --threads 1": launch_process(*common, "--threads", "1"),
            "lnn, no batching, --threads 1": launch_process(*common, "--max-batch", "1", "--threads", "1"),
            "lnn, batching, --max-delay-ms 0": launch_process(*common, "--max-delay-ms", "0")}


def draw(rows: list, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    for server in dict.fromkeys(row["server"] for row in rows):
        mine = [row for row in rows if row["server"] == server and row["clients"] in (1, 4, 16, 64)]
        clients = [row["clients"] for row in mine]
        left.plot(clients, [row["throughput"] for row in mine], marker="o", label=server)
        right.plot(clients, [row["p99"] for row in mine], marker="o", label=server)
    for axis, title in ((left, "answers per second"), (right, "p99 latency, ms")):
        axis.set_xscale("log", base=2)
        axis.set_xlabel("parallel clients")
        axis.set_title(title)
        axis.grid(alpha=0.3)
    right.set_yscale("log")
    left.legend(fontsize=8)
    figure.suptitle("lnn-serve on loopback, tomato_leaf, 256x256 JPEG uploads (benchmarks/serve_load.py)")
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=100)


def run_plan(servers: dict, plan: list, photos, labels, args) -> list:
    """Measure each (server name, clients) of the plan; the servers are stopped at the end."""
    from tqdm import tqdm

    rows = []
    try:
        for _, url in servers.values():
            wait_ready(url)
        for name, clients in tqdm(plan, desc="load runs", unit="run"):
            process, url = servers[name]
            row = measure(url, process.pid, photos, labels, clients, args.seconds, args.max_requests)
            rows.append({"server": name, **row})
            tqdm.write(f"{name:32} {clients:3} clients  {row['throughput']:7.1f}/s  p50 {row['p50']:7.1f}  "
                       f"p99 {row['p99']:7.1f} ms  batches {row['batches']}  503: {row['refused']}  "
                       f"errors {row['errors']}  unanswered {row['no_answer']}  mismatched {row['mismatched']}  "
                       f"CPU ms/request server {row['server_cpu_ms']:.1f} client {row['client_cpu_ms']:.1f}"
                       + (f"  lone photos: {row['lone_photos']}" if row["lone_photos"] else ""))
    finally:
        for process, _ in servers.values():
            process.terminate()
            process.wait(timeout=60)
    return rows


def batching_pair(label: str, model: Path, photos, labels, args) -> list:
    """The batching and the unbatched lnn server (defaults) of `model` at 16 clients on `photos`."""
    from lnn.tools.serve import launch_process

    common = ("--model", model, "--port", "0", "--device", "cpu")
    servers = {f"{label}, batching": launch_process(*common),
               f"{label}, no batching": launch_process(*common, "--max-batch", "1")}
    return run_plan(servers, [(name, 16) for name in servers], photos, labels, args)


def rows_table(rows: list) -> str:
    return markdown_table(
        ["server", "clients", "answers/s", "p50 ms", "p95 ms", "p99 ms", "batch sizes", "503 refused",
         "other errors", "no answer", "answers ≠ lnn's", "server CPU ms/req", "client CPU ms/req"],
        [[row["server"], row["clients"], f"{row['throughput']:.1f}", f"{row['p50']:.1f}", f"{row['p95']:.1f}",
          f"{row['p99']:.1f}", row["batches"], row["refused"], row["errors"], row["no_answer"], row["mismatched"],
          f"{row['server_cpu_ms']:.1f}", f"{row['client_cpu_ms']:.1f}"]
         for row in rows])


def heavy_model(folder: Path) -> Path | None:
    """The reference leaf_cnn224 (224x224 input, random weights) as a .bin, from ../shared/reference_models;
    None when that is absent."""
    import contextlib
    import io

    from lnn.tools.export import main as export_main

    weights = REFERENCE_MODELS / "leaf_cnn224.weights.npz"
    if not weights.exists():
        return None
    out = folder / "leaf_cnn224.bin"
    with contextlib.redirect_stdout(io.StringIO()):
        export_main([str(REPO / "examples" / "reference" / "leaf_cnn224.json"), "--weights", str(weights), "-o", str(out)])
    return out


def run_load(args, photos, labels, onnx_path, heavy: Path | None) -> None:
    import lnn
    from lnn.runtime import usable_cores
    from lnn.tools.serve_app import upload_side

    load_before = os.getloadavg()[0]
    stages = stage_costs(photos)                 # before the servers start: this script alone on the cores
    servers = start_servers(onnx_path)
    plan = [(name, clients) for name in servers for clients in args.clients] + [(next(iter(servers)), args.overload)]
    # the target's pair again, alternating: on this shared VM the machine's speed drifts within a run, and one
    # run of each, minutes apart, compared drift as much as the servers
    target = [(name, 16) for _ in range(args.target_rounds) for name in list(servers)[:2]]
    rows = run_plan(servers, plan + target, photos, labels, args)
    rows, target_rows = rows[:len(plan)], rows[len(plan):]
    draw(rows, PICTURE)
    by = {(row["server"], row["clients"]): row for row in rows}
    batched, unbatched = (by[(name, 16)]["throughput"] for name in list(servers)[:2])
    pairs = [(b["throughput"], u["throughput"]) for b, u in zip(target_rows[::2], target_rows[1::2])]
    target_line = (f" Then {len(pairs)} rounds alternating the two at 16 clients: batching "
                   f"{np.median([b for b, _ in pairs]):.1f} against {np.median([u for _, u in pairs]):.1f} answers/s "
                   f"(medians), the rounds' ratios {', '.join(f'{b / u:.2f}' for b, u in pairs)}: median "
                   f"**{np.median([b / u for b, u in pairs]):.2f}×**." if pairs else "")
    # what the unbatched server ran its photos on: chosen by timing in its own process (the cpu backend's split of
    # one photo's layers against one thread, and the server's own timing of the two under load), it moves this
    # baseline more than the run-to-run noise does
    lone = [row["lone_photos"] for row in [by[(list(servers)[1], 16)], *target_rows[1::2]]]
    lone_line = (f" What the unbatched server had chosen for its photos at the end of each run (/v1/model's "
                 f"threads_choice and lone_photos_under_load): {lone[0]} after the table's row"
                 + (f"; then {'; '.join(map(str, lone[1:]))} after the rounds" if len(lone) > 1 else "")
                 + ". Its cpu backend times splitting a photo's layers over the cores against one thread, and the "
                   "server times the two again under its own load for the photos computed while others wait; both "
                   "review their choice as calls go on, so a run may have run on both.")
    side = upload_side(lnn.load(MODEL, device="numpy"))
    page_size = (round(side * 4 / 3), side)
    sized = {size: photos_of_size(*size) for size in (page_size, LARGE_UPLOAD)}
    page_rows = [row for size, sized_photos in sized.items()
                 for row in batching_pair(f"lnn, {size[0]}×{size[1]} uploads", MODEL, sized_photos,
                                          expected_labels(sized_photos), args)]
    kilobytes = {size: np.mean([len(photo) for photo in sized_photos]) / 1000 for size, sized_photos in sized.items()}
    page_part = [f"### Uploads of the page's size: {page_size[0]}×{page_size[1]}, and 1600×1200, 16 clients",
                 f"The phone page shrinks a photo to the server's `upload_side` on its short side ({side} pixels for "
                 f"the bundled model, twice what its model and photo checks need), a 4:3 photo to "
                 f"{page_size[0]}×{page_size[1]}; until 2026-12-07 it sent 1600 pixels on the long side, as an "
                 f"API client may still. The sample leaves enlarged to those sizes (baseline JPEGs, "
                 f"{kilobytes[page_size]:.0f} and {kilobytes[LARGE_UPLOAD]:.0f} KB on average, "
                 "benchmarks/photo_sizes.py), the bundled model, both servers at the defaults. lnn decodes them "
                 "reduced, at 341×256 and 400×300 (libjpeg's reduced decoding: the model and its photo checks "
                 "need 256 pixels a side).",
                 rows_table(page_rows)]
    heavy_part = []
    if heavy is not None:
        heavy_rows = batching_pair("leaf_cnn224", heavy, photos, expected_labels(photos, heavy), args)
        heavy_part = ["### A model whose inference dominates: the reference leaf_cnn224, 16 clients",
                      "The same uploads and clients; leaf_cnn224 (224×224 input, random reference weights: "
                      "its answers mean nothing) costs several times the bundled model's server CPU per photo, "
                      "so inference, not HTTP and decoding, takes most of it. Both servers at the defaults "
                      "(`--threads auto`): a batch is split over the cores by images, a lone photo by its "
                      "layers' output rows or channels.",
                      rows_table(heavy_rows)]
    update_section("serve_load", "\n\n".join([
        "## lnn-serve under load (dynamic batching on and off, onnxruntime behind the same stack)",
        f"Command: `python benchmarks/serve_load.py --seconds {args.seconds:g}`. Machine: {machine_line()}. "
        f"Load average when it started: {load_before:.2f}{'; ' + args.note if args.note else ''}.",
        f"Loopback only; each server its own process (`lnn-serve --device cpu`: one inference thread whose "
        f"calls run on `--threads auto`, the usable cores ({usable_cores()} here; a batch is split over them "
        f"by images, a lone photo by its layers), BLAS at one thread, photos decoded on a pool of one thread "
        f"per core; `--threads 1`: the model on the inference thread alone; onnxruntime with one intra-op "
        f"thread per call, one call per request on Starlette's thread pool, so calls run side by side; "
        f"`--max-delay-ms 0` never waits for photos still being decoded), the clients in this "
        f"script's process on the same cores, each on its own keep-alive connection (a lean client: asyncio "
        f"streams and httptools on uvloop; until 2026-12-02 httpx, which took 1.1-2.3 ms of CPU per request "
        f"from the same 2 cores; from then until 2026-12-06 the lean client misread httptools and opened a new "
        f"connection for every request). Closed loop: each client sends a 256×256 JPEG of a real leaf "
        f"({len(photos)} photos) and waits for the answer; {WARMUP_S:g} s of warm-up, then {args.seconds:g} s "
        f"measured. Latency is the client's, send to answer. CPU ms per request: the server process's user + "
        f"system time (all its threads) and this client's, over the requests sent, a figure less sensitive to "
        f"other work on the machine than the wall times. The last row overloads the batching server past "
        f"its --queue 64 on purpose: the refused get 503 and wait their Retry-After.",
        f"At 16 clients (target: batching ≥ 2× the unbatched server's throughput, p99 ≤ 200 ms): in the table, "
        f"batching {batched:.1f} answers/s against {unbatched:.1f} without ({batched / unbatched:.2f}×), p99 "
        f"{by[(list(servers)[0], 16)]['p99']:.0f} ms.{target_line}{lone_line}",
        rows_table(rows),
        "![throughput and p99 latency](images/serve_load.png)",
        breakdown_part(stages, by, list(servers)),
        *page_part,
        *heavy_part]))
    print(f"wrote the serve_load section of docs/BENCHMARKS.md and {PICTURE}")


def run_soak(args, photos, labels) -> None:
    """16 clients against the batching server for args.soak seconds; RSS sampled every few seconds."""
    from tqdm import tqdm

    from lnn.tools.serve import launch_process

    load_before = os.getloadavg()[0]
    process, url = launch_process("--model", MODEL, "--port", "0", "--device", "cpu")
    samples = []
    tally = Tally()
    try:
        wait_ready(url)
        warmup = min(30.0, args.soak / 10)
        chunk = 5.0
        started = time.perf_counter()
        with tqdm(total=int(args.soak), desc="soak", unit="s") as bar:
            while (done := time.perf_counter() - started) < args.soak:
                seconds = min(chunk, args.soak - done)
                run_clients(closed_loop(url, photos, labels, 16, seconds, 10**9,
                                        tally if done >= warmup else None))
                samples.append((time.perf_counter() - started, rss_mib(process.pid)))
                bar.update(int(samples[-1][0]) - bar.n)
    finally:
        process.terminate()
        process.wait(timeout=60)
    after_warmup = next(rss for at, rss in samples if at >= warmup)
    peak, last = max(rss for at, rss in samples if at >= warmup), samples[-1][1]
    growth = (last - after_warmup) / after_warmup
    answers = tally.statuses[200]
    errors = sum(n for status, n in tally.statuses.items() if status not in (200, 503))
    measured = args.soak - warmup
    summary = (f"soak {args.soak:g} s at 16 clients: {answers} answers ({answers / measured:.1f}/s), "
               f"p99 {np.percentile(np.array(tally.latencies) * 1000, 99):.1f} ms, 503 refused {tally.statuses[503]}, "
               f"other errors {errors}, no answer {tally.no_answer}, answers ≠ lnn's {tally.mismatched}; RSS after "
               f"{warmup:g} s warm-up {after_warmup:.1f} MiB, peak {peak:.1f} MiB, at the end {last:.1f} MiB "
               f"(growth {growth:+.1%}; target ≤ +10%)")
    print(summary)
    update_section("serve_soak", "\n\n".join([
        f"## lnn-serve soak: 16 clients for {args.soak / 60:g} minutes, RSS",
        f"Command: `python benchmarks/serve_load.py --soak {args.soak:g}`. Machine: {machine_line()}. "
        f"Load average when it started: {load_before:.2f}{'; ' + args.note if args.note else ''}.",
        "The batching server (`lnn-serve --device cpu`, defaults), 16 closed-loop clients on loopback; the "
        "server's resident memory (VmRSS) sampled every 5 s; figures counted after the warm-up.",
        summary + ".",
        markdown_table(["seconds", "RSS MiB"], [[f"{at:.0f}", f"{rss:.1f}"] for at, rss in samples[::6]])]))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=int, nargs="+", default=[1, 4, 16, 64])
    parser.add_argument("--overload", type=int, default=128, help="clients of the overload row (batching server)")
    parser.add_argument("--target-rounds", type=int, default=3,
                        help="rounds alternating the batching and unbatched servers at 16 clients, after the table")
    parser.add_argument("--seconds", type=float, default=10.0, help="measured seconds per run")
    parser.add_argument("--max-requests", type=int, default=50_000, help="most requests per run")
    parser.add_argument("--soak", type=float, default=0, metavar="S", help="also soak for S seconds (300 = the target)")
    parser.add_argument("--no-load", action="store_true", help="only the soak")
    parser.add_argument("--note", default="", help="text added after the load average (e.g. who else used the machine)")
    parser.add_argument("--onnx-server", metavar="X.onnx", help=argparse.SUPPRESS)     # the anchor's own process
    parser.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.onnx_server:
        onnx_server(args.onnx_server, str(MODEL), "127.0.0.1", args.port)
        return 0
    import tempfile

    from lnn.formats.binfile import read_bin
    from lnn.formats.onnx_export import export_bin_to_onnx

    photos = upload_photos(PHOTOS)
    labels = expected_labels(photos)
    with tempfile.TemporaryDirectory() as folder:
        onnx_path = Path(folder) / "tomato_leaf.onnx"
        export_bin_to_onnx(read_bin(MODEL), onnx_path)
        if not args.no_load:
            run_load(args, photos, labels, onnx_path, heavy_model(Path(folder)))
    if args.soak:
        run_soak(args, photos, labels)
    return 0


if __name__ == "__main__":
    sys.exit(main())
