"""The processing order (penalties -> grammar mask -> min_new_tokens -> temperature / top-k /
top-p), draft rows processed exactly like verify rows, and greedy speculation equal to plain
greedy decoding token for token under grammars and penalties."""

from __future__ import annotations

import pytest
import torch

from sloserve.runtime.constraints.bitmask import from_bool
from sloserve.runtime.constraints.processing import process
from sloserve.runtime.penalties import PenaltyParams, TokenCounts
from sloserve.runtime.request import SamplingParams
from sloserve.runtime.sampler import processed_probs

from . import toy
from .test_penalties import naive

NEG = float("-inf")


def test_order_penalties_mask_min_tokens():
    V, R = 20, 4
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(R, V, generator=g) * 3
    allowed = torch.rand(R, V, generator=g) < 0.6
    allowed[2] = False
    allowed[2, 7] = True  # row 2: the grammar allows only the stop token 7
    pen = PenaltyParams(frequency_penalty=0.8, presence_penalty=0.3, repetition_penalty=1.5,
                        min_new_tokens=4)
    prompt, output, drafts = [1, 2, 3], [4, 4, 7], [5, 4, 9]
    counts = TokenCounts(V, prompt)
    counts.add(output)
    stop = torch.tensor([7, 11])
    got = process(logits, SamplingParams(temperature=0.7), pen, counts, drafts, 0,
                  from_bool(allowed), stop)
    want = naive(logits, pen, prompt, output, drafts, 0)
    want[~allowed] = NEG
    # output of 3 tokens: only row 0 (3 < 4) forbids the stops; row 2 is not row 0
    want[0, stop] = NEG
    torch.testing.assert_close(got, want)  # the naive loop computes in double
    # with min_new_tokens 6 rows 0..2 are blocked, but row 2 keeps its only token
    pen6 = PenaltyParams(frequency_penalty=0.8, presence_penalty=0.3, repetition_penalty=1.5,
                         min_new_tokens=6)
    got6 = process(logits, SamplingParams(), pen6, counts, drafts, 0, from_bool(allowed), stop)
    want[1, stop] = NEG
    torch.testing.assert_close(got6[[0, 1, 3]], want[[0, 1, 3]])
    assert torch.isclose(got6[2, 7], want[2, 7]) and torch.isfinite(got6[2]).sum() == 1
    # then temperature, top-k, top-p on the processed logits
    p = processed_probs(got, [SamplingParams(temperature=0.7, top_k=3, top_p=0.9)] * R)
    assert (p[~allowed] == 0).all() and torch.allclose(p.sum(-1), torch.ones(R))


def test_min_new_tokens_yields_to_a_complete_grammar():
    """Grammar complete after 'ab' (only EOS allowed) while min_new_tokens is not reached: EOS
    stays allowed, so the request can end; with a grammar that can go on, EOS is masked."""
    comp = toy.compiler()
    pen = PenaltyParams(min_new_tokens=10)
    for pattern, eos_ok in (("ab", True), ("(ab)+", False)):
        rc = toy.make(pattern, SamplingParams(temperature=0.0), pen, comp)
        rc.commit([2])  # "ab"
        pr = rc.target(torch.zeros(1, toy.V), [])
        assert bool(torch.isfinite(pr.logits[0, toy.EOS])) == eos_ok
        assert torch.isfinite(pr.logits[0]).any()


@pytest.mark.parametrize("pattern", ["[ab]{1,6}", "(a|ba|bb)+", None])
def test_draft_rows_are_verify_rows(pattern):
    """The draft row at position j (after pushing drafts[:j]) and the verify row j are processed
    identically: same penalties, same mask, bit for bit."""
    comp = toy.compiler()
    pen = PenaltyParams(frequency_penalty=0.9, presence_penalty=0.4, repetition_penalty=1.4,
                        min_new_tokens=3)
    sp = SamplingParams(temperature=0.8, top_k=5)
    rc = toy.make(pattern, sp, pen, comp)
    rc.commit([0])
    logits = torch.randn(5, toy.V, generator=torch.Generator().manual_seed(1))
    drafts, rows = [], []
    for j in range(4):
        pr = rc.draft(logits[j], drafts)
        rows.append(pr.logits[0])
        t = pr.argmax[0]
        assert rc.push_draft(t)
        drafts.append(t)
    ver = rc.target(logits, drafts)
    assert ver.n_valid == 4
    for j in range(4):
        assert torch.equal(rows[j], ver.logits[j])


def _greedy_case(pattern, pen, k, comp):
    sp = SamplingParams(temperature=0.0)
    plain = toy.plain_decode(toy.make(pattern, sp, pen, comp), None, max_new=10)
    spec = toy.spec_decode(toy.make(pattern, sp, pen, comp), None, k, max_new=10)
    return plain, spec


@pytest.mark.parametrize("pattern", ["[ab]{2,8}", "(a|ba|bb|x)+", "(ab|c)*q", None])
def test_greedy_speculation_equals_plain_greedy(pattern):
    comp = toy.compiler()
    pens = [PenaltyParams(), PenaltyParams(frequency_penalty=1.2, presence_penalty=0.5,
                                           repetition_penalty=1.7, min_new_tokens=3),
            PenaltyParams(repetition_penalty=0.6, min_new_tokens=6)]
    for pen in pens:
        for k in (1, 2, 4):
            plain, spec = _greedy_case(pattern, pen, k, comp)
            assert spec == plain, (pattern, pen, k)


def test_greedy_check_can_fail():
    """The same comparison with position-independent verify rows (drafts not counted by the
    penalties) disagrees with plain greedy: the test above has teeth."""
    comp = toy.compiler()
    pen = PenaltyParams(frequency_penalty=1.5, presence_penalty=1.0, repetition_penalty=1.8)
    sp = SamplingParams(temperature=0.0)
    differ = 0
    for pattern in ("[ab]{2,8}", "(a|ba|bb|x)+", None):
        plain = toy.plain_decode(toy.make(pattern, sp, pen, comp), None, max_new=10)
        rc = toy.make(pattern, sp, pen, comp)
        wrong = toy.spec_decode(rc, None, 4, max_new=10, target_fn=toy.stale_target(rc))
        differ += wrong != plain
    assert differ > 0


def test_confidence_is_the_processed_probability():
    comp = toy.compiler()
    pen = PenaltyParams(frequency_penalty=0.5)
    logits = torch.randn(toy.V, generator=torch.Generator().manual_seed(3))
    for sp in (SamplingParams(temperature=0.0), SamplingParams(temperature=0.5, top_k=2)):
        rc = toy.make("[ab]+", sp, pen, comp)
        rc.commit([0])
        pr = rc.draft(logits, [])
        t = pr.argmax[0]
        want = (torch.softmax(pr.logits[0], -1)[t] if sp.greedy
                else processed_probs(pr.logits, [sp])[0, t])
        assert pr.confidence(0, t) == pytest.approx(float(want))
        assert pr.confidence(0, 5) == 0.0  # "c": outside the grammar
