"""Issue 22, acceptances 3 and 4: a huge prompt is measured before it is tokenized (and what
tokenizing remains runs off the event loop), so /health keeps answering and memory does not
grow per request; bodies over the size limit are refused before they are read; connections
that stall their headers (slowloris) or their body are closed while other clients are
served."""

from __future__ import annotations

import json
import socket
import threading
import time

import httpx
import pytest
from server_testing import start_server, tiny_config

from sloserve.runtime.engine import Engine

TEN_MB = json.dumps({"text": "lorem ipsum dolor " * (10_000_000 // 18),
                     "sampling_params": {"max_new_tokens": 4}}).encode()
CHAT_10MB = json.dumps({"model": "m", "max_tokens": 4, "messages": [
    {"role": "user", "content": "x" * 10_000_000}]}).encode()
JSON = {"Content-Type": "application/json"}
GREEDY = {"input_ids": [11, 57, 300, 42], "sampling_params": {
    "max_new_tokens": 8, "temperature": 0.0, "ignore_eos": True}}


def _rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS")


def _health_latencies(url: str, stop: threading.Event, out: list[float]) -> None:
    with httpx.Client(base_url=url, timeout=30) as c:
        while not stop.is_set():
            t = time.perf_counter()
            assert c.get("/health").status_code == 200
            out.append(time.perf_counter() - t)
            time.sleep(0.02)


@pytest.mark.parametrize("path,body,param", [("/generate", TEN_MB, "text"),
                                             ("/v1/chat/completions", CHAT_10MB, "messages")])
def test_10mb_prompt_rejected_while_health_answers(live, path, body, param):
    stop, lat = threading.Event(), []
    poller = threading.Thread(target=_health_latencies, args=(live.url, stop, lat))
    poller.start()
    try:
        time.sleep(0.2)
        with live.client() as c:
            t = time.perf_counter()
            r = c.post(path, content=body, headers=JSON)
            took = time.perf_counter() - t
    finally:
        stop.set()
        poller.join(30)
    assert r.status_code == 400, r.text[:500]
    err = r.json()["error"] if path.startswith("/v1/") else r.json()
    assert err["param"] == param and "characters" in err["message"], err
    assert took < 5, took  # it took 10-23 s when the whole text was tokenized first
    assert len(lat) >= 5 and max(lat) < 1.0, (max(lat), len(lat))


def test_rss_stays_near_baseline_after_huge_prompts(live):
    with live.client() as c:
        r = c.post("/generate", content=TEN_MB, headers=JSON)  # the first may grow the heap
        assert r.status_code == 400
        base = _rss_mb()
        for _ in range(5):
            assert c.post("/generate", content=TEN_MB, headers=JSON).status_code == 400
        grown = _rss_mb() - base
        r = c.post("/generate", json=GREEDY)
        assert r.status_code == 200, r.text
    # it grew by about 500 MB per such request when the text was tokenized
    assert grown < 100, f"RSS grew {grown:.0f} MB over five 10 MB prompts"


@pytest.fixture(scope="module")
def strict(tiny_pair):
    """A server with a 1 MB body limit and short read deadlines."""
    srv = start_server(Engine(tiny_config(tiny_pair)), max_body_bytes=1 << 20,
                       header_timeout_s=1.0, body_timeout_s=1.5)
    yield srv
    info = srv.wait_idle()
    srv.stop()
    assert info["kv_pool"]["used_blocks"] == 0


def _connect(url: str) -> socket.socket:
    host, port = url.removeprefix("http://").split(":")
    return socket.create_connection((host, int(port)), timeout=10)


def _read_all(sock: socket.socket, timeout: float) -> tuple[bytes, bool]:
    """What the server sends within timeout, and whether it closed the connection."""
    sock.settimeout(timeout)
    out = b""
    try:
        while chunk := sock.recv(65536):
            out += chunk
    except TimeoutError:
        return out, False
    except ConnectionResetError:
        pass
    return out, True


def test_announced_huge_bodies_are_refused_unread(strict):
    """50 connections announcing 1 GB and sending nothing more: each gets a 413 at once and
    is closed; the server serves others meanwhile."""
    socks = []
    for _ in range(50):
        s = _connect(strict.url)
        s.sendall(b"POST /generate HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: "
                  b"application/json\r\nContent-Length: 1000000000\r\n\r\n{\"text\": \"")
        socks.append(s)
    t = time.perf_counter()
    answers = [_read_all(s, 10) for s in socks]
    assert time.perf_counter() - t < 10
    for a, closed in answers:
        assert a.startswith(b"HTTP/1.1 413") and closed, a[:200]
        assert b"max-request-body-bytes" in a
    for s in socks:
        s.close()
    with strict.client() as c:
        assert c.post("/generate", json=GREEDY).status_code == 200


def test_body_over_the_limit_without_length(strict):
    """A chunked body is counted as it arrives: 413 once it passes the limit."""
    def chunks():
        yield b'{"text": "'
        for _ in range(40):
            yield b"a" * 65536

    with strict.client() as c:
        r = c.post("/generate", content=chunks(), headers=JSON)
        assert r.status_code == 413, r.text
        assert r.json()["param"] == "body"
        big = json.dumps({"text": "a" * (2 << 20)})
        r = c.post("/generate", content=big, headers=JSON)
        assert r.status_code == 413


def test_slowloris_connections_closed_others_served(strict):
    """30 connections dribbling their headers and 10 stalling their body are closed by the
    server within the deadlines, while a normal client gets its answers all along."""
    dribblers = [_connect(strict.url) for _ in range(30)]
    stallers = [_connect(strict.url) for _ in range(10)]
    for s in stallers:
        s.sendall(b"POST /generate HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: "
                  b"application/json\r\nContent-Length: 100\r\n\r\n{\"text\": ")
    head = b"POST /generate HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: "
    closed = [False] * len(dribblers)
    t0 = time.monotonic()
    served = 0
    with strict.client() as c:
        for step in range(12):  # ~3 s of one header byte every 0.25 s per connection
            for i, s in enumerate(dribblers):
                if not closed[i]:
                    try:
                        s.sendall(head[step:step + 1] or b"a")
                    except OSError:
                        closed[i] = True
            r = c.post("/generate", json=GREEDY)
            assert r.status_code == 200, r.text
            served += 1
            time.sleep(0.25)
    for i, s in enumerate(dribblers):
        if not closed[i]:
            closed[i] = _read_all(s, 2) == (b"", True)  # closed by the server, no answer
    assert all(closed), f"{closed.count(False)} dribbling connections still open"
    for s in stallers:
        answer, closed_ = _read_all(s, 5)
        assert answer.startswith(b"HTTP/1.1 408") and closed_, answer[:200]
    assert served == 12 and time.monotonic() - t0 < 30
    for s in dribblers + stallers:
        s.close()
    deadline = time.monotonic() + 5
    while len(strict.server.server_state.connections) > 1 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(strict.server.server_state.connections) <= 1
