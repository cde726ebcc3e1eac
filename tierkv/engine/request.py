"""A generation request: its tokens, the slots holding their KV, the cache node it locks, and timings."""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from tierkv.radix import TreeNode


@dataclass(eq=False)  # a request is itself: membership tests (waiting, running) compare identity
class Request:
    """Greedy generation of up to ``max_new_tokens`` after ``prompt``.

    Slot ownership: ``slots[:cached_len]`` belong to the radix tree (their node path is ``locked_node``,
    locked while the request runs); ``slots[cached_len:]`` were allocated for this request and are
    its own until it finishes, inserts its tokens and frees what the tree did not take.
    """

    prompt: list[int]
    max_new_tokens: int
    extra_key: str | None = None
    eos_token_id: int | None = None
    on_token: Callable[["Request", int], None] | None = None
    rid: str = field(default_factory=lambda: uuid.uuid4().hex)  # unique across restarts, not only in-process
    output: list[int] = field(default_factory=list)
    slots: torch.Tensor | None = None
    cached_len: int = 0
    num_computed: int = 0
    locked_node: TreeNode | None = None
    pending_load: Any = None  # a deferred L2 -> L1 load of its prefix (tierkv.cache.hicache.PendingLoad)
    restarts: int = 0  # times a failed prefix load made it start over
    device_hit_tokens: int = 0
    host_hit_tokens: int = 0
    storage_hit_tokens: int = 0
    first_logits: torch.Tensor | None = None
    last_logits: torch.Tensor | None = None
    error: str | None = None
    stop_requested: bool = False  # set by on_token to end generation after this token (a stop string matched)
    cancelled: bool = False  # its client went away: Scheduler.abort released it before it finished
    finished: bool = False
    arrival_s: float = field(default_factory=time.perf_counter)
    admitted_s: float | None = None
    first_token_s: float | None = None
    finish_s: float | None = None

    def __post_init__(self) -> None:
        if not self.prompt:
            raise ValueError("prompt must hold at least one token")
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be a positive int, got {self.max_new_tokens!r}")

    @property
    def all_tokens(self) -> list[int]:
        return self.prompt + self.output

    @property
    def own_slots(self) -> torch.Tensor:
        return self.slots[self.cached_len:]

    @property
    def in_prefill(self) -> bool:
        return self.num_computed < len(self.prompt)

    @property
    def max_kv_tokens(self) -> int:
        """Tokens whose KV this request may compute: the KV of its final output token is never needed."""
        return len(self.prompt) + self.max_new_tokens - 1

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token_s is None else self.first_token_s - self.arrival_s

    @property
    def decode_tokens_per_s(self) -> float | None:
        """Output tokens after the first over the time they took (None for a single-token output)."""
        if self.finish_s is None or len(self.output) < 2 or self.finish_s <= self.first_token_s:
            return None
        return (len(self.output) - 1) / (self.finish_s - self.first_token_s)

    @property
    def cache_hit_tokens(self) -> int:
        return self.device_hit_tokens + self.host_hit_tokens + self.storage_hit_tokens
