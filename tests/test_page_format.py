import struct

import pytest
import xxhash

from tierkv.storage.page_format import (
    HEADER_SIZE, PageFormat, PageFormatError, checksum, copy_with_checksum,
)

KEY, OTHER = "ab" * 32, "cd" * 32


def test_header_round_trip_and_every_mismatch_is_named():
    fmt = PageFormat("ns", 1000)
    payload = memoryview(bytes(range(256)) * 3 + bytes(232))
    header = fmt.header(KEY, payload)
    assert len(header) == HEADER_SIZE
    fmt.verify(KEY, header, payload)
    for match, args in [
        ("another namespace", (KEY, PageFormat("ns2", 1000).header(KEY, payload), payload)),
        ("another key", (OTHER, header, payload)),
        ("checksum", (KEY, header, memoryview(bytes(1000)))),
        ("payload", (KEY, header, payload[:999])),
        ("format", (KEY, b"XXXX" + header[4:], payload)),
        ("header of 47", (KEY, header[:47], payload)),
    ]:
        with pytest.raises(PageFormatError, match=match):
            fmt.verify(*args)
    with pytest.raises(PageFormatError, match="expected 999"):
        PageFormat("ns", 999).verify(KEY, header, payload)


def test_a_newer_format_version_is_refused():
    fmt = PageFormat("ns", 4)
    header = bytearray(fmt.header(KEY, memoryview(b"abcd")))
    struct.pack_into("<H", header, 4, 2)
    with pytest.raises(PageFormatError, match="v2"):
        fmt.verify(KEY, header, memoryview(b"abcd"))


def test_chunked_copy_checksum_equals_one_shot():
    src = memoryview(bytes(range(256)) * 5000)  # several chunks plus a tail
    dst = bytearray(len(src))
    assert copy_with_checksum(memoryview(dst), src) == checksum(src) == xxhash.xxh3_64_intdigest(src)
    assert dst == src
    with pytest.raises(ValueError):
        copy_with_checksum(memoryview(dst)[1:], src)


def test_split_takes_the_header_from_the_end():
    fmt = PageFormat("ns", 4)
    blob = memoryview(b"abcd" + fmt.header(KEY, memoryview(b"abcd")))
    header, payload = fmt.split(blob)
    assert bytes(payload) == b"abcd" and len(header) == HEADER_SIZE
    fmt.verify(KEY, header, payload)
    short_header, empty = fmt.split(blob[:10])
    assert len(short_header) == 10 and len(empty) == 0
