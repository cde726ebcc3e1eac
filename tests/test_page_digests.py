"""Host page digests (tierkv/pools/page_digests.py, tierkv/copy/_rowcopy_hash.c): the L1 -> L2 write hashes
each page it writes, a backup hands the digests to a store that takes them (Mooncake, Redis), and a digest
never outlives the bytes it describes. The store tests start a real mooncake_master and redis-server
(tests/conftest.py)."""

import os

import numpy as np
import pytest
import torch
import xxhash

from tests.pool_helpers import random_pools
from tests.storage_util import SPECS, compute_and_insert, drop_l1_l2, fetch_and_load, make_cache, storage_config
from tests.test_storage_backends import PAGE_NBYTES, empty_pages, make_keys, make_pages
from tests.test_storage_native import native_built  # noqa: F401 (autouse: skips without the module)
from tierkv.copy import cpu_copy
from tierkv.copy.transfer import TransferController
from tierkv.hashing import HashNamespace
from tierkv.pools.page_digests import PageDigests
from tierkv.pools.spec import KVSpec
from tierkv.radix import RadixKey
from tierkv.storage.factory import open_store
from tierkv.storage.memory import MemoryStore
from tierkv.storage.page_format import CHECKSUM_OFFSET

pytestmark = pytest.mark.skipif(not cpu_copy.native_hashing(), reason="needs the native copy and page I/O")


def page_checksums(host, pages) -> list[int]:
    """The xxhash package's xxh3-64 of each host page's bytes as they are now."""
    return [xxhash.xxh3_64_intdigest(host.read_page(p).numpy().tobytes()) for p in pages]


def written_pages(attention="mha", layout="page_first", page_size=16, num_pages=6, enable=True):
    """(transfer, device, host, host pages): ``num_pages`` random L1 pages written to L2 by the transfer
    controller, host digests on (``enable``)."""
    device, host = random_pools(SPECS[attention], layout, page_size)
    if enable and host.digests is not None:
        host.digests.enable()
    transfer = TransferController(device, host)
    host_slots = host.alloc(num_pages * page_size)
    assert transfer.write_now(torch.arange(num_pages * page_size), host_slots) is None
    return transfer, device, host, host.allocator.slots_to_pages(host_slots).tolist()


@pytest.mark.parametrize("attention, layout, page_size", [("mha", "page_first", 16), ("mla", "page_first", 4),
                                                          ("mha", "page_first_direct", 16),
                                                          ("mla", "page_first_direct", 1)])
def test_write_records_each_host_page_digest(attention, layout, page_size):
    """Token-row chunks (page_first) and whole-page chunks (page_first_direct): each page's digest is the
    xxhash package's xxh3 of the page's bytes, and the bytes are those of a plain copy."""
    transfer, device, host, pages = written_pages(attention, layout, page_size)
    assert host.digests.lookup(pages) == page_checksums(host, pages)
    _, plain_host = random_pools(SPECS[attention], layout, page_size, seed=1)
    cpu_copy.ChunkCopy(device, plain_host).copy_slots(torch.arange(6 * page_size), torch.arange(6 * page_size))
    assert all(torch.equal(host.read_page(p), plain_host.read_page(i)) for i, p in enumerate(pages))
    transfer.shutdown()


# (spec, page size): chunks of 64, 192, 1,152 (MLA's 576 bf16) and 32,768 bytes, all whole 64-byte stripes,
# in pages of 512, 384, 2,304 and 65,536 bytes (64 blocks): the one-pass copy's cases; and 32-byte chunks,
# which go chunk by chunk through the bound xxh3
ONE_PASS_CASES = [(KVSpec(num_layers=4, kv_heads=1, head_dim=32, dtype=torch.float16), 1),
                  (KVSpec(num_layers=1, kv_heads=3, head_dim=32, dtype=torch.float16), 1),
                  (KVSpec(num_layers=2, attention="mla", kv_lora_rank=512, rope_dim=64, dtype=torch.bfloat16), 1),
                  (KVSpec(num_layers=1, kv_heads=8, head_dim=128, dtype=torch.float16), 16),
                  (KVSpec(num_layers=3, kv_heads=1, head_dim=16, dtype=torch.float16), 1)]


def check_one_pass_digests() -> None:
    """For each case: host pages written (shuffled) by the hashed copy carry the xxhash package's digest of
    their bytes, and those bytes are a plain copy's."""
    for spec, page_size in ONE_PASS_CASES:
        device, host = random_pools(spec, "page_first", page_size, device_pages=8, host_pages=8)
        host.digests.enable()
        transfer = TransferController(device, host)
        order = torch.tensor([5, 2, 7, 0, 3, 6, 1, 4])
        host_slots = (order[:, None] * page_size + torch.arange(page_size)).reshape(-1)
        assert host.alloc(8 * page_size) is not None
        assert transfer.write_now(torch.arange(8 * page_size), host_slots) is None
        pages = order.tolist()
        assert host.digests.lookup(pages) == page_checksums(host, pages), (spec, page_size)
        _, plain = random_pools(spec, "page_first", page_size, device_pages=8, host_pages=8, seed=1)
        cpu_copy.ChunkCopy(device, plain).copy_slots(torch.arange(8 * page_size), host_slots)
        assert torch.equal(host.buffer.view(torch.uint8), plain.buffer.view(torch.uint8)), (spec, page_size)
        transfer.shutdown()


def test_the_one_pass_hashed_copy_digests_every_chunk_shape():
    check_one_pass_digests()


def test_the_portable_one_pass_hashed_copy_digests_every_chunk_shape():
    """The path for CPUs without AVX2, forced by TIERKV_XXH3_COPY_SCALAR=1 in a fresh process."""
    import subprocess
    import sys
    code = "from tests.test_page_digests import check_one_pass_digests; check_one_pass_digests(); print('ok')"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "TIERKV_XXH3_COPY_SCALAR": "1"})
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]


def test_writes_run_by_the_worker_record_digests_too():
    """A write over the inline limit goes to the transfer worker: its digests land by its ack."""
    device, host = random_pools(SPECS["mha"], "page_first", 16, device_pages=64, host_pages=96)
    host.digests.enable()
    transfer = TransferController(device, host)
    host_slots = host.alloc(64 * 16)
    handle = transfer.write(torch.arange(64 * 16), host_slots)
    assert handle.wait() and handle.error is None
    pages = host.allocator.slots_to_pages(host_slots).tolist()
    assert host.digests.lookup(pages) == page_checksums(host, pages)
    transfer.shutdown()


def test_no_digests_before_enable_nor_in_a_layer_first_pool():
    transfer, _, host, pages = written_pages(enable=False)
    assert host.digests.lookup(pages) == [None] * len(pages)
    transfer.shutdown()
    transfer, _, host, _ = written_pages(layout="layer_first")
    assert host.digests is None
    transfer.shutdown()


def test_a_rewritten_page_never_keeps_its_old_digest():
    """Every way a host page gets new bytes clears or renews its digest: write_page, scatter_pages (and so
    write_tokens), a free and a new allocation, and a second hashed write of other KV (new digest)."""
    transfer, device, host, pages = written_pages(num_pages=8)
    old = host.digests.lookup(pages)
    host.write_page(pages[0], host.read_page(pages[1]).clone())
    host.scatter_pages(torch.tensor(pages[2:3]), host.gather_pages(torch.tensor(pages[3:4])))
    assert host.digests.lookup(pages[:4]) == [None, old[1], None, old[3]]
    host.free(host.allocator.pages_to_slots(torch.tensor(pages[4:6])))
    everything_free = host.allocator.slots_to_pages(host.alloc(host.num_free_slots)).tolist()
    assert set(pages[4:6]) <= set(everything_free) and host.digests.lookup(pages[4:6]) == [None, None]
    device.buffer.view(torch.uint8).bitwise_not_()  # other KV, written over pages[6:8]
    assert transfer.write_now(torch.arange(2 * 16), host.allocator.pages_to_slots(torch.tensor(pages[6:8]))) is None
    new = host.digests.lookup(pages[6:8])
    assert new == page_checksums(host, pages[6:8]) and new != old[6:8]
    transfer.shutdown()


def test_a_write_that_cannot_hash_clears_the_digests():
    """The direct io backend copies page by page without the native copy: the digests it would leave
    behind describe the old bytes, so it clears them."""
    transfer, device, host, pages = written_pages(layout="page_first_direct")
    direct = TransferController(device, host, io_backend="direct")
    device.buffer.view(torch.uint8).bitwise_not_()
    assert direct.write_now(torch.arange(2 * 16), host.allocator.pages_to_slots(torch.tensor(pages[:2]))) is None
    assert host.digests.lookup(pages[:3])[:2] == [None, None]
    assert host.digests.lookup(pages[2:]) == page_checksums(host, pages[2:])
    transfer.shutdown()
    direct.shutdown()


def test_the_native_copy_refuses_to_hash_what_it_cannot_describe():
    """No table, or a destination whose page is not written whole and in order (layer_first): a ValueError
    before any byte moves; a table of the wrong size is refused when the copier is made."""
    device, host = random_pools(SPECS["mha"], "page_first", 16)
    plain = cpu_copy.ChunkCopy(device, host)
    assert not plain.hashes_pages
    with pytest.raises(ValueError, match="no digest table"):
        plain.copy_slots(torch.arange(16), torch.arange(16), False, True)
    _, layer_first = random_pools(SPECS["mha"], "layer_first", 16)
    split = cpu_copy.ChunkCopy(device, layer_first, digests=PageDigests(layer_first.num_pages, 16))
    before = layer_first.buffer.clone()
    assert not split.hashes_pages
    with pytest.raises(ValueError, match="not written whole and in order"):
        split.copy_slots(torch.arange(16), torch.arange(16), False, True)
    assert torch.equal(layer_first.buffer.view(torch.uint8), before.view(torch.uint8))
    with pytest.raises(ValueError, match="digest table"):
        cpu_copy.ChunkCopy(device, host, digests=PageDigests(host.num_pages - 1, 16)).hashes_pages


class DigestTakingStore(MemoryStore):
    """A memory store that takes digests and records what each batch_set was handed."""

    accepts_digests = True

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.handed: list = []

    def batch_set(self, keys, values, digests=None):
        self.handed.append((digests, [xxhash.xxh3_64_intdigest(v.numpy().tobytes()) for v in values]))
        return super().batch_set(keys, values)


def test_backup_turns_digests_on_and_hands_them_over():
    """The first backup to a store that takes digests turns them on (its own pages were written before:
    None); a later node's pages, written by the hashed copy, are handed over with their digests."""
    cache = make_cache("mha", 16, host_layout="page_first")
    store = DigestTakingStore("digest-ns", cache.host_pool.page_nbytes)
    cache.attach_storage(store, storage_config(), "digest-model")
    compute_and_insert(cache, RadixKey(list(range(3 * 16))), seed=1)
    cache.flush()
    assert cache.host_pool.digests.enabled and [handed for handed, _ in store.handed] == [[None] * 3]
    compute_and_insert(cache, RadixKey(list(range(1000, 1000 + 2 * 16))), seed=2)
    cache.flush()
    assert len(store.handed) == 2
    handed, checksums = store.handed[1]
    assert handed == checksums and len(handed) == 2
    cache.close()


class DigestStore:
    """A store that takes digests (Mooncake, Redis) on its real server: opens stores, reads a stored
    header's checksum, and counts the pages the store hashes itself."""

    def __init__(self, name: str, server) -> None:
        self.name, self.server = name, server

    def open(self, namespace: str, page_nbytes: int = PAGE_NBYTES, **options):
        if self.name == "mooncake":
            return open_store(self.server.url, namespace, page_nbytes, {**self.server.client_config(), **options})
        return open_store(self.server.url, namespace, page_nbytes, {"key_prefix": f"digests{os.getpid()}:", **options})

    def stored_checksum(self, store, key: str) -> int:
        """The checksum field of ``key``'s stored header."""
        if self.name == "mooncake":
            blob = torch.zeros(store.format.blob_nbytes, dtype=torch.uint8)
            assert store.client.get_into(store.object_key(key), blob.data_ptr(), blob.numel()) == blob.numel()
            header = blob[store.page_nbytes:].numpy()
        else:
            header = np.frombuffer(store.client.get(store.redis_key(key))[store.page_nbytes:], np.uint8)
        return int(header[CHECKSUM_OFFSET:CHECKSUM_OFFSET + 8].view("<u8")[0])

    def counting_hashes(self, store) -> list:
        """Patch ``store`` so that each batch it hashes itself appends its number of pages (Mooncake: a
        native xxh3_many call) or each page it hashes appends 1 (Redis: a header or a streamed hasher)."""
        counts: list = []
        if self.name == "mooncake":
            real = store._native

            class CountingNative:
                def __getattr__(self, name):
                    return getattr(real, name)

                def xxh3_many(self, views):
                    counts.append(len(views))
                    return real.xxh3_many(views)
            store._native = CountingNative()
            return counts
        fmt = store.format

        class CountingFormat:
            def __getattr__(self, name):
                return getattr(fmt, name)

            def header(self, key, payload, state=None):
                counts.append(1) if state is None else None
                return fmt.header(key, payload, state)

            def payload_hasher(self, key):
                counts.append(1)
                return fmt.payload_hasher(key)
        store.format = CountingFormat()
        return counts


@pytest.fixture(params=["mooncake", "redis"])
def digest_store(request) -> DigestStore:
    server = request.getfixturevalue("mooncake_master" if request.param == "mooncake" else "redis_server")
    return DigestStore(request.param, server)


@pytest.mark.parametrize("page_nbytes", [PAGE_NBYTES, 1 << 20])
def test_a_store_hashes_only_the_pages_given_no_digest(digest_store, page_nbytes):
    """Redis pages of 1 MiB are otherwise streamed in chunks hashed as they are sent."""
    store = digest_store.open("ns-digests-some", page_nbytes)
    try:
        assert store.accepts_digests
        keys = make_keys(6)
        g = torch.Generator().manual_seed(1)
        pages = [torch.randint(0, 256, (page_nbytes,), dtype=torch.uint8, generator=g) for _ in keys]
        digests = [xxhash.xxh3_64_intdigest(p.numpy().tobytes()) for p in pages]
        counts = digest_store.counting_hashes(store)
        assert store.batch_set(keys, pages, digests=digests[:2] + [None] + digests[3:]) == [True] * 6
        assert sum(counts) == 1
        targets = [torch.zeros(page_nbytes, dtype=torch.uint8) for _ in keys]
        assert store.batch_get(keys, targets) == [True] * 6
        assert all(torch.equal(t, p) for t, p in zip(targets, pages))
        assert [digest_store.stored_checksum(store, k) for k in keys] == digests
        with pytest.raises(ValueError, match="6 keys but 5 digests"):
            store.batch_set(keys, pages, digests=digests[:5])
    finally:
        store.clear()
        store.close()


def test_a_page_under_a_wrong_digest_is_a_miss(digest_store):
    """A digest that does not describe its page (planted, or stale) makes a stored page that fails
    verification: a counted miss, dropped, never KV read back as a hit (Mooncake: through the transfer
    engine and through the in-place copy)."""
    store = digest_store.open("ns-digests-wrong")
    try:
        keys, pages = make_keys(4), make_pages(4)
        digests = [xxhash.xxh3_64_intdigest(p.numpy().tobytes()) for p in pages]
        digests[2] ^= 1
        assert store.batch_set(keys, pages, digests=digests) == [True] * 4
        store.read_in_place = False  # Mooncake: through the transfer engine first
        assert store.batch_get(keys, empty_pages(4)) == [True, True, False, True]
        assert store.stats.corrupt_pages == 1 and store.batch_exists(keys[2:3]) == 0
        assert store.batch_set(keys[2:3], pages[2:3], digests=digests[2:3]) == [True]
        store.read_in_place = True
        assert store.batch_get(keys, empty_pages(4)) == [True, True, False, True]
        assert store.stats.corrupt_pages == 2
    finally:
        store.clear()
        store.close()


def test_a_store_with_a_page_key_ignores_digests(digest_store):
    """A keyed store writes MACs, which no copy computes: it takes no digests and ignores any given."""
    store = digest_store.open("ns-digests-keyed", page_key="k" * 32)
    try:
        assert not store.accepts_digests
        keys, pages = make_keys(3), make_pages(3)
        assert store.batch_set(keys, pages, digests=[1, 2, 3]) == [True] * 3
        targets = empty_pages(3)
        assert store.batch_get(keys, targets) == [True] * 3
        assert all(torch.equal(t, p) for t, p in zip(targets, pages))
    finally:
        store.clear()
        store.close()


def test_a_store_never_stores_a_rewritten_host_page_under_its_old_digest(digest_store):
    """Host pages written by the hashed copy, then one rewritten by write_page and one freed and filled
    again through the pool's rows (as a prefetch does): a backup of all of them hashes those two itself,
    and every stored checksum is that of the bytes stored."""
    transfer, _, host, pages = written_pages(num_pages=4)
    store = digest_store.open("ns-digests-rewritten", host.page_nbytes)
    try:
        host.write_page(pages[0], torch.randint(0, 256, (host.page_nbytes,), dtype=torch.uint8))
        host.free(host.allocator.pages_to_slots(torch.tensor(pages[1:2])))
        assert pages[1] in host.allocator.slots_to_pages(host.alloc(host.num_free_slots)).tolist()
        host.page_bytes_array()[pages[1]] = 7
        keys = make_keys(4, seed=5)
        counts = digest_store.counting_hashes(store)
        assert store.batch_set_rows(keys, host.page_bytes_array(), pages,
                                    digests=host.digests.lookup(pages)) == [True] * 4
        assert sum(counts) == 2
        assert [digest_store.stored_checksum(store, k) for k in keys] == page_checksums(host, pages)
    finally:
        store.clear()
        store.close()
        transfer.shutdown()


@pytest.mark.parametrize("layout", ["page_first", "page_first_direct"])
def test_cache_backs_up_with_copy_digests_and_reads_back(digest_store, layout):
    """The product path: L1 -> L2 writes hash, backups hand the digests to the store, which hashes
    nothing; with L1 and L2 dropped the pages come back from L3 bit-identical."""
    cache = make_cache("mha", 16, device_tokens=256, host_layout=layout)
    ns = HashNamespace.for_spec("digest-model", cache.device_pool.spec, layout)
    store = digest_store.open(ns.name(), cache.host_pool.page_nbytes)
    cache.attach_storage(store, storage_config(prefetch_stop_policy="wait_complete"), ns)
    try:
        cache.host_pool.digests.enable()  # as the first backup would: every write below hashes
        counts = digest_store.counting_hashes(store)
        key = RadixKey(list(range(7 * 16)))
        kv = compute_and_insert(cache, key, seed=9)
        cache.flush()
        assert cache.storage.stats.backed_up_tokens == 7 * 16 and counts == []
        drop_l1_l2(cache)
        started, got = fetch_and_load(cache, key)
        assert started and torch.equal(got.view(torch.uint8), kv.view(torch.uint8))
        assert store.stats.corrupt_pages == 0
        cache.check_integrity()
    finally:
        store.clear()
        cache.close()
