"""One suite, every backend: each test runs against memory, file, redis and mooncake (when runnable)."""

import errno
import os
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
import torch

from tierkv.hashing import HashNamespace, page_hashes
from tierkv.pools.kv import HostKVPool
from tierkv.pools.spec import KVSpec
from tierkv.storage import native
from tierkv.storage.base import PageStore, StoreStats
from tierkv.storage.factory import open_store
from tierkv.storage.file import GROUP_NBYTES
from tierkv.storage.file_pack import pack_name
from tierkv.storage.page_format import HEADER_SIZE

PAGE_NBYTES = 3000  # deliberately not a power of two
# file-python: the file store's Python I/O loop (keyed stores and builds without tierkv._pageio use it);
# file-threads: the native reads spread over several threads whatever the batch's size
# redis-streamed: every page streamed in small chunks, each hashed as it is sent (8 MiB pages' path)
BACKENDS = ["memory", "file", "file-python", "file-threads", "redis", "redis-streamed", "mooncake"]


def make_keys(num_pages: int, model: str = "m", seed: int = 0) -> list[str]:
    tokens = [seed * 1_000_003 + t for t in range(4 * num_pages)]
    return page_hashes(tokens, 4, None, HashNamespace(model=model))


def make_pages(num_pages: int, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (PAGE_NBYTES,), dtype=torch.uint8, generator=g) for _ in range(num_pages)]


def empty_pages(num_pages: int) -> list[torch.Tensor]:
    return [torch.zeros(PAGE_NBYTES, dtype=torch.uint8) for _ in range(num_pages)]


def corrupt_mooncake_page(store, key: str, offset: int) -> None:
    """Flip the byte at ``offset`` of ``key``'s stored blob (payload, then the header as a trailer)."""
    name, client = store.object_key(key), store.client
    blob = torch.zeros(store.format.blob_nbytes, dtype=torch.uint8)
    assert client.get_into(name, blob.data_ptr(), blob.numel()) == blob.numel()
    blob[offset] ^= 0xFF
    assert client.upsert_from(name, blob.data_ptr(), blob.numel()) == 0


class Backend:
    """How the suite opens and tampers with one backend's stores."""

    def __init__(self, name: str, request, tmp_path, cached: dict) -> None:
        self.name = name
        self.tmp_path = tmp_path
        self.stores: list[PageStore] = []
        self.server = None
        if name.startswith("redis"):
            self.server = request.getfixturevalue("redis_server")
        elif name == "mooncake":
            self.server = request.getfixturevalue("mooncake_master")
        self.shared_blobs: dict = {}
        self.cached = cached

    def open(self, namespace: str = "ns-a", page_nbytes: int = PAGE_NBYTES, **extra) -> PageStore:
        """A store of this backend; ``extra`` are more backend keys (``page_key``, ``max_bytes``)."""
        if self.name == "memory":
            from tierkv.storage.memory import MemoryStore
            store = MemoryStore(namespace, page_nbytes, blobs=self.shared_blobs, **extra)
        elif self.name.startswith("file"):
            store = open_store(f"file://{self.tmp_path}/l3", namespace, page_nbytes, extra)
            if self.name == "file-python":
                store._native = None
            elif self.name == "file-threads":
                store.read_threads, store.parallel_read_min_nbytes = 3, 0
                store.write_threads, store.parallel_write_min_nbytes = 3, 0
        elif self.name.startswith("redis"):
            store = open_store(self.server.url, namespace, page_nbytes,
                               {"key_prefix": f"t{os.getpid()}:", "timeout_s": 1.0, "retry_backoff_s": 0.05,
                                **extra})
            if self.name == "redis-streamed":
                store.stream_min_nbytes, store.stream_chunk_nbytes = 0, 1024
        else:
            # A Mooncake client takes ~2 s to close (segment unmount): reuse one per namespace.
            cache_key = (namespace, page_nbytes, tuple(sorted(extra.items())))
            if cache_key not in self.cached:
                self.cached[cache_key] = open_store(
                    self.server.url, namespace, page_nbytes, {**self.server.client_config(), **extra})
            store = self.cached[cache_key]
            store.stats = StoreStats()
        self.stores.append(store)
        return store

    def corrupt(self, store: PageStore, key: str, offset: int) -> None:
        """Flip one stored byte at ``offset`` of the blob (payload, then the header as a trailer)."""
        if self.name == "memory":
            store.blobs[store._slot(key)][offset] ^= 0xFF
        elif self.name.startswith("file"):
            path, payload_at, header_at = store.page_extent(key)  # a page's payload and header lie apart
            offset = payload_at + offset if offset < store.page_nbytes else header_at + offset - store.page_nbytes
            with open(path, "r+b") as f:
                f.seek(offset)
                byte = f.read(1)
                f.seek(offset)
                f.write(bytes([byte[0] ^ 0xFF]))
        elif self.name.startswith("redis"):
            import redis
            client = redis.Redis(port=self.server.port)
            name = store.redis_key(key)
            blob = bytearray(client.get(name))
            blob[offset] ^= 0xFF
            client.set(name, bytes(blob))
            client.close()
        else:
            corrupt_mooncake_page(store, key, offset)

    def close(self) -> None:
        for store in self.stores:
            store.clear()
            if store not in self.cached.values():
                store.close()


@pytest.fixture(scope="module")
def cached_stores():
    stores: dict = {}
    yield stores
    for store in stores.values():
        store.close()


@pytest.fixture(params=BACKENDS)
def backend(request, tmp_path, cached_stores):
    b = Backend(request.param, request, tmp_path, cached_stores)
    yield b
    b.close()


@pytest.mark.parametrize("num_pages", [1, 21], ids=["one", "several-pipelined-rounds"])
def test_round_trip_is_bit_exact(backend, num_pages):
    store = backend.open()
    keys, pages = make_keys(num_pages), make_pages(num_pages)
    assert store.batch_set(keys, pages) == [True] * num_pages
    targets = empty_pages(num_pages)
    assert store.batch_get(keys, targets) == [True] * num_pages
    assert all(torch.equal(t, p) for t, p in zip(targets, pages))
    assert store.stats.set_pages == num_pages and store.stats.get_pages == num_pages
    assert store.stats.get_bytes == num_pages * PAGE_NBYTES and store.stats.corrupt_pages == 0
    assert store.stats.get_seconds > 0 and store.stats.set_seconds > 0


@pytest.mark.parametrize("layout", ["page_first", "page_first_direct"])
def test_host_pool_pages_round_trip_through_their_views(backend, layout):
    spec = KVSpec(num_layers=3, kv_heads=2, head_dim=8, dtype=torch.bfloat16)
    source, sink = (HostKVPool(spec, 64, 16, layout=layout, pin_memory=False) for _ in range(2))
    source.buffer.copy_(torch.randn(source.buffer.shape).to(torch.bfloat16))
    store = backend.open(page_nbytes=source.page_nbytes)
    store.register_host_buffer(sink.buffer)
    keys = make_keys(source.num_pages)
    assert all(store.batch_set(keys, [source.page_bytes(p) for p in range(source.num_pages)]))
    assert all(store.batch_get(keys, [sink.page_bytes(p) for p in range(sink.num_pages)]))
    assert torch.equal(sink.buffer.view(torch.uint8), source.buffer.view(torch.uint8))


@pytest.mark.parametrize("layout", ["page_first", "page_first_direct"])
@pytest.mark.parametrize("page_key", [None, "k" * 20], ids=["checksum", "mac"])
def test_pool_rows_round_trip_shuffled_and_match_the_tensor_path(backend, layout, page_key):
    # batch_set_rows / batch_get_rows (the cache's backups and prefetches on page-first pools) store the
    # same blobs as batch_set / batch_get of the same pages: either path reads what the other wrote.
    spec = KVSpec(num_layers=3, kv_heads=2, head_dim=8, dtype=torch.bfloat16)
    source, sink = (HostKVPool(spec, 128, 16, layout=layout, pin_memory=False) for _ in range(2))
    source.buffer.copy_(torch.randn(source.buffer.shape).to(torch.bfloat16))
    store = backend.open(page_nbytes=source.page_nbytes, **({"page_key": page_key} if page_key else {}))
    keys = make_keys(source.num_pages)
    order = torch.randperm(source.num_pages, generator=torch.Generator().manual_seed(3)).tolist()
    half = len(keys) // 2
    assert store.batch_set_rows(keys[:half], source.page_bytes_array(), order[:half]) == [True] * half
    assert store.batch_set(keys[half:], [source.page_bytes(p) for p in order[half:]]) == [True] * (len(keys) - half)
    assert store.batch_get_rows(keys, sink.page_bytes_array(), order) == [True] * len(keys)
    assert torch.equal(sink.buffer.view(torch.uint8), source.buffer.view(torch.uint8))
    targets = [torch.zeros(source.page_nbytes, dtype=torch.uint8) for _ in keys[:half]]
    assert store.batch_get(keys[:half], targets) == [True] * half
    assert all(torch.equal(t, source.page_bytes(p)) for t, p in zip(targets, order[:half]))
    assert store.stats.set_pages == len(keys) and store.stats.corrupt_pages == 0


def test_bad_page_rows_are_refused_naming_the_value_and_nothing_is_written(backend):
    spec = KVSpec(num_layers=1, kv_heads=1, head_dim=8, dtype=torch.bfloat16)
    pool = HostKVPool(spec, 64, 16, layout="page_first", pin_memory=False)
    store = backend.open(page_nbytes=pool.page_nbytes)
    rows, keys = pool.page_bytes_array(), make_keys(2)
    cases = [(rows, [0, pool.num_pages], "page row 4 is outside the 4 rows"),
             (rows, [-1, 0], "page row -1"),
             (rows, [0], "2 keys need as many integer page rows"),
             (rows, [0.0, 1.0], "integer page rows"),
             (rows[:, :-1], [0, 1], f"C-contiguous 2-D uint8 array of {pool.page_nbytes}-byte rows"),
             (rows.view("<u2"), [0, 1], "uint16"),
             (rows[::2], [0, 1], "C-contiguous"),
             (torch.from_numpy(rows), [0, 1], "got Tensor")]
    for bad_rows, pages, message in cases:
        with pytest.raises(ValueError, match=message):
            store.batch_set_rows(keys, bad_rows, pages)
        with pytest.raises(ValueError, match=message):
            store.batch_get_rows(keys, rows if bad_rows is rows else bad_rows, pages)
    with pytest.raises(ValueError, match="page key"):
        store.batch_set_rows([keys[0], "x"], rows, [0, 1])
    assert store.batch_exists(keys) == 0 and store.stats.set_pages == 0


@pytest.mark.parametrize("store_class", ["file", "memory"])
def test_a_subclass_or_wrapper_that_intercepts_batch_set_and_get_sees_the_pool_rows_too(tmp_path, store_class):
    # The file and memory stores take pool rows in place; a subclass overriding batch_set/get (and a
    # wrapper delegating by attribute, which the cache hands no rows) must still see every page.
    from tierkv.storage.base import takes_rows
    from tierkv.storage.file import FileStore
    from tierkv.storage.memory import MemoryStore
    base = FileStore if store_class == "file" else MemoryStore

    class Counting(base):
        pages_set = pages_got = 0

        def batch_set(self, keys, values):
            self.pages_set += len(keys)
            return super().batch_set(keys, values)

        def batch_get(self, keys, targets):
            self.pages_got += len(keys)
            return super().batch_get(keys, targets)

    spec = KVSpec(num_layers=1, kv_heads=1, head_dim=8, dtype=torch.bfloat16)
    pool = HostKVPool(spec, 64, 16, layout="page_first", pin_memory=False)
    pool.buffer.copy_(torch.randn(pool.buffer.shape).to(torch.bfloat16))
    extra = {"root": str(tmp_path)} if store_class == "file" else {}
    store, keys = Counting("ns", pool.page_nbytes, **extra), make_keys(3)
    assert store.batch_set_rows(keys, pool.page_bytes_array(), [2, 0, 3]) == [True] * 3 and store.pages_set == 3
    assert store.batch_get_rows(keys, pool.page_bytes_array(), [2, 0, 3]) == [True] * 3 and store.pages_got == 3

    class Delegating:
        def __init__(self, inner):
            self.inner = inner

        def __getattr__(self, name):
            return getattr(self.inner, name)
    assert takes_rows(store) and not takes_rows(Delegating(store))
    store.close()


def test_redis_takes_pool_rows_in_place_digests_included_and_a_subclass_still_sees_every_page(redis_server,
                                                                                              monkeypatch):
    """Redis backups and prefetches on a page-first pool: rows sent from and read into the pool in place (no
    tensor, no checked view a page), the copy's digests used; a subclass overriding batch_set and batch_get
    still gets every page through them."""
    import xxhash

    from tierkv.storage.redis_store import RedisStore

    spec = KVSpec(num_layers=1, kv_heads=1, head_dim=8, dtype=torch.bfloat16)
    pool = HostKVPool(spec, 64, 16, layout="page_first", pin_memory=False)
    pool.buffer.copy_(torch.randn(pool.buffer.shape).to(torch.bfloat16))
    rows, keys, order = pool.page_bytes_array(), make_keys(3, seed=7), [2, 0, 3]
    digests = [xxhash.xxh3_64_intdigest(rows[p].tobytes()) for p in order]
    config = {"key_prefix": f"rows{os.getpid()}:"}
    store = open_store(redis_server.url, "ns-rows", pool.page_nbytes, config)

    def no_tensor_path(*args):
        raise AssertionError("a tensor a page")
    monkeypatch.setattr(RedisStore, "_check_batch", no_tensor_path)
    digests[1] ^= 1  # stored under a wrong checksum: read back as a miss
    assert store.batch_set_rows(keys, rows, order, digests=digests) == [True] * 3
    sink = np.zeros_like(rows)
    assert store.batch_get_rows(keys, sink, order) == [True, False, True]
    assert np.array_equal(sink[[2, 3]], rows[[2, 3]]) and not sink[1].any()  # row 0: the miss's, unused
    with pytest.raises(ValueError, match="3 keys but 2 digests"):
        store.batch_set_rows(keys, rows, order, digests=digests[:2])
    store.clear()
    monkeypatch.undo()

    class Counting(RedisStore):
        pages_set = pages_got = 0

        def batch_set(self, keys, values, digests=None):
            self.pages_set += len(keys)
            return super().batch_set(keys, values, digests)

        def batch_get(self, keys, targets):
            self.pages_got += len(keys)
            return super().batch_get(keys, targets)
    counting = Counting("ns-rows", pool.page_nbytes, port=redis_server.port, **config)
    assert counting.batch_set_rows(keys, rows, order) == [True] * 3 and counting.pages_set == 3
    assert counting.batch_get_rows(keys, sink, order) == [True] * 3 and counting.pages_got == 3
    counting.clear()
    store.close()
    counting.close()


def test_exists_is_the_leading_run(backend):
    store = backend.open()
    keys, pages = make_keys(6), make_pages(6)
    assert store.batch_exists(keys) == 0
    store.batch_set(keys[:2] + keys[3:], pages[:2] + pages[3:])
    assert store.batch_exists(keys) == 2
    assert store.batch_exists(keys[3:]) == 3
    assert store.batch_exists([]) == 0


def test_missing_pages_are_false_and_others_still_read(backend):
    store = backend.open()
    keys, pages = make_keys(4), make_pages(4)
    store.batch_set([keys[0], keys[2]], [pages[0], pages[2]])
    targets = empty_pages(4)
    assert store.batch_get(keys, targets) == [True, False, True, False]
    assert torch.equal(targets[0], pages[0]) and torch.equal(targets[2], pages[2])
    assert store.stats.corrupt_pages == 0


def test_overwrite_replaces_the_page_or_keeps_the_first(backend):
    store = backend.open()
    key, (old, new) = make_keys(1), make_pages(2)
    store.batch_set(key, [old])
    assert store.batch_set(key, [new]) == [True]
    target = empty_pages(1)
    assert store.batch_get(key, target) == [True]
    # Mooncake objects are put-if-absent (a key names immutable content); the others overwrite.
    assert torch.equal(target[0], old if backend.name == "mooncake" else new)


def test_clear_removes_only_this_namespace(backend):
    a, b = backend.open("ns-a"), backend.open("ns-b")
    keys, pages = make_keys(3), make_pages(3)
    a.batch_set(keys, pages)
    b.batch_set(keys, pages)
    a.clear()
    assert a.batch_exists(keys) == 0 and a.batch_get(keys, empty_pages(3)) == [False] * 3
    assert b.batch_exists(keys) == 3


def test_a_page_of_namespace_a_is_a_miss_under_b(backend):
    a, b = backend.open("ns-a"), backend.open("ns-b")
    keys, pages = make_keys(2), make_pages(2)
    a.batch_set(keys, pages)
    assert b.batch_exists(keys) == 0
    assert b.batch_get(keys, empty_pages(2)) == [False, False]


@pytest.mark.parametrize("offset", [17, PAGE_NBYTES + 30], ids=["payload", "header"])
def test_corrupt_page_is_a_counted_miss(backend, offset):
    store = backend.open()
    keys, pages = make_keys(3), make_pages(3)
    store.batch_set(keys, pages)
    backend.corrupt(store, keys[1], offset)
    targets = empty_pages(3)
    assert store.batch_get(keys, targets) == [True, False, True]
    assert torch.equal(targets[2], pages[2])
    assert store.stats.corrupt_pages == 1 and store.stats.get_pages == 2
    # Removed, so a later backup (which skips pages that exist) can write it again.
    assert store.batch_exists(keys) == 1
    assert store.batch_set(keys[1:2], pages[1:2]) == [True]
    assert store.batch_get(keys, targets) == [True] * 3 and torch.equal(targets[1], pages[1])


@pytest.mark.parametrize("overlapped", [True, False], ids=["helper-threads", "in-place"])
def test_batches_of_several_helper_groups_round_trip_and_catch_corruption(backend, overlapped, monkeypatch):
    """Big batches hash and verify in the store's helper threads (tierkv.storage.overlap; small pages in
    place): the same verdicts as one page at a time, and a closed store leaves no helper thread behind."""
    from tierkv.storage import mooncake_store, overlap
    from tierkv.storage.overlap import pages_per_group
    monkeypatch.setattr(overlap, "MIN_OVERLAP_PAGE_NBYTES", 0 if overlapped else 1 << 40)
    monkeypatch.setattr(mooncake_store, "RANGE_NBYTES", 4 * PAGE_NBYTES if overlapped else 1 << 40)
    threads_before = set(threading.enumerate())
    store = backend.open()
    num_pages = 2 * pages_per_group(PAGE_NBYTES) + 5
    keys, pages = make_keys(num_pages), make_pages(num_pages)
    assert store.batch_set(keys, pages) == [True] * num_pages
    bad = [3, num_pages - 2]
    for i in bad:
        backend.corrupt(store, keys[i], 5)
    targets = empty_pages(num_pages)
    assert store.batch_get(keys, targets) == [i not in bad for i in range(num_pages)]
    assert all(torch.equal(targets[i], pages[i]) for i in range(num_pages) if i not in bad)
    assert store.stats.corrupt_pages == len(bad) and store.stats.get_pages == num_pages - len(bad)
    if backend.name != "mooncake":  # mooncake clients are shared across tests and closed at the end
        store.close()
        left = [t.name for t in set(threading.enumerate()) - threads_before if t.name.startswith("tierkv-")]
        assert not left, left


def test_malformed_keys_and_tensors_are_refused(backend):
    store = backend.open()
    for bad in ["../../etc/passwd", "ABCDEF0123456789", "0123", "/abs", "ab" * 70, 12345]:
        with pytest.raises(ValueError):
            store.batch_set([bad], make_pages(1))
        with pytest.raises(ValueError):
            store.batch_exists([bad])
    with pytest.raises(ValueError, match="bytes"):
        store.batch_set(make_keys(1), [torch.zeros(PAGE_NBYTES + 1, dtype=torch.uint8)])
    with pytest.raises(ValueError, match="uint8"):
        store.batch_get(make_keys(1), [torch.zeros(PAGE_NBYTES, dtype=torch.float32)])


def test_a_bad_key_anywhere_in_a_batch_refuses_the_whole_batch(backend):
    store = backend.open()
    good = make_keys(3)
    for bad in ["\u00e9" * 20, "ab" * 7, "AB" * 10, b"ab" * 10, None]:
        with pytest.raises(ValueError, match="page key"):
            store.batch_set([*good, bad], make_pages(4))
        with pytest.raises(ValueError, match="page key"):
            store.batch_get([good[0], bad], empty_pages(2))
    assert store.batch_exists(good) == 0  # nothing of a refused batch was written


def test_non_contiguous_and_off_cpu_tensors_are_refused(backend):
    store = backend.open()
    strided = torch.zeros(2 * PAGE_NBYTES, dtype=torch.uint8)[::2]
    for bad in [strided, torch.zeros(PAGE_NBYTES, dtype=torch.uint8, device="meta"),
                torch.zeros(PAGE_NBYTES, dtype=torch.int8)]:
        with pytest.raises(ValueError, match="contiguous uint8 on cpu"):
            store.batch_set(make_keys(1), [bad])
    with pytest.raises(TypeError, match="torch.Tensor, got ndarray"):  # was an AttributeError
        store.batch_set(make_keys(1), [make_pages(1)[0].numpy()])
    assert store.batch_exists(make_keys(1)) == 0


@pytest.mark.parametrize("page_key", [None, "k" * 20], ids=["checksum", "mac"])
def test_a_contiguous_page_of_any_shape_round_trips(backend, page_key):
    # Regression: a (2, n/2) page was viewed as 2 rows, so the memory store and keyed stores raised
    # "copy of 2 bytes into 3000" / "payload of 2 bytes" on a page the contract accepts.
    store = backend.open(page_key=page_key) if page_key else backend.open()
    keys = make_keys(2)
    pages = [p.view(2, PAGE_NBYTES // 2) for p in make_pages(2)]
    assert store.batch_set(keys, pages) == [True, True]
    targets = [torch.zeros(2, PAGE_NBYTES // 2, dtype=torch.uint8) for _ in keys]
    assert store.batch_get(keys, targets) == [True, True]
    assert all(torch.equal(t, p) for t, p in zip(targets, pages))


def test_one_writer_and_one_reader_thread_never_see_a_torn_page(backend):
    store = backend.open()
    keys, versions = make_keys(2), make_pages(2)
    store.batch_set(keys, [versions[0]] * 2)
    done = threading.Event()
    seen: list[bool] = []

    def writer():
        for i in range(40):
            store.batch_set(keys, [versions[i % 2]] * 2)
        done.set()

    thread = threading.Thread(target=writer)
    thread.start()
    targets = empty_pages(2)
    while not done.is_set() or not seen:
        found = store.batch_get(keys, targets)
        seen += [any(torch.equal(t, v) for v in versions) for t, ok in zip(targets, found) if ok]
    thread.join()
    assert seen and all(seen)
    assert store.stats.corrupt_pages == 0 and store.stats.errors == 0


BLOB_NBYTES = PAGE_NBYTES + HEADER_SIZE
PACK1_NBYTES = BLOB_NBYTES + 64 + 16  # a file pack of one page: its blob, its 64-character key, the footer


@pytest.mark.parametrize("backend", ["memory", "file", "file-python", "file-threads"], indirect=True)
def test_max_bytes_bounds_the_store_evicting_the_least_recently_used(backend):
    """Issue 15, item 5: a bounded L3 evicts by recency (reads count as use) and never exceeds its bound."""
    max_bytes = 4 * BLOB_NBYTES + 400  # room for four file packs of one page (a pack adds its key list)
    store = backend.open(max_bytes=max_bytes)
    keys, pages = make_keys(8), make_pages(8)
    for i in range(4):  # one batch a page: the file store evicts whole batches (packs)
        assert store.batch_set(keys[i:i + 1], pages[i:i + 1]) == [True]
    assert store.batch_get(keys[:1], empty_pages(1)) == [True]  # page 0 is now the most recent
    assert store.batch_set(keys[4:5], pages[4:5]) == [True]
    present = [store.batch_exists([k]) for k in keys[:5]]
    assert present == [1, 0, 1, 1, 1] and store.stats.evicted_pages == 1
    for i in range(5, 8):
        assert store.batch_set(keys[i:i + 1], pages[i:i + 1]) == [True]
    present = [store.batch_exists([k]) for k in keys]
    assert sum(present) == 4 and present[5:] == [1, 1, 1] and 4 * BLOB_NBYTES <= store.size_bytes <= max_bytes
    targets = empty_pages(8)
    found = store.batch_get(keys, targets)
    assert found == [bool(p) for p in present]
    assert all(torch.equal(t, p) for t, p, ok in zip(targets, pages, found) if ok)
    with pytest.raises(ValueError, match="max_bytes"):
        backend.open(max_bytes=BLOB_NBYTES - 1)


SECRET = "s3cret-page-key-0123456789"


def test_a_planted_page_with_a_valid_checksum_is_a_miss_with_a_page_key(backend, caplog):
    """Issue 11, item 13: every header field is public, so without a MAC anyone who can write to the
    store can plant KV; with a page_key such a page (correct xxh3 and all) is a miss."""
    keys, pages = make_keys(3), make_pages(3)
    attacker = backend.open()  # no key: writes well-formed pages with a correct checksum
    assert attacker.batch_set(keys, pages) == [True] * 3
    targets = empty_pages(3)
    assert backend.open().batch_get(keys, targets) == [True] * 3  # served, without a key
    assert torch.equal(targets[1], pages[1])
    with caplog.at_level("DEBUG"):
        keyed = backend.open(page_key=SECRET)
        assert keyed.batch_get(keys, empty_pages(3)) == [False] * 3
        assert keyed.stats.corrupt_pages == 3
        # Pages written with the key round-trip; another key, or none, cannot read them.
        assert keyed.batch_set(keys, pages) == [True] * 3
        assert keyed.batch_get(keys, targets) == [True] * 3 and torch.equal(targets[2], pages[2])
        assert backend.open(page_key=SECRET[::-1]).batch_get(keys, empty_pages(3)) == [False] * 3
        assert backend.open().batch_get(keys, empty_pages(3)) == [False] * 3
    assert SECRET not in caplog.text and SECRET[::-1] not in caplog.text and SECRET not in repr(keyed.format)


# File-only behaviours.

def test_file_survives_a_new_store_and_a_new_process(tmp_path):
    url, keys, pages = f"file://{tmp_path}", make_keys(3), make_pages(3)
    open_store(url, "ns", PAGE_NBYTES).batch_set(keys, pages)
    again = open_store(url, "ns", PAGE_NBYTES)
    targets = empty_pages(3)
    assert again.batch_get(keys, targets) == [True] * 3
    assert all(torch.equal(t, p) for t, p in zip(targets, pages))
    script = (
        "import sys, torch\n"
        "from tierkv.storage.factory import open_store\n"
        f"s = open_store({url!r}, 'ns', {PAGE_NBYTES})\n"
        "keys = sys.argv[1:]\n"
        f"t = [torch.zeros({PAGE_NBYTES}, dtype=torch.uint8) for _ in keys]\n"
        "assert s.batch_exists(keys) == len(keys) and all(s.batch_get(keys, t))\n"
        "print(sum(int(x.sum()) for x in t))\n"
    )
    out = subprocess.run([sys.executable, "-c", script, *keys], capture_output=True, text=True, timeout=60,
                         cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert out.returncode == 0, out.stderr
    assert int(out.stdout) == sum(int(p.sum()) for p in pages)


def _age(store, keys: list[str], start_s: float = 1_000_000.0) -> None:
    """Give ``keys``' packs increasing modification times (oldest first): a deterministic recency order."""
    for i, key in enumerate(keys):
        os.utime(store.path(key), (start_s + i, start_s + i))


def test_file_max_bytes_index_survives_a_restart(tmp_path):
    """The file L3 rebuilds its index and size from the directory: the bound holds across restarts."""
    url, keys, pages = f"file://{tmp_path}", make_keys(6), make_pages(6)
    first = open_store(url, "ns", PAGE_NBYTES, {"max_bytes": 8 * PACK1_NBYTES})
    for i in range(5):  # a pack each
        assert first.batch_set(keys[i:i + 1], pages[i:i + 1]) == [True]
    _age(first, keys[:5])
    packs = {k: first.path(k) for k in keys[:5]}
    (tmp_path / "stray.txt").write_text("not a page")  # ignored, never counted nor removed
    again = open_store(url, "ns", PAGE_NBYTES, {"max_bytes": 8 * PACK1_NBYTES})
    assert again.size_bytes == 5 * PACK1_NBYTES and again.batch_exists(keys[:5]) == 5
    assert again.batch_get(keys[:1], empty_pages(1)) == [True]  # a hit refreshes page 0's pack's mtime
    # Restart with a smaller bound: the least recently used packs go at once (1 and 2, not 0).
    smaller = open_store(url, "ns", PAGE_NBYTES, {"max_bytes": 3 * PACK1_NBYTES})
    assert smaller.size_bytes == 3 * PACK1_NBYTES and smaller.stats.evicted_pages == 2
    on_disk = lambda: [os.path.exists(packs[k]) for k in keys[:5]]  # noqa: E731 (batch_exists would touch)
    assert on_disk() == [True, False, False, True, True]
    assert smaller.batch_set(keys[5:], pages[5:]) == [True]  # evicts page 3's pack, the oldest left
    assert on_disk() == [True, False, False, False, True] and os.path.exists(smaller.path(keys[5]))
    assert (tmp_path / "stray.txt").exists()
    packs_on_disk = [p for p in tmp_path.rglob("*.pack")]
    assert len(packs_on_disk) == 3 and sum(p.stat().st_size for p in packs_on_disk) == smaller.size_bytes


def test_file_keys_stay_inside_the_directory(tmp_path):
    store = open_store("file", "ns", PAGE_NBYTES, {"dir": str(tmp_path)})
    key = make_keys(1)[0]
    assert store.batch_set([key], make_pages(1)) == [True]
    assert store.path(key).startswith(str(tmp_path) + os.sep)
    with pytest.raises(ValueError):
        store.path("../" + key)


def test_file_symlinks_planted_in_the_store_are_never_followed(tmp_path):
    store = open_store(f"file://{tmp_path}/l3", "ns", PAGE_NBYTES)
    outside = tmp_path / "outside"
    outside.mkdir()
    keys, pages = make_keys(3), make_pages(3)
    # A pack replaced by a link to a file outside, holding a valid pack of that page (issue 11, item 10) ...
    assert store.batch_set(keys[1:2], pages[1:2]) == [True]
    pack = store.path(keys[1])
    os.replace(pack, outside / "stolen.pack")
    os.symlink(outside / "stolen.pack", pack)
    # ... and links where the next pack and its temp file will be written.
    following = pack_name(store._counter.peek())
    os.symlink(outside / "next.pack", os.path.join(store.directory, following))
    os.symlink(outside / "next.tmp", os.path.join(store.directory, f"{following}.{os.getpid()}.tmp"))
    before = sorted(p.name for p in outside.rglob("*"))
    assert store.batch_get(keys[1:2], empty_pages(1)) == [False] and store.stats.errors == 1
    assert store.batch_exists(keys[1:2]) == 0
    # The write replaces the links themselves, never the files they point to.
    assert store.batch_set(keys[:1], pages[:1]) == [True]
    assert store.path(keys[0]).endswith(following) and not os.path.islink(store.path(keys[0]))
    targets = empty_pages(1)
    assert store.batch_get(keys[:1], targets) == [True] and torch.equal(targets[0], pages[0])
    assert sorted(p.name for p in outside.rglob("*")) == before  # nothing written outside the store
    assert store.batch_set(keys[1:2], pages[1:2]) == [True] and store.batch_exists(keys[1:2]) == 1
    store.clear()
    assert os.path.isfile(outside / "stolen.pack") and sorted(p.name for p in outside.rglob("*")) == before


def test_file_write_error_is_false_and_counted(tmp_path, monkeypatch):
    monkeypatch.setattr(native, "pageio", None)  # the Python loop, whose writes this test breaks
    store = open_store(f"file:{tmp_path}", "ns", PAGE_NBYTES)
    keys, pages = make_keys(2), make_pages(2)

    def disk_full(fd, buffers, offset):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "pwritev", disk_full)
    assert store.batch_set(keys, pages) == [False, False]
    assert store.stats.errors == 2 and store.stats.set_pages == 0
    monkeypatch.undo()
    assert store.batch_exists(keys) == 0
    assert [p.name for p in tmp_path.rglob("*") if p.is_file()] == [".packs"]  # the counter, no temp file


def _store_warnings(caplog) -> list:
    return [r for r in caplog.records if r.name.startswith("tierkv.storage") and r.levelname == "WARNING"]


def test_file_full_disk_warns_once_and_backs_off_writes(tmp_path, monkeypatch, caplog):
    """One warning, not one per page per backup; later writes skip the disk (issue 11, item 11)."""
    monkeypatch.setattr(native, "pageio", None)  # the Python loop, whose writes this test breaks
    store = open_store(f"file:{tmp_path}", "ns", PAGE_NBYTES, {"retry_backoff_s": 30.0})
    keys, pages = make_keys(10), make_pages(10)
    assert store.batch_set(keys[:2], pages[:2]) == [True, True]
    attempts = []

    def no_space(fd, buffers, offset):
        attempts.append(offset)
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr("tierkv.storage.file_write.write_all", no_space)
    with caplog.at_level("WARNING"):
        for _ in range(3):
            assert store.batch_set(keys[2:], pages[2:]) == [False] * 8
    assert len(_store_warnings(caplog)) == 1 and "disk full" in caplog.text
    assert store.stats.errors == 24 and len(attempts) == 1
    targets = empty_pages(10)
    assert store.batch_get(keys, targets) == [True, True] + [False] * 8  # reads go on
    assert torch.equal(targets[1], pages[1])
    assert not [p for p in tmp_path.rglob("*.tmp")]


def test_store_warnings_are_rate_limited_with_a_count(tmp_path, monkeypatch, caplog):
    """A failing disk that is not full (EIO) is tried page by page, but logs once per interval."""
    monkeypatch.setattr(native, "pageio", None)  # the Python loop, whose writes this test breaks
    store = open_store(f"file:{tmp_path}", "ns", PAGE_NBYTES)
    now = [0.0]
    store._error_log.clock = lambda: now[0]  # a fake clock: no waiting, no timing
    keys, pages = make_keys(20), make_pages(20)

    def io_error(fd, data, offset):
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr("tierkv.storage.file_write.write_all", io_error)
    with caplog.at_level("WARNING"):
        for i in range(19):  # a batch a page: a file store writes a batch as one pack, one failure
            assert store.batch_set(keys[i:i + 1], pages[i:i + 1]) == [False]
        assert len(_store_warnings(caplog)) == 1
        now[0] += store._error_log.interval_s
        assert store.batch_set(keys[19:], pages[19:]) == [False]
    warnings = _store_warnings(caplog)
    assert len(warnings) == 2 and "and 18 more like it" in warnings[1].getMessage()
    assert store.stats.errors == 20


def test_file_truncated_page_is_a_miss(tmp_path):
    store = open_store(f"file:{tmp_path}", "ns", PAGE_NBYTES)
    keys, pages = make_keys(1), make_pages(1)
    store.batch_set(keys, pages)
    pack = store.path(keys[0])
    with open(pack, "r+b") as f:
        f.truncate(HEADER_SIZE + 10)
    assert store.batch_get(keys, empty_pages(1)) == [False]
    assert store.stats.corrupt_pages == 1 and not os.path.exists(pack) and store.batch_exists(keys) == 0


def test_file_fsync_mode_round_trips(tmp_path):
    store = open_store(f"file:{tmp_path}", "ns", PAGE_NBYTES, {"fsync": True})
    keys, pages = make_keys(2), make_pages(2)
    assert store.batch_set(keys, pages) == [True, True]
    targets = empty_pages(2)
    assert store.batch_get(keys, targets) == [True, True] and torch.equal(targets[1], pages[1])


# Redis-only behaviours.

def _redis_store(server, **extra) -> PageStore:
    config = {"timeout_s": 1.0, "retry_backoff_s": 0.05, "key_prefix": f"fault{os.getpid()}:", **extra}
    return open_store(server.url, "ns", PAGE_NBYTES, config)


class _WatchedSocket:
    """A redis connection's socket whose ``sendall`` calls ``on_send(data)`` first (which may raise)."""

    def __init__(self, inner, on_send) -> None:
        self.inner, self.on_send = inner, on_send

    def sendall(self, data):
        self.on_send(data)
        return self.inner.sendall(data)

    def __getattr__(self, name):
        return getattr(self.inner, name)


def _watch_sends(store: PageStore, on_send):
    """Put ``on_send`` in front of the socket of the store's pooled connection; (connection, real socket)."""
    conn = store.client.connection_pool.get_connection()
    sock = conn._sock if conn._sock is not None else (conn.connect() or conn._sock)
    store.client.connection_pool.release(conn)
    conn._sock = _WatchedSocket(sock, on_send)
    return conn, sock


def test_redis_killed_gives_misses_then_recovers_after_restart(redis_server):
    store = _redis_store(redis_server)
    keys, pages = make_keys(3), make_pages(3)
    assert store.batch_set(keys, pages) == [True] * 3
    redis_server.kill()
    try:
        assert store.batch_exists(keys) == 0
        assert store.batch_get(keys, empty_pages(3)) == [False] * 3
        assert store.batch_set(keys, pages) == [False] * 3
        store.clear()
        assert store.stats.errors >= 4
    finally:
        redis_server.restart()
    time.sleep(0.5)  # past the longest backoff window reached above (0.05 s doubled a few times)
    assert store.batch_exists(keys) == 0  # a restarted server has no data
    assert store.batch_set(keys, pages) == [True] * 3
    targets = empty_pages(3)
    assert store.batch_get(keys, targets) == [True] * 3 and torch.equal(targets[1], pages[1])
    store.clear()


def test_a_reset_in_the_middle_of_a_streamed_page_costs_hits_only(redis_server):
    """The socket fails after a few chunks of a streamed batch: no page of it counts as written, none
    half-written is ever served, and the next batch (a fresh connection) stores whole pages."""
    store = _redis_store(redis_server, retry_backoff_s=0.01)
    store.stream_min_nbytes, store.stream_chunk_nbytes = 0, 512  # 6 chunks a page
    keys, pages = make_keys(4, seed=3), make_pages(4, seed=3)
    sent = []

    def reset_at_the_ninth(data):
        sent.append(len(data))
        if len(sent) == 9:  # the second page's first chunk
            raise ConnectionResetError("reset by peer")
    conn, _ = _watch_sends(store, reset_at_the_ninth)  # the store disconnects it: the next use reconnects
    assert store.batch_set(keys, pages) == [False] * 4
    assert store.stats.errors >= 1 and len(sent) == 9 and conn._sock is None
    time.sleep(0.05)  # past the backoff window
    targets = empty_pages(4)
    found = store.batch_get(keys, targets)
    assert store.read_backoff.ready() and found[1:] == [False] * 3  # never reached the server whole
    if found[0]:  # sent whole before the reset: stored, and exact
        assert torch.equal(targets[0], pages[0])
    assert store.batch_set(keys, pages) == [True] * 4
    assert store.batch_get(keys, targets) == [True] * 4 and all(torch.equal(t, p) for t, p in zip(targets, pages))
    store.clear()


@pytest.mark.parametrize("streamed", [False, True], ids=["whole", "streamed"])
def test_a_redis_batch_sends_each_page_with_its_header_tail_and_next_head_in_one_piece(redis_server, streamed):
    """Under TCP_NODELAY each sendall is a segment and a server read: per page one send of its memory
    (or one per streamed chunk) and one of its header, the tail and the next SET's head, joined."""
    store = _redis_store(redis_server)
    store.stream_min_nbytes, store.stream_chunk_nbytes = (0, PAGE_NBYTES // 2) if streamed else (None, 1)
    keys, pages = make_keys(4, seed=5), make_pages(4, seed=5)
    sent = []
    conn, sock = _watch_sends(store, lambda data: sent.append(len(data)))
    try:
        assert store.batch_set(keys, pages) == [True] * 4
    finally:
        conn._sock = sock
    chunks_per_page = 2 if streamed else 1
    assert len(sent) == 4 * (chunks_per_page + 1) + 1
    assert sent.count(PAGE_NBYTES // chunks_per_page) == 4 * chunks_per_page  # page memory, never copied
    targets = empty_pages(4)
    assert store.batch_get(keys, targets) == [True] * 4 and all(torch.equal(t, p) for t, p in zip(targets, pages))
    store.clear()


def test_redis_backoff_skips_the_network_until_the_window_ends(redis_server):
    store = _redis_store(redis_server, retry_backoff_s=30.0)
    keys, pages = make_keys(1), make_pages(1)
    redis_server.kill()
    try:
        assert store.batch_get(keys, empty_pages(1)) == [False]
    finally:
        redis_server.restart()
    errors = store.stats.errors
    assert store.batch_set(keys, pages) == [False]  # still inside the 30 s window: no attempt made
    assert store.stats.errors == errors + 1


def _fill_until_refused(store: PageStore, page_nbytes: int, num_pages: int) -> tuple[list, list, list]:
    keys = make_keys(num_pages, seed=5)
    gen = torch.Generator().manual_seed(5)
    pages = [torch.randint(0, 256, (page_nbytes,), dtype=torch.uint8, generator=gen) for _ in keys]
    done: list[bool] = []
    for start in range(0, num_pages, 4):
        done += store.batch_set(keys[start:start + 4], pages[start:start + 4])
    return keys, pages, done


def test_redis_full_refuses_writes_but_still_serves_what_it_holds():
    """maxmemory + noeviction answers SET with OOM: writes back off, reads go on (issue 11, item 8)."""
    import redis
    from tests.servers import RedisServer, running
    with running(lambda: RedisServer.start(extra_args=("--maxmemory-policy", "noeviction"))) as server:
        admin = redis.Redis(port=server.port)
        admin.config_set("maxmemory", admin.info("memory")["used_memory"] + (1 << 20))
        page_nbytes = 64 << 10
        store = open_store(server.url, "ns", page_nbytes, {"retry_backoff_s": 30.0, "batch_pages": 2})
        keys, pages, done = _fill_until_refused(store, page_nbytes, 48)
        stored = sum(done)
        assert 0 < stored < len(keys) and done == [True] * stored + [False] * (len(keys) - stored)
        assert store.stats.errors >= 1
        # Inside the 30 s write window: the stored pages are all still found and read.
        assert store.batch_exists(keys) == stored
        targets = [torch.zeros(page_nbytes, dtype=torch.uint8) for _ in keys]
        assert store.batch_get(keys, targets) == done
        assert all(torch.equal(t, p) for t, p, ok in zip(targets, pages, done) if ok)
        assert store.stats.get_pages == stored
        assert store.read_backoff.ready() and not store.write_backoff.ready()
        store.clear()
        store.close()
        admin.close()


def test_redis_ttl_s_sets_an_expiry_on_every_page(redis_server):
    import redis
    store = _redis_store(redis_server, ttl_s=90.5)
    keys, pages = make_keys(3), make_pages(3)
    assert store.batch_set(keys, pages) == [True] * 3
    admin = redis.Redis(port=redis_server.port)
    assert all(90 < admin.pttl(store.redis_key(k)) / 1000 <= 91 for k in keys)  # EX rounds up
    targets = empty_pages(3)
    assert store.batch_get(keys, targets) == [True] * 3 and torch.equal(targets[2], pages[2])
    for bad in (0, -1.0, float("nan"), float("inf"), True, "60"):
        with pytest.raises(ValueError, match="ttl_s"):
            _redis_store(redis_server, ttl_s=bad)
    store.clear()
    admin.close()


def test_redis_password_db_and_prefix(caplog):
    from tests.servers import RedisServer, running
    with running(lambda: RedisServer.start(password="pw-s3cret")) as server:
        keys, pages = make_keys(2), make_pages(2)
        good = open_store(f"redis://:pw-s3cret@127.0.0.1:{server.port}/3", "ns", PAGE_NBYTES)
        assert good.batch_set(keys, pages) == [True, True]
        other_db = open_store(f"redis://:pw-s3cret@127.0.0.1:{server.port}/4", "ns", PAGE_NBYTES)
        other_prefix = open_store(f"redis://:pw-s3cret@127.0.0.1:{server.port}/3", "ns", PAGE_NBYTES,
                                  {"key_prefix": "other:"})
        assert other_db.batch_exists(keys) == 0 and other_prefix.batch_exists(keys) == 0
        assert good.batch_exists(keys) == 2
        wrong = open_store(f"redis://:pw-wrong@127.0.0.1:{server.port}/3", "ns", PAGE_NBYTES)
        with caplog.at_level("DEBUG"):
            assert wrong.batch_get(keys, empty_pages(2)) == [False, False]
        assert wrong.stats.errors == 1 and "redis store: get" in caplog.text
        assert "pw-wrong" not in caplog.text and "pw-s3cret" not in caplog.text
        for store in (good, other_db, other_prefix, wrong):
            store.close()



# Mooncake-only behaviours.

def test_mooncake_unreachable_master_is_a_fast_counted_miss():
    from tests.servers import free_port
    store = open_store(f"mooncake://127.0.0.1:{free_port()}", "ns", PAGE_NBYTES,
                       {"retry_backoff_s": 0.01, "global_segment_size": 1 << 20})
    keys, pages = make_keys(2), make_pages(2)
    assert store.batch_exists(keys) == 0  # refused by the TCP probe, before the client's long retries
    time.sleep(0.05)
    assert store.batch_set(keys, pages) == [False, False]
    assert store.batch_get(keys, empty_pages(2)) == [False, False]  # inside the backoff window
    assert store.stats.errors == 3 and store.client is None


def test_file_writes_make_no_directory_per_page(tmp_path, monkeypatch):
    """The subdirectories are made with the store; a write is open, write, rename (issue 16)."""
    store = open_store(f"file:{tmp_path}", "ns", PAGE_NBYTES)
    made = []
    real_mkdir = os.mkdir
    monkeypatch.setattr(os, "mkdir", lambda *a, **k: (made.append(a[0]), real_mkdir(*a, **k)))
    keys, pages = make_keys(64), make_pages(64)
    assert store.batch_set(keys, pages) == [True] * 64
    assert made == []
    targets = empty_pages(64)
    assert store.batch_get(keys, targets) == [True] * 64 and all(map(torch.equal, targets, pages))


def test_file_batch_is_one_pack_written_once_and_renamed_once(tmp_path, monkeypatch):
    """Issue 27, target 4: a batch costs one write and one rename, not an open, a write, a close and a
    rename per page; a read opens each pack once and reads each run of its pages in one call (batches
    within GROUP_NBYTES: larger ones go group by group, each checksummed while in cache)."""
    store = open_store(f"file:{tmp_path}", "ns", PAGE_NBYTES)
    num_pages = 300
    assert num_pages * PAGE_NBYTES <= GROUP_NBYTES
    keys, pages = make_keys(num_pages), make_pages(num_pages)
    calls: dict[str, int] = {}
    for name in ("open", "replace", "rename", "pwritev", "write", "preadv", "pread", "fsync", "mkdir"):
        real = getattr(os, name)
        monkeypatch.setattr(os, name, lambda *a, _real=real, _name=name, **k: (
            calls.__setitem__(_name, calls.get(_name, 0) + 1), _real(*a, **k))[1])
    assert store.batch_set(keys, pages) == [True] * num_pages
    # the namespace directory and the pack's temp file; the pack counter (read and bumped under a lock)
    assert calls == {"open": 2, "pwritev": 1, "replace": 1, "pread": 1}
    calls.clear()
    targets = empty_pages(num_pages)
    assert store.batch_get(keys, targets) == [True] * num_pages and all(map(torch.equal, targets, pages))
    # the directory and the pack; the headers, then the pages; the pack counter (no other writer since)
    assert calls == {"open": 2, "preadv": 2, "pread": 1}
    calls.clear()
    assert store.batch_exists(keys) == num_pages and calls == {"open": 1, "pread": 1}


def test_mooncake_batches_move_in_ranges_not_a_call_per_page(mooncake_master):
    """Every call costs round trips to the master: a batch of small pages goes in one call per
    RANGE_NBYTES range (two in flight), in both directions."""
    from tierkv.storage import mooncake_store
    page_nbytes, num_pages = 64 << 10, 768  # 48 MiB: three ranges
    store = open_store(mooncake_master.url, "ns-calls", page_nbytes,
                       {**mooncake_master.client_config(), "global_segment_size": 128 << 20})
    try:
        keys = make_keys(num_pages)
        g = torch.Generator().manual_seed(1)
        pages = [torch.randint(0, 256, (page_nbytes,), dtype=torch.uint8, generator=g) for _ in keys]
        assert store.batch_exists(keys[:1]) == 0 and store.client is not None
        store.read_in_place = False  # every page through the transfer engine (in place: test_mooncake_in_place)
        calls = []

        class CountingClient:
            def __getattr__(self, name):
                method = getattr(client, name)
                if name.startswith(("batch_put_from", "batch_get_into")):
                    return lambda *args, **kwargs: (calls.append(name), method(*args, **kwargs))[1]
                return method
        client, store.client = store.client, CountingClient()
        ranges = -(-num_pages * page_nbytes // mooncake_store.RANGE_NBYTES)
        assert ranges == 3
        assert store.batch_set(keys, pages) == [True] * num_pages and len(calls) == ranges
        calls.clear()
        targets = [torch.zeros(page_nbytes, dtype=torch.uint8) for _ in keys]
        assert store.batch_get(keys, targets) == [True] * num_pages and len(calls) == ranges
        assert all(map(torch.equal, targets, pages))
        store.client = client
        store.clear()
    finally:
        store.close()


def _failing_gets(store, faults: dict) -> object:
    """A stand-in client whose get of a range starting at a key of ``faults`` raises ("raise") or answers
    a transport error for that key's page ("code"); everything else goes to the real client."""
    client, lock = store.client, threading.Lock()

    class FailingClient:
        def __getattr__(self, name):
            return getattr(client, name)

        def batch_get_into_multi_buffers(self, names, *args):
            with lock:
                fault = faults.pop(names[0][len(store.key_prefix):], None)
            if fault == "raise":
                raise RuntimeError("transfer failed")
            codes = client.batch_get_into_multi_buffers(names, *args)
            return [-1] + codes[1:] if fault == "code" else codes
    return FailingClient()


@pytest.mark.parametrize("fault", ["code", "raise"])
def test_mooncake_a_failed_get_range_costs_hits_only(mooncake_master, monkeypatch, fault):
    """Gets go in ranges on two threads. A page whose transfer fails inside a range is a counted miss,
    a corrupt page in another range too, and every other page a hit with its own bytes; a range whose
    call raises is all misses (and the store backs off, so ranges not yet started miss too): never an
    exception, never a wrong byte, and once the backoff ends the batch reads again."""
    from tierkv.storage import mooncake_store
    monkeypatch.setattr(mooncake_store, "RANGE_NBYTES", 4 * PAGE_NBYTES)
    store = open_store(mooncake_master.url, f"ns-failed-{fault}", PAGE_NBYTES, mooncake_master.client_config())
    store.read_in_place = False  # the transfer engine's path (a get in place has no transfer to fail)
    try:
        keys, pages = make_keys(24), make_pages(24)
        assert store.batch_set(keys, pages) == [True] * 24
        corrupt_mooncake_page(store, keys[13], 7)
        client, store.client = store.client, _failing_gets(store, {keys[16]: fault})  # range 4's first page
        targets = empty_pages(24)
        found = store.batch_get(keys, targets)
        store.client = client
        assert all(torch.equal(targets[i], pages[i]) for i in range(24) if found[i])
        if fault == "code":
            assert found == [i not in (13, 16) for i in range(24)]
            assert store.stats.corrupt_pages == 1 and store.stats.errors == 1
        else:
            assert not any(found[16:20]) and found.count(True) <= 24 - 5 and store.stats.errors >= 1
            store.backoff.succeeded()  # the window's end
        assert store.batch_get(keys, empty_pages(24)) == [i != 13 for i in range(24)]
    finally:
        store.clear()
        store.close()


def test_mooncake_a_failed_put_range_costs_only_its_pages(mooncake_master, monkeypatch):
    """Puts go in ranges on two threads: a range whose call raises is False (counted), every other range
    is stored and reads back exactly; the failed pages are simply absent."""
    from tierkv.storage import mooncake_store
    monkeypatch.setattr(mooncake_store, "RANGE_NBYTES", 4 * PAGE_NBYTES)
    store = open_store(mooncake_master.url, "ns-failed-put", PAGE_NBYTES, mooncake_master.client_config())
    try:
        keys, pages = make_keys(24), make_pages(24)
        assert store.batch_exists(keys[:1]) == 0
        client = store.client

        class FailingClient:
            def __getattr__(self, name):
                return getattr(client, name)

            def batch_put_from_multi_buffers(self, names, *args):
                if names[0] == store.object_key(keys[8]):
                    raise RuntimeError("transfer failed")
                return client.batch_put_from_multi_buffers(names, *args)
        store.client = FailingClient()
        assert store.batch_set(keys, pages) == [not 8 <= i < 12 for i in range(24)]
        store.client = client
        assert store.stats.errors == 1 + 4 and store.stats.set_pages == 20  # the call, then each of its pages
        targets = empty_pages(24)
        assert store.batch_get(keys, targets) == [not 8 <= i < 12 for i in range(24)]
        assert all(torch.equal(targets[i], pages[i]) for i in range(24) if not 8 <= i < 12)
    finally:
        store.clear()
        store.close()


def test_file_bounded_store_keeps_the_newest_pages_of_a_batch_larger_than_its_bound(tmp_path):
    """A bounded store cuts a batch into small packs: one pack over the bound would be evicted whole."""
    max_bytes = 3 * PACK1_NBYTES
    store = open_store(f"file:{tmp_path}", "ns", PAGE_NBYTES, {"max_bytes": max_bytes})
    keys, pages = make_keys(13), make_pages(13)
    assert store.batch_set(keys, pages) == [True] * 13
    assert [store.batch_exists([k]) for k in keys] == [0] * 10 + [1] * 3
    on_disk = sum(p.stat().st_size for p in tmp_path.rglob("*.pack"))
    assert on_disk == store.size_bytes <= max_bytes
    targets = empty_pages(3)
    assert store.batch_get(keys[10:], targets) == [True] * 3 and all(map(torch.equal, targets, pages[10:]))
