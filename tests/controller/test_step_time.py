"""Step-time model: the closed forms agree with a forward-by-forward sum (docs/design.md sec. 2)."""

from __future__ import annotations

import numpy as np
import pytest

from sloserve.bench.synthetic import cpu_cost_model, make_step
from sloserve.estimator.cost_model import CostModel, ForwardCost
from sloserve.estimator.step_time import StepTimer, step_time
from sloserve.speculation import StepInfo

COST = CostModel(ForwardCost(3e-6, 2e-3, 30e-3), ForwardCost(5e-7, 2e-4, 5e-3), overhead=2e-3)
# the same pair with roofline knees: the first 24 verify / 6 draft query tokens are free
KNEE = CostModel(ForwardCost(3e-6, 2e-3, 30e-3, q0=24), ForwardCost(5e-7, 2e-4, 5e-3, q0=6),
                 overhead=2e-3)
# the knee pair with a drafter's per-step setup (SGLang's CPU draft: ~3 ms on ~6 ms forwards)
SETUP = CostModel(KNEE.target, ForwardCost(5e-7, 2e-4, 5e-3, q0=6, first=3e-3), overhead=2e-3,
                  verify_fixed=4e-3)


def brute_force(cost: CostModel, step: StepInfo, drafted, verified) -> float:
    """Sum every forward explicitly, one draft step j at a time."""
    n = step.context_lens.astype(float)
    lag = step.draft_lag if step.draft_lag is not None else np.zeros(step.batch_size)
    t = 0.0
    for j in range(1, int(np.max(drafted, initial=0)) + 1):
        rows = np.flatnonzero(np.asarray(drafted) >= j)
        if j == 1:  # draft KV before the first forward: n - lag; it feeds lag + 1 tokens
            ctx, q = (n[rows] - lag[rows]).sum(), len(rows) + lag[rows].sum()
        else:
            ctx, q = (n[rows] + j - 1).sum(), len(rows)
        t += cost.draft.time(ctx, q) + (cost.draft.first if j == 1 else 0.0)
    if step.prefill_tokens:  # the draft model reads the prefill chunks too
        t += cost.draft.time(step.prefill_context, step.prefill_tokens)
    q_verify = float(np.sum(np.asarray(verified) + 1)) + step.prefill_tokens
    t += cost.target.time(n.sum() + step.prefill_context, q_verify)
    if np.sum(verified) > 0:
        t += cost.verify_fixed
    return t + cost.overhead


@pytest.mark.parametrize("cost", [COST, KNEE, SETUP], ids=["linear", "knee", "setup"])
@pytest.mark.parametrize("seed", range(5))
def test_plan_time_matches_forward_by_forward_sum(seed, cost):
    rng = np.random.default_rng(seed)
    B = int(rng.integers(1, 40))
    step = StepInfo(
        request_ids=[str(i) for i in range(B)],
        context_lens=rng.integers(10, 3000, B),
        tpot_slo=np.full(B, np.inf),
        k_max=8,
        prefill_tokens=int(rng.integers(0, 300)),
        prefill_context=int(rng.integers(0, 900)),
        draft_lag=rng.integers(0, 3, B),
    )
    drafted = rng.integers(0, 9, B)
    verified = np.minimum(drafted, rng.integers(0, 9, B))
    assert step_time(cost, step, drafted, verified) == pytest.approx(
        brute_force(cost, step, drafted, verified), rel=1e-12
    )


@pytest.mark.parametrize("cost", [COST, KNEE, SETUP], ids=["linear", "knee", "setup"])
@pytest.mark.parametrize("batch", [3, 12, 40])
def test_uniform_times_match_plans(cost, batch):
    step = make_step(batch, context=np.arange(100, 100 * (batch + 1), 100),
                     lag=np.array([0, 1] * batch)[:batch])
    timer = StepTimer(cost, step)
    uniform = timer.uniform(6)
    for k in range(7):
        ks = np.full(batch, k)
        assert uniform[k] == pytest.approx(brute_force(cost, step, ks, ks), rel=1e-12)


def test_knee_makes_few_query_tokens_free():
    """Below the knee the verify forward costs its fixed part only; past it, b per token."""
    step = make_step(4, context=np.full(4, 100))
    timer = StepTimer(KNEE, step)
    assert timer.verify_extra(20) == 0.0  # 4 + 20 query tokens <= q0 = 24
    assert timer.verify_extra(30) == pytest.approx(10 * KNEE.target.b)


def test_plain_step_has_no_draft_forward_and_counts_prefill():
    """Plain decoding: one target forward over decodes + prefill chunks, plus the draft model
    reading the prefill chunks (the engine keeps the draft cache caught up)."""
    step = StepInfo(["a", "b"], np.array([100, 300]), np.full(2, np.inf), 4, 50, 70)
    zero = np.zeros(2, dtype=int)
    expected = COST.target.time(400 + 70, 2 + 50) + COST.draft.time(70, 50) + COST.overhead
    assert StepTimer(COST, step).plain == pytest.approx(expected)
    assert step_time(COST, step, zero, zero) == pytest.approx(expected)


def test_marginal_token_costs_add_up():
    """draft_token_cost(j) + the fixed draft cost is what one more draft step adds."""
    step = make_step(5, context=np.array([10, 200, 30, 4000, 50]), lag=np.array([0, 1, 2, 0, 1]))
    timer = StepTimer(COST, step)
    drafted = np.zeros(5, dtype=int)
    for j in range(4):
        before = timer.plan(drafted, drafted)
        grown = drafted + 1
        delta = timer.plan(grown, grown) - before
        assert delta == pytest.approx(COST.draft.c + timer.draft_token_cost(j).sum(), rel=1e-12)
        drafted = grown
    np.testing.assert_allclose(
        timer.draft_token_costs(4), [timer.draft_token_cost(j) for j in range(4)], rtol=1e-12
    )


def test_cpu_cost_model_shape():
    """The synthetic CPU pair behaves like docs/design.md sec. 1: verifying 8 tokens costs little
    more than 1 at batch 1 and much more at batch 32."""
    cost = cpu_cost_model()
    t1 = StepTimer(cost, make_step(1)).uniform(7)
    t32 = StepTimer(cost, make_step(32)).uniform(7)
    assert t1[7] / t1[0] < 2.5
    assert t32[7] / t32[0] > 3.0


def test_verify_path_fixed_cost_is_paid_once_by_any_verified_token():
    """CostModel.verify_fixed: a step verifying no draft token runs the decode forward; one
    verifying any pays the verify path once, whoever verifies (sim, timer, uniform agree)."""
    import dataclasses

    from sloserve.bench.synthetic import cpu_cost_model, make_step
    from sloserve.estimator.step_time import StepTimer

    base = cpu_cost_model()
    cost = dataclasses.replace(base, verify_fixed=0.01)
    step = make_step(4, context=300, k_max=4)
    t0, t1 = StepTimer(base, step), StepTimer(cost, step)
    none = np.zeros(4, dtype=np.int64)
    one = np.array([0, 1, 0, 0])
    two = np.array([1, 1, 0, 0])
    assert t1.plan(none, none) == pytest.approx(t0.plan(none, none))
    assert t1.plan(one, one) == pytest.approx(t0.plan(one, one) + 0.01)
    assert t1.plan(two, two) == pytest.approx(t0.plan(two, two) + 0.01)
    u0, u1 = t0.uniform(4), t1.uniform(4)
    assert u1[0] == pytest.approx(u0[0])
    assert np.allclose(u1[1:] - u0[1:], 0.01)
    assert np.allclose(t1.verify_extra(np.array([0.0, 3.0])) - t0.verify_extra(np.array([0.0, 3.0])),
                       [0.0, 0.01])


def test_draft_setup_is_paid_once_by_a_step_that_drafts():
    """ForwardCost.first of the draft: a step that drafts pays it once, however many
    forwards and requests draft; a plain step does not; the timer's step_fixed carries it
    with the verify path (what a plan's first draft token pays)."""
    import dataclasses

    step = make_step(4, context=300, k_max=4)
    base = StepTimer(KNEE, step)
    setup = StepTimer(dataclasses.replace(KNEE, draft=dataclasses.replace(KNEE.draft, first=3e-3)),
                      step)
    for drafted in ([0, 0, 0, 0], [1, 0, 0, 0], [3, 3, 1, 0], [4, 4, 4, 4]):
        d = np.array(drafted)
        extra = 3e-3 if d.any() else 0.0
        assert setup.plan(d, d) == pytest.approx(base.plan(d, d) + extra, rel=1e-12)
    assert setup.uniform(4) - base.uniform(4) == pytest.approx([0.0] + [3e-3] * 4)
    assert setup.step_fixed == pytest.approx(base.step_fixed + 3e-3)


def test_verify_token_price_follows_the_batch_size():
    """CostModel.verify_token: a verified token's price by decode batch size (SGLang's CPU
    engine: 4.9 ms at batch 1, ~2 ms at 4-16), interpolated linearly between the profiled
    batches and flat past both ends, token_scale included; without a table target.b at every
    batch. The step timer prices a step's verified tokens at its own batch's price."""
    import dataclasses

    base = CostModel(ForwardCost(3e-6, 2e-3, 30e-3), ForwardCost(5e-7, 2e-4, 5e-3),
                     token_scale=1.5)
    assert base.token_time(1) == base.token_time(16) == pytest.approx(3e-3)
    table = dataclasses.replace(base, verify_token=((1.0, 5e-3), (4.0, 2e-3), (16.0, 1.8e-3)))
    assert table.token_time(1) == pytest.approx(7.5e-3)
    assert table.token_time(2) == pytest.approx(1.5 * 4e-3)  # a third of the way to 4
    assert table.token_time(10) == pytest.approx(1.5 * 1.9e-3)
    assert table.token_time(64) == pytest.approx(1.5 * 1.8e-3)
    assert table.without_draft().token_time(2) == table.token_time(2)
    target, scaled = table.scaled_target(2.0)
    assert target.b == pytest.approx(4e-3)
    assert np.allclose(scaled, ((1.0, 1e-2), (4.0, 4e-3), (16.0, 3.6e-3)))
    for B, price in ((1, 7.5e-3), (4, 3e-3), (16, 2.7e-3)):
        timer = StepTimer(table, make_step(B, context=300, k_max=4))
        assert timer.token_time == pytest.approx(price)
        none, two = np.zeros(B, dtype=np.int64), np.full(B, 2)
        assert timer.plan(two, two) - timer.plan(two, none) == pytest.approx(2 * B * price)
        assert timer.uniform(2)[2] == pytest.approx(timer.plan(two, two))
