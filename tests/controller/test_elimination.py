"""Confidence-prior verifier (SpecServe Alg. 2): draft token elimination."""

from __future__ import annotations

import dataclasses
import itertools

import numpy as np
import pytest

from sloserve.bench.synthetic import cpu_cost_model, make_step
from sloserve.estimator.acceptance import chain_probs, expected_tokens
from sloserve.estimator.step_time import StepTimer
from sloserve.verifier.elimination import eliminate, eliminate_plan

COST = cpu_cost_model()
# the same costs with roofline knees (cost_model.py): a few verify / draft tokens are free
KNEE = dataclasses.replace(COST, target=dataclasses.replace(COST.target, q0=6.0),
                           draft=dataclasses.replace(COST.draft, q0=3.0))


def efficiency(timer: StepTimer, P, drafted, k, slo=np.inf) -> float:
    t = timer.plan(drafted, k)
    return -1.0 if t > slo else float(expected_tokens(P, k).sum()) / t


def brute_force_best(timer: StepTimer, P, drafted, slo=np.inf) -> float:
    best = -1.0
    for k in itertools.product(*[range(d + 1) for d in drafted]):
        best = max(best, efficiency(timer, P, drafted, np.array(k), slo))
    return best


def test_removes_the_lowest_probability_tails():
    P = np.array([[0.95, 0.9, 0.85, 0.1], [0.9, 0.5, 0.05, 0.01], [0.99, 0.98, 0.97, 0.96]])
    drafted = np.array([4, 4, 4])
    k = eliminate_plan(StepTimer(COST, make_step(3)), P, drafted, np.inf)
    np.testing.assert_array_equal(k, [3, 2, 4])


@pytest.mark.parametrize("cost", [COST, KNEE], ids=["linear", "knee"])
@pytest.mark.parametrize("seed", range(30))
def test_matches_brute_force_optimum(seed, cost):
    rng = np.random.default_rng(seed)
    B = int(rng.integers(1, 4))
    drafted = rng.integers(0, 5, B)
    P = chain_probs(rng.beta(2.0, 1.0, (B, 4)))
    P[np.arange(4)[None, :] >= drafted[:, None]] = 0.0
    timer = StepTimer(cost, make_step(B, context=int(rng.integers(10, 5000))))
    k = eliminate_plan(timer, P, drafted, np.inf)
    assert np.all((0 <= k) & (k <= drafted))
    assert efficiency(timer, P, drafted, k) == pytest.approx(brute_force_best(timer, P, drafted))


def test_stops_where_one_more_removal_would_lower_e():
    rng = np.random.default_rng(7)
    B, s = 32, 6
    P = chain_probs(rng.beta(3.0, 1.0, (B, s)))
    drafted = np.full(B, s)
    timer = StepTimer(COST, make_step(B))
    k = eliminate_plan(timer, P, drafted, np.inf)
    assert 0 < (drafted - k).sum() < B * s  # it removed some, not all
    e = efficiency(timer, P, drafted, k)
    # the next candidate (lowest P among the kept tails) would lower E ...
    tails = np.where(k > 0, P[np.arange(B), np.maximum(k - 1, 0)], np.inf)
    r = int(np.argmin(tails))
    fewer = k.copy()
    fewer[r] -= 1
    assert efficiency(timer, P, drafted, fewer) < e
    # ... and putting back the best removed token would lower E too
    heads = np.where(k < drafted, P[np.arange(B), np.minimum(k, s - 1)], -np.inf)
    r = int(np.argmax(heads))
    more = k.copy()
    more[r] += 1
    assert efficiency(timer, P, drafted, more) < e


def test_slo_forces_removals_even_when_they_lower_e():
    P = np.full((8, 4), 0.99)  # every token is worth verifying without an SLO
    drafted = np.full(8, 4)
    timer = StepTimer(COST, make_step(8))
    np.testing.assert_array_equal(eliminate_plan(timer, P, drafted, np.inf), drafted)
    t_full = timer.plan(drafted, drafted)
    slo = t_full - 5.5 * COST.target.b  # six tokens must go
    k = eliminate_plan(timer, P, drafted, slo)
    assert (drafted - k).sum() == 6
    assert timer.plan(drafted, k) <= slo


def test_forced_removals_with_equal_probabilities():
    P = np.array([[1.0, 1.0, 1.0, 0.0]])  # p = 1 gives equal chain probabilities
    k = eliminate(P, np.array([3]), tokens=4.0, step_time=1.0, token_time=0.1, slo=0.85)
    assert k[0] == 1  # T = 1.0 - 2 * 0.1 fits


def test_nothing_drafted_is_a_no_op():
    k = eliminate(
        np.zeros((3, 0)),
        np.zeros(3, dtype=int),
        tokens=3,
        step_time=1.0,
        token_time=0.1,
        slo=np.inf,
    )
    np.testing.assert_array_equal(k, [0, 0, 0])


def test_verify_path_cost_drops_every_draft_when_plain_decoding_rates_higher():
    """With `fixed` (CostModel.verify_fixed) removing the last verified token saves it too:
    one middling draft is kept without it and dropped with it, a likely chain is kept."""
    from sloserve.verifier.elimination import eliminate

    token_time, plain = 0.002, 0.06
    P = np.array([[0.3], [np.inf]])
    drafted = np.array([1, 0])
    tokens = 2.0 + 0.3
    common = dict(tokens=tokens, token_time=token_time, slo=float("inf"))
    kept = eliminate(P, drafted, step_time=plain + token_time, **common)
    assert kept.tolist() == [1, 0]  # 0.3 tokens for 2 ms: worth it
    dropped = eliminate(P, drafted, step_time=plain + token_time + 0.02, fixed=0.02, **common)
    assert dropped.tolist() == [0, 0]  # 0.3 tokens for 22 ms at E = 2 / 60 ms: not
    P = np.array([[0.9, 0.8, 0.7], [0.5, np.inf, np.inf]])
    drafted = np.array([3, 1])
    tokens = 2.0 + 0.9 + 0.8 + 0.7 + 0.5
    keep = eliminate(P, drafted, tokens=tokens, token_time=token_time, slo=float("inf"),
                     step_time=plain + 4 * token_time + 0.02, fixed=0.02)
    assert keep.tolist() == [3, 1]
