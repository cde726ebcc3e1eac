"""The native page I/O (tierkv/_pageio.c): batched xxh3 checksums, copies of replies into pages that
checksum as they copy, one call per batch without the GIL, and the xxh3-128 chain of page hashes.
``pageio`` is the module, or None when it is not built, is another version, or cannot reach the xxhash
package's xxh3 (then the stores and page_hashes use their Python loops).

The C side takes xxh3 from the xxhash package's own shared object, so both paths compute the same
checksum; a known digest is checked here before the module is used.
"""

from __future__ import annotations

import logging
from types import ModuleType

import xxhash

log = logging.getLogger(__name__)

NATIVE_API_VERSION = 7  # the API_VERSION of tierkv/_pageio.c that the stores call


def bound(module: ModuleType | None) -> ModuleType | None:
    """``module`` bound to the xxhash package's xxh3 and checked against it, else None."""
    if module is None:
        return None
    if getattr(module, "API_VERSION", 0) != NATIVE_API_VERSION:
        log.warning("ignoring %s: API_VERSION %s, expected %s (a stale build?)", getattr(module, "__file__", module),
                    getattr(module, "API_VERSION", 0), NATIVE_API_VERSION)
        return None
    try:
        from xxhash import _xxhash
        if not module.bind_xxh3(_xxhash.__file__):
            return None
    except (ImportError, AttributeError, OSError):
        return None
    probe = bytes(range(256)) * 41 + b"tierkv"  # past xxh3's short-input paths, not a stripe multiple
    if module.xxh3_many([probe, probe[:100], b""]) != [xxhash.xxh3_64_intdigest(p) for p in (probe, probe[:100], b"")]:
        log.warning("tierkv._pageio: xxh3 from %s disagrees with the xxhash package; not used", _xxhash.__file__)
        return None
    prior, tag = xxhash.xxh3_128_digest(b"prior"), b"\x01"
    chained = xxhash.xxh3_128_digest(xxhash.xxh3_128_digest(prior + tag + probe[:100]) + tag + probe[100:200])
    if module.chain_xxh3_128(prior, tag, probe[:200], 100)[1] != chained.hex():
        log.warning("tierkv._pageio: xxh3-128 from %s disagrees with the xxhash package; not used", _xxhash.__file__)
        return None
    keys = ["00ff" * 8, "caf\u00e9"]
    try:
        key_digests = module.key_digests(keys)
    except RuntimeError:  # XXH64 not found in that library (every xxhash release has it)
        key_digests = None
    if key_digests != b"".join(xxhash.xxh64_digest(k.encode()) for k in keys):
        log.warning("tierkv._pageio: xxh64 from %s is missing or disagrees with the xxhash package; not used",
                    _xxhash.__file__)
        return None
    return module


try:
    from tierkv import _pageio  # type: ignore[attr-defined]
except ImportError:
    _pageio = None
pageio: ModuleType | None = bound(_pageio)
