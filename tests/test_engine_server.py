"""The completions server: plain and streaming answers, /metrics, 4xx on bad bodies, the serve command."""

import http.client
import json
import os
import subprocess
import sys
import time

import pytest

from engine_helpers import reference, tiny_model
from engine_helpers import single_torch_thread  # noqa: F401  (autouse fixture)
from tierkv.engine.engine import Engine, EngineConfig
from tierkv.engine.server import CompletionServer


@pytest.fixture(scope="module")
def model():
    return tiny_model("tiny-llama")


@pytest.fixture(scope="module")
def server(model):
    srv = CompletionServer(Engine(model, EngineConfig(mode="l1+l2", l1_tokens=1024))).start()
    yield srv
    srv.close()


def call(port, method, path, body=None, raw=None):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    payload = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
    conn.request(method, path, body=payload, headers={"Content-Type": "application/json"})
    resp = conn.getresponse()
    data = resp.read()
    conn.close()
    return resp.status, resp.getheader("Content-Type"), data


def test_completion_matches_the_engine_and_reports_cache_hits(server, model):
    prompt = list(range(40, 90))
    want = reference(model, [prompt], 5)[0].output
    for attempt in range(2):
        status, ctype, data = call(server.port, "POST", "/v1/completions", {"prompt": prompt, "max_tokens": 5})
        assert status == 200 and ctype == "application/json"
        body = json.loads(data)
        assert body["object"] == "text_completion" and body["choices"][0]["token_ids"] == want
        assert body["choices"][0]["finish_reason"] == "length"
        assert body["usage"]["completion_tokens"] == 5 and body["usage"]["prompt_tokens"] == 50
    assert body["usage"]["prompt_tokens_details"]["cached_tokens"] >= 48  # the second attempt hit the first's KV


def test_streaming_sends_one_event_per_token_then_done(server, model):
    want = reference(model, [list(b"hello streaming")], 4)[0].output
    status, ctype, data = call(server.port, "POST", "/v1/completions",
                               {"prompt": "hello streaming", "max_tokens": 4, "stream": True})
    assert status == 200 and ctype.startswith("text/event-stream")
    events = [line[len("data: "):] for line in data.decode().split("\n\n") if line]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert [c["choices"][0]["token_ids"][0] for c in chunks[:-1]] == want
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


@pytest.mark.parametrize("raw", [b"not json", b"[1, 2]", b'{"prompt": 5}', b'{"prompt": []}',
                                 b'{"prompt": [1, 99999]}', b'{"prompt": "x", "max_tokens": 0}',
                                 b'{"prompt": "x", "max_tokens": "3"}', b'{"prompt": "x", "stream": "yes"}',
                                 b'{"prompt": [true, 2]}', b'\xff\xfe'])
def test_bad_bodies_get_a_4xx_json_error(server, raw):
    status, ctype, data = call(server.port, "POST", "/v1/completions", raw=raw)
    assert 400 <= status < 500 and ctype == "application/json"
    assert "message" in json.loads(data)["error"]


def test_too_long_prompt_is_refused_before_anything_is_evicted(server):
    """Regression: a prompt that can never fit evicted all of L1 before its 400."""
    cached = list(range(100, 160))
    call(server.port, "POST", "/v1/completions", {"prompt": cached, "max_tokens": 2})
    evicted_before = server.loop.engine.cache.stats.evicted_device_tokens
    status, _, data = call(server.port, "POST", "/v1/completions", {"prompt": [1] * 2000, "max_tokens": 2})
    error = json.loads(data)["error"]
    assert status == 400 and "KV slots" in error["message"] and error["param"] == "prompt"
    assert server.loop.engine.cache.stats.evicted_device_tokens == evicted_before
    status, _, data = call(server.port, "POST", "/v1/completions", {"prompt": cached, "max_tokens": 2})
    assert json.loads(data)["usage"]["prompt_tokens_details"]["cached_tokens"] == len(cached) - 1
    assert call(server.port, "GET", "/health")[0] == 200  # still serving


def test_engine_refuses_a_never_fitting_request_without_evicting(model):
    engine = Engine(model, EngineConfig(mode="l1+l2", l1_tokens=256))
    engine.generate([list(range(200))], 4)
    evicted_before = engine.cache.stats.evicted_device_tokens
    too_long = engine.submit(list(range(300)), 2)
    assert too_long.finished and "KV slots" in too_long.error
    assert engine.cache.stats.evicted_device_tokens == evicted_before and not engine.scheduler.has_work
    again = engine.generate([list(range(200))], 4)[0]
    assert again.cache_hit_tokens == 199
    engine.check_integrity()
    engine.close()


def test_serve_command_prints_a_summary_and_logs_each_request(tmp_path):
    env = dict(os.environ, PYTHONPATH=os.getcwd())
    proc = subprocess.Popen([sys.executable, "-m", "tierkv.engine.cli", "serve", "--model", "tiny-qwen3",
                             "--port", "0", "--l1-tokens", "2k", "--l2-tokens", "8k"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env)
    try:
        summary = [proc.stdout.readline() for _ in range(4)]
        assert "L1 2,000 tokens" in summary[1] and "L2 8,000 tokens" in summary[1], summary
        assert "exclusive with 256 tokens of staging, write_through" in summary[1], summary
        assert "eviction adaptive" in summary[1], summary
        assert "listening on http://127.0.0.1:" in summary[-1], summary
        port = int(summary[-1].rsplit(":", 1)[1])
        status, _, data = call(port, "POST", "/v1/completions", {"prompt": "hi", "max_tokens": 3})
        assert status == 200 and len(json.loads(data)["choices"][0]["token_ids"]) == 3
    finally:
        proc.terminate()
        _, err = proc.communicate(timeout=20)
    assert proc.returncode == 0
    access = [line for line in err.splitlines() if "tierkv.access" in line]
    assert len(access) == 1 and '"POST /v1/completions" 200' in access[0] and "prompt_tokens=2" in access[0]


@pytest.mark.parametrize("flags, named", [
    (["--storage-extra", "{bad"], "--storage-extra"), (["--port", "99999"], "--port"),
    (["--l1-tokens", "inf"], "--l1-tokens"), (["--l1-tokens", "1e400"], "--l1-tokens"),
    (["--l1-tokens", "1e12"], "--l1-tokens"), (["--device", "cuda"], "--device"),
    (["--tenant-keys", "/nonexistent/keys"], "--tenant-keys"), (["--l2-tokens", "100"], "--l2-tokens"),
    (["--prefill-tokens-per-s", "0"], "--prefill-tokens-per-s"), (["--tier-mode", "both"], "--tier-mode"),
    (["--eviction-policy", "random"], "--eviction-policy"), (["--max-waiting-requests", "0"], "--max-waiting-requests"),
    (["--device", "meta"], "--device"),  # 24.7: accepted, then every request failed
    (["--l3", "file:/tmp/tierkv-unused-l3", "--mode", "l1+l2"], "--l3"),  # 29.2: ran without the L3 it named
    (["--l3", "file:/tmp/tierkv-unused-l3", "--storage-extra", '{"io_wait_timeout_s": 0}'], "io_wait_timeout_s"),
    (["--hicache-mem-layout", "page_head"], "--hicache-mem-layout"),  # 29.5: SGLang's value tierkv lacks
])
def test_serve_flag_errors_are_one_line_naming_the_flag(flags, named):
    if flags[0] == "--device":
        import torch
        if torch.cuda.is_available():
            pytest.skip("this machine has CUDA")
    proc = subprocess.run([sys.executable, "-m", "tierkv.engine.cli", "serve", "--model", "tiny-llama",
                           "--port", "0", *flags], capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, PYTHONPATH=os.getcwd()))
    assert proc.returncode == 2 and named in proc.stderr and "Traceback" not in proc.stderr, proc.stderr


def test_serve_never_echoes_the_storage_extra_config():
    """24.6: valid JSON that is not an object was echoed whole in the error (a pasted page key showed)."""
    secret = "page-key-Zq81xK-0123456789abcdef"
    proc = subprocess.run([sys.executable, "-m", "tierkv.engine.cli", "serve", "--model", "tiny-llama", "--port", "0",
                           "--mode", "l1+l2+l3", "--l3", "file:/tmp/tierkv-unused-l3", "--storage-extra",
                           json.dumps(secret)], capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, PYTHONPATH=os.getcwd()))
    assert proc.returncode == 2 and "--storage-extra" in proc.stderr, proc.stderr
    assert secret not in proc.stderr + proc.stdout


def test_client_leaving_mid_stream_leaks_nothing(server):
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    conn.request("POST", "/v1/completions", body=json.dumps({"prompt": "bye" * 20, "max_tokens": 200,
                                                             "stream": True}))
    resp = conn.getresponse()
    resp.fp.readline()  # the first event has started
    resp.close()  # the response owns the socket (Connection: close); this hangs up
    conn.close()
    status, _, _ = call(server.port, "POST", "/v1/completions", {"prompt": "still here", "max_tokens": 2})
    assert status == 200
    deadline = time.monotonic() + 30
    while server.loop.engine.scheduler.has_work and time.monotonic() < deadline:
        time.sleep(0.05)
    with server.loop.lock:
        server.loop.engine.cache.flush()
        server.loop.engine.check_integrity()
        assert not server.loop.engine.scheduler.running
