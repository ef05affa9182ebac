"""What routers and OpenAI-style load tools send, replayed byte for byte, and the endpoints they
read (issue 18): unknown keys are ignored as SGLang ignores them, known-but-unsupported options
are a 400 only away from their default, a context overflow is a 400 naming the lengths, and
/get_load, /v1/loads, /version, /v1/models/{id} answer in SGLang's shapes."""

from __future__ import annotations

import json
import logging

import pytest

# Captured 2026-11-24 from sglang-router 0.3.2 (`python -m sglang_router.launch_router
# --worker-urls http://127.0.0.1:18001 --port 18100`) in front of a tiny HTTP server that logged
# each request body; the client requests were the minimal bodies (text + sampling_params;
# model + messages / prompt + max_tokens; stream with stream_options.include_usage). The
# router re-serialises every request with its own defaults, in this key order.
ROUTER_GENERATE = (
    '{"text":"hi","model":null,"sampling_params":{"temperature":0.0,"max_new_tokens":4},'
    '"return_text_in_logprobs":false,"stream":false,"log_metrics":true,'
    '"return_hidden_states":false,"background":false,"no_logs":false,"return_bytes":false,'
    '"return_entropy":false}')
ROUTER_GENERATE_STREAM = (
    '{"text":"hi","model":null,"sampling_params":{"max_new_tokens":4},'
    '"return_text_in_logprobs":false,"stream":true,"log_metrics":true,'
    '"return_hidden_states":false,"background":false,"no_logs":false,"return_bytes":false,'
    '"return_entropy":false}')
ROUTER_CHAT = (
    '{"messages":[{"role":"user","content":"hi"}],"model":"m","logprobs":false,'
    '"max_completion_tokens":4,"stream":false,"no_stop_trim":false,"ignore_eos":false,'
    '"continue_final_message":false,"skip_special_tokens":true,"separate_reasoning":true,'
    '"stream_reasoning":true,"return_hidden_states":false}')
ROUTER_CHAT_STREAM = (
    '{"messages":[{"role":"user","content":"hi"}],"model":"m","logprobs":false,'
    '"max_completion_tokens":4,"stream":true,"stream_options":{"include_usage":true},'
    '"no_stop_trim":false,"ignore_eos":false,"continue_final_message":false,'
    '"skip_special_tokens":true,"separate_reasoning":true,"stream_reasoning":true,'
    '"return_hidden_states":false}')
ROUTER_COMPLETION = (
    '{"model":"m","prompt":"hi","max_tokens":4,"stream":false,"echo":false,'
    '"no_stop_trim":false,"ignore_eos":false,"skip_special_tokens":true,'
    '"return_hidden_states":false}')
# smg (sglang-router's successor) fills /generate's model with "unknown" (issue 18)
SMG_GENERATE = ROUTER_GENERATE.replace('"model":null', '"model":"unknown"')
# OpenAI-style load tools (the shape of vLLM's benchmark client and of the clients that ask
# for exact per-chunk token counts): continuous_usage_stats is accepted by SGLang and vLLM
LOAD_TOOL_COMPLETION = (
    '{"model":"m","prompt":"hi","temperature":0.0,"repetition_penalty":1.0,"max_tokens":4,'
    '"logprobs":null,"stream":true,"stream_options":{"include_usage":true,'
    '"continuous_usage_stats":true},"ignore_eos":true}')
LOAD_TOOL_CHAT = (
    '{"model":"m","messages":[{"role":"user","content":"hi"}],"temperature":0.0,'
    '"max_completion_tokens":4,"stream":true,"stream_options":{"include_usage":true,'
    '"continuous_usage_stats":true},"ignore_eos":true}')

REPLAYED = [
    ("router generate", "/generate", ROUTER_GENERATE),
    ("router generate stream", "/generate", ROUTER_GENERATE_STREAM),
    ("router chat", "/v1/chat/completions", ROUTER_CHAT),
    ("router chat stream", "/v1/chat/completions", ROUTER_CHAT_STREAM),
    ("router completion", "/v1/completions", ROUTER_COMPLETION),
    ("smg generate", "/generate", SMG_GENERATE),
    ("load tool completion", "/v1/completions", LOAD_TOOL_COMPLETION),
    ("load tool chat", "/v1/chat/completions", LOAD_TOOL_CHAT),
]
JSON = {"content-type": "application/json"}


def _events(text: str) -> list[dict]:
    lines = [ln[6:] for ln in text.split("\n") if ln.startswith("data: ")]
    assert lines[-1] == "[DONE]", text[-200:]
    return [json.loads(ln) for ln in lines[:-1]]


@pytest.mark.parametrize("name,path,body", REPLAYED, ids=[r[0] for r in REPLAYED])
def test_replayed_bodies_are_served(client, name, path, body):
    r = client.post(path, content=body, headers=JSON)
    assert r.status_code == 200, r.text
    if json.loads(body).get("stream"):
        events = _events(r.text)
        assert events and not any("error" in e for e in events), r.text[-300:]
    else:
        out = r.json()
        assert "text" in out or "choices" in out


def test_unknown_keys_are_ignored_with_a_debug_log(client, caplog):
    with caplog.at_level(logging.DEBUG, logger="sloserve.server.errors"):
        r = client.post("/generate", json={"text": "hi", "frobnicate": {"x": 1},
                                           "sampling_params": {"max_new_tokens": 2}})
        assert r.status_code == 200, r.text
        r = client.post("/v1/chat/completions", json={
            "model": "m", "messages": [{"role": "user", "content": "hi", "weight": 1}],
            "max_tokens": 2, "chat_template_kwargs": {"enable_thinking": False}})
        assert r.status_code == 200, r.text
    logged = " ".join(rec.getMessage() for rec in caplog.records)
    for key in ("frobnicate", "chat_template_kwargs", "messages[0].weight"):
        assert key in logged, logged
    # an unknown key inside sampling_params stays a 400, as in SGLang
    r = client.post("/generate", json={"text": "hi", "sampling_params": {"temprature": 0}})
    assert r.status_code == 400 and "sampling_params.temprature" in r.json()["message"]


@pytest.mark.parametrize("path,body,key", [
    ("/generate", {"text": "hi", "background": True}, "background"),
    ("/generate", {"text": "hi", "return_hidden_states": True}, "return_hidden_states"),
    ("/v1/chat/completions", {"model": "m", "messages": [{"role": "user", "content": "hi"}],
                              "continue_final_message": True}, "continue_final_message"),
    ("/v1/completions", {"model": "m", "prompt": "hi", "return_hidden_states": True},
     "return_hidden_states"),
])
def test_known_unsupported_options_are_a_400_naming_them(client, path, body, key):
    r = client.post(path, json=body)
    assert r.status_code == 400, r.text
    err = r.json().get("error", r.json())
    assert err["param"] == key and key in err["message"]


def test_continuous_usage_stats_puts_usage_in_every_chunk(client):
    for path, body in (("/v1/completions", LOAD_TOOL_COMPLETION),
                       ("/v1/chat/completions", LOAD_TOOL_CHAT)):
        events = _events(client.post(path, content=body, headers=JSON).text)
        assert all("usage" in e for e in events), events
        done = [u["completion_tokens"] for u in (e["usage"] for e in events)]
        assert done == sorted(done) and done[-1] == 4  # cumulative, ending at max_tokens
        assert events[-1]["choices"] == []  # include_usage's final chunk
        assert all(e["usage"]["total_tokens"] == e["usage"]["prompt_tokens"]
                   + e["usage"]["completion_tokens"] for e in events)
    plain = _events(client.post("/v1/completions", json={
        "model": "m", "prompt": "hi", "max_tokens": 3, "stream": True}).text)
    assert not any("usage" in e for e in plain)


def test_context_overflow_is_a_400_naming_the_lengths(client, live):
    ctx = live.state.max_context
    ids = [11] * (ctx - 10)
    cases = [
        ("/generate", {"input_ids": ids, "sampling_params": {"max_new_tokens": 20}},
         "sampling_params.max_new_tokens", "20"),
        ("/v1/completions", {"model": "m", "prompt": ids, "max_tokens": 11}, "max_tokens", "11"),
        ("/v1/chat/completions", {"model": "m", "messages": [{"role": "user", "content": "hi"}],
                                  "max_completion_tokens": ctx}, "max_completion_tokens",
         str(ctx)),
    ]
    for path, body, param, n in cases:
        r = client.post(path, json=body)
        assert r.status_code == 400, r.text
        err = r.json().get("error", r.json())
        assert err["param"] == param
        assert n in err["message"] and f"context length of {ctx}" in err["message"]
    ok = client.post("/generate", json={"input_ids": ids, "sampling_params": {
        "max_new_tokens": 10, "ignore_eos": True}})  # exactly fills the window
    assert ok.status_code == 200 and ok.json()["meta_info"]["completion_tokens"] == 10


def test_served_model_name_defaults_to_the_model_path(client, live, tiny_pair):
    assert live.state.model_name == tiny_pair[0]
    data = client.get("/v1/models").json()["data"]
    assert [m["id"] for m in data] == [tiny_pair[0]]
    assert client.get("/model_info").json()["served_model_name"] == tiny_pair[0]


def test_model_card_by_id(client, tiny_pair, live):
    card = client.get("/v1/models/" + tiny_pair[0].lstrip("/"))
    assert card.status_code == 404  # the id is the full path, leading slash included
    card = client.get("/v1/models/" + tiny_pair[0])
    assert card.status_code == 200, card.text
    assert card.json()["id"] == tiny_pair[0]
    assert card.json()["max_model_len"] == live.state.max_context
    missing = client.get("/v1/models/no-such-model")
    assert missing.status_code == 404
    assert missing.json() == {"error": {
        "message": "The model 'no-such-model' does not exist", "type": "invalid_request_error",
        "param": "model", "code": "model_not_found"}}


def test_version_and_idle_loads(client, live):
    live.wait_idle()
    assert client.get("/version").json() == {"version": "0.1.0"}
    (load,) = client.get("/get_load").json()
    assert load["dp_rank"] == 0 and load["num_reqs"] == 0 and load["num_tokens"] == 0
    v1 = client.get("/v1/loads").json()
    assert v1["dp_rank_count"] == 1 and v1["version"] == "0.1.0"
    (rank,) = v1["loads"]
    assert rank["num_running_reqs"] == 0 and rank["num_used_tokens"] == 0
    assert rank["max_total_num_tokens"] == live.engine.cfg.kv_cache_tokens
    assert v1["aggregate"]["total_reqs"] == 0


def test_loads_count_a_running_request(client, live):
    import threading

    ids = [11, 57, 300, 42] * 5
    done = threading.Event()

    def long_request():
        with live.client() as c:
            c.post("/generate", json={"input_ids": ids, "rid": "load-probe", "sampling_params": {
                "max_new_tokens": 900, "ignore_eos": True}})
        done.set()

    t = threading.Thread(target=long_request)
    t.start()
    try:
        seen = None
        while not done.is_set():
            (load,) = client.get("/get_load").json()
            if load["num_reqs"] == 1 and load["num_tokens"] > len(ids):
                seen = load
                break
        assert seen is not None, "the running request never showed in /get_load"
        rank = client.get("/v1/loads").json()["loads"][0]
        assert rank["num_total_reqs"] == 1 and rank["num_used_tokens"] >= len(ids)
    finally:
        client.post("/abort_request", json={"rid": "load-probe"})
        t.join(60)
