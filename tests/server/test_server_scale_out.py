"""Scale-out (issue 18): the real sglang-router in front of two sloserve replicas. Every request
through the router succeeds, both replicas serve, greedy output through the router equals the
output of a replica asked directly, and the loads the router shows are the replicas' real
/get_load numbers (-1 is what it shows when it cannot read them)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from server_testing import start_server, tiny_config

from sloserve.listen import reserve_loopback_port
from sloserve.runtime.engine import Engine

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("sglang_router") is None,
    reason="sglang-router is not installed (pip install -e '.[test]' installs it)")

PROMPTS = [f"Replica test {i}: once upon a time" for i in range(10)]
CHATS = [f"Say something about {w}" for w in ("cats", "rain", "trains", "tea", "maps")]
SP = {"max_new_tokens": 8, "temperature": 0.0, "ignore_eos": True}


@pytest.fixture(scope="module")
def cluster(tiny_pair, tmp_path_factory):
    replicas = [start_server(Engine(tiny_config(tiny_pair))) for _ in range(2)]
    # outside the ephemeral range (no connect meets itself), held until the router binds it
    reservation = reserve_loopback_port()
    port = reservation.getsockname()[1]
    log = tmp_path_factory.mktemp("router") / "router.log"
    with open(log, "w") as out:
        router = subprocess.Popen(
            [sys.executable, "-m", "sglang_router.launch_router", "--host", "127.0.0.1",
             "--port", str(port), "--policy", "round_robin", "--log-level", "warn",
             # as README's Scaling out section: sglang-router 0.3.2 counts a 4xx as a worker
             # failure, so a client's bad requests would open every replica's circuit (10 in a
             # row: 503 "all circuits open"); dead replicas leave by the health checks instead
             "--disable-circuit-breaker",
             "--worker-urls", *[r.url for r in replicas]],
            stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            assert router.poll() is None, log.read_text()[-3000:]
            assert time.monotonic() < deadline, "router not ready: " + log.read_text()[-3000:]
            try:
                workers = httpx.get(url + "/workers", timeout=5).json()["workers"]
                if len(workers) == 2 and all(w["is_healthy"] for w in workers):
                    break
            except (httpx.HTTPError, ValueError, KeyError):
                pass
            time.sleep(0.2)
        yield url, replicas
    finally:
        reservation.close()
        router.terminate()
        try:
            router.wait(20)
        except subprocess.TimeoutExpired:
            router.kill()
            router.wait(10)
        for r in replicas:
            info = r.wait_idle()
            r.stop()
            assert info["kv_pool"]["used_blocks"] == 0, "KV blocks leaked"
            r.engine.check_idle_integrity()


def _finished(replica) -> int:
    with replica.client() as c:
        return c.get("/server_info").json()["engine_stats"]["requests_finished"]


def test_router_spreads_requests_and_output_matches_direct(cluster):
    url, replicas = cluster
    with replicas[0].client() as direct:
        want = {p: direct.post("/generate", json={"text": p, "sampling_params": SP}).json()["text"]
                for p in PROMPTS}
        want_chat = {}
        for p in CHATS:
            r = direct.post("/v1/chat/completions", json={
                "model": "m", "messages": [{"role": "user", "content": p}], "max_tokens": 8,
                "temperature": 0, "ignore_eos": True})
            want_chat[p] = r.json()["choices"][0]["message"]["content"]
    before = [_finished(r) for r in replicas]

    def gen(i: int):
        p = PROMPTS[i % len(PROMPTS)]
        with httpx.Client(base_url=url, timeout=120) as c:
            r = c.post("/generate", json={"text": p, "sampling_params": SP})
        return "gen", p, r.status_code, r.text, (r.json()["text"] if r.status_code == 200 else "")

    def chat(i: int):
        p = CHATS[i % len(CHATS)]
        with httpx.Client(base_url=url, timeout=120) as c:
            r = c.post("/v1/chat/completions", json={
                "model": replicas[0].state.model_name, "max_tokens": 8, "temperature": 0,
                "ignore_eos": True, "messages": [{"role": "user", "content": p}]})
        text = r.json()["choices"][0]["message"]["content"] if r.status_code == 200 else ""
        return "chat", p, r.status_code, r.text, text

    with ThreadPoolExecutor(8) as pool:
        futures = [pool.submit(gen, i) for i in range(40)]
        futures += [pool.submit(chat, i) for i in range(20)]
        results = [f.result() for f in futures]
    for kind, prompt, status, body, text in results:
        assert status == 200, f"{kind} through the router: {status} {body[:300]}"
        assert text == (want if kind == "gen" else want_chat)[prompt], (kind, prompt)
    served = [_finished(r) - b for r, b in zip(replicas, before)]
    assert all(n > 0 for n in served), served  # both replicas served
    assert sum(served) == 60, served


def test_router_shows_the_replicas_real_loads(cluster):
    url, replicas = cluster
    for r in replicas:
        r.wait_idle()
    loads = httpx.get(url + "/get_loads", timeout=10).json()["workers"]
    assert sorted(w["worker"] for w in loads) == sorted(r.url for r in replicas)
    assert [w["load"] for w in loads] == [0, 0], loads  # -1: the router could not read them
    busy = replicas[0]
    done = threading.Event()

    def long_request():
        with busy.client() as c:
            c.post("/generate", json={"text": "a long one", "rid": "router-load-probe",
                                      "sampling_params": {"max_new_tokens": 900,
                                                          "ignore_eos": True}})
        done.set()

    t = threading.Thread(target=long_request)
    t.start()
    try:
        shown = None
        while not done.is_set():
            loads = {w["worker"]: w["load"]
                     for w in httpx.get(url + "/get_loads", timeout=10).json()["workers"]}
            if loads[busy.url] > 0:
                shown = loads
                break
        assert shown is not None, "the router never showed the busy replica's load"
        assert shown[replicas[1].url] == 0
        with busy.client() as c:
            own = c.get("/get_load").json()[0]["num_tokens"]
        assert own > 0  # what the router sums: the replica's token count
    finally:
        with busy.client() as c:
            c.post("/abort_request", json={"rid": "router-load-probe"})
        t.join(60)


def test_unsupported_requests_do_not_take_replicas_out(cluster):
    """A client's bad requests are 400s that the router passes on; the replicas stay in
    rotation and serve the next good request (with the router's circuit breaker on, its
    default, 10 such 400s per replica open every circuit: checked by hand, 2026-11-24)."""
    url, _ = cluster
    with httpx.Client(base_url=url, timeout=60) as c:
        for _ in range(30):  # 15 per replica: past the breaker's default threshold of 10
            r = c.post("/generate", json={"text": "hi", "background": True})
            assert r.status_code == 400, r.text
            assert "background" in r.text
        for p in PROMPTS[:4]:
            r = c.post("/generate", json={"text": p, "sampling_params": SP})
            assert r.status_code == 200, r.text
