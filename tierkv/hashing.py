"""Chained page hashes: the L3 key of a page names the page's tokens and every token before it.

hash(page_0) = H(seed, tokens of page_0); hash(page_i) = H(hash(page_i-1), tokens of page_i). The seed
comes from a :class:`HashNamespace` (model, tenant, KV layout, dtype, shape, TP shard) and the key's own
``extra_key``, so two models, two tenants or two TP layouts never compute the same key for the same
tokens. Keys are hex strings.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np
import xxhash

from tierkv.storage import native
from tierkv.validate import check_int, check_text

HASH_ALGORITHMS = ("sha256", "xxh3_128")
# A key names the whole prefix, so a pair-token (bigram) page must never hash like a flat page
# holding the same integers.
_FLAT_TAG = b"\x01"
_PAIR_TAG = b"\x02"
# Version of the key derivation; bumped whenever the same prefix would get a different key (v2: fields
# quoted in the namespace name; the request's extra key tagged, None apart from "").
HASH_FORMAT = "v2"


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _xxh3_128(data: bytes) -> str:
    return xxhash.xxh3_128_hexdigest(data)


def _sha256_digest(data: bytes) -> bytes:
    return hashlib.sha256(data).digest()


_HASHERS: dict[str, Callable[[bytes], str]] = {"sha256": _sha256, "xxh3_128": _xxh3_128}
# The same functions giving raw digests (hex(raw) == hex function): a chain runs on raw bytes and
# converts to hex once per page, not back and forth.
_RAW_HASHERS: dict[str, Callable[[bytes], bytes]] = {"sha256": _sha256_digest, "xxh3_128": xxhash.xxh3_128_digest}


def hash_function(algorithm: str) -> Callable[[bytes], str]:
    """The hex-digest function for ``algorithm``; ValueError for an unknown name."""
    try:
        return _HASHERS[algorithm]
    except KeyError:
        raise ValueError(f"hash algorithm {algorithm!r} is not one of {HASH_ALGORITHMS}") from None


@dataclass(frozen=True)
class HashNamespace:
    """Everything that makes two equal token prefixes hold different KV bytes."""

    model: str
    extra_key: str = ""
    kv_layout: str = ""
    kv_dtype: str = ""
    kv_shape: tuple[int, ...] = ()
    tp_rank: int = 0
    tp_size: int = 1
    algorithm: str = "sha256"

    def __post_init__(self) -> None:
        hash_function(self.algorithm)
        check_text("model", self.model, allow_empty=False)
        for name in ("extra_key", "kv_layout", "kv_dtype"):
            check_text(name, getattr(self, name))
        check_int("tp_size", self.tp_size, minimum=1)
        check_int("tp_rank", self.tp_rank, minimum=0, maximum=self.tp_size - 1)
        object.__setattr__(self, "kv_shape", tuple(int(d) for d in self.kv_shape))

    @classmethod
    def for_spec(cls, model: str, spec, host_layout: str, tp_rank: int = 0, tp_size: int = 1,
                 extra_key: str | None = None, algorithm: str = "sha256") -> "HashNamespace":
        """The namespace of one TP shard's pages, from a :class:`tierkv.pools.spec.KVSpec`.

        MLA's latent KV is not sharded: every rank holds the same bytes, so its pages are named without
        the rank and one copy in L3 serves every rank (HiCache's ``backup_skip``).
        """
        shape = (spec.num_kv, spec.num_layers, spec.heads, spec.dim)
        if spec.attention == "mla":
            tp_rank, tp_size = 0, 1
        return cls(model=model, extra_key=extra_key or "", kv_layout=f"{spec.attention}/{host_layout}",
                   kv_dtype=str(spec.dtype).removeprefix("torch."), kv_shape=shape, tp_rank=tp_rank,
                   tp_size=tp_size, algorithm=algorithm)

    def name(self) -> str:
        """A canonical, human-readable string of every field (also the store namespace).

        Strings appear as their ``repr`` (quoted and escaped), so no field's text can imitate another's.
        """
        shape = "x".join(str(d) for d in self.kv_shape)
        return (f"tierkv/{HASH_FORMAT}|model={self.model!r}|extra={self.extra_key!r}|layout={self.kv_layout!r}"
                f"|dtype={self.kv_dtype!r}|shape={shape}|tp={self.tp_rank}of{self.tp_size}"
                f"|hash={self.algorithm}")

    def seed(self, request_extra_key: str | None = None) -> str:
        """The prior hash of a sequence's first page (hex, in this namespace's algorithm).

        ``request_extra_key`` is the key's own ``extra_key`` (a tenant, a LoRA id): None, "" and every
        string give different seeds, and none equals the seed of the namespace's own ``extra_key``.
        """
        tenant = "none" if request_extra_key is None else f"str:{request_extra_key!r}"
        return hash_function(self.algorithm)(f"{self.name()}|request_extra={tenant}".encode())


def request_extra_key(tenant: str | None, salt: str | None) -> str | None:
    """A request's ``extra_key`` (its cache namespace) from its tenant and its ``cache_salt``; None for neither.

    No two (tenant, salt) pairs give the same key, whatever the separators or empty strings they hold:
    a tenant alone is ``tenant:T``, a salt alone ``salt:S`` (both as before), and the two together
    ``tenant+salt:<len(T)>:TS``, whose prefix neither single form can start with and whose length says
    where the tenant ends. (A plain join let tenant ``a`` with salt ``b`` meet tenant ``a|salt:b``.)
    """
    if tenant is None:
        return None if salt is None else f"salt:{salt}"
    if salt is None:
        return f"tenant:{tenant}"
    return f"tenant+salt:{len(tenant)}:{tenant}{salt}"


def token_bytes(tokens: Sequence) -> bytes:
    """Tokens (ints, or pairs of ints in bigram mode) as tagged little-endian int64 bytes."""
    array = np.asarray(tokens, dtype="<i8")
    return (_PAIR_TAG if array.ndim > 1 else _FLAT_TAG) + array.tobytes()


def page_hashes(tokens: Sequence, page_size: int, prior_hash: str | None,
                namespace: HashNamespace) -> list[str]:
    """Hashes of every whole page of ``tokens``, continuing the chain from ``prior_hash``.

    ``prior_hash`` is the hash of the page just before ``tokens[0]`` (a node's parent's last page), or
    None when ``tokens`` starts the sequence. A trailing partial page gets no hash.
    """
    if page_size < 1:
        raise ValueError(f"page_size must be >= 1, got {page_size!r}")
    hash_function(namespace.algorithm)  # ValueError for an unknown name
    digest = _RAW_HASHERS[namespace.algorithm]
    prior = bytes.fromhex(namespace.seed() if prior_hash is None else prior_hash)
    num_pages = len(tokens) // page_size
    if num_pages == 0:
        return []
    # one conversion for all pages (per-page numpy calls dominated hashing): page i's bytes are exactly
    # token_bytes(tokens[i * page_size:(i + 1) * page_size]); the chain stays in raw digests
    # (the bytes of token_bytes less its tag, without its two copies: ids already int64 are not copied at all)
    array = np.ascontiguousarray(np.asarray(tokens[:num_pages * page_size], dtype="<i8"))
    tag, data = (_PAIR_TAG if array.ndim > 1 else _FLAT_TAG), memoryview(array).cast("B")
    stride = len(data) // num_pages
    if namespace.algorithm == "xxh3_128" and native.pageio is not None:
        # the whole chain in one native call (~0.5 us a page in Python: the replay hashes ~2 million pages)
        return native.pageio.chain_xxh3_128(prior, tag, data, stride)
    digests = []
    for start in range(0, len(data), stride):
        prior = digest(prior + tag + data[start:start + stride])
        digests.append(prior)
    return [d.hex() for d in digests]
