"""Issue 22, acceptance 7: property-based fuzzing (hypothesis) of the in-process API and of
the HTTP layer with random sampling parameters and bodies, extremes included (huge and
negative integers, NaN, infinities, subnormals, junk types, unknown keys, malformed JSON).
Properties: the engine accepts or refuses with InvalidRequest, the server answers only 200
or a 4xx JSON error, no engine step ever fails, the engine stays alive, the KV pool ends all
free. Issue 34, acceptance 2: well-formed bodies with every honoured field at its extremes
(tiny temperatures and repetition penalties, grammars that admit nothing or nest 10k deep,
huge n and top_logprobs_num, batches) answer 200 or a 400, never a 5xx, and no request fails
in the engine. Bounded: SLOSERVE_FUZZ_EXAMPLES examples per test (default 40), at most 3 new tokens
per request, a small KV pool so that huge token counts are refused rather than run."""

from __future__ import annotations

import json
import math
import os

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from server_testing import start_server, tiny_config

from sloserve.runtime.engine import Engine
from sloserve.runtime.request import InvalidRequest, SamplingParams

EXAMPLES = int(os.environ.get("SLOSERVE_FUZZ_EXAMPLES", "40"))
FUZZ = settings(max_examples=EXAMPLES, deadline=None, database=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture,
                                       HealthCheck.too_slow, HealthCheck.data_too_large])

EXTREME_FLOATS = [0.0, -0.0, 5e-324, 1e-300, 1e-45, 1e-40, 1e-7, 1e-6, 0.5, 1.0, 2.0, 1e6,
                  1e39, 1e308, math.inf, -math.inf, math.nan, -1e-300, -1.0]
EXTREME_INTS = [-(2**64), -(2**63) - 1, -(2**63), -2, -1, 0, 1, 2, 2047, 2048, 2**31, 2**63,
                2**64 - 1, 2**64, 10**30]
floats = st.one_of(st.sampled_from(EXTREME_FLOATS), st.floats(), st.floats(0, 2))
ints = st.one_of(st.sampled_from(EXTREME_INTS), st.integers(), st.integers(-3, 50))
scalars = st.one_of(st.none(), st.booleans(), ints, floats, st.text(max_size=12))
json_values = st.recursive(scalars, lambda c: st.lists(c, max_size=3)
                           | st.dictionaries(st.text(max_size=6), c, max_size=3), max_leaves=6)
texts = st.text(max_size=24)


def _either(valid):
    """Mostly values of the key's type and range (so requests run), some junk."""
    return st.one_of(valid, valid, valid, json_values)


SAMPLING = {
    "max_new_tokens": _either(st.integers(0, 3)) | st.sampled_from([-1, 10**9, 2**63, 10**30]),
    "temperature": _either(floats),
    "top_p": _either(floats),
    "top_k": _either(ints),
    "min_p": _either(floats),
    "seed": _either(ints),
    "sampling_seed": _either(ints),
    "stop": _either(st.one_of(texts, st.lists(texts, max_size=3))),
    "stop_token_ids": _either(st.lists(ints, max_size=3)),
    "ignore_eos": _either(st.booleans()),
    "n": _either(st.integers(-1, 3)),
    "frequency_penalty": _either(floats),
    "presence_penalty": _either(floats),
    "repetition_penalty": _either(floats),
    "tpot_slo": _either(floats),
    "ttft_slo": _either(floats),
    "regex": _either(texts),
    "no_stop_trim": _either(st.booleans()),
    "logit_bias": _either(st.dictionaries(texts, floats, max_size=2)),
    "unknown_" + "key": json_values,
}
# values inside the accepted ranges, extremes included: these requests run
VALID = {
    "max_new_tokens": st.one_of(st.integers(1, 3), st.integers(1, 3), st.just(0)),
    "temperature": st.one_of(st.sampled_from([0.0, 5e-324, 1e-300, 1e-40, 1e-7, 1e6, 1e308]),
                             st.floats(0, 1e308), st.floats(0, 2)),
    "top_p": st.one_of(st.sampled_from([5e-324, 1e-300, 1e-46, 0.5, 1.0]),
                       st.floats(5e-324, 1.0)),
    "top_k": st.one_of(st.sampled_from([-1, 0, 1, 2047, 2048, 2**63, 10**30]),
                       st.integers(-1, 10**30)),
    "sampling_seed": st.integers(-(2**63), 2**64 - 1),
    "stop": st.lists(texts.filter(bool), max_size=2),
    "stop_token_ids": st.lists(st.integers(0, 2047), max_size=2),
    "ignore_eos": st.booleans(),
    "tpot_slo": st.floats(1e-300, 1e300),
    "no_stop_trim": st.booleans(),
}
sampling_params = st.one_of(st.fixed_dictionaries({}, optional=VALID),
                            st.fixed_dictionaries({}, optional=VALID),
                            st.fixed_dictionaries({}, optional=SAMPLING))
good_prompts = st.one_of(texts.filter(bool), st.lists(st.integers(0, 2047), min_size=1,
                                                      max_size=12))
prompts = st.one_of(good_prompts, good_prompts, good_prompts,
                    texts, st.lists(st.one_of(st.integers(0, 2047), ints), max_size=12))


# ----- the in-process API
def _engine_keys(keys: dict) -> dict:
    out = {k: keys[k] for k in ("temperature", "top_p", "top_k", "stop", "stop_token_ids",
                                "ignore_eos", "tpot_slo")}
    out["seed"] = keys["sampling_seed"] if keys is VALID else keys["seed"]
    out["max_new_tokens"] = st.integers(1, 3) if keys is VALID else st.one_of(
        st.integers(1, 3), st.sampled_from([0, -1, 10**30]))
    return out


engine_kwargs = st.one_of(st.fixed_dictionaries({}, optional=_engine_keys(VALID)),
                          st.fixed_dictionaries({}, optional=_engine_keys(VALID)),
                          st.fixed_dictionaries({}, optional=_engine_keys(SAMPLING)))


@pytest.fixture(scope="module")
def fuzz_engine(tiny_pair):
    eng = Engine(tiny_config(tiny_pair, kv_cache_tokens=256))
    yield eng
    assert not eng.has_work
    eng.check_idle_integrity()
    assert eng.scheduler.alloc.num_free == eng.scheduler.alloc.num_blocks


@FUZZ
@given(batch=st.lists(st.tuples(prompts, engine_kwargs), min_size=1, max_size=4))
def test_in_process_api(fuzz_engine, batch):
    eng = fuzz_engine
    try:
        for prompt, kw in batch:
            try:
                params = SamplingParams(**kw)
                eng.add_request(prompt, params)
            except InvalidRequest:
                continue
        steps = 0
        while eng.has_work:  # every request runs to its end in one batch: no step may raise
            eng.step()
            steps += 1
            assert steps < 200
    finally:  # a failing example leaves nothing behind for the next one
        for rid in list(eng.requests):
            eng.abort(rid)
        eng.take_aborted()
    eng.check_idle_integrity()
    assert eng.scheduler.alloc.num_free == eng.scheduler.alloc.num_blocks


# ----- the HTTP layer
@pytest.fixture(scope="module")
def fuzz_server(tiny_pair):
    srv = start_server(Engine(tiny_config(tiny_pair, kv_cache_tokens=256)))
    with srv.client() as c:
        yield srv, c
    info = srv.wait_idle()
    alive, failed = srv.state.aengine.alive, srv.state.aengine.failed_steps
    srv.stop()
    assert info["kv_pool"]["used_blocks"] == 0, "KV blocks leaked"
    assert alive and failed == 0
    srv.engine.check_idle_integrity()
    # the fuzzing reached the engine, not only the validation
    assert STATUS.get(200, 0) >= EXAMPLES // 4, STATUS


STATUS: dict[int, int] = {}


def _check(r: httpx.Response, stream: bool) -> None:
    STATUS[r.status_code] = STATUS.get(r.status_code, 0) + 1
    assert r.status_code == 200 or 400 <= r.status_code < 500, (r.status_code, r.text[:300])
    if r.status_code != 200:
        body = r.json()  # a JSON error naming the problem
        err = body.get("error", body)
        assert isinstance(err["message"], str) and err["message"], body
    elif stream:
        events = [ln for ln in r.text.splitlines() if ln.startswith("data:")]
        assert events[-1] == "data: [DONE]"
        assert not any(e.startswith('data: {"error"') for e in events), events[-3:]


def _post(c: httpx.Client, path: str, body) -> httpx.Response:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    return c.post(path, content=data, headers={"Content-Type": "application/json"})


@FUZZ
@given(prompt=prompts, sp=sampling_params, stream=st.booleans(),
       extra=st.dictionaries(st.sampled_from(["rid", "return_logprob", "top_logprobs_num",
                                              "logprob_start_len", "lora_path", "bogus"]),
                             json_values, max_size=2))
def test_http_generate(fuzz_server, prompt, sp, stream, extra):
    srv, c = fuzz_server
    key = "text" if isinstance(prompt, str) else "input_ids"
    body = {key: prompt, "sampling_params": sp, "stream": stream, **extra}
    _check(_post(c, "/generate", body), stream)
    assert srv.state.aengine.alive and srv.state.aengine.failed_steps == 0


def _openai(keys: dict) -> dict:
    out = {k: v for k, v in keys.items() if k not in (
        "max_new_tokens", "min_p", "sampling_seed", "regex", "no_stop_trim")}
    out["max_tokens"] = st.integers(1, 3) if keys is VALID else keys["max_new_tokens"]
    out["seed"] = keys["sampling_seed"] if keys is VALID else keys["seed"]
    return out


openai_params = st.one_of(st.fixed_dictionaries({}, optional=_openai(VALID)),
                          st.fixed_dictionaries({}, optional=_openai(VALID)),
                          st.fixed_dictionaries({}, optional=_openai(SAMPLING)))


@FUZZ
@given(prompt=prompts, params=openai_params, stream=st.booleans(), chat=st.booleans())
def test_http_openai(fuzz_server, prompt, params, stream, chat):
    srv, c = fuzz_server
    if chat:
        content = prompt if isinstance(prompt, str) else str(prompt)
        body = {"model": "m", "messages": [{"role": "user", "content": content}], **params}
        path = "/v1/chat/completions"
    else:
        body = {"model": "m", "prompt": prompt, **params}
        path = "/v1/completions"
    _check(_post(c, path, {**body, "stream": stream}), stream)
    assert srv.state.aengine.alive and srv.state.aengine.failed_steps == 0


@FUZZ
@given(raw=st.one_of(st.binary(max_size=64), texts.map(str.encode),
                     json_values.map(lambda v: json.dumps(v).encode()),
                     st.sampled_from([b'{"text": "\\ud800"}', b'{"text": 1e999}',
                                      b'{"text": "a", "sampling_params": {"top_k": 1e400}}',
                                      b'{"input_ids": [' + b"1," * 2000 + b"1]}",
                                      b"[" * 5000, b'{"text": NaN}'])),
       path=st.sampled_from(["/generate", "/v1/completions", "/v1/chat/completions",
                             "/abort_request"]))
def test_http_raw_bodies(fuzz_server, raw, path):
    srv, c = fuzz_server
    _check(_post(c, path, raw), False)
    assert srv.state.aengine.alive


def test_after_fuzzing_a_normal_request_succeeds(fuzz_server):
    srv, c = fuzz_server
    assert c.get("/health").status_code == 200
    r = c.post("/generate", json={"input_ids": [1, 2, 3], "sampling_params": {
        "max_new_tokens": 3, "temperature": 0, "ignore_eos": True}})
    assert r.status_code == 200 and len(r.json()["output_ids"]) == 3, r.text


# ----- issue 34: well-formed bodies, every honoured field at its extremes
GRAMMARS = st.sampled_from([
    {"regex": "[a-z]+"}, {"regex": "\\d{1,3}"}, {"json_schema": '{"type": "object"}'},
    {"json_schema": json.dumps({"$defs": {"x": {"$ref": "#/$defs/x"}}, "$ref": "#/$defs/x"})},
    {"json_schema": "[" * 10000 + "]" * 10000},
    {"json_schema": '{"type": "integer", "maximum": ' + "9" * 5000 + "}"},
    {"ebnf": 'root ::= "a" | "b"'}, {}])
TEMPERATURES = st.one_of(st.sampled_from([0.0, 5e-324, 1e-320, 1e-300, 1e-45, 1e-38, 1e-37,
                                          1e-7, 1e-6, 1e-5, 0.5, 1.0, 2.0, 1e6, 1e308]),
                         st.floats(0, 1e308))
PENALTIES = st.one_of(st.sampled_from([-2.0, -1e-300, 0.0, 5e-324, 1e-300, 2.0]),
                      st.floats(-2, 2))
REPETITION = st.one_of(st.sampled_from([5e-324, 1e-320, 1e-300, 1e-38, 1e-30, 1e-6, 0.5, 1.0,
                                        2.0]), st.floats(5e-324, 2))
WELL_FORMED = {
    "max_new_tokens": st.integers(0, 3),
    "min_new_tokens": st.integers(0, 3),
    "n": st.one_of(st.integers(1, 3), st.sampled_from([64, 65, 10**6, 2**63])),
    "temperature": TEMPERATURES,
    "top_p": VALID["top_p"],
    "top_k": VALID["top_k"],
    "frequency_penalty": PENALTIES,
    "presence_penalty": PENALTIES,
    "repetition_penalty": REPETITION,
    "sampling_seed": VALID["sampling_seed"],
    "stop": VALID["stop"],
    "stop_token_ids": VALID["stop_token_ids"],
    "ignore_eos": st.booleans(),
    "no_stop_trim": st.booleans(),
    "tpot_slo": st.sampled_from([1e-300, 0.03, 1e300]),
    "ttft_slo": st.sampled_from([1e-300, 1.0, 1e300]),
}
TOP_LOGPROBS = st.sampled_from([0, 1, 5, 100, 101, 10**6, 2**63])
# a request runs ~0.5 s on a busy 2-core CI machine: half the examples of the others
WELL_FORMED_FUZZ = settings(FUZZ, max_examples=max(1, EXAMPLES // 2))


def _well_formed_check(srv, r: httpx.Response, stream: bool) -> None:
    _check(r, stream)
    if r.status_code != 200:
        body = r.json()
        assert "internal" not in body.get("error", body)["message"], body
    assert srv.state.aengine.alive and srv.state.aengine.failed_steps == 0
    assert srv.engine.stats.requests_failed == 0


@WELL_FORMED_FUZZ
@given(prompt=good_prompts, sp=st.fixed_dictionaries({}, optional=WELL_FORMED),
       grammar=GRAMMARS, stream=st.booleans(), logprob=st.booleans(), top=TOP_LOGPROBS,
       start=st.sampled_from([-1, 0, 2]), batch=st.integers(1, 3))
def test_http_well_formed_generate(fuzz_server, prompt, sp, grammar, stream, logprob, top,
                                   start, batch):
    srv, c = fuzz_server
    key = "text" if isinstance(prompt, str) else "input_ids"
    body = {key: prompt if batch == 1 else [prompt] * batch,
            "sampling_params": {**sp, **grammar}, "stream": stream}
    if logprob:
        body.update(return_logprob=True, top_logprobs_num=top, logprob_start_len=start)
    _well_formed_check(srv, _post(c, "/generate", body), stream)


OPENAI_WELL_FORMED = {
    "max_tokens": st.integers(1, 3),
    "min_tokens": st.integers(0, 3),
    "n": WELL_FORMED["n"],
    "temperature": TEMPERATURES,
    "top_p": VALID["top_p"],
    "top_k": VALID["top_k"],
    "frequency_penalty": PENALTIES,
    "presence_penalty": PENALTIES,
    "repetition_penalty": REPETITION,
    "seed": VALID["sampling_seed"],
    "stop": VALID["stop"],
    "ignore_eos": st.booleans(),
}


@WELL_FORMED_FUZZ
@given(prompt=good_prompts, params=st.fixed_dictionaries({}, optional=OPENAI_WELL_FORMED),
       grammar=GRAMMARS, stream=st.booleans(), chat=st.booleans(), logprob=st.booleans(),
       top=st.sampled_from([0, 1, 5, 20]))
def test_http_well_formed_openai(fuzz_server, prompt, params, grammar, stream, chat, logprob,
                                 top):
    srv, c = fuzz_server
    body = {"model": "m", **params, **grammar, "stream": stream}
    if chat:
        content = prompt if isinstance(prompt, str) else str(prompt)
        body["messages"] = [{"role": "user", "content": content}]
        if logprob:
            body.update(logprobs=True, top_logprobs=top)
        path = "/v1/chat/completions"
    else:
        body["prompt"] = prompt
        if logprob:
            body["logprobs"] = top
        path = "/v1/completions"
    _well_formed_check(srv, _post(c, path, body), stream)
