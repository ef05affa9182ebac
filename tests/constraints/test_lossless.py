"""Speculative sampling over the processed (penalised + grammar-masked + min_new_tokens)
distributions keeps the target's processed distribution: the output distribution of the toy
speculative loop (sloserve.verifier.acceptance.speculative_accept, k = 3) is compared with the
exact distribution of plain sampling, enumerated over every complete output the grammar allows.
Two deliberately wrong variants must fail the same test: verify rows penalised without the
drafts before them, and drafts sampled from a distribution other than the q the rule is given."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from sloserve_testing import chi2_pvalue

from sloserve.runtime.penalties import PenaltyParams
from sloserve.runtime.request import SamplingParams

from . import toy

PATTERN = "[ab]{1,4}"  # with penalties strong enough that the wrong variants visibly differ
PENALTIES = PenaltyParams(frequency_penalty=1.0, presence_penalty=0.6, repetition_penalty=1.8,
                          min_new_tokens=2)
SAMPLING = SamplingParams(temperature=0.9, top_k=4)
TRIALS = 300  # p-values here: correct 0.76, wrong 3e-77 and 1e-14
K = 3


def exact_distribution(comp) -> dict[tuple[int, ...], float]:
    """P(output) under plain sampling: the product of the processed p of each token, over every
    output the grammar allows (it ends at EOS within 5 tokens)."""
    dist: dict[tuple[int, ...], float] = {}

    def expand(prefix: tuple[int, ...], prob: float) -> None:
        rc = toy.make(PATTERN, SAMPLING, PENALTIES, comp)
        rc.commit(list(prefix))
        p = rc.target(toy.target_logits(toy.PROMPT + prefix)[None], []).probs[0].double()
        for t in p.nonzero().flatten().tolist():
            seq = prefix + (t,)
            if t == toy.EOS:
                dist[seq] = dist.get(seq, 0.0) + prob * float(p[t])
            else:
                expand(seq, prob * float(p[t]))

    expand((), 1.0)
    return dist


@pytest.fixture(scope="module")
def setting():
    comp = toy.compiler()
    dist = exact_distribution(comp)
    assert abs(sum(dist.values()) - 1.0) < 1e-6 and len(dist) > 10
    return comp, dist


def _sample(comp, seed: int, **variant) -> Counter:
    gen = torch.Generator().manual_seed(seed)
    out = Counter()
    for _ in range(TRIALS):
        rc = toy.make(PATTERN, SAMPLING, PENALTIES, comp)
        if variant.get("stale"):
            variant["target_fn"] = toy.stale_target(rc)
        kw = {k: v for k, v in variant.items() if k != "stale"}
        out[tuple(toy.spec_decode(rc, gen, K, **kw))] += 1
    return out


def test_speculative_sampling_keeps_the_processed_distribution(setting):
    comp, dist = setting
    samples = _sample(comp, seed=1)
    assert set(samples) <= set(dist), "an output outside the grammar / min_new_tokens support"
    assert chi2_pvalue(samples, dist) > 1e-3


def test_fails_when_verify_rows_ignore_the_drafts(setting):
    comp, dist = setting
    assert chi2_pvalue(_sample(comp, seed=2, stale=True), dist) < 1e-6


def test_fails_when_the_draft_is_not_sampled_from_the_rules_q(setting):
    comp, dist = setting
    assert chi2_pvalue(_sample(comp, seed=3, drafter=toy.draft_unpenalised), dist) < 1e-6
