"""The OpenAI-compatible API through the official `openai` client, on the tiny pair."""

from __future__ import annotations

import openai
import pytest

GREEDY = {"temperature": 0.0}


@pytest.fixture
def oai(live):
    with openai.OpenAI(base_url=live.url + "/v1", api_key="unused", max_retries=0,
                       timeout=60) as c:
        yield c


def _native(client, text: str, n: int, **sp) -> dict:
    return client.post("/generate", json={"text": text, "sampling_params": {
        "max_new_tokens": n, "temperature": 0.0, **sp}}).json()


def test_models(oai, live):
    ids = [m.id for m in oai.models.list()]
    assert ids == [live.state.model_name]


def test_completions_match_native_greedy(oai, client, live):
    want = _native(client, "hello world", 10, ignore_eos=True)
    r = oai.completions.create(model=live.state.model_name, prompt="hello world", max_tokens=10,
                               extra_body={"ignore_eos": True}, **GREEDY)
    assert r.choices[0].text == want["text"]
    assert r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 10
    assert r.usage.prompt_tokens == want["meta_info"]["prompt_tokens"]
    assert r.usage.total_tokens == r.usage.prompt_tokens + 10
    stream = oai.completions.create(model="any", prompt="hello world", max_tokens=10,
                                    stream=True, stream_options={"include_usage": True},
                                    extra_body={"ignore_eos": True}, **GREEDY)
    chunks = list(stream)
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == want["text"]
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 10 and not chunks[-1].choices


def test_completions_batch_stop_and_seed(oai):
    r = oai.completions.create(model="m", prompt=["first", "second"], max_tokens=6, **GREEDY,
                               extra_body={"ignore_eos": True})
    assert [c.index for c in r.choices] == [0, 1] and r.usage.completion_tokens == 12
    text = r.choices[0].text
    stop = text[2:4]
    s = oai.completions.create(model="m", prompt="first", max_tokens=6, stop=[stop], **GREEDY,
                               extra_body={"ignore_eos": True})
    assert s.choices[0].text == text[: text.index(stop)] and s.choices[0].finish_reason == "stop"
    a, b = (oai.completions.create(model="m", prompt="first", max_tokens=8, temperature=1.0,
                                   seed=123) for _ in range(2))
    assert a.choices[0].text == b.choices[0].text  # a seed makes sampling reproducible


def test_chat_completions(oai, client, live):
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    prompt = live.state.tokenizer.apply_chat_template(msgs, tokenize=False,
                                                      add_generation_prompt=True)
    want = _native(client, prompt, 8, ignore_eos=True)
    r = oai.chat.completions.create(model="m", messages=msgs, max_tokens=8,
                                    extra_body={"ignore_eos": True, "tpot_slo": 0.5}, **GREEDY)
    msg = r.choices[0].message
    assert msg.role == "assistant" and msg.content == want["text"]
    assert r.usage.prompt_tokens == want["meta_info"]["prompt_tokens"]
    assert r.usage.completion_tokens == 8
    stream = oai.chat.completions.create(model="m", messages=msgs, max_completion_tokens=8,
                                         stream=True, extra_body={"ignore_eos": True}, **GREEDY)
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == want["text"]
    assert chunks[-1].choices[0].finish_reason == "length"


def test_openai_errors_are_400_with_message(oai):
    with pytest.raises(openai.BadRequestError) as e:
        oai.chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}],
                                    max_tokens=4, n=0)
    assert "n: must be an integer >= 1" in str(e.value)
    with pytest.raises(openai.BadRequestError) as e:
        oai.chat.completions.create(
            model="m", messages=[{"role": "user", "content": "x"}], max_tokens=4,
            response_format={"type": "json_schema", "json_schema": {
                "name": "x", "schema": {"type": "integer", "minimum": 3, "maximum": 1}}})
    assert "response_format" in str(e.value)
    with pytest.raises(openai.BadRequestError) as e:
        oai.completions.create(model="m", prompt="x", max_tokens=4, temperature=-1)
    assert "temperature" in str(e.value)
