"""Mooncake gets in place: a page whose replica lies in the client's own mounted segment is copied out of
it and hashed in one native pass (tierkv/_pageio_mem.c), with the same answers as the transfer engine's
path: exact bytes, corrupt pages counted misses and dropped, other pages through the engine."""

import numpy as np
import pytest
import torch
import xxhash

from tests.test_storage_backends import (
    PAGE_NBYTES,
    corrupt_mooncake_page,
    empty_pages,
    make_keys,
    make_pages,
)
from tests.test_storage_native import native_built  # noqa: F401 (autouse: skips without the module)
from tierkv.storage import native
from tierkv.storage.factory import open_store
from tierkv.storage.page_format import CHECKSUM_OFFSET, HEADER_SIZE, PageFormat


@pytest.mark.parametrize("payload_nbytes", [0, 15, 3000, (16 << 10) + 17, 3 * (16 << 10), (64 << 10) + 17,
                                            3 * (64 << 10)])
def test_copy_blobs_xxh3_copies_hashes_and_checks_each_header(payload_nbytes):
    """Blobs at raw addresses (payload then header) land in their pages with the xxhash package's digest;
    a header that differs anywhere from its template is a mismatch, the others ok."""
    fmt = PageFormat("ns", payload_nbytes)
    keys = make_keys(3)
    rng = np.random.default_rng(payload_nbytes)
    payloads = [rng.integers(0, 256, payload_nbytes, dtype=np.uint8) for _ in keys]
    digests = [xxhash.xxh3_64_intdigest(p.tobytes()) for p in payloads]
    headers = fmt.filled_headers(keys, digests)
    blobs = [np.concatenate([p, h]) for p, h in zip(payloads, headers)]
    blobs[2][payload_nbytes + 40] ^= 1  # the key digest: a page filed under another key
    addresses = np.array([b.ctypes.data for b in blobs], dtype=np.int64)
    pages = [np.zeros(payload_nbytes, dtype=np.uint8) for _ in keys]
    got = np.zeros((3, HEADER_SIZE), dtype=np.uint8)
    results = native.pageio.copy_blobs_xxh3(addresses, pages, got, fmt.header_templates(keys), payload_nbytes,
                                            CHECKSUM_OFFSET)
    assert results == [(0, d - (1 << 64) if d >= 1 << 63 else d) for d in digests[:2]] + [(3, results[2][1])]
    assert all(np.array_equal(p, q) for p, q in zip(pages, payloads))
    assert np.array_equal(got, np.stack([b[payload_nbytes:] for b in blobs]))


@pytest.mark.parametrize("shift", [1, 8, 15])
def test_copy_blobs_xxh3_lands_exact_bytes_at_any_alignment(shift):
    """Pages at any alignment, over one 64 KiB copy chunk: every byte lands, none around the page is touched."""
    fmt, keys, payload_nbytes = PageFormat("ns", (64 << 10) + 100), make_keys(2), (64 << 10) + 100
    rng = np.random.default_rng(shift)
    payloads = [rng.integers(0, 256, payload_nbytes, dtype=np.uint8) for _ in keys]
    digests = [xxhash.xxh3_64_intdigest(p.tobytes()) for p in payloads]
    sources = [np.concatenate([p, h]).tobytes() for p, h in zip(payloads, fmt.filled_headers(keys, digests))]
    arena = np.full(2 * payload_nbytes + 64, 7, dtype=np.uint8)
    pages = [arena[shift:shift + payload_nbytes], arena[shift + payload_nbytes + 3:shift + 2 * payload_nbytes + 3]]
    results = native.pageio.copy_blobs_xxh3(sources, pages, np.zeros((2, HEADER_SIZE), dtype=np.uint8),
                                            fmt.header_templates(keys), payload_nbytes, CHECKSUM_OFFSET)
    assert [status for status, _ in results] == [0, 0]
    assert all(np.array_equal(p, q) for p, q in zip(pages, payloads))
    assert (arena[:shift] == 7).all() and (arena[shift + payload_nbytes:shift + payload_nbytes + 3] == 7).all()
    assert (arena[shift + 2 * payload_nbytes + 3:] == 7).all()


FUSED_LENGTHS = [241, 255, 256, 257, 1023, 1024, 1025, 1087, 1088, 1089, 4096, (16 << 10) + 63, 128 << 10,
                 (1 << 20) + 5]


def check_fused_copies(lengths: list[int]) -> None:
    """Each length copied by copy_blobs_xxh3 into a page 32-byte aligned (streamed stores) and one 8 bytes
    off (plain stores): exact bytes, nothing around the page touched, the xxhash package's digest."""
    for length in lengths:
        fmt, keys = PageFormat("ns", length), make_keys(1)
        payload = np.random.default_rng(length).integers(0, 256, length, dtype=np.uint8)
        digest = xxhash.xxh3_64_intdigest(payload.tobytes())
        source = np.concatenate([payload, fmt.filled_headers(keys, [digest])[0]]).tobytes()
        arena = np.full(length + 128, 5, dtype=np.uint8)
        base = (-arena.ctypes.data) % 32
        for offset in (base, base + 8):
            arena[:] = 5
            page = arena[offset:offset + length]
            results = native.pageio.copy_blobs_xxh3([source], [page], np.zeros((1, HEADER_SIZE), dtype=np.uint8),
                                                    fmt.header_templates(keys), length, CHECKSUM_OFFSET)
            assert results == [(0, digest - (1 << 64) if digest >= 1 << 63 else digest)], (length, offset)
            assert np.array_equal(page, payload), (length, offset)
            assert (arena[:offset] == 5).all() and (arena[offset + length:] == 5).all(), (length, offset)


def test_the_one_pass_copy_and_hash_gives_the_xxhash_packages_digest_at_every_length_shape():
    """Payloads over 240 bytes are copied and hashed from the same registers (tierkv/_xxh3_copy.c, XXH3's
    long path written here): around 1 KiB blocks and 64-byte stripes, at page sizes, over 1 MiB."""
    check_fused_copies(FUSED_LENGTHS)


def test_the_portable_one_pass_copy_gives_the_same_digests():
    """The path for CPUs without AVX2, forced by TIERKV_XXH3_COPY_SCALAR=1 in a fresh process."""
    import os
    import subprocess
    import sys
    code = ("from tests.test_mooncake_in_place import check_fused_copies, FUSED_LENGTHS; "
            "check_fused_copies(FUSED_LENGTHS); print('ok')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "TIERKV_XXH3_COPY_SCALAR": "1"})
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]


def test_copy_blobs_xxh3_refuses_wrong_sizes():
    fmt, keys = PageFormat("ns", 100), make_keys(2)
    blob = np.zeros(148, dtype=np.uint8)
    addresses = np.array([blob.ctypes.data] * 2, dtype=np.int64)
    with pytest.raises(ValueError, match="payload 1 has 99 bytes"):
        native.pageio.copy_blobs_xxh3(addresses, [bytearray(100), bytearray(99)], bytearray(96),
                                      fmt.header_templates(keys), 100, CHECKSUM_OFFSET)
    with pytest.raises(ValueError, match="2 addresses"):
        native.pageio.copy_blobs_xxh3(addresses[:1], [bytearray(100)] * 2, bytearray(96),
                                      fmt.header_templates(keys), 100, CHECKSUM_OFFSET)
    with pytest.raises(ValueError, match="48 per page"):
        native.pageio.copy_blobs_xxh3(addresses, [bytearray(100)] * 2, bytearray(95), fmt.header_templates(keys),
                                      100, CHECKSUM_OFFSET)


def _counting(store, calls: list):
    client = store.client

    class CountingClient:
        def __getattr__(self, name):
            method = getattr(client, name)
            if name.startswith(("batch_get_into", "batch_get_replica_desc")):
                return lambda *args, **kwargs: (calls.append(name), method(*args, **kwargs))[1]
            return method
    return client, CountingClient()


def test_pages_in_the_own_segment_are_read_in_place_and_corrupt_ones_missed(mooncake_master):
    """Every page lies in the client's own segment: the get makes no transfer-engine call, lands exact
    bytes, and a page with a flipped payload or header byte is a counted miss, dropped from the store."""
    store = open_store(mooncake_master.url, "ns-in-place", PAGE_NBYTES, mooncake_master.client_config())
    try:
        keys, pages = make_keys(20), make_pages(20)
        assert store.batch_set(keys, pages) == [True] * 20
        corrupt_mooncake_page(store, keys[3], 11)  # payload
        corrupt_mooncake_page(store, keys[9], PAGE_NBYTES + CHECKSUM_OFFSET)  # the stored checksum
        calls: list = []
        client, store.client = _counting(store, calls)
        targets = empty_pages(20)
        found = store.batch_get(keys, targets)
        store.client = client
        assert found == [i not in (3, 9) for i in range(20)]
        assert all(torch.equal(targets[i], pages[i]) for i in range(20) if found[i])
        assert calls == ["batch_get_replica_desc"] and store.stats.corrupt_pages == 2
        assert store.batch_exists(keys[3:4]) == 0 and store.batch_exists(keys[9:10]) == 0  # dropped
    finally:
        store.clear()
        store.close()


def test_pages_elsewhere_go_through_the_engine_beside_those_in_place(mooncake_master):
    """Pages whose replica the master does not place in this client's segment (here: left out of its
    answer) are fetched through the transfer engine in one call; absent pages are plain misses."""
    store = open_store(mooncake_master.url, "ns-mixed", PAGE_NBYTES, mooncake_master.client_config())
    try:
        keys, pages = make_keys(12), make_pages(12)
        assert store.batch_set(keys[:10], pages[:10]) == [True] * 10
        client = store.client
        elsewhere = {store.object_key(keys[i]) for i in (1, 4, 5)}
        calls = []

        class RemoteSome:
            def __getattr__(self, name):
                return getattr(client, name)

            def batch_get_replica_desc(self, names):
                return {n: r for n, r in client.batch_get_replica_desc(names).items() if n not in elsewhere}

            def batch_get_into_multi_buffers(self, names, *args):
                calls.append(sorted(names))
                return client.batch_get_into_multi_buffers(names, *args)
        store.client = RemoteSome()
        targets = empty_pages(12)
        found = store.batch_get(keys, targets)
        store.client = client
        assert found == [True] * 10 + [False] * 2
        assert all(torch.equal(targets[i], pages[i]) for i in range(10))
        assert calls == [sorted(elsewhere | {store.object_key(k) for k in keys[10:]})]
        assert store.stats.corrupt_pages == 0 and store.stats.errors == 0
    finally:
        store.clear()
        store.close()


def test_pool_rows_are_read_in_place_and_elsewhere_with_no_tensor_a_page(mooncake_master, monkeypatch):
    """batch_get_rows (an L3 prefetch into a page-first host pool) lands pages in their rows, shuffled:
    those in the own segment copied in place, a corrupt one a counted miss, those the master places
    elsewhere through the engine at their rows' addresses, an absent one a miss; and no page goes through
    the tensor path (its check of a tensor a page was a tenth of a 1,024-page get)."""
    from tierkv.storage.mooncake_store import MooncakeStore
    store = open_store(mooncake_master.url, "ns-rows", PAGE_NBYTES, mooncake_master.client_config())
    try:
        keys, pages = make_keys(12), make_pages(12)
        assert store.batch_set(keys[:11], pages[:11]) == [True] * 11
        corrupt_mooncake_page(store, keys[6], 5)
        client = store.client
        elsewhere = {store.object_key(keys[i]) for i in (2, 8)}

        class RemoteSome:
            def __getattr__(self, name):
                return getattr(client, name)

            def batch_get_replica_desc(self, names):
                return {n: r for n, r in client.batch_get_replica_desc(names).items() if n not in elsewhere}

        def no_tensor_path(*args):
            raise AssertionError("a tensor a page")
        monkeypatch.setattr(MooncakeStore, "_check_batch", no_tensor_path)
        store.client = RemoteSome()
        rows = np.zeros((20, PAGE_NBYTES), dtype=np.uint8)
        order = [13, 0, 7, 19, 2, 11, 5, 16, 9, 1, 4, 17]
        found = store.batch_get_rows(keys, rows, order)
        store.client = client
        assert found == [i not in (6, 11) for i in range(12)]
        for i, row in enumerate(order):
            expected = pages[i].numpy() if found[i] else None
            assert expected is None or np.array_equal(rows[row], expected)
        untouched = sorted(set(range(20)) - set(order))
        assert not rows[untouched].any() and not rows[order[11]].any()
        assert store.stats.corrupt_pages == 1 and store.stats.get_pages == 10
    finally:
        store.clear()
        store.close()
