"""L1 -> L2 -> L3 -> (L1 and L2 dropped) -> prefetch -> load back gives bit-identical KV, per backend."""

import os
import subprocess
import sys
import textwrap
import uuid

import pytest
import torch

from tests.storage_util import (compute_and_insert, drop_l1_l2, fetch_and_load, make_cache, random_tokens,
                                storage_config)
from tierkv.hashing import HashNamespace
from tierkv.radix import RadixKey
from tierkv.storage.factory import open_store
from tierkv.storage.memory import MemoryStore

BACKENDS = ["memory", "file", "redis", "mooncake"]
# (attention, page_size, how L1/L2 are dropped, host layout): both attentions at both page sizes,
# both ways of dropping, every host layout (layer_first reads and writes through a staging copy).
CASES = [
    ("mha", 16, "evict", "layer_first"),
    ("mla", 16, "fresh", "page_first"),
    ("mha", 64, "fresh", "page_first_direct"),
    ("mla", 64, "evict", "page_first"),
]


@pytest.fixture
def store_opener(request, tmp_path):
    """``open(namespace, page_nbytes)`` for the backend named by the test's param: every call opens
    another client onto the same stored pages (as a restarted process would)."""
    backend = request.param
    if backend == "memory":
        blobs: dict = {}
        yield lambda ns, nbytes: MemoryStore(ns, nbytes, blobs=blobs)
    elif backend == "file":
        yield lambda ns, nbytes: open_store(f"file://{tmp_path}", ns, nbytes)
    elif backend == "redis":
        server = request.getfixturevalue("redis_server")
        prefix = f"rt-{uuid.uuid4().hex[:8]}:"
        yield lambda ns, nbytes: open_store(server.url, ns, nbytes, {"key_prefix": prefix})
    else:
        pytest.importorskip("tierkv.storage.mooncake_store")
        master = request.getfixturevalue("mooncake_master")
        # Objects live in the memory segment of the client that put them: closing the only client drops
        # them, so the "fresh cache" here shares one client whose close waits for the test's end.
        clients: dict = {}

        def open_shared(ns, nbytes):
            if (ns, nbytes) not in clients:
                store = open_store(master.url, ns, nbytes, master.client_config())
                clients[ns, nbytes] = (store, store.close)
                store.close = lambda: None
            return clients[ns, nbytes][0]

        yield open_shared
        for store, close in clients.values():
            store.clear()
            close()


def _attach(cache, opener, layout):
    ns = HashNamespace.for_spec("roundtrip-model", cache.device_pool.spec, layout)
    store = opener(ns.name(), cache.host_pool.page_nbytes)
    cache.attach_storage(store, storage_config(prefetch_stop_policy="wait_complete"), ns)
    return store


@pytest.mark.parametrize("store_opener", BACKENDS, indirect=True)
@pytest.mark.parametrize("attention, page_size, drop, layout", CASES)
def test_round_trip_is_bit_identical(store_opener, attention, page_size, drop, layout):
    num_tokens = 8 * page_size
    cache = make_cache(attention, page_size, device_tokens=2 * num_tokens, host_layout=layout)
    _attach(cache, store_opener, layout)
    key = RadixKey(random_tokens(num_tokens, seed=page_size))
    kv = compute_and_insert(cache, key, seed=3)
    cache.flush()
    assert cache.storage.stats.backed_up_tokens == num_tokens
    if drop == "evict":
        drop_l1_l2(cache)
    else:
        cache.close()
        cache = make_cache(attention, page_size, device_tokens=2 * num_tokens, host_layout=layout)
        _attach(cache, store_opener, layout)
    assert cache.match_prefix(key).host_hit_length == 0
    started, got = fetch_and_load(cache, key)
    assert started
    assert cache.stats.storage_hit_tokens == num_tokens
    assert torch.equal(got.view(torch.uint8), kv.view(torch.uint8))
    cache.check_integrity()
    cache.close()


@pytest.mark.parametrize("store_opener", ["memory", "file"], indirect=True)
def test_partial_prefix_in_store(store_opener):
    """A prompt longer than what L3 holds gets exactly the stored prefix."""
    cache = make_cache("mha", 16, host_layout="page_first")
    _attach(cache, store_opener, "page_first")
    stored = random_tokens(5 * 16, seed=21)
    kv = compute_and_insert(cache, RadixKey(stored), seed=22)
    drop_l1_l2(cache)
    longer = RadixKey(stored + random_tokens(4 * 16, seed=23))
    started, got = fetch_and_load(cache, longer)
    assert started and torch.equal(got, kv)
    cache.check_integrity()
    cache.close()


_RESTARTED = textwrap.dedent("""
    import sys, torch
    from tests.storage_util import make_cache, fetch_and_load, storage_config, random_tokens
    from tierkv.hashing import HashNamespace
    from tierkv.radix import RadixKey
    from tierkv.storage.factory import open_store
    cache = make_cache("mha", 16, host_layout="page_first")
    ns = HashNamespace.for_spec("roundtrip-model", cache.device_pool.spec, "page_first")
    store = open_store("file://" + sys.argv[1], ns.name(), cache.host_pool.page_nbytes)
    cache.attach_storage(store, storage_config(prefetch_stop_policy="wait_complete"), ns)
    started, got = fetch_and_load(cache, RadixKey(random_tokens(6 * 16, seed=31)))
    torch.save(got, sys.argv[2])
    cache.check_integrity()
    cache.close()
""")


def test_file_store_survives_process_restart(tmp_path):
    cache = make_cache("mha", 16, host_layout="page_first")
    ns = HashNamespace.for_spec("roundtrip-model", cache.device_pool.spec, "page_first")
    store = open_store(f"file://{tmp_path / 'pages'}", ns.name(), cache.host_pool.page_nbytes)
    cache.attach_storage(store, storage_config(), ns)
    kv = compute_and_insert(cache, RadixKey(random_tokens(6 * 16, seed=31)), seed=32)
    cache.close()
    out = tmp_path / "kv.pt"
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    subprocess.run([sys.executable, "-c", _RESTARTED, str(tmp_path / "pages"), str(out)], cwd=root,
                   check=True, timeout=120, env={**os.environ, "PYTHONPATH": root})
    assert torch.equal(torch.load(out), kv)
