"""#19 through the HTTP server: SGLang frontend programs with regex / dtype=int / min_tokens;
JSON-schema requests that always parse and validate (temperature 0 and 0.8, speculative and
not); greedy output per option equal with and without speculation (fixed k and specserve);
n samples, stop_token_ids trimming, OpenAI response_format / logprobs / echo / n.

Three servers on the tiny pair: plain decoding ("ar"), fixed:3 and specserve. JSON schemas
are compiled in the compact layout (--constrained-json-disable-any-whitespace): the random-
weight model, left any whitespace, writes whitespace runs longer than any token budget; with
bounded strings and integers the compact document always fits the budget.
"""

from __future__ import annotations

import dataclasses
import json
import re

import jsonschema
import pytest
import torch
from server_testing import start_server, tiny_config
from sloserve_testing import prompts_of_lengths

from sloserve.runtime.constraints import GrammarState
from sloserve.runtime.engine import Engine
from sloserve.runtime.request import SamplingParams

POLICIES = ("ar", "fixed:3", "specserve")
SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 8},
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "ok": {"type": "boolean"}}, "required": ["name", "age", "ok"], "additionalProperties": False}
EBNF = 'root ::= "(" expr ")"\nexpr ::= term (("+" | "*") term)*\nterm ::= [0-9]+ | "(" expr ")"'
PROMPTS = prompts_of_lengths([5 + 3 * i for i in range(6)], seed=31)


@pytest.fixture(scope="module")
def servers(tiny_pair):
    """policy -> live server; each engine idle with its KV pool free at the end."""
    out = {}
    for policy in POLICIES:
        cfg = dataclasses.replace(tiny_config(tiny_pair, tpot_slo=0.05), spec_policy=policy,
                                  constrained_json_disable_any_whitespace=True)
        if policy == "specserve":
            # its plans from the rough cost estimate alone, not corrected online from this
            # machine's step times: the tests assert that it drafted, and corrected on a fast
            # machine it rightly drafted nothing for the last requests (n = 2, 2026-12-06)
            cfg = dataclasses.replace(cfg, spec_options=(("correct_cost", "false"),))
        out[policy] = start_server(Engine(cfg))
    yield out
    for srv in out.values():
        info = srv.wait_idle()
        srv.stop()
        assert info["kv_pool"]["used_blocks"] == 0, "KV blocks leaked"
        srv.engine.check_idle_integrity()


def _sglang():
    try:
        import sglang
    except ImportError:
        pytest.fail("the SGLang frontend is not installed: bash scripts/install_sglang_frontend.sh")
    return sglang


def _generate(srv, sp: dict, prompts=PROMPTS, **extra) -> list[dict]:
    with srv.client() as c:
        r = c.post("/generate", json={"input_ids": prompts, "sampling_params": sp, **extra})
    assert r.status_code == 200, r.text
    return r.json()


# ------------------------------------------------------------------ acceptance 1: frontend
def test_sglang_frontend_regex_dtype_int_and_min_tokens(servers):
    sgl = _sglang()
    from sglang.lang.ir import REGEX_INT

    backend = sgl.RuntimeEndpoint(servers["fixed:3"].url)

    @sgl.function
    def fields(s):
        s += "Record 7\nCount: " + sgl.gen("count", dtype=int, max_tokens=24, temperature=0)
        s += "\nCode: " + sgl.gen("code", regex=r"[A-Z]{3}-[0-9]{2}", max_tokens=16,
                                  temperature=0)
        s += "\nNote: " + sgl.gen("probe", max_tokens=1, temperature=0, return_logprob=True)

    st = fields.run(backend=backend)
    assert re.fullmatch(REGEX_INT, st["count"]), st["count"]
    assert isinstance(int(st["count"].strip()), int)
    assert re.fullmatch(r"[A-Z]{3}-[0-9]{2}", st["code"]), st["code"]
    assert st.get_meta_info("code")["finish_reason"]["type"] == "stop"  # the grammar ended it
    # the token the model writes first after "Note: " becomes a stop token: without
    # min_tokens the generation stops at once, with min_tokens it must go on
    first = st.get_meta_info("probe")["output_token_logprobs"][0][1]

    @sgl.function
    def note(s, min_tokens):
        s += "Record 7\nCount: " + st["count"] + "\nCode: " + st["code"] + "\nNote: "
        s += sgl.gen("note", max_tokens=12, temperature=0, stop_token_ids=[first],
                     min_tokens=min_tokens)

    assert note.run(min_tokens=0, backend=backend).get_meta_info("note")[
        "completion_tokens"] == 1
    forced = note.run(min_tokens=8, backend=backend).get_meta_info("note")
    assert forced["completion_tokens"] >= 8


# ------------------------------------------------------------------ acceptance 1: JSON
@pytest.mark.parametrize("temperature", [0.0, 0.8])
@pytest.mark.parametrize("policy", POLICIES)
def test_json_schema_output_always_parses_and_validates(servers, policy, temperature):
    srv = servers[policy]
    prompts = prompts_of_lengths([4 + i for i in range(12)], seed=int(temperature * 10) + 5)
    sp = [{"max_new_tokens": 96, "temperature": temperature, "json_schema": json.dumps(SCHEMA),
           "sampling_seed": 100 + i} for i in range(len(prompts))]
    outs = _generate(srv, sp, prompts)
    with srv.client() as c:  # OpenAI's response_format, n choices
        r = c.post("/v1/chat/completions", json={
            "model": "m", "messages": [{"role": "user", "content": "a person"}], "n": 4,
            "max_tokens": 96, "temperature": temperature, "seed": 3, "response_format": {
                "type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}}})
    assert r.status_code == 200, r.text
    texts = [o["text"] for o in outs] + [ch["message"]["content"] for ch in r.json()["choices"]]
    assert len(texts) == 16
    for o in outs:
        assert o["meta_info"]["finish_reason"]["type"] == "stop", o
    for t in texts:
        jsonschema.validate(json.loads(t), SCHEMA)
    if policy != "ar":
        assert sum(o["meta_info"]["spec_verify_ct"] for o in outs) > 0
    if temperature > 0:
        assert len(set(texts)) > 4  # sampled, not one document


def test_json_object_output_is_accepted_by_the_object_grammar(servers):
    srv = servers["specserve"]
    with srv.client() as c:
        r = c.post("/v1/chat/completions", json={
            "model": "m", "messages": [{"role": "user", "content": "json please"}],
            "max_tokens": 24, "temperature": 0.8, "seed": 1, "n": 3,
            "response_format": {"type": "json_object"}})
    assert r.status_code == 200, r.text
    tok = srv.engine.tokenizer
    grammar = srv.engine.constraints.grammar(SamplingParams(json_schema='{"type": "object"}'))
    for ch in r.json()["choices"]:
        text = ch["message"]["content"]
        assert text.startswith("{")
        state = GrammarState(grammar)
        assert all(state.push(t) for t in tok.encode(text, add_special_tokens=False)) or \
            ch["finish_reason"] == "length"
        if ch["finish_reason"] == "stop":
            assert isinstance(json.loads(text), dict)


# ------------------------------------------------------------------ acceptance 2: greedy
OPTIONS = {
    "regex": {"regex": r"[0-9]{2,4}-[a-z]+( [a-z]+)*"},
    "json_schema": {"json_schema": json.dumps(SCHEMA)},
    "ebnf": {"ebnf": EBNF},
    "penalties": {"frequency_penalty": 0.7, "presence_penalty": 0.4,
                  "repetition_penalty": 1.3},
    # tokens the plain greedy outputs of PROMPTS write within their first six
    "min_new_tokens": {"min_new_tokens": 14, "stop_token_ids": [1506, 198, 62, 253, 1417, 1814]},
    "stop_token_ids": {"stop_token_ids": [1506, 1417, 1814, 1866]},
    "no_stop_trim": {"stop": ["e"], "no_stop_trim": True},
    "n": {"n": 2},
}


@pytest.mark.parametrize("option", list(OPTIONS))
def test_greedy_with_speculation_equals_plain_per_option(servers, option):
    sp = {"max_new_tokens": 20, "temperature": 0.0, **OPTIONS[option]}
    got = {p: _generate(servers[p], sp, return_logprob=True, top_logprobs_num=2)
           for p in POLICIES}
    ref = got["ar"]
    assert len(ref) == len(PROMPTS) * sp.get("n", 1)
    for policy in ("fixed:3", "specserve"):
        for a, b in zip(got[policy], ref):
            assert a["output_ids"] == b["output_ids"] and a["text"] == b["text"]
            la = [e[0] for e in a["meta_info"]["output_token_logprobs"]]
            lb = [e[0] for e in b["meta_info"]["output_token_logprobs"]]
            torch.testing.assert_close(torch.tensor(la), torch.tensor(lb), atol=1e-4, rtol=0)
            ta = [[e[1] for e in row] for row in a["meta_info"]["output_top_logprobs"]]
            assert ta == [[e[1] for e in row] for row in b["meta_info"]["output_top_logprobs"]]
        assert sum(o["meta_info"]["spec_verify_ct"] for o in got[policy]) > 0
    plain = [o["output_ids"] for o in _generate(servers["ar"], {"max_new_tokens": 20,
                                                               "temperature": 0.0})]
    if option == "n":  # greedy samples: each is the plain output
        assert [o["output_ids"] for o in ref[::2]] == [o["output_ids"] for o in ref[1::2]] == plain
    else:  # the option changed the output (so the equality above is about it)
        assert [o["output_ids"] for o in ref] != plain


def test_min_new_tokens_and_stop_token_ids_shape_the_output(servers):
    """The premises of the cases above: the stop tokens end requests early unless
    min_new_tokens holds them; a stop token's text is trimmed and kept with no_stop_trim."""
    srv = servers["fixed:3"]
    stops = OPTIONS["min_new_tokens"]["stop_token_ids"]
    early = _generate(srv, {"max_new_tokens": 20, "temperature": 0.0, "stop_token_ids": stops})
    assert any(o["meta_info"]["completion_tokens"] < 14 for o in early)
    held = _generate(srv, {"max_new_tokens": 20, "temperature": 0.0,
                           **OPTIONS["min_new_tokens"]})
    assert all(o["meta_info"]["completion_tokens"] >= 14 for o in held)
    sp = {"max_new_tokens": 20, "temperature": 0.0, **OPTIONS["stop_token_ids"]}
    cut = _generate(srv, sp)
    kept = _generate(srv, {**sp, "no_stop_trim": True})
    stopped = 0
    for a, b in zip(cut, kept):
        assert a["output_ids"] == b["output_ids"]
        if a["meta_info"]["finish_reason"] == {"type": "stop", "matched": a["output_ids"][-1]}:
            stopped += 1
            tail = srv.engine.tokenizer.decode(a["output_ids"][-1:])
            assert b["text"] == a["text"] + tail and tail.strip()
    assert stopped >= 2


@pytest.mark.parametrize("policy", ["ar", "fixed:3"])
def test_n_samples_are_the_seeded_single_samples(servers, policy):
    """Sample i of a seeded request is the request seeded seed + i. (Under specserve a seeded
    sample also depends on the k the controller picks, which depends on the batch.)"""
    srv = servers[policy]
    sp = {"max_new_tokens": 12, "temperature": 0.9, "sampling_seed": 11}
    many = _generate(srv, {**sp, "n": 3}, PROMPTS[0])
    assert isinstance(many, list) and len(many) == 3
    singles = [_generate(srv, {**sp, "sampling_seed": 11 + i}, PROMPTS[0]) for i in range(3)]
    assert [m["output_ids"] for m in many] == [s["output_ids"] for s in singles]
    assert len({tuple(m["output_ids"]) for m in many}) == 3


# ------------------------------------------------------------------ OpenAI logprobs, echo
def test_openai_completions_logprobs_echo_and_n(servers):
    srv = servers["fixed:3"]
    tok = srv.engine.tokenizer
    body = {"model": "m", "prompt": "The list: one, two,", "max_tokens": 24, "temperature": 0,
            "logprobs": 2, "echo": True, "n": 2, "presence_penalty": 2.0,
            "frequency_penalty": 1.0}
    with srv.client() as c:
        r = c.post("/v1/completions", json=body).json()
        native = c.post("/generate", json={"text": body["prompt"], "return_logprob": True,
                                           "sampling_params": {"max_new_tokens": 24,
                                                               "temperature": 0,
                                                               "presence_penalty": 2.0,
                                                               "frequency_penalty": 1.0}}).json()
        plain = c.post("/v1/completions", json={**body, "presence_penalty": 0,
                                                       "frequency_penalty": 0}).json()
        with c.stream("POST", "/v1/completions", json={**body, "stream": True, "n": 1}) as s:
            chunks = [json.loads(x[5:]) for x in s.iter_lines()
                      if x.startswith("data:") and x != "data: [DONE]"]
    assert [ch["index"] for ch in r["choices"]] == [0, 1]
    assert r["choices"][0]["text"] == r["choices"][1]["text"] == body["prompt"] + native["text"]
    assert r["choices"][0]["text"] != plain["choices"][0]["text"]  # the penalty acted
    lp = r["choices"][0]["logprobs"]
    n_prompt = len(tok.encode(body["prompt"], add_special_tokens=False))
    assert len(lp["tokens"]) == n_prompt + len(native["output_ids"])
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    ours = lp["token_logprobs"][n_prompt:]
    want = [e[0] for e in native["meta_info"]["output_token_logprobs"]]
    torch.testing.assert_close(torch.tensor(ours), torch.tensor(want), atol=1e-5, rtol=0)
    assert lp["text_offset"][n_prompt] == len(body["prompt"])
    assert all(len(t) <= 2 for t in lp["top_logprobs"][1:])
    streamed = [ch["choices"][0] for ch in chunks if ch["choices"]]
    assert "".join(x["text"] for x in streamed) == r["choices"][0]["text"]
    toks = [t for x in streamed if x["logprobs"] for t in x["logprobs"]["token_logprobs"]]
    assert toks == lp["token_logprobs"]


def test_openai_chat_logprobs_under_a_grammar(servers):
    srv = servers["specserve"]
    with srv.client() as c:
        r = c.post("/v1/chat/completions", json={
            "model": "m", "messages": [{"role": "user", "content": "code?"}], "max_tokens": 16,
            "temperature": 0, "logprobs": True, "top_logprobs": 3,
            "regex": r"[A-Z]{3}-[0-9]{2}"}).json()
    ch = r["choices"][0]
    assert re.fullmatch(r"[A-Z]{3}-[0-9]{2}", ch["message"]["content"])
    content = ch["logprobs"]["content"]
    assert "".join(e["token"] for e in content[:-1]) == ch["message"]["content"]
    for e in content:  # greedy under the mask: the chosen token is the masked argmax
        assert e["top_logprobs"][0]["token"] == e["token"]
        assert e["top_logprobs"][0]["logprob"] == pytest.approx(e["logprob"])
        allowed = [x for x in e["top_logprobs"] if x["logprob"] > -1e30]
        assert all(x["logprob"] <= e["logprob"] for x in allowed)
