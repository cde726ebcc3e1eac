"""HTTP front end: OpenAI-compatible ``/v1/completions`` (plain and SSE streaming) and ``/metrics``.

One engine thread owns the engine (the cache's thread contract: one scheduler thread); HTTP handler
threads only hand requests over through a queue and read the tokens back from a per-request queue.
"""

from __future__ import annotations

import codecs
import json
import logging
import queue
import threading
import time
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from tierkv.engine.engine import Engine
from tierkv.engine.metrics import render_metrics
from tierkv.engine.request import Request

log = logging.getLogger(__name__)

MAX_BODY_BYTES = 1 << 20
_DONE = object()


class ByteTokenizer:
    """Token id = byte value (UTF-8); ids >= 256 decode to nothing. Enough to drive a random model."""

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decoder(self) -> "codecs.IncrementalDecoder":
        return codecs.getincrementaldecoder("utf-8")(errors="replace")

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")


class BadRequest(ValueError):
    """A client error: answered with HTTP 400 and a JSON error body."""


@dataclass
class CompletionJob:
    request: Request
    tokens: "queue.Queue[int | object]"


class EngineLoop:
    """Runs the scheduler on its own thread; :meth:`submit` is safe from any thread."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self._inbox: queue.Queue[CompletionJob] = queue.Queue()
        self._active: list[CompletionJob] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="tierkv-engine", daemon=True)
        self.broken: str | None = None
        self.lock = threading.Lock()  # held while the engine steps, so /metrics reads a consistent view

    def start(self) -> "EngineLoop":
        self._thread.start()
        return self

    def submit(self, prompt: list[int], max_new_tokens: int) -> CompletionJob:
        if self.broken:
            raise RuntimeError(self.broken)
        tokens: queue.Queue = queue.Queue()
        request = Request(prompt, max_new_tokens, on_token=lambda r, t: tokens.put(t) if t >= 0 else None)
        job = CompletionJob(request, tokens)
        self._inbox.put(job)
        return job

    def _run(self) -> None:
        scheduler = self.engine.scheduler
        while not self._stop.is_set():
            try:
                wait_s = 0 if scheduler.has_work else 0.05
                job = self._inbox.get(timeout=wait_s) if wait_s else self._inbox.get_nowait()
                with self.lock:
                    scheduler.submit(job.request)
                self._active.append(job)
                continue  # drain the inbox before stepping so arrivals batch together
            except queue.Empty:
                pass
            if scheduler.has_work:
                try:
                    with self.lock:
                        scheduler.step()
                except Exception as exc:  # a bug must not hang every client: fail them and stop serving
                    log.exception("engine step failed")
                    self.broken = f"engine failed: {exc!r}"
                    for job in self._active:
                        job.request.error, job.request.finished = self.broken, True
                    self._stop.set()
            for job in [j for j in self._active if j.request.finished]:
                self._active.remove(job)
                job.tokens.put(_DONE)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)
        for job in self._active:
            job.request.error = job.request.error or "server shutting down"
            job.tokens.put(_DONE)


def parse_completion(body: bytes, tokenizer: ByteTokenizer, vocab_size: int) -> tuple[list[int], int, bool]:
    """Prompt ids, max_tokens and stream flag from a /v1/completions body; BadRequest on anything odd."""
    try:
        data = json.loads(body or b"")
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise BadRequest(f"body is not valid JSON: {exc}") from None
    except RecursionError:  # the decoder recurses per nesting level
        raise BadRequest("body is JSON nested too deeply") from None
    if not isinstance(data, dict):
        raise BadRequest("body must be a JSON object")
    prompt = data.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        ids = tokenizer.encode(prompt)
    elif isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        ids = prompt
    else:
        raise BadRequest("prompt must be a string or a list of token ids")
    if not ids:
        raise BadRequest("prompt is empty")
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise BadRequest(f"token ids out of range [0, {vocab_size}): {bad[:5]}")
    max_tokens = data.get("max_tokens", 16)
    if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or not 1 <= max_tokens <= 4096:
        raise BadRequest(f"max_tokens must be an int in [1, 4096], got {max_tokens!r}")
    stream = data.get("stream", False)
    if not isinstance(stream, bool):
        raise BadRequest(f"stream must be a boolean, got {stream!r}")
    return ids, max_tokens, stream


class CompletionHandler(BaseHTTPRequestHandler):
    """Routes: POST /v1/completions, GET /metrics, /health, /v1/models. Bound to a loop by :func:`make_handler`."""

    loop: EngineLoop
    model_name: str
    tokenizer = ByteTokenizer()
    protocol_version = "HTTP/1.1"

    def log_message(self, fmt: str, *args: object) -> None:
        log.debug("%s " + fmt, self.address_string(), *args)

    def do_GET(self) -> None:
        if self.path == "/metrics":
            with self.loop.lock:
                text = render_metrics(self.loop.engine)
            self._send(200, text.encode(), "text/plain; version=0.0.4")
        elif self.path == "/health":
            self._send(200, b"ok", "text/plain")
        elif self.path == "/v1/models":
            self._json(200, {"object": "list", "data": [{"id": self.model_name, "object": "model"}]})
        else:
            self._error(404, f"no route {self.path}")

    def do_POST(self) -> None:
        if self.path != "/v1/completions":
            self._error(404, f"no route {self.path}")
            return
        try:
            length = int(self.headers.get("Content-Length") or 0)
            if not 0 <= length <= MAX_BODY_BYTES:
                raise BadRequest(f"body length {length} outside [0, {MAX_BODY_BYTES}]")
            ids, max_tokens, stream = parse_completion(self.rfile.read(length), self.tokenizer, self.vocab_size)
        except (BadRequest, ValueError) as exc:
            self._error(400, str(exc))
            return
        try:
            job = self.loop.submit(ids, max_tokens)
        except RuntimeError as exc:
            self._error(503, str(exc))
            return
        if stream:
            self._stream(job)
        else:
            self._complete(job)

    def _complete(self, job: CompletionJob) -> None:
        ids = list(_iter_tokens(job))
        if job.request.error:
            self._error(503 if self.loop.broken else 400, job.request.error)
            return
        choice = {"index": 0, "text": self.tokenizer.decode(ids), "token_ids": ids, "logprobs": None,
                  "finish_reason": _finish_reason(job.request)}
        self._json(200, _envelope(job, self.model_name, choice) | {"usage": _usage(job.request)})

    def _stream(self, job: CompletionJob) -> None:
        try:
            self._stream_events(job)
        except (BrokenPipeError, ConnectionResetError):
            log.info("client of %s went away; the request still finishes and caches its KV", job.request.rid)

    def _stream_events(self, job: CompletionJob) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        self.send_header("Connection", "close")
        self.end_headers()
        self.close_connection = True
        decoder = self.tokenizer.decoder()
        for token in _iter_tokens(job):
            text = decoder.decode(bytes([token]) if token < 256 else b"")
            chunk = {"index": 0, "text": text, "token_ids": [token], "logprobs": None, "finish_reason": None}
            self._event(_envelope(job, self.model_name, chunk))
        if job.request.error:
            self._event({"error": {"message": job.request.error, "type": "invalid_request_error"}})
        else:
            final = {"index": 0, "text": decoder.decode(b"", final=True), "token_ids": [], "logprobs": None,
                     "finish_reason": _finish_reason(job.request)}
            self._event(_envelope(job, self.model_name, final) | {"usage": _usage(job.request)})
        self.wfile.write(b"data: [DONE]\n\n")
        self.wfile.flush()

    def _event(self, payload: dict) -> None:
        self.wfile.write(b"data: " + json.dumps(payload).encode() + b"\n\n")
        self.wfile.flush()

    def _json(self, status: int, payload: dict) -> None:
        self._send(status, json.dumps(payload).encode(), "application/json")

    def _error(self, status: int, message: str) -> None:
        self._json(status, {"error": {"message": message, "type": "invalid_request_error", "code": status}})

    def _send(self, status: int, body: bytes, content_type: str) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    @property
    def vocab_size(self) -> int:
        return self.loop.engine.model.config.vocab_size


def make_handler(loop: EngineLoop, model_name: str) -> type[CompletionHandler]:
    return type("BoundCompletionHandler", (CompletionHandler,), {"loop": loop, "model_name": model_name})


def _iter_tokens(job: CompletionJob):
    while (token := job.tokens.get()) is not _DONE:
        yield token


def _finish_reason(request: Request) -> str:
    return "length" if len(request.output) >= request.max_new_tokens else "stop"


def _usage(request: Request) -> dict:
    n_in, n_out = len(request.prompt), len(request.output)
    return {"prompt_tokens": n_in, "completion_tokens": n_out, "total_tokens": n_in + n_out,
            "cached_tokens": request.cache_hit_tokens}


def _envelope(job: CompletionJob, model_name: str, choice: dict) -> dict:
    return {"id": f"cmpl-{job.request.rid}", "object": "text_completion", "created": int(time.time()),
            "model": model_name, "choices": [choice]}


class CompletionServer:
    """An engine loop plus a threading HTTP server; ``port=0`` picks a free port (see :attr:`port`)."""

    def __init__(self, engine: Engine, host: str = "127.0.0.1", port: int = 0, model_name: str = "tierkv") -> None:
        self.loop = EngineLoop(engine)
        self.httpd = ThreadingHTTPServer((host, port), make_handler(self.loop, model_name))
        self.httpd.daemon_threads = True
        self._thread: threading.Thread | None = None

    @property
    def port(self) -> int:
        return self.httpd.server_address[1]

    def start(self) -> "CompletionServer":
        self.loop.start()
        self._thread = threading.Thread(target=self.httpd.serve_forever, name="tierkv-http", daemon=True)
        self._thread.start()
        return self

    def serve_forever(self) -> None:
        self.loop.start()
        self.httpd.serve_forever()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        self.loop.stop()
        self.loop.engine.close()
