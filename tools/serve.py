"""lnn-serve: the station's box answers the phones on its network, merging requests into batches.

    lnn-serve                                   # the bundled tomato-leaf model on http://127.0.0.1:8080/
    lnn-serve --host 0.0.0.0                    # phones on the station's Wi-Fi open http://<this box>:8080/
    curl -F file=@leaf.jpg http://127.0.0.1:8080/v1/classify

Phones open the page at / (a camera button, the answer in words with its advice, the last answers, and the
QR code of its address for the next phone).
POST /v1/classify takes a photo (the body, or a multipart `file` field) and returns lnn-infer --json's
object. Requests that arrive together are merged into one batch of up to --max-batch images, waiting at most
--max-delay-ms for photos still being decoded (none on the way: no wait), counted from when the first was
ready or the batch before ended, whichever is later. Over
--queue uploads, --max-connections connections or --upload-memory bytes of uploads at once: 503 with
Retry-After; a body over --max-body: 413; one sent compressed (Content-Encoding): 415; not an image, truncated
or over --max-pixels: 400 with lnn-infer's reason; no answer within --timeout: 504. GET /v1/model, /healthz,
/readyz (warmed up) and /metrics (Prometheus). SIGTERM finishes the requests in flight, then exits 0.
Needs the serve extra: pip install 'lnn[serve]'.
"""

from __future__ import annotations

import contextlib
import ipaddress
import json
import logging
import math
import os
import re
import signal
import socket
import sys
import threading
from dataclasses import dataclass
from urllib.parse import urlsplit

from lnn.formats.errors import LnnError, LnnInputError
from lnn.runtime.cores import usable_cpus
from lnn.tools.cli import EXIT_INTERRUPTED, command_parser, error_line, run_command

PROG = "lnn-serve"
DEFAULT_PORT = 8080
ALL_NETWORKS = ("0.0.0.0", "::")
NO_ROUTE_PROBE = ("10.255.255.255", 1)      # a private address: connecting a UDP socket sends nothing
BANNER = "serving on"                       # the first line on stderr: "lnn-serve: serving on http://HOST:PORT/ ..."


RETRY_AFTER_S = 1                           # what a 503 asks the phone to wait
ERROR_TYPE = "application/json"            # every error's body: error_body
HEAD_LIMIT = 64 * 1024                      # bytes of a request's line and headers: more is 431
UPGRADE_HEADER = re.compile(rb"\r\nupgrade:", re.IGNORECASE)   # in a head: renamed, so the request is plain HTTP
NOT_A_HEAD = re.compile(rb"\A[\r\n]*[^A-Z\r\n]|(?<!\r)\n")   # bytes no request head the parser reads starts with
                                    # (a method is capitals: a TLS hello is not) or holds (a line ended by LF alone)
PIPELINE_LIMIT = 32                         # requests a connection may send ahead of their answers: more is 503
FILES_KEPT_FREE = 64                        # open files left for the model, the logs and the pools under --max-connections
INVALID_REQUEST = "Invalid HTTP request received."      # uvicorn's log line before its 400 for malformed HTTP


def error_body(status: int, message: str) -> bytes:
    """The one-line JSON every error answer carries, the application's (serve_app.error_response) and the
    protocol's own refusals alike: {"error": message, "status": status}, compact and UTF-8 as Starlette writes it."""
    return json.dumps({"error": message, "status": status}, ensure_ascii=False, separators=(",", ":")).encode()


class QuietInvalidRequests(logging.Filter):
    """Drops uvicorn's warning line for each malformed request (one line per hostile request in the station's log;
    /metrics counts them as bad_http instead)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.getMessage() != INVALID_REQUEST


QUIET_INVALID_REQUESTS = QuietInvalidRequests()


def guarded_protocol(config: "ServeConfig", metrics):
    """uvicorn's httptools protocol (the serve extra's) with the limits it lacks, or None without httptools
    (uvicorn's h11 protocol then, which has a 16 KiB head limit of its own). What it answers itself is counted
    in metrics.unserved (status, reason), its connections in metrics.connections.
    - A request's line and headers over HEAD_LIMIT: 431 (httptools buffered an endless header whole: 100 MB
      sent took the server's memory up 146 MB).
    - No whole head within --timeout of the connection's start or of the head's first byte: the connection
      closed, with 408 where part of a head came (an idle connection stayed open forever, so enough of them
      used up the process's open files and every other phone was refused).
    - A request answered before its body is all in (413, 504, 404, ...) is told `connection: close` (RFC 9110
      15: such an answer SHOULD say so), and the connection ends in a staged close (below): a client that then
      skipped the rest of its body had its next request read as that body, and uvicorn read and dropped an
      endless body for ever.
    - More than PIPELINE_LIMIT requests sent ahead of their answers: 503 (uvicorn parsed every read whole into
      its queue, and read on after each answer: one client pipelining /healthz without reading took the server
      from 78 to about 790 MB in 7 s). A client that reads no answer for --timeout while one waits to be sent:
      the connection closed.
    - More than --max-connections open: 503 with Retry-After and closed, before any request is read.
    - Part of a head in when the server stops: 503 with Retry-After, not a connection closed unanswered.
    - uvicorn's own 400 for malformed HTTP is counted (bad_http), its log line dropped (QuietInvalidRequests), and
      written as error_body's JSON (a chunked body broken mid-upload got uvicorn's plain text);
      bytes that cannot begin a head the parser reads (a TLS hello: a phone that tried https://) or a line ended
      by LF alone (which httptools refuses) get it at once, not a 408 after --timeout.
    - An Upgrade header (curl --http2 and Java's HttpClient ask for h2c) is ignored, as RFC 9110 allows: the
      request is answered as HTTP/1.1 (httptools skipped an upgrade request's body: the photo arrived empty).
    A head is held here until whole, then given to the parser (so the header can be renamed first). These
    refusals are written after the answers still owed on the connection (not in their place); then the
    connection ends in a staged close (RFC 9112 9.6; `close_gently`): no more requests are read, the write side
    is shut once the last answer is out, and what the client still sends is dropped until it closes or
    --timeout passes (closing at once, with its bytes unread, resets the connection, and the client may lose
    the answer it has not read yet). A client that half-closes after its request (shutdown(SHUT_WR), as
    `nc -N` does) still gets its answers (uvicorn closed the connection at once)."""
    try:
        from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol
    except ImportError:
        return None
    timeout_s = config.timeout_s
    retry_after = b"retry-after: %d\r\n" % RETRY_AFTER_S
    logging.getLogger("uvicorn.error").addFilter(QUIET_INVALID_REQUESTS)

    def answer_bytes(status: int, message: str, headers: bytes = b"") -> bytes:
        """A whole answer of error_body, written by the protocol itself, the connection then closed."""
        body = error_body(status, message)
        return (STATUS_LINE[status] + headers + b"content-type: %s\r\n" % ERROR_TYPE.encode() +
                b"content-length: %d\r\nconnection: close\r\n\r\n" % len(body) + body)

    class GuardedHttpToolsProtocol(HttpToolsProtocol):
        def connection_made(self, transport) -> None:
            self.reading_head, self.head = True, bytearray()
            self.head_timer = self.linger_timer = self.write_timer = None
            self.refusal = None                 # (status line + headers + body) written once no answer is owed
            self.close_promised = False         # an answer said `connection: close`: no request is read after it
            self.peer_closed = False            # the client half-closed: close once its answers are sent
            super().connection_made(transport)
            metrics.connections.inc()
            if len(self.connections) > config.max_connections:
                return self.refuse(503, f"the server has {config.max_connections:,} connections open; try again in "
                                        f"a moment", "too_many_connections", retry_after)
            self.start_head_timer()

        def answers_owed(self) -> bool:
            return (self.cycle is not None and not self.cycle.response_complete) or bool(self.pipeline)

        def start_head_timer(self) -> None:
            if self.head_timer is None:
                self.head_timer = self.loop.call_later(timeout_s, self.head_timed_out)

        def stop_timers(self) -> None:
            for timer in (self.head_timer, self.linger_timer):
                if timer is not None:
                    timer.cancel()
            self.head_timer = self.linger_timer = None

        def data_received(self, data: bytes) -> None:
            if self.refusal is not None or self.close_promised:     # closing: no request is read any more
                return
            if self.reading_head:               # a head is held here until whole, then given to the parser
                self.start_head_timer()
                searched = max(len(self.head) - 3, 0)
                self.head += data
                end = self.head.find(b"\r\n\r\n", searched)
                if (end if end >= 0 else len(self.head)) > HEAD_LIMIT:
                    return self.refuse(431, f"the request's line and headers are over {HEAD_LIMIT:,} bytes",
                                       "head_too_large")
                if end < 0 and NOT_A_HEAD.search(self.head, searched):    # refused by the parser now, not
                    data, self.head = bytes(self.head), bytearray()        # with 408 after --timeout
                    return super().data_received(data)
                if end < 0:
                    return
                data = UPGRADE_HEADER.sub(b"\r\nx-ignored-upgrade:", bytes(self.head[:end + 4])) + self.head[end + 4:]
                self.head = bytearray()
            super().data_received(data)

        def on_headers_complete(self) -> None:
            if self.refusal is not None or self.close_promised:    # the rest of a read: not a request any more
                return
            self.reading_head = False
            self.stop_timers()
            super().on_headers_complete()
            self.cycle.send = self.saying_close_when_answered_early(self.cycle)
            if len(self.pipeline) > PIPELINE_LIMIT:
                self.pipeline.popleft()         # this one (appended on the left), refused after those before it;
                self.cycle = self.pipeline[0][0]        # self.cycle: the last request that will be answered
                self.refuse(503, f"more than {PIPELINE_LIMIT} requests sent ahead of their answers; read them, "
                                 f"then send more", "pipeline_full", retry_after)

        def on_body(self, body: bytes) -> None:
            if self.refusal is None:
                super().on_body(body)

        def on_message_complete(self) -> None:
            if self.refusal is not None:
                return
            super().on_message_complete()
            self.stop_timers()
            self.reading_head = True            # the next request's head

        def saying_close_when_answered_early(self, cycle):
            """cycle.send, adding `connection: close` to an answer started before the request's body is all in;
            the connection then ends in a staged close once that answer is out (not at once, as uvicorn would)."""
            send = cycle.send

            async def send_saying_close(message) -> None:
                if message["type"] != "http.response.start" or not cycle.more_body or cycle.disconnected:
                    return await send(message)
                self.close_promised = True
                await send({**message, "headers": [*message.get("headers", ()), (b"connection", b"close")]})
                cycle.keep_alive = True         # uvicorn closes at the answer's end; on_response_complete will

            return send_saying_close

        def on_response_complete(self) -> None:
            super().on_response_complete()      # (starts the next pipelined request, resumes reading)
            if self.transport.is_closing():
                return
            if self.refusal is not None or self.pipeline:
                self.flow.pause_reading()       # read on only once the requests already in are answered
            if self.answers_owed():
                return
            if self.refusal is not None:
                self.close_gently(self.refusal)
            elif self.peer_closed:
                self.transport.close()
            elif self.close_promised:
                self.close_gently()

        def close_gently(self, last_words: bytes = b"") -> None:
            """The staged close of RFC 9112 9.6, once no answer is owed: write last_words, shut the write side,
            drop what the client still sends until it closes (eof_received) or --timeout passes, then close. Over
            --max-connections, closed at once: a lingering connection holds an open file."""
            self.stop_timers()
            if self.timeout_keep_alive_task is not None:    # uvicorn's idle timer: would cut the linger short
                self.timeout_keep_alive_task.cancel()
                self.timeout_keep_alive_task = None
            self.transport.write(last_words)
            if len(self.connections) > config.max_connections or not self.transport.can_write_eof():
                return self.transport.close()
            self.transport.write_eof()
            self.flow.resume_reading()
            self.linger_timer = self.loop.call_later(timeout_s, self.transport.close)

        def eof_received(self) -> bool | None:
            """The client will send no more: keep the connection to send the answers it is owed (True), unless
            its upload was cut short (then closed, as uvicorn did: the request ends as incomplete_upload)."""
            if self.cycle is not None and self.cycle.more_body or not self.answers_owed():
                return None
            self.peer_closed = True
            return True

        def pause_writing(self) -> None:
            super().pause_writing()
            if self.write_timer is None:        # the client reads no answer: closed after --timeout
                self.write_timer = self.loop.call_later(timeout_s, self.transport.abort)

        def resume_writing(self) -> None:
            if self.write_timer is not None:
                self.write_timer.cancel()
                self.write_timer = None
            if self.transport.is_closing() and self.cycle is not None:
                self.cycle.disconnected = True  # uvloop resumes a paused write as it closes: nothing more is written
            super().resume_writing()

        def connection_lost(self, exc) -> None:
            self.stop_timers()
            if self.write_timer is not None:
                self.write_timer.cancel()
            metrics.connections.dec()
            super().connection_lost(exc)

        def head_timed_out(self) -> None:
            self.head_timer = None
            if not self.reading_head or self.transport.is_closing() or self.refusal is not None:
                return
            if self.answers_owed():             # a pipelined head behind an answer
                return self.start_head_timer()
            if self.head:
                return self.refuse(408, f"no whole request within {timeout_s:g} s", "head_timeout")
            self.transport.close()

        def shutdown(self) -> None:
            """SIGTERM: uvicorn closed a connection with part of a head in it, no answer; now 503 (try again)."""
            if self.reading_head and self.head and self.refusal is None and not self.answers_owed():
                return self.refuse(503, "the server is stopping; try again in a moment", "stopping", retry_after)
            super().shutdown()

        def send_400_response(self, msg: str) -> None:
            """uvicorn's answer to bytes the parser cannot read. In the body of the request in flight: that
            request's answer, counted by the application (incomplete_upload); in the body of one already
            answered: no second answer, the connection closed; else a request of its own, answered in turn."""
            if self.cycle is not None and self.cycle.more_body:
                if not self.cycle.response_complete:    # the JSON error of every other answer, not uvicorn's text
                    self.transport.write(answer_bytes(400, "the upload's body cannot be read as HTTP (its chunked "
                                                           "encoding is broken)"))
                return self.transport.close()
            self.refuse(400, msg, "bad_http")

        def refuse(self, status: int, message: str, reason: str, headers: bytes = b"") -> None:
            """Answer a request the application never sees, after the answers still owed, then close; the
            connection reads nothing more."""
            if self.refusal is not None:
                return
            metrics.unserved.labels(str(status), reason).inc()
            self.refusal = answer_bytes(status, message, headers)
            self.stop_timers()
            if self.answers_owed():
                self.flow.pause_reading()       # written, then the connection closed, once they are out
            else:
                self.close_gently(self.refusal)

    return GuardedHttpToolsProtocol


@dataclass
class ServeConfig:
    """The server's settings; their defaults are the command's."""
    max_batch: int = 16
    max_delay_s: float = 0.010
    queue: int = 64                     # uploads in the server at once (decoding, waiting, computing: QueuePlaces)
    timeout_s: float = 10.0
    max_body: int = 10_000_000          # bytes
    max_pixels: int = 50_000_000        # a 48-megapixel phone photo passes
    max_connections: int = 1000         # open at once (a browser keeps up to 6 a server); more get 503
    upload_memory: int = 256_000_000    # bytes of uploads held at once (serve_app.UploadMemory); more get 503
    top_k: int = 3
    decode_threads: int = usable_cpus()     # the photo decoding pool (OpenCV drops the GIL)


DEFAULTS = ServeConfig()


def build_parser():
    parser = command_parser(PROG, __doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1])
    parser.add_argument("--model", metavar="M.bin", help="the model file (default: the bundled models/tomato_leaf.bin)")
    parser.add_argument("--host", default="127.0.0.1",
                        help="address to listen on (default 127.0.0.1, this computer only; 0.0.0.0 for every network)")
    parser.add_argument("--port", type=int, default=DEFAULT_PORT, help=f"TCP port (default {DEFAULT_PORT}; 0 = any free port)")
    parser.add_argument("--max-batch", type=int, default=DEFAULTS.max_batch, metavar="N",
                        help=f"most images per batch (default {DEFAULTS.max_batch}; 1 = no batching)")
    parser.add_argument("--max-delay-ms", type=float, default=DEFAULTS.max_delay_s * 1000, metavar="MS",
                        help=f"longest wait for photos still being decoded, from when a batch's first was "
                             f"ready or the batch before ended, whichever is later "
                             f"(default {DEFAULTS.max_delay_s * 1000:g})")
    parser.add_argument("--queue", type=int, default=DEFAULTS.queue, metavar="N",
                        help=f"most uploads in the server at once (being decoded, waiting for the model or in "
                             f"it; uploads still arriving take no place); more are refused with 503 "
                             f"(default {DEFAULTS.queue})")
    parser.add_argument("--threads", default="auto", metavar="N|auto",
                        help="threads for the Numba backend: a batch split over them by images, a lone photo's "
                             "layers too; default auto, the usable cores, as lnn-infer (1: inference on one core, "
                             "decoding and HTTP on the others: less CPU per request, fewer answers a second; "
                             "BENCHMARKS serve_load)")
    parser.add_argument("--timeout", type=float, default=DEFAULTS.timeout_s, metavar="S",
                        help=f"seconds before a request gets 504 (default {DEFAULTS.timeout_s:g})")
    parser.add_argument("--max-body", type=int, default=DEFAULTS.max_body, metavar="BYTES",
                        help=f"largest upload; bigger ones get 413 (default {DEFAULTS.max_body})")
    parser.add_argument("--max-pixels", type=int, default=DEFAULTS.max_pixels, metavar="N",
                        help=f"largest image in pixels; bigger ones get 400 (default {DEFAULTS.max_pixels})")
    parser.add_argument("--upload-memory", type=int, default=DEFAULTS.upload_memory, metavar="BYTES",
                        help=f"most bytes of uploads held at once; an upload past it gets 503 (default "
                             f"{DEFAULTS.upload_memory}, at least --max-body)")
    parser.add_argument("--max-connections", type=int, default=DEFAULTS.max_connections, metavar="N",
                        help=f"most connections open at once; more get 503 (default {DEFAULTS.max_connections}, at "
                             f"most the open-files limit less {FILES_KEPT_FREE})")
    parser.add_argument("--top-k", type=int, default=DEFAULTS.top_k, metavar="K",
                        help=f"labels per answer unless the request asks (default {DEFAULTS.top_k})")
    parser.add_argument("--device", choices=("auto", "cpu", "numpy"), default="auto",
                        help="backend: auto (Numba when installed, else NumPy), cpu (Numba), numpy")
    return parser


def lan_address() -> str:
    """This computer's address on its local network (the one phones on the same Wi-Fi reach), or 127.0.0.1
    when it has none. Asks the routing table only: no packet is sent."""
    probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        probe.connect(NO_ROUTE_PROBE)
        return probe.getsockname()[0]
    except OSError:
        return "127.0.0.1"
    finally:
        probe.close()


def phone_url(host: str, port: int) -> str:
    """The address phones should open: the LAN address when listening on every network."""
    return f"http://{lan_address() if host in ALL_NETWORKS else host}:{port}/"


def phones_can_open(url: str) -> bool:
    """False for a loopback address (127.0.0.1, ::1, localhost): a phone opening it reaches itself, not this
    computer, so its QR code would only mislead."""
    host = urlsplit(url).hostname or ""
    try:
        return not ipaddress.ip_address(host).is_loopback
    except ValueError:                           # a name
        return host != "localhost"


def listening_socket(host: str, port: int) -> socket.socket:
    """Bind here, not in uvicorn, so a port in use is one clear error before anything starts."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)   # IPPROTO_TCP: asyncio then sets
    # TCP_NODELAY on each connection (with proto 0 it does not, and every answer waited ~40 ms for an ACK)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as err:
        sock.close()
        raise LnnInputError(f"cannot listen on {host}:{port} ({err.strerror or err})") from None
    sock.listen(128)
    return sock


def check_options(args) -> None:
    from lnn.tools.infer import threads_option

    args.threads = threads_option(args.threads)
    for name in ("max_batch", "queue", "max_body", "max_pixels", "max_connections", "top_k"):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise LnnInputError(f"--{name.replace('_', '-')} must be at least 1, not {value}")
    if not math.isfinite(args.max_delay_ms) or args.max_delay_ms < 0:
        raise LnnInputError(f"--max-delay-ms must be a number of at least 0, not {args.max_delay_ms}")
    if not math.isfinite(args.timeout) or args.timeout <= 0:       # nan: every connection's timer failed
        raise LnnInputError(f"--timeout must be a number above 0, not {args.timeout}")
    if args.upload_memory < args.max_body:
        raise LnnInputError(f"--upload-memory ({args.upload_memory}) must be at least --max-body ({args.max_body}), "
                            f"or no upload that large could be taken")
    if not 0 <= args.port < 65536:
        raise LnnInputError(f"--port must be between 0 (any free port) and 65535, not {args.port}")


def server_for(model, host: str, port: int, device: str = "auto", threads: int | str = "auto", **settings):
    """(uvicorn.Server, its bound socket) for a model: the whole server, ready to run on any thread; the
    Session is `server.config.app.state.session`.

    threads: the Numba backend's (a count or "auto"); photos decode on one thread per core. settings: ServeConfig's fields
    (max_batch, max_delay_s, queue, timeout_s, max_body, max_pixels, max_connections, upload_memory, top_k)."""
    try:
        import uvicorn

        from lnn.tools.serve_app import create_app
    except ImportError as err:
        raise LnnError(f"lnn-serve needs the serve extra ({err}): pip install 'lnn[serve]'") from None
    from lnn.runtime import resolve_device
    from lnn.tools.infer import load_session

    device = resolve_device(device)
    session = load_session(model, device, threads if device == "cpu" else None)
    config = ServeConfig(**settings)
    sock = listening_socket(host, port)
    app = create_app(session, config)
    app.state.phone_url = phone_url(host, sock.getsockname()[1])     # the page's QR code falls back to it
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False, lifespan="on",
                                           http=guarded_protocol(config, app.state.metrics) or "auto",
                                           timeout_graceful_shutdown=config.timeout_s + 5))
    return server, sock


def one_blas_thread():
    """Hold BLAS at one thread while a server runs (threadpoolctl's limits; restore_original_limits() ends it).

    The server runs calls side by side itself (the decode pool, the inference thread); a threaded BLAS call
    beside them (the gate's products at batch 8 and over) woke OpenBLAS's helper thread, which then
    busy-waits for more work: on 2 cores it burnt 1.6-3.8 ms of CPU per request, about as much as the model
    (BENCHMARKS serve_load). Called on the thread that starts the server, not in the app's lifespan: threadpoolctl
    (3.8) lets only the first thread that sets an OpenBLAS count set it until its limits end (its "controlling
    thread"; backend.any_thread_setter), and uvicorn runs lnn-field's server on a thread of its own."""
    from threadpoolctl import threadpool_limits

    return threadpool_limits(1, user_api="blas")


class BackgroundServer:
    """lnn-serve on a thread of this process (lnn-field's menu): start() binds and starts, stop() drains and
    ends; BLAS is held at one thread in between (one_blas_thread)."""

    def __init__(self, model, host: str = "0.0.0.0", port: int = DEFAULT_PORT):
        self.server, sock = server_for(model, host, port)
        self.blas = one_blas_thread()
        self.host, self.port = host, sock.getsockname()[1]
        self.url = phone_url(host, self.port)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]},
                                       name="lnn-serve", daemon=True)
        self.thread.start()

    @property
    def running(self) -> bool:
        return self.thread.is_alive()

    @property
    def warming_up(self) -> bool:
        return warming_up(self.server)

    def stop(self, timeout_s: float = 15.0) -> None:
        self.server.should_exit = True
        self.thread.join(timeout_s)
        self.blas.restore_original_limits()


def more_open_files() -> int | None:
    """Raise this process's soft limit on open files to its hard one, as servers do: each connection is a file,
    and under the usual soft limit of 1,024 about 1,000 open connections (idle or slow ones included) got every
    further phone's connection reset until some closed. -> the soft limit now (None: no such limit)."""
    try:
        import resource
    except ImportError:                         # Windows: no such limit to raise
        return None
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    with contextlib.suppress(ValueError, OSError):          # macOS: an unlimited hard limit is not settable
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    return None if soft == resource.RLIM_INFINITY else soft


def serve(args) -> int:
    check_options(args)
    files = more_open_files()
    if files is not None and args.max_connections > files - FILES_KEPT_FREE:     # past it, accept() fails silently
        args.max_connections = max(1, files - FILES_KEPT_FREE)
    server, sock = server_for(args.model, args.host, args.port, args.device, args.threads,
                              max_batch=args.max_batch, max_delay_s=args.max_delay_ms / 1000, queue=args.queue,
                              timeout_s=args.timeout, max_body=args.max_body, max_pixels=args.max_pixels,
                              max_connections=args.max_connections, upload_memory=args.upload_memory,
                              top_k=args.top_k)
    # uvicorn catches SIGTERM, drains the requests in flight, puts the previous handler back and raises the
    # signal again; this handler makes that second delivery harmless, so a drained server exits 0. Set before
    # the banner, and stopping the server: a SIGTERM between the banner and uvicorn's own handler (its loop's
    # start) was swallowed by a no-op handler here, and the server then ran on, deaf to it.
    signal.signal(signal.SIGTERM, lambda *_: setattr(server, "should_exit", True))
    print_banner(args.host, sock, server.config.app.state.session.describe_threads())
    one_blas_thread()                           # until the process ends
    try:
        server.run(sockets=[sock])
    except KeyboardInterrupt:                   # Ctrl-C: uvicorn stops the server, then raises the SIGINT again
        if server.started and warming_up(server):
            leave_during_the_warm_up(EXIT_INTERRUPTED)
        raise
    if not server.started:
        error_line(PROG, "the server did not start (see the message above)")
        return 1
    if warming_up(server):
        leave_during_the_warm_up(0)
    return 0


def warming_up(server) -> bool:
    """The server's model is not ready yet: a compile may be running, or about to start (before the lifespan
    has run there is no batcher); not once its warm-up has failed."""
    batcher = getattr(server.config.app.state, "batcher", None)
    return batcher is None or not (batcher.ready.is_set() or batcher.failed is not None)


def leave_during_the_warm_up(exit_code: int) -> None:
    """Stopped (SIGTERM, Ctrl-C) before the model was warmed up: the inference thread is inside a compile,
    which cannot be interrupted, and the interpreter's exit would wait for it (a first start's compile held
    a SIGTERM 12 s and a Ctrl-C 14 s, silently). Numba writes each cache file whole (to a temporary name, then
    renamed), so leaving at once loses only the kernels being compiled: the next start compiles them again."""
    after_ctrl_c = "" if exit_code == 0 else "\n"          # (a terminal's ^C is on the line)
    print(f"{after_ctrl_c}{PROG}: stopped during the model's warm-up (its compile is dropped; the next start "
          f"does it again)", file=sys.stderr)
    leave_at_once(exit_code)


def leave_at_once(exit_code: int) -> None:
    """End the process now, its output flushed, without waiting for its threads (os._exit)."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(exit_code)


def print_banner(host: str, sock: socket.socket, runtime: str | None = None) -> None:
    """The first line on stderr, which launch_process() waits for: the address, and the phones' one; then
    what computes the answers (Session.describe_threads), when given."""
    port = sock.getsockname()[1]
    where = f"http://{host}:{port}/"
    if host in ALL_NETWORKS:
        where += f" (phones on this network open {phone_url(host, port)})"
    print(f"{PROG}: {BANNER} {where} ({runtime + '; ' if runtime else ''}Ctrl-C or SIGTERM stops)",
          file=sys.stderr, flush=True)


def launch_process(*args, program=("-m", "lnn.tools.serve"), timeout_s: float = 120.0, **popen_options) -> tuple:
    """lnn-serve ARGS... as a child process -> (Popen, base URL) once it listens (its banner line on stderr).
    Pass --port 0 for a free port. A thread keeps reading its stderr (so a chatty server never blocks on a
    full pipe) into the list `process.stderr_lines`; that thread, `process.stderr_reader`, ends once the process
    has ended and its stderr is all read (join it to read every line). For tests, benchmarks and scripts that
    need a real server (`program`: another Python program printing the same banner); raises LnnError when it
    exits or stays silent instead."""
    import select
    import subprocess

    process = subprocess.Popen([sys.executable, *program, *map(str, args)], stderr=subprocess.PIPE,
                               stdout=subprocess.DEVNULL, text=True, **popen_options)
    ready, _, _ = select.select([process.stderr], [], [], timeout_s)
    line = process.stderr.readline() if ready else ""
    if f" {BANNER} " not in line:
        process.kill()
        process.wait()
        raise LnnError(f"lnn-serve did not start: {' '.join((line + process.stderr.read()).split()) or 'no output'}")
    process.stderr_lines = [line]
    process.stderr_reader = threading.Thread(target=lambda: process.stderr_lines.extend(process.stderr), daemon=True)
    process.stderr_reader.start()
    return process, line.split(f" {BANNER} ", 1)[1].split()[0]


def main(argv=None) -> int:
    return run_command(build_parser(), serve, argv)


if __name__ == "__main__":
    sys.exit(main())
