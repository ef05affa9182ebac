"""Penalties and min_new_tokens against a naive per-position, per-token loop."""

from __future__ import annotations

import random

import pytest
import torch

from sloserve.runtime.penalties import (
    PenaltyParams,
    TokenCounts,
    apply_penalties,
    min_tokens_rows,
)
from sloserve.runtime.request import InvalidRequest

V = 24  # small, so drafts and output repeat tokens often


def naive(logits, params: PenaltyParams, prompt, output, drafts, first):
    """Row r: count every token of output + drafts[:first + r] by hand, scalar arithmetic."""
    out = logits.clone()
    for r in range(logits.shape[0]):
        seq = list(output) + list(drafts[: first + r])
        for t in range(logits.shape[1]):
            n = seq.count(t)
            x = float(logits[r, t]) - params.frequency_penalty * n - params.presence_penalty * (n > 0)
            if params.repetition_penalty != 1.0 and (t in prompt or n > 0):
                x = x / params.repetition_penalty if x > 0 else x * params.repetition_penalty
            out[r, t] = x
    return out


CASES = [
    PenaltyParams(frequency_penalty=0.7),
    PenaltyParams(presence_penalty=-0.6),
    PenaltyParams(repetition_penalty=1.6),
    PenaltyParams(repetition_penalty=0.7),
    PenaltyParams(frequency_penalty=1.1, presence_penalty=0.4, repetition_penalty=1.3),
]


@pytest.mark.parametrize("params", CASES)
@pytest.mark.parametrize("seed", range(6))
def test_verify_rows_match_the_naive_loop(params, seed):
    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    prompt = [rng.randrange(V) for _ in range(rng.randint(1, 8))]
    output = [rng.randrange(V) for _ in range(rng.randint(0, 12))]
    k = rng.randint(0, 6)
    drafts = [rng.randrange(V) for _ in range(k)]
    if k >= 2:
        drafts[-1] = drafts[0]  # a draft repeated inside the chain
    logits = torch.randn(k + 1, V, generator=g) * 3
    stats = TokenCounts(V, prompt)
    stats.add(output)
    got = apply_penalties(logits, params, stats, drafts, first=0)
    torch.testing.assert_close(got, naive(logits, params, prompt, output, drafts, 0))
    for j in range(k + 1):
        # a draft-model row at draft position j is the verify row j, bit for bit
        row = apply_penalties(logits[j : j + 1], params, stats, drafts[:j], first=j)
        assert torch.equal(row[0], got[j])
        # and so is plain decoding's row once drafts[:j] are committed output
        plain = TokenCounts(V, prompt)
        plain.add(output + drafts[:j])
        assert torch.equal(apply_penalties(logits[j : j + 1], params, plain, [])[0], got[j])


def test_counts_accumulate_across_commits():
    rng = random.Random(1)
    stats = TokenCounts(V, [3, 4])
    seq: list[int] = []
    params = CASES[-1]
    for _ in range(5):
        step = [rng.randrange(V) for _ in range(rng.randint(1, 4))]
        stats.add(step)
        seq += step
        logits = torch.randn(2, V)
        got = apply_penalties(logits, params, stats, [7], first=0)
        torch.testing.assert_close(got, naive(logits, params, [3, 4], seq, [7], 0))
    assert stats.num_output == len(seq)


def test_no_penalty_leaves_logits_alone():
    logits = torch.randn(3, V)
    assert apply_penalties(logits, PenaltyParams(min_new_tokens=5), TokenCounts(V), [1, 2]) is logits
    with pytest.raises(ValueError):
        apply_penalties(logits, CASES[0], TokenCounts(V), [1], first=0)  # 3 rows need 2 drafts


@pytest.mark.parametrize("m, n_out, rows, first, want", [
    (0, 0, 5, 0, 0),
    (3, 0, 5, 0, 3),  # rows 0, 1, 2: output of 0, 1, 2 tokens before them
    (3, 2, 5, 0, 1),
    (3, 3, 5, 0, 0),
    (10, 0, 5, 0, 5),
    (3, 0, 1, 2, 1),  # draft position 2 of an empty output: 2 < 3, blocked
    (3, 1, 1, 2, 0),
])
def test_min_new_tokens_rows(m, n_out, rows, first, want):
    assert min_tokens_rows(PenaltyParams(min_new_tokens=m), n_out, rows, first) == want


@pytest.mark.parametrize("kw, field", [
    (dict(frequency_penalty=2.5), "frequency_penalty"),
    (dict(presence_penalty=-2.1), "presence_penalty"),
    (dict(repetition_penalty=0.0), "repetition_penalty"),
    (dict(repetition_penalty=float("nan")), "repetition_penalty"),
    (dict(min_new_tokens=-1), "min_new_tokens"),
    (dict(min_new_tokens=9), "min_new_tokens"),
])
def test_validation_names_the_field(kw, field):
    with pytest.raises(InvalidRequest) as e:
        PenaltyParams(**kw).validate(max_new_tokens=8)
    assert e.value.field == field
    PenaltyParams(frequency_penalty=2.0, presence_penalty=-2.0, repetition_penalty=2.0,
                  min_new_tokens=8).validate(max_new_tokens=8)
