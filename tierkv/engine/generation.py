"""One completion in flight, as the HTTP side sees it: the per-token sink that runs on the engine thread
(text, stop strings, log-probabilities, latency histograms) and the asyncio-side handle that submits the
request, yields its tokens and cancels it when the client goes away."""

from __future__ import annotations

import asyncio
import math
import time
from typing import AsyncIterator

import torch

from tierkv.engine import openai_api as api
from tierkv.engine.app_state import AppState
from tierkv.engine.engine_loop import DONE, CompletionJob, QueueFull
from tierkv.engine.openai_api import ApiError, TokenOut, Usage
from tierkv.engine.request import Request

MAX_RETRY_AFTER_S = 60


class TokenSink:
    """Runs on the engine thread for each token: text (holding back a possible stop string's start),
    stop strings, log-probabilities and the TTFT / queue-time / inter-token histograms; then hands a
    TokenOut to the request's handler."""

    def __init__(self, state: AppState, stops: list[str], top_k: int | None, deliver) -> None:
        self.tokenizer, self.metrics = state.tokenizer, state.metrics
        self.stream = state.tokenizer.stream()
        self.stops, self.top_k, self.deliver = stops, top_k, deliver
        self.hold = max((len(s) for s in stops), default=1) - 1
        self.pending, self.stopped = "", False
        self._last_token_s: float | None = None

    def on_token(self, request: Request, token: int) -> None:
        if token < 0 or self.stopped:  # -1: the request failed; the loop delivers DONE next
            return
        self._observe(request)
        self.pending += self.stream.push(token)
        text = self._release(request)
        out = TokenOut(token, text)
        if self.top_k is not None:
            out.piece = self.tokenizer.decode([token])
            self._logprobs(out, request.last_logits)
        self.deliver(out)

    def _observe(self, request: Request) -> None:
        now = time.perf_counter()
        if len(request.output) == 1:
            self.metrics.ttft.observe(request.ttft_s)
            if request.admitted_s is not None:
                self.metrics.queue_time.observe(max(request.admitted_s - request.arrival_s, 0.0))
        elif self._last_token_s is not None:
            self.metrics.inter_token.observe(now - self._last_token_s)
        self._last_token_s = now

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
    """One submitted request, seen from the asyncio side. Raises ApiError 429 (with ``Retry-After``) when
    the waiting queue is full and 503 once the engine broke."""

    def __init__(self, state: AppState, ids: list[int], max_new: int, extra_key: str | None,
                 req: api._Common) -> None:
        loop, self.queue = asyncio.get_running_loop(), asyncio.Queue()

        def deliver(item: object) -> None:
            try:
                loop.call_soon_threadsafe(self.queue.put_nowait, item)
            except RuntimeError:  # the event loop is gone (shutdown): nobody is waiting any more
                pass

        self.state, self.created_unix = state, int(time.time())
        self.sink = TokenSink(state, api.stop_strings(req), api.top_logprobs_wanted(req), deliver)
        eos = None if req.ignore_eos else state.tokenizer.eos_token_id
        self.request = Request(ids, max_new, extra_key=extra_key, eos_token_id=eos, on_token=self.sink.on_token)
        try:
            state.loop.submit(CompletionJob(self.request, deliver))
        except QueueFull as full:
            state.metrics.queue_full.inc()
            raise ApiError(429, f"server busy: {full.waiting} requests are waiting (max_waiting_requests "
                                f"{state.loop.max_waiting}); retry later", kind="rate_limit_exceeded",
                           headers={"retry-after": str(self._retry_after_s(full.waiting))}) from None
        except RuntimeError as exc:
            raise ApiError(503, str(exc), kind="server_error") from None

    def _retry_after_s(self, waiting: int) -> int:
        """About the time the queue ahead takes to drain: batches of max_running at the mean latency."""
        batches = waiting / self.state.loop.engine.scheduler.config.max_running_requests
        return min(MAX_RETRY_AFTER_S, max(1, math.ceil(batches * self.state.metrics.mean_e2e_s)))

    async def tokens(self) -> AsyncIterator[TokenOut]:
        while (item := await self.queue.get()) is not DONE:
            yield item

    def cancel(self) -> None:
        """The client went away: abort the request, releasing its KV slots and locks."""
        self.state.loop.cancel(self.request)

    @property
    def cancelled(self) -> bool:
        return self.request.cancelled

    def error(self) -> ApiError | None:
        if self.request.error is None:
            return None
        status = 503 if self.state.loop.broken else 400
        return ApiError(status, self.request.error, kind="server_error" if status == 503 else "invalid_request_error")

    def finish_reason(self) -> str:
        if self.sink.stopped or (self.request.output and self.request.output[-1] == self.request.eos_token_id):
            return "stop"
        return "length"

    def usage(self) -> Usage:
        return Usage(len(self.request.prompt), len(self.request.output), self.request.cache_hit_tokens)

    def envelope(self, kind: str, choice: dict) -> dict:
        return api.envelope(kind, self.request.rid, self.state.model_name, choice, self.created_unix)

    def outcome(self) -> str:
        """This request's row of ``tierkv_requests_total`` once it has ended; observes e2e when finished."""
        if self.request.cancelled:
            return "cancelled"
        if (err := self.error()) is not None:
            return "refused_4xx" if err.status < 500 else "failed"
        if self.request.finish_s is not None:
            self.state.metrics.observe_finished(self.request.finish_s - self.request.arrival_s)
        return "finished"
