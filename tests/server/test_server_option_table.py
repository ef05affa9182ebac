"""#33: one table of options (sloserve/server/options.py) for /generate and the OpenAI
endpoints. Every option of the table, set off its default, goes through both APIs: a served
one is answered 200 (and /generate and /v1/completions give the same text), an unserved one is
a 400 naming it; the request models hold exactly the table's options; README's option list is
the table's. Unknown keys follow SGLang 0.5.23: a 400 inside /generate's sampling_params,
ignored at the top level and on the OpenAI endpoints."""

from __future__ import annotations

from pathlib import Path

import pytest

from sloserve.server.openai_protocol import ChatCompletionRequest, CompletionRequest
from sloserve.server.options import OPTIONS, Option, markdown
from sloserve.server.protocol import GenerateRequest, SGLangSamplingParams

PROMPT = "hello world"
README = Path(__file__).resolve().parents[2] / "README.md"


def _generate(client, opt: Option):
    sp = {"max_new_tokens": 4, "temperature": 0.0, "sampling_seed": 1}
    top: dict = {}
    if opt.generate == "request":
        top[opt.name] = opt.example
    else:
        sp[opt.name] = opt.example
    if opt.name == "seed":
        del sp["sampling_seed"]
    if opt.name == "token_ids_logprob":
        top["return_logprob"] = True
    return client.post("/generate", json={"text": PROMPT, "sampling_params": sp, **top})


def _openai(client, opt: Option, path: str):
    body: dict = {"model": "m", "max_tokens": 4, "temperature": 0.0, "seed": 1,
                  opt.openai_name: opt.example}
    if path.endswith("chat/completions"):
        body["messages"] = [{"role": "user", "content": PROMPT}]
    else:
        body["prompt"] = PROMPT
    return client.post(path, json=body)


def _texts(gen: dict | list) -> list[str]:
    return [g["text"] for g in (gen if isinstance(gen, list) else [gen])]


@pytest.mark.parametrize("opt", OPTIONS, ids=[o.name for o in OPTIONS])
def test_every_option_is_served_or_a_400_naming_it_in_both_apis(client, opt):
    gen = None
    if opt.generate is not None:
        r = _generate(client, opt)
        if "generate" in opt.served:
            assert r.status_code == 200, r.text
            gen = r.json()
        else:
            assert r.status_code == 400, r.text
            assert r.json()["param"] == opt.where("generate"), r.json()
    if opt.openai_name is None:
        return
    paths = ["/v1/chat/completions"] * (not opt.completions_only) + \
        ["/v1/completions"] * (not opt.chat_only)
    for path in paths:
        r = _openai(client, opt, path)
        if "openai" in opt.served:
            assert r.status_code == 200, (path, r.text)
            if path == "/v1/completions" and gen is not None:  # served the same way
                assert [c["text"] for c in r.json()["choices"]] == _texts(gen)
        else:
            assert r.status_code == 400, (path, r.text)
            assert r.json()["error"]["param"] == opt.openai_name, r.json()


def test_request_models_hold_exactly_the_tables_options():
    sampling = {o.name for o in OPTIONS if o.generate == "sampling_params"}
    assert set(SGLangSamplingParams.model_fields) == sampling
    assert {o.name for o in OPTIONS if o.generate == "request"} <= set(
        GenerateRequest.model_fields)
    for model, skip in ((CompletionRequest, "chat_only"), (ChatCompletionRequest,
                                                          "completions_only")):
        names = {o.openai_name for o in OPTIONS if o.openai_name and not getattr(o, skip)}
        assert names <= set(model.model_fields), names - set(model.model_fields)


def test_unknown_keys_follow_sglang(client):
    r = client.post("/generate", json={"text": PROMPT, "sampling_params": {
        "max_new_tokens": 2, "no_such_key": 1}})
    assert r.status_code == 400 and "sampling_params.no_such_key" in r.text
    r = client.post("/generate", json={"text": PROMPT, "no_such_key": 1,
                                       "sampling_params": {"max_new_tokens": 2}})
    assert r.status_code == 200, r.text
    r = client.post("/v1/completions", json={"model": "m", "prompt": PROMPT, "max_tokens": 2,
                                             "no_such_key": 1})
    assert r.status_code == 200, r.text


def test_readme_lists_the_tables_options():
    text = README.read_text()
    start, end = "<!-- options-table -->\n", "\n<!-- /options-table -->"
    assert start in text and end in text
    assert text.split(start, 1)[1].split(end, 1)[0] == markdown()
