"""`tierkv serve` when clients go away or arrive faster than it serves, over real sockets: a dropped request
(streaming or not) is cancelled and its KV released at once, and the waiting queue is capped with 429."""

import http.client
import json
import socket
import threading
import time

import pytest
from prometheus_client.parser import text_string_to_metric_families

from engine_helpers import tiny_model
from engine_helpers import single_torch_thread  # noqa: F401  (autouse fixture)
from tierkv.engine.engine import Engine, EngineConfig
from tierkv.engine.server import CompletionServer, ServerLimits

NUM_STREAMS, MAX_TOKENS = 32, 400


@pytest.fixture(scope="module")
def model():
    return tiny_model("tiny-llama")


def body(prompt: str, max_tokens: int, stream: bool) -> bytes:
    return json.dumps({"prompt": prompt, "max_tokens": max_tokens, "stream": stream}).encode()


def post_raw(port: int, payload: bytes) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=60)
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n" % len(payload) + payload)
    return sock


def metric_samples(srv) -> dict:
    conn = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=30)
    conn.request("GET", "/metrics")
    text = conn.getresponse().read().decode()
    conn.close()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def wait_idle(srv) -> None:
    deadline = time.monotonic() + 60
    while srv.loop.engine.scheduler.has_work and time.monotonic() < deadline:
        time.sleep(0.05)


def assert_nothing_held(srv) -> None:
    engine = srv.loop.engine
    with srv.loop.lock:
        assert not engine.scheduler.running and not engine.scheduler.waiting
        engine.cache.flush()
        engine.check_integrity()
        assert engine.cache.tree.protected_size == 0  # no node is locked any more


def test_dropped_streams_stop_generating_and_release_their_kv(model):
    """Regression: 64 dropped streams still generated all 64 x 600 tokens."""
    # 8 run, 24 wait: both kinds are dropped
    srv = CompletionServer(Engine(model, EngineConfig(mode="l1+l2", l1_tokens=8192, max_running_requests=8))).start()
    try:
        counters = srv.loop.engine.scheduler.counters
        socks = [post_raw(srv.port, body(f"stream {i} " * 8, MAX_TOKENS, True)) for i in range(NUM_STREAMS)]
        for sock in socks:
            assert sock.recv(64).startswith(b"HTTP/1.1 200")  # generating: the response has started
        for sock in socks:
            sock.close()
        wait_idle(srv)
        assert counters.generated_tokens < NUM_STREAMS * MAX_TOKENS // 4, counters.generated_tokens
        assert counters.requests_cancelled == NUM_STREAMS and counters.requests_finished == 0
        assert_nothing_held(srv)
        samples = metric_samples(srv)
        assert samples[("tierkv_requests_total", (("outcome", "cancelled"),))] == NUM_STREAMS
        assert samples[("tierkv_aborted_requests_total", ())] == NUM_STREAMS
        conn = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=30)
        conn.request("POST", "/v1/completions", body=body("still serving", 3, False))
        assert len(json.loads(conn.getresponse().read())["choices"][0]["token_ids"]) == 3
    finally:
        srv.close()


def test_a_dropped_plain_request_is_cancelled_too(model):
    srv = CompletionServer(Engine(model, EngineConfig(mode="l1+l2", l1_tokens=4096))).start()
    try:
        counters = srv.loop.engine.scheduler.counters
        sock = post_raw(srv.port, body("plain request " * 4, 2000, False))
        deadline = time.monotonic() + 60
        while counters.generated_tokens == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        sock.close()  # no response has been sent: only the socket's end says the client left
        wait_idle(srv)
        assert counters.generated_tokens < 1000, counters.generated_tokens
        assert counters.requests_cancelled == 1
        assert_nothing_held(srv)
        assert metric_samples(srv)[("tierkv_requests_total", (("outcome", "cancelled"),))] == 1
    finally:
        srv.close()


def test_the_waiting_queue_is_capped_with_429_and_retry_after(model):
    """Regression: the waiting queue had no cap."""
    srv = CompletionServer(Engine(model, EngineConfig(mode="l1", l1_tokens=4096)),
                           limits=ServerLimits(max_waiting_requests=2)).start()
    try:
        replies, threads = [], []

        def client(i: int) -> None:
            conn = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=120)
            conn.request("POST", "/v1/completions", body=body(f"queued {i}", 2, False))
            resp = conn.getresponse()
            replies.append((resp.status, resp.getheader("Retry-After"), json.loads(resp.read())))
            conn.close()

        with srv.loop.lock:  # the engine cannot take requests in: they all wait
            threads = [threading.Thread(target=client, args=(i,)) for i in range(5)]
            for t in threads:
                t.start()
            deadline = time.monotonic() + 60
            while len(replies) < 3 and time.monotonic() < deadline:
                time.sleep(0.01)
            assert [r[0] for r in replies] == [429] * 3
        for t in threads:
            t.join()
        assert sorted(r[0] for r in replies) == [200, 200, 429, 429, 429]
        for status, retry_after, error in replies[:3]:
            assert retry_after is not None and int(retry_after) >= 1
            assert error["error"]["code"] == 429 and "max_waiting_requests 2" in error["error"]["message"]
        samples = metric_samples(srv)
        assert samples[("tierkv_queue_full_refusals_total", ())] == 3
        assert samples[("tierkv_requests_total", (("outcome", "refused_4xx"),))] == 3
        assert samples[("tierkv_requests_total", (("outcome", "finished"),))] == 2
    finally:
        srv.close()


@pytest.mark.parametrize("value", [0, -1, 1.5, True])
def test_max_waiting_requests_must_be_a_positive_int(value):
    with pytest.raises(ValueError, match="max_waiting_requests"):
        ServerLimits(max_waiting_requests=value)
