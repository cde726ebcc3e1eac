"""The FastAPI application of :class:`tierkv.engine.server.CompletionServer`: routes, body limits, tenants,
the per-token sink that runs on the engine thread, and one access-log line per request."""

from __future__ import annotations

import asyncio
import hmac
import json
import time
from typing import TYPE_CHECKING, AsyncIterator

import torch
from fastapi import FastAPI, Request as HttpRequest
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from prometheus_client.exposition import choose_encoder
from starlette.exceptions import HTTPException as StarletteHTTPException

from tierkv.engine import openai_api as api
from tierkv.engine.openai_api import ApiError, TokenOut, Usage
from tierkv.engine.request import Request
from tierkv.engine.server import _DONE, CompletionJob, access_log

if TYPE_CHECKING:
    from tierkv.engine.server import CompletionServer


class TokenSink:
    """Runs on the engine thread for each token: text (holding back a possible stop string's start),
    stop strings, log-probabilities and the TTFT histogram; then hands a TokenOut to the request's handler."""

    def __init__(self, server: "CompletionServer", stops: list[str], top_k: int | None, deliver) -> None:
        self.tokenizer, self.ttft = server.tokenizer, server.metrics.ttft
        self.stream = server.tokenizer.stream()
        self.stops, self.top_k, self.deliver = stops, top_k, deliver
        self.hold = max((len(s) for s in stops), default=1) - 1
        self.pending, self.stopped = "", False

    def on_token(self, request: Request, token: int) -> None:
        if token < 0 or self.stopped:  # -1: the request failed; the loop delivers _DONE next
            return
        if len(request.output) == 1:
            self.ttft.observe(request.ttft_s)
        self.pending += self.stream.push(token)
        text = self._release(request)
        out = TokenOut(token, text)
        if self.top_k is not None:
            out.piece = self.tokenizer.decode([token])
            self._logprobs(out, request.last_logits)
        self.deliver(out)

    def _release(self, request: Request) -> str:
        hits = [i for i in (self.pending.find(s) for s in self.stops) if i >= 0]
        if hits:
            text, self.pending, self.stopped = self.pending[:min(hits)], "", True
            request.stop_requested = True
            return text
        cut = len(self.pending) - self.hold
        text, self.pending = self.pending[:max(cut, 0)], self.pending[max(cut, 0):]
        return text

    def _logprobs(self, out: TokenOut, logits: torch.Tensor) -> None:
        logprobs = torch.log_softmax(logits.float(), dim=-1)
        out.logprob = float(logprobs[out.token_id])
        if self.top_k:
            values, ids = logprobs.topk(self.top_k)
            out.top = [(self.tokenizer.decode([int(i)]), float(v)) for v, i in zip(values, ids)]

    def tail(self) -> str:
        """Text still held back once generation has ended (a stop string can still cut it)."""
        if self.stopped:
            return ""
        text, self.pending = self.pending + self.stream.finish(), ""
        hits = [i for i in (text.find(s) for s in self.stops) if i >= 0]
        if hits:
            self.stopped = True
            return text[:min(hits)]
        return text


class Generation:
    """One submitted request, seen from the asyncio side."""

    def __init__(self, server: "CompletionServer", ids: list[int], max_new: int, extra_key: str | None,
                 req: api._Common) -> None:
        loop, self.queue = asyncio.get_running_loop(), asyncio.Queue()

        def deliver(item: object) -> None:
            try:
                loop.call_soon_threadsafe(self.queue.put_nowait, item)
            except RuntimeError:  # the event loop is gone (shutdown): nobody is waiting any more
                pass

        self.sink = TokenSink(server, api.stop_strings(req), api.top_logprobs_wanted(req), deliver)
        self.request = Request(ids, max_new, extra_key=extra_key, eos_token_id=server.tokenizer.eos_token_id,
                               on_token=self.sink.on_token)
        self.server = server
        try:
            server.loop.submit(CompletionJob(self.request, deliver))
        except RuntimeError as exc:
            raise ApiError(503, str(exc), kind="server_error") from None

    async def tokens(self) -> AsyncIterator[TokenOut]:
        while (item := await self.queue.get()) is not _DONE:
            yield item

    def error(self) -> ApiError | None:
        if self.request.error is None:
            return None
        status = 503 if self.server.loop.broken else 400
        return ApiError(status, self.request.error, kind="server_error" if status == 503 else "invalid_request_error")

    def finish_reason(self) -> str:
        if self.sink.stopped or (self.request.output and self.request.output[-1] == self.request.eos_token_id):
            return "stop"
        return "length"

    def usage(self) -> Usage:
        return Usage(len(self.request.prompt), len(self.request.output), self.request.cache_hit_tokens)


# ---- request intake -----------------------------------------------------------------------------
async def read_body(request: HttpRequest, limit: int) -> bytes:
    """The body, refused (413, connection closed) past ``limit`` bytes, declared or chunked."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise ApiError(413, f"body of {declared} bytes is over the limit of {limit}")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise ApiError(413, f"body is over the limit of {limit} bytes")
        chunks.append(chunk)
    return b"".join(chunks)


def tenant_key(server: "CompletionServer", request: HttpRequest, salt: str | None) -> str | None:
    """The cache namespace (RadixKey extra_key) of this request: its tenant's and its cache_salt's."""
    parts = []
    if server.api_keys is not None:
        given = request.headers.get("authorization", "").removeprefix("Bearer ").strip()
        tenant = next((t for key, t in server.api_keys.items() if hmac.compare_digest(key, given)), None)
        if tenant is None:
            raise ApiError(401, "missing or unknown API key (Authorization: Bearer KEY)", kind="authentication_error")
        parts.append(f"tenant:{tenant}")
        request.state.log["tenant"] = tenant
    if salt is not None:
        parts.append(f"salt:{salt}")
    return "|".join(parts) or None


def check_fits(server: "CompletionServer", ids: list[int], max_new: int) -> None:
    """Refuse, before anything is queued or evicted, a request the device pool or the model can never hold."""
    engine = server.loop.engine
    page = engine.cache.config.page_size
    needed = -(-(len(ids) + max_new - 1) // page) * page
    if needed > engine.device_pool.num_slots:
        raise ApiError(400, f"prompt ({len(ids)} tokens) plus max_tokens ({max_new}) needs {needed} KV slots; "
                            f"the device pool has {engine.device_pool.num_slots}", "prompt")
    if len(ids) + max_new > engine.model.config.max_position:
        raise ApiError(400, f"prompt ({len(ids)} tokens) plus max_tokens ({max_new}) is over the model's "
                            f"{engine.model.config.max_position} positions", "prompt")
    vocab = engine.model.config.vocab_size
    bad = [t for t in ids if not 0 <= t < vocab]
    if bad:
        raise ApiError(400, f"prompt: token ids out of range [0, {vocab}): {bad[:5]}", "prompt")


async def start(server: "CompletionServer", http: HttpRequest, kind: type[api._Common]):
    """Parse, authenticate, tokenise and submit; returns the parsed request, the prompt text and the run."""
    req = api.parse_request(kind, await read_body(http, server.limits.max_body_bytes))
    extra_key = tenant_key(server, http, req.cache_salt)
    if req.model is not None and req.model != server.model_name:
        raise ApiError(404, f"model {req.model!r} not found; this server serves {server.model_name!r}", "model")
    if isinstance(req, api.ChatRequest):
        ids, prompt_text = server.tokenizer.chat_prompt(api.chat_messages(req)), ""
    else:
        prompt = api.completion_prompt(req)
        ids = server.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        prompt_text = prompt if isinstance(prompt, str) else server.tokenizer.decode(ids)
    if not ids:
        raise ApiError(400, "prompt: is empty", "prompt")
    max_new = api.max_new_tokens(req)
    check_fits(server, ids, max_new)
    http.state.log.update(prompt_tokens=len(ids))
    return req, prompt_text, Generation(server, ids, max_new, extra_key, req)


# ---- responses ------------------------------------------------------------------------------------
async def complete(server: "CompletionServer", http: HttpRequest, req, prompt_text: str, gen: Generation) -> dict:
    tokens = [t async for t in gen.tokens()]
    if (err := gen.error()) is not None:
        raise err
    text = "".join(t.text for t in tokens) + gen.sink.tail()
    _log_usage(http, gen)
    if isinstance(req, api.ChatRequest):
        choice = {"index": 0, "message": {"role": "assistant", "content": text},
                  "logprobs": api.chat_logprobs(tokens) if req.logprobs else None,
                  "finish_reason": gen.finish_reason()}
        return api.envelope("chat.completion", gen.request.rid, server.model_name, choice) | {
            "usage": gen.usage().body()}
    echo = prompt_text if req.echo else ""
    choice = {"index": 0, "text": echo + text, "token_ids": [t.token_id for t in tokens],
              "logprobs": api.completion_logprobs(tokens, len(echo)) if req.logprobs is not None else None,
              "finish_reason": gen.finish_reason()}
    return api.envelope("text_completion", gen.request.rid, server.model_name, choice) | {"usage": gen.usage().body()}


async def stream(server: "CompletionServer", http: HttpRequest, req, prompt_text: str,
                 gen: Generation) -> AsyncIterator[bytes]:
    chat = isinstance(req, api.ChatRequest)
    kind = "chat.completion.chunk" if chat else "text_completion"

    def event(choice: dict | None, **extra) -> bytes:
        body = api.envelope(kind, gen.request.rid, server.model_name, choice) if choice else \
            api.envelope(kind, gen.request.rid, server.model_name, {}) | {"choices": []}
        return b"data: " + json.dumps(body | extra).encode() + b"\n\n"

    def choice(text: str, token: TokenOut | None, finish: str | None) -> dict:
        if chat:
            out = {"index": 0, "delta": {"content": text} if text or token else {}, "finish_reason": finish,
                   "logprobs": api.chat_logprobs([token]) if token and req.logprobs else None}
        else:
            out = {"index": 0, "text": text, "finish_reason": finish, "token_ids": [token.token_id] if token else [],
                   "logprobs": api.completion_logprobs([token], 0) if token and req.logprobs is not None else None}
        return out

    if chat:
        yield event({"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None,
                     "logprobs": None})
    elif req.echo:
        yield event(choice(prompt_text, None, None))
    async for token in gen.tokens():
        yield event(choice(token.text, token, None))
    if (err := gen.error()) is not None:
        yield b"data: " + json.dumps(err.body()).encode() + b"\n\n"
    else:
        yield event(choice(gen.sink.tail(), None, gen.finish_reason()))
        _log_usage(http, gen)
        if req.stream_options is not None and req.stream_options.include_usage:
            yield event(None, usage=gen.usage().body())
    yield b"data: [DONE]\n\n"


def _log_usage(http: HttpRequest, gen: Generation) -> None:
    usage = gen.usage()
    http.state.log.update(cached_tokens=usage.cached_tokens, completion_tokens=usage.completion_tokens)


# ---- the application -----------------------------------------------------------------------------
def build_app(server: "CompletionServer") -> "AccessLog":
    app = FastAPI(title="tierkv", docs_url=None, redoc_url=None, openapi_url=None)

    @app.exception_handler(ApiError)
    async def api_error(request: HttpRequest, exc: ApiError) -> JSONResponse:
        headers = {"connection": "close"} if exc.status == 413 else None  # the unread body must not be parsed
        return JSONResponse(exc.body(), status_code=exc.status, headers=headers)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: HttpRequest, exc: StarletteHTTPException) -> JSONResponse:
        message = f"no route {request.method} {request.url.path}" if exc.status_code in (404, 405) else exc.detail
        return JSONResponse(ApiError(exc.status_code, str(message)).body(), status_code=exc.status_code)

    @app.get("/health")
    async def health() -> PlainTextResponse:
        if server.loop.broken:
            return PlainTextResponse(server.loop.broken, status_code=503)
        return PlainTextResponse("ok")

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [{"id": server.model_name, "object": "model", "created": 0,
                                            "owned_by": "tierkv"}]}

    @app.get("/metrics")
    def metrics(request: HttpRequest) -> Response:  # sync: it waits for the engine lock on a worker thread
        encoder, content_type = choose_encoder(request.headers.get("accept"))
        return Response(encoder(server.metrics.registry), media_type=content_type)

    async def serve(http: HttpRequest, kind: type[api._Common]) -> Response:
        req, prompt_text, gen = await start(server, http, kind)
        if req.stream:
            return StreamingResponse(stream(server, http, req, prompt_text, gen), media_type="text/event-stream",
                                     headers={"cache-control": "no-cache"})
        return JSONResponse(await complete(server, http, req, prompt_text, gen))

    @app.post("/v1/completions")
    async def completions(http: HttpRequest) -> Response:
        return await serve(http, api.CompletionRequest)

    @app.post("/v1/chat/completions")
    async def chat_completions(http: HttpRequest) -> Response:
        return await serve(http, api.ChatRequest)

    return AccessLog(app)


class AccessLog:
    """ASGI wrapper: one log line per HTTP request once its response has been sent (streams included)."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start_s, status, details = time.perf_counter(), [0], {}
        scope.setdefault("state", {})["log"] = details

        async def logged_send(message) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)
            if message["type"] == "http.response.body" and not message.get("more_body", False):
                client = scope.get("client") or ("-", 0)
                extra = " ".join(f"{k}={v}" for k, v in details.items())
                access_log.info('%s:%s "%s %s" %d %.1fms %s', client[0], client[1], scope["method"], scope["path"],
                                status[0], 1000 * (time.perf_counter() - start_s), extra)

        await self.app(scope, receive, logged_send)
