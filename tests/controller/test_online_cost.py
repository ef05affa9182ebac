"""Online cost correction (estimator/online_cost.py) and SpecServe's use of it: the fit
recovers known scales, and a profile that prices speculation too low stops misleading the
policy once measured steps say so. Also SpecServe's amortized catch-up and its E without a
step's prefill seconds."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from sloserve.bench.synthetic import cpu_cost_model, make_step
from sloserve.estimator.online_cost import StepCostCorrection, solve3
from sloserve.estimator.step_time import StepTimer, draft_time
from sloserve.policies.specserve import SpecServePolicy
from sloserve.speculation import VerifyOutcome

COST = cpu_cost_model()


def test_solve3_solves_as_numpy_and_refuses_a_singular_system():
    """The three-feature fit's 3 x 3 solve on Python floats (it runs every step, on caches a
    forward flushed) gives numpy's solution, pivoting where the first pivot is small."""
    rng = np.random.default_rng(3)
    for _ in range(200):
        m = rng.normal(size=(3, 3)) * rng.choice([1e-3, 1.0, 1e3], size=(3, 1))
        A = m @ m.T + np.diag(rng.uniform(1e-6, 1.0, 3))  # as the fit's: SPD
        b = rng.normal(size=3)
        got = solve3(A.tolist(), b.tolist())
        np.testing.assert_allclose(got, np.linalg.solve(A, b), rtol=1e-7, atol=0.0)
    perm = [[0.0, 2.0, 0.0], [1.0, 0.0, 0.0], [0.0, 0.0, 4.0]]  # a zero first pivot
    assert solve3(perm, [2.0, 3.0, 8.0]) == [3.0, 1.0, 2.0]
    assert solve3([[1.0, 2.0, 3.0], [2.0, 4.0, 6.0], [0.0, 0.0, 1.0]], [1.0, 2.0, 3.0]) is None


def test_correction_recovers_known_scales():
    rng = np.random.default_rng(0)
    c = StepCostCorrection()
    assert c.theta == (1.0, 1.0)  # starts at the profile
    for _ in range(300):
        plain = rng.uniform(0.02, 0.08)
        spec = rng.random() < 0.8
        draft = rng.uniform(0.002, 0.02) if spec else 0.0
        verify = rng.uniform(0.0, 0.02) if spec else 0.0
        noise = rng.normal(1.0, 0.03)
        c.observe(plain + verify, draft, (1.2 * (plain + verify) + 1.3 * draft) * noise,
                  1.3 * draft * noise)
    assert c.theta_target == pytest.approx(1.2, rel=0.03)
    assert c.theta_draft == pytest.approx(1.3, rel=0.03)


def test_a_scale_without_evidence_stays_at_the_profile():
    c = StepCostCorrection()
    for _ in range(100):  # speculation off: only plain steps, 20% slower than profiled
        c.observe(0.05, 0.0, 0.06)
    assert c.theta_target == pytest.approx(1.2, rel=0.01)
    assert c.theta_draft == pytest.approx(1.0)


def test_scales_return_to_the_profile_once_their_evidence_stops():
    """A price learned while speculating fades back to the profile while speculation is off,
    so a few slow steps cannot turn speculation off for good."""
    rng = np.random.default_rng(1)
    c = StepCostCorrection()
    for _ in range(300):
        plain, draft, verify = rng.uniform(0.02, 0.08), rng.uniform(0.002, 0.02), rng.uniform(0.0, 0.02)
        c.observe(plain + verify, draft, 1.4 * (plain + verify) + 1.5 * draft, 1.5 * draft)
    assert c.theta_draft == pytest.approx(1.5, rel=0.03)
    assert c.theta_target == pytest.approx(1.4, rel=0.03)
    for _ in range(600):  # speculation off, plain steps as profiled
        c.observe(0.05, 0.0, 0.05)
    assert c.theta_draft == pytest.approx(1.0, abs=0.05)
    assert c.theta_target == pytest.approx(1.0, abs=0.02)


def test_unmeasured_drafting_is_taken_at_its_current_scale():
    c = StepCostCorrection()
    for _ in range(200):  # no separate draft timing (measured_draft None)
        c.observe(0.06, 0.01, 0.05 + 0.01 + 1.5 * 0.01)
    assert c.theta_draft == 1.0
    assert 0.06 * c.theta_target == pytest.approx(0.065, rel=0.01)


def test_an_outlier_step_is_clipped():
    c = StepCostCorrection()
    for _ in range(50):
        c.observe(0.06, 0.01, 0.07, 0.01)
    c.observe(0.06, 0.01, 5.0, 3.0)  # a pause 70x (GC, preemption) counts as 2x at most
    assert max(c.theta) < 1.2



def test_the_policys_price_clip_bounds_what_one_slow_step_moves():
    """SpecServeOptions.price_clip is the correction's clip: a step measured 1.6x its price
    counts at most 1.1x under price_clip=1.1, in full under the default 2.0; out of range
    is refused naming the option."""
    from sloserve.policies.specserve.options import SpecServeOptions, parse_options

    tight = SpecServePolicy(COST, k_max=4, options=parse_options([("price_clip", "1.1")]))
    default = SpecServePolicy(COST, k_max=4)
    assert tight.correction is not None and default.correction is not None
    moved = []
    for c in (tight.correction, default.correction):
        for _ in range(50):
            c.observe(0.06, 0.01, 0.07, 0.01)
        before = c.theta_target
        c.observe(0.06, 0.01, 0.06 * 1.6 * before + 0.01, 0.01)
        moved.append(c.theta_target / before - 1.0)
    assert 0.0 < moved[0] < moved[1] / 3
    with pytest.raises(ValueError, match="price_clip"):
        SpecServeOptions(price_clip=1.0)


def _plan(policy, step, conf):
    """(drafted, verified, plan) of one step in engine order."""
    plan = policy.plan(step)
    drafting = plan.drafting
    drafted = np.zeros(step.batch_size, dtype=np.int64)
    j = 0
    while drafting.any() and j < step.k_max:
        drafted += drafting
        j += 1
        drafting = plan.extend(conf[:, :j], drafting)
    k = plan.verify_lengths(conf[:, : max(j, 1)], drafted) if j else drafted
    return drafted, np.asarray(k), plan


def test_policy_drafts_less_once_speculation_measures_dearer_than_profiled():
    """Steps whose drafting runs 1.9x their profiled time and whose target work 1.1x: the
    fitted scales find it (the drafter ties plain and verify) and the plans shrink; a policy
    without the correction keeps planning as before."""
    B = 16
    conf = np.full((B, 8), 0.8)
    corrected = SpecServePolicy(COST, 8, prior=0.8)
    profile_only = SpecServePolicy(COST, 8, prior=0.8, correct_cost=False)
    first = {}
    # varied steps (contexts, confidences: plans of every size) so plain and extra time vary
    # apart and both scales are identifiable
    rng = np.random.default_rng(0)
    contexts, means = rng.integers(64, 4096, 150), rng.uniform(0.3, 0.95, 150)
    for i in range(150):
        for name, policy in (("corrected", corrected), ("profile", profile_only)):
            step = make_step(B, context=512 if i == 0 else contexts[i])
            drafted, k, plan = _plan(policy, step,
                                     conf if i == 0 else np.full((B, 8), means[i]))
            if i == 0:
                first[name] = int(k.sum())
            truth = StepTimer(COST, step, lag_cap=policy.options.lag_cap)
            drafting = draft_time(COST.draft, truth.n, truth.lag, drafted)
            verify = truth.plan(drafted, k) - truth.plain - drafting
            measured = 1.1 * (truth.plain + verify) + 1.9 * drafting
            policy.observe(plan, VerifyOutcome(
                drafted=drafted, verified=k, accepted=np.minimum(k, 2),
                confidences=conf[:, : max(int(drafted.max()), 1)], step_time=measured,
                draft_time=1.9 * drafting))
    assert first["corrected"] == first["profile"] > 0  # same start: the profile
    theta_target, theta_draft = corrected.correction.theta
    assert theta_target == pytest.approx(1.1, rel=0.03)
    assert theta_draft == pytest.approx(1.9, rel=0.02)
    # confident drafts at a long context: long plans, where the draft's price decides
    sure = np.full((B, 8), 0.9)
    late_corrected = int(_plan(corrected, make_step(B, context=2048), sure)[1].sum())
    late_profile = int(_plan(profile_only, make_step(B, context=2048), sure)[1].sum())
    assert late_corrected < 0.8 * late_profile


def _plain_outcome(B: int, step_time: float) -> VerifyOutcome:
    zeros = np.zeros(B, dtype=np.int64)
    return VerifyOutcome(drafted=zeros, verified=zeros, accepted=zeros,
                         confidences=np.zeros((B, 0)), step_time=step_time, draft_time=0.0)


def _steps_until_drafting(policy: SpecServePolicy, B: int, lag: int, limit: int) -> int:
    """Plain steps a batch owing `lag` catch-up tokens a request (one more each step) runs
    before the policy drafts; `limit` if it never does."""
    for i in range(limit):
        plan = policy.plan(make_step(B, context=512, lag=np.full(B, lag + i)))
        if plan.drafting.any():
            return i
        policy.observe(plan, _plain_outcome(B, plan.timer.plain))
    return limit


def test_a_paused_request_resumes_once_its_forgone_gains_pay_its_catch_up():
    """Catch-up tokens owed to the draft model after steps without drafting (or a prompt it
    never read) are priced in full less the request's credit: what its next draft token
    would have saved in each step it did not draft. So a pause ends after about as many
    steps as the catch-up costs in forgone gains (a ski-rental rule), not at once (a batch
    that drafted once in a while paid every request's catch-up each time) and not never (a
    price that grows a token per paused step made every pause permanent)."""
    B = 16
    steady = SpecServePolicy(COST, 8, prior=0.8).plan(
        make_step(B, context=512, lag=np.ones(B))).drafting
    assert steady.all()
    # the old rule, lag_cap alone: a pause of any length is priced like one step's
    assert _steps_until_drafting(SpecServePolicy(COST, 8, prior=0.8, lag_credit=False),
                                 B, 400, 100) == 0
    policy = SpecServePolicy(COST, 8, prior=0.8)
    waited = _steps_until_drafting(policy, B, 400, 100)
    # 400 tokens at the draft's b are 40 ms a request; a step forgoes ~0.8 x 4.3 ms less
    # the token's ~1.7 ms of draft and verify a request: ~22 steps
    assert 10 <= waited <= 40
    # a request that drafts pays its catch-up: its credit restarts
    plan = policy.plan(make_step(B, context=512, lag=np.full(B, 400 + waited)))
    drafted = plan.drafting.astype(np.int64)
    policy.observe(plan, VerifyOutcome(
        drafted=drafted, verified=drafted, accepted=drafted, confidences=np.full((B, 1), 0.9),
        step_time=plan.time, draft_time=0.01))
    assert not policy.history.credit[plan.slots].any()


def test_drafting_that_does_not_pay_earns_no_credit():
    """A request whose next draft token would not pay for itself at its prediction forgoes
    nothing by not drafting: its catch-up stays priced in full and the pause lasts."""
    B = 16
    policy = SpecServePolicy(COST, 8, prior=0.2)
    assert _steps_until_drafting(policy, B, 40, 50) == 50
    assert not policy.history.credit.any()


def test_the_credit_counts_savings_as_the_plan_does_under_a_start_margin():
    """A pair the plan drafts on only because its start margin is below 0 (it drafts where E
    is down to 1 + start_margin of plain decoding's): a token's saving is counted with the
    same margin, so a request paused with a long catch-up owed resumes. Counted at no margin
    it earned nothing, and a request that paused once, or owed its prompt, never drafted
    again (the tiny pair's SGLang tests with start_margin=-0.5 on the AMX Xeon, 2026-12-05)."""
    B = 4
    steady = make_step(B, context=512, lag=np.ones(B))
    assert not SpecServePolicy(COST, 4, prior=0.2).plan(steady).drafting.any()
    assert SpecServePolicy(COST, 4, prior=0.2, start_margin=-0.5).plan(steady).drafting.all()
    policy = SpecServePolicy(COST, 4, prior=0.2, start_margin=-0.5)
    # 1,500 tokens at the draft's b are 0.15 s a request; a step forgoes ~(2.4 - 1) x 7.3 ms
    # less the token's draft, verify and fixed share (~1.6 ms): ~11 steps
    waited = _steps_until_drafting(policy, B, 1500, 200)
    assert 3 <= waited <= 40, waited


def test_a_batch_where_drafting_pays_only_without_its_fixed_costs_earns_no_credit():
    """The credit is what a request's next draft token would have saved, its share of the
    step's fixed draft and verify costs included (at least 1 / B of them). The real pair
    inside SGLang at batch 16 (a draft forward's 6.4 ms and the verify path's 1.4 ms, 4.8
    ms a plain token, a first token accepted at ~0.45): a token saves ~0.25 ms less its
    draft row and verify row, less than its ~0.5 ms share; without the share the batch
    earned credit until every request drafted with its whole catch-up (up to 1,700 rows,
    a 580 ms step against 78; 2026-12-05). Where drafting pays with its fixed costs
    (batch 4) the credit still grows."""
    from sloserve.estimator.cost_model import CostModel, ForwardCost

    # the -kpa profile's fit (2026-12-05), contexts of ~128 tokens a request as at C = 16
    real = CostModel(ForwardCost(3.1e-6, 1.76e-3, 48e-3, q0=4.5),
                     ForwardCost(5.5e-7, 1.45e-4, 6.4e-3), overhead=0.9e-3, verify_fixed=1.4e-3)

    def paused(B: int, steps: int) -> SpecServePolicy:
        policy = SpecServePolicy(real, 4, prior=0.45, correct_cost=False)
        for i in range(steps):
            plan = policy.plan(make_step(B, context=128, lag=np.full(B, 100 + i)))
            assert not plan.drafting.any()
            policy.observe(plan, _plain_outcome(B, plan.timer.plain))
        return policy

    assert not paused(16, 300).history.credit.any()
    credit = paused(4, 2).history.credit
    assert np.count_nonzero(credit > 0.0) == 4


def test_the_catch_up_is_priced_less_its_credit_under_a_binding_slo_too():
    """Under a binding SLO no token of the catch-up is free (no lag_cap), but the credit
    counts as without one."""
    B = 16
    slo = np.full(B, 10.0)
    policy = SpecServePolicy(COST, 8, prior=0.8)
    plan = policy.plan(make_step(B, context=512, lag=np.full(B, 400), slo=slo))
    np.testing.assert_array_equal(plan.timer.lag, np.full(B, 400.0))  # no credit yet
    assert not plan.drafting.any()
    for i in range(1, 4):
        policy.observe(plan, _plain_outcome(B, plan.timer.plain))
        plan = policy.plan(make_step(B, context=512, lag=np.full(B, 400 + i), slo=slo))
    assert (plan.timer.lag < 400.0).all()
    old = SpecServePolicy(COST, 8, prior=0.8, lag_credit=False).plan(
        make_step(B, context=512, lag=np.full(B, 403), slo=slo))
    np.testing.assert_array_equal(old.timer.lag, np.full(B, 403.0))  # the real catch-up


def test_a_credit_lowers_the_catch_ups_price_not_the_time_held_to_the_slo():
    """A credit is a reason to draft, not a faster forward: the plan weighs the catch-up at
    its price less the credit, but holds the step's time to the SLO with all of it. Under
    an SLO that the step with the whole batch's catch-up (16 x 400 draft rows, ~0.7 s)
    breaks, a paused batch resumes with as many requests as fit, or none; with the time
    held at the credited price all 16 resumed into a step 0.7 s longer than planned (the
    sweep inside SGLang at 1x on the AVX-512 EPYC, 2026-12-07: 0.3-1.1 s steps at batch
    5-12 against a 75 ms tight TPOT)."""
    B = 16

    def resumes(slo: float) -> tuple[int, object]:
        policy = SpecServePolicy(COST, 8, prior=0.8)
        for i in range(60):
            plan = policy.plan(make_step(B, context=512, lag=np.full(B, 400 + i),
                                         slo=np.full(B, slo)))
            if plan.drafting.any():
                return i, plan
            policy.observe(plan, _plain_outcome(B, plan.timer.plain))
        return 60, plan

    waited, plan = resumes(10.0)  # a loose SLO: the credit's rule as without one
    assert 10 <= waited <= 40
    real = plan.time + float(plan.timer.excused[plan.drafting].sum())
    assert plan.timer.excused.sum() > 0.5 and real < plan.slo_all
    # the same batch under an SLO whose limit (the guard's initial 2x) lies between the
    # step's credited time and its real one
    tight = plan.time + real
    assert plan.time < tight / 2.0 < real
    _, plan = resumes(tight)
    assert 0 < np.count_nonzero(plan.drafting) < B
    assert plan.time + float(plan.timer.excused[plan.drafting].sum()) <= tight / 2.0
    _, plan = resumes(0.4)  # a limit of 0.2 s: no prefix that fits raises E
    assert not plan.drafting.any()


@pytest.mark.parametrize("rule", ["decode-only E", "paper E"])
def test_prefill_chunks_change_the_plan_only_under_the_papers_rule(rule):
    """A draft token is worth the same whether or not the step also carries a prefill chunk
    with the default E that leaves the prefill's seconds out; the step's own E over all its
    seconds (the paper's rule, score_prefill=True) drafts more beside a prefill, whose time
    makes the step's E look low."""
    B = 16
    conf = np.full((B, 8), 0.7)
    policy = SpecServePolicy(COST, 8, prior=0.7, score_prefill=rule == "paper E",
                             correct_cost=False)
    plans = {}
    for prefill in (0, 2048):
        step = make_step(B, context=512)
        step = dataclasses.replace(step, prefill_tokens=prefill, prefill_context=prefill)
        plans[prefill] = int(_plan(policy, step, conf)[1].sum())
    assert plans[0] > 0
    if rule == "paper E":
        assert plans[2048] > plans[0]
    else:
        assert plans[2048] == plans[0]


def test_prefill_seconds_of_a_step():
    """StepTimer.prefill: what a step's prefill chunks add to plain decoding (target and
    draft reading them), 0 without prefill."""
    step = make_step(8, context=300)
    assert StepTimer(COST, step).prefill == 0.0
    mixed = dataclasses.replace(step, prefill_tokens=500, prefill_context=700)
    timer = StepTimer(COST, mixed)
    expected = (COST.target.time(8 * 300 + 700, 8 + 500) - COST.target.time(8 * 300, 8)
                + COST.draft.time(700, 500))
    assert timer.prefill == pytest.approx(expected)
    assert timer.plain == pytest.approx(StepTimer(COST, step).plain + expected)


def test_measured_target_forward_gives_its_scale_and_the_engine_overhead():
    """With the target forward timed apart, its scale is fitted on it alone and the rest of
    the step (the engine's own work) is learned as the overhead, so that work does not
    raise the price of verified tokens."""
    rng = np.random.default_rng(2)
    c = StepCostCorrection()
    assert c.overhead is None
    for _ in range(400):
        plain, draft, verify = rng.uniform(0.01, 0.03), rng.uniform(0.002, 0.01), rng.uniform(0, 0.02)
        noise = rng.normal(1.0, 0.02)
        target = 0.8 * (plain + verify) * noise
        m_draft = 1.3 * draft * noise
        c.observe(plain + verify, draft, target + m_draft + 0.004, m_draft,
                  measured_target=target, overhead=0.001)
    assert c.theta_target == pytest.approx(0.8, rel=0.02)
    assert c.theta_draft == pytest.approx(1.3, rel=0.02)
    assert c.overhead == pytest.approx(0.004, rel=0.02)


def test_the_drafter_prices_the_measured_overhead_outside_verify_tokens():
    """Fed steps whose target forward runs at the profile's time but which spend 5 ms more
    outside the forwards, the drafter keeps the profile's price of a verified token and
    moves the 5 ms to the overhead; without the measured forward the tied scale absorbs
    the 5 ms and prices every verified token higher."""
    B = 8
    conf = np.full((B, 8), 0.7)
    prices = {}
    for measured in (True, False):
        policy = SpecServePolicy(COST, 8, prior=0.7)
        for _ in range(200):
            step = make_step(B, context=256)
            drafted, k, plan = _plan(policy, step, conf)
            truth = StepTimer(COST, step, lag_cap=policy.options.lag_cap)
            drafting = draft_time(COST.draft, truth.n, truth.lag, drafted)
            target = truth.plan(drafted, k) - drafting - COST.overhead
            policy.observe(plan, VerifyOutcome(
                drafted=drafted, verified=k, accepted=np.minimum(k, 2),
                confidences=conf[:, : max(int(drafted.max()), 1)],
                step_time=target + drafting + 0.005, draft_time=drafting,
                verify_time=target if measured else None))
        prices[measured] = policy.plan(make_step(B, context=256)).cost
    assert prices[True].target.b == pytest.approx(COST.target.b, rel=0.02)
    assert prices[True].overhead == pytest.approx(0.005, rel=0.05)
    assert prices[False].target.b > 1.05 * COST.target.b


def test_correction_learns_the_verify_path_apart_from_the_scale():
    """A profiled verify_fixed of 10 ms where the verify path really costs 18 ms, the plain
    forward runs at 0.8x the profile and verified tokens at 3x theirs (SGLang's CPU verify
    at batch 1): the three-feature fit finds all three (one scale could not). Like the
    scales, v stays within max_scale of the profile's, or within a plain forward where the
    verify path really costs that much (next test)."""
    rng = np.random.default_rng(1)
    c = StepCostCorrection(verify_fixed=0.01)
    for _ in range(400):
        plain = rng.uniform(0.05, 0.2)
        k = int(rng.integers(0, 8)) if rng.random() < 0.6 else 0
        tokens = 0.002 * k
        measured_target = 0.8 * plain + 3.0 * tokens + (0.018 if k else 0.0)
        c.observe(plain + tokens, 0.0, measured_target + 0.001, measured_draft=None,
                  measured_target=measured_target, verify_part=tokens if k else None)
    assert c.theta_target == pytest.approx(0.8, rel=0.03)
    assert c.theta_verify == pytest.approx(3.0, rel=0.05)
    assert c.verify_fixed == pytest.approx(0.018, rel=0.1)
    plain_only = StepCostCorrection(verify_fixed=0.01)  # no verify step: v stays the prior
    for _ in range(100):
        plain_only.observe(0.1, 0.0, 0.09, measured_target=0.09)
    assert plain_only.verify_fixed == pytest.approx(0.01)
    assert plain_only.theta_verify == pytest.approx(1.0)
    assert plain_only.theta_target == pytest.approx(0.9, rel=0.02)


def test_a_verify_path_far_dearer_than_profiled_is_learned_up_to_a_plain_forward():
    """The 2-core AMD EPYC (2026-11-27): a batch-1 decode forward ~170 ms, the verify path
    ~120 ms more, the profile's verify_fixed 16 ms. v follows it past max_scale x the prior
    (the old bound held it at 32 ms), but never past a plain forward."""
    rng = np.random.default_rng(2)
    c = StepCostCorrection(verify_fixed=0.016)
    for _ in range(300):
        plain = rng.uniform(0.16, 0.18)
        k = int(rng.integers(1, 8)) if rng.random() < 0.5 else 0
        tokens = 0.004 * k
        measured_target = plain + tokens + (0.12 if k else 0.0)
        c.observe(plain + tokens, 0.0, measured_target + 0.001, measured_draft=None,
                  measured_target=measured_target, verify_part=tokens if k else None)
    assert c.verify_fixed == pytest.approx(0.12, rel=0.1)
    worse = StepCostCorrection(verify_fixed=0.016)  # a verify costing 3 forwards more
    for i in range(300):
        k = i % 2
        worse.observe(0.17 + 0.004 * k, 0.0, 1.0, measured_draft=None,
                      measured_target=0.17 + (0.5 if k else 0.0),
                      verify_part=0.004 if k else None)
    assert worse.verify_fixed <= 0.17 * 1.001


def test_one_fast_verify_step_does_not_price_the_verify_path_at_nothing():
    """SGLang's CPU engine at batch 1 with a weak draft (2026-12-02): hundreds of decode
    steps, then one verify step that ran faster than the decode steps around it (this
    machine's speed swings 0.86-1.27x second to second). v's prior had faded to the ridge,
    so that one step set v to 0 and theta_verify to its floor, and the plan then drafted
    32 steps in a row that accepted next to nothing. v stays within max_scale of the
    profile's, as the scales do."""
    c = StepCostCorrection(verify_fixed=0.006)
    for _ in range(300):
        c.observe(0.08, 0.0, 0.0815, measured_target=0.08)
    c.observe(0.082, 0.0, 0.072, measured_target=0.0705, verify_part=0.002)
    assert c.verify_fixed >= 0.006 / c.max_scale
    assert c.theta_target == pytest.approx(1.0, rel=0.02)


def _run_at_batch_1(policy, truth, token_seconds, conf, rng, steps=200):
    """`steps` single-request steps through the policy, measured as `truth` prices a plain
    forward, plus its verify path and token_seconds a verified token when the step verifies."""
    for _ in range(steps):
        step = make_step(1, context=int(rng.integers(64, 1024)))
        drafted, k, plan = _plan(policy, step, conf)
        timer = StepTimer(truth, step)
        verify = timer.plain - truth.overhead + (
            truth.verify_fixed + token_seconds * float(k.sum()) if k.sum() else 0.0)
        drafting = draft_time(COST.draft, timer.n, timer.lag, drafted)
        policy.observe(plan, VerifyOutcome(
            drafted=drafted, verified=k, accepted=np.minimum(k, 2),
            confidences=conf[:, : max(int(drafted.max()), 1)],
            step_time=verify + drafting + truth.overhead, draft_time=drafting,
            verify_time=verify))


def test_verified_tokens_learnt_at_batch_1_are_not_overpriced_at_batch_16():
    """SGLang's CPU engine: a verified token costs ~5 ms at batch 1 and ~1.5 ms at 16
    against one profiled b of 2.2 ms. A policy that speculates at batch 1 first learns one
    scale for verified tokens there (~2x): without the profile's price by batch size it
    then prices batch 16's tokens at ~5 ms too (and stops speculating there, 2026-12-02);
    with it the scale stays ~1 and batch 16 keeps its own price."""
    b = 2.2e-3
    truth = ((1.0, 5e-3), (16.0, 1.5e-3))
    flat = dataclasses.replace(COST, target=dataclasses.replace(COST.target, b=b),
                               verify_fixed=0.005)
    by_batch = dataclasses.replace(flat, verify_token=truth)
    conf = np.full((1, 8), 0.9)
    rng = np.random.default_rng(3)
    policies = {"flat": SpecServePolicy(flat, 8, prior=0.9),
                "by_batch": SpecServePolicy(by_batch, 8, prior=0.9)}
    for policy in policies.values():
        _run_at_batch_1(policy, by_batch, 5e-3, conf, rng)
        assert policy.correction is not None
    flat_verify = policies["flat"].correction.theta_verify
    assert flat_verify > 0.8 * 5e-3 / b  # (with the verify path's v, fitted alongside)
    assert policies["by_batch"].correction.theta_verify == pytest.approx(1.0, abs=0.1)
    at16 = {name: StepTimer(p._current_prices().cost, make_step(16)).token_time
            for name, p in policies.items()}
    assert at16["by_batch"] == pytest.approx(1.5e-3, rel=0.1)
    assert at16["flat"] > 2.5 * at16["by_batch"]


@pytest.mark.parametrize("rough", [False, True])
def test_a_rough_estimate_is_corrected_past_a_profiles_bound(rough):
    """Without a profile the cost is rough_cost's, from the models' shapes: SGLang's float32
    decode forward on a 2-core Xeon ran 2-3x it at batch 1-4 (2026-12-02), and the step's
    scale sat at a profile's bound, 2, so every step was priced a third too low. A rough
    estimate's scales may move ROUGH_MAX_SCALE; a profile's stay within 2x."""
    cost = dataclasses.replace(COST, rough=rough)
    policy = SpecServePolicy(cost, 4, prior=0.0)  # predicts nothing: plain steps only
    for _ in range(300):
        step = make_step(4, context=256)
        plan = policy.plan(step)
        assert not plan.drafting.any()
        truth = StepTimer(cost, step, lag_cap=policy.options.lag_cap).plain
        zeros = np.zeros(4, dtype=np.int64)
        policy.observe(plan, VerifyOutcome(
            drafted=zeros, verified=zeros, accepted=zeros, confidences=np.zeros((4, 0)),
            step_time=3.0 * truth, draft_time=0.0, verify_time=3.0 * (truth - cost.overhead)))
    theta_target = policy.correction.theta_target
    if rough:
        assert theta_target == pytest.approx(3.0, rel=0.02)
        step = make_step(4, context=256)
        assert StepTimer(policy.plan(step).cost, step).plain == pytest.approx(3.0 * truth,
                                                                             rel=0.02)
    else:
        assert theta_target == 2.0


def test_verified_tokens_learnt_cheap_at_batch_1_keep_the_profiles_price_at_batch_16():
    """Without a price by batch size (a rough estimate has none), steps at batch 1 where a
    verified token costs next to nothing (the verify path's fixed cost took the difference)
    teach a verified-token scale of ~0. SGLang's CPU engine, going from C = 1 to 16 so,
    priced batch 16's tokens at 1/64 of theirs and verified 24-37 tokens a step for 27
    steps. What a band of batch sizes learnt holds there; another band starts at the
    profile's price, until steps there verify (and a scale cheaper than the profile holds
    within 2x of the batch sizes it was learnt at, within a band too)."""
    b = 2.2e-3
    cost = dataclasses.replace(COST, target=dataclasses.replace(COST.target, b=b),
                               verify_fixed=0.005, rough=True)
    conf = np.full((1, 8), 0.9)
    rng = np.random.default_rng(3)
    policy = SpecServePolicy(cost, 8, prior=0.9)
    _run_at_batch_1(policy, cost, 0.0, conf, rng)
    assert policy.correction is not None
    assert policy.correction.theta_verify < 0.5  # learnt: cheaper than profiled at batch 1
    token = {B: StepTimer(policy._current_prices(B).cost, make_step(B)).token_time
             for B in (1, 2, 16)}
    assert token[1] < 0.5 * b  # the learnt price
    assert token[2] == token[16] == pytest.approx(b)  # other bands: the profile's
    # once steps at batch 16 verify, what they teach holds there
    for _ in range(30):
        step = make_step(16, context=512)
        plan = policy.plan(step)
        k = np.ones(16, dtype=np.int64)
        policy.observe(plan, VerifyOutcome(
            drafted=k, verified=k, accepted=k, confidences=np.full((16, 1), 0.9),
            step_time=0.1, draft_time=0.02, verify_time=0.07))
    assert StepTimer(policy._current_prices(16).cost, make_step(16)).token_time \
        == pytest.approx(b * policy.correction.theta_verify)


def test_a_slow_first_step_after_a_long_pause_moves_the_scales_as_at_the_start():
    """SGLang at batch 16 drafts nothing for hundreds of steps; the first drafting step at
    batch 4 reads its requests' catch-up and runs cold (38 ms of drafting against ~12; its
    verify path 15 ms against 3). With the priors faded to the ridge, that one step set
    theta_draft to 4x and v to 7x (2026-12-05); as sure of the profile as at the start, the
    fit moves about as far as one such step moves a fresh fit (here 1.27 against 1.11: its
    feature, 3x the typical drafting, counts for more against the typical square; the
    ridge alone gave 1.91)."""
    def run(pause: int) -> StepCostCorrection:
        c = StepCostCorrection(verify_fixed=0.003)
        for i in range(300):  # drafting and verifying at the profile's prices
            k = i % 3 != 0
            c.observe(0.05 + (0.01 if k else 0.0), 0.012 if k else 0.0,
                      0.063 + (0.025 if k else 0.0), 0.012 if k else None,
                      measured_target=0.05 + (0.013 if k else 0.0),
                      verify_part=0.01 if k else None)
        for _ in range(pause):  # plain steps only, as profiled
            c.observe(0.05, 0.0, 0.051, measured_target=0.05)
        # the slow first step: drafting 3x (its catch-up priced at 0.02), v 5x
        c.observe(0.06, 0.02, 0.06 + 0.015 + 0.06, 0.06, measured_target=0.05 + 0.01 + 0.015,
                  verify_part=0.01)
        return c

    fresh = StepCostCorrection(verify_fixed=0.003)
    fresh.observe(0.06, 0.02, 0.06 + 0.015 + 0.06, 0.06, measured_target=0.05 + 0.01 + 0.015,
                  verify_part=0.01)
    after = run(500)
    assert fresh.theta_draft < after.theta_draft < 1.3
    assert after.verify_fixed <= fresh.verify_fixed * 1.1 and after.verify_fixed < 0.0045
    busy = run(0)  # right after steady evidence the step moves the fit even less
    assert busy.theta_draft < 1.1 and busy.verify_fixed < 0.0035


def test_an_anchored_fit_forgets_towards_the_runs_prices_not_the_profiles():
    """The verify path measured at 5 ms against the profile's 9 over 400 steps, then 150
    steps that verify nothing (the plan stopped drafting): without the anchor the windowed
    fit returns to the profile's v (and the plan, seeing speculation dear, does not draft
    again to correct it); anchored to a slow fit of the same features (`anchor`, ~500
    steps), it returns to what the run measured. While steps verify, both track them."""
    def run(anchor: float, pause: int) -> StepCostCorrection:
        rng = np.random.default_rng(2)
        c = StepCostCorrection(verify_fixed=0.009, anchor=anchor)
        for _ in range(400):
            plain = rng.uniform(0.05, 0.07)
            k = int(rng.integers(1, 4)) if rng.random() < 0.7 else 0
            tokens = 0.002 * k
            measured = plain + tokens + (0.005 if k else 0.0)
            c.observe(plain + tokens, 0.0, measured + 0.001, measured_target=measured,
                      verify_part=tokens if k else None)
        for _ in range(pause):
            c.observe(0.06, 0.0, 0.061, measured_target=0.06)
        return c

    for anchor in (0.0, 0.998):
        assert run(anchor, 0).verify_fixed == pytest.approx(0.005, abs=0.0008)
    assert run(0.0, 150).verify_fixed > 0.0075  # back at the profile's 9 ms
    anchored = run(0.998, 150)
    assert anchored.verify_fixed < 0.006
    assert anchored.theta_target == pytest.approx(1.0, abs=0.02)
    with pytest.raises(ValueError, match="anchor"):
        StepCostCorrection(anchor=0.5)


def test_an_anchored_draft_scale_keeps_what_the_run_measured_over_a_pause():
    """Drafting measured 3x its estimate (a rough estimate: no profile), then 200 steps
    without drafting: the windowed scale returns towards the estimate (and a plan would
    draft again at a third of its price); anchored, it stays near what was measured."""
    def run(anchor: float) -> float:
        c = StepCostCorrection(anchor=anchor, max_scale=8.0)
        for i in range(300):
            d = 0.01 if i % 2 else 0.0
            c.observe(0.05, d, 0.05 + 3 * d, 3 * d if d else None, measured_target=0.05)
        assert c.theta_draft == pytest.approx(3.0, rel=0.05)
        for _ in range(200):
            c.observe(0.05, 0.0, 0.05, None, measured_target=0.05)
        return c.theta_draft

    assert run(0.0) < 1.5
    assert run(0.998) > 2.5


def test_a_verify_path_below_its_floor_does_not_raise_the_tokens_price():
    """At batch 16 SGLang's verify path costs next to nothing over its decode forward while
    the profile says 10 ms (measured at batch 1): v stops at its floor (5 ms), and the
    tokens' scale is fitted given that floor, so the price of the verified tokens the batch
    runs stays near what they cost rather than the floor's 5 ms over it."""
    rng = np.random.default_rng(3)
    c = StepCostCorrection(verify_fixed=0.01)
    for _ in range(300):
        plain = rng.uniform(0.12, 0.14)
        k = int(rng.integers(12, 33)) if rng.random() < 0.7 else 0
        tokens = 0.0013 * k  # profiled; they cost 0.8 ms each, nothing fixed
        measured = plain + 0.0008 * k
        c.observe(plain + tokens, 0.0, measured + 0.001, measured_target=measured,
                  verify_part=tokens if k else None)
    assert c.verify_fixed == pytest.approx(0.005)
    for k in (16, 32):
        price = c.theta_verify * 0.0013 * k + c.verify_fixed
        assert price == pytest.approx(0.0008 * k, rel=0.2)


def test_a_verify_path_learnt_dear_at_batch_1_does_not_price_batch_16():
    """A minute at batch 1 where the verify path costs 20 ms over a decode forward against
    a profiled 10, then batch 16: its steps are priced by their own band's fit (the
    profile's at first), not by batch 1's window; SGLang's CPU runtime drafted nothing at
    batch 16 for ~100 steps while batch 1's v faded (2026-12-07). Back at batch 1 its band
    still holds what it learnt."""
    cost = dataclasses.replace(COST, verify_fixed=0.01)
    policy = SpecServePolicy(cost, 4, prior=0.9)
    for _ in range(200):
        step = make_step(1, context=256)
        plan = policy.plan(step)
        k = np.ones(1, dtype=np.int64)
        truth = StepTimer(cost, step).plain
        policy.observe(plan, VerifyOutcome(
            drafted=k, verified=k, accepted=k, confidences=np.full((1, 1), 0.9),
            step_time=truth + 0.03, draft_time=0.005,
            verify_time=truth - cost.overhead + 0.02 + StepTimer(cost, step).token_time))
    assert policy.correction is not None
    assert policy.correction.verify_fixed > 0.012
    assert policy._current_prices(16).cost.verify_fixed == pytest.approx(0.01)
    assert policy._current_prices(1).cost.verify_fixed > 0.012
    from sloserve.estimator.online_cost import BatchCorrections
    assert [BatchCorrections.band(b) for b in (1, 2, 4, 7, 8, 16, 31, 32)] == \
        [0, 1, 1, 1, 2, 2, 2, 3]
