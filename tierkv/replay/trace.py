"""Mooncake-format request traces: parsing with line-numbered errors, and deterministic token expansion.

One JSON object a line: ``timestamp`` (ms), ``input_length``, ``output_length`` and ``hash_ids``, one id
per 512-token block of the prompt, each id standing for the block *and everything before it*.

Expansion: block id ``b`` becomes the token ids ``b * 512 + i`` for ``i`` in ``0..511`` and the prompt is
cut to ``input_length``. Equal ids give equal tokens, different ids give disjoint tokens, so two prompts
share a token prefix exactly as far as they share block ids (then a partial block, if its id matches).
Generated tokens (``--include-output``) are unique per request and never collide with prompt tokens.
"""

from __future__ import annotations

import gzip
import json
import math
from array import array
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

BLOCK_TOKENS = 512
# Output tokens live above every prompt token: prompt ids stay below 2**40 for ids < 2**31.
_OUTPUT_BASE = 1 << 40
_OUTPUT_STRIDE = 1 << 22  # > any plausible output_length, so requests never share output tokens
# 16 M tokens: 100x the longest prompt of the Mooncake traces; a line past it is a typo, not a prompt, and
# expanding it would exhaust memory long before the replay could report anything.
MAX_INPUT_TOKENS = 1 << 24
_BLOCK_OFFSETS = np.arange(BLOCK_TOKENS, dtype=np.int64)


class TraceError(ValueError):
    """A bad trace line; the message names the file's line number."""

    def __init__(self, line_no: int, reason: str) -> None:
        super().__init__(f"trace line {line_no}: {reason}")
        self.line_no = line_no
        self.reason = reason


@dataclass(frozen=True)
class TraceRequest:
    """One request of the trace. ``index`` counts accepted requests from 0; ``line_no`` counts from 1."""

    index: int
    line_no: int
    timestamp_ms: int
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]

    def prompt_tokens(self) -> list[int]:
        """The prompt's token ids: each block id expanded to 512 ids, cut to ``input_length``."""
        tokens: list[int] = []
        for block_id in self.hash_ids:
            start = block_id * BLOCK_TOKENS
            tokens.extend(range(start, start + BLOCK_TOKENS))
        del tokens[self.input_length:]
        return tokens

    def prompt_array(self) -> np.ndarray:
        """:meth:`prompt_tokens` as an int64 numpy array, built in C (the replay's hot path: a Python list
        of a 12k-token prompt costs ~30 ns a token to build and as much again to check as a key)."""
        blocks = np.fromiter(self.hash_ids, dtype=np.int64, count=len(self.hash_ids))
        return (blocks[:, None] * BLOCK_TOKENS + _BLOCK_OFFSETS).reshape(-1)[: self.input_length]

    def output_tokens(self) -> list[int]:
        """Stand-ins for the generated tokens: unique to this request."""
        start = _OUTPUT_BASE + self.index * _OUTPUT_STRIDE
        return list(range(start, start + self.output_length))

    def block_token_counts(self) -> list[int]:
        """Prompt tokens of each block: 512, except the last, which may be partial."""
        counts = [BLOCK_TOKENS] * len(self.hash_ids)
        if counts:
            counts[-1] = self.input_length - BLOCK_TOKENS * (len(counts) - 1)
        return counts


class TraceRequests(Sequence[TraceRequest]):
    """Requests kept as columns of ints (block ids end to end), each item a :class:`TraceRequest` made when
    read: ~100 B a request where the objects took ~1 KB, so a long trace costs little memory."""

    _COLUMNS = ("index", "line_no", "timestamp_ms", "input_length", "output_length")

    def __init__(self, requests: Iterable[TraceRequest] = ()) -> None:
        self._columns = {name: array("q") for name in self._COLUMNS}
        self._blocks = array("q")
        self._block_ends = array("q")  # request i's block ids: _blocks[_block_ends[i - 1]:_block_ends[i]]
        for req in requests:
            self.append(req)

    def append(self, req: TraceRequest) -> None:
        for name, column in self._columns.items():
            column.append(getattr(req, name))
        self._blocks.extend(req.hash_ids)
        self._block_ends.append(len(self._blocks))

    def __len__(self) -> int:
        return len(self._block_ends)

    def __getitem__(self, i):  # type: ignore[override]
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        if i < 0:
            i += len(self)
        ends, cols = self._block_ends, self._columns
        start = ends[i - 1] if i > 0 else 0
        return TraceRequest(cols["index"][i], cols["line_no"][i], cols["timestamp_ms"][i], cols["input_length"][i],
                            cols["output_length"][i], tuple(self._blocks[start:ends[i]]))

    def __iter__(self) -> Iterator[TraceRequest]:
        return (self[i] for i in range(len(self)))

    def __eq__(self, other: object) -> bool:
        if isinstance(other, TraceRequests):
            return (self._columns, self._blocks, self._block_ends) == (other._columns, other._blocks,
                                                                      other._block_ends)
        return isinstance(other, Sequence) and list(self) == list(other)

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"TraceRequests({len(self)} requests)"

    def block_columns(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Every request's block ids end to end, each request's block count and its prompt length (numpy,
        no copy of the block ids)."""
        ends = np.frombuffer(self._block_ends, dtype=np.int64)
        return (np.frombuffer(self._blocks, dtype=np.int64), np.diff(ends, prepend=0),
                np.frombuffer(self._columns["input_length"], dtype=np.int64))

    @property
    def prompt_tokens(self) -> int:
        return sum(self._columns["input_length"])


@dataclass
class Trace:
    """Accepted requests, in file order, and the bad lines skipped (only with ``skip_bad``)."""

    requests: TraceRequests
    bad_lines: list[TraceError] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not isinstance(self.requests, TraceRequests):
            self.requests = TraceRequests(self.requests)

    @property
    def prompt_tokens(self) -> int:
        return self.requests.prompt_tokens


def _int_field(obj: dict, name: str, line_no: int, minimum: int) -> int:
    if name not in obj:
        raise TraceError(line_no, f"missing field {name!r}")
    value = obj[name]
    if not isinstance(value, int) or isinstance(value, bool):
        raise TraceError(line_no, f"field {name!r} must be an int, got {value!r}")
    if value < minimum:
        raise TraceError(line_no, f"field {name!r} must be >= {minimum}, got {value}")
    return value


def parse_line(text: str | bytes, line_no: int, index: int) -> TraceRequest:
    """Parse one trace line (text, or UTF-8 bytes); raises :class:`TraceError` naming ``line_no`` on any defect."""
    if isinstance(text, bytes):
        try:
            text = text.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise TraceError(line_no, f"not UTF-8 (bad byte at column {exc.start + 1})") from None
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as exc:
        raise TraceError(line_no, f"malformed JSON ({exc.msg} at column {exc.colno})") from None
    except RecursionError:  # the decoder recurses per nesting level
        raise TraceError(line_no, "JSON nested too deeply") from None
    if not isinstance(obj, dict):
        raise TraceError(line_no, f"expected a JSON object, got {type(obj).__name__}")
    timestamp_ms = _int_field(obj, "timestamp", line_no, 0)
    input_length = _int_field(obj, "input_length", line_no, 1)
    output_length = _int_field(obj, "output_length", line_no, 0)
    if input_length > MAX_INPUT_TOKENS:
        raise TraceError(line_no, f"input_length {input_length} is over the limit of {MAX_INPUT_TOKENS} tokens")
    if "hash_ids" not in obj:
        raise TraceError(line_no, "missing field 'hash_ids'")
    hash_ids = obj["hash_ids"]
    if not isinstance(hash_ids, list) or not all(
            isinstance(h, int) and not isinstance(h, bool) and 0 <= h < 2**31 for h in hash_ids):
        raise TraceError(line_no, "field 'hash_ids' must be a list of ints in [0, 2**31)")
    expected = math.ceil(input_length / BLOCK_TOKENS)
    if len(hash_ids) != expected:
        raise TraceError(line_no, f"len(hash_ids) is {len(hash_ids)} but input_length {input_length} "
                                  f"needs ceil({input_length}/{BLOCK_TOKENS}) = {expected}")
    if output_length >= _OUTPUT_STRIDE:
        raise TraceError(line_no, f"output_length {output_length} is over {_OUTPUT_STRIDE - 1}")
    return TraceRequest(index, line_no, timestamp_ms, input_length, output_length, tuple(hash_ids))


def parse_lines(lines: Iterable[str | bytes], limit: int | None = None, skip_bad: bool = False) -> Trace:
    """Parse trace lines (blank lines ignored); the first ``limit`` accepted requests at most.

    A bad line raises :class:`TraceError`, or with ``skip_bad`` is recorded in ``Trace.bad_lines``.
    """
    if limit is not None and (not isinstance(limit, int) or limit < 0):
        raise ValueError(f"limit must be an int >= 0, got {limit!r}")
    trace = Trace(TraceRequests())
    for line_no, text in enumerate(lines, start=1):
        if limit is not None and len(trace.requests) >= limit:
            break
        if not text.strip():
            continue
        try:
            trace.requests.append(parse_line(text, line_no, len(trace.requests)))
        except TraceError as exc:
            if not skip_bad:
                raise
            trace.bad_lines.append(exc)
    return trace


def load_trace(path: str | Path, limit: int | None = None, skip_bad: bool = False) -> Trace:
    """Read a JSONL trace file, gzipped when its name ends in ``.gz``; see :func:`parse_lines`.

    Lines are read as bytes and decoded one by one, so a line that is not UTF-8 is a :class:`TraceError`
    naming it (skippable), not a decoding error of the whole file.
    """
    opener = gzip.open if str(path).endswith(".gz") else open
    try:
        with opener(path, "rb") as f:
            return parse_lines(f, limit, skip_bad)
    except (gzip.BadGzipFile, EOFError) as exc:
        raise ValueError(f"trace {str(path)!r} is not a readable gzip file: {exc}") from None
