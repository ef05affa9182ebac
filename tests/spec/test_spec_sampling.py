"""Acceptance (speculative 2): speculative sampling keeps the target's distribution.

Two levels: the acceptance rule alone (many trials on fixed distributions), and the whole
engine on a 16-token model pair, comparing the distribution of a token produced by
verification with the exact target probabilities. Both use a chi-square test at the 1% level,
for temperature 0.7 and with top-p 0.9, and both show a deliberately wrong acceptance rule
is rejected by the same test (the test can fail).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from sloserve.runtime.request import SamplingParams
from sloserve.runtime.sampler import processed_probs
from sloserve.verifier import acceptance
from sloserve.verifier.acceptance import draw

ALPHA = 0.01
SETTINGS = [SamplingParams(temperature=0.7), SamplingParams(temperature=0.7, top_p=0.9)]


def _chi2_pvalue(samples: np.ndarray, probs: np.ndarray) -> float:
    counts = np.bincount(samples, minlength=len(probs)).astype(float)
    support = probs > 0
    if counts[~support].sum() > 0:
        return 0.0  # a token the target can never produce
    expected = probs[support].astype(np.float64)
    return float(chisquare(counts[support], expected / expected.sum() * counts.sum()).pvalue)


def _accept_always(draft, q, p, gen):  # wrong: emits drafts unchecked
    return [*draft, draw(p[len(draft)], gen)]


def _resample_from_p(draft, q, p, gen):  # wrong: on rejection samples p, not max(0, p - q)
    for j, x in enumerate(draft):
        if float(torch.rand((), generator=gen)) * float(q[j, x]) < float(p[j, x]):
            continue
        return [*draft[:j], draw(p[j], gen)]
    return [*draft, draw(p[len(draft)], gen)]


def _first_tokens(rule, p, q, n, seed):
    gen = torch.Generator().manual_seed(seed)
    out = np.empty(n, dtype=np.int64)
    for i in range(n):
        drafts = [draw(q[j], gen) for j in range(q.shape[0])]
        out[i] = rule(drafts, q, p, gen)[0]
    return out


@pytest.mark.parametrize("params", SETTINGS, ids=["t0.7", "t0.7-top_p0.9"])
def test_acceptance_rule_keeps_target_distribution(params):
    g = torch.Generator().manual_seed(0)
    V, k = 8, 2
    p = processed_probs(torch.randn(k + 1, V, generator=g) * 1.5, [params] * (k + 1))
    q = processed_probs(torch.randn(k, V, generator=g) * 1.5, [params] * k)
    n = 6000
    good = _first_tokens(acceptance.speculative_accept, p, q, n, seed=1)
    assert _chi2_pvalue(good, p[0].numpy()) > ALPHA
    for wrong in (_accept_always, _resample_from_p):
        bad = _first_tokens(wrong, p, q, n, seed=1)
        assert _chi2_pvalue(bad, p[0].numpy()) < ALPHA, wrong.__name__


# ---------------------------------------------------------------- whole engine, small vocab
# (the 16-token pair: small_vocab_pair in conftest.py)
V_SMALL = 16


def _exact_second_token(target, prompt, params) -> np.ndarray:
    """P(t2) = sum_t1 P(t1 | prompt) P(t2 | prompt, t1) under the processed distribution."""
    with torch.inference_mode():
        p1 = processed_probs(target(torch.tensor([prompt])).logits[0, -1:], [params])[0]
        seqs = torch.tensor([[*prompt, t] for t in range(V_SMALL)])
        p2 = processed_probs(target(seqs).logits[:, -1], [params] * V_SMALL)
    return (p1[:, None] * p2).sum(0).numpy()


def _engine_second_tokens(make_engine, paths, prompt, params, n, must_reject=True):
    eng = make_engine(model_path=paths[0], draft_model_path=paths[1], spec_policy="fixed:3",
                      kv_cache_tokens=8192, block_size=4)
    out = np.empty(n, dtype=np.int64)
    for lo in range(0, n, 128):
        sps = [SamplingParams(max_new_tokens=3, temperature=params.temperature, top_p=params.top_p,
                              seed=10_000 + i, ignore_eos=True) for i in range(lo, min(n, lo + 128))]
        res = eng.generate([prompt] * len(sps), sps)
        out[lo : lo + len(sps)] = [r["output_ids"][1] for r in res]
    assert eng.stats.verified > 0 and 0 < eng.stats.accepted
    if must_reject:  # the correct rule must see rejections, or the test proves little
        assert eng.stats.accepted < eng.stats.verified
    return out


@pytest.mark.parametrize("params", SETTINGS, ids=["t0.7", "t0.7-top_p0.9"])
def test_engine_speculative_sampling_distribution(make_engine, small_vocab_pair, params, monkeypatch):
    paths, target = small_vocab_pair
    prompt = [3, 7, 1, 12, 5]
    exact = _exact_second_token(target, prompt, params)
    n = 3000
    assert _chi2_pvalue(_engine_second_tokens(make_engine, paths, prompt, params, n), exact) > ALPHA
    import sloserve.runtime.step as step_mod

    monkeypatch.setattr(step_mod, "speculative_accept", _accept_always)
    wrong = _engine_second_tokens(make_engine, paths, prompt, params, n, must_reject=False)
    assert _chi2_pvalue(wrong, exact) < ALPHA
