"""HiCache's sizing and maintenance calls: hicache_size_gb=0 means "use the ratio", an L2 larger than
the free host memory less HiCache's 10 GiB reserve is refused up front, clear_storage_backend() empties
L3 alone and answers False when the backend fails, and get_height gives a node's depth."""

from __future__ import annotations

import pytest

from tierkv.cache.config import CacheConfig
from tierkv.pools import kv
from tierkv.pools.kv import available_host_memory_bytes, host_pool_tokens
from tierkv.cache.l3.controller import open_storage
from tierkv.radix import RadixKey
from tests.servers import free_port

from storage_util import FakeStore, attach_fake, compute_and_insert, make_cache, random_tokens, storage_config

PS = 16


def test_hicache_size_zero_uses_the_ratio():
    cache = make_cache(page_size=PS, device_tokens=512, hicache_ratio=3.0, hicache_size_gb=0)
    assert cache.host_pool.num_slots == 3 * 512 + cache.config.staging_tokens
    assert host_pool_tokens(512, 1024, PS, ratio=2.0, size_gb=0) == 1024
    cache.close()


def test_negative_hicache_size_is_still_refused():
    with pytest.raises(ValueError, match="hicache_size_gb"):
        CacheConfig(hicache_size_gb=-1)


@pytest.mark.skipif(available_host_memory_bytes() is None, reason="no /proc/meminfo here")
def test_l2_larger_than_the_free_host_memory_is_a_clear_error():
    free_gb = available_host_memory_bytes() / 1e9
    with pytest.raises(ValueError, match=r"GB of host memory is available.*lower hicache_ratio") as info:
        make_cache(page_size=PS, device_tokens=512, hicache_size_gb=free_gb * 4)
    assert "GB" in str(info.value)


@pytest.mark.skipif(available_host_memory_bytes() is None, reason="no /proc/meminfo here")
def test_l2_must_leave_hicaches_10_gib_of_host_memory_free():
    reserve_bytes = getattr(kv, "HOST_MEMORY_RESERVE_BYTES", 0)
    assert reserve_bytes == 10 * 2**30 and CacheConfig().host_memory_reserve_gib == 10.0
    # an L2 that fits in the free memory but not beside the reserve (sized only: nothing is allocated)
    size_gb = (available_host_memory_bytes() - reserve_bytes // 2) / 1e9
    with pytest.raises(ValueError, match=r"GiB stays free \(host_memory_reserve_gib\)"):
        host_pool_tokens(512, 1024, PS, size_gb=size_gb)
    assert host_pool_tokens(512, 1024, PS, size_gb=size_gb, reserve_bytes=0) > 512
    # the cache passes its config's reserve: one larger than the free memory refuses even a small L2
    reserve_gib = available_host_memory_bytes() / 2**30 + 1
    with pytest.raises(ValueError, match="host_memory_reserve_gib"):
        make_cache(page_size=PS, device_tokens=512, host_memory_reserve_gib=reserve_gib)
    with pytest.raises(ValueError, match="host_memory_reserve_gib"):
        CacheConfig(host_memory_reserve_gib=-1)


def test_clear_storage_backend_empties_l3_and_keeps_l1_l2():
    cache = make_cache(page_size=PS)
    assert cache.clear_storage_backend() is False  # no L3 attached
    store = attach_fake(cache)
    key = RadixKey(random_tokens(4 * PS, seed=51))
    compute_and_insert(cache, key, seed=52)
    cache.flush()
    assert len(store.blobs) == 4
    assert cache.clear_storage_backend() is True
    assert not store.blobs
    m = cache.match_prefix(key)
    assert len(m.device_indices) + m.host_hit_length == 4 * PS
    cache.check_integrity()
    cache.close()


class _NoClearStore(FakeStore):
    def clear(self) -> None:
        raise NotImplementedError("this backend cannot list its keys")


def test_clear_storage_backend_says_when_the_backend_cannot():
    cache = make_cache(page_size=PS)
    store = _NoClearStore("ns", cache.host_pool.page_nbytes)
    cache.attach_storage(store, storage_config(), "test-model")
    assert cache.clear_storage_backend() is False
    cache.close()


class _FailingClearStore(FakeStore):
    def clear(self) -> None:
        raise ConnectionError("the backend went away")


def test_clear_storage_backend_is_false_when_the_backend_fails(tmp_path):
    cache = make_cache(page_size=PS)
    cache.attach_storage(_FailingClearStore("ns", cache.host_pool.page_nbytes), storage_config(), "test-model")
    assert cache.clear_storage_backend() is False  # raised: HiCache answers False
    cache.close()
    cache = make_cache(page_size=PS)  # a backend that counts the failure instead of raising
    open_storage(cache, f"redis://127.0.0.1:{free_port()}", '{"timeout_s": 0.5}', "test-model")
    assert cache.clear_storage_backend() is False
    cache.close()


def test_get_height_is_a_nodes_depth():
    cache = make_cache(page_size=PS)
    head = random_tokens(2 * PS, seed=60)
    compute_and_insert(cache, RadixKey(head), seed=61)
    compute_and_insert(cache, RadixKey(head + random_tokens(PS, seed=62)), seed=63)
    leaf = cache.match_prefix(RadixKey(head + random_tokens(PS, seed=62))).last_device_node
    assert cache.get_height(cache.tree.root) == 0
    assert cache.get_height(leaf.parent) == 1 and cache.get_height(leaf) == 2
    cache.close()
