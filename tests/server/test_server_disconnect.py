"""Acceptance 4: clients that go away mid-stream abort their requests; the KV pool returns to
all-free (seen through /server_info and /metrics) and the server keeps serving."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time

import httpx
from prometheus_client.parser import text_string_to_metric_families

N = 20


def _gauge(metrics_text: str, name: str) -> float:
    for fam in text_string_to_metric_families(metrics_text):
        for s in fam.samples:
            if s.name == name:
                return s.value
    raise KeyError(name)


async def _cancel_after(client: httpx.AsyncClient, i: int, chunks: int) -> int:
    """Stream a long generation, leave after `chunks` chunks; returns the chunks seen."""
    body = {"input_ids": [10 + i, 20, 30 + i], "stream": True, "rid": f"gone-{i}",
            "sampling_params": {"max_new_tokens": 800, "temperature": 0.0, "ignore_eos": True}}
    seen = 0
    async with client.stream("POST", "/generate", json=body) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if line.startswith("data:"):
                seen += 1
                if seen >= chunks:
                    break  # leaving the block closes the connection mid-stream
    return seen


def test_cancelled_streams_free_their_kv_blocks(live, client):
    before = client.get("/server_info").json()["engine_stats"]["requests_aborted"]

    async def main():
        async with httpx.AsyncClient(base_url=live.url, timeout=httpx.Timeout(60.0),
                                     limits=httpx.Limits(max_connections=N + 2)) as c:
            return await asyncio.wait_for(
                asyncio.gather(*(_cancel_after(c, i, 2 + i % 3) for i in range(N))), 60)

    seen = asyncio.run(main())
    assert all(s >= 2 for s in seen)
    info = live.wait_idle()
    assert info["num_requests_running"] == 0 and info["num_requests_waiting"] == 0
    assert info["kv_pool"]["used_blocks"] == 0
    assert info["kv_pool"]["free_blocks"] == info["kv_pool"]["total_blocks"]
    stats = info["engine_stats"]
    assert stats["requests_aborted"] - before == N
    assert stats["generated_tokens"] < N * 800  # they really stopped early
    metrics = client.get("/metrics").text
    assert _gauge(metrics, "sloserve_kv_blocks_used") == 0
    assert _gauge(metrics, "sloserve_kv_blocks_free") == info["kv_pool"]["total_blocks"]
    r = client.post("/generate", json={"input_ids": [3, 4, 5], "sampling_params": {
        "max_new_tokens": 5, "temperature": 0.0, "ignore_eos": True}})
    assert r.status_code == 200 and r.json()["meta_info"]["completion_tokens"] == 5


def _raw_post(url: str, body: dict) -> socket.socket:
    """Send POST /generate on a raw socket (so the test decides when the client goes away)."""
    host, port = url.removeprefix("http://").split(":")
    data = json.dumps(body).encode()
    sock = socket.create_connection((host, int(port)), timeout=10)
    sock.sendall(b"POST /generate HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n%s" % (len(data), data))
    return sock


def test_disconnect_non_streaming_and_before_reading(live, client):
    """A client that leaves a non-streamed request, or a stream before reading any chunk,
    aborts it too."""
    before = client.get("/server_info").json()["engine_stats"]["requests_aborted"]
    body = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 1000,
                                                        "temperature": 0.0, "ignore_eos": True}}
    for stream in (False, True):
        sock = _raw_post(live.url, {**body, "stream": stream})
        deadline = time.monotonic() + 20
        while client.get("/server_info").json()["num_requests_running"] == 0:
            assert time.monotonic() < deadline, "the request never ran"
            time.sleep(0.01)
        # hold the engine between steps so the request cannot finish before the server
        # notices the disconnect (the tiny pair decodes 1000 tokens in well under a second)
        gate, held = threading.Event(), threading.Event()
        live.state.aengine.call(lambda e, held=held, gate=gate: (held.set(), gate.wait(20)))
        assert held.wait(20)
        sock.close()  # gone while its request runs
        while live.state.aengine._cmds.empty():  # the server queues the abort
            assert time.monotonic() < deadline, "the disconnect was never noticed"
            time.sleep(0.01)
        gate.set()
    info = live.wait_idle()
    assert info["kv_pool"]["used_blocks"] == 0
    assert info["engine_stats"]["requests_aborted"] - before == 2
