"""Configuration of the L3 tier (prefetch, backup, hashing) parsed from the extra-config JSON.

The JSON object mixes the controller's keys (the fields of :class:`StorageConfig`) with keys meant for
the backend; the latter are kept in ``backend_config`` and handed to ``open_store`` untouched. A key is
a backend key only when the caller names it as one (``backend_keys``): anything else unknown is an error.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, fields
from typing import Any, Iterable, Mapping

from tierkv.validate import check_bool, check_choice, check_int, check_seconds

STOP_POLICIES = ("best_effort", "wait_complete", "timeout")
HASH_ALGORITHMS = ("sha256", "xxh3_128")
# None: resolved by the controller (from the cache's sizes, the store's choice)
_RESOLVED_LATER = ("prefetch_max_tokens_in_flight", "prefetch_batch_pages", "backup_batch_pages")


@dataclass(frozen=True)
class StorageConfig:
    """Policies of the L3 tier. Errors are ValueErrors naming the field and the bad value.

    Timeouts are seconds (the seed's names keep no unit suffix). ``hash_algorithm`` None keeps the
    namespace's own. ``hicache_storage_pass_prefix_keys`` hands stores that declare
    ``accepts_prefix_keys`` the hashes of the pages before each batch (none of tierkv's own backends
    needs them: a chained page hash already names its whole prefix).
    ``prefetch_max_tokens_in_flight`` is the rate limit (None: HiCache's 0.8 x (L2 - L1) tokens, at least
    one page, resolved by the controller); ``prefetch_batch_pages`` and ``backup_batch_pages`` are the pages
    one store call carries (a prefetch's progress is counted, and can stop, between its calls); None is
    the store's choice (:meth:`PageStore.prefetch_batch_pages`, :meth:`PageStore.backup_batch_pages`): 16
    pages a read and HiCache's ``STORAGE_BATCH_SIZE`` of 128 a write, or for the file store, whose calls
    each open a pack file, as many small pages as fill 1 MiB a read and 4 MiB a write;
    ``backup_max_pending_tokens`` caps the backup
    queue (later backups are dropped, costing only a future L3 miss); ``io_wait_timeout_s`` bounds every
    wait on storage threads (flush, reset, close).
    """

    prefetch_threshold: int = 256
    prefetch_timeout_base: float = 1.0
    prefetch_timeout_per_ki_token: float = 0.25
    hicache_storage_pass_prefix_keys: bool = False
    prefetch_stop_policy: str = "best_effort"
    hash_algorithm: str | None = None
    prefetch_max_tokens_in_flight: int | None = None
    prefetch_batch_pages: int | None = None
    backup_batch_pages: int | None = None
    backup_max_pending_tokens: int = 1 << 20
    io_wait_timeout_s: float = 10.0
    backend_config: Mapping[str, Any] = field(default_factory=dict, repr=False)  # may hold a password

    def __post_init__(self) -> None:
        check_int("prefetch_threshold", self.prefetch_threshold, minimum=0)
        for name in ("prefetch_max_tokens_in_flight", "prefetch_batch_pages", "backup_batch_pages",
                     "backup_max_pending_tokens"):
            if name not in _RESOLVED_LATER or getattr(self, name) is not None:
                check_int(name, getattr(self, name), minimum=1)
        for name in ("prefetch_timeout_base", "prefetch_timeout_per_ki_token"):
            check_seconds(name, getattr(self, name))
        # > 0: a zero bound gives up on every storage thread at once, and close() then reports a hang
        check_seconds("io_wait_timeout_s", self.io_wait_timeout_s, positive=True)
        check_bool("hicache_storage_pass_prefix_keys", self.hicache_storage_pass_prefix_keys)
        check_choice("prefetch_stop_policy", self.prefetch_stop_policy, STOP_POLICIES)
        if self.hash_algorithm is not None:
            check_choice("hash_algorithm", self.hash_algorithm, HASH_ALGORITHMS)
        if not isinstance(self.backend_config, Mapping):
            # its value is not shown: backend keys include passwords and page keys
            raise ValueError(f"backend_config must be a mapping, got a {type(self.backend_config).__name__}")
        object.__setattr__(self, "backend_config", dict(self.backend_config))  # a private copy; picklable

    @classmethod
    def from_dict(cls, values: Mapping[str, Any], backend_keys: Iterable[str] = ()) -> "StorageConfig":
        """Split ``values`` into controller fields and the backend's keys; unknown keys are errors."""
        own = {f.name for f in fields(cls)} - {"backend_config"}
        allowed_backend = set(backend_keys)
        nested = values.get("backend_config", {})
        if not isinstance(nested, Mapping):
            raise ValueError(f"backend_config must be an object, got {type(nested).__name__}")
        mine, backend = {}, dict(nested)
        for key, value in values.items():
            if key in own:
                mine[key] = value
            elif key in allowed_backend:
                backend[key] = value
            elif key != "backend_config":
                raise ValueError(f"unknown storage config key {key!r}; known: {sorted(own | allowed_backend)}")
        return cls(**mine, backend_config=backend)

    @classmethod
    def from_json(cls, text: str | None, backend_keys: Iterable[str] = ()) -> "StorageConfig":
        """Parse the extra-config JSON (an object); empty or None gives the defaults."""
        if text is None or not text.strip():
            return cls()
        try:
            values = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"storage extra config is not valid JSON: {exc}") from None
        if not isinstance(values, dict):
            raise ValueError(f"storage extra config must be a JSON object, got {type(values).__name__}")
        return cls.from_dict(values, backend_keys)

    def prefetch_timeout_s(self, num_tokens: int) -> float:
        """The timeout policy's budget for ``num_tokens`` that L3 holds (HiCache: the agreed hit, not the
        tokens asked for, so a prompt with 1 of 64 pages in L3 waits for 1 page's worth)."""
        return self.prefetch_timeout_base + self.prefetch_timeout_per_ki_token * num_tokens / 1024
