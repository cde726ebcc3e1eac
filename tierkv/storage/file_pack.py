"""Pack files of the file store: the pages of one ``batch_set`` in one file, and the index that finds them.

A pack holds ``count`` pages: their payloads back to back from offset 0 (so each payload keeps the
alignment of a page multiple), then their 48-byte headers (:mod:`tierkv.storage.page_format`), then
their keys (ASCII, newline-separated), then a 16-byte footer: magic ``b"TKVPACK1"``, ``count`` and the
keys' length (u32 little-endian each). A reader that knows ``count`` finds every page and header
without reading the footer; a store opening the directory reads each footer and key list once.

Packs are named by a number drawn from the directory's counter file (:data:`COUNTER_NAME`, under an
``fcntl`` lock), so names never collide across processes, and a process finds the packs others wrote
since it last looked by opening the numbers between what it has seen and the counter: no directory
listing on a miss.

:class:`PackIndex` maps each page's key to its pack and slot, and keeps packs in recency order with
their live page counts: a pack whose pages were all rewritten elsewhere or dropped is removed, and a
bounded store evicts whole packs, least recently used first.
"""

from __future__ import annotations

import fcntl
import itertools
import operator
import os
import struct
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from tierkv.storage.page_format import HEADER_SIZE

PACK_SUFFIX = ".pack"
COUNTER_NAME = ".packs"
PACK_MAGIC = b"TKVPACK1"
_FOOTER = struct.Struct("<8sII")
FOOTER_NBYTES = _FOOTER.size
# A number drawn but not yet seen as a pack (its writer is still writing, or it failed) is looked for
# again on later misses, until this many newer numbers have been drawn; then it is given up.
PENDING_WINDOW = 1024
IOV_MAX = 1024  # buffers per preadv/pwritev call (Linux's UIO_MAXIOV)
# The index keeps a page's place as one int, pack number << SLOT_BITS | slot: a (number, slot) tuple a page
# cost a tuple made in a Python loop per page written (~1 us a page in a replay, most of indexing a pack)
# and more memory; an int range zipped with the keys builds a pack's entries in C.
SLOT_BITS = 32
SLOT_MASK = (1 << SLOT_BITS) - 1


def pack_name(number: int) -> str:
    return f"{number:016x}{PACK_SUFFIX}"


def pack_number(name: str) -> int | None:
    """The number of a pack file's name; None for any other name."""
    stem = name[:-len(PACK_SUFFIX)]
    if not name.endswith(PACK_SUFFIX) or len(stem) != 16 or stem.strip("0123456789abcdef"):
        return None
    return int(stem, 16)


def pack_nbytes(count: int, payload_nbytes: int, keys_nbytes: int) -> int:
    """The size of a pack of ``count`` pages whose key list takes ``keys_nbytes``."""
    return count * (payload_nbytes + HEADER_SIZE) + keys_nbytes + FOOTER_NBYTES


def pack_trailer(keys: list[str]) -> bytes:
    """The key list and the footer that end a pack of ``keys``."""
    names = "\n".join(keys).encode("ascii")
    return names + _FOOTER.pack(PACK_MAGIC, len(keys), len(names))


def read_pack_keys(fd: int, size_bytes: int, payload_nbytes: int) -> list[str] | None:
    """The keys of the pack open at ``fd`` (``size_bytes`` long); None if it is not a whole pack."""
    if size_bytes < FOOTER_NBYTES:
        return None
    magic, count, keys_nbytes = _FOOTER.unpack(os.pread(fd, FOOTER_NBYTES, size_bytes - FOOTER_NBYTES))
    if magic != PACK_MAGIC or size_bytes != pack_nbytes(count, payload_nbytes, keys_nbytes):
        return None
    raw = os.pread(fd, keys_nbytes, size_bytes - FOOTER_NBYTES - keys_nbytes)
    try:
        keys = raw.decode("ascii").split("\n") if count else []
    except UnicodeDecodeError:
        return None
    return keys if len(keys) == count and len(raw) == keys_nbytes else None


def pack_numbers(places: list[int | None]) -> dict[int, None]:
    """The pack numbers of index ``places`` (None: not stored), each once, in order of first appearance:
    the leading run of stored places in one C loop (a Python expression a place cost ~0.5 s of a replay's
    exists calls), the rest one by one."""
    run = places.index(None) if None in places else len(places)
    numbers = dict.fromkeys(map(operator.rshift, places[:run], itertools.repeat(SLOT_BITS, run)))
    numbers.update(dict.fromkeys(place >> SLOT_BITS for place in places[run:] if place is not None))
    return numbers


def pack_pages(path: str) -> list[tuple[str, int, int]]:
    """(key, payload offset, payload bytes) of each page in the pack file at ``path`` (for tools and
    tests that look at a store's files); [] if it is not a whole pack."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size < FOOTER_NBYTES:
            return []
        magic, count, keys_nbytes = _FOOTER.unpack(os.pread(f.fileno(), FOOTER_NBYTES, size - FOOTER_NBYTES))
        if magic != PACK_MAGIC or not count or (size - FOOTER_NBYTES - keys_nbytes) % count:
            return []
        payload_nbytes = (size - FOOTER_NBYTES - keys_nbytes) // count - HEADER_SIZE
        keys = read_pack_keys(f.fileno(), size, payload_nbytes)
    return [] if keys is None else [(key, slot * payload_nbytes, payload_nbytes) for slot, key in enumerate(keys)]


def run_bounds(values: Sequence[int] | np.ndarray) -> list[int]:
    """Where the runs of consecutive ``values`` start, then ``len(values)``: run i is
    ``values[bounds[i]:bounds[i + 1]]`` (one numpy pass)."""
    return [0, *(np.flatnonzero(np.diff(values) != 1) + 1).tolist(), len(values)]


def slot_groups(slots: Sequence[int] | np.ndarray, page_nbytes: int, group_nbytes: int = 1 << 20
                ) -> list[tuple[int, int]]:
    """(start, end) index ranges of ``slots`` (sorted): runs of consecutive slots of at most
    ``group_nbytes`` (at least one page each), each read or written in one call. The runs' bounds are
    found in one numpy pass (a read of 4,096 small pages looped over them one by one)."""
    per_group = max(1, group_nbytes // page_nbytes)
    bounds = run_bounds(slots)
    return [(at, min(at + per_group, end)) for start, end in zip(bounds, bounds[1:])
            for at in range(start, end, per_group)]


def read_run(fd: int, views: list[memoryview], offset: int) -> int:
    """Read into ``views`` back to back from ``offset`` (one ``preadv`` per 1,024 views unless the kernel
    gives less); the bytes read, short only at the end of the file."""
    done, total = 0, sum(len(v) for v in views)
    while views:
        got = os.preadv(fd, views[:IOV_MAX], offset + done)
        if got == 0:
            break
        done += got
        views = consumed(views, got)
    return min(done, total)


def consumed(buffers: list[memoryview], nbytes: int) -> list[memoryview]:
    """``buffers`` less their first ``nbytes`` bytes (what one vectored call moved)."""
    i = 0
    while i < len(buffers) and nbytes >= len(buffers[i]):
        nbytes -= len(buffers[i])
        i += 1
    rest = buffers[i:]
    if rest and nbytes:
        rest[0] = rest[0][nbytes:]
    return rest


class PackCounter:
    """The directory's shared pack counter: ``draw`` reserves the next number, ``peek`` reads how many
    have been drawn (8 bytes little-endian; ``flock`` excludes other processes, a lock this process's
    threads, which share the one open file description)."""

    def __init__(self, dir_fd: int) -> None:
        self._fd = os.open(COUNTER_NAME, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644,
                           dir_fd=dir_fd)
        self._lock = threading.Lock()

    def peek(self) -> int:
        return int.from_bytes(os.pread(self._fd, 8, 0).ljust(8, b"\0"), "little")

    def draw(self) -> int:
        with self._lock:
            fcntl.flock(self._fd, fcntl.LOCK_EX)
            try:
                number = self.peek()
                os.pwrite(self._fd, (number + 1).to_bytes(8, "little"), 0)
            finally:
                fcntl.flock(self._fd, fcntl.LOCK_UN)
        return number

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


@dataclass
class PackInfo:
    """One pack the index knows: its keys by slot, its file size and how many of its slots are live."""

    keys: list[str]
    size_bytes: int
    live: int


class PackIndex:
    """Where each page is (pack number and slot: one int, see SLOT_BITS), and the packs in recency order
    (least recent first).

    Not thread-safe on its own: the store calls it under its own lock. Methods that make packs
    unreachable return their numbers: the caller removes those files.
    """

    def __init__(self, max_bytes: int | None) -> None:
        self.max_bytes = max_bytes
        self.size_bytes = 0
        self.pages: dict[str, int] = {}  # key -> number << SLOT_BITS | slot
        self.packs: OrderedDict[int, PackInfo] = OrderedDict()
        self.seen_up_to = 0  # every number below this was written by us, found, or is pending
        self.pending: set[int] = set()

    def __len__(self) -> int:
        return len(self.pages)

    def locate(self, key: str) -> tuple[int, int, int] | None:
        """(pack number, slot, pages in that pack) of ``key``, or None."""
        where = self.pages.get(key)
        if where is None:
            return None
        number = where >> SLOT_BITS
        return number, where & SLOT_MASK, len(self.packs[number].keys)

    def add(self, number: int, keys: list[str], size_bytes: int) -> list[tuple[int, PackInfo]]:
        """Index pack ``number`` holding ``keys`` as the most recent (a later pack's page replaces an
        earlier one's); the packs to remove: those left without live pages, then the least recently
        used ones over the bound."""
        self.pending.discard(number)
        if number in self.packs:
            return []
        if len(keys) > SLOT_MASK + 1:
            raise ValueError(f"a pack of {len(keys)} pages: at most {SLOT_MASK + 1}")
        info = PackInfo(keys, size_bytes, 0)
        self.packs[number] = info
        self.size_bytes += size_bytes
        dead = []
        # One dict for the whole pack, built in C (a key twice: its last slot), merged in one update; only
        # the keys another pack holds already are looked at one by one, in slot order.
        first = number << SLOT_BITS
        fresh = dict(zip(keys, range(first, first + len(keys))))
        for key in sorted(fresh.keys() & self.pages.keys(), key=fresh.__getitem__):
            old = self.pages[key] >> SLOT_BITS
            if old > number:  # a newer pack already holds this page
                del fresh[key]
            elif self._release(old):
                dead.append(old)
        self.pages.update(fresh)
        info.live = len(fresh)
        if not info.live:
            dead.append(number)
        return [(pack, self._forget(pack)) for pack in dead] + self._over_bound(number)

    def touch(self, number: int) -> None:
        if number in self.packs:
            self.packs.move_to_end(number)

    def drop_page(self, key: str) -> tuple[int, PackInfo] | None:
        """Forget ``key``'s page; its pack if that left the pack without live pages."""
        where = self.pages.pop(key, None)
        if where is None or not self._release(where >> SLOT_BITS):
            return None
        return where >> SLOT_BITS, self._forget(where >> SLOT_BITS)

    def drop_pack(self, number: int) -> PackInfo | None:
        """Forget pack ``number`` and the pages it holds (its file is gone or bad)."""
        return self._forget(number) if number in self.packs else None

    def clear(self) -> None:
        self.pages.clear()
        self.packs.clear()
        self.pending.clear()
        self.size_bytes = 0

    def _release(self, number: int) -> bool:
        info = self.packs[number]
        info.live -= 1
        return info.live == 0

    def _forget(self, number: int) -> PackInfo:
        info = self.packs.pop(number)
        self.size_bytes -= info.size_bytes
        first = number << SLOT_BITS
        for slot, key in enumerate(info.keys):
            if self.pages.get(key) == first + slot:
                del self.pages[key]
        return info

    def _over_bound(self, keep: int) -> list[tuple[int, PackInfo]]:
        """Least recently used packs (never ``keep``) removed until the index fits ``max_bytes``."""
        victims = []
        while self.max_bytes is not None and self.size_bytes > self.max_bytes and len(self.packs) > 1:
            victim = next(iter(self.packs))
            if victim == keep:
                self.packs.move_to_end(keep)
                victim = next(iter(self.packs))
            victims.append((victim, self._forget(victim)))
        return victims

    def drew(self, number: int) -> None:
        """This process drew ``number``: the numbers others drew before it are still to look for."""
        if number >= self.seen_up_to:
            self.pending.update(range(max(self.seen_up_to, number - PENDING_WINDOW), number))
            self.seen_up_to = number + 1
        else:
            self.pending.discard(number)

    def numbers_to_look_for(self, drawn: int) -> list[int]:
        """The pack numbers that may hold pages written by others since the last look, given that
        ``drawn`` numbers have been drawn; numbers too old to still be in flight are given up."""
        if drawn > self.seen_up_to:
            self.pending.update(range(max(self.seen_up_to, drawn - PENDING_WINDOW), drawn))
            self.seen_up_to = drawn
        self.pending = {n for n in self.pending if n >= drawn - PENDING_WINDOW and n not in self.packs}
        return sorted(self.pending)
