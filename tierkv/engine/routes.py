"""The FastAPI application of a :class:`tierkv.engine.server.CompletionServer`: routes, body limits, tenants,
cancellation when a client goes away, OpenAI-shaped errors (500 included) and one access-log line per request."""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import time
from typing import AsyncIterator

from fastapi import FastAPI, Request as HttpRequest
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from prometheus_client.exposition import choose_encoder
from starlette.exceptions import HTTPException as StarletteHTTPException

from tierkv.engine import openai_api as api
from tierkv.engine.app_state import AppState
from tierkv.engine.generation import Generation
from tierkv.engine.openai_api import ApiError, TokenOut
from tierkv.hashing import request_extra_key

log = logging.getLogger(__name__)
access_log = logging.getLogger("tierkv.access")

CLIENT_GONE_STATUS = 499  # the access log's status for a request whose client hung up (nginx's convention)


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


def tenant_key(state: AppState, request: HttpRequest, salt: str | None) -> str | None:
    """The cache namespace (RadixKey extra_key) of this request: its tenant's and its cache_salt's."""
    tenant = None
    if state.api_keys is not None:
        # compared as bytes: compare_digest refuses non-ASCII str, and a header may hold any byte
        given = request.headers.get("authorization", "").encode("latin-1").removeprefix(b"Bearer ").strip()
        tenant = next((t for key, t in state.api_keys.items() if hmac.compare_digest(key.encode(), given)), None)
        if tenant is None:
            raise ApiError(401, "missing or unknown API key (Authorization: Bearer KEY)", kind="authentication_error")
        request.state.log["tenant"] = tenant
    return request_extra_key(tenant, salt)


def check_fits(state: AppState, ids: list[int], max_new: int) -> None:
    """Refuse, before anything is queued or evicted, a request the device pool or the model can never hold."""
    engine = state.loop.engine
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


async def start(state: AppState, http: HttpRequest, kind: type[api._Common]):
    """Parse, authenticate, tokenise and submit; returns the parsed request, the prompt text and the run."""
    req = api.parse_request(kind, await read_body(http, state.limits.max_body_bytes))
    extra_key = tenant_key(state, http, req.cache_salt)
    if req.model is not None and req.model != state.model_name:
        raise ApiError(404, f"model {req.model!r} not found; this server serves {state.model_name!r}", "model")
    if isinstance(req, api.ChatRequest):
        ids, prompt_text = state.tokenizer.chat_prompt(api.chat_messages(req)), ""
    else:
        prompt = api.completion_prompt(req)
        ids = state.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        prompt_text = prompt if isinstance(prompt, str) else state.tokenizer.decode(ids)
    if not ids:
        raise ApiError(400, "prompt: is empty", "prompt")
    max_new = api.max_new_tokens(req)
    check_fits(state, ids, max_new)
    http.state.log.update(prompt_tokens=len(ids))
    return req, prompt_text, Generation(state, ids, max_new, extra_key, req)


# ---- responses ------------------------------------------------------------------------------------
async def _until_disconnect(http: HttpRequest, gen: Generation) -> None:
    """Cancel ``gen`` when the client hangs up. The body is read, so the next ASGI message is the disconnect."""
    while (await http.receive())["type"] != "http.disconnect":
        pass
    gen.cancel()


async def complete(state: AppState, http: HttpRequest, req, prompt_text: str, gen: Generation) -> dict | None:
    """The whole answer, or None when the client went away (its request is then cancelled)."""
    watcher = asyncio.create_task(_until_disconnect(http, gen))
    try:
        tokens = [t async for t in gen.tokens()]
    finally:
        watcher.cancel()
    if gen.cancelled:
        return None
    if (err := gen.error()) is not None:
        raise err
    text = "".join(t.text for t in tokens) + gen.sink.tail()
    _log_usage(http, gen)
    if isinstance(req, api.ChatRequest):
        choice = {"index": 0, "message": {"role": "assistant", "content": text},
                  "logprobs": api.chat_logprobs(tokens) if req.logprobs else None,
                  "finish_reason": gen.finish_reason()}
        return gen.envelope("chat.completion", choice) | {"usage": gen.usage().body()}
    echo = prompt_text if req.echo else ""
    choice = {"index": 0, "text": echo + text, "token_ids": [t.token_id for t in tokens],
              "logprobs": api.completion_logprobs(tokens, len(echo)) if req.logprobs is not None else None,
              "finish_reason": gen.finish_reason()}
    return gen.envelope("text_completion", choice) | {"usage": gen.usage().body()}


def _choice(req, text: str, token: TokenOut | None, finish: str | None) -> dict:
    """One stream chunk's choice."""
    if isinstance(req, api.ChatRequest):
        return {"index": 0, "delta": {"content": text} if text or token else {}, "finish_reason": finish,
                "logprobs": api.chat_logprobs([token]) if token and req.logprobs else None}
    return {"index": 0, "text": text, "finish_reason": finish, "token_ids": [token.token_id] if token else [],
            "logprobs": api.completion_logprobs([token], 0) if token and req.logprobs is not None else None}


async def stream(state: AppState, http: HttpRequest, req, prompt_text: str,
                 gen: Generation) -> AsyncIterator[bytes]:
    """Server-sent events; when the client hangs up, Starlette cancels this generator and the request
    is cancelled with it."""
    kind = "chat.completion.chunk" if isinstance(req, api.ChatRequest) else "text_completion"

    def event(body: dict) -> bytes:
        return b"data: " + json.dumps(body).encode() + b"\n\n"

    ended = False
    try:
        if kind.startswith("chat"):
            yield event(gen.envelope(kind, {"index": 0, "delta": {"role": "assistant", "content": ""},
                                            "finish_reason": None, "logprobs": None}))
        elif req.echo:
            yield event(gen.envelope(kind, _choice(req, prompt_text, None, None)))
        async for token in gen.tokens():
            yield event(gen.envelope(kind, _choice(req, token.text, token, None)))
        if (err := gen.error()) is not None:
            http.state.log["error"] = json.dumps(err.message)
            yield event(err.body())
        else:
            yield event(gen.envelope(kind, _choice(req, gen.sink.tail(), None, gen.finish_reason())))
            _log_usage(http, gen)
            if req.stream_options is not None and req.stream_options.include_usage:
                yield event(gen.envelope(kind, {}) | {"choices": [], "usage": gen.usage().body()})
        yield b"data: [DONE]\n\n"
        ended = True
    except Exception as exc:  # the response has started: end the stream with an error event, not a hang
        yield event(_internal_error(exc).body())
    finally:
        if not ended and not gen.request.finished:
            gen.cancel()
        state.metrics.count(gen.outcome() if ended or gen.request.finished else "cancelled")


def _log_usage(http: HttpRequest, gen: Generation) -> None:
    usage = gen.usage()
    http.state.log.update(cached_tokens=usage.cached_tokens, completion_tokens=usage.completion_tokens)


def _error_response(http: HttpRequest, error: ApiError) -> JSONResponse:
    """The OpenAI-shaped error; its message goes to the access-log line too (a 4xx says why)."""
    http.state.log["error"] = json.dumps(error.message)
    headers = dict(error.headers or {})
    if error.status == 413:
        headers["connection"] = "close"  # the unread body must not be parsed as a next request
    return JSONResponse(error.body(), status_code=error.status, headers=headers or None)


async def serve(state: AppState, http: HttpRequest, kind: type[api._Common]) -> Response:
    """One completion request, counted once in ``tierkv_requests_total`` by its outcome."""
    try:
        req, prompt_text, gen = await start(state, http, kind)
    except ApiError as exc:
        state.metrics.count("refused_4xx" if exc.status < 500 else "failed")
        raise
    except Exception as exc:
        state.metrics.count("failed")
        raise _internal_error(exc) from None
    if req.stream:  # the stream counts its own outcome
        return StreamingResponse(stream(state, http, req, prompt_text, gen), media_type="text/event-stream",
                                 headers={"cache-control": "no-cache"})
    try:
        body = await complete(state, http, req, prompt_text, gen)
    except ApiError:
        raise
    except Exception as exc:
        raise _internal_error(exc) from None
    finally:
        if not gen.request.finished:
            gen.cancel()
        state.metrics.count(gen.outcome() if gen.request.finished else "cancelled")
    if body is None:
        http.state.log["client"] = "gone"
        return Response(status_code=CLIENT_GONE_STATUS)
    return JSONResponse(body)


def _internal_error(exc: Exception) -> ApiError:
    """A bug, logged with its traceback here; the client gets a JSON 500 naming no internals, and its
    connection stays usable (an exception left to the ASGI server would close it)."""
    log.error("request failed", exc_info=exc)
    return ApiError(500, f"internal error: {type(exc).__name__}", kind="server_error")


def _install_error_handlers(app: FastAPI) -> None:
    """Every error is an OpenAI-shaped JSON body, an unexpected one a 500 that shows no internals."""

    @app.exception_handler(ApiError)
    async def api_error(request: HttpRequest, exc: ApiError) -> JSONResponse:
        return _error_response(request, exc)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: HttpRequest, exc: StarletteHTTPException) -> JSONResponse:
        message = f"no route {request.method} {request.url.path}" if exc.status_code in (404, 405) else exc.detail
        return _error_response(request, ApiError(exc.status_code, str(message)))

    @app.exception_handler(Exception)
    async def unexpected(request: HttpRequest, exc: Exception) -> JSONResponse:
        # outside serve(): uvicorn logs the traceback and closes the connection; the body shows no internals
        return _error_response(request, ApiError(500, f"internal error: {type(exc).__name__}", kind="server_error"))


# ---- the application -----------------------------------------------------------------------------
def build_app(state: AppState) -> "AccessLog":
    app = FastAPI(title="tierkv", docs_url=None, redoc_url=None, openapi_url=None)

    _install_error_handlers(app)

    @app.get("/health")
    async def health() -> PlainTextResponse:
        if state.loop.broken:
            return PlainTextResponse(state.loop.broken, status_code=503)
        return PlainTextResponse("ok")

    @app.get("/v1/models")
    async def models(http: HttpRequest) -> dict:
        tenant_key(state, http, None)  # the API key is checked as on the rest of /v1
        return {"object": "list", "data": [{"id": state.model_name, "object": "model",
                                            "created": state.started_unix, "owned_by": "tierkv"}]}

    @app.get("/metrics")
    def metrics(request: HttpRequest) -> Response:  # sync: it waits for the engine lock on a worker thread
        encoder, content_type = choose_encoder(request.headers.get("accept"))
        return Response(encoder(state.metrics.registry), media_type=content_type)

    @app.post("/v1/completions")
    async def completions(http: HttpRequest) -> Response:
        return await serve(state, http, api.CompletionRequest)

    @app.post("/v1/chat/completions")
    async def chat_completions(http: HttpRequest) -> Response:
        return await serve(state, http, api.ChatRequest)

    return AccessLog(app)


class AccessLog:
    """ASGI wrapper: one log line per HTTP request once its response has been sent (streams included), or
    once its handler returned when the client hung up first."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start_s, status, details, logged = time.perf_counter(), [0], {}, [False]
        scope.setdefault("state", {})["log"] = details

        def write() -> None:
            logged[0] = True
            client = scope.get("client") or ("-", 0)
            extra = " ".join(f"{k}={v}" for k, v in details.items())
            access_log.info('%s:%s "%s %s" %d %.1fms %s', client[0], client[1], scope["method"], scope["path"],
                            status[0], 1000 * (time.perf_counter() - start_s), extra)

        async def logged_send(message) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)
            if message["type"] == "http.response.body" and not message.get("more_body", False):
                write()

        try:
            await self.app(scope, receive, logged_send)
        finally:
            if not logged[0]:
                details["client"] = "gone"
                status[0] = status[0] or CLIENT_GONE_STATUS
                write()
