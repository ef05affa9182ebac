"""#19 acceptance 2 (greedy): with each sampling option - a regex, a JSON schema, an EBNF
grammar, penalties, logit_bias, min_new_tokens, logprobs, stop trimming - greedy output with speculation
(fixed k and specserve; draft model and n-gram) equals plain greedy output token for token; the
draft model never proposes a token the grammar forbids, and the controller sees the processed
confidences."""

from __future__ import annotations

import json
import re

import pytest
import torch
from sloserve_testing import prompts_of_lengths

from sloserve.runtime.config import EngineConfig
from sloserve.runtime.constraints import RequestConstraints
from sloserve.runtime.engine import Engine
from sloserve.runtime.request import SamplingParams, Status
from sloserve.runtime.scheduler import SchedulerConfig

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 12},
    "n": {"type": "integer", "minimum": 0, "maximum": 999},
    "ok": {"type": "boolean"}}, "required": ["name", "n", "ok"]}
EBNF = 'root ::= "(" expr ")"\nexpr ::= term (("+" | "*") term)*\nterm ::= [0-9]+ | "(" expr ")"'
PENALTIES = dict(frequency_penalty=0.7, presence_penalty=0.4, repetition_penalty=1.3)
OPTIONS = {
    "regex": dict(regex=r"[0-9]{2,4}-[a-z]+( [a-z]+)*"),
    "json_schema": dict(json_schema=json.dumps(SCHEMA)),
    "ebnf": dict(ebnf=EBNF),
    "penalties": PENALTIES,
    "logprobs": dict(logprobs=3),
    "no_stop_trim": dict(no_stop_trim=True, stop=("e",)),
    "everything": dict(regex=r"[a-z ]+", min_new_tokens=10, logprobs=2, **PENALTIES),
    # logit_bias is part of the processed rows both models' tokens are compared on (#33)
    "logit_bias": dict(logit_bias={"300": 4.0, 301: 4.0, 77: -100.0}, min_p=0.2, logprobs=2),
}
N_NEW = 24


def _engine(tiny_pair, policy: str, drafter: str = "model") -> Engine:
    return Engine(EngineConfig(
        model_path=tiny_pair[0], draft_model_path=tiny_pair[1], spec_policy=policy,
        drafter=drafter, kv_cache_tokens=16384, block_size=8, tpot_slo=0.05, dtype="float32",
        scheduler=SchedulerConfig(max_running_requests=64, max_step_tokens=512)))


def _run(eng: Engine, prompts, params: SamplingParams, per_step: int = 3) -> list[dict]:
    """Staggered arrivals; each request's ids, text and logprobs."""
    reqs, pending = [], list(prompts)
    while pending or eng.has_work:
        reqs += [eng.add_request(p, params) for p in pending[:per_step]]
        pending = pending[per_step:]
        eng.step()
    assert all(r.status is Status.FINISHED for r in reqs)
    return [{"ids": r.output_ids, "text": r.output_text, "lp": r.logprobs} for r in reqs]


def _params(name: str, **kw) -> SamplingParams:
    return SamplingParams(max_new_tokens=N_NEW, temperature=0.0, **{**OPTIONS[name], **kw})


@pytest.fixture(scope="module")
def prompts():
    return prompts_of_lengths([4 + (i * 5) % 23 for i in range(10)], seed=21)


@pytest.fixture(scope="module")
def reference(tiny_pair, prompts):
    """Plain greedy output per option."""
    eng = _engine(tiny_pair, "ar")
    out = {name: _run(eng, prompts, _params(name)) for name in OPTIONS}
    eng.check_idle_integrity()
    return out


def _same(got: list[dict], want: list[dict]) -> None:
    assert [g["ids"] for g in got] == [w["ids"] for w in want]
    assert [g["text"] for g in got] == [w["text"] for w in want]
    for g, w in zip(got, want):
        if w["lp"] is not None:  # plain decoding's values, up to the forward's rounding
            torch.testing.assert_close(torch.tensor(g["lp"].logprobs),
                                       torch.tensor(w["lp"].logprobs), atol=1e-4, rtol=0)
            assert [[t for t, _ in row] for row in g["lp"].top] == \
                [[t for t, _ in row] for row in w["lp"].top]


@pytest.mark.parametrize("policy,drafter", [("fixed:3", "model"), ("specserve", "model"),
                                            ("fixed:4", "ngram")])
def test_speculative_greedy_equals_plain_for_every_option(tiny_pair, prompts, reference,
                                                          policy, drafter, monkeypatch):
    pushes: list[bool] = []
    push = RequestConstraints.push_draft

    def recorded(self, token):
        ok = push(self, token)
        pushes.append(ok)
        return ok

    monkeypatch.setattr(RequestConstraints, "push_draft", recorded)
    eng = _engine(tiny_pair, policy, drafter)
    work = prompts if drafter == "model" else [(p[:4] * 5)[: 8 + i] for i, p in enumerate(prompts)]
    ref = reference if drafter == "model" else None
    plain = _engine(tiny_pair, "ar") if drafter == "ngram" else None
    for name in OPTIONS:
        got = _run(eng, work, _params(name))
        _same(got, ref[name] if ref is not None else _run(plain, work, _params(name)))
    s = eng.stats
    assert s.verified > 0 and 0 < s.accepted < s.verified, "must see accepts and rejects"
    assert pushes, "constrained requests drafted"
    if drafter == "model":  # drafted from the masked row: the grammar takes every proposal
        assert all(pushes)
    for e in (eng, plain):
        if e is not None:
            e.check_idle_integrity()


def test_options_shape_the_output(reference):
    """The options did something (so the equality above is about them)."""
    assert all(re.fullmatch(OPTIONS["regex"]["regex"], o["text"]) or len(o["ids"]) == N_NEW
               for o in reference["regex"])
    for o in reference["json_schema"]:
        if o["ids"][-1] != N_NEW:  # finished: a complete, valid document
            assert len(o["ids"]) == N_NEW or json.loads(o["text"]).keys() == SCHEMA["properties"].keys()
    assert all(re.fullmatch(r"[()+*0-9]+", o["text"]) for o in reference["ebnf"])
    assert [o["ids"] for o in reference["penalties"]] != [o["ids"] for o in reference["logprobs"]]
    stopped = [o for o in reference["no_stop_trim"] if len(o["ids"]) < N_NEW]
    assert stopped and all("e" in o["text"] for o in stopped)  # the stop string is kept
    assert all(len(o["ids"]) >= 10 for o in reference["everything"])
    biased = [t for o in reference["logit_bias"] for t in o["ids"]]
    assert biased.count(300) + biased.count(301) > \
        sum(o["ids"].count(300) + o["ids"].count(301) for o in reference["logprobs"])


def test_controller_sees_processed_confidences(tiny_pair, prompts, monkeypatch):
    """Under "[01]+" only the tokens spelling 0/1 runs (and EOS) are allowed: the processed
    argmax of m allowed tokens has probability >= 1/m, which the raw draft distribution over the
    whole vocabulary does not reach."""
    eng = _engine(tiny_pair, "fixed:3")
    seen = []
    observe = eng.runner.policy.observe
    monkeypatch.setattr(eng.runner.policy, "observe",
                        lambda plan, out: (seen.append(out.confidences.copy()), observe(plan, out)))
    tok = eng.tokenizer
    allowed = [t for t in range(len(tok)) if re.fullmatch("[01]+", tok.decode([t]))]
    m = len(allowed) + len(eng.runner.eos)
    _run(eng, prompts[:4], SamplingParams(max_new_tokens=16, temperature=0.0, regex="[01]+"))
    conf = torch.tensor([c for o in seen for c in o.flatten().tolist() if c == c])
    assert len(conf) > 10 and float(conf.min()) >= 1.0 / m - 1e-6
    raw = []
    monkeypatch.setattr(eng.runner.policy, "observe",
                        lambda plan, out: raw.append(out.confidences.copy()))
    _run(eng, prompts[:4], SamplingParams(max_new_tokens=16, temperature=0.0))
    raw_c = torch.tensor([c for o in raw for c in o.flatten().tolist() if c == c])
    assert float(raw_c.min()) < 1.0 / m  # the test would catch raw confidences
