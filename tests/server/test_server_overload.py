"""Issue 22, acceptance 6: with --max-queued-requests, an open loop of requests above the
server's capacity gets each request either served with its exact greedy tokens or refused
at once with a 503 and Retry-After; memory stays flat and the KV pool ends all free."""

from __future__ import annotations

import asyncio
import os
import time

import httpx
import pytest
from server_testing import start_server, tiny_config

from sloserve.runtime.engine import Engine

SECONDS = float(os.environ.get("SLOSERVE_OVERLOAD_SECONDS", "20"))
RUNNING, QUEUED = 2, 4  # --max-running-requests, --max-queued-requests
PROMPTS = [[(i * 31 + j * 7) % 2000 + 3 for j in range(8 + 3 * i)] for i in range(6)]
SP = {"max_new_tokens": 24, "temperature": 0.0, "ignore_eos": True}


def _rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS")


@pytest.fixture(scope="module")
def bounded(tiny_pair):
    srv = start_server(Engine(tiny_config(tiny_pair, max_running_requests=RUNNING,
                                          max_queued_requests=QUEUED)))
    yield srv
    info = srv.wait_idle()
    srv.stop()
    assert info["kv_pool"]["used_blocks"] == 0, "KV blocks leaked"
    srv.engine.check_idle_integrity()


def test_open_loop_above_capacity(bounded):
    with bounded.client() as c:  # the references, each prompt once (greedy: batching
        # does not change the tokens)
        r = c.post("/generate", json={"input_ids": PROMPTS, "sampling_params": SP})
        assert r.status_code == 200, r.text
        reference = [x["output_ids"] for x in r.json()]
        r = c.post("/v1/completions", json={"model": "m", "prompt": PROMPTS, "max_tokens": 24,
                                            "temperature": 0, "ignore_eos": True})
        assert r.status_code == 200, r.text
        ref_text = [ch["text"] for ch in r.json()["choices"]]
        t = time.monotonic()
        assert c.post("/generate", json={"input_ids": PROMPTS[0], "sampling_params": SP}
                      ).json()["output_ids"] == reference[0]
        alone = time.monotonic() - t
    # open loop at three times what the server can serve (measured: the machine may be
    # shared), arrivals not waiting for answers
    rate = min(50.0, max(2.0, 3 * RUNNING / alone))

    outcomes: list[tuple[int, int, httpx.Response]] = []
    rss: list[float] = []
    sent: list[int] = []

    async def one(c: httpx.AsyncClient, k: int) -> None:
        i = k % len(PROMPTS)
        path = "/generate" if k % 2 else "/v1/completions"
        body = ({"input_ids": PROMPTS[i], "sampling_params": SP} if path == "/generate" else
                {"model": "m", "prompt": PROMPTS[i], "max_tokens": SP["max_new_tokens"],
                 "temperature": 0, "ignore_eos": True})
        outcomes.append((k, i, await c.post(path, json=body)))

    async def main() -> None:
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=50)
        async with httpx.AsyncClient(base_url=bounded.url, timeout=120, limits=limits) as c:
            tasks, t0, k = [], time.monotonic(), 0
            while (now := time.monotonic() - t0) < SECONDS:
                while k < now * rate:
                    tasks.append(asyncio.create_task(one(c, k)))
                    k += 1
                if int(now) % 5 == 0 and len(rss) <= now / 5:
                    rss.append(_rss_mb())
                await asyncio.sleep(0.005)
            await asyncio.gather(*tasks)
            rss.append(_rss_mb())
            sent.append(k)

    asyncio.run(main())
    served = refused = 0
    for k, i, r in outcomes:
        if r.status_code == 200:
            served += 1
            if k % 2:
                assert r.json()["output_ids"] == reference[i], k
            else:
                assert r.json()["choices"][0]["text"] == ref_text[i], k
        else:
            assert r.status_code == 503, (r.status_code, r.text)
            assert r.headers["retry-after"] == "1"
            body = r.json()
            msg = body["error"]["message"] if "error" in body else body["message"]
            assert "queue is full" in msg
            refused += 1
    # (on a loaded machine the client may send fewer per second: no matter)
    assert served + refused == len(outcomes) == sent[0] >= min(50, rate * SECONDS / 2)
    assert served > 0 and refused > 0, (served, refused)
    with bounded.client() as c:
        metrics = c.get("/metrics").text
    assert f"sloserve_requests_rejected_queue_full_total {float(refused)}" in metrics
    # memory flat: from the first sample taken under load to the end
    assert max(rss[1:]) - rss[1] < 60, rss
