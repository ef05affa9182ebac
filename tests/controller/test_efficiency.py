"""Efficiency E and the SLO rule (docs/design.md sec. 4; issue #4 acceptance item 1)."""

from __future__ import annotations

import numpy as np
import pytest

from sloserve.bench.synthetic import cpu_cost_model, make_step
from sloserve.estimator.acceptance import chain_probs
from sloserve.estimator.cost_model import CostModel, ForwardCost
from sloserve.estimator.efficiency import (
    SLO_VIOLATION,
    binding_slo,
    plan_efficiency,
    score,
    uniform_efficiency,
)
from sloserve.estimator.step_time import StepTimer
from sloserve.policies.goodput import GoodputPolicy
from sloserve.policies.specserve import SpecServePolicy

COST = cpu_cost_model()
BATCHES = [1, 2, 4, 8, 16, 32, 64, 128]
CONTEXTS = [64, 256, 1024, 4096, 16384]


def is_unimodal(e: np.ndarray) -> bool:
    peak = int(np.argmax(e))
    return bool(np.all(np.diff(e[: peak + 1]) >= 0) and np.all(np.diff(e[peak:]) <= 0))


def test_is_unimodal_can_fail():
    assert not is_unimodal(np.array([1.0, 2.0, 1.5, 1.8, 1.0]))


@pytest.mark.parametrize("acceptance", [0.2, 0.5, 0.7, 0.9, 0.99])
def test_uniform_efficiency_has_one_peak(acceptance):
    for B in BATCHES:
        for ctx in CONTEXTS:
            timer = StepTimer(COST, make_step(B, context=ctx))
            assert is_unimodal(uniform_efficiency(timer, acceptance, 16)), (B, ctx)


def test_heterogeneous_chains_have_one_peak():
    """Per-request chains (non-increasing P_r): E over a uniform k still has one peak."""
    rng = np.random.default_rng(0)
    for _ in range(50):
        B = int(rng.integers(1, 64))
        P = chain_probs(rng.beta(4, 1.5, (B, 12)))  # [B, 12]
        timer = StepTimer(COST, make_step(B, context=int(rng.integers(16, 8000))))
        tokens = B + np.concatenate([[0.0], np.cumsum(P.sum(axis=0))])  # [13]
        e = tokens / timer.uniform(12)
        assert is_unimodal(e)


def goodput_k(B: int, ctx: int, a: float, cost: CostModel = COST) -> int:
    policy = GoodputPolicy(cost, 8, prior=a)
    return policy.best_k(make_step(B, context=ctx))


def specserve_drafts(
    B: int, ctx: int, conf: float, slo: float | np.ndarray = np.inf, cost: CostModel = COST
) -> np.ndarray:
    """[B] tokens SpecServe drafts per request when every draft token has confidence `conf`
    (identity calibration: acceptance = conf). The paper's rule exactly: no start margin and
    no overrun guard (both tested in test_policies.py)."""
    policy = SpecServePolicy(cost, 8, prior=conf, start_margin=0.0, initial_overrun=1.0)
    step = make_step(B, context=ctx, slo=slo)
    plan = policy.plan(step)
    drafting = plan.drafting
    conf_m = np.full((B, 8), np.nan)
    drafted = np.zeros(B, dtype=int)
    j = 0
    while drafting.any() and j < 8:
        conf_m[drafting, j] = conf
        drafted += drafting
        j += 1
        drafting = plan.extend(conf_m[:, :j], drafting)
    return drafted


def specserve_k(B: int, ctx: int, conf: float, cost: CostModel = COST) -> int:
    return int(specserve_drafts(B, ctx, conf, cost=cost).max())


def assert_non_increasing_and_moves(ks: list[int]) -> None:
    assert all(a >= b for a, b in zip(ks, ks[1:])), ks
    assert ks[0] > ks[-1], ks


@pytest.mark.parametrize("choose", [goodput_k, specserve_k])
def test_chosen_k_falls_with_batch_size(choose):
    assert_non_increasing_and_moves([choose(B, 512, 0.8) for B in BATCHES])


# A pair whose draft reads as much KV per context token as the target (a deep or
# MHA draft for a GQA target): context then mostly adds per-draft-step cost.
KV_HEAVY_DRAFT = CostModel(
    target=COST.target, draft=ForwardCost(a=2e-6, b=1e-4, c=4e-3), overhead=COST.overhead
)


@pytest.mark.parametrize("choose", [goodput_k, specserve_k])
def test_chosen_k_falls_with_context(choose):
    assert_non_increasing_and_moves([choose(16, ctx, 0.8, KV_HEAVY_DRAFT) for ctx in CONTEXTS])


@pytest.mark.parametrize("choose", [goodput_k, specserve_k])
def test_context_direction_follows_the_kv_cost_ratio(choose):
    """With the verify cost of docs/design.md sec. 2 (context sum_r n_r, independent of k) the target's KV reads
    are a per-step cost that speculation amortises; with a light draft (a_d = a_t / 10),
    long contexts therefore favour *more* speculation. The direction flips when the draft's
    KV reads dominate (test above)."""
    ks = [choose(16, ctx, 0.8, COST) for ctx in CONTEXTS]
    assert all(a <= b for a, b in zip(ks, ks[1:])) and ks[-1] > ks[0], ks


@pytest.mark.parametrize("choose", [goodput_k, specserve_k])
def test_chosen_k_rises_with_acceptance(choose):
    ks = [choose(4, 512, a) for a in (0.95, 0.9, 0.8, 0.6, 0.4, 0.2)]
    assert_non_increasing_and_moves(ks)


def test_score_rule():
    assert score(10.0, 0.1, slo=0.05) == SLO_VIOLATION
    assert score(10.0, 0.1, slo=0.05, plain=True) == pytest.approx(100.0)
    assert score(10.0, 0.1, slo=0.2) == pytest.approx(100.0)


def test_binding_slo_is_the_tightest():
    step = make_step(3, slo=np.array([np.inf, 0.05, 0.08]))
    assert binding_slo(step) == 0.05
    assert binding_slo(make_step(2)) == np.inf


def test_plan_efficiency_applies_the_slo_rule():
    step = make_step(4, slo=0.001)  # tighter than anything
    P = np.full((4, 2), 0.9)
    zero, two = np.zeros(4, dtype=int), np.full(4, 2)
    assert plan_efficiency(COST, step, P, two, two) == SLO_VIOLATION
    assert plan_efficiency(COST, step, P, zero, zero) > 0  # plain is never rejected


def smallest_speculative_step(B: int, ctx: int) -> float:
    """T_step of the cheapest plan with any drafting: one request drafts one token."""
    timer = StepTimer(COST, make_step(B, context=ctx))
    return timer.plain + COST.draft.c + float(timer.draft_token_cost(0).min())


def test_tight_slo_turns_speculation_off():
    B, ctx = 4, 512
    t = StepTimer(COST, make_step(B, context=ctx)).uniform(2)  # [plain, k=1, k=2]
    t_min = smallest_speculative_step(B, ctx)
    assert specserve_drafts(B, ctx, 0.95).min() >= 2  # unconstrained it speculates
    assert not specserve_drafts(B, ctx, 0.95, slo=t_min * 0.999).any()  # any k > 0 breaks it
    assert not specserve_drafts(B, ctx, 0.95, slo=t[0] * 0.5).any()  # even plain breaks it
    drafted = specserve_drafts(B, ctx, 0.95, slo=t[1] * 1.001)  # room for one step each
    np.testing.assert_array_equal(drafted, np.ones(B))
    # between the two: only some requests draft a token, and the step fits the SLO
    slo = 0.5 * (t_min + t[1])
    drafted = specserve_drafts(B, ctx, 0.95, slo=slo)
    assert 0 < drafted.sum() < B and drafted.max() == 1
    assert StepTimer(COST, make_step(B, context=ctx)).plan(drafted, drafted) <= slo


def test_one_tight_request_binds_the_batch():
    B, ctx = 4, 512
    slo = np.array([np.inf, np.inf, smallest_speculative_step(B, ctx) * 0.99, np.inf])
    assert not specserve_drafts(B, ctx, 0.95, slo=slo).any()
