"""tierkv's L3 page stores (file, Redis, Redis Cluster, Mooncake) as an SGLang HiCache storage backend.

SGLang 0.5.23 loads it as a ``dynamic`` backend (see docs/sglang.md for a whole command line)::

    --enable-hierarchical-cache --hicache-storage-backend dynamic --hicache-storage-backend-extra-config
    '{"backend_name": "tierkv", "module_path": "tierkv.integrations.sglang", "class_name": "TierkvStorage",
      "interface_v1": 1, "storage_backend": "file:///var/cache/tierkv", "max_bytes": 100000000000}'

``interface_v1`` makes SGLang call the zero-copy ``batch_get_v1`` / ``batch_set_v1``; without it SGLang
copies each page through a flat staging tensor (``batch_get`` / ``batch_set``). Both paths store the
same bytes. ``storage_backend`` is a tierkv store spec; the store's own keys (``dir``, ``max_bytes``,
``page_key``, ``password``, ``ttl_s``, ...) sit flat beside it; ``model_tag`` replaces SGLang's model
name in the page namespace. Every page carries tierkv's header (checksum, namespace, and with a
``page_key`` a keyed MAC): a corrupt or forged page is a miss, never wrong KV.

One SGLang page is ``E`` tierkv pages, one per buffer element of the host pool's page
(``get_page_buffer_meta``): in ``page_first`` / ``page_first_direct`` an MHA page is its K and its V
run, an MLA page one run, each read and written in place in the host pool. Other layouts (``layer_first``
scatters a page over every layer) move one flat page (``get_data_page``) through a staging buffer.
A tierkv key is SGLang's page hash plus two hex digits naming the element. The namespace names the
model, attention kind, host layout, dtype, shape, page size, pipeline stage and, for MHA only, the TP
rank: MLA's latent KV is the same on every rank, so every rank reads the one copy rank 0 writes
(SGLang itself skips MLA backups on the other ranks). Pages of another layout or shape are misses.

This is the only tierkv module that imports sglang.
"""

from __future__ import annotations

import logging
import sys
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
from sglang.srt.mem_cache.hicache_storage import HiCacheStorage, HiCacheStorageConfig, HiCacheStorageExtraInfo

from tierkv.hashing import HashNamespace
from tierkv.storage.base import PageStore
from tierkv.storage.factory import (BACKEND_OPTIONS, PAGE_KEY_FILE_ENV, SECRET_OPTIONS, check_options, open_store,
                                    parse_spec, redact_spec)

log = logging.getLogger(__name__)

# Keys of the extra config that SGLang itself reads and leaves in the dict it hands to the backend.
SGLANG_KEYS = ("backend_name", "module_path", "class_name", "interface_v1")
OWN_KEYS = {"storage_backend": str, "model_tag": str}
ZERO_COPY_LAYOUTS = ("page_first", "page_first_direct")
# Layouts that scatter a page over the host pool move through staging buffers of at most this size.
STAGING_NBYTES = 64 << 20
_SECRET_HINT = (f"pass the extra config as a file (--hicache-storage-backend-extra-config @/path/config.json) "
                f"or put the page key in a file named by ${PAGE_KEY_FILE_ENV}")


@dataclass(frozen=True)
class BackendConfig:
    """The backend's keys from SGLang's ``--hicache-storage-backend-extra-config``."""

    spec: str = field(repr=False)  # a Redis URL may carry a password
    model_tag: Optional[str] = None
    store_options: dict = field(default_factory=dict, repr=False)  # may hold page_key / password

    @classmethod
    def from_extra(cls, extra: Optional[dict]) -> "BackendConfig":
        """Split the extra config; ValueError naming a missing, unknown or mistyped key and every known one."""
        extra = dict(extra or {})
        for key in SGLANG_KEYS:
            extra.pop(key, None)
        spec = extra.pop("storage_backend", None)
        if not isinstance(spec, str) or not spec:
            raise ValueError("the tierkv SGLang backend needs \"storage_backend\" in the extra config: a store spec "
                             f"such as file:///dir or redis://host:port/0, got {spec!r}")
        backend, _ = parse_spec(spec)
        model_tag = extra.pop("model_tag", None)
        if model_tag is not None and (not isinstance(model_tag, str) or not model_tag):
            raise ValueError(f"extra config key 'model_tag' must be a non-empty string, got {model_tag!r}")
        known = sorted({*SGLANG_KEYS, *OWN_KEYS, *BACKEND_OPTIONS[backend]})
        for key in extra:
            if key not in BACKEND_OPTIONS[backend]:
                raise ValueError(f"unknown extra config key {key!r} for the tierkv SGLang backend with a {backend} "
                                 f"store (known: {known})")
        check_options(backend, dict(extra))
        _warn_inline_secrets(spec, extra)
        return cls(spec=spec, model_tag=model_tag, store_options=extra)


def _warn_inline_secrets(spec: str, options: dict, argv: Optional[list] = None) -> None:
    """A secret on the command line is in ``ps`` and in SGLang's log of its server arguments: say which one
    (never its value). Multiprocessing children inherit the launcher's ``sys.argv``, so every rank sees it."""
    command_line = " ".join(sys.argv if argv is None else argv)
    inline = [key for key in SECRET_OPTIONS if key in options and str(options[key]) in command_line]
    if redact_spec(spec) != spec and spec in command_line:
        inline.append("the password in storage_backend")
    if inline:
        log.warning("tierkv: %s given on the command line, which SGLang logs with its server arguments: %s",
                    ", ".join(inline), _SECRET_HINT)


@dataclass(frozen=True)
class PageGeometry:
    """How one SGLang page of a host pool maps onto tierkv pages."""

    elements_per_page: int
    element_nbytes: int
    zero_copy: bool
    page_numel: int  # of the host pool's flat data page, in its dtype


def page_geometry(pool: Any) -> PageGeometry:
    """The element split of ``pool``'s pages: its buffer metadata when a layout keeps elements whole."""
    flat = pool.get_dummy_flat_data_page()
    flat_nbytes = flat.numel() * flat.element_size()
    if pool.layout in ZERO_COPY_LAYOUTS:
        _, sizes = pool.get_page_buffer_meta(torch.arange(pool.page_size, dtype=torch.int64))
        # the flat page must be exactly the elements end to end, or the two interfaces would disagree
        if len(set(sizes)) == 1 and sizes[0] * len(sizes) == flat_nbytes:
            return PageGeometry(len(sizes), int(sizes[0]), True, flat.numel())
    return PageGeometry(1, flat_nbytes, False, flat.numel())


def store_namespace(config: HiCacheStorageConfig, pool: Any, model: str) -> str:
    """The namespace of one rank's pages (see the module docstring)."""
    kind = "mla" if config.is_mla_model else "mha"
    if config.is_mla_model:
        shape = (pool.layer_num, 1, pool.kv_cache_dim)
        tp_rank, tp_size = 0, 1
    else:
        shape = (pool.layer_num, pool.head_num, pool.head_dim)
        tp_rank, tp_size = config.tp_rank, config.tp_size
    layout = (f"sglang/{kind}/{pool.layout}/page={pool.page_size}/pp={config.pp_rank}of{config.pp_size}"
              f"/cp={config.attn_cp_rank}of{config.attn_cp_size}/format={pool.storage_format_tag or ''}")
    return HashNamespace(model=model, kv_layout=layout, kv_dtype=str(pool.dtype).removeprefix("torch."),
                         kv_shape=shape, tp_rank=tp_rank, tp_size=tp_size).name()


def _check_supported(config: HiCacheStorageConfig) -> None:
    if config.should_split_heads:
        raise ValueError("the tierkv SGLang backend does not split heads across TP sizes: drop tp_lcm_size")
    if config.dcp_size > 1:
        raise ValueError(f"the tierkv SGLang backend does not support decode context parallel "
                         f"(dcp_size={config.dcp_size})")


class TierkvStorage(HiCacheStorage):
    """SGLang's ``HiCacheStorage`` over a tierkv :class:`~tierkv.storage.base.PageStore`.

    Thread contract: SGLang calls it from its prefetch and backup threads at once; the store is safe for
    one reader and one writer thread, and this class keeps no state that a call changes.
    """

    def __init__(self, storage_config: HiCacheStorageConfig, kwargs: Optional[dict] = None) -> None:
        _check_supported(storage_config)
        self.storage_config = storage_config
        self.config = BackendConfig.from_extra(storage_config.extra_config)
        model = self.config.model_tag or storage_config.model_name
        if not model:
            raise ValueError("SGLang passed no model name: set \"model_tag\" in the extra config")
        self.model = model
        if not (storage_config.extra_config or {}).get("interface_v1"):
            log.warning("tierkv: \"interface_v1\" is not set in --hicache-storage-backend-extra-config, so SGLang "
                        "copies every page through a staging tensor; set \"interface_v1\": 1 for zero-copy")
        self.store: Optional[PageStore] = None
        self.geometry: Optional[PageGeometry] = None

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        """Open the store for this pool's pages (their size is known only now)."""
        super().register_mem_pool_host(mem_pool_host)
        if mem_pool_host.kv_buffer is None:
            raise ValueError("the tierkv SGLang backend needs a host pool holding KV (got an allocator-only pool)")
        if not mem_pool_host.kv_buffer.is_contiguous():
            raise ValueError("the tierkv SGLang backend needs the host pool's KV buffer contiguous")
        self.geometry = page_geometry(mem_pool_host)
        namespace = store_namespace(self.storage_config, mem_pool_host, self.model)
        if self.store is not None:
            self.store.close()
        self.store = open_store(self.config.spec, namespace, self.geometry.element_nbytes,
                                self.config.store_options)
        self._base = mem_pool_host.kv_buffer.view(-1).view(torch.uint8)
        self.store.register_host_buffer(self._base)
        log.info("tierkv L3 for SGLang: %s, %s pages of %d x %d bytes (%s), namespace %s",
                 redact_spec(self.config.spec), mem_pool_host.layout, self.geometry.elements_per_page,
                 self.geometry.element_nbytes, "zero-copy" if self.geometry.zero_copy else "staged", namespace)

    # Keys and element views.

    def _ready(self) -> tuple[PageStore, PageGeometry]:
        if self.store is None or self.geometry is None:
            raise RuntimeError("tierkv SGLang backend used before register_mem_pool_host")
        return self.store, self.geometry

    def _element_keys(self, keys: list[str]) -> list[str]:
        num = self._ready()[1].elements_per_page
        return [f"{key}{element:02x}" for key in keys for element in range(num)]

    def _prefix_arg(self, extra_info: Optional[HiCacheStorageExtraInfo]) -> dict:
        """``prefix_keys=`` for a store that lays pages out by prefix (none of tierkv's own do)."""
        store = self._ready()[0]
        if not store.accepts_prefix_keys or extra_info is None or extra_info.prefix_keys is None:
            return {}
        return {"prefix_keys": self._element_keys(list(extra_info.prefix_keys))}

    def _pool_views(self, host_indices: torch.Tensor) -> list[torch.Tensor]:
        """uint8 views of every element of the pages at ``host_indices``, in place in the host pool."""
        ptrs, sizes = self.mem_pool_host.get_page_buffer_meta(host_indices)
        start, end = self._base.data_ptr(), self._base.data_ptr() + self._base.numel()
        views = []
        for ptr, size in zip(ptrs, sizes):
            if not start <= ptr <= end - size:
                raise ValueError(f"host pool element at {ptr:#x} (+{size}) lies outside its KV buffer")
            views.append(self._base[ptr - start:ptr - start + size])
        return views

    def _split(self, flat_pages: list[torch.Tensor]) -> list[torch.Tensor]:
        """Each flat page (the pool's dtype) as its elements' uint8 views."""
        geometry = self._ready()[1]
        views = []
        for page in flat_pages:
            if not isinstance(page, torch.Tensor) or not page.is_contiguous():
                # a reshape of a strided page would be a copy, and a read into it would be lost
                raise ValueError(f"a flat page must be a contiguous torch.Tensor, got {type(page).__name__}")
            data = page.reshape(-1).view(torch.uint8)
            if data.numel() != geometry.elements_per_page * geometry.element_nbytes:
                raise ValueError(f"flat page of {data.numel()} bytes, expected "
                                 f"{geometry.elements_per_page * geometry.element_nbytes}")
            views.extend(data.split(geometry.element_nbytes))
        return views

    def _by_page(self, found: list[bool]) -> list[bool]:
        num = self._ready()[1].elements_per_page
        return [all(found[i:i + num]) for i in range(0, len(found), num)]

    # Existence.

    def batch_exists(self, keys: list[str], extra_info: Optional[HiCacheStorageExtraInfo] = None) -> int:
        """Length of the leading run of ``keys`` whose every element is stored (not yet verified: a corrupt
        page shows up as a failed get, which SGLang counts as the end of the hit)."""
        if not keys:
            return 0
        store, geometry = self._ready()
        return store.batch_exists(self._element_keys(keys), **self._prefix_arg(extra_info)) \
            // geometry.elements_per_page

    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    # Zero-copy interface (extra config "interface_v1": 1).

    def batch_get_v1(self, keys: list[str], host_indices: torch.Tensor,
                     extra_info: Optional[HiCacheStorageExtraInfo] = None) -> list[bool]:
        """Read each page into the host pool at ``host_indices`` (page after page); False where missing or bad."""
        store, geometry = self._ready()
        if not keys:
            return []
        self._check_indices(keys, host_indices)
        if not geometry.zero_copy:
            return self._staged_get(keys, host_indices, extra_info)
        found = store.batch_get(self._element_keys(keys), self._pool_views(host_indices),
                                **self._prefix_arg(extra_info))
        return self._by_page(found)

    def batch_set_v1(self, keys: list[str], host_indices: torch.Tensor,
                     extra_info: Optional[HiCacheStorageExtraInfo] = None) -> list[bool]:
        """Store the host pool's pages at ``host_indices`` under ``keys``; False where a write failed."""
        store, geometry = self._ready()
        if not keys:
            return []
        self._check_indices(keys, host_indices)
        page_size = self.mem_pool_host.page_size
        if geometry.zero_copy:
            def views_of(lo: int, hi: int) -> list[torch.Tensor]:
                return self._pool_views(host_indices[lo * page_size:hi * page_size])
        else:
            def views_of(lo: int, hi: int) -> list[torch.Tensor]:
                return self._split(self._flat_pages(host_indices, lo, hi))
        return self._set_elements(keys, views_of, extra_info)

    def _check_indices(self, keys: list[str], host_indices: torch.Tensor) -> None:
        expected = len(keys) * self.mem_pool_host.page_size
        if host_indices.numel() != expected:
            raise ValueError(f"{len(keys)} page keys but {host_indices.numel()} host indices (expected {expected})")

    def _flat_pages(self, host_indices: torch.Tensor, lo: int, hi: int) -> list[torch.Tensor]:
        page_size = self.mem_pool_host.page_size
        return [self.mem_pool_host.get_data_page(int(host_indices[i * page_size]), flat=True).contiguous()
                for i in range(lo, hi)]

    def _set_elements(self, keys: list[str], views_of, extra_info: Optional[HiCacheStorageExtraInfo]) -> list[bool]:
        """Write the pages after the leading run already stored (a page's key names its bytes: a stored page
        never changes); ``views_of(lo, hi)`` gives the element views of pages lo..hi-1."""
        store, geometry = self._ready()
        present = self.batch_exists(keys, extra_info)
        results = [True] * present
        step = max(1, STAGING_NBYTES // (geometry.element_nbytes * geometry.elements_per_page))
        base = self._prefix_arg(extra_info)
        for lo in range(present, len(keys), step):
            hi = min(len(keys), lo + step)
            prefix = {"prefix_keys": base["prefix_keys"] + self._element_keys(keys[:lo])} if base else {}
            results.extend(self._by_page(store.batch_set(self._element_keys(keys[lo:hi]), views_of(lo, hi),
                                                         **prefix)))
        return results

    def _staged_get(self, keys: list[str], host_indices: torch.Tensor,
                    extra_info: Optional[HiCacheStorageExtraInfo]) -> list[bool]:
        """Read whole flat pages into a staging buffer, then scatter each good one into the pool."""
        store, geometry = self._ready()
        pool, page_size = self.mem_pool_host, self.mem_pool_host.page_size
        step = max(1, STAGING_NBYTES // geometry.element_nbytes)
        results: list[bool] = []
        for lo in range(0, len(keys), step):
            hi = min(len(keys), lo + step)
            staging = torch.empty((hi - lo, geometry.page_numel), dtype=pool.dtype)
            found = store.batch_get(self._element_keys(keys[lo:hi]), self._split(list(staging)),
                                    **self._prefix_arg(extra_info))
            for i, ok in enumerate(found):
                if ok:
                    pool.set_from_flat_data_page(int(host_indices[(lo + i) * page_size]), staging[i])
            results.extend(found)
        return results

    # Copying interface (what SGLang calls without "interface_v1"): flat pages in the pool's dtype.

    def batch_get(self, keys: list[str], target_locations: Optional[list] = None,
                  target_sizes: Optional[Any] = None) -> list[Optional[torch.Tensor]]:
        """Read each page into its flat target; the target, or None where missing or bad."""
        store, _ = self._ready()
        if not keys:
            return []
        if target_locations is None or len(target_locations) != len(keys):
            raise ValueError(f"{len(keys)} page keys need as many flat target pages")
        found = self._by_page(store.batch_get(self._element_keys(keys), self._split(target_locations)))
        return [target if ok else None for target, ok in zip(target_locations, found)]

    def batch_set(self, keys: list[str], values: Optional[list] = None, target_locations: Optional[Any] = None,
                  target_sizes: Optional[Any] = None) -> bool:
        """Store each flat page under its key; True if every page is stored."""
        if not keys:
            return True
        if values is None or len(values) != len(keys):
            raise ValueError(f"{len(keys)} page keys need as many flat pages")
        pages = [value.contiguous() for value in values]
        return all(self._set_elements(keys, lambda lo, hi: self._split(pages[lo:hi]), None))

    def get(self, key: str, target_location: Optional[Any] = None,
            target_sizes: Optional[Any] = None) -> Optional[torch.Tensor]:
        return self.batch_get([key], [target_location])[0]

    def set(self, key: str, value: Optional[Any] = None, target_location: Optional[Any] = None,
            target_sizes: Optional[Any] = None) -> bool:
        return self.batch_set([key], [value])

    # Lifecycle.

    def clear(self) -> None:
        """Remove every page of this rank's namespace."""
        if self.store is not None:
            self.store.clear()

    def close(self) -> None:
        if self.store is not None:
            self.store.close()
            self.store = None

    def get_stats(self) -> None:
        # SGLang's storage metrics are histograms of its own; the store's counters are in self.store.stats.
        return None

