"""`tierkv serve` under HTTP abuse, over real sockets: oversize and smuggled bodies, keep-alive after errors,
chunked bodies, a burst of concurrent clients, slow clients and too many connections."""

import http.client
import json
import socket
import threading
import time

import pytest

from engine_helpers import tiny_model
from engine_helpers import single_torch_thread  # noqa: F401  (autouse fixture)
from tierkv.engine.engine import Engine, EngineConfig
from tierkv.engine.server import CompletionServer, ServerLimits

LIMIT = 1 << 20


@pytest.fixture(scope="module")
def model():
    return tiny_model("tiny-llama")


@pytest.fixture(scope="module")
def server(model):
    srv = CompletionServer(Engine(model, EngineConfig(mode="l1+l2", l1_tokens=4096))).start()
    yield srv
    srv.close()


def small_server(model, **limits):
    return CompletionServer(Engine(model, EngineConfig(mode="l1", l1_tokens=512)), limits=ServerLimits(**limits))


@pytest.fixture
def impatient_server(model):
    srv = small_server(model, read_timeout_s=0.5).start()
    yield srv
    srv.close()


@pytest.fixture
def capped_server(model):
    srv = small_server(model, read_timeout_s=120, max_connections=8).start()
    yield srv
    srv.close()


def read_all(sock: socket.socket) -> bytes:
    """Everything the server sends until it closes the connection."""
    sock.settimeout(30)
    data = b""
    try:
        while chunk := sock.recv(65536):
            data += chunk
    except ConnectionResetError:
        pass
    return data


def completion(prompt: str = "hello", max_tokens: int = 2) -> bytes:
    return json.dumps({"prompt": prompt, "max_tokens": max_tokens}).encode()


def test_oversize_body_is_refused_and_its_bytes_never_run_as_requests(server):
    """Regression: a body over 1 MiB got a 400 unread, and its bytes were served as further requests."""
    smuggled = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                b"Content-Length: 40\r\n\r\n" + completion().ljust(40) + b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
    with socket.create_connection(("127.0.0.1", server.port)) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n" % (LIMIT + 1) + smuggled)
        reply = read_all(sock)
    assert reply.startswith(b"HTTP/1.1 413") and reply.count(b"HTTP/1.1 ") == 1
    assert b"tierkv_requests_total" not in reply


def test_connection_stays_in_step_after_a_404_with_a_body(server):
    """Regression: after a 404 the next request on the connection got a 501 HTML page."""
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    conn.request("POST", "/v1/nothing-here", body=completion())
    first = conn.getresponse()
    assert first.status == 404 and "error" in json.loads(first.read())
    conn.request("GET", "/nope")
    second = conn.getresponse()
    assert second.status == 404 and second.getheader("Content-Type") == "application/json"
    second.read()
    conn.request("POST", "/v1/completions", body=completion())
    third = conn.getresponse()
    assert third.status == 200 and len(json.loads(third.read())["choices"][0]["token_ids"]) == 2
    conn.close()


def test_chunked_bodies_are_read_and_limited(server):
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    body = completion("chunked hello", 3)
    conn.request("POST", "/v1/completions", body=iter([body[:7], body[7:]]), encode_chunked=True,
                 headers={"Content-Type": "application/json", "Transfer-Encoding": "chunked"})
    resp = conn.getresponse()
    assert resp.status == 200 and len(json.loads(resp.read())["choices"][0]["token_ids"]) == 3
    conn.close()
    with socket.create_connection(("127.0.0.1", server.port)) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n")
        chunk = b"x" * 65536
        try:
            for _ in range(LIMIT // len(chunk) + 2):
                sock.sendall(b"%x\r\n" % len(chunk) + chunk + b"\r\n")
        except (BrokenPipeError, ConnectionResetError):
            pass  # the server answered and closed before the rest arrived
        reply = read_all(sock)
    assert reply.startswith(b"HTTP/1.1 413") and reply.count(b"HTTP/1.1 ") == 1


def test_sixty_four_concurrent_clients_are_all_answered(server):
    """Regression: a listen backlog of 5 reset 15-20 of 64 concurrent connections."""
    barrier, results = threading.Barrier(64), []

    def client(i: int) -> None:
        barrier.wait()
        try:
            conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=120)
            conn.request("POST", "/v1/completions", body=completion(f"client {i}", 2))
            resp = conn.getresponse()
            results.append((resp.status, len(json.loads(resp.read())["choices"][0]["token_ids"])))
            conn.close()
        except OSError as exc:
            results.append((repr(exc), 0))

    threads = [threading.Thread(target=client, args=(i,)) for i in range(64)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == [(200, 2)] * 64


def test_a_client_that_never_finishes_its_request_is_disconnected(impatient_server):
    with socket.create_connection(("127.0.0.1", impatient_server.port)) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{\"prompt\"")
        assert read_all(sock) == b""  # closed by the server, with no response to a request never completed
    conn = http.client.HTTPConnection("127.0.0.1", impatient_server.port, timeout=30)
    conn.request("POST", "/v1/completions", body=completion())
    assert conn.getresponse().status == 200


def test_connections_past_the_cap_are_refused_without_a_thread_each(capped_server):
    """Regression: 300 half-open connections held 306 threads."""
    threads_before = threading.active_count()
    idle = [socket.create_connection(("127.0.0.1", capped_server.port)) for _ in range(30)]
    try:
        replies = []
        for sock in idle[8:]:
            replies.append(read_all(sock))
        assert all(r.startswith(b"HTTP/1.1 503") for r in replies)
        assert threading.active_count() == threads_before
    finally:
        for sock in idle:
            sock.close()
    deadline = time.monotonic() + 30  # the server notices the hang-ups on its own loop
    while capped_server.uvicorn.server_state.connections and time.monotonic() < deadline:
        time.sleep(0.01)
    conn = http.client.HTTPConnection("127.0.0.1", capped_server.port, timeout=30)
    conn.request("POST", "/v1/completions", body=completion())
    assert conn.getresponse().status == 200
