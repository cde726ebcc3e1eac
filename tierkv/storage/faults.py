"""A fault-injecting wrapper around any page store: latency, errors, hangs, partial batches, corruption.

Corruption must happen where a real one would: between the moment a page's checksum is computed and the
moment it is verified. The wrapper therefore frames every page with its own :class:`PageFormat` header
(the inner store holds ``HEADER_SIZE + page_nbytes`` bytes per page) and flips bytes in that frame, after
framing on set or before verifying on get. A flipped page must come back as a miss, never as KV.

Batch faults (latency, error, hang, partial) are drawn once per batch call, corruption once per page.
Each operation kind draws from its own seeded generator, so one thread per kind replays the same faults.
"""

from __future__ import annotations

import random
import threading
from dataclasses import asdict, dataclass, fields

import torch

from tierkv.storage.base import PageStore
from tierkv.storage.page_format import HEADER_SIZE
from tierkv.validate import check_int, check_number, check_seconds

OPERATIONS = ("exists", "get", "set")
FAULT_KINDS = ("latency", "error", "hang", "partial", "corrupt_get", "corrupt_set")


class InjectedFault(ConnectionError):
    """The error a faulty store raises; a ConnectionError like a real backend's lost connection."""


@dataclass(frozen=True)
class FaultConfig:
    """Rates (probabilities in [0, 1]) and durations of injected faults. Errors name the field and value.

    ``hang_s`` should exceed the caller's timeout; a hang ends early when the store is closed.
    """

    latency_rate: float = 0.0
    latency_s: float = 0.0
    error_rate: float = 0.0
    hang_rate: float = 0.0
    hang_s: float = 5.0
    partial_rate: float = 0.0
    corrupt_get_rate: float = 0.0
    corrupt_set_rate: float = 0.0
    operations: tuple[str, ...] = OPERATIONS
    seed: int = 0

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name.endswith("_rate"):
                check_number(f"faults.{f.name}", value, 0.0, 1.0)
            elif f.name.endswith("_s"):
                check_seconds(f"faults.{f.name}", value)
        check_int("faults.seed", self.seed)
        ops = self.operations
        if isinstance(ops, str) or not isinstance(ops, (list, tuple)) or not set(ops) <= set(OPERATIONS):
            raise ValueError(f"faults.operations must be a list drawn from {OPERATIONS}, got {ops!r}")
        object.__setattr__(self, "operations", tuple(ops))

    @classmethod
    def from_dict(cls, raw: object) -> "FaultConfig":
        """Build from the ``"faults"`` object of an extra config; unknown keys are a ValueError."""
        if not isinstance(raw, dict):
            raise ValueError(f"faults must be a JSON object, got {type(raw).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(str(k) for k in raw if k not in known)
        if unknown:
            raise ValueError(f"unknown faults keys {unknown}; valid: {sorted(known)}")
        return cls(**raw)

    def as_dict(self) -> dict:
        return asdict(self)


class FaultyStore(PageStore):
    """Wraps ``inner`` (whose pages are ``HEADER_SIZE`` bytes larger) and injects faults per ``config``.

    Thread contract: as :class:`PageStore`; fault counters share the stats lock.
    """

    name = "faulty"

    def __init__(self, inner: PageStore, config: FaultConfig, namespace: str,
                 page_key: bytes | str | None = None) -> None:
        page_nbytes = inner.page_nbytes - HEADER_SIZE
        if page_nbytes <= 0:
            raise ValueError(f"inner store pages of {inner.page_nbytes} bytes leave no room for a frame")
        super().__init__(namespace, page_nbytes, page_key)
        self.inner, self.config = inner, config
        self.name = f"faulty({inner.name})"
        self.injected = dict.fromkeys(FAULT_KINDS, 0)
        self.stats.extra["injected_faults"] = self.injected
        self._rngs = {op: random.Random(f"{config.seed}:{op}") for op in OPERATIONS}
        self._closed = threading.Event()

    # ---- fault draws ----------------------------------------------------------------------------
    def _inject(self, kind: str) -> None:
        with self._stats_lock:
            self.injected[kind] += 1

    def _draw(self, op: str, rate: float) -> bool:
        return op in self.config.operations and rate > 0 and self._rngs[op].random() < rate

    def _batch_faults(self, op: str, num_keys: int) -> int:
        """Apply latency, error and hang for one batch; returns how many keys may succeed (partial)."""
        cfg = self.config
        if self._draw(op, cfg.latency_rate):
            self._inject("latency")
            self._closed.wait(cfg.latency_s)
        if self._draw(op, cfg.error_rate):
            self._inject("error")
            self._count(errors=1)
            raise InjectedFault(f"injected {op} error on {self.inner.name}")
        if self._draw(op, cfg.hang_rate):
            self._inject("hang")
            self._closed.wait(cfg.hang_s)
            if self._closed.is_set():
                raise InjectedFault(f"{op} interrupted: store closed while hanging")
        if num_keys > 0 and self._draw(op, cfg.partial_rate):
            self._inject("partial")
            return self._rngs[op].randrange(num_keys)
        return num_keys

    def _flip(self, op: str, frame: torch.Tensor) -> None:
        """Flip one random bit of one random byte of a frame (header or payload).

        The header's reserved flags (bytes 6-7) are skipped: nothing reads them, so a flip there would
        leave a sound page and make the injected count disagree with the detected one.
        """
        rng = self._rngs[op]
        pos = rng.randrange(frame.numel() - 2)
        pos += 2 if pos >= 6 else 0
        frame[pos] = int(frame[pos]) ^ (1 << rng.randrange(8))

    # ---- PageStore ------------------------------------------------------------------------------
    def batch_exists(self, keys: list[str]) -> int:
        ok = self._batch_faults("exists", len(keys))
        self._count(exists_calls=1)
        return self.inner.batch_exists(keys[:ok])

    def batch_get(self, keys: list[str], targets: list[torch.Tensor]) -> list[bool]:
        views = self._check_batch(keys, targets)
        ok = self._batch_faults("get", len(keys))
        with self._timed("get"):
            frames = [torch.empty(self.inner.page_nbytes, dtype=torch.uint8) for _ in keys[:ok]]
            found = self.inner.batch_get(keys[:ok], frames) if ok else []
            results = [False] * len(keys)
            for i, (key, frame, hit) in enumerate(zip(keys, frames, found)):
                if not hit:
                    continue
                if self._draw("get", self.config.corrupt_get_rate):
                    self._inject("corrupt_get")
                    self._flip("get", frame)
                results[i] = self._unframe(key, frame, views[i])
        self._count(get_pages=sum(results), get_bytes=sum(results) * self.page_nbytes)
        return results

    def _unframe(self, key: str, frame: torch.Tensor, target: memoryview) -> bool:
        data = memoryview(frame.numpy())
        if not self._verified(key, data[:HEADER_SIZE], data[HEADER_SIZE:]):
            return False
        target[:] = data[HEADER_SIZE:]
        return True

    def _drop(self, key: str) -> None:
        self.inner._drop(key)  # the corrupt frame lives in the inner store; a later backup rewrites it

    def batch_set(self, keys: list[str], values: list[torch.Tensor]) -> list[bool]:
        views = self._check_batch(keys, values)
        ok = self._batch_faults("set", len(keys))
        with self._timed("set"):
            frames = []
            for key, view in zip(keys[:ok], views[:ok]):
                frame = torch.empty(self.inner.page_nbytes, dtype=torch.uint8)
                data = memoryview(frame.numpy())
                data[:HEADER_SIZE] = self.format.header(key, view)
                data[HEADER_SIZE:] = view
                if self._draw("set", self.config.corrupt_set_rate):
                    self._inject("corrupt_set")
                    self._flip("set", frame)
                frames.append(frame)
            stored = self.inner.batch_set(keys[:ok], frames) if ok else []
        results = list(stored) + [False] * (len(keys) - ok)
        self._count(set_pages=sum(results), set_bytes=sum(results) * self.page_nbytes)
        return results

    def clear(self) -> None:
        self.inner.clear()

    def close(self) -> None:
        """Wake any injected hang, then close the inner store."""
        self._closed.set()
        self.inner.close()

    def __repr__(self) -> str:
        return f"FaultyStore({self.inner!r}, {self.config!r})"


def wrap_with_faults(open_inner, namespace: str, page_nbytes: int, faults: object,
                     page_key: bytes | None = None) -> PageStore:
    """Open the inner store (``open_inner(inner_page_nbytes)``) and wrap it; ``faults`` as in extra config.

    The page key (if any) goes to the wrapper, whose frame is what the inner store holds: a flipped
    byte anywhere in it then fails the MAC."""
    config = FaultConfig.from_dict(faults) if not isinstance(faults, FaultConfig) else faults
    return FaultyStore(open_inner(page_nbytes + HEADER_SIZE), config, namespace, page_key)
