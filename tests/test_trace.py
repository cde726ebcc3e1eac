import gzip
import hashlib
import json
from pathlib import Path

import pytest

from tierkv.replay.trace import BLOCK_TOKENS, MAX_INPUT_TOKENS, TraceError, load_trace, parse_line, parse_lines

FIXTURE = Path(__file__).parent / "fixtures" / "conversation_200.jsonl"


def line(**fields):
    base = {"timestamp": 0, "input_length": 1000, "output_length": 5, "hash_ids": [7, 9]}
    base.update(fields)
    return json.dumps({k: v for k, v in base.items() if v is not None})


def test_expansion_is_cut_to_input_length_and_deterministic():
    req = parse_line(line(), 1, 0)
    tokens = req.prompt_tokens()
    assert len(tokens) == 1000
    assert tokens[:BLOCK_TOKENS] == list(range(7 * 512, 8 * 512))
    assert tokens[BLOCK_TOKENS:] == list(range(9 * 512, 9 * 512 + 1000 - 512))
    assert parse_line(line(), 5, 3).prompt_tokens() == tokens
    assert req.block_token_counts() == [512, 488]


def test_equal_ids_share_tokens_and_different_ids_do_not():
    a = parse_line(line(hash_ids=[1, 2, 3], input_length=1300), 1, 0).prompt_tokens()
    b = parse_line(line(hash_ids=[1, 2, 4], input_length=1536), 2, 1).prompt_tokens()
    assert a[:1024] == b[:1024]
    assert not set(a[1024:]) & set(b[1024:])


def test_output_tokens_are_unique_per_request_and_disjoint_from_prompts():
    r0 = parse_line(line(hash_ids=[0, 1]), 1, 0)
    r1 = parse_line(line(hash_ids=[0, 1]), 2, 1)
    assert len(r0.output_tokens()) == 5
    assert not set(r0.output_tokens()) & set(r1.output_tokens())
    assert not set(r0.output_tokens()) & set(r0.prompt_tokens())


@pytest.mark.parametrize("text, reason", [
    ("{not json", "malformed JSON"),
    ("[1, 2]", "expected a JSON object"),
    (line(input_length=None), "missing field 'input_length'"),
    (line(hash_ids=None), "missing field 'hash_ids'"),
    (line(timestamp=None), "missing field 'timestamp'"),
    (line(input_length=-3), "'input_length' must be >= 1"),
    (line(output_length=-1), "'output_length' must be >= 0"),
    (line(input_length="12"), "must be an int"),
    (line(hash_ids=[1, 2, 3]), "len(hash_ids) is 3 but input_length 1000"),
    (line(hash_ids=[1, "x"]), "list of ints"),
])
def test_bad_line_names_its_line_number(text, reason):
    with pytest.raises(TraceError) as info:
        parse_lines([line(), "", text, line()])
    assert info.value.line_no == 3
    assert str(info.value).startswith("trace line 3: ")
    assert reason in str(info.value)


def test_skip_bad_counts_and_skips():
    trace = parse_lines([line(), "{oops", line(input_length=-1), line(hash_ids=[1])], skip_bad=True)
    assert [r.line_no for r in trace.requests] == [1]
    assert [e.line_no for e in trace.bad_lines] == [2, 3, 4]
    assert [r.index for r in trace.requests] == [0]


def test_limit_and_fixture():
    trace = load_trace(FIXTURE, limit=10)
    assert len(trace.requests) == 10
    full = load_trace(FIXTURE)
    assert len(full.requests) == 200 and not full.bad_lines
    assert full.prompt_tokens == 873_883
    with pytest.raises(ValueError, match="limit"):
        parse_lines([], limit=-1)


def test_gzipped_trace_reads_like_the_plain_file(tmp_path):
    gz = tmp_path / "t.jsonl.gz"
    gz.write_bytes(gzip.compress(FIXTURE.read_bytes()))
    plain, packed = load_trace(FIXTURE, limit=50), load_trace(gz, limit=50)
    assert packed.requests == plain.requests and len(packed.requests) == 50


def test_a_corrupt_gzip_is_a_value_error_naming_the_file(tmp_path):
    bad = tmp_path / "t.jsonl.gz"
    bad.write_bytes(b"this is not gzip")
    with pytest.raises(ValueError, match="t.jsonl.gz"):
        load_trace(bad)


def test_a_non_utf8_line_names_its_line_and_can_be_skipped(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_bytes(line().encode() + b"\n" + b'{"timestamp": 0, "x": "\xff\xfe"}\n' + line().encode() + b"\n")
    with pytest.raises(TraceError, match="trace line 2: not UTF-8"):
        load_trace(path)
    trace = load_trace(path, skip_bad=True)
    assert len(trace.requests) == 2 and [b.line_no for b in trace.bad_lines] == [2]


def test_a_line_past_the_token_limit_is_an_error_not_a_memory_error():
    huge = MAX_INPUT_TOKENS + 1
    with pytest.raises(TraceError, match=f"trace line 1: input_length {huge} is over the limit"):
        parse_line(line(input_length=huge, hash_ids=[0]), 1, 0)


def test_the_shipped_trace_is_the_mooncake_conversation_trace():
    shipped = Path(__file__).parent.parent / "data" / "traces" / "conversation_trace.jsonl.gz"
    raw = gzip.decompress(shipped.read_bytes())
    notice = (shipped.parent / "README.md").read_text()
    assert hashlib.sha256(raw).hexdigest() in notice and "Apache License 2.0" in notice
    assert len(load_trace(shipped, limit=100).requests) == 100


def test_prompt_array_equals_prompt_tokens_on_the_fixture():
    """The replay's fast expansion (numpy) against the reference (Python list), partial blocks included."""
    requests = load_trace(FIXTURE).requests
    assert any(r.input_length % BLOCK_TOKENS for r in requests)
    for req in requests:
        array = req.prompt_array()
        assert array.dtype.name == "int64"
        assert array.tolist() == req.prompt_tokens()


def test_requests_are_kept_as_columns_and_read_back_as_requests():
    import pickle

    from tierkv.replay.trace import TraceRequest, TraceRequests

    plain = [TraceRequest(0, 1, 5, 600, 3, (7, 8)), TraceRequest(1, 3, 9, 10, 0, (2**31 - 1,))]
    columns = TraceRequests(plain)
    assert len(columns) == 2 and columns[1] == plain[1] and columns[-1] == plain[-1] and columns[:1] == plain[:1]
    assert list(columns) == plain and columns == plain and columns != plain[:1]
    assert pickle.loads(pickle.dumps(columns)) == columns
    assert load_trace(FIXTURE).requests == list(load_trace(FIXTURE).requests)
    with pytest.raises(IndexError):
        columns[2]
