"""#19 acceptance 2 (sampling): speculative sampling with a grammar, penalties and
min_new_tokens keeps the target's processed distribution, through the whole engine.

On the 16-token pair, every output a regex over four tokens allows in three tokens (EOS barred
from the first two by min_new_tokens, strong penalties, top-k) has an exact probability under
plain sampling, from the target's processed rows; the engine with fixed:3 speculation (draft
model) must match it in a chi-square test, and the same test must fail when the verify rows are
penalised without the drafts before them (the engine's processing made deliberately stale).
"""

from __future__ import annotations

from collections import Counter

import torch
from sloserve_testing import chi2_pvalue

import sloserve.runtime.step as step_mod
from sloserve.runtime.constraints import Processed, RequestConstraints
from sloserve.runtime.constraints.processing import finish, process
from sloserve.runtime.request import SamplingParams

PROMPT = [3, 7, 1, 12, 5]
PARAMS = dict(max_new_tokens=3, temperature=0.9, top_k=4, regex="(w1|w2|w3|w4)+",
              min_new_tokens=2, frequency_penalty=1.0, presence_penalty=0.6,
              repetition_penalty=1.8)
# #33: min_p and logit_bias are part of the processed distribution too
PARAMS_MIN_P = {**PARAMS, "min_p": 0.3, "logit_bias": {2: 1.5, 4: -0.7}}
N = 1200  # p-values here: correct 0.2-0.3, stale verify rows ~1e-165 (at 800)


def _exact(engine, target, kw=PARAMS) -> dict[tuple[int, ...], float]:
    """P(output) under plain sampling with kw: the product of each token's processed p."""
    params = SamplingParams(**kw)
    dist: dict[tuple[int, ...], float] = {}

    def expand(prefix: tuple[int, ...], prob: float) -> None:
        rc = engine.constraints.build(params, PROMPT)
        rc.commit(list(prefix))
        with torch.inference_mode():
            logits = target(torch.tensor([PROMPT + list(prefix)])).logits[0, -1:].float()
        p = rc.target(logits, []).probs[0].double()
        for t in p.nonzero().flatten().tolist():
            seq = prefix + (t,)
            if t in engine.runner.eos or len(seq) == PARAMS["max_new_tokens"]:
                dist[seq] = dist.get(seq, 0.0) + prob * float(p[t])
            else:
                expand(seq, prob * float(p[t]))

    expand((), 1.0)
    return dist


def _samples(engine, kw=PARAMS) -> Counter:
    out: Counter = Counter()
    for lo in range(0, N, 200):
        sps = [SamplingParams(**kw, seed=50_000 + i) for i in range(lo, min(N, lo + 200))]
        out.update(tuple(r["output_ids"]) for r in engine.generate([PROMPT] * len(sps), sps))
    return out


def _stale_targets(items) -> list[Processed]:
    """Wrong on purpose: each verify row penalised with the committed output only."""
    out = []
    for rc, logits, drafts in items:
        bm, n_valid = (rc.grammar.verify_bitmask(drafts) if rc.grammar is not None
                       else (None, len(drafts)))
        rows = [process(logits[j : j + 1], rc.params, rc.penalties, rc.counts, [], 0,
                        None if bm is None else bm[j : j + 1], rc.stop_ids)
                for j in range(logits.shape[0])]
        out.append(finish(torch.cat(rows), rc.params, n_valid))
    return out


def _engine(make_engine, paths):
    return make_engine(model_path=paths[0], draft_model_path=paths[1], spec_policy="fixed:3",
                       kv_cache_tokens=8192, block_size=4)


def test_speculative_sampling_with_options_keeps_the_processed_distribution(
        make_engine, small_vocab_pair):
    paths, target = small_vocab_pair
    eng = _engine(make_engine, paths)
    exact = _exact(eng, target)
    assert abs(sum(exact.values()) - 1.0) < 1e-6 and len(exact) > 20
    got = _samples(eng)
    s = eng.stats
    assert s.verified > 0 and 0 < s.accepted < s.verified, "must see accepts and rejects"
    assert set(got) <= set(exact), "an output outside the grammar / min_new_tokens support"
    assert chi2_pvalue(got, exact) > 1e-3


def test_the_same_check_fails_with_stale_verify_penalties(make_engine, small_vocab_pair,
                                                          monkeypatch):
    paths, target = small_vocab_pair
    monkeypatch.setattr(step_mod, "process_targets", _stale_targets)
    eng = _engine(make_engine, paths)
    assert chi2_pvalue(_samples(eng), _exact(eng, target)) < 1e-3


def test_constraints_build_for_the_small_pair(make_engine, small_vocab_pair):
    """The fixture's premise: the grammar allows exactly w1..w4 first (EOS barred)."""
    paths, _ = small_vocab_pair
    eng = _engine(make_engine, paths)
    rc = eng.constraints.build(SamplingParams(**PARAMS), PROMPT)
    assert isinstance(rc, RequestConstraints)
    p = rc.target(torch.zeros(1, 16), []).probs[0]
    assert p.nonzero().flatten().tolist() == [1, 2, 3, 4]


def test_speculative_sampling_keeps_min_p_and_logit_bias(make_engine, small_vocab_pair):
    paths, target = small_vocab_pair
    eng = _engine(make_engine, paths)
    exact = _exact(eng, target, PARAMS_MIN_P)
    assert abs(sum(exact.values()) - 1.0) < 1e-6
    assert len(exact) < len(_exact(eng, target)), "min_p must drop outputs"
    got = _samples(eng, PARAMS_MIN_P)
    s = eng.stats
    assert s.verified > 0 and 0 < s.accepted < s.verified, "must see accepts and rejects"
    assert set(got) <= set(exact), "an output min_p forbids"
    assert chi2_pvalue(got, exact) > 1e-3


def test_the_min_p_check_fails_when_verification_ignores_min_p(make_engine, small_vocab_pair,
                                                               monkeypatch):
    """Wrong on purpose: the verify rows' distributions without min_p."""
    import dataclasses

    real = step_mod.process_targets

    def no_min_p(items):
        out = real(items)
        for (rc, _, _), pr in zip(items, out):
            if pr.probs is not None:
                pr.probs = finish(pr.logits, dataclasses.replace(rc.params, min_p=0.0), 0).probs
        return out

    monkeypatch.setattr(step_mod, "process_targets", no_min_p)
    paths, target = small_vocab_pair
    eng = _engine(make_engine, paths)
    exact = _exact(eng, target, PARAMS_MIN_P)
    got = _samples(eng, PARAMS_MIN_P)
    assert not set(got) <= set(exact) or chi2_pvalue(got, exact) < 1e-3
