"""The native page I/O (tierkv/_pageio.c): same checksums and files as the Python loops, faults still
cost hits, never wrong bytes or a hang, and a batch is one call, not Python work per page."""

import json
import os
import subprocess
import sys
import threading

import numpy as np
import pytest
import torch
import xxhash

from tests.test_storage_backends import PAGE_NBYTES, empty_pages, make_keys, make_pages
from tierkv.storage import native
from tierkv.storage.factory import open_store
from tierkv.storage.page_format import CHUNK_NBYTES, HEADER_SIZE, PageFormat, PageFormatError

KEY, OTHER = "ab" * 32, "cd" * 32


@pytest.fixture(autouse=True)
def native_built():
    if native.pageio is None:
        if os.environ.get("TIERKV_REQUIRE_NATIVE") == "1":
            pytest.fail("tierkv._pageio is not built or not bound to xxhash (TIERKV_REQUIRE_NATIVE=1)")
        pytest.skip("tierkv._pageio is not built")


@pytest.mark.parametrize("num_bytes", [0, 1, 16, 17, 128, 129, 240, 241, 1024, 3000, 1 << 20])
def test_native_xxh3_is_the_xxhash_packages(num_bytes):
    data = np.random.default_rng(num_bytes).integers(0, 256, num_bytes, dtype=np.uint8).tobytes()
    assert native.pageio.xxh3_many([data, memoryview(data)]) == [xxhash.xxh3_64_intdigest(data)] * 2


@pytest.mark.parametrize("num_bytes", [241, 4096, (256 << 10) + 64, (1 << 20) + 5, 8 << 20])
def test_read_xxh3_reads_a_page_and_hashes_what_it_stored(tmp_path, num_bytes):
    """read_xxh3 (a file page read through a bounce buffer and copied in one pass, _xxh3_copy.c): exact bytes
    at an offset, the xxhash package's digest; a file that ends before the page does is None (the bytes
    before its end are read); refused: a page of 240 bytes or less, a negative offset; a bad fd an OSError."""
    data = np.random.default_rng(num_bytes).integers(0, 256, num_bytes + 100, dtype=np.uint8)
    path = tmp_path / "pack"
    path.write_bytes(data.tobytes())
    page = np.zeros(num_bytes, dtype=np.uint8)
    fd = os.open(path, os.O_RDONLY)
    try:
        assert native.pageio.read_xxh3(fd, page, 100) == xxhash.xxh3_64_intdigest(data[100:].tobytes())
        assert np.array_equal(page, data[100:])
        assert native.pageio.read_xxh3(fd, page, 101) is None  # one byte short
        with pytest.raises(ValueError, match="over 240 bytes"):
            native.pageio.read_xxh3(fd, np.zeros(240, dtype=np.uint8), 0)
        with pytest.raises(ValueError, match="offset >= 0"):
            native.pageio.read_xxh3(fd, page, -1)
    finally:
        os.close(fd)
    with pytest.raises(OSError):
        native.pageio.read_xxh3(fd, page, 0)


def test_header_templates_filled_are_the_headers_and_check_names_each_bad_page():
    fmt = PageFormat("ns", 1000)
    payloads = [memoryview(bytes([i]) * 1000) for i in range(3)]
    keys = [KEY, OTHER, "ef" * 32]
    digests = native.pageio.xxh3_many(payloads)
    filled = fmt.filled_headers(keys, digests)
    assert [row.tobytes() for row in filled] == [fmt.header(k, p) for k, p in zip(keys, payloads)]
    stored = filled.copy()
    stored[1, 40] ^= 1  # page 1's key digest
    wrong_namespace = PageFormat("ns2", 1000).header(keys[2], payloads[2])
    stored[2] = np.frombuffer(wrong_namespace, np.uint8)
    failures = fmt.check_headers(keys, stored, payloads, digests)
    assert [i for i, _ in failures] == [1, 2]
    assert "another key" in str(failures[0][1]) and "another namespace" in str(failures[1][1])
    with pytest.raises(ValueError, match="MAC"):
        PageFormat("ns", 1000, page_key="k" * 32).header_templates(keys)


def test_key_digests_are_the_xxhash_packages_and_headers_use_them(monkeypatch):
    """key_digests (a header's key digest field for a whole batch, one C loop): xxh64 of each key's UTF-8
    bytes, canonical, as page_format's _key_digest; the headers made with it are those made without the
    native module; a key that is not a str is a TypeError naming it."""
    import tierkv.storage.page_format as page_format

    keys = [KEY, OTHER, "0" * 16, "caf\u00e9", ""]
    assert native.pageio.key_digests(keys) == b"".join(xxhash.xxh64_digest(k.encode()) for k in keys)
    assert native.pageio.key_digests([]) == b""
    with pytest.raises(TypeError, match="key 1 is not a str"):
        native.pageio.key_digests([KEY, b"ab" * 8])
    fmt, digests = PageFormat("ns", 1000), [1, 2 ** 64 - 1, 0]
    with_native = fmt.filled_headers(keys[:3], digests)
    monkeypatch.setattr(page_format.native, "pageio", None)
    assert np.array_equal(fmt.filled_headers(keys[:3], digests), with_native)
    assert with_native[1].tobytes() == fmt.header(OTHER, memoryview(bytes(1000)))[:32] + \
        (2 ** 64 - 1).to_bytes(8, "little") + xxhash.xxh64_digest(OTHER.encode())


def test_a_build_without_xxh64_or_with_a_wrong_one_is_not_used(caplog):
    """native.bound checks key_digests against the xxhash package like the checksums: a library without XXH64
    (key_digests raises) or one that disagrees leaves the stores on their Python paths, with a warning, instead
    of failing at import."""
    class Stub:
        API_VERSION = native.NATIVE_API_VERSION

        def __init__(self, key_digests):
            self.key_digests = key_digests

        def __getattr__(self, name):
            return getattr(native.pageio, name)

    def missing(keys):
        raise RuntimeError("xxh64 is not bound")
    assert native.bound(Stub(missing)) is None and native.bound(Stub(lambda keys: b"\0" * 8 * len(keys))) is None
    assert "xxh64" in caplog.text
    assert native.bound(Stub(native.pageio.key_digests)) is not None


@pytest.mark.parametrize("page_nbytes", [PAGE_NBYTES, 3 * CHUNK_NBYTES + 17], ids=["one-chunk", "several-chunks"])
@pytest.mark.parametrize("writer_native", [True, False], ids=["native-writes", "python-writes"])
def test_native_and_python_file_stores_read_each_others_pages(tmp_path, writer_native, page_nbytes):
    """Same page format either way: a store of one build reads the pages of the other (pages of several
    chunks: the native streaming xxh3, dispatched to AVX2/AVX-512, agrees with the package's)."""
    keys = make_keys(9)
    pages = [torch.randint(0, 256, (page_nbytes,), dtype=torch.uint8, generator=torch.Generator().manual_seed(i))
             for i in range(9)]
    writer = open_store(f"file:{tmp_path}", "ns", page_nbytes)
    reader = open_store(f"file:{tmp_path}", "ns", page_nbytes)
    (reader if writer_native else writer)._native = None
    assert writer.batch_set(keys, pages) == [True] * 9
    targets = [torch.zeros(page_nbytes, dtype=torch.uint8) for _ in keys]
    assert reader.batch_get(keys, targets) == [True] * 9 and all(map(torch.equal, targets, pages))
    assert reader.stats.corrupt_pages == 0


def test_file_batches_do_no_python_work_per_page(tmp_path, monkeypatch):
    """Regression (issues 16, 27): a batch opened, read or wrote, and hashed each page from Python (~15 us
    a page, half of a 128 KiB read); now a batch is one pack file, opened once to write it and once to
    read it back, and its checksums one native call: no Python hasher is made."""
    store = open_store(f"file:{tmp_path}", "ns", PAGE_NBYTES)
    keys, pages = make_keys(40), make_pages(40)
    opened = []
    real_open = os.open

    def recording_open(path, flags, *args, **kwargs):
        if not flags & os.O_DIRECTORY:
            opened.append(path)
        return real_open(path, flags, *args, **kwargs)

    def no_hasher(*args):
        raise AssertionError("a per-page Python hasher")
    monkeypatch.setattr(os, "open", recording_open)
    monkeypatch.setattr(PageFormat, "payload_hasher", no_hasher)
    assert store.batch_set(keys, pages) == [True] * 40
    targets = empty_pages(40)
    assert store.batch_get(keys, targets) == [True] * 40 and all(map(torch.equal, targets, pages))
    assert len(opened) == 2  # the pack's temp file, then the pack


def test_mooncake_batches_hash_with_the_native_module(mooncake_master, monkeypatch):
    """Regression (issue 16): each page's header was made, and each page read verified, by a Python
    hasher (a cold pass plus ~5 us of Python a page); now one native call hashes a range."""
    store = open_store(mooncake_master.url, "ns-native", PAGE_NBYTES, mooncake_master.client_config())
    try:
        keys, pages = make_keys(30), make_pages(30)

        def no_hasher(*args):
            raise AssertionError("a per-page Python hasher")
        monkeypatch.setattr(PageFormat, "payload_hasher", no_hasher)
        assert store.batch_set(keys, pages) == [True] * 30
        targets = empty_pages(30)
        assert store.batch_get(keys, targets) == [True] * 30 and all(map(torch.equal, targets, pages))
        monkeypatch.undo()
        name, blob = store.object_key(keys[4]), torch.zeros(store.format.blob_nbytes, dtype=torch.uint8)
        assert store.client.get_into(name, blob.data_ptr(), blob.numel()) == blob.numel()
        blob[PAGE_NBYTES + 40] ^= 1  # the key digest: a page filed under another key
        assert store.client.upsert_from(name, blob.data_ptr(), blob.numel()) == 0
        assert store.batch_get(keys, empty_pages(30)) == [i != 4 for i in range(30)]
        assert store.stats.corrupt_pages == 1
    finally:
        store.clear()
        store.close()


@pytest.mark.parametrize("use_native", [True, False], ids=["native", "python"])
def test_a_fifo_planted_as_a_page_is_a_miss_not_a_hang(tmp_path, use_native):
    """Regression: opening a FIFO for reading blocks until a writer comes; a planted one hung the reader."""
    store = open_store(f"file:{tmp_path}", "ns", PAGE_NBYTES)
    if not use_native:
        store._native = None
    keys, pages = make_keys(3), make_pages(3)
    for i in range(3):  # a pack each
        assert store.batch_set(keys[i:i + 1], pages[i:i + 1]) == [True]
    pack = store.path(keys[1])
    os.unlink(pack)
    os.mkfifo(pack)
    found = []
    reader = threading.Thread(target=lambda: found.append(store.batch_get(keys, empty_pages(3))), daemon=True)
    reader.start()
    reader.join(60.0)  # a liveness bound, not a timing: the read returns at once or never
    if reader.is_alive():
        with open(pack, "wb"):  # unblock it so the thread ends
            pass
        pytest.fail("batch_get hung on a FIFO planted as a page")
    assert found == [[True, False, True]]
    assert store.stats.corrupt_pages == 1 and not os.path.exists(pack)


# Run in a child process: a file size limit holds for every write of the process, pytest's own
# output file included.
_LIMITED_WRITES = """
import errno, json, logging, os, resource, signal, sys
import tierkv.storage.file as file_backend
from tests.test_storage_backends import PAGE_NBYTES, empty_pages, make_keys, make_pages
from tierkv.storage.factory import open_store
root, refusal = sys.argv[1], sys.argv[2] == "refusal"
if refusal:  # count EFBIG as a disk refusal: the batch stops, writes back off
    file_backend._DISK_REFUSALS = file_backend._DISK_REFUSALS | {errno.EFBIG}
logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
store = open_store(f"file:{root}", "ns", PAGE_NBYTES, {"retry_backoff_s": 30.0})
keys, pages = make_keys(5), make_pages(5)
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
resource.setrlimit(resource.RLIMIT_FSIZE, (PAGE_NBYTES // 2, hard))  # writes past it fail with EFBIG
written = [store.batch_set(keys, pages), store.batch_set(keys, pages)]
resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
print(json.dumps({"written": written, "errors": store.stats.errors, "set_pages": store.stats.set_pages,
                  "backing_off": not store.write_backoff.ready(), "native": store._native is not None,
                  "read": store.batch_get(keys, empty_pages(5))}))
"""


def _limited_writes(tmp_path, mode: str) -> tuple[dict, str]:
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = subprocess.run([sys.executable, "-c", _LIMITED_WRITES, str(tmp_path), mode], capture_output=True,
                         text=True, cwd=root, env={**os.environ, "PYTHONPATH": root}, timeout=120)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.splitlines()[-1]), out.stderr


def test_native_write_failures_are_false_counted_and_leave_no_temp_file(tmp_path):
    """A real kernel refusal (EFBIG past a file size limit) that is not a full disk: each batch is tried
    (one pack: all its pages fail, each counted)."""
    result, _ = _limited_writes(tmp_path, "error")
    assert result["native"] and result["written"] == [[False] * 5] * 2
    assert result["errors"] == 10 and result["set_pages"] == 0 and not result["backing_off"]
    assert result["read"] == [False] * 5
    assert [p.name for p in tmp_path.rglob("*") if p.is_file()] == [".packs"]  # the counter, no temp file


def test_native_disk_refusal_stops_the_batch_and_backs_off(tmp_path):
    """A refusal the next page would hit too (EFBIG counted as one) ends the batch after one attempt;
    writes back off (the second batch is not even tried), reads go on."""
    result, log = _limited_writes(tmp_path, "refusal")
    assert result["native"] and result["written"] == [[False] * 5] * 2
    assert result["errors"] == 10 and result["backing_off"] and "disk full or read-only" in log
    assert [p.name for p in tmp_path.rglob("*") if p.is_file()] == [".packs"]  # the counter, no temp file


def test_check_headers_explains_a_mismatch_verify_cannot_see():
    """A header whose bytes differ from the expected ones in a field verify ignores is still refused."""
    fmt = PageFormat("ns", 8)
    payload = memoryview(b"abcdefgh")
    row = np.frombuffer(fmt.header(KEY, payload), np.uint8).copy()
    row[6] = 0x80  # a flag bit no version defines
    failures = fmt.check_headers([KEY], row.reshape(1, HEADER_SIZE), [payload], native.pageio.xxh3_many([payload]))
    assert len(failures) == 1 and isinstance(failures[0][1], PageFormatError)


@pytest.mark.parametrize("parallel_min_nbytes", [0, PAGE_NBYTES])
def test_an_empty_batch_writes_and_reads_nothing(tmp_path, parallel_min_nbytes):
    """An empty batch is an empty answer, on the threaded path too (it once indexed a run that did not
    exist)."""
    store = open_store(f"file:{tmp_path}", "ns", PAGE_NBYTES)
    store.write_threads, store.parallel_write_min_nbytes = 3, parallel_min_nbytes
    store.read_threads, store.parallel_read_min_nbytes = 3, parallel_min_nbytes
    assert store.batch_set([], []) == []
    assert store.batch_get([], []) == []
    assert store.stats.errors == 0


@pytest.mark.parametrize("page_nbytes", [PAGE_NBYTES, 1 << 20], ids=["in-line", "helpers"])
def test_redis_gets_copy_and_hash_replies_natively(redis_server, monkeypatch, page_nbytes):
    """Each round trip's replies are copied into their pages and hashed in one native call (no Python
    hasher a page); a corrupt page and a reply of another length are counted misses, the rest exact."""
    store = open_store(redis_server.url, f"ns-native-get-{page_nbytes}", page_nbytes, {"batch_pages": 4})
    try:
        keys = make_keys(10)
        pages = [torch.randint(0, 256, (page_nbytes,), dtype=torch.uint8, generator=torch.Generator().manual_seed(i))
                 for i in range(10)]
        assert store.batch_set(keys, pages) == [True] * 10
        blob = bytearray(store.client.get(store.redis_key(keys[2])))
        blob[5] ^= 1
        store.client.set(store.redis_key(keys[2]), bytes(blob))
        store.client.set(store.redis_key(keys[7]), bytes(blob[:-1]))

        def no_hasher(*args):
            raise AssertionError("a per-page Python hasher")
        monkeypatch.setattr(PageFormat, "payload_hasher", no_hasher)
        targets = [torch.zeros(page_nbytes, dtype=torch.uint8) for _ in keys]
        found = store.batch_get(keys, targets)
        monkeypatch.undo()
        assert found == [i not in (2, 7) for i in range(10)]
        assert all(torch.equal(targets[i], pages[i]) for i in range(10) if found[i])
        assert store.stats.corrupt_pages == 2
    finally:
        store.clear()
        store.close()


BAD_KEYS = ["0" * 15, "0" * 129, "A" * 16, "0" * 16 + "\n", "é" * 16, "g" * 16, "0" * 8 + " " + "0" * 8,
            b"0" * 16, None, 16 * 10 ** 20]


@pytest.mark.parametrize("bad", BAD_KEYS, ids=range(len(BAD_KEYS)))
@pytest.mark.parametrize("at", [0, 3])
def test_native_and_python_key_checks_refuse_the_same_key(monkeypatch, bad, at):
    # every store call checks its keys; natively, ~0.1 us a key less (~0.5 CPU-s of a replay)
    from tierkv.storage.base import check_keys

    good = ["0123456789abcdef" * i for i in range(1, 9)]
    check_keys(good)
    keys = good[:at] + [bad] + good[at:]
    with pytest.raises(ValueError, match="not a lowercase hex page hash") as fast:
        check_keys(keys)
    monkeypatch.setattr(native, "pageio", None)
    check_keys(good)
    with pytest.raises(ValueError, match="not a lowercase hex page hash") as slow:
        check_keys(keys)
    assert str(fast.value) == str(slow.value)
