"""Issue 22, acceptance 2: a request that can never fit the KV pool is a 400 up front (it
used to be preempted and re-prefilled for ever); one without a token limit gets as many as the
pool holds; requests that each fit but not all together finish with bounded preemptions."""

from __future__ import annotations

import threading

import pytest
from server_testing import start_server, tiny_config

from sloserve.runtime.engine import Engine
from sloserve.runtime.request import InvalidRequest, SamplingParams

POOL = 512  # KV tokens; the tiny pair's context window is 1024; k_max is 8
PROMPT = [(i * 37) % 1900 + 10 for i in range(400)]


@pytest.fixture(scope="module")
def small(tiny_pair):
    srv = start_server(Engine(tiny_config(tiny_pair, kv_cache_tokens=POOL)))
    yield srv
    info = srv.wait_idle()
    srv.stop()
    assert info["kv_pool"]["used_blocks"] == 0, "KV blocks leaked"
    srv.engine.check_idle_integrity()


@pytest.mark.parametrize("path,body,param", [
    ("/generate", {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 200,
                                                            "ignore_eos": True}},
     "sampling_params.max_new_tokens"),
    ("/generate", {"input_ids": [PROMPT, PROMPT[:10]], "sampling_params": {
        "max_new_tokens": 200}}, "sampling_params.max_new_tokens"),
    ("/v1/completions", {"model": "m", "prompt": PROMPT, "max_tokens": 200}, "max_tokens"),
    ("/generate", {"input_ids": PROMPT * 2}, "input_ids"),
])
def test_request_that_cannot_fit_is_a_400(small, path, body, param):
    with small.client() as c:
        r = c.post(path, json=body)
        assert r.status_code == 400, r.text
        err = r.json()["error"] if path.startswith("/v1/") else r.json()
        assert err["param"] == param and "KV cache" in err["message"], err
        if param != "input_ids":
            assert "at most 104" in err["message"]  # 512 - 8 - 400
        assert c.get("/server_info").json()["engine_stats"]["preemptions"] == 0


def test_no_limit_means_what_the_pool_holds(small):
    longer = PROMPT + PROMPT[:80]
    with small.client() as c:
        r = c.post("/generate", json={"input_ids": longer, "sampling_params": {
            "max_new_tokens": None, "ignore_eos": True, "temperature": 0}})
        assert r.status_code == 200, r.text
        meta = r.json()["meta_info"]
        assert meta["completion_tokens"] == POOL - 8 - len(longer)
        assert meta["finish_reason"]["type"] == "length"
        r = c.post("/v1/completions", json={"model": "m", "prompt": longer + PROMPT[:10],
                                            "max_tokens": None, "ignore_eos": True})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 14, r.text


def test_contention_finishes_with_bounded_preemptions(small):
    """Four requests growing to 220 tokens each (1.7 times the pool together): all finish
    with the tokens they get alone, after a bounded number of preemptions."""
    prompts = [[(i * 7 + j * 13) % 2000 + 5 for j in range(100)] for i in range(4)]
    sp = {"max_new_tokens": 120, "ignore_eos": True, "temperature": 0}
    with small.client() as c:
        alone = []
        for p in prompts:
            r = c.post("/generate", json={"input_ids": p, "sampling_params": sp})
            assert r.status_code == 200, r.text
            alone.append(r.json()["output_ids"])
        before = c.get("/server_info").json()["engine_stats"]["preemptions"]
    results: list = [None] * len(prompts)

    def one(i):
        with small.client() as c:
            results[i] = c.post("/generate", json={"input_ids": prompts[i],
                                                   "sampling_params": sp})

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert [r.json()["output_ids"] for r in results] == alone
    with small.client() as c:
        preemptions = c.get("/server_info").json()["engine_stats"]["preemptions"] - before
    # the oldest running request always makes progress; each preemption is of a newer one
    assert 0 < preemptions <= 3 * len(prompts), preemptions


def test_in_process_api_rejects_it_too(make_engine):
    eng = make_engine(kv_cache_tokens=POOL, spec_policy="fixed:3")
    with pytest.raises(InvalidRequest, match="at most 104") as e:
        eng.add_request(PROMPT, SamplingParams(max_new_tokens=200))
    assert e.value.field == "max_new_tokens"
    # the context window cuts generation before the pool does: no KV needed beyond it
    big = make_engine(kv_cache_tokens=1100, spec_policy="fixed:3")
    out = big.generate([PROMPT], SamplingParams(max_new_tokens=10**6, temperature=0,
                                                ignore_eos=True))
    assert out[0]["completion_tokens"] == 1024 - len(PROMPT)
