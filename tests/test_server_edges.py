"""`tierkv serve` at the edges of the OpenAI API: authorization bytes, unexpected errors, the sampling fields
vLLM's and SGLang's clients send, ignore_eos, stream_options, /v1/models, ids, times and access-log reasons."""

import ast
import http.client
import json
import logging
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import openai
import pytest

from engine_helpers import reference, tiny_model
from engine_helpers import single_torch_thread  # noqa: F401  (autouse fixture)
from tierkv.engine.engine import Engine, EngineConfig
from tierkv.engine.server import CompletionServer
from tierkv.engine.tokenizer import ByteTokenizer

MODEL = "tiny-llama"


@pytest.fixture(scope="module")
def model():
    return tiny_model(MODEL)


def start_server(model, **kwargs) -> CompletionServer:
    return CompletionServer(Engine(model, EngineConfig(mode="l1", l1_tokens=2048)), model_name=MODEL,
                            **kwargs).start()


@pytest.fixture(scope="module")
def server(model):
    srv = start_server(model)
    yield srv
    srv.close()


@pytest.fixture(scope="module")
def keyed_server(model):
    srv = start_server(model, api_keys={"good-key": "alice"})
    yield srv
    srv.close()


def call(port: int, method: str, path: str, body: dict | None = None, headers: dict | None = None):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    conn.request(method, path, body=json.dumps(body).encode() if body is not None else None,
                 headers={"Content-Type": "application/json"} | (headers or {}))
    resp = conn.getresponse()
    data = resp.read()
    conn.close()
    if resp.getheader("Content-Type") == "application/json":
        return resp.status, json.loads(data)
    return resp.status, data.decode()


def completion(port: int, **fields):
    return call(port, "POST", "/v1/completions", {"prompt": "edge", "max_tokens": 2} | fields)


# ---- 24.5: authorization bytes ---------------------------------------------------------------------
@pytest.mark.parametrize("value", [b"Bearer \xff\xfe", b"Bearer good-key\xe9", b"\xc3\xa9t\xc3\xa9"])
def test_a_non_ascii_authorization_header_is_a_401(keyed_server, value):
    """Regression: a non-ASCII byte in Authorization gave a 500 with a traceback."""
    payload = json.dumps({"prompt": "x", "max_tokens": 1}).encode()
    with socket.create_connection(("127.0.0.1", keyed_server.port), timeout=60) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: " + value +
                     b"\r\nContent-Type: application/json\r\nConnection: close\r\n"
                     b"Content-Length: %d\r\n\r\n" % len(payload) + payload)
        reply = b""
        while chunk := sock.recv(65536):
            reply += chunk
    head, _, body = reply.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 401"), reply
    assert json.loads(body)["error"]["type"] == "authentication_error" and b"Traceback" not in reply


# ---- 29.1: every unexpected error is an OpenAI-shaped JSON 500 ------------------------------------------
class BrokenChatTokenizer(ByteTokenizer):
    def chat_prompt(self, messages):
        raise TypeError("a bug in the chat template path")


def test_an_unexpected_error_is_an_openai_json_500_without_a_traceback(model):
    srv = start_server(model, tokenizer=BrokenChatTokenizer())
    try:
        conn = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=60)
        conn.request("POST", "/v1/chat/completions", body=json.dumps(
            {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}))
        resp = conn.getresponse()
        raw = resp.read()
        assert resp.status == 500 and resp.getheader("Content-Type") == "application/json"
        error = json.loads(raw)["error"]
        assert set(error) >= {"message", "type", "code"} and error["code"] == 500
        assert b"Traceback" not in raw and b"a bug in" not in raw  # no internals to the client
        conn.request("POST", "/v1/completions", body=json.dumps({"prompt": "x", "max_tokens": 2}))
        assert conn.getresponse().status == 200  # the same connection still serves
        conn.close()
    finally:
        srv.close()


# ---- 29.3: the sampling fields vLLM and SGLang clients send -----------------------------------------
@pytest.mark.parametrize("fields", [
    {"repetition_penalty": 1.0}, {"repetition_penalty": 1}, {"top_k": -1}, {"top_k": 0}, {"top_k": 1},
    {"min_p": 0.0}, {"top_p": 1.0}, {"presence_penalty": 0.0, "frequency_penalty": 0}, {"seed": 3},
    {"best_of": 1}, {"min_tokens": 0}, {"logit_bias": {}}, {"ignore_eos": True}, {"ignore_eos": False},
    {"stop_token_ids": [], "skip_special_tokens": True, "include_stop_str_in_output": False},
    {"temperature": 0.0, "best_of": 1, "ignore_eos": True, "stream": True},  # SGLang's bench_serving
    {"temperature": 0, "top_p": 0.9, "top_k": 40, "min_p": 0.1},  # filters are no-ops when greedy
    {"stream": True, "stream_options": {"include_usage": True}, "repetition_penalty": 1.0, "logprobs": None},
])
def test_neutral_sampling_fields_are_accepted(server, fields):
    """Regression: vLLM's bench client (repetition_penalty 1.0), ignore_eos and top_k were refused."""
    status, body = completion(server.port, **fields)
    assert status == 200 and (body.endswith("data: [DONE]\n\n") if fields.get("stream") else
                              len(body["choices"][0]["token_ids"]) == 2)


@pytest.mark.parametrize("field, value", [
    ("repetition_penalty", 1.2), ("top_k", 40), ("min_p", 0.05), ("top_p", 0.9), ("frequency_penalty", 0.5),
    ("best_of", 2), ("min_tokens", 3), ("logit_bias", {"5": 10.0}), ("temperature", 0.7),
    ("stop_token_ids", [7]), ("skip_special_tokens", False), ("include_stop_str_in_output", True),
])
def test_output_changing_sampling_fields_are_refused_naming_field_and_value(server, field, value):
    status, body = completion(server.port, **{field: value})
    message = body["error"]["message"]
    assert status == 400 and body["error"]["param"] == field and message.startswith(field)
    assert str(len(value) if isinstance(value, dict) else value) in message


def test_ignore_eos_is_honoured(model):
    prompt = list(b"ignore eos please")
    want = reference(model, [prompt], 6)[0].output
    tokenizer = ByteTokenizer()
    tokenizer.eos_token_id = want[1]  # the second greedy token ends the answer unless eos is ignored
    srv = start_server(model, tokenizer=tokenizer)
    try:
        status, stopped = completion(srv.port, prompt=prompt, max_tokens=6)
        assert status == 200 and stopped["choices"][0]["finish_reason"] == "stop"
        assert stopped["choices"][0]["token_ids"] == want[:2]
        status, full = completion(srv.port, prompt=prompt, max_tokens=6, ignore_eos=True)
        assert full["choices"][0]["token_ids"] == want and full["choices"][0]["finish_reason"] == "length"
    finally:
        srv.close()


# ---- 29.7: OpenAI edges -----------------------------------------------------------------------------
def test_stream_options_without_stream_is_a_400(server):
    status, body = completion(server.port, stream_options={"include_usage": True})
    assert status == 400 and body["error"]["param"] == "stream_options"
    assert completion(server.port, stream=False, stream_options=None)[0] == 200


def test_models_follows_the_api_key_like_the_rest_of_v1(keyed_server):
    assert call(keyed_server.port, "GET", "/v1/models")[0] == 401
    assert call(keyed_server.port, "GET", "/v1/models", headers={"Authorization": "Bearer nope"})[0] == 401
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{keyed_server.port}/v1", api_key="good-key", max_retries=0)
    (entry,) = client.models.list().data
    assert entry.id == MODEL and abs(entry.created - time.time()) < 24 * 3600  # a time, not 0


def test_created_is_the_time(server):
    before = int(time.time())
    _, body = completion(server.port)
    assert before <= body["created"] <= time.time() + 1


def test_ids_are_unique_across_restarts(server):
    """Regression: ids counted from 0 in each process (cmpl-req-0 after every restart)."""
    script = "from tierkv.engine.request import Request; print(Request([1], 1).rid)"
    ids = {subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True,
                          env=dict(os.environ, PYTHONPATH=os.getcwd())).stdout.strip() for _ in range(2)}
    assert len(ids) == 2
    first, second = completion(server.port)[1]["id"], completion(server.port)[1]["id"]
    assert first != second and first.startswith("cmpl-") and len(first) >= len("cmpl-") + 32


def test_4xx_access_log_lines_say_why(server, caplog):
    """The server logs each line after its response is sent, so the wait is for the two lines themselves:
    waiting for any two records let a late line of an earlier test's request stand in for one (CI saw a 200
    line and the 400 line, the 404 line still to come)."""
    wanted = [lambda line: '" 400 ' in line and 'error="temperature: only greedy' in line,
              lambda line: '" 404 ' in line and 'error="no route POST /v1/nowhere"' in line]

    def lines() -> list[str]:
        return [r.getMessage() for r in caplog.records if r.name == "tierkv.access"]
    with caplog.at_level(logging.INFO, logger="tierkv.access"):
        completion(server.port, temperature=0.7)
        call(server.port, "POST", "/v1/nowhere", {})
        deadline = time.monotonic() + 10
        while not all(any(w(line) for line in lines()) for w in wanted) and time.monotonic() < deadline:
            time.sleep(0.01)
    assert any(wanted[0](line) for line in lines()), lines()
    assert any(wanted[1](line) for line in lines()), lines()


# ---- the import circle engine/routes.py <-> engine/server.py ------------------------------------------
def _engine_imports(path: Path) -> set[str]:
    """tierkv.engine modules ``path`` imports anywhere (top level, functions, TYPE_CHECKING blocks)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("tierkv.engine"):
            found |= {node.module} if node.module != "tierkv.engine" else \
                {f"tierkv.engine.{a.name}" for a in node.names}
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("tierkv.engine.")}
    return found


def test_the_http_modules_import_without_a_cycle():
    """Regression: routes.py imported server.py, which imported routes.py (inside a function)."""
    root = Path(__file__).resolve().parents[1] / "tierkv" / "engine"
    graph = {f"tierkv.engine.{p.stem}": _engine_imports(p) for p in root.glob("*.py")}

    def reaches(start: str, goal: str, seen: set) -> bool:
        for nxt in graph.get(start, ()):
            if nxt == goal or (nxt not in seen and reaches(nxt, goal, seen | {nxt})):
                return True
        return False

    http_modules = ["server", "routes", "generation", "engine_loop", "app_state", "openai_api", "metrics"]
    cycles = [m for m in http_modules if reaches(f"tierkv.engine.{m}", f"tierkv.engine.{m}", set())]
    assert cycles == []
