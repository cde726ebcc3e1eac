"""Fetch or recompute: an online cost model for L3 prefetches and L2 -> L1 loads.

A cached page is worth fetching only while fetching it costs less than recomputing it. The model keeps
running estimates, measured from completed work:

- prefill: seconds per forward pass as ``overhead + a x new tokens + b x token pairs`` (a token at
  position ``t`` attends to ``t`` earlier ones, so recompute grows with depth), fitted by least squares
  over exponentially decayed statistics of the engine's reported passes. ``prefill_tokens_per_s`` in
  the config fixes ``a`` (and ``b`` = 0) instead.
- L3 get: seconds per call (the latency, from ``exists`` calls, which every prefetch makes) and seconds
  per page (a get batch's time less one call), as EWMAs.
- L3 lookups: the fraction of the pages asked that the store held (usable), as an EWMA: a prefetch
  is only started when the expected saving (that fraction of a full hit's) beats the ``exists`` call
  every lookup costs, so a store that keeps finding nothing stops being asked (but is probed now and
  then).
- L2 -> L1 load: *exposed* seconds per token, the time the forward pass waited for layer-wise loads
  (what the overlap did not hide), as an EWMA.
- L3 writes: the backup thread's CPU seconds per page written, as an EWMA, and the read-back
  fraction: pages read from L3 per page written, as decayed counts that start at one read per write
  with the weight of ``READ_BACK_PRIOR_PAGES`` pages (reads come a conversation turn after the writes
  they find: the first writes are trusted, and probes keep the fraction measured once backups stop).
  A page written is only counted once ``read_back_lag_pages`` more have been written after it: until
  the faster tiers have let it go (the cache sets the lag to what L1 and L2 hold), nothing can read
  it from L3, and counting it at once made the fraction fall to ~0.1 on a fresh cache, after which
  every backup was refused and L3 was never read.

Backups (:func:`backup_worth_writing`): a page written to L3 is worth its writing only when, weighted by the
read-back fraction, the fetch it enables saves more than the write costs. The write's cost is CPU: on a
host whose forward passes share the CPU and the GIL with the backup thread (this engine on a CPU), that
CPU comes out of the forward passes, so a small model with a slow-to-write store backs up only a probe
now and then (one get batch every ``BACKUP_PROBE_EVERY``-th refusal), which keeps both estimates fresh. The checksum
helpers of large pages (>= 1 MiB, GIL-free, see tierkv.storage.overlap) are not counted.

The decision (:func:`pages_worth_fetching`) is a pure function of a :class:`CostEstimates` snapshot,
so tests check it on fixed numbers. Until the engine has reported a prefill rate (a cache driven by a
trace replay or another engine) the estimates are None and every found page is fetched, as before.

Thread contract: the ``observe_*`` methods may run on any thread (the prefetch worker reports L3
timings); a lock guards the estimates. Decisions read one snapshot.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import numpy as np

EWMA_WEIGHT = 0.2  # of the newest sample: a few batches move the estimate, one outlier does not
PREFILL_DECAY = 0.97  # per reported pass: the fit forgets over ~30 passes (load on a shared host changes)
MIN_PREFILL_SAMPLES = 8  # passes before the fitted rate is trusted
PROBE_EVERY = 32  # after this many skipped fetches, fetch once anyway: the L3 estimate must stay fresh
LOOKUP_PROBE_EVERY = 8  # after this many lookups skipped for a poor hit rate, look up once anyway
BACKUP_PROBE_EVERY = 32  # after this many backups skipped as not paying, write one get batch anyway
# The read-back fraction starts at 1 with the weight of a few pages: the first writes happen, and a store
# whose pages never come back stops being written within a few backups (probes keep it measured).
READ_BACK_PRIOR_PAGES = 4
READ_BACK_DECAY = 0.995  # per page written: the fraction follows the last few hundred pages
_TOKEN_SCALE, _PAIR_SCALE = 1e3, 1e6  # features near 1, so the fit's small ridge weighs them alike


@dataclass(frozen=True)
class CostEstimates:
    """A snapshot of the estimates, in seconds. ``l3_page_s`` and ``load_s_per_token`` include nothing
    the forward pass hides; ``batch_pages`` is how many pages one L3 get call carries."""

    prefill_s_per_token: float
    prefill_s_per_token_pair: float
    l3_call_s: float
    l3_page_s: float
    load_s_per_token: float
    batch_pages: int = 16
    l3_write_s_per_page: float = 0.0
    read_back_fraction: float = 1.0

    def recompute_s(self, start_tokens: int, end_tokens: int) -> float:
        """Prefill time of the tokens at positions ``[start_tokens, end_tokens)``."""
        n = max(0, end_tokens - start_tokens)
        pairs = n * (start_tokens + end_tokens - 1) / 2  # the positions summed: each attends that many
        return self.prefill_s_per_token * n + self.prefill_s_per_token_pair * pairs

    def fetch_s(self, num_pages: int, page_size: int, from_l3: bool = True) -> float:
        """Exposed time to bring ``num_pages`` into L1 (from L3 through L2 when ``from_l3``)."""
        if num_pages <= 0:
            return 0.0
        load_s = self.load_s_per_token * num_pages * page_size
        if not from_l3:
            return load_s
        num_calls = -(-num_pages // self.batch_pages)
        return num_calls * self.l3_call_s + num_pages * self.l3_page_s + load_s

    def backup_gain_s(self, start_tokens: int, num_pages: int, page_size: int) -> float:
        """Expected time saved by writing ``num_pages`` pages from position ``start_tokens`` to L3: the
        read-back fraction of what fetching them saves over recomputing them, less the writing's CPU."""
        end_tokens = start_tokens + num_pages * page_size
        fetch_gain_s = self.recompute_s(start_tokens, end_tokens) - self.fetch_s(num_pages, page_size)
        return self.read_back_fraction * max(0.0, fetch_gain_s) - num_pages * self.l3_write_s_per_page


def pages_worth_fetching(estimates: CostEstimates | None, start_tokens: int, found_pages: int,
                         page_size: int, from_l3: bool = True) -> int:
    """How many of ``found_pages`` (the pages after position ``start_tokens``) to fetch: the prefix
    length whose fetch saves the most prefill time over recomputing it, 0 when none saves any.

    Deeper pages save more (attention over a longer context), so the best cut is 0, all, or the end
    of a get batch (each batch adds a call's latency); those are the candidates tried.
    """
    if estimates is None or found_pages <= 0:
        return max(0, found_pages)
    batch = estimates.batch_pages if from_l3 else found_pages
    candidates = set(range(batch, found_pages, batch)) | {found_pages}
    best_pages, best_gain_s = 0, 0.0
    for k in sorted(candidates):
        gain_s = estimates.recompute_s(start_tokens, start_tokens + k * page_size) - \
            estimates.fetch_s(k, page_size, from_l3)
        if gain_s > best_gain_s:
            best_pages, best_gain_s = k, gain_s
    return best_pages


def backup_worth_writing(estimates: CostEstimates | None, start_tokens: int, num_pages: int, page_size: int) -> bool:
    """Whether writing ``num_pages`` pages from position ``start_tokens`` to L3 is expected to save more
    than it costs (always, while no prefill rate is known)."""
    if estimates is None or num_pages <= 0:
        return True
    return estimates.backup_gain_s(start_tokens, num_pages, page_size) > 0


class _Probe:
    """Refusals since the last probe: every ``every``-th refusal is made anyway, so a cost that changed
    is noticed. The caller holds the model's lock."""

    def __init__(self, every: int) -> None:
        self.every, self.since = every, 0

    def due(self) -> bool:
        """Count one refusal; True (and start counting again) when this one is the probe."""
        self.since += 1
        if self.since < self.every:
            return False
        self.since = 0
        return True


class CostModel:
    """Running estimates (see the module docstring) and the fetch decisions made from them."""

    def __init__(self, prefill_tokens_per_s: float | None = None, batch_pages: int = 16,
                 l3_call_s: float = 0.0, l3_page_s: float = 0.0, enabled: bool = True) -> None:
        self.enabled = enabled  # False: every decision fetches everything (the cost-blind behaviour)
        self.fixed_prefill_tokens_per_s = prefill_tokens_per_s
        self.batch_pages = batch_pages
        self._lock = threading.Lock()
        # decayed normal equations of step_s ~ [1, tokens, pairs] . coef
        self._xtx = np.zeros((3, 3))
        self._xty = np.zeros(3)
        self._prefill_samples = 0
        self._coef = (0.0, 0.0)  # (s per token, s per token pair), refitted on each observation
        self.l3_call_s, self.l3_page_s = l3_call_s, l3_page_s  # priors until measured
        self.load_s_per_token = 0.0
        self.l3_samples = 0  # get batches measured
        self._exists_samples = self._load_samples = 0
        self._fetch_probe = _Probe(PROBE_EVERY)
        self.skipped_fetches = 0
        self.l3_hit_fraction = 1.0  # of the pages a lookup asks, those found usable (optimistic until measured)
        self.skipped_lookups = 0
        self._lookup_probe = _Probe(LOOKUP_PROBE_EVERY)
        self.l3_write_s_per_page = 0.0
        self._write_samples = 0
        # decayed pages read from L3 and written to it; their ratio is the read-back fraction
        self._read_back_pages = self._written_pages = float(READ_BACK_PRIOR_PAGES)
        self.read_back_lag_pages = 0  # pages the faster tiers hold (the cache sets it): writes not yet readable
        self._lagging_pages = 0  # the newest pages written, not yet counted (at most the lag)
        self.skipped_backups = 0
        self._backup_probe = _Probe(BACKUP_PROBE_EVERY)

    # ---- observations ----------------------------------------------------------------------------
    def observe_prefill(self, step_s: float, num_tokens: int, token_pairs: float) -> None:
        """One forward pass of ``num_tokens`` new tokens attending ``token_pairs`` (token, context) pairs,
        which took ``step_s`` of compute (exposed load waits excluded)."""
        if num_tokens <= 0 or step_s <= 0:
            return
        x = np.array([1.0, num_tokens / _TOKEN_SCALE, token_pairs / _PAIR_SCALE])
        with self._lock:
            self._xtx = PREFILL_DECAY * self._xtx + np.outer(x, x)
            self._xty = PREFILL_DECAY * self._xty + x * step_s
            self._prefill_samples += 1
            self._coef = _fit(self._xtx, self._xty)

    def observe_l3_exists(self, call_s: float) -> None:
        """One ``exists`` call: the store's per-call latency."""
        with self._lock:
            self.l3_call_s = _ewma(self.l3_call_s, call_s, self._exists_samples == 0)
            self._exists_samples += 1

    def observe_l3_lookup(self, asked_pages: int, found_pages: int) -> None:
        """One lookup asked ``asked_pages`` and found the leading ``found_pages`` (0 when too few to use)."""
        if asked_pages > 0:
            with self._lock:
                # from the optimistic prior, not replacing it: a few early misses (L3 still filling) must
                # not stop the lookups that would find what later backups write
                self.l3_hit_fraction = _ewma(self.l3_hit_fraction, min(found_pages, asked_pages) / asked_pages,
                                             first=False)

    def observe_l3_get(self, call_s: float, num_pages: int) -> None:
        """One get batch of ``num_pages`` pages that took ``call_s``."""
        if num_pages <= 0:
            return
        with self._lock:
            page_s = max(0.0, call_s - self.l3_call_s) / num_pages
            self.l3_page_s = _ewma(self.l3_page_s, page_s, self.l3_samples == 0)
            self.l3_samples += 1
            self._fetch_probe.since = 0
            self._read_back_pages += num_pages

    def observe_l3_write(self, cpu_s: float, num_pages: int) -> None:
        """One backup wrote ``num_pages`` pages, its thread using ``cpu_s`` of CPU (exists call included)."""
        if num_pages <= 0:
            return
        with self._lock:
            self.l3_write_s_per_page = _ewma(self.l3_write_s_per_page, max(0.0, cpu_s) / num_pages,
                                             self._write_samples == 0)
            self._write_samples += 1
            # the decay is per page, so which write a counted page came from does not matter: only how many
            self._lagging_pages += num_pages
            counted = self._lagging_pages - self.read_back_lag_pages
            if counted > 0:
                self._lagging_pages -= counted
                decay = READ_BACK_DECAY ** counted  # each page counted is one step of the decay
                self._written_pages = decay * self._written_pages + (1 - decay) / (1 - READ_BACK_DECAY)
                self._read_back_pages *= decay

    @property
    def read_back_fraction(self) -> float:
        """Pages read from L3 per page written (decayed; at most 1: a shared store serves others' pages)."""
        return min(1.0, self._read_back_pages / self._written_pages)

    def observe_load(self, exposed_s: float, num_tokens: int) -> None:
        """The forward pass waited ``exposed_s`` for L2 -> L1 loads of ``num_tokens`` tokens."""
        if num_tokens > 0:
            with self._lock:
                self.load_s_per_token = _ewma(self.load_s_per_token, exposed_s / num_tokens, self._load_samples == 0)
                self._load_samples += 1

    # ---- decisions -------------------------------------------------------------------------------
    def estimates(self) -> CostEstimates | None:
        """The current snapshot; None while no prefill rate is known (fixed or measured) or when disabled."""
        with self._lock:
            if not self.enabled:
                return None
            if self.fixed_prefill_tokens_per_s is not None:
                per_token, per_pair = 1.0 / self.fixed_prefill_tokens_per_s, 0.0
            elif self._prefill_samples >= MIN_PREFILL_SAMPLES and any(self._coef):
                per_token, per_pair = self._coef
            else:
                return None
            return CostEstimates(per_token, per_pair, self.l3_call_s, self.l3_page_s, self.load_s_per_token,
                                 self.batch_pages, self.l3_write_s_per_page, self.read_back_fraction)

    def l3_pages_to_fetch(self, start_tokens: int, found_pages: int, page_size: int) -> int:
        """Pages of an L3 hit worth reading (see :func:`pages_worth_fetching`); every ``PROBE_EVERY``-th
        refusal fetches anyway, so a store that got faster is noticed."""
        pages = pages_worth_fetching(self.estimates(), start_tokens, found_pages, page_size)
        if pages >= found_pages:
            return pages
        with self._lock:
            self.skipped_fetches += 1
            if self._fetch_probe.due():
                return found_pages
        return pages

    def expected_fetch_s(self, num_pages: int, page_size: int) -> float:
        """Expected time of a prefetch of ``num_pages`` (exists, reads and load), known prefill rate or not."""
        with self._lock:
            est = CostEstimates(0.0, 0.0, self.l3_call_s, self.l3_page_s, self.load_s_per_token, self.batch_pages)
        return est.l3_call_s + est.fetch_s(num_pages, page_size)

    def l3_may_pay(self, start_tokens: int, max_pages: int, page_size: int) -> bool:
        """Before a prefetch starts: whether asking L3 for ``max_pages`` is expected to save time. A
        store too slow for even a full hit to beat recomputing it (the exists call included) is not
        asked at all; otherwise the expected saving (the recent hit fraction of a full hit's) must beat
        the exists call, and every ``LOOKUP_PROBE_EVERY``-th lookup refused for that is made anyway."""
        estimates = self.estimates()
        if estimates is None or max_pages <= 0:
            return max_pages > 0
        full_hit_gain_s = estimates.recompute_s(start_tokens, start_tokens + max_pages * page_size) - \
            estimates.fetch_s(max_pages, page_size)
        if full_hit_gain_s <= estimates.l3_call_s:
            return False
        with self._lock:
            if self.l3_hit_fraction * full_hit_gain_s > estimates.l3_call_s:
                return True
            if self._lookup_probe.due():
                return True
            self.skipped_lookups += 1
        return False

    def backup_pages(self, start_tokens: int, num_pages: int, page_size: int) -> int:
        """Of a backup of ``num_pages`` pages from position ``start_tokens``, how many leading pages to
        write (see :func:`backup_worth_writing`): all until a write has been measured or while writing
        pays; 0 when it does not, but every ``BACKUP_PROBE_EVERY``-th refusal writes one get batch (a
        probe: enough to keep the write cost and the read-back fraction measured, no more)."""
        with self._lock:
            measured = self._write_samples > 0
        if not measured or backup_worth_writing(self.estimates(), start_tokens, num_pages, page_size):
            return num_pages
        with self._lock:
            self.skipped_backups += 1
            if self._backup_probe.due():
                return min(num_pages, self.batch_pages)
        return 0

    def load_pays(self, start_tokens: int, num_tokens: int) -> bool:
        """Whether loading ``num_tokens`` host tokens after position ``start_tokens`` into L1 beats
        recomputing them (always, while no prefill rate is known)."""
        estimates = self.estimates()
        if estimates is None or num_tokens <= 0:
            return True
        return estimates.fetch_s(num_tokens, 1, from_l3=False) <= estimates.recompute_s(
            start_tokens, start_tokens + num_tokens)


def _ewma(old: float, sample: float, first: bool) -> float:
    return sample if first else (1 - EWMA_WEIGHT) * old + EWMA_WEIGHT * sample


def _fit(xtx: np.ndarray, xty: np.ndarray) -> tuple[float, float]:
    """Least-squares (s per token, s per pair), both >= 0; when the pair term comes out negative (too
    little spread in depth to tell it apart), the per-token rate is refitted alone."""
    ridge = 1e-9 * np.trace(xtx) * np.eye(3)
    try:
        coef = np.linalg.solve(xtx + ridge, xty)
    except np.linalg.LinAlgError:
        return 0.0, 0.0
    if coef[2] >= 0 and coef[1] >= 0:
        return float(coef[1]) / _TOKEN_SCALE, float(coef[2]) / _PAIR_SCALE
    sub = xtx[:2, :2] + ridge[:2, :2]
    try:
        coef2 = np.linalg.solve(sub, xty[:2])
    except np.linalg.LinAlgError:
        return 0.0, 0.0
    return max(0.0, float(coef2[1])) / _TOKEN_SCALE, 0.0
