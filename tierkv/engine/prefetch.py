"""L3 for the engine: open the store, attach it to the cache, and prefetch waiting requests' prompts.

A waiting request whose prompt extends past its L1+L2 hit starts a prefetch from storage into L2 as
soon as it is seen; it is admitted once the cache's stop policy says the prefetch may end (the
fetched pages are then host nodes of the tree, and admission loads them back like any L2 hit). The
scheduler waits for a prefetch that is not ready at most its expected time (once per step), then admits
the requests behind it; the cache's cost model decides what is worth reading at all.
"""

from __future__ import annotations

import json
import logging

from tierkv.engine.request import Request
from tierkv.radix import RadixKey

log = logging.getLogger(__name__)

# The engine's stop policy when the extra config names none: HiCache's default. StorageConfig's own,
# best_effort (end a prefetch whenever its request can run), gave an idle engine no L3 hit at all: a
# request runs in the step its prefetch starts, before the exists call returns (issue 29.4).
DEFAULT_STOP_POLICY = "timeout"
# An admission waits at most this long for a prefetch (less when L3 is timed faster): a prefetch that
# finds nothing then costs its request an exists call, not a whole scheduler step.
MAX_ADMISSION_WAIT_S = 0.05


class Prefetcher:
    """Tracks which waiting requests have a prefetch in flight. Scheduler thread only."""

    def __init__(self, cache) -> None:
        self.cache = cache
        self._started: dict[str, int] = {}  # request id -> L1+L2 hit length before the prefetch

    def start(self, request: Request) -> None:
        """Begin a prefetch of the prompt past its L1+L2 hit (idempotent). Lock contract: as the cache's."""
        if request.rid in self._started:
            return
        key = RadixKey(request.prompt[:-1], request.extra_key)
        path = self.cache.tree.match(key, touch=False)
        self._started[request.rid] = path.num_tokens
        last_node = path.last_node or self.cache.tree.root
        if not self.cache.prefetch_from_storage(request.rid, last_node, key):
            self._started[request.rid] = -1  # nothing to fetch: ready at once

    def ready(self, request: Request) -> bool:
        """True once ``request`` may be admitted (no prefetch, or the stop policy ended it)."""
        self.start(request)
        if self._started[request.rid] < 0:
            return True
        return bool(self.cache.check_prefetch_progress(request.rid))

    def wait(self, request: Request, max_wait_s: float = MAX_ADMISSION_WAIT_S) -> bool:
        """``request``'s prefetch was not ready: wait for it (bounded by its expected time), then agree
        progress in one cache step (two when that step grants the slots for what L3 holds: the reads
        follow), and say whether it is ready now. Every TP rank calls this alike
        (readiness is agreed state), so the extra step's collective stays matched."""
        storage = self.cache.storage
        phase = storage.prefetch_phase(request.rid)
        storage.wait_prefetch(request.rid, max_wait_s)
        self.cache.step()
        if self.ready(request):
            return True
        if phase == "lookup" and storage.prefetch_phase(request.rid) == "reading":
            # that step agreed what L3 holds and granted the slots: the reads start now, wait for them too
            storage.wait_prefetch(request.rid, max_wait_s)
            self.cache.step()
            return self.ready(request)
        return False

    def storage_tokens(self, request: Request, hit_tokens: int) -> int:
        """Of ``hit_tokens`` cached tokens found at admission, how many came from L3."""
        before = self._started.get(request.rid, -1)
        return max(0, hit_tokens - before) if before >= 0 else 0

    def admitted(self, request: Request) -> None:
        """``request`` runs: forget it. Until then an admission that failed for want of room keeps the
        prefetch it had (ended), rather than asking L3 again on every retry."""
        self._started.pop(request.rid, None)

    def abort(self, request: Request) -> None:
        if self._started.pop(request.rid, -1) >= 0:
            self.cache.release_prefetch(request.rid)


def attach_l3(engine, spec: str, extra_config: dict) -> Prefetcher:
    """Open the store named by ``spec`` and attach it with ``extra_config`` (prefetch policy, backend keys;
    the stop policy is :data:`DEFAULT_STOP_POLICY` unless it names one)."""
    from tierkv.hashing import HashNamespace
    from tierkv.cache.l3.controller import open_storage
    cache = engine.cache
    namespace = HashNamespace.for_spec(engine.namespace, cache.host_pool.spec, cache.host_pool.layout)
    extra_config = {"prefetch_stop_policy": DEFAULT_STOP_POLICY, **extra_config}
    open_storage(cache, spec, json.dumps(extra_config), namespace)
    engine.scheduler.prefetcher = prefetcher = Prefetcher(cache)
    return prefetcher


def l3_counters(cache) -> dict[str, int]:
    """What L3 did and what the cost model decided, since the cache started: prefetches started,
    revoked (by the stop policy or too small a hit, HiCache's threshold), judged not worth it (even a
    full hit slower than recomputing) or cut after the exists call; lookups skipped for a poor hit rate;
    backups started and skipped as not paying; tokens read. Empty without L3. For the banner, the
    bench and /metrics: the answer to "why no L3 hits"."""
    storage = cache.storage
    if storage is None:
        return {}
    stats, model = storage.stats, cache.cost_model
    return {"started": stats.prefetch_started, "revoked": stats.prefetch_revoked,
            "not_worth": stats.prefetch_not_worth, "cut_after_exists": model.skipped_fetches,
            "lookups_skipped": model.skipped_lookups, "rate_limited": stats.prefetch_rate_limited,
            "backups": stats.backup_started, "backups_skipped": model.skipped_backups,
            "prefetched_tokens": stats.prefetched_tokens}
