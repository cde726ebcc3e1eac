"""Several processes sharing one bounded file L3 keep the directory as a whole within its bound.

Each process's own LRU index bounds only the pages it knows; the directory's shared ledger
(tierkv/storage/file_budget.py) bounds them all: at any moment the pages on disk are at most
``max_bytes`` plus the batches written but not yet counted, one per writing process.
"""

from __future__ import annotations

import multiprocessing as mp
from pathlib import Path

from tests.test_storage_backends import BLOB_NBYTES, PAGE_NBYTES, make_keys, make_pages
from tierkv.storage.factory import open_store

NUM_PROCESSES = 4
BATCH_PAGES = 2
MAX_PAGES = 16
PAGES_PER_PROCESS = 3 * MAX_PAGES  # each process alone writes three times the bound


def _pages_on_disk(root: str) -> list[Path]:  # pack files: each batch of pages is one
    return [p for p in Path(root).rglob("*.pack")]


def _bytes_on_disk(root: str) -> int:
    """Page bytes in ``root`` now; a page another process removes while we look counts as gone."""
    total = 0
    for page in _pages_on_disk(root):
        try:
            total += page.stat().st_size
        except FileNotFoundError:
            pass
    return total


def _writer(root: str, worker: int, start, result) -> None:
    """Write this worker's own pages batch by batch; the most page bytes seen on disk after a batch."""
    store = open_store(f"file://{root}", "ns", PAGE_NBYTES, {"max_bytes": MAX_PAGES * BLOB_NBYTES})
    keys = make_keys(PAGES_PER_PROCESS, seed=100 + worker)
    pages = make_pages(BATCH_PAGES, seed=worker)
    start.wait()
    most = 0
    for first in range(0, PAGES_PER_PROCESS, BATCH_PAGES):
        assert store.batch_set(keys[first:first + BATCH_PAGES], pages) == [True] * BATCH_PAGES
        most = max(most, _bytes_on_disk(root))
    result.put(most)
    store.close()


def test_processes_sharing_a_bounded_directory_stay_within_the_bound(tmp_path):
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "tierkv.storage.file"])
    start, result = ctx.Event(), ctx.Queue()
    workers = [ctx.Process(target=_writer, args=(str(tmp_path), w, start, result)) for w in range(NUM_PROCESSES)]
    for worker in workers:
        worker.start()
    start.set()
    most_seen = [result.get(timeout=300) for _ in workers]
    for worker in workers:
        worker.join(60)
        assert worker.exitcode == 0
    bound = (MAX_PAGES + NUM_PROCESSES * BATCH_PAGES) * BLOB_NBYTES
    final = _bytes_on_disk(str(tmp_path))
    assert final <= bound, f"{final / (MAX_PAGES * BLOB_NBYTES):.2f}x max_bytes on disk"
    assert max(most_seen) <= bound, f"{max(most_seen) / (MAX_PAGES * BLOB_NBYTES):.2f}x max_bytes seen"
    assert final >= MAX_PAGES * BLOB_NBYTES // 2  # the store still holds pages: bounded, not emptied
    reader = open_store(f"file://{tmp_path}", "ns", PAGE_NBYTES, {"max_bytes": MAX_PAGES * BLOB_NBYTES})
    assert reader.size_bytes <= bound
