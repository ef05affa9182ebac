"""SGLang's native API: /generate (single, batch, stream, logprobs, stops, abort) and the
info/health endpoints."""

from __future__ import annotations

import json
import threading
import time

import torch
from sloserve_testing import prompts_of_lengths

GREEDY = {"temperature": 0.0, "ignore_eos": True}


def sse_chunks(resp) -> list:
    """Parsed `data:` payloads of a server-sent-event response, [DONE] as the string."""
    out = []
    for line in resp.iter_lines():
        if line.startswith("data:"):
            data = line[5:].strip()
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


def test_generate_text_meta_info(client):
    r = client.post("/generate", json={"text": "hello there", "sampling_params": {
        "max_new_tokens": 9, **GREEDY}, "rid": "my-rid"})
    assert r.status_code == 200, r.text
    body = r.json()
    meta = body["meta_info"]
    assert meta["id"] == "my-rid"
    assert meta["finish_reason"] == {"type": "length", "length": 9}
    assert meta["completion_tokens"] == len(body["output_ids"]) == 9
    assert meta["prompt_tokens"] > 0 and meta["e2e_latency"] > 0
    assert meta["spec_verify_ct"] >= 1  # fixed:3 speculates from the second token on
    assert 0.0 <= meta["spec_accept_rate"] <= 1.0
    assert 1.0 <= meta["spec_accept_length"] <= 4.0
    assert isinstance(body["text"], str)


def test_stream_is_cumulative_and_matches_non_stream(client):
    req = {"input_ids": [11, 57, 300, 42], "sampling_params": {"max_new_tokens": 12, **GREEDY}}
    full = client.post("/generate", json=req).json()
    with client.stream("POST", "/generate", json={**req, "stream": True}) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        chunks = sse_chunks(r)
    assert chunks[-1] == "[DONE]"
    data = chunks[:-1]
    counts = [c["meta_info"]["completion_tokens"] for c in data]
    assert counts == sorted(counts) and counts[-1] == 12
    for a, b in zip(data, data[1:]):
        assert b["text"].startswith(a["text"])  # cumulative text
    assert all(c["meta_info"]["finish_reason"] is None for c in data[:-1])
    assert data[-1]["meta_info"]["finish_reason"] == {"type": "length", "length": 12}
    assert data[-1]["output_ids"] == full["output_ids"]
    assert data[-1]["text"] == full["text"]


def test_batch_of_texts_and_ids(client):
    ids = prompts_of_lengths([3, 8, 5], seed=4)
    r = client.post("/generate", json={"input_ids": ids, "sampling_params": {
        "max_new_tokens": 5, **GREEDY}, "rid": "b"})
    assert r.status_code == 200, r.text
    out = r.json()
    assert [o["meta_info"]["id"] for o in out] == ["b_0", "b_1", "b_2"]
    assert [o["meta_info"]["prompt_tokens"] for o in out] == [3, 8, 5]
    singles = [client.post("/generate", json={"input_ids": p, "sampling_params": {
        "max_new_tokens": 5, **GREEDY}}).json()["output_ids"] for p in ids]
    assert [o["output_ids"] for o in out] == singles
    r = client.post("/generate", json={"text": ["one", "two"], "sampling_params": [
        {"max_new_tokens": 2, **GREEDY}, {"max_new_tokens": 4, **GREEDY}], "stream": True})
    chunks = sse_chunks(r)
    finals = {c["index"]: c for c in chunks[:-1] if c["meta_info"]["finish_reason"]}
    assert {i: c["meta_info"]["completion_tokens"] for i, c in finals.items()} == {0: 2, 1: 4}


def _hf_logprobs(hf_target, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        logits = hf_target(torch.tensor([ids])).logits[0].float()
    lp = torch.log_softmax(logits, dim=-1)
    return torch.tensor([lp[p - 1, ids[p]] for p in range(1, len(ids))])


def test_prompt_logprobs_match_transformers(client, hf_target):
    ids = prompts_of_lengths([40], seed=9)[0]
    r = client.post("/generate", json={
        "input_ids": ids, "sampling_params": {"max_new_tokens": 0}, "return_logprob": True,
        "logprob_start_len": 0, "top_logprobs_num": 3, "return_text_in_logprobs": True})
    assert r.status_code == 200, r.text
    meta = r.json()["meta_info"]
    assert meta["completion_tokens"] == 0 and meta["prompt_tokens"] == 40
    entries = meta["input_token_logprobs"]
    assert [e[1] for e in entries] == ids
    assert entries[0][0] is None and all(isinstance(e[2], str) for e in entries)
    ours = torch.tensor([e[0] for e in entries[1:]])
    torch.testing.assert_close(ours, _hf_logprobs(hf_target, ids), atol=2e-3, rtol=1e-3)
    tops = meta["input_top_logprobs"]
    assert tops[0] is None and all(len(t) == 3 for t in tops[1:])
    assert all(t[0][0] >= e[0] for t, e in zip(tops[1:], entries[1:]))  # top-1 is the max
    # logprob_start_len: entries from that position on; the first one is filled in
    r = client.post("/generate", json={"input_ids": ids, "sampling_params": {
        "max_new_tokens": 0}, "return_logprob": True, "logprob_start_len": 30})
    part = r.json()["meta_info"]["input_token_logprobs"]
    assert [e[1] for e in part] == ids[30:] and part[0][2] is None
    torch.testing.assert_close(torch.tensor([e[0] for e in part]), ours[29:], atol=1e-4, rtol=0)


def test_output_logprobs_with_generation(client, hf_target):
    ids = prompts_of_lengths([12], seed=2)[0]
    r = client.post("/generate", json={"input_ids": ids, "sampling_params": {
        "max_new_tokens": 6, **GREEDY}, "return_logprob": True})
    meta = r.json()["meta_info"]
    out = r.json()["output_ids"]
    assert meta["input_token_logprobs"] == []  # logprob_start_len -1: output tokens only
    got = meta["output_token_logprobs"]
    assert [e[1] for e in got] == out
    ref = _hf_logprobs(hf_target, ids + out)[len(ids) - 1:]
    torch.testing.assert_close(torch.tensor([e[0] for e in got]), ref, atol=2e-3, rtol=1e-3)


def test_stop_strings_and_no_stop_trim(client):
    base = {"input_ids": [11, 57, 300, 42], "sampling_params": {"max_new_tokens": 12, **GREEDY}}
    text = client.post("/generate", json=base).json()["text"]
    stop = text[3:6]
    assert len(stop) == 3 and stop in text
    sp = {"max_new_tokens": 12, "stop": [stop], **GREEDY}
    body = client.post("/generate", json={**base, "sampling_params": sp}).json()
    assert body["text"] == text[: text.index(stop)]
    assert body["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    kept = client.post("/generate", json={**base, "sampling_params": {
        **sp, "no_stop_trim": True}}).json()
    assert kept["text"] == text[: text.index(stop)] + stop
    with client.stream("POST", "/generate", json={**base, "sampling_params": sp,
                                                   "stream": True}) as r:
        chunks = sse_chunks(r)
    assert chunks[-2]["text"] == body["text"]


def test_abort_request_ends_the_stream(client, live):
    rid = "to-abort"
    req = {"input_ids": [5, 6, 7], "rid": rid, "stream": True,
           "sampling_params": {"max_new_tokens": 900, **GREEDY}}
    chunks = []

    def reader():
        with live.client() as c, c.stream("POST", "/generate", json=req) as r:
            chunks.extend(sse_chunks(r))

    t = threading.Thread(target=reader)
    t.start()
    deadline = time.monotonic() + 20
    aborted = 0
    while not aborted and time.monotonic() < deadline:
        aborted = client.post("/abort_request", json={"rid": rid}).json()["aborted"]
        time.sleep(0.02)
    t.join(20)
    assert aborted == 1 and not t.is_alive()
    assert chunks[-1] == "[DONE]"
    assert chunks[-2]["meta_info"]["finish_reason"]["type"] == "abort"
    assert chunks[-2]["meta_info"]["completion_tokens"] < 900
    assert client.post("/abort_request", json={"rid": "no-such"}).json()["aborted"] == 0


def test_info_and_health_endpoints(client, live):
    for path in ("/get_model_info", "/model_info"):
        info = client.get(path).json()
        assert info["model_path"] == live.state.model_path and info["is_generation"] is True
    for path in ("/get_server_info", "/server_info"):
        info = client.get(path).json()
        kv = info["kv_pool"]
        assert kv["free_blocks"] + kv["used_blocks"] == kv["total_blocks"] == 16384 // 8
        assert info["engine_config"]["spec_policy"] == "fixed:3"
        assert "accepted" in info["engine_stats"]
    assert client.get("/health").status_code == 200
    assert client.get("/health_generate").status_code == 200
    assert client.post("/flush_cache", json={"empty_cache": True}).status_code == 200
    json_type = {"Content-Type": "application/json"}  # state-changing: JSON only (issue 22)
    assert client.get("/flush_cache", headers=json_type).status_code == 200
    assert client.get("/flush_cache").status_code == 415


def test_sglang_bench_serving_payload(client):
    """What `python -m sglang.bench_serving --backend sglang` sends, neutral fields included."""
    payload = {"input_ids": [11, 57, 300, 42], "sampling_params": {
        "temperature": 0.0, "max_new_tokens": 6, "ignore_eos": True}, "stream": True,
        "lora_path": None, "return_logprob": False, "return_routed_experts": False,
        "logprob_start_len": -1}
    with client.stream("POST", "/generate", json=payload) as r:
        assert r.status_code == 200
        chunks = sse_chunks(r)
    assert chunks[-2]["meta_info"]["completion_tokens"] == 6 and chunks[-1] == "[DONE]"
    r = client.post("/generate", json={**payload, "lora_path": "my-adapter"})
    assert r.status_code == 400 and "lora_path" in r.json()["message"]


def test_trim_stop_cuts_a_stop_prefix_emitted_by_an_earlier_step():
    from sloserve.server.serving import _trim_stop

    assert _trim_stop("abc STO", "STOP") == "abc "  # "STO" went out before the match
    assert _trim_stop("abc STOP", "STOP") == "abc "
    assert _trim_stop("abc ", "STOP") == "abc "
    assert _trim_stop("xSxS", "xSy") == "xS"
