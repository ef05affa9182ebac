"""#33: min_p, logit_bias, skip_special_tokens, stream_interval, token_ids_logprob and chat's
max_tokens + max_completion_tokens are served by /generate and the OpenAI endpoints alike."""

from __future__ import annotations

import json

import openai
import pytest

N = 8


@pytest.fixture
def oai(live):
    with openai.OpenAI(base_url=live.url + "/v1", api_key="unused", max_retries=0,
                       timeout=60) as c:
        yield c


def _gen(client, **sp) -> dict:
    r = client.post("/generate", json={"text": "hello world", "sampling_params": {
        "max_new_tokens": N, "ignore_eos": True, **sp}})
    assert r.status_code == 200, r.text
    return r.json()


def test_logit_bias_steers_both_apis(client, oai):
    plain = _gen(client, temperature=0.0)["output_ids"]
    tok = next(t for t in range(300, 400) if t not in plain)
    got = _gen(client, temperature=0.0, logit_bias={str(tok): 100.0})
    assert got["output_ids"] == [tok] * N
    r = oai.completions.create(model="m", prompt="hello world", max_tokens=N, temperature=0.0,
                               logit_bias={str(tok): 100}, extra_body={"ignore_eos": True})
    assert r.choices[0].text == got["text"]


def test_min_p_one_is_greedy_in_both_apis(client, oai):
    """min_p = 1 keeps the top token only: sampling at temperature 1 gives greedy output."""
    greedy = _gen(client, temperature=0.0)
    for seed in range(3):
        assert _gen(client, temperature=1.0, min_p=1.0, sampling_seed=seed)["output_ids"] == \
            greedy["output_ids"]
        r = oai.completions.create(model="m", prompt="hello world", max_tokens=N, seed=seed,
                                   temperature=1.0, extra_body={"ignore_eos": True,
                                                                "min_p": 1.0})
        assert r.choices[0].text == greedy["text"]


def test_skip_special_tokens_false_keeps_them(client, live):
    eos = live.engine.parts.tokenizer.eos_token_id
    sp = dict(temperature=0.0, logit_bias={str(eos): 100.0})
    kept = _gen(client, skip_special_tokens=False, **sp)
    skipped = _gen(client, **sp)
    assert kept["output_ids"] == skipped["output_ids"] == [eos] * N
    assert skipped["text"] == "" and kept["text"] != ""


def _stream_lengths(resp) -> list[int]:
    out = []
    for line in resp.iter_lines():
        if line.startswith("data: ") and line != "data: [DONE]":
            out.append(len(json.loads(line[6:])["output_ids"]))
    return out


@pytest.mark.parametrize("interval", [None, 3])
def test_stream_interval(client, interval):
    body = {"text": "hello world", "stream": True, "sampling_params": {
        "max_new_tokens": 10, "ignore_eos": True, "temperature": 0.0,
        "stream_interval": interval}}
    with client.stream("POST", "/generate", json=body) as r:
        assert r.status_code == 200
        lengths = _stream_lengths(r)
    assert lengths[-1] == 10
    steps = [b - a for a, b in zip(lengths, lengths[1:-1])]
    if interval:
        assert all(s >= interval for s in steps)
    assert len(lengths) >= 2


def test_stream_interval_in_chat(oai):
    chunks = list(oai.chat.completions.create(
        model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=10, stream=True,
        temperature=0.0, extra_body={"ignore_eos": True, "stream_interval": 4}))
    content = [c for c in chunks if c.choices and c.choices[0].delta.content]
    assert 1 <= len(content) <= 4  # 10 tokens: the first, then at least 4 per chunk


def test_token_ids_logprob(client):
    ids = [5, 300, 301]
    r = client.post("/generate", json={"text": "hello world", "return_logprob": True,
                                       "token_ids_logprob": ids, "sampling_params": {
                                           "max_new_tokens": N, "ignore_eos": True,
                                           "temperature": 0.0, "logit_bias": {"300": 100}}})
    assert r.status_code == 200, r.text
    meta = r.json()["meta_info"]
    rows = meta["output_token_ids_logprobs"]
    assert len(rows) == N and all([t for _, t, _ in row] == ids for row in rows)
    # the emitted token (300) has the same value in both lists
    for row, (lp, tok, _) in zip(rows, meta["output_token_logprobs"]):
        assert tok == 300 and abs(row[1][0] - lp) < 1e-5


def test_chat_max_tokens_and_max_completion_tokens(oai):
    r = oai.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}],
                                    max_tokens=9, max_completion_tokens=5, temperature=0.0,
                                    extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 5
