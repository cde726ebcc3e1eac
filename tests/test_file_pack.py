"""The file store's packs (tierkv/storage/file_pack.py): the index of pages in packs, the pack format, and
finding packs that another store wrote by number."""

from __future__ import annotations

import os

import pytest
import torch

from tests.test_storage_backends import PAGE_NBYTES, empty_pages, make_keys, make_pages
from tierkv.storage.factory import open_store
from tierkv.storage.file import GROUP_NBYTES
from tierkv.storage.file_pack import (
    PENDING_WINDOW,
    SLOT_BITS,
    PackIndex,
    consumed,
    pack_name,
    pack_number,
    pack_numbers,
    pack_pages,
)

K = [f"{i:016x}" for i in range(8)]


def flip_byte(path, offset: int, mask: int) -> None:
    """Corrupt one byte of the file at ``path`` in place: XOR it with ``mask``."""
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ mask]))


def test_a_later_pack_replaces_a_page_and_a_pack_without_live_pages_goes():
    index = PackIndex(None)
    assert index.add(0, K[:2], 100) == []
    assert index.add(1, K[1:3], 100) == []
    assert index.locate(K[1]) == (1, 0, 2) and index.locate(K[0]) == (0, 0, 2)
    gone = index.add(2, [K[0]], 50)  # pack 0's last live page moves on: pack 0 is garbage
    assert [number for number, _ in gone] == [0] and index.size_bytes == 150
    assert index.locate(K[0]) == (2, 0, 1)


def test_an_older_pack_found_late_never_replaces_a_newer_page():
    index = PackIndex(None)
    index.add(5, [K[0]], 10)
    gone = index.add(3, [K[0]], 10)  # another process's older pack, found after ours
    assert [number for number, _ in gone] == [3] and index.locate(K[0]) == (5, 0, 1)


def test_a_bounded_index_evicts_whole_packs_least_recently_used_first():
    index = PackIndex(250)
    index.add(0, K[0:2], 100)
    index.add(1, K[2:4], 100)
    index.touch(0)
    gone = index.add(2, K[4:6], 100)
    assert [(number, info.live) for number, info in gone] == [(1, 2)]
    assert index.locate(K[2]) is None and index.locate(K[0]) is not None and index.size_bytes == 200


def test_the_index_keeps_one_int_a_page_and_a_key_twice_in_a_pack_is_its_last_slot():
    # a (number, slot) tuple a page cost ~1 us a page written in a replay; the place is number << SLOT_BITS | slot
    index = PackIndex(None)
    index.add(1, K[:2], 100)
    gone = index.add(3, [K[0], K[2], K[0]], 100)
    assert gone == [] and index.locate(K[0]) == (3, 2, 3) and index.locate(K[1]) == (1, 1, 2)
    assert index.packs[3].live == 2 and index.packs[1].live == 1
    assert index.pages[K[2]] == (3 << SLOT_BITS) + 1 and all(type(p) is int for p in index.pages.values())
    number, info = index.drop_page(K[1])
    assert number == 1 and info.live == 0 and 1 not in index.packs


def test_pack_numbers_are_each_once_in_order_of_first_use():
    places = [(7 << SLOT_BITS) + 3, 2 << SLOT_BITS, (7 << SLOT_BITS) + 4, None, (9 << SLOT_BITS), 0, None]
    assert list(pack_numbers(places)) == [7, 2, 9, 0]  # pack 0, slot 0: place 0 counts too
    assert list(pack_numbers([])) == [] and list(pack_numbers([None])) == []


def test_dropping_pages_frees_their_pack_once_none_is_live():
    index = PackIndex(None)
    index.add(0, K[:2], 100)
    assert index.drop_page(K[0]) is None
    number, info = index.drop_page(K[1])
    assert number == 0 and info.live == 0 and len(index) == 0 and index.size_bytes == 0


def test_numbers_drawn_by_others_are_looked_for_until_found_or_too_old():
    index = PackIndex(None)
    index.drew(0)
    index.drew(3)  # 1 and 2 were drawn by another process meanwhile
    assert index.numbers_to_look_for(5) == [1, 2, 4]
    index.add(2, [K[0]], 10)
    assert index.numbers_to_look_for(5) == [1, 4]
    assert index.numbers_to_look_for(5 + PENDING_WINDOW) == list(range(5, 5 + PENDING_WINDOW))


def test_pack_names_round_trip_and_other_names_are_not_packs():
    assert pack_number(pack_name(0xabc)) == 0xabc
    for name in ("x.pack", "0000000000000abc.pack.1.tmp", ".packs", "000000000000000G.pack", "00.page"):
        assert pack_number(name) is None


def test_a_pack_lists_its_pages_and_another_store_finds_it_on_a_miss(tmp_path):
    writer = open_store(f"file:{tmp_path}", "ns", PAGE_NBYTES)
    reader = open_store(f"file:{tmp_path}", "ns", PAGE_NBYTES)  # opened before the pack exists
    keys, pages = make_keys(3), make_pages(3)
    assert writer.batch_set(keys, pages) == [True] * 3
    pack = writer.path(keys[0])
    assert [(key, at) for key, at, _ in pack_pages(pack)] == [(k, i * PAGE_NBYTES) for i, k in enumerate(keys)]
    with open(pack, "rb") as f:
        assert f.read(PAGE_NBYTES) == pages[0].numpy().tobytes()  # payloads first, at page multiples
    targets = empty_pages(3)
    assert reader.batch_get(keys, targets) == [True] * 3 and all(map(torch.equal, targets, pages))
    assert sorted(os.listdir(writer.directory)) == [".packs", os.path.basename(pack)]
    writer.close()
    reader.close()


@pytest.mark.parametrize("use_native", [True, False], ids=["native", "python"])
@pytest.mark.parametrize("page_nbytes, num_pages", [(GROUP_NBYTES + 4097, 3), (40_000, 60)],
                         ids=["pages-over-a-group", "batch-over-a-group"])
def test_batches_over_a_group_round_trip_and_a_flipped_byte_is_a_miss(tmp_path, use_native, page_nbytes,
                                                                      num_pages):
    """Batches over GROUP_NBYTES are written and read group by group (a page over it chunk by chunk),
    each checksummed while in cache: same bytes back, and a corrupt page is still caught."""
    store = open_store(f"file:{tmp_path}", "ns", page_nbytes)
    if not use_native:
        store._native = None
    g = torch.Generator().manual_seed(3)
    pages = [torch.randint(0, 256, (page_nbytes,), dtype=torch.uint8, generator=g) for _ in range(num_pages)]
    keys = make_keys(num_pages)
    assert store.batch_set(keys, pages) == [True] * num_pages
    targets = [torch.zeros(page_nbytes, dtype=torch.uint8) for _ in keys]
    assert store.batch_get(keys, targets) == [True] * num_pages and all(map(torch.equal, targets, pages))
    path, payload_at, _ = store.page_extent(keys[1])
    flip_byte(path, payload_at + page_nbytes - 3, 0xFF)  # in the last chunk of the page
    found = store.batch_get(keys, [torch.zeros(page_nbytes, dtype=torch.uint8) for _ in keys])
    assert found == [i != 1 for i in range(num_pages)] and store.stats.corrupt_pages == 1
    store.close()


def test_a_short_vectored_call_goes_on_from_the_byte_it_stopped_at():
    parts = [memoryview(b"abc"), memoryview(b"de"), memoryview(b"f")]
    assert [bytes(p) for p in consumed(parts, 4)] == [b"e", b"f"]
    assert [bytes(p) for p in consumed(parts, 3)] == [b"de", b"f"] and consumed(parts, 6) == []
    assert [bytes(p) for p in parts] == [b"abc", b"de", b"f"]  # the caller's list is left as it was


def test_a_newer_pack_of_a_known_page_written_by_another_store_wins(tmp_path):
    """Regression: a reader that already knew a page kept reading its old pack after another process
    rewrote it (a file per page always read the newest); now each batch first looks at the counter."""
    first, second, reader = (open_store(f"file:{tmp_path}", "ns", PAGE_NBYTES) for _ in range(3))
    keys, old, new = make_keys(2), make_pages(2, seed=1), make_pages(2, seed=2)
    assert first.batch_set(keys, old) == [True] * 2
    targets = empty_pages(2)
    assert reader.batch_get(keys, targets) == [True] * 2 and torch.equal(targets[0], old[0])
    assert second.batch_set(keys, new) == [True] * 2
    assert reader.batch_exists(keys) == 2
    assert reader.batch_get(keys, targets) == [True] * 2 and all(map(torch.equal, targets, new))
    for store in (first, second, reader):
        store.close()


@pytest.mark.parametrize("run", [0, 1, 15, 16, 17, 47, 48, 49, 150, 200])
def test_exists_counts_the_leading_run_wherever_the_first_miss_falls(tmp_path, run):
    """exists maps keys in growing chunks (16, 32, 64, ...) up to the first miss: the run is exact at and
    around every chunk boundary, a hit after the miss does not count, and a pack another store wrote
    since is still found."""
    store = open_store(f"file:{tmp_path}", "ns", PAGE_NBYTES)
    keys = make_keys(200)
    present = keys[:run] + keys[run + 1:]  # every key but the one at ``run``
    for start in range(0, len(present), 64):
        chunk = present[start:start + 64]
        assert store.batch_set(chunk, make_pages(len(chunk))) == [True] * len(chunk)
    assert store.batch_exists(keys) == run
    if run < len(keys):  # 200: every key present
        assert store.batch_exists(keys[run + 1:]) == len(keys) - run - 1
        other = open_store(f"file:{tmp_path}", "ns", PAGE_NBYTES)
        assert other.batch_set([keys[run]], make_pages(1)) == [True]
        assert store.batch_exists(keys) == len(keys)
        other.close()
    store.close()


@pytest.mark.parametrize("removed, run", [(1, 1), (0, 0)], ids=["the-later-pack", "the-first-pack"])
def test_exists_ends_at_the_first_page_of_a_removed_pack_where_packs_interleave(tmp_path, removed, run):
    """Pages 0, 2, 3 in pack 0 and page 1 rewritten into pack 1: a pack another process removed ends the
    run at its first page in the batch, whichever pack it is."""
    store = open_store(f"file:{tmp_path}", "ns", PAGE_NBYTES)
    keys = make_keys(4)
    assert store.batch_set(keys, make_pages(4)) == [True] * 4
    assert store.batch_set(keys[1:2], make_pages(1, seed=1)) == [True]
    assert store.batch_exists(keys) == 4
    os.unlink(tmp_path / store.namespace_tag / pack_name(removed))
    assert store.batch_exists(keys) == run
    store.close()


def test_a_read_of_a_few_pages_of_a_large_pack_reads_their_headers_alone_and_checks_each(tmp_path, monkeypatch):
    """A prefetch reads a backup's pack 16 pages at a time: only the wanted span of headers is read, and a
    bad header inside that span is still a miss for its page alone."""
    import tierkv.storage.file as file_module

    store = open_store(f"file:{tmp_path}", "ns", PAGE_NBYTES)
    keys, pages = make_keys(300), make_pages(300)
    assert store.batch_set(keys, pages) == [True] * 300
    path, _, header_at = store.page_extent(keys[151])
    flip_byte(path, header_at + 20, 0xFF)  # the namespace digest
    reads, real_read_run = [], file_module.read_run

    def read_run(fd, views, offset):
        reads.append(sum(map(len, views)))
        return real_read_run(fd, views, offset)
    monkeypatch.setattr(file_module, "read_run", read_run)
    targets = empty_pages(3)
    assert store.batch_get(keys[150:153], targets) == [True, False, True]
    assert torch.equal(targets[0], pages[150]) and torch.equal(targets[2], pages[152])
    assert reads[0] == 3 * 48 and store.stats.corrupt_pages == 1
    store.close()


@pytest.mark.parametrize("use_native", [True, False], ids=["one-pass", "groups"])
def test_a_page_over_a_group_is_read_whole_and_a_flipped_byte_in_its_tail_is_a_miss(tmp_path, monkeypatch,
                                                                                  use_native):
    """A page larger than a read group (1 MiB; 8 MiB pages in practice), 2.5 MiB plus 3 bytes: read exact,
    natively in one pass (``read_xxh3``) or in group-sized reads each checksummed as it lands (three); a
    byte flipped in its tail makes that page, and only it, a counted miss; a pack cut short, a miss."""
    import tierkv.storage.file as file_module

    page_nbytes = (5 << 19) + 3
    store = open_store(f"file:{tmp_path}", "ns", page_nbytes)
    if not use_native:
        store._native = None
    elif store._native is None:
        pytest.skip("tierkv._pageio is not built")
    keys = make_keys(2)
    g = torch.Generator().manual_seed(2)
    pages = [torch.randint(0, 256, (page_nbytes,), dtype=torch.uint8, generator=g) for _ in keys]
    assert store.batch_set(keys, pages) == [True, True]
    reads, real_read_run = [], file_module.read_run

    def read_run(fd, views, offset):
        reads.append(sum(map(len, views)))
        return real_read_run(fd, views, offset)
    monkeypatch.setattr(file_module, "read_run", read_run)
    targets = [torch.zeros(page_nbytes, dtype=torch.uint8) for _ in keys]
    assert store.batch_get(keys, targets) == [True, True]
    assert all(torch.equal(t, p) for t, p in zip(targets, pages))
    groups = [] if use_native else [1 << 20, 1 << 20, page_nbytes - (2 << 20)] * 2
    assert reads[1:] == groups  # after the headers' read
    path, payload_at, _ = store.page_extent(keys[1])
    flip_byte(path, payload_at + page_nbytes - 2, 0x01)
    assert store.batch_get(keys, [torch.zeros(page_nbytes, dtype=torch.uint8) for _ in keys]) == [True, False]
    assert store.stats.corrupt_pages == 1
    os.truncate(path, os.path.getsize(path) - 1)
    assert store.batch_get(keys[:1], [torch.zeros(page_nbytes, dtype=torch.uint8)]) == [False]
    store.close()


@pytest.mark.parametrize("use_native", [True, False], ids=["native", "python"])
@pytest.mark.parametrize("page_nbytes", [256, 40_000], ids=["one-group", "groups"])
def test_a_backup_from_row_runs_writes_the_same_pack_as_a_view_a_page(tmp_path, use_native, page_nbytes):
    """batch_set_rows writes runs of consecutive rows, a view a run (a view a page was ~1 CPU-s of a
    replay): the pack's bytes are those of batch_set, wherever the runs break and the groups are cut."""
    import numpy as np

    from tierkv.storage import native

    if use_native and native.pageio is None:
        from tests.conftest import skip_without_native
        skip_without_native("tierkv._pageio is not built")
    rows = np.random.default_rng(4).integers(0, 256, (100, page_nbytes), dtype=np.uint8)
    index = [7, 8, 9, 10, 3, 4, 50, *range(60, 90), 2, 99, 98, *range(20, 40)]  # runs of 1 to 30 rows
    keys = make_keys(len(index))
    by_views, by_runs = (open_store(f"file:{tmp_path / name}", "ns", page_nbytes) for name in ("views", "runs"))
    for store in (by_views, by_runs):
        store._native = native.pageio if use_native else None
    assert by_views.batch_set(keys, [torch.from_numpy(rows[i].copy()) for i in index]) == [True] * len(index)
    assert by_runs.batch_set_rows(keys, rows, index) == [True] * len(index)
    packs = [tmp_path / name / store.namespace_tag / pack_name(0) for name, store in
             (("views", by_views), ("runs", by_runs))]
    assert packs[0].read_bytes() == packs[1].read_bytes()
    targets = np.zeros_like(rows)
    assert by_runs.batch_get_rows(keys, targets, index) == [True] * len(index)
    assert (targets[index] == rows[index]).all()
    by_views.close()
    by_runs.close()


def test_row_runs_are_cut_into_groups_of_whole_pages():
    import numpy as np

    from tierkv.storage.file_write import RowRuns

    rows = np.arange(10 * 4, dtype=np.uint8).reshape(10, 4)
    runs = RowRuns(rows, np.array([2, 3, 4, 7, 8, 0]))
    assert runs.runs() == [(2, 3), (7, 2), (0, 1)] and len(runs[1:3]) == 2 and RowRuns(rows, []).runs() == []
    groups = runs.groups(group_nbytes=2 * 4)  # two pages a group
    assert [[bytes(v) for v in group] for group in groups] == [
        [rows[2:4].tobytes()], [rows[4].tobytes(), rows[7].tobytes()], [rows[8].tobytes(), rows[0].tobytes()]]
    assert [len(g) for g in runs.groups(group_nbytes=3)] == [1, 1, 1, 1, 1, 1]  # under a page: a page a group


def test_native_page_checksums_match_xxhash_and_refuse_partial_pages():
    import xxhash

    from tierkv.storage import native

    if native.pageio is None:
        from tests.conftest import skip_without_native
        skip_without_native("tierkv._pageio is not built")
    data = bytes(range(256)) * 10
    assert native.pageio.xxh3_pages([data[:512], data[1024:1280]], 256) == [
        xxhash.xxh3_64_intdigest(data[at:at + 256]) for at in (0, 256, 1024)]
    with pytest.raises(ValueError, match="not whole pages"):
        native.pageio.xxh3_pages([data[:300]], 256)


def test_a_bounded_store_cuts_a_backup_from_row_runs_into_small_packs(tmp_path):
    """A bounded store keeps each pack a 1/16 share of max_bytes, from row runs as from a view a page."""
    import numpy as np

    from tests.test_storage_backends import BLOB_NBYTES

    store = open_store(f"file:{tmp_path}", "ns", PAGE_NBYTES, {"max_bytes": 64 * BLOB_NBYTES})
    rows = np.random.default_rng(5).integers(0, 256, (40, PAGE_NBYTES), dtype=np.uint8)
    index, keys = [*range(5, 17), 30, 31, 0], make_keys(15)
    assert store.batch_set_rows(keys, rows, index) == [True] * 15
    assert len(list((tmp_path / store.namespace_tag).glob("*.pack"))) == 4  # 4 + 4 + 4 + 3 pages
    targets = np.zeros_like(rows)
    assert store.batch_get_rows(keys, targets, index) == [True] * 15 and (targets[index] == rows[index]).all()
    store.close()


def test_pages_wanted_are_grouped_by_pack_with_sorted_slots_and_reads_cut_into_runs():
    import numpy as np

    from tierkv.storage.file_pack import slot_groups
    from tierkv.storage.file_read import wanted_by_pack

    places = [3 << SLOT_BITS | 5, None, 1 << SLOT_BITS | 2, 3 << SLOT_BITS | 4, 3 << SLOT_BITS | 5, None,
              1 << SLOT_BITS | 0]
    grouped = wanted_by_pack(places)
    assert sorted(grouped) == [1, 3]
    assert grouped[1][0].tolist() == [0, 2] and grouped[1][1].tolist() == [6, 2]
    # a slot wanted twice is read twice, in batch order (a tuple sort's order)
    assert grouped[3][0].tolist() == [4, 5, 5] and grouped[3][1].tolist() == [3, 0, 4]
    assert wanted_by_pack([None, None]) == {} and wanted_by_pack([]) == {}
    slots = np.array([0, 1, 2, 3, 4, 7, 9, 10])
    assert slot_groups(slots, page_nbytes=10, group_nbytes=30) == [(0, 3), (3, 5), (5, 6), (6, 8)]
    assert slot_groups(slots, page_nbytes=10, group_nbytes=5) == [(i, i + 1) for i in range(8)]  # a page at least
    assert slot_groups([3, 4, 5, 9], page_nbytes=10) == [(0, 3), (3, 4)] and slot_groups([], page_nbytes=10) == []


def test_page_rows_merge_consecutive_rows_into_one_view():
    import numpy as np

    from tierkv.storage.file_read import PageRows, Picked

    rows = np.arange(8 * 4, dtype=np.uint8).reshape(8, 4)
    targets = PageRows(rows, np.array([5, 6, 7, 0, 2, 3]))
    pieces = targets.pieces(np.array([0, 1, 2, 4, 5, 3]))
    assert [bytes(p) for p in pieces] == [rows[5:8].tobytes(), rows[2:4].tobytes(), rows[0].tobytes()]
    assert bytes(targets[4]) == rows[2].tobytes() and len(targets) == 6 and targets.pieces(np.array([], int)) == []
    picked = Picked(targets, [3, 1])
    assert len(picked) == 2 and bytes(picked[0]) == rows[0].tobytes() and bytes(picked[1]) == rows[6].tobytes()


@pytest.mark.parametrize("use_native", [True, False], ids=["native", "python"])
@pytest.mark.parametrize("page_nbytes", [256, 40_000], ids=["one-group", "groups"])
def test_a_prefetch_into_row_runs_reads_what_a_view_a_page_reads(tmp_path, use_native, page_nbytes):
    """batch_get_rows reads runs of consecutive rows into a view a run: over several packs, with runs that
    break in the pack and in the rows, a key missing, a key twice and a corrupt page inside a run, it
    finds, fills and rejects exactly what batch_get does."""
    import numpy as np

    from tierkv.storage import native

    if use_native and native.pageio is None:
        from tests.conftest import skip_without_native
        skip_without_native("tierkv._pageio is not built")
    rng = np.random.default_rng(7)
    source = rng.integers(0, 256, (60, page_nbytes), dtype=np.uint8)
    keys = make_keys(60)
    stores = {name: open_store(f"file:{tmp_path / name}", "ns", page_nbytes) for name in ("views", "rows")}
    for store in stores.values():
        store._native = native.pageio if use_native else None
        for start in (0, 25, 40):  # three packs
            end = {0: 25, 25: 40, 40: 60}[start]
            assert store.batch_set_rows(keys[start:end], source, list(range(start, end))) == [True] * (end - start)
        path, payload_at, _ = store.page_extent(keys[12])  # corrupt one page in the middle of a run
        flip_byte(path, payload_at + 3, 0xFF)
    wanted = [*keys[10:20], "ab" * 8, keys[30], *keys[41:50], keys[5], keys[30]]
    rows_of = [*range(0, 10), 10, 11, *range(20, 29), 40, 45]
    views_store, rows_store = stores["views"], stores["rows"]
    targets = [torch.zeros(page_nbytes, dtype=torch.uint8) for _ in wanted]
    expected = views_store.batch_get(wanted, targets)
    sink = np.zeros((50, page_nbytes), dtype=np.uint8)
    assert rows_store.batch_get_rows(wanted, sink, rows_of) == expected
    assert expected == [True, True, False, *[True] * 7, False, *[True] * 12]
    for i, found in enumerate(expected):
        if found:
            assert (sink[rows_of[i]] == source[keys.index(wanted[i])]).all()
            assert torch.equal(targets[i], torch.from_numpy(sink[rows_of[i]]))
    assert rows_store.stats.corrupt_pages == views_store.stats.corrupt_pages == 1
    for store in stores.values():
        store.close()


@pytest.mark.parametrize("page_key", [None, "k" * 20], ids=["checksum", "mac"])
def test_pages_over_a_group_read_into_rows_are_checked_and_a_bad_one_is_a_miss(tmp_path, page_key):
    """Pages over GROUP_NBYTES read into pool rows one at a time (read_large: read_xxh3, or chunk by chunk for
    a MAC) land in their rows, and a page corrupted in its pack is a counted miss, its neighbours not."""
    import numpy as np

    page_nbytes = GROUP_NBYTES + 4096
    source = np.random.default_rng(9).integers(0, 256, (3, page_nbytes), dtype=np.uint8)
    keys = make_keys(3)
    store = open_store(f"file:{tmp_path}", "ns", page_nbytes, {"page_key": page_key} if page_key else None)
    assert store.batch_set_rows(keys, source, [0, 1, 2]) == [True] * 3
    path, payload_at, _ = store.page_extent(keys[1])
    flip_byte(path, payload_at + page_nbytes - 1, 0x10)
    sink = np.zeros((4, page_nbytes), dtype=np.uint8)
    assert store.batch_get_rows(keys, sink, [3, 0, 1]) == [True, False, True]
    assert (sink[3] == source[0]).all() and (sink[1] == source[2]).all() and store.stats.corrupt_pages == 1
    store.close()
