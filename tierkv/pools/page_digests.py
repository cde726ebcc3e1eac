"""Each host page's xxh3-64 checksum as the L1 -> L2 copy that wrote it computed it in the same pass
(tierkv/copy/_rowcopy_hash.c), kept beside the host pool so that an L3 backup of the page writes its header
without reading the page again: a store whose own transfer copies the page (Mooncake's transfer engine)
cannot hash inside that copy, so without a digest the checksum is a second pass over memory.

An entry holds only while its page keeps the bytes that copy wrote. The hashed copy clears a page's flag
before writing it and sets it after; the host pool clears it when it hands the page out again (a host page
is written only once allocated: by a write to L2, or a prefetch from L3) and when anything else writes the
page (:meth:`HostKVPool.write_page`, :meth:`HostKVPool.scatter_pages`); a copy that cannot hash clears the
entries of the pages it writes. A digest that does not describe the stored bytes could only cost a miss,
never wrong KV: a store's reader checks the stored header against the payload it reads.

Off until an L3 store that takes digests is attached (:meth:`enable`, one way): otherwise no copy hashes.
Thread contract: the scheduler thread clears entries (allocation), the transfer worker records them, the
backup worker reads them; each touches only pages it owns at that moment, so no lock is needed.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch


class PageDigests:
    """Per host page: ``values`` (uint64 xxh3-64 of its bytes) and ``valid`` (uint8 flag), written in place
    by the native hashed copy, which holds both arrays."""

    def __init__(self, num_pages: int, page_size: int) -> None:
        self.values = np.zeros(num_pages, dtype=np.uint64)
        self.valid = np.zeros(num_pages, dtype=np.uint8)
        self.page_size = page_size
        self.enabled = False

    def enable(self) -> None:
        """Start keeping digests (an L3 store that takes them is attached). Never turned off: an entry made
        while on is cleared by every later rewrite only while it is on."""
        self.enabled = True

    def forget_pages(self, pages: Sequence[int] | np.ndarray | torch.Tensor) -> None:
        """Clear the entries of these pages (they are being written by something that does not hash)."""
        if self.enabled:
            self.valid[_int_array(pages)] = 0

    def forget_slots(self, slots: torch.Tensor | np.ndarray) -> None:
        """Clear the entries of the whole pages of these token slots (just allocated, or about to be written)."""
        if self.enabled:
            self.valid[_int_array(slots)[::self.page_size] // self.page_size] = 0

    def lookup(self, pages: Sequence[int] | np.ndarray) -> list[int | None]:
        """Each page's digest, or None where no valid one is kept (the store then hashes that page)."""
        index = _int_array(pages)
        values, valid = self.values[index].tolist(), self.valid[index]
        if valid.all():
            return values
        return [value if ok else None for value, ok in zip(values, valid.tolist())]


def _int_array(items: Sequence[int] | np.ndarray | torch.Tensor) -> np.ndarray:
    if isinstance(items, torch.Tensor):
        return items.detach().cpu().numpy().astype(np.int64, copy=False).reshape(-1)
    return np.asarray(items, dtype=np.int64).reshape(-1)
