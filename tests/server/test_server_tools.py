"""#33 tool calling on /v1/chat/completions through the official `openai` client, on the tiny
pair: tool_choice auto, required and named, streamed and not, a history with tool results;
required / named arguments always validate against the function's schema (50 sampled calls
each); greedy tool-call answers with speculation (the default policy) equal those without.

Servers run with --tool-call-parser qwen25 and compact JSON (the random-weight model, left any
whitespace, writes whitespace runs longer than any token budget). "auto" with a random model
writes no call by itself, so the auto cases hold the answer to a call with a `regex`: the
parser then has a real call to read."""

from __future__ import annotations

import dataclasses
import json
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import openai
import pytest
from server_testing import start_server, tiny_config

from sloserve.runtime.config import EngineConfig
from sloserve.runtime.engine import Engine

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 8},
        "unit": {"type": "string", "enum": ["c", "f"]}},
        "required": ["city", "unit"], "additionalProperties": False}}}
ADD = {"type": "function", "function": {
    "name": "add", "parameters": {"type": "object", "properties": {
        "a": {"type": "integer", "minimum": -99, "maximum": 99},
        "b": {"type": "integer", "minimum": -99, "maximum": 99}},
        "required": ["a", "b"], "additionalProperties": False}}}
TOOLS = [WEATHER, ADD]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
# an auto answer held to one qwen25-format call (the parser reads it as any model's)
AUTO_CALL = r'Checking\.<tool_call>\n\{"name": "get_weather", "arguments": \{"city": "[a-z]{1,6}", "unit": "c"\}\}\n</tool_call>'
POLICIES = ("default", "ar")


@pytest.fixture(scope="module")
def servers(tiny_pair):
    out = {}
    for name in POLICIES:
        policy = EngineConfig().spec_policy if name == "default" else "ar"
        cfg = dataclasses.replace(tiny_config(tiny_pair), spec_policy=policy,
                                  constrained_json_disable_any_whitespace=True)
        out[name] = start_server(Engine(cfg), tool_call_parser="qwen25")
    yield out
    for srv in out.values():
        info = srv.wait_idle()
        srv.stop()
        assert info["kv_pool"]["used_blocks"] == 0, "KV blocks leaked"
        srv.engine.check_idle_integrity()


def _client(srv) -> openai.OpenAI:
    return openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def _check_calls(calls, names=("get_weather", "add")) -> list[tuple[str, dict]]:
    out = []
    for c in calls:
        assert c.type == "function" and c.id.startswith("call_") and c.function.name in names
        args = json.loads(c.function.arguments)
        jsonschema.validate(args, SCHEMAS[c.function.name])
        out.append((c.function.name, args))
    return out


def _streamed(stream) -> tuple[str, list[tuple[str, dict]], str | None]:
    """(content, calls, finish_reason) of a streamed choice, accumulated by index."""
    content, calls, finish, ids = "", {}, None, {}
    for chunk in stream:
        ch = chunk.choices[0]
        content += ch.delta.content or ""
        for d in ch.delta.tool_calls or []:
            c = calls.setdefault(d.index, {"name": "", "arguments": ""})
            if d.id:
                ids[d.index] = d.id
            c["name"] += d.function.name or ""
            c["arguments"] += d.function.arguments or ""
        finish = ch.finish_reason or finish
    assert sorted(ids) == sorted(calls)
    got = [(c["name"], json.loads(c["arguments"])) for _, c in sorted(calls.items())]
    for name, args in got:
        jsonschema.validate(args, SCHEMAS[name])
    return content, got, finish


def test_auto_reads_a_call_whole_and_streamed(servers):
    with _client(servers["default"]) as oai:
        kw = dict(model="m", messages=ASK, tools=TOOLS, max_tokens=128, temperature=0,
                  extra_body={"regex": AUTO_CALL})
        r = oai.chat.completions.create(**kw)
        ch = r.choices[0]
        assert ch.finish_reason == "tool_calls" and ch.message.content == "Checking."
        [(name, args)] = _check_calls(ch.message.tool_calls)
        assert name == "get_weather" and args["unit"] == "c"
        content, calls, finish = _streamed(oai.chat.completions.create(**kw, stream=True))
        assert (content, calls, finish) == ("Checking.", [(name, args)], "tool_calls")
        # unconstrained: the random model writes text, served as content
        plain = oai.chat.completions.create(model="m", messages=ASK, tools=TOOLS, max_tokens=8,
                                            temperature=0, tool_choice="auto")
        assert plain.choices[0].message.tool_calls is None
        assert plain.choices[0].finish_reason in ("stop", "length")
        # "none": the tools are not offered (the prompt is the one without them)
        none = oai.chat.completions.create(model="m", messages=ASK, tools=TOOLS, max_tokens=4,
                                           temperature=0, tool_choice="none")
        bare = oai.chat.completions.create(model="m", messages=ASK, max_tokens=4, temperature=0)
        assert none.usage.prompt_tokens == bare.usage.prompt_tokens
        assert none.choices[0].message.content == bare.choices[0].message.content
        assert plain.usage.prompt_tokens > bare.usage.prompt_tokens


def forced_calls(srv, tool_choice, names, max_tokens: int, workers: int,
                 n: int = 50) -> list[list[tuple[str, dict]]]:
    """n sampled answers (temperature 1, seeds 0..n-1, every fifth streamed) to ASK with
    `tool_choice`, each checked to be a call of one of `names` whose arguments validate
    against its function's schema; returns them."""

    def ask(seed: int) -> list[tuple[str, dict]]:
        with _client(srv) as oai:
            kw = dict(model="m", messages=ASK, tools=TOOLS, tool_choice=tool_choice,
                      max_tokens=max_tokens, temperature=1.0, seed=seed,
                      parallel_tool_calls=False)
            if seed % 5 == 0:
                _, calls, finish = _streamed(oai.chat.completions.create(**kw, stream=True))
                assert finish == "tool_calls" and calls  # (_streamed validates each)
                return calls
            r = oai.chat.completions.create(**kw)
            ch = r.choices[0]
            assert ch.finish_reason == "tool_calls" and ch.message.content is None
            return _check_calls(ch.message.tool_calls, names)

    with ThreadPoolExecutor(workers) as pool:
        answers = list(pool.map(ask, range(n)))
    assert all(answers) and len(answers) == n
    assert {name for calls in answers for name, _ in calls} <= set(names)
    return answers


@pytest.mark.parametrize("choice", ["required", "named"])
def test_forced_calls_always_validate(servers, choice):
    """50 sampled answers (temperature 1, different seeds): every one is a call whose
    arguments validate against its function's schema."""
    tool_choice = "required" if choice == "required" else {
        "type": "function", "function": {"name": "add"}}
    names = ("get_weather", "add") if choice == "required" else ("add",)
    answers = forced_calls(servers["default"], tool_choice, names, max_tokens=192, workers=4)
    assert len({json.dumps(a) for a in answers}) > 10  # sampled, not one answer
    if choice == "required":
        assert {n for calls in answers for n, _ in calls} == set(names)


def test_history_with_tool_results_is_served(servers):
    history = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [{
            "id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "c"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"},
    ]
    with _client(servers["default"]) as oai:
        r = oai.chat.completions.create(model="m", messages=history, tools=TOOLS,
                                        max_tokens=8, temperature=0)
        short = oai.chat.completions.create(model="m", messages=ASK, tools=TOOLS,
                                            max_tokens=8, temperature=0)
        again = oai.chat.completions.create(model="m", messages=history, tools=[WEATHER],
                                            tool_choice="required", max_tokens=128,
                                            temperature=0, parallel_tool_calls=False)
    assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")
    assert r.usage.prompt_tokens > short.usage.prompt_tokens + 10  # the call and its result
    _check_calls(again.choices[0].message.tool_calls)


def _greedy_answers(srv) -> list:
    """Greedy answers to forced and auto choices; parallel_tool_calls false (one call at most:
    greedy, the random model would add calls up to the token budget) but for the last."""
    named = {"type": "function", "function": {"name": "get_weather"}}
    cases = [("required", {}, False), (named, {}, False), ("auto", {"regex": AUTO_CALL}, False),
             ("required", {}, True)]
    out = []
    with _client(srv) as oai:
        for choice, extra, parallel in cases:
            for msgs in (ASK, [{"role": "user", "content": "add two numbers"}]):
                r = oai.chat.completions.create(model="m", messages=msgs, tools=TOOLS,
                                                tool_choice=choice, max_tokens=160,
                                                temperature=0, extra_body=extra,
                                                parallel_tool_calls=parallel)
                m = r.choices[0].message
                out.append((m.content, [(c.function.name, c.function.arguments)
                                        for c in m.tool_calls or []],
                            r.choices[0].finish_reason))
    return out


def test_greedy_tool_calls_equal_with_and_without_speculation(servers):
    before = servers["default"].engine.stats.verify_steps
    spec = _greedy_answers(servers["default"])
    assert spec == _greedy_answers(servers["ar"])
    assert all(calls and finish == "tool_calls" for _, calls, finish in spec[:6])
    assert servers["default"].engine.stats.verify_steps > before  # drafts were verified
    assert servers["ar"].engine.stats.verify_steps == 0


BAD = [
    ({"tools": [{"type": "function", "function": {"description": "no name"}}]},
     "tools[0].function.name"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": "x"}}]},
     "tools[0].function.parameters"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "array"}}}]}, "tools[0].function.parameters"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "mul"}}},
     "tool_choice.function.name"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
     "tool_choice"),
    ({"messages": [{"role": "user", "content": "x", "tool_calls": []}]}, None),
]


@pytest.mark.parametrize("extra,field", BAD, ids=[f or "ok" for _, f in BAD])
def test_bad_tool_specs_are_400_naming_the_field(servers, extra, field):
    with servers["default"].client() as c:
        r = c.post("/v1/chat/completions", json={"model": "m", "messages": ASK,
                                                 "max_tokens": 2, **extra})
    if field is None:  # an empty tool_calls list on a user message is harmless
        assert r.status_code == 200, r.text
        return
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == field or err["message"].startswith(field), err


def test_auto_without_a_parser_is_a_400(live):
    with live.client() as c:
        r = c.post("/v1/chat/completions", json={"model": "m", "messages": ASK, "tools": TOOLS,
                                                 "max_tokens": 2})
        assert r.status_code == 400 and r.json()["error"]["param"] == "tool_choice"
        assert "--tool-call-parser" in r.json()["error"]["message"]
        ok = c.post("/v1/chat/completions", json={"model": "m", "messages": ASK, "tools": TOOLS,
                                                  "tool_choice": "none", "max_tokens": 2})
        assert ok.status_code == 200, ok.text
