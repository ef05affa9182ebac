"""SpecServe's small-batch plan (policies/specserve/small_plan.py, Python floats) decides
exactly what its numpy plan decides: the same requests draft every position, the same
tokens are verified, with the same plan time, over random steps (contexts, catch-up lags,
SLOs, prefill chunks, knee and linear cost models) and random confidences, fed back through
observe so the histories and scales evolve alike."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from sloserve.bench.synthetic import cpu_cost_model
from sloserve.estimator.cost_model import CostModel, ForwardCost
from sloserve.estimator.step_time import StepTimer
from sloserve.policies.specserve import SpecServePolicy
from sloserve.policies.specserve.plan import SpecServePlan
from sloserve.policies.specserve.small_plan import SmallSpecServePlan
from sloserve.speculation import StepInfo, VerifyOutcome

KNEE = CostModel(ForwardCost(2.0e-6, 4.4e-4, 12.6e-3, 6.5), ForwardCost(1.5e-7, 2.9e-5, 2.1e-3, 5.0),
                 1.2e-3)


def _random_step(rng, B: int, t: int, slo_on: bool) -> StepInfo:
    slo = np.full(B, np.inf)
    if slo_on:
        slo[rng.integers(0, B)] = rng.uniform(0.02, 0.2)
    lag = rng.integers(0, 3, B) if rng.random() < 0.5 else None
    prefill = int(rng.integers(1, 300)) if rng.random() < 0.3 else 0
    return StepInfo(
        request_ids=[f"r{(t // 7) * 3 + i}" for i in range(B)],  # requests come and go
        context_lens=rng.integers(16, 2048, B),
        tpot_slo=slo,
        k_max=8,
        prefill_tokens=prefill,
        prefill_context=prefill + int(rng.integers(0, 500)) if prefill else 0,
        draft_lag=lag,
    )


def _run(policy: SpecServePolicy, step: StepInfo, conf: np.ndarray, rng_seed: int):
    """One engine step: plan / extend until nobody drafts / verify_lengths / observe."""
    B = step.batch_size
    plan = policy.plan(step)
    rounds = [plan.drafting.copy()]
    drafting = rounds[0]
    drafted = np.zeros(B, dtype=np.int64)
    j = 0
    while drafting.any() and j < step.k_max:
        drafted += drafting
        j += 1
        c = np.where(drafted >= np.arange(1, j + 1)[:, None], conf[:, :j].T, np.nan).T
        drafting = drafting & plan.extend(c, drafting)
        rounds.append(drafting.copy())
    s = int(drafted.max()) if B else 0
    c = np.where(np.arange(1, s + 1)[None, :] <= drafted[:, None], conf[:, :s], np.nan)
    k = plan.verify_lengths(c, drafted) if s else drafted.copy()
    totals = (plan.tokens, plan.time)
    rng = np.random.default_rng(rng_seed)
    accepted = np.minimum(k, rng.integers(0, 4, B))
    timer = StepTimer(plan.cost, step)
    predicted = timer.plan(drafted, k)
    policy.observe(plan, VerifyOutcome(
        drafted=drafted, verified=np.asarray(k), accepted=accepted, confidences=c,
        step_time=predicted * rng.uniform(0.8, 1.6), draft_time=0.0,
        verify_time=predicted * 0.7 if rng.random() < 0.7 else None))
    return [r.tolist() for r in rounds], np.asarray(k).tolist(), totals, type(plan)


# SGLang's CPU shape: the verify forward's path costs ~25% of a decode forward over it
VERIFY_PATH = dataclasses.replace(cpu_cost_model(), verify_fixed=7e-3)
# and its draft's per-step setup (ForwardCost.first), paid by the step's first draft token
SETUP = dataclasses.replace(KNEE, verify_fixed=4e-3,
                            draft=dataclasses.replace(KNEE.draft, first=1.5e-3))


def _compare(numpy_path, small_path, step, conf, t):
    """Run one step through both paths, assert they decide alike, and return what the step
    exercised: its number of draft rounds and whether a round drafted for a subset."""
    a = _run(numpy_path, step, conf, t)
    b = _run(small_path, dataclasses.replace(step), conf, t)
    assert a[3] is SpecServePlan and b[3] is SmallSpecServePlan
    assert a[0] == b[0], f"step {t}: draft rounds differ"
    assert a[1] == b[1], f"step {t}: verify lengths differ"
    assert a[2] == pytest.approx(b[2], rel=1e-9), f"step {t}: plan tokens/time differ"
    B = len(conf)
    return {len(a[0]) - 1, "subset" if any(0 < sum(r) < B for r in a[0]) else "uniform"}


@pytest.mark.parametrize("cost", [KNEE, cpu_cost_model(), VERIFY_PATH, SETUP],
                         ids=["knee", "linear", "verify-path", "setup"])
@pytest.mark.parametrize("options", [{}, {"uniform_margin": 0.0},
                                     {"score_prefill": True, "start_margin": 0.05},
                                     {"lookahead": True}])
def test_small_batch_path_decides_as_the_numpy_path(cost, options):
    rng = np.random.default_rng(7)
    numpy_path = SpecServePolicy(cost, 8, small_batch=0, **options)
    small_path = SpecServePolicy(cost, 8, small_batch=64, **options)
    slo_on = rng.random() < 0.5
    exercised = set()
    for t in range(150):
        B = int(rng.integers(1, 9))
        step = _random_step(rng, B, t, slo_on or t % 3 == 0)
        conf = rng.beta(2.0, 1.2, (B, 8))
        exercised |= _compare(numpy_path, small_path, step, conf, t)
    np.testing.assert_allclose(numpy_path.history.values[:32],
                               small_path.history.values[:32], rtol=1e-9)
    assert numpy_path.prior == pytest.approx(small_path.prior, rel=1e-9)
    assert {0, 1, 2} <= exercised  # plain steps, one draft round and more were all compared


def _compare_slo_steps(seed: int, slo_low: float, **options) -> set:
    """150 random steps of specserve-slo with per-request SLOs in [slo_low, 0.12) s through
    the numpy and the small-batch plans (asserting they decide alike); what they exercised."""
    from sloserve.policies.specserve.slo_policy import SloSpecServePolicy

    rng = np.random.default_rng(seed)
    numpy_path = SloSpecServePolicy(KNEE, 8, small_batch=0, **options)
    small_path = SloSpecServePolicy(KNEE, 8, small_batch=64, **options)
    exercised = set()
    for t in range(150):
        B = int(rng.integers(1, 9))
        step = dataclasses.replace(_random_step(rng, B, t, False),
                                   tpot_slo=rng.uniform(slo_low, 0.12, B))
        conf = rng.beta(2.0, 1.2, (B, 8))
        exercised |= _compare(numpy_path, small_path, step, conf, t)
    return exercised


def test_small_batch_path_decides_as_the_numpy_path_with_per_request_limits():
    """specserve-slo's plans hold a first round's prefix of drafters to their allowances and
    the others to their one-token limits (StepInfo.one_token_limits): both paths alike."""
    assert {0, 1, 2, "subset"} <= _compare_slo_steps(11, 0.015)


def test_small_batch_path_decides_as_the_numpy_path_with_slo_weights():
    """specserve-slo with slo_weight: requests behind their SLOs count their draft tokens
    more when a round is chosen (StepInfo.token_weights): both paths alike."""
    assert {0, 1, 2, "subset"} <= _compare_slo_steps(13, 0.01, slo_weight=2.0)


def test_small_batch_path_decides_as_the_numpy_path_with_credited_catch_ups():
    """Long catch-ups (a prompt the draft never read) priced less their credit under TPOT
    limits, which hold the step's time with the whole catch-up (StepTimer.excused): both
    paths alike, through steps where the limit cut the drafters to a subset."""
    from sloserve.policies.specserve.slo_policy import SloSpecServePolicy

    rng = np.random.default_rng(5)
    numpy_path = SloSpecServePolicy(KNEE, 8, small_batch=0, prior=0.8)
    small_path = SloSpecServePolicy(KNEE, 8, small_batch=64, prior=0.8)
    exercised, excused = set(), 0
    for t in range(200):
        B = int(rng.integers(2, 9))
        step = dataclasses.replace(
            _random_step(rng, B, t // 40 * 40, False),  # requests that live 40 steps
            draft_lag=rng.integers(100, 400, B), tpot_slo=rng.uniform(0.03, 0.3, B))
        conf = rng.beta(4.0, 1.2, (B, 8))
        # a request with credit and a catch-up: the step's plans have excused seconds
        excused += bool(numpy_path.history.credit.any())
        exercised |= _compare(numpy_path, small_path, step, conf, t)
    assert excused and {0, 1, "subset"} <= exercised
