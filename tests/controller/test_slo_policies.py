"""The SLO-customized policies: specserve-slo's per-request budgets and AdaServe's selection."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from sloserve.bench.synthetic import SyntheticWorkload, cpu_cost_model, drive_step, make_step
from sloserve.estimator.step_time import StepTimer
from sloserve.policies.adaserve import (
    STEP_TIME_MARGIN,
    AdaServePolicy,
    default_token_budget,
    select_tokens,
    step_depth,
)
from sloserve.policies.registry import make_policy
from sloserve.policies.request_clock import RequestClock, StepStalls
from sloserve.policies.specserve import SpecServePolicy
from sloserve.policies.specserve.budgets import expected_allowance, step_budgets, token_weights
from sloserve.policies.specserve.overrun import OverrunGuard
from sloserve.policies.specserve.slo_policy import SloSpecServePolicy
from sloserve.speculation import VerifyOutcome

COST = cpu_cost_model()
INF = np.inf


def plain_outcome(B: int, step_time: float, accepted=None) -> VerifyOutcome:
    z = np.zeros(B, dtype=np.int64)
    acc = z if accepted is None else np.asarray(accepted, dtype=np.int64)
    return VerifyOutcome(z, acc, acc, np.zeros((B, 0)), step_time, 0.0)


# ----- the request clock
def test_clock_slack_and_release():
    clock = RequestClock()
    clock.track(["a", "b"])
    clock.record(["a", "b"], 0.05, np.array([3, 1]))  # a: 3 tokens in 50 ms, b: 1
    slack = clock.slack(["a", "b", "c"], np.array([0.03, 0.03, INF]))
    np.testing.assert_allclose(slack, [0.09 - 0.05, 0.03 - 0.05, INF])
    clock.release("a")
    clock.record(["a"], 1.0, np.array([1]))  # feedback after release: not brought back
    assert len(clock) == 1
    np.testing.assert_allclose(clock.progress(["a"])[0], [0.0])


def test_clock_counts_the_time_between_a_requests_steps():
    """With end times told, a request's seconds are the wall time since its previous step's
    end (another request's prefill between two decode steps included); its first step, or a
    step without an end time, counts the step alone."""
    clock = RequestClock()
    clock.track(["a"])
    clock.record(["a"], 0.05, np.array([1]), end_time=10.05)  # first step: its own 50 ms
    clock.track(["b"])
    # 30 ms of b's prefill, then a 50 ms step of both
    clock.record(["a", "b"], 0.05, np.array([1, 1]), end_time=10.13)
    elapsed, tokens = clock.progress(["a", "b"])
    np.testing.assert_allclose(elapsed, [0.05 + 0.08, 0.05])
    np.testing.assert_allclose(tokens, [2, 1])
    clock.record(["a", "b"], 0.05, np.array([1, 1]))  # no end time: the step's own
    np.testing.assert_allclose(clock.progress(["a", "b"])[0], [0.18, 0.10])


def test_stalls_learn_the_time_between_steps_of_continuing_requests():
    stalls = StepStalls(ema=0.5)
    stalls.record(["a"], 0.05, None)  # no end time: nothing learnt
    assert stalls.mean == 0.0
    stalls.record(["a"], 0.05, 1.0)
    stalls.record(["a", "b"], 0.05, 1.09)  # 40 ms between the two steps
    assert stalls.mean == pytest.approx(0.5 * 0.04)
    stalls.record(["c"], 0.05, 5.0)  # nobody continued (the engine idled): not a stall
    assert stalls.mean == pytest.approx(0.02)
    stalls.record(["c"], 0.05, 5.05)  # back to back
    assert stalls.mean == pytest.approx(0.01)


# ----- budgets
def test_budgets_spend_a_share_of_slack_and_all_of_a_deficit():
    b = step_budgets(np.array([0.05, 0.05, INF]), np.array([0.2, -0.01, INF]), plain_time=0.02,
                     share=0.5)
    np.testing.assert_allclose(b, [0.05 + 0.1, 0.04, INF])


def test_a_request_no_plan_can_keep_is_held_to_plain_decodings_pace():
    b = step_budgets(np.array([0.01, 0.05]), np.array([0.0, 0.0]), plain_time=0.02)
    assert b[0] == pytest.approx(0.02) and b[1] == pytest.approx(0.05)
    # behind by more than plain leaves: the same
    b = step_budgets(np.array([0.05]), np.array([-0.04]), plain_time=0.02)
    assert b[0] == pytest.approx(0.02)


def test_allowance_scales_a_budget_by_one_plus_predicted_acceptance():
    a = expected_allowance(np.array([0.05, INF, 0.05]), np.array([0.6, 0.9, 1.3]))
    np.testing.assert_allclose(a, [0.08, INF, 0.10])  # acceptance clipped to [0, 1]


def test_a_stall_shares_the_budget_with_the_step():
    """A step and the stall after it make one token's TPOT: the allowance leaves the stall
    out, and the budget's floor is the plain step with its stall."""
    b = step_budgets(np.array([0.05, 0.03]), np.array([0.0, 0.0]), plain_time=0.02,
                     stall=0.015)
    np.testing.assert_allclose(b, [0.05, 0.035])  # 0.03 < 0.02 + 0.015
    a = expected_allowance(b, np.array([0.6, 0.6]), stall=0.015)
    np.testing.assert_allclose(a, [0.05 * 1.6 - 0.015, 0.035 * 1.6 - 0.015])


@pytest.mark.parametrize("name", ["specserve", "specserve-slo"])
def test_stalls_between_steps_hold_speculation_back(name):
    """The same batch, SLO and plain steps, with and without a stall after each step (SGLang's
    prefills between decode steps: a request's TPOT counts them) that puts the requests
    behind their SLO: the SLO rules then allow shorter steps and plan no more drafts
    (specserve, held to the SLO less the stall, fewer). specserve-slo without slo_weight:
    with it, requests behind their SLOs count their draft tokens more and may draft more
    (test_slo_weight_drafts_for_a_request_that_needs_the_tokens)."""
    ids = [f"r{i}" for i in range(4)]
    step = make_step(4, slo=0.2, ids=ids)
    plain = StepTimer(COST, step).plain

    def after(stall: float) -> tuple[float, int]:
        policy = (SpecServePolicy(COST, 8, prior=0.8) if name == "specserve"
                  else SloSpecServePolicy(COST, 8, prior=0.8, slo_weight=0.0))
        end = 0.0
        for _ in range(100):  # plain steps, each followed by `stall` seconds
            plan = policy.plan(step)
            end += plain + stall
            policy.observe(plan, dataclasses.replace(plain_outcome(4, plain), end_time=end))
        limit = float(np.min(policy.plan(step).step.step_limits))
        out = drive_step(policy, step, SyntheticWorkload(np.random.default_rng(5)),
                         np.full(4, 0.8))
        return limit, int(out.drafted.sum())

    free, stalled = after(0.0), after(0.2 - plain + 0.01)
    assert free[1] > 0
    assert stalled[0] < free[0]
    assert stalled[1] < free[1] if name == "specserve" else stalled[1] <= free[1]


def test_slo_policy_allows_longer_steps_than_specserve_once_requests_saved_slack():
    """One SLO. New requests (nothing saved) hold specserve-slo's step to the SLO as
    specserve's worst case does; after a step that ran well within it, each request may spend
    its slack on a step of up to (SLO + share * slack) * (1 + prior), capped by the slack:
    specserve-slo then drafts at least as deep, here deeper."""
    ids = [f"n{i}" for i in range(12)]
    step = make_step(12, slo=0.2, ids=ids)
    timer = StepTimer(COST, step)
    # the SLO binds specserve (its guard halves it until steps are measured) below k = 2
    assert timer.uniform(8)[1] < 0.2 / 2 < timer.uniform(8)[2] < 0.2 * 1.8 / 2
    slo = SloSpecServePolicy(COST, 8, prior=0.8)
    np.testing.assert_allclose(slo.budgets(step), 0.2)  # new: the one-token worst case
    slo.observe(slo.plan(step), plain_outcome(12, 0.05))  # 150 ms saved each
    pred = slo.history.values[slo.history.slots(ids, 0.0)]
    budget = 0.2 + slo.slack_share * 0.15
    np.testing.assert_allclose(slo.budgets(step), budget + np.minimum(budget * pred, 0.15))
    mean = np.full(12, 0.8)
    out_base = drive_step(SpecServePolicy(COST, 8, prior=0.8), step,
                          SyntheticWorkload(np.random.default_rng(3)), mean)
    out_slo = drive_step(slo, step, SyntheticWorkload(np.random.default_rng(3)), mean)
    assert out_base.drafted.any()  # the comparison says something: both speculate
    assert out_slo.drafted.sum() > out_base.drafted.sum()


def test_the_expected_tokens_part_of_an_allowance_is_capped_by_the_slack():
    """Past its budget a request allows what its expected tokens pay for only as far as its
    saved seconds cover a step that gives it one token; at the floor (no plan keeps it) all
    of it: plain decoding's pace in expectation."""
    budget = np.array([0.05, 0.05, 0.03, INF])
    a = expected_allowance(budget, np.array([0.6, 0.6, 0.5, 0.5]), stall=0.01,
                           slack=np.array([0.0, 0.02, -0.5, INF]), floor=0.03)
    np.testing.assert_allclose(a, [0.05 - 0.01, 0.05 + 0.02 - 0.01, 0.03 * 1.5 - 0.01, INF])


def test_a_request_that_drafts_nothing_holds_the_step_to_its_one_token_limit():
    """A request's allowance counts its own expected draft tokens; one the plan does not draft
    for gets one token from the step, so the step is held to its one-token limit (its budget
    less the stall) while the drafters are held to their allowances. Random batches of
    mixed SLOs and predictions: whenever a step drafts, its planned time is within both."""
    rng = np.random.default_rng(4)
    policy = SloSpecServePolicy(COST, 8)
    subsets = 0
    for t in range(120):
        B = int(rng.integers(2, 12))
        ids = [f"q{t}-{i}" for i in range(B)]
        step = make_step(B, slo=rng.uniform(0.02, 0.3, B), ids=ids)
        slots = policy.history.slots(ids, fill=policy.prior)
        policy.history.values[slots] = rng.uniform(0.05, 0.95, B)
        allow, one = policy.limits(step)
        scale = policy.slo_scale()
        plan = policy.plan(step)
        drafting, drafted = plan.drafting, np.zeros(B, dtype=np.int64)
        conf = rng.uniform(0.05, 0.95, (B, 8))
        while drafting.any() and drafted.max() < 8:
            drafted += drafting
            j = int(drafted.max())
            drafting = plan.extend(np.where(drafted[:, None] >= np.arange(1, j + 1), conf[:, :j],
                                            np.nan), drafting)
        plan_time = plan.time
        drafted = drafted > 0
        if not drafted.any():
            continue
        assert plan_time <= allow[drafted].min() / scale + 1e-12
        if (~drafted).any():
            subsets += 1
            assert plan_time <= one[~drafted].min() / scale + 1e-12
    assert subsets > 0  # plans that left some requests out were checked


def test_a_uniform_step_is_held_to_the_smallest_allowance():
    """A caller that drafts one length for the whole batch (batch_rounds) has every request
    drafting: the step's limit is the smallest allowance, whatever prefix the plan's own
    first round had chosen under the one-token limits."""
    rng = np.random.default_rng(9)
    policy = SloSpecServePolicy(COST, 8)
    for t in range(40):
        B = int(rng.integers(2, 10))
        ids = [f"u{t}-{i}" for i in range(B)]
        step = make_step(B, slo=rng.uniform(0.02, 0.3, B), ids=ids)
        policy.history.values[policy.history.slots(ids, fill=policy.prior)] = \
            rng.uniform(0.05, 0.95, B)
        allow, _ = policy.limits(step)
        scale = policy.slo_scale()
        plan = policy.plan(step)
        k = plan.batch_rounds()
        assert plan.slo == pytest.approx(allow.min() / scale)
        if k:
            assert plan.time <= allow.min() / scale + 1e-12


def test_a_hopeless_tight_request_does_not_turn_speculation_off_for_the_batch():
    """Seven loose requests and one whose SLO is below the plain step: specserve plans no
    speculation for anyone; specserve-slo lets the loose ones bind and speculates."""
    slos = np.array([1e-3] + [1.0] * 7)
    step = make_step(8, slo=slos)
    plain = StepTimer(COST, step).plain
    assert slos[0] < plain < slos[1]
    base = SpecServePolicy(COST, 8, prior=0.9)
    custom = SloSpecServePolicy(COST, 8, prior=0.9)
    assert not base.plan(step).drafting.any()
    assert custom.plan(step).drafting.any()


def test_token_weights_count_the_tokens_of_a_request_plain_decoding_cannot_keep():
    """Budget (SLO + slack's share) below the plain step (0.05 s) and its stall: the cap,
    however close; at or above it, or without an SLO: 1."""
    slo = np.array([0.049, 0.02, 0.1, np.inf, 0.03, 0.04])
    slack = np.array([0.0, 0.0, 0.0, 0.0, -0.05, 0.04])  # the last: 0.04 + 0.02 saved
    w = token_weights(slo, slack, 0.05, cap=2.0)
    np.testing.assert_allclose(w, [2.0, 2.0, 1.0, 1.0, 2.0, 1.0])
    # the stall counts with the plain step: 0.06 is below 0.05 + 0.015
    np.testing.assert_allclose(token_weights(slo, slack, 0.05, cap=2.0, stall=0.015)[5], 2.0)


def test_slo_weight_drafts_for_a_request_that_needs_the_tokens():
    """A draft round dear enough (its fixed cost) that drafting does not raise the batch's
    tokens a second: specserve-slo drafts nothing; with slo_weight, a request whose SLO is a
    third of the plain step counts its draft tokens 3x and the round is taken, with it in."""
    cost = dataclasses.replace(COST, draft=dataclasses.replace(COST.draft, c=COST.draft.c * 6.5))
    step = make_step(4, slo=np.ones(4))
    plain = StepTimer(cost, step).plain
    step = dataclasses.replace(step, tpot_slo=np.array([0.3 * plain, 1.0, 1.0, 1.0]))
    assert not SloSpecServePolicy(cost, 8, prior=0.8, slo_weight=0.0).plan(step).drafting.any()
    assert SloSpecServePolicy(cost, 8, prior=0.8, slo_weight=3.0).plan(step).drafting[0]


def test_overrun_guard_keeps_the_worst_and_the_mean_overrun():
    """The window's worst for specserve's every-step rule; an EMA of the measured steps for
    specserve-slo's rule of expectation. Prefill steps count in neither's error."""
    guard = OverrunGuard(window=64, initial=1.0)
    for i in range(40):
        guard.record(2.5 if i == 20 else 1.0)
    guard.record(5.0, measured=False)
    assert guard.scale == 2.0  # the one slow step, clipped
    assert 1.0 <= guard.mean < 1.05  # ... aged out of the mean


def test_slo_policy_prices_its_budgets_at_the_mean_overrun():
    """One step at twice its predicted time among many on time: specserve holds its plans to
    SLO / 2, and so does specserve-slo's floor by default (mean_guard off), which puts a
    request whose SLO is 1.5x the plain step at the floor (no plan keeps it). At the mean
    overrun (mean_guard on) that request keeps its own budget and allows the step by it."""
    runs = {}
    for mean_guard in (True, False):
        policy = SloSpecServePolicy(COST, 8, initial_overrun=1.0, mean_guard=mean_guard)
        for i in range(60):
            step = make_step(4, slo=np.full(4, 10.0), ids=[f"w{i}-{j}" for j in range(4)])
            plan = policy.plan(step)
            predicted = StepTimer(COST, step).plain
            policy.observe(plan, plain_outcome(4, (2.0 if i == 5 else 1.0) * predicted))
        assert policy.guard.scale == pytest.approx(2.0)
        step = make_step(4, slo=np.ones(4), ids=["a", "b", "c", "d"])
        plain = StepTimer(COST, step).plain
        step = dataclasses.replace(step, tpot_slo=np.array([1.5 * plain, 10.0, 10.0, 10.0]))
        runs[mean_guard] = (policy.slo_scale(), policy.budgets(step)[0], plain,
                            policy.history.values[policy.history.slots(["a"], 0.0)][0])
    (mean, allow, plain, _), (worst, floored, _, pred) = runs[True], runs[False]
    assert mean < 1.1 and worst == pytest.approx(2.0)
    # its own SLO, one token's worth (nothing saved yet, no stall) ...
    assert allow == pytest.approx(1.5 * plain)
    # ... against the floor, the guarded plain step, at plain decoding's pace in expectation
    # (priced at the online-corrected prices, a percent off the profile's here)
    assert floored == pytest.approx(2.0 * plain * (1.0 + pred), rel=0.03)


def test_slack_lets_a_request_allow_a_longer_step():
    policy = SloSpecServePolicy(COST, 8)
    step = make_step(2, slo=np.array([0.5, 0.5]), ids=["fast", "new"])
    policy.plan(step)
    policy.observe(policy.plan(step), plain_outcome(2, 0.1))  # 1 token in 0.1 s: 0.4 s ahead
    budgets = policy.budgets(step)
    pred = policy.history.values[policy.history.slots(["fast", "new"], 0.0)]
    budget = 0.5 + policy.slack_share * 0.4
    np.testing.assert_allclose(budgets, budget + np.minimum(budget * pred, 0.4))
    assert (budgets > 0.5).all()
    policy.release("fast")
    policy.plan(step)  # "fast" is new again: nothing saved, the one-token worst case
    assert policy.budgets(step)[0] == pytest.approx(0.5)


# ----- AdaServe's selection
def test_selection_meets_needs_first_then_highest_path_probability():
    P = np.array([[0.9, 0.8, 0.7, 0.6],    # tight request: needs 2.0 expected tokens
                  [0.99, 0.98, 0.97, 0.96]])  # loose: better tokens, no need
    k = select_tokens(P, np.array([4, 4]), need=np.array([2.0, 0.0]), budget=3)
    # phase 1 takes the tight request's first 3 (0.9 + 0.8 < 2 <= + 0.7); the budget is spent
    np.testing.assert_array_equal(k, [3, 0])
    # a throughput-only selection (no needs) takes the loose request's tokens
    np.testing.assert_array_equal(select_tokens(P, np.array([4, 4]), np.zeros(2), 3), [0, 3])
    # with budget to spare, phase 2 takes the highest path probabilities left
    np.testing.assert_array_equal(select_tokens(P, np.array([4, 4]), np.array([2.0, 0.0]), 6),
                                  [3, 3])


def test_phase_one_serves_the_smallest_needs_first_when_the_budget_cannot_meet_all():
    """The authors' rule: requests in ascending need, each to its need, until the budget is
    spent. A request far behind its SLO (its need past its whole chain) comes last, even with
    the likelier tokens; the old rule (unmet needs' tokens by path probability) gave it all
    three rows."""
    P = np.array([[0.95, 0.9, 0.85, 0.8],   # far behind: needs more than its chain holds
                  [0.6, 0.4, 0.3, 0.2],     # needs 0.5: one token
                  [0.7, 0.5, 0.4, 0.3]])    # needs 1.2: two tokens
    need = np.array([4.0, 0.5, 1.2])
    np.testing.assert_array_equal(select_tokens(P, np.full(3, 4), need, 3), [0, 1, 2])
    # the request the budget runs out on gets what is left, then phase 2 has nothing
    np.testing.assert_array_equal(select_tokens(P, np.full(3, 4), need, 5), [2, 1, 2])
    # ties in batch order
    np.testing.assert_array_equal(
        select_tokens(P[[1, 1]], np.full(2, 4), np.array([0.5, 0.5]), 1), [1, 0])


def test_phase_one_takes_at_most_the_cap_per_request():
    P = np.array([[0.9, 0.8, 0.7, 0.6],
                  [0.99, 0.98, 0.97, 0.96]])
    need = np.array([3.0, 0.0])  # the first needs all four
    np.testing.assert_array_equal(select_tokens(P, np.full(2, 4), need, 4), [4, 0])
    # capped at 2 in phase 1; phase 2 then takes the likeliest left: the second's
    np.testing.assert_array_equal(select_tokens(P, np.full(2, 4), need, 4, cap=2), [2, 2])


def test_adaserve_caps_needs_at_the_depth_and_shares_the_budget_in_order():
    """Needs past the chain tie at the depth (batch order decides), so phase 1 does not rank
    requests by how far behind they already are; the cap is int(1.2 budget / B)."""
    policy = AdaServePolicy(COST, 8, depth=4, token_budget=5)  # 2 rows + 3 draft tokens
    step = make_step(2, slo=0.05)
    plan = policy.plan(step)
    assert plan.batch_rounds() == 3  # ceil(5 / 2)
    conf = np.full((2, 3), 0.9)
    policy.needs = lambda step, t: np.array([400.0, 500.0])  # both far behind
    np.testing.assert_array_equal(plan.verify_lengths(conf, np.full(2, 3)), [3, 0])
    policy.needs = lambda step, t: np.array([400.0, 0.05])  # the second can be kept
    k = plan.verify_lengths(conf, np.full(2, 3))
    assert k[1] >= 1 and k.sum() == 3
    # 16 rows for 5: depth ceil(3.2) = 4, cap int(1.2 * 3.2) = 3, 11 draft tokens
    policy = AdaServePolicy(COST, 8, depth=4, token_budget=16)
    plan = policy.plan(make_step(5, slo=0.05))
    assert plan.batch_rounds() == 4
    policy.needs = lambda step, t: np.array([9.0, 9.0, 0.0, 0.0, 0.0])
    k = plan.verify_lengths(np.full((5, 4), 0.9), np.full(5, 4))
    # phase 1: 3 + 3; phase 2 the 5 likeliest left: the others' first and two second tokens
    # (uncapped: 4 + 4, then the others' first tokens, [4, 4, 1, 1, 1])
    np.testing.assert_array_equal(k, [3, 3, 2, 2, 1])


def test_selection_respects_drafted_lengths_and_keeps_prefixes():
    rng = np.random.default_rng(0)
    for _ in range(50):
        B, s = int(rng.integers(1, 10)), int(rng.integers(1, 8))
        P = np.cumprod(rng.uniform(0.3, 1.0, (B, s)), axis=1)
        drafted = rng.integers(0, s + 1, B)
        need = rng.uniform(-1.0, 4.0, B)
        budget = int(rng.integers(0, B * s + 2))
        k = select_tokens(P, drafted, need, budget)
        assert np.all((0 <= k) & (k <= drafted))
        assert k.sum() == min(budget, drafted.sum())  # the budget is spent when tokens remain


def test_adaserve_needs_follow_the_clock():
    policy = AdaServePolicy(COST, 8)
    step = make_step(2, slo=np.array([0.1, 0.1]), ids=["on", "late"])
    policy.plan(step)
    policy.clock.record(["on"], 1.0, np.array([10]))  # 10 tokens in 1 s: on its SLO
    policy.clock.record(["late"], 2.0, np.array([10]))  # 10 tokens in 2 s: 1 s behind
    need = policy.needs(step, 0.1)
    np.testing.assert_allclose(need, [0.0, 10.0])  # (2.1 / 0.1) - 10 - 1
    no_slo = make_step(1, ids=["on"])
    assert policy.needs(no_slo, 0.1)[0] == 0.0


def test_adaserve_needs_use_the_predicted_step_time_with_the_authors_margin():
    policy = AdaServePolicy(COST, 8, depth=3)
    step = make_step(3, slo=0.05)
    plan = policy.plan(step)
    seen: list[float] = []

    def needs(step, step_time):
        seen.append(step_time)
        return np.zeros(step.batch_size)

    policy.needs = needs
    drafted = np.array([3, 2, 0])
    conf = np.where(np.arange(3)[None, :] < drafted[:, None], 0.8, np.nan)
    plan.verify_lengths(conf, drafted)
    predicted = StepTimer(COST, step).plan(drafted, drafted)  # everything drafted verified
    assert STEP_TIME_MARGIN == 1.05
    assert seen == [pytest.approx(1.05 * predicted)]


def test_adaserve_drafts_its_depth_and_verifies_within_the_budget():
    policy = make_policy("adaserve:3", COST, k_max=8)
    assert isinstance(policy, AdaServePolicy) and policy.depth == 3
    assert default_token_budget(COST) == int(COST.target.c / COST.target.b) == 18
    step = make_step(4, slo=0.2)  # 18 / 4 rows per request: ceil 5, the depth 3 binds
    out = drive_step(policy, step, SyntheticWorkload(np.random.default_rng(1)), np.full(4, 0.7))
    assert out.drafted.max() == 3
    assert 4 + out.verified.sum() <= policy.token_budget


def test_adaserve_drafts_nothing_when_the_batch_uses_up_the_budget():
    """40 verify rows past a budget of 18: no draft token could be verified, so none is
    drafted (the old rule drafted its depth and verified none of it)."""
    policy = make_policy("adaserve:3", COST, k_max=8)
    step = make_step(40, slo=0.2)
    plan = policy.plan(step)
    assert not plan.drafting.any() and plan.batch_rounds() == 0
    out = drive_step(policy, step, SyntheticWorkload(np.random.default_rng(1)), np.full(40, 0.7))
    assert out.drafted.sum() == 0 and out.verified.sum() == 0


def test_step_depth_is_the_budget_per_request_rounded_up():
    assert step_depth(4, 226, 35) == 4  # 6.5 rows per request: the most rounds bind
    assert step_depth(4, 226, 64) == 4  # 3.53: ceil
    assert step_depth(4, 226, 100) == 3
    assert step_depth(4, 226, 150) == 2
    assert step_depth(4, 226, 225) == 2  # one row to spare: a draft token can be verified
    assert step_depth(4, 226, 226) == 0  # the verify rows take the whole budget
    assert step_depth(4, 226, 0) == 0 and step_depth(0, 226, 10) == 0


@pytest.mark.parametrize("batch, rounds", [(10, 4), (30, 4), (40, 3), (60, 2), (99, 2),
                                           (100, 0), (150, 0)])
def test_adaserve_plan_drafts_the_steps_depth(batch, rounds):
    policy = AdaServePolicy(COST, 8, depth=4, token_budget=100)
    plan = policy.plan(make_step(batch, slo=0.05))
    assert plan.batch_rounds() == rounds
    assert plan.drafting.all() if rounds else not plan.drafting.any()
    # k_max caps the rounds too
    assert policy.plan(make_step(batch, k_max=2)).batch_rounds() == min(rounds, 2)


def test_adaserve_budget_is_the_decode_batchs_whatever_prefill_rides_along():
    """The authors' engine runs prefill in iterations of its own; under the linear cost
    model a draft row costs b_t whether a prefill chunk shares the forward or not, so the
    chunk changes neither the depth nor what is verified (it did: 80 prefill tokens left
    20 requests no row for a draft token)."""
    policy = AdaServePolicy(COST, 8, depth=4, token_budget=60)
    step = make_step(20, slo=INF)  # no needs: phase 2 alone
    conf = np.full((20, 3), 0.9)
    for prefill in (0, 80, 1000):
        plan = policy.plan(dataclasses.replace(step, prefill_tokens=prefill))
        assert plan.batch_rounds() == 3  # ceil(60 / 20)
        k = plan.verify_lengths(conf, np.full(20, 3))
        assert k.sum() == 60 - 20  # the draft rows of the budget, all spent
