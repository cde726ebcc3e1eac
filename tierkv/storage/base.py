"""The L3 interface: a page store keyed by chained page hashes. It knows nothing of the tree.

Pages move as uint8 tensors of exactly ``page_nbytes`` bytes (a host-pool page view when the layout
keeps a page contiguous, so reads and writes need no staging copy). Every stored page carries a
header (see :mod:`tierkv.storage.page_format`); a page that fails verification is reported as a miss.

Thread contract: methods are called from the storage worker threads, one batch at a time per thread;
implementations must be safe for one reader thread and one writer thread at once.

Fault contract: a backend never raises into its caller for an I/O or connection failure; it counts the
failure in ``stats.errors`` and answers a miss (exists/get) or False (set). A malformed key is a
caller bug and raises ValueError. Warnings are rate-limited per store and kind (one per
``LOG_INTERVAL_S``, the next one saying how many were held back): a full disk fails every page of
every backup, and one line per page would drown the log.
"""

from __future__ import annotations

import logging
import re
import threading
import time
from abc import ABC, abstractmethod
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Sequence

import numpy as np
import torch

from tierkv.storage import native
from tierkv.storage.overlap import helper_pool
from tierkv.storage.page_format import PageFormat, PageFormatError, namespace_digest

log = logging.getLogger(__name__)

# Chained page hashes are hex digests (sha256: 64 chars, xxh3-128: 32); anything else is refused so a
# key can never name a path or a pattern outside the store's own space.
MIN_KEY_CHARS, MAX_KEY_CHARS = 16, 128
_KEY_RE = re.compile(rf"[0-9a-f]{{{MIN_KEY_CHARS},{MAX_KEY_CHARS}}}")
_HEX_DIGITS = b"0123456789abcdef"
LOG_INTERVAL_S = 10.0
HICACHE_BATCH_PAGES = 128  # HiCache's STORAGE_BATCH_SIZE: the pages of one backup store call by default
PREFETCH_BATCH_PAGES = 16  # the pages of one prefetch read by default: progress is counted between reads


@dataclass
class StoreStats:
    """Counters every backend keeps; throughput is bytes over the seconds spent in batch calls."""

    get_pages: int = 0
    get_bytes: int = 0
    get_seconds: float = 0.0
    set_pages: int = 0
    set_bytes: int = 0
    set_seconds: float = 0.0
    exists_calls: int = 0
    corrupt_pages: int = 0
    evicted_pages: int = 0
    errors: int = 0
    extra: dict = field(default_factory=dict)

    def get_gbps(self) -> float:
        return self.get_bytes / self.get_seconds / 1e9 if self.get_seconds else 0.0

    def set_gbps(self) -> float:
        return self.set_bytes / self.set_seconds / 1e9 if self.set_seconds else 0.0


class Backoff:
    """Retry window after failures of a remote store: doubles per failure up to 64x, resets on success."""

    MAX_FACTOR = 64

    def __init__(self, base_s: float) -> None:
        if isinstance(base_s, bool) or not isinstance(base_s, (int, float)) or not 0 < base_s < float("inf"):
            raise ValueError(f"retry_backoff_s must be a finite number > 0, got {base_s!r}")
        self.base_s = base_s
        self._lock = threading.Lock()
        self._retry_at = 0.0
        self._failures = 0

    def ready(self) -> bool:
        """False while inside the window: the caller answers a miss without touching the network."""
        with self._lock:
            return time.monotonic() >= self._retry_at

    def failed(self) -> None:
        with self._lock:
            self._failures += 1
            factor = min(2 ** (self._failures - 1), self.MAX_FACTOR)
            self._retry_at = time.monotonic() + self.base_s * factor

    def succeeded(self) -> None:
        with self._lock:
            self._failures, self._retry_at = 0, 0.0


class RateLimitedLog:
    """At most one warning per ``interval_s``; the next one logged carries the count held back since."""

    def __init__(self, logger: logging.Logger, interval_s: float = LOG_INTERVAL_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.logger, self.interval_s, self.clock = logger, interval_s, clock
        self._lock = threading.Lock()
        self._next_at = float("-inf")
        self.suppressed = 0

    def warning(self, msg: str, *args: object) -> None:
        with self._lock:
            now = self.clock()
            if now < self._next_at:
                self.suppressed += 1
                return
            held_back, self.suppressed = self.suppressed, 0
            self._next_at = now + self.interval_s
        if held_back:
            msg, args = msg + " (and %d more like it in the last %.0f s)", (*args, held_back, self.interval_s)
        self.logger.warning(msg, *args)


def prefix_keys_arg(prefix_hashes: list[str] | None, hashes: list[str], start: int) -> dict[str, list[str]]:
    """``prefix_keys=`` for a batch of ``hashes`` from ``start`` (see PageStore.accepts_prefix_keys): the
    hashes before the batch, ``prefix_hashes`` first; nothing when ``prefix_hashes`` is None."""
    return {} if prefix_hashes is None else {"prefix_keys": prefix_hashes + hashes[:start]}


class LruIndex:
    """Sizes of stored pages in recency order: the capacity bookkeeping of a bounded store.

    Not thread-safe on its own: the store calls it under its own lock.
    """

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.size_bytes = 0
        self._sizes: OrderedDict[str, int] = OrderedDict()

    def __len__(self) -> int:
        return len(self._sizes)

    def __contains__(self, key: str) -> bool:
        return key in self._sizes

    def touch(self, key: str) -> None:
        if key in self._sizes:
            self._sizes.move_to_end(key)

    def add(self, key: str, size_bytes: int) -> list[str]:
        """Record ``key`` as the most recent page; return the least recent keys to evict to fit."""
        self.remove(key)
        self._sizes[key] = size_bytes
        self.size_bytes += size_bytes
        victims = []
        while self.size_bytes > self.max_bytes and len(self._sizes) > 1:
            victim, size = self._sizes.popitem(last=False)
            self.size_bytes -= size
            victims.append(victim)
        return victims

    def remove(self, key: str) -> None:
        size = self._sizes.pop(key, None)
        if size is not None:
            self.size_bytes -= size

    def clear(self) -> None:
        self._sizes.clear()
        self.size_bytes = 0


def check_max_bytes(max_bytes: int | None, blob_nbytes: int) -> int | None:
    """``max_bytes`` if None or an int that holds at least one stored page; ValueError otherwise."""
    if max_bytes is None:
        return None
    if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < blob_nbytes:
        raise ValueError(f"max_bytes must be an int >= one stored page ({blob_nbytes} bytes), got {max_bytes!r}")
    return max_bytes


def is_key(name: str) -> bool:
    return bool(_KEY_RE.fullmatch(name))


def check_key(key: str) -> str:
    """Return ``key`` if it is a lowercase hex page hash; ValueError naming it otherwise."""
    if not isinstance(key, str) or not _KEY_RE.fullmatch(key):
        raise ValueError(f"page key {key!r} is not a lowercase hex page hash of 16-128 characters")
    return key


def check_digests(keys: list[str], digests: Sequence[int | None] | None) -> None:
    """ValueError unless ``digests`` (see :attr:`PageStore.accepts_digests`) is None or one per key."""
    if digests is not None and len(digests) != len(keys):
        raise ValueError(f"{len(keys)} keys but {len(digests)} digests")


def check_keys(keys: list[str]) -> None:
    """:func:`check_key` for a whole batch: one native pass where built (~0.1 us a key less than the
    Python one, ~0.5 CPU-s of a replay), else one pass over the joined keys (a regex match per key cost
    ~1 us, a tenth of a 128 KiB page read); ValueError naming the first bad key."""
    if native.pageio is not None and isinstance(keys, (list, tuple)):
        bad = native.pageio.first_bad_key(keys, MIN_KEY_CHARS, MAX_KEY_CHARS)
        if bad >= 0:
            check_key(keys[bad])
        return
    try:
        joined = "".join(keys).encode("ascii")
        lengths = list(map(len, keys))  # C loops: a generator over the keys cost more than the rest
        ok = not joined.translate(None, _HEX_DIGITS) and (
            not keys or (min(lengths) >= MIN_KEY_CHARS and max(lengths) <= MAX_KEY_CHARS))
    except (TypeError, UnicodeEncodeError):
        ok = False
    if not ok:
        for key in keys:
            check_key(key)


def batch_pages(store: Any, configured_pages: int | None, kind: str) -> int:
    """The pages a ``kind`` ("prefetch" or "backup") moves to or from ``store`` per call: ``configured_pages``
    (the storage config's), or when None the store's own choice (a duck-typed store: the defaults)."""
    if configured_pages is not None:
        return configured_pages
    if isinstance(store, PageStore):
        return store.prefetch_batch_pages() if kind == "prefetch" else store.backup_batch_pages()
    return PREFETCH_BATCH_PAGES if kind == "prefetch" else HICACHE_BATCH_PAGES


def takes_rows(store: Any) -> bool:
    """Whether the cache may hand ``store`` pool rows (``batch_set_rows`` / ``batch_get_rows``): only a
    PageStore. A duck-typed store or a wrapper that delegates by attribute gets ``batch_set`` /
    ``batch_get`` as before, so a wrapper that intercepts those still sees every page."""
    return isinstance(store, PageStore)


def page_view(page: torch.Tensor, page_nbytes: int) -> memoryview:
    """A writable 1-D byte view of a contiguous uint8 CPU page tensor (no copy); ValueError otherwise.

    Checked on the numpy view (which only a CPU tensor has): torch's own attribute checks cost ~5 us a
    page, as much as the header and the key together."""
    if not isinstance(page, torch.Tensor):
        raise TypeError(f"page must be a torch.Tensor, got {type(page).__name__}")
    try:
        array = page.numpy()
    except (TypeError, RuntimeError):
        array = None
    if array is None or array.dtype != np.uint8 or not array.flags.c_contiguous:
        raise ValueError(f"page tensor must be contiguous uint8 on cpu, got {page.dtype} on "
                         f"{page.device} (contiguous={page.is_contiguous()})")
    if array.size != page_nbytes:
        raise ValueError(f"page tensor has {array.size} bytes, expected {page_nbytes}")
    return memoryview(array if array.ndim == 1 else array.reshape(-1))  # uint8: already bytes ("B")


class PageStore(ABC):
    """Abstract L3 backend. ``namespace`` names model, tenant, KV layout and TP shard (see hashing)."""

    name = "abstract"

    def __init__(self, namespace: str, page_nbytes: int, page_key: bytes | str | None = None) -> None:
        if not isinstance(page_nbytes, int) or page_nbytes < 1:
            raise ValueError(f"page_nbytes must be an int >= 1, got {page_nbytes!r}")
        # With a page_key every page carries a MAC and pages without a valid one are misses.
        self.format = PageFormat(namespace, page_nbytes, page_key)
        self.namespace = namespace
        # 32 hex chars naming the namespace in paths and remote key prefixes.
        self.namespace_tag = namespace_digest(namespace).hex()
        self.page_nbytes = page_nbytes
        self.stats = StoreStats()
        self._stats_lock = threading.Lock()
        self._error_log = RateLimitedLog(log)
        self._corrupt_log = RateLimitedLog(log)
        self._helpers: ThreadPoolExecutor | None = None

    # A store that sets this receives ``prefix_keys=`` (the hashes of every page before the batch, oldest
    # first) in batch_exists/get/set when the extra config asks for hicache_storage_pass_prefix_keys:
    # backends that lay pages out by prefix (as SGLang's hf3fs does) want it; a chained hash already
    # names its whole prefix, so no backend here needs it.
    accepts_prefix_keys: bool = False
    # A store that sets this takes ``digests=`` in batch_set (and so through batch_set_rows): per page its
    # payload's xxh3-64, or None, made by the L1 -> L2 copy that wrote the page (see
    # tierkv.pools.page_digests); it writes those headers without hashing the pages again (Mooncake, Redis,
    # unkeyed). A digest that does not match its page only makes a page that fails verification (a miss),
    # never wrong KV.
    accepts_digests: bool = False

    def backup_batch_pages(self) -> int:
        """Pages one backup hands :meth:`batch_set` at a time when the storage config leaves
        ``backup_batch_pages`` unset: HiCache's 128, unless a store's calls cost far more than its pages."""
        return HICACHE_BATCH_PAGES

    def prefetch_batch_pages(self) -> int:
        """Pages one prefetch asks :meth:`batch_get` for at a time when the storage config leaves
        ``prefetch_batch_pages`` unset: 16, unless a store's calls cost far more than its pages."""
        return PREFETCH_BATCH_PAGES

    @abstractmethod
    def batch_exists(self, keys: list[str]) -> int:
        """Length of the leading run of ``keys`` present in the store."""

    @abstractmethod
    def batch_get(self, keys: list[str], targets: list[torch.Tensor]) -> list[bool]:
        """Read each page into its uint8 target; False for a missing or corrupt page (target undefined)."""

    @abstractmethod
    def batch_set(self, keys: list[str], values: list[torch.Tensor]) -> list[bool]:
        """Store each uint8 page under its key; False where the write failed."""

    def batch_get_rows(self, keys: list[str], rows: np.ndarray, pages: Any, **kwargs: Any) -> list[bool]:
        """:meth:`batch_get` into rows ``pages[i]`` of ``rows``, a writable 2-D C-contiguous uint8 array whose
        rows are whole pages (``HostKVPool.page_bytes_array``); ValueError naming a bad row or page, nothing read.
        A store whose batch_get is its check then ``_get_views`` reads into the rows in place (no tensor a
        page); any other goes through its batch_get, a tensor a row."""
        return self._rows_call("batch_get", "_get_views", keys, rows, pages, kwargs)

    def batch_set_rows(self, keys: list[str], rows: np.ndarray, pages: Any, **kwargs: Any) -> list[bool]:
        """:meth:`batch_set` of rows ``pages[i]`` of ``rows`` (as :meth:`batch_get_rows`, with ``_set_views``)."""
        return self._rows_call("batch_set", "_set_views", keys, rows, pages, kwargs)

    @abstractmethod
    def clear(self) -> None:
        """Remove every page of this store's namespace/prefix."""

    def check_config(self) -> None:
        """Raise ValueError for a setting the backend refuses (a Redis db index out of range). A backend
        that is down or slow is no error here: that only costs hits. Default: nothing to check."""

    def close(self) -> None:
        """Release connections, files and helper threads."""
        self._stop_helpers()

    def _helper_pool(self) -> ThreadPoolExecutor:
        """The threads that checksum this store's pages beside its I/O (see overlap); made on first use."""
        with self._stats_lock:
            if self._helpers is None:
                self._helpers = helper_pool()
            return self._helpers

    def _stop_helpers(self) -> None:
        with self._stats_lock:
            helpers, self._helpers = self._helpers, None
        if helpers is not None:
            helpers.shutdown(wait=True)  # their jobs are short hashing passes

    def register_host_buffer(self, buffer: torch.Tensor) -> None:
        """Tell the backend where the host pool lives (RDMA backends register it); default: nothing."""

    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    # Helpers for implementations.

    def _verified(self, key: str, header: bytes | memoryview, payload: memoryview, state: Any = None) -> bool:
        """True if the stored page checks out (``state``: its payload hasher, already fed, if any);
        otherwise log, count, remove it and return False."""
        try:
            self.format.verify(key, header, payload, state)
        except PageFormatError as err:
            self._reject(key, err)
            return False
        return True

    def _reject(self, key: str, err: PageFormatError) -> None:
        """A page that failed verification: log, count and remove it."""
        self._corrupt_log.warning("%s store: dropping corrupt page: %s", self.name, err)
        self._count(corrupt_pages=1)
        self._drop(key)

    def _rejected(self, failures: list[tuple[int, PageFormatError]], keys: list[str],
                  found: list[bool]) -> list[bool]:
        """``found`` with the pages that failed verification (``failures``: index, error) turned to False
        (each rejected), and the good ones counted as read."""
        for index, err in failures:
            found[index] = False
            self._reject(keys[index], err)
        num_found = sum(found)
        self._count(get_pages=num_found, get_bytes=num_found * self.page_nbytes)
        return found

    def _drop(self, key: str) -> None:
        """Best-effort removal of a corrupt page: backups skip pages that exist, so it would stay."""

    def _error(self, what: str, err: BaseException) -> None:
        self._error_log.warning("%s store: %s failed: %s: %s", self.name, what, type(err).__name__, err)
        self._count(errors=1)

    def _count(self, **deltas: float) -> None:
        with self._stats_lock:
            for name, delta in deltas.items():
                setattr(self.stats, name, getattr(self.stats, name) + delta)

    @contextmanager
    def _timed(self, op: str) -> Iterator[None]:
        """Adds the batch's wall time to ``stats.<op>_seconds``."""
        start = time.perf_counter()
        try:
            yield
        finally:
            self._count(**{f"{op}_seconds": time.perf_counter() - start})

    def _rows_call(self, method: str, view_method: str, keys: list[str], rows: np.ndarray, pages: Any,
                   kwargs: dict[str, Any]) -> list[bool]:
        _, views = self._row_views(keys, rows, pages)
        # in place only through the class that defines the view call, and only if ``method`` is still that
        # class's own: a subclass that overrides batch_get/batch_set must see every page. The only keyword
        # the view call takes is a backup's ``digests``, and only from a store that accepts them.
        owner = next((c for c in type(self).__mro__ if view_method in vars(c)), None)
        in_place = not kwargs or (set(kwargs) == {"digests"} and self.accepts_digests)
        if owner is not None and in_place and getattr(type(self), method) is getattr(owner, method):
            return getattr(self, view_method)(keys, views, **kwargs)
        return getattr(self, method)(keys, [torch.from_numpy(rows[p]) for p in np.asarray(pages).tolist()], **kwargs)

    def _row_views(self, keys: list[str], rows: np.ndarray, pages: Any) -> tuple[np.ndarray, list[memoryview]]:
        """Rows ``pages`` of ``rows`` as an index array and a byte view each (checked once for the whole
        batch, not page by page)."""
        index = self._row_index(keys, rows, pages)
        flat, nbytes = memoryview(rows).cast("B"), self.page_nbytes
        return index, [flat[p * nbytes:(p + 1) * nbytes] for p in index.tolist()]

    def _row_index(self, keys: list[str], rows: np.ndarray, pages: Any) -> np.ndarray:
        """``pages`` as an integer array, once ``rows`` (page rows), ``pages`` (one in range per key) and
        ``keys`` are checked; ValueError naming what is wrong."""
        if (not isinstance(rows, np.ndarray) or rows.dtype != np.uint8 or rows.ndim != 2
                or not rows.flags.c_contiguous or rows.shape[1] != self.page_nbytes):
            raise ValueError(f"page rows must be a C-contiguous 2-D uint8 array of {self.page_nbytes}-byte rows, "
                             f"got {type(rows).__name__} {getattr(rows, 'dtype', '')} "
                             f"{getattr(rows, 'shape', '')}")
        index = np.asarray(pages)
        if index.ndim != 1 or len(index) != len(keys) or (len(index) and index.dtype.kind not in "iu"):
            raise ValueError(f"{len(keys)} keys need as many integer page rows, got {index.dtype} {index.shape}")
        if len(index) and (index.min() < 0 or index.max() >= len(rows)):
            bad = index[(index < 0) | (index >= len(rows))][0]
            raise ValueError(f"page row {int(bad)} is outside the {len(rows)} rows given")
        check_keys(keys)
        return index

    def _check_batch(self, keys: list[str], tensors: list[torch.Tensor]) -> list[memoryview]:
        if len(keys) != len(tensors):
            raise ValueError(f"{len(keys)} keys but {len(tensors)} page tensors")
        check_keys(keys)
        return [page_view(t, self.page_nbytes) for t in tensors]
