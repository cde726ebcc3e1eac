"""HiCache's sizing and maintenance calls: hicache_size_gb=0 means "use the ratio", an L2 larger than
the free host memory is refused up front, and clear_storage_backend() empties L3 alone."""

from __future__ import annotations

import pytest

from tierkv.cache.config import CacheConfig
from tierkv.pools.kv import available_host_memory_bytes, host_pool_tokens
from tierkv.radix import RadixKey

from storage_util import FakeStore, attach_fake, compute_and_insert, make_cache, random_tokens, storage_config

PS = 16


def test_hicache_size_zero_uses_the_ratio():
    cache = make_cache(page_size=PS, device_tokens=512, hicache_ratio=3.0, hicache_size_gb=0)
    assert cache.host_pool.num_slots == 3 * 512
    assert host_pool_tokens(512, 1024, PS, ratio=2.0, size_gb=0) == 1024
    cache.close()


def test_negative_hicache_size_is_still_refused():
    with pytest.raises(ValueError, match="hicache_size_gb"):
        CacheConfig(hicache_size_gb=-1)


@pytest.mark.skipif(available_host_memory_bytes() is None, reason="no /proc/meminfo here")
def test_l2_larger_than_the_free_host_memory_is_a_clear_error():
    free_gb = available_host_memory_bytes() / 1e9
    with pytest.raises(ValueError, match=r"host memory is available; lower hicache_ratio") as info:
        make_cache(page_size=PS, device_tokens=512, hicache_size_gb=free_gb * 4)
    assert "GB" in str(info.value)


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
