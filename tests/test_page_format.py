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


SECRET = b"0123456789abcdef-secret"


def test_keyed_pages_carry_a_mac_over_header_and_payload():
    keyed, plain = PageFormat("ns", 1000, SECRET), PageFormat("ns", 1000)
    payload = memoryview(bytes(range(256)) * 3 + bytes(232))
    header = keyed.header(KEY, payload)
    assert len(header) == HEADER_SIZE
    keyed.verify(KEY, header, payload)
    flipped = bytearray(payload)
    flipped[500] ^= 1
    for match, args in [
        ("carries no MAC", (KEY, plain.header(KEY, payload), payload)),  # a valid xxh3 page, planted
        ("MAC mismatch", (KEY, PageFormat("ns", 1000, SECRET[::-1]).header(KEY, payload), payload)),
        ("MAC mismatch", (OTHER, header, payload)),
        ("MAC mismatch", (KEY, header, memoryview(flipped))),
        ("another namespace", (KEY, PageFormat("ns2", 1000, SECRET).header(KEY, payload), payload)),
    ]:
        with pytest.raises(PageFormatError, match=match):
            keyed.verify(*args)
    with pytest.raises(PageFormatError, match="carries a MAC"):
        plain.verify(KEY, header, payload)
    # The same MAC, however the payload hasher was fed (one shot or chunk by chunk while copying).
    dst = bytearray(1000)
    state = copy_with_checksum(memoryview(dst), payload, keyed.payload_hasher(KEY))
    assert keyed.header(KEY, payload, state) == header


@pytest.mark.parametrize("bad", [b"short", "", 12345, b"x" * 15])
def test_weak_page_keys_are_refused_without_being_shown(bad):
    with pytest.raises(ValueError, match="page_key") as err:
        PageFormat("ns", 4, bad)
    if bad:
        assert str(bad) not in str(err.value) and repr(bad) not in str(err.value)


def test_chunked_copy_checksum_equals_one_shot():
    src = memoryview(bytes(range(256)) * 5000)  # several chunks plus a tail
    dst = bytearray(len(src))
    assert copy_with_checksum(memoryview(dst), src).intdigest() == checksum(src) == xxhash.xxh3_64_intdigest(src)
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
