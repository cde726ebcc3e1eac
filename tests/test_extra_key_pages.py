"""Every distinct extra key (None and "" included) gets its own L3 pages, on every backend.

The tree keeps keys with different extra keys apart; the page hash must too, or a tenant reads another
tenant's KV from L3. A tenant named like the namespace's own extra key must not collide either.
"""

import itertools

import pytest
import torch

from storage_util import compute_and_insert, drop_l1_l2, fetch_and_load, make_cache, random_tokens, storage_config
from test_storage_backends import backend, cached_stores  # noqa: F401  (the every-backend fixtures)
from tierkv.hashing import HashNamespace, page_hashes
from tierkv.radix import RadixKey

NAMESPACE_EXTRA_KEYS = ["", "tenant-a"]
REQUEST_EXTRA_KEYS = [None, "", "tenant-a", "None", "none", "'tenant-a'", "str:'tenant-a'", "tenant-a|x"]


def test_seeds_differ_for_every_pair_of_namespace_and_request_extra_key():
    pairs = list(itertools.product(["", "tenant-a", "None"], REQUEST_EXTRA_KEYS))
    seeds = {HashNamespace(model="m", extra_key=ns_extra).seed(extra) for ns_extra, extra in pairs}
    assert len(seeds) == len(pairs)
    tokens = list(range(32))
    keys = [page_hashes(tokens, 16, HashNamespace(model="m", extra_key=n).seed(e), HashNamespace(model="m"))
            for n, e in pairs]
    assert len({k for ks in keys for k in ks}) == 2 * len(pairs)


def test_namespace_fields_cannot_imitate_each_other():
    a = HashNamespace(model="m|extra=x", extra_key="")
    b = HashNamespace(model="m", extra_key="x|extra=")
    assert a.name() != b.name() and a.seed() != b.seed()


@pytest.mark.parametrize("namespace_extra_key", NAMESPACE_EXTRA_KEYS)
def test_every_extra_key_reads_back_its_own_kv(backend, namespace_extra_key):  # noqa: F811
    page_size, num_tokens = 16, 64
    cache = make_cache("mha", page_size, device_tokens=1024, host_layout="page_first")
    ns = HashNamespace.for_spec("extra-key-model", cache.device_pool.spec, "page_first",
                                extra_key=namespace_extra_key)
    store = backend.open(ns.name(), cache.host_pool.page_nbytes)
    cache.attach_storage(store, storage_config(prefetch_stop_policy="wait_complete"), ns)
    tokens = random_tokens(num_tokens, seed=41)
    kv = {}
    for i, extra_key in enumerate(REQUEST_EXTRA_KEYS):
        kv[extra_key] = compute_and_insert(cache, RadixKey(tokens, extra_key), seed=100 + i)
        cache.flush()
    assert cache.storage.stats.backed_up_tokens == num_tokens * len(REQUEST_EXTRA_KEYS)
    drop_l1_l2(cache)
    for i, extra_key in enumerate(REQUEST_EXTRA_KEYS):
        started, got = fetch_and_load(cache, RadixKey(tokens, extra_key), request_id=f"r{i}")
        assert started and got.shape[2] == num_tokens, extra_key
        assert torch.equal(got.view(torch.uint8), kv[extra_key].view(torch.uint8)), extra_key
    cache.check_integrity()
    cache.close()
