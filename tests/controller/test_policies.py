"""Every policy on random step streams, and each baseline's source rule."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from sloserve.bench.synthetic import SyntheticWorkload, cpu_cost_model, drive_step, make_step
from sloserve.estimator.acceptance import chain_probs
from sloserve.estimator.cost_model import CostModel, ForwardCost
from sloserve.estimator.efficiency import binding_slo
from sloserve.estimator.step_time import StepTimer
from sloserve.policies.goodput import GoodputPolicy
from sloserve.policies.hf import HFHeuristicPolicy, HFThresholdPolicy
from sloserve.policies.lut import LookupTablePolicy, default_table
from sloserve.policies.registry import POLICY_NAMES, make_policy
from sloserve.policies.sglang_adaptive import EmaStepTracker, SGLangAdaptivePolicy
from sloserve.policies.specserve import SpecServePolicy
from sloserve.speculation import SpecPlan, SpecPolicy, StepInfo, VerifyOutcome

COST = cpu_cost_model()
NGRAM_COST = CostModel(COST.target, ForwardCost.free(), COST.overhead)
KNEE_COST = CostModel(ForwardCost(COST.target.a, COST.target.b, COST.target.c, q0=80.0),
                      ForwardCost(COST.draft.a, COST.draft.b, COST.draft.c, q0=16.0), COST.overhead)
# with the draft's per-step setup and the verify path's fixed cost (SGLang's CPU shape)
SETUP_COST = CostModel(KNEE_COST.target,
                       ForwardCost(COST.draft.a, COST.draft.b, COST.draft.c, q0=16.0,
                                   first=COST.draft.c * 0.5), COST.overhead,
                       verify_fixed=COST.target.c * 0.1)


class CheckingPlan(SpecPlan):
    """Wraps a plan and asserts the contract on every call."""

    def __init__(self, plan, speculates: bool):
        self.p = plan
        self.step = plan.step
        d = np.asarray(plan.drafting)
        assert d.shape == (plan.step.batch_size,) and d.dtype == bool
        if not speculates:
            assert not d.any()
        self.drafting = d

    def extend(self, conf, drafting):
        d = np.asarray(self.p.extend(conf, drafting))
        assert d.shape == drafting.shape and d.dtype == bool
        assert not np.any(d & ~drafting), "extend must return a subset of drafting"
        if conf.shape[1] >= self.step.k_max:
            assert not d.any(), "nobody drafts past k_max"
        return d

    def verify_lengths(self, conf, drafted):
        k = np.asarray(self.p.verify_lengths(conf, drafted))
        assert k.shape == drafted.shape and np.issubdtype(k.dtype, np.integer)
        assert np.all((0 <= k) & (k <= drafted))
        return k


class CheckingPolicy(SpecPolicy):
    """Wraps a policy and hands out checked plans; observe gets the policy's own plan."""

    def __init__(self, policy):
        self.p = policy

    def plan(self, step):
        return CheckingPlan(self.p.plan(step), self.p.speculates)

    def observe(self, plan, outcome):
        self.p.observe(plan.p, outcome)


def random_stream(rng, steps: int):
    """Steps with churning requests, random contexts, lags, SLOs, prefill and k_max."""
    live: list[str] = []
    next_id = 0
    for _ in range(steps):
        live = [r for r in live if rng.random() > 0.1]
        while len(live) < rng.integers(0, 40):
            live.append(f"q{next_id}")
            next_id += 1
        B = len(live)
        slo = np.where(rng.random(B) < 0.3, rng.uniform(0.03, 0.5, B), np.inf)
        yield StepInfo(
            request_ids=list(live),
            context_lens=rng.integers(1, 6000, B),
            tpot_slo=slo,
            k_max=int(rng.integers(0, 9)),
            prefill_tokens=int(rng.integers(0, 200)),
            prefill_context=int(rng.integers(0, 400)),
            draft_lag=rng.integers(0, 3, B) if rng.random() < 0.8 else None,
        )


@pytest.mark.parametrize("drafter", ["model", "ngram"])
@pytest.mark.parametrize("spec", POLICY_NAMES)
def test_every_policy_keeps_the_contract_on_random_streams(spec, drafter):
    rng = np.random.default_rng(abs(hash((spec, drafter))) % 2**32)
    cost = NGRAM_COST if drafter == "ngram" else COST
    policy = make_policy(spec, cost, k_max=8, drafter=drafter)
    checked = CheckingPolicy(policy)
    work = SyntheticWorkload(rng)
    seen: set[str] = set()
    for step in random_stream(rng, 60):
        mean = rng.uniform(0.05, 0.98, step.batch_size)
        drive_step(checked, step, work, mean)
        for rid in seen - set(step.request_ids):
            policy.release(rid)
        seen = set(step.request_ids)


def outcome(drafted, verified, accepted, s=None) -> VerifyOutcome:
    drafted = np.asarray(drafted)
    s = int(drafted.max()) if s is None else s
    conf = np.where(np.arange(s)[None, :] < drafted[:, None], 0.5, np.nan)
    return VerifyOutcome(drafted, np.asarray(verified), np.asarray(accepted), conf, 0.0, 0.0)


def test_hf_heuristic_rule():
    policy = HFHeuristicPolicy(k_max=8)
    step = make_step(3)
    np.testing.assert_array_equal(policy.target_lengths(step), [5, 5, 5])
    plan = policy.plan(step)
    # all accepted -> +2 (capped at k_max), one rejected -> -1, nothing verified -> unchanged
    policy.observe(plan, outcome([5, 5, 0], [5, 5, 0], [5, 2, 0], s=5))
    np.testing.assert_array_equal(policy.target_lengths(step), [7, 4, 5])
    for _ in range(6):
        policy.observe(policy.plan(step), outcome([5, 5, 5], [5, 5, 5], [0, 0, 0]))
    np.testing.assert_array_equal(policy.target_lengths(step), [1, 1, 1])  # floor at 1
    policy.release("r0")
    np.testing.assert_array_equal(policy.target_lengths(step), [5, 1, 1])  # fresh state


def test_hf_threshold_stops_after_a_low_confidence_token():
    policy = HFThresholdPolicy(k_max=8)
    step = make_step(3)
    plan = policy.plan(step)
    drafting = plan.drafting
    assert drafting.all()
    conf = np.array([[0.9], [0.39], [0.4]])
    np.testing.assert_array_equal(plan.extend(conf, drafting), [True, False, True])
    full = np.array([[0.9] * 8, [0.9] * 8, [0.9] * 8])
    assert not plan.extend(full, drafting).any()  # k_max reached


def test_lut_lookup_semantics():
    policy = LookupTablePolicy({4: 4, 8: 2, 32: 1}, k_max=8)  # TensorRT-LLM's example
    got = {b: policy.k_for(b) for b in (1, 4, 5, 8, 9, 32, 33)}
    assert got == {1: 4, 4: 4, 5: 2, 8: 2, 9: 1, 32: 1, 33: 0}


def test_default_lut_is_non_increasing_and_speculates_at_batch_one():
    table = default_table(COST, 8)
    ks = list(table.values())
    assert ks[0] >= 2 and all(a >= b for a, b in zip(ks, ks[1:])) and ks[-1] < ks[0]


def test_sglang_tracker_hysteresis():
    t = EmaStepTracker((1, 3, 7))
    assert t.steps == 3
    for _ in range(10):
        t.update(6.0)  # warm-up: EMA moves, steps do not
    assert t.steps == 3
    for _ in range(5):
        t.update(6.0)
    assert t.steps == 7
    for _ in range(5):
        t.update(2.9)  # EMA still above 3 - 0.5: no drop yet
    assert t.steps == 7 and t.ema > 2.5
    for _ in range(30):
        t.update(0.0)
    assert t.steps == 1


def test_sglang_buckets_by_batch_size():
    policy = SGLangAdaptivePolicy(k_max=4)
    assert policy.tracker(1) is policy.tracker(63)
    assert policy.tracker(64) is not policy.tracker(63)
    assert policy.tracker(1).candidates == [1, 3, 4]  # 7 clipped to k_max


def test_goodput_ngram_mode_proposes_max_and_picks_verify_length():
    policy = GoodputPolicy(NGRAM_COST, 6, drafter="ngram", prior=0.6)
    step = make_step(8)
    plan = policy.plan(step)
    assert (plan.drafting & (plan.target == 6)).all()
    drafted = np.array([6, 2, 0, 4] * 2)
    k = plan.verify_lengths(np.full((8, 6), 0.5), drafted)
    assert np.all(k <= drafted) and 0 < k.max() < 6
    assert np.all(k == np.minimum(drafted, k.max()))  # one uniform verification length


def test_specserve_learns_per_request_predictability():
    """Requests whose drafts are confident draft longer than hopeless ones."""
    rng = np.random.default_rng(3)
    policy = SpecServePolicy(COST, 8)
    work = SyntheticWorkload(rng, concentration=30.0)
    step = make_step(8)
    mean = np.array([0.95] * 4 + [0.15] * 4)
    drafted = np.zeros(8)
    for i in range(40):
        o = drive_step(policy, step, work, mean)
        if i >= 10:
            drafted += o.drafted
    assert drafted[:4].min() > 2 * max(drafted[4:].max(), 1)


def test_specserve_measures_new_requests_after_the_prior_fell():
    """The running prior (the mean prediction of measured requests) can fall, after a run
    of poorly accepted requests, to where a new request is not worth a draft round at it.
    New requests are still planned at the configured prior until their own first drafts
    are seen, so confident newcomers are measured and then draft (before, speculation
    stayed off for good: nothing drafted, nothing learned)."""
    rng = np.random.default_rng(5)
    work = SyntheticWorkload(rng, concentration=30.0)
    newcomers = make_step(12)
    # at 0.15 no draft round pays at batch 12 (a policy configured so does not draft)
    assert not SpecServePolicy(COST, 8, prior=0.15).plan(newcomers).drafting.any()
    policy = SpecServePolicy(COST, 8)  # configured prior 0.6
    policy.prior = 0.15  # the running prior after hopeless requests
    assert policy.plan(newcomers).drafting.all()  # measured at the configured prior
    drafted = [drive_step(policy, newcomers, work, np.full(12, 0.95)).drafted.sum()
               for _ in range(10)]
    assert min(drafted[1:]) >= 2 * 12  # measured confident: they go on drafting
    assert policy.prior > 0.15  # the prior follows the measured requests
    assert not policy.history.fresh[policy.history.slots(newcomers.request_ids, 0.0)].any()


@pytest.mark.parametrize("batch", [1, 12])  # the Python-float plan and the numpy one
def test_specserve_paused_requests_draft_again_once_their_estimate_aged(batch):
    """A request that met a stretch of text its draft does not know (low confidences) stops
    drafting. Its prediction then ages towards the pair's pooled acceptance, one share a
    paused step (pause_relax), so once the text turns easy again it drafts again, and learns
    so. Frozen at the low tail it paused on (pause_relax 0), it never drafted again (SGLang,
    the distilled draft at C = 1: 74% of steps drafted nothing)."""
    centers = (np.arange(16) + 0.5) / 16
    total = 400.0 * centers / centers.sum()  # more samples at high confidence, as drafted
    seeded = np.stack([total * (1.0 - centers), total * centers])  # a calibrated draft
    resumed = {}
    for relax in (0.05, 0.0):
        rng = np.random.default_rng(11)
        work = SyntheticWorkload(rng, concentration=30.0)
        policy = SpecServePolicy(COST, 8, pause_relax=relax)
        policy.seed_calibration(seeded)
        assert policy.g.pooled == pytest.approx(float((centers ** 2).sum() / centers.sum()))
        step = make_step(batch)
        for _ in range(6):  # easy text: it drafts
            assert drive_step(policy, step, work, np.full(batch, 0.9)).drafted.all()
        hard = 0
        while drive_step(policy, step, work, np.full(batch, 0.05)).drafted.any():
            hard += 1
            assert hard < 10, "hard text should stop the drafting"
        # easy text again: how many steps until every request drafts again
        for i in range(40):
            if drive_step(policy, step, work, np.full(batch, 0.9)).drafted.all():
                resumed[relax] = i
                break
    assert resumed.get(0.05, 99) < 30
    assert 0.0 not in resumed  # frozen, it stayed paused


@pytest.mark.parametrize("batch", [1, 12])  # the Python-float plan and the numpy one
def test_specserve_stops_measuring_newcomers_once_its_most_confident_drafts_fail(batch):
    """A draft confident of tokens the target rejects (the weak draft inside SGLang: 0.99
    confidences, 0.1 accepted) first teaches the calibration map so; then new requests are
    no longer measured at the configured prior (nor at a running prior that still lags
    above the map): no confidence can correct their estimate above the map's top, so that
    round (with its prompt's catch-up) never pays. Before, every newcomer drafted once (52
    rounds in 52 requests at C = 1, 1.25% of the run)."""
    rng = np.random.default_rng(7)
    work = SyntheticWorkload(rng, truth=lambda c: np.full_like(c, 0.03), concentration=30.0)
    policy = SpecServePolicy(COST, 8)
    mean = np.full(batch, 0.95)
    steps_drafting = []
    for wave in range(12):
        step = make_step(batch, ids=[f"w{wave}-{i}" for i in range(batch)])
        n = 0
        for _ in range(8):
            n += bool(drive_step(policy, step, work, mean).drafted.any())
        for rid in step.request_ids:
            policy.release(rid)
        steps_drafting.append(n)
    assert sum(steps_drafting[:4]) > 0  # it drafted while the map learnt
    assert policy.calibrator.top < policy.options.prior
    assert sum(steps_drafting[-4:]) == 0  # later newcomers are not measured
    assert policy.prior > policy.calibrator.top  # (the running prior, a mean, lags)


def test_specserve_verifier_trims_but_drafter_only_does_not():
    step = make_step(16)
    conf = np.tile([0.9, 0.8, 0.3, 0.1], (16, 1))
    drafted = np.full(16, 4)
    full = SpecServePolicy(COST, 8).plan(step).verify_lengths(conf, drafted)
    only = SpecServePolicy(COST, 8, verifier=False).plan(step).verify_lengths(conf, drafted)
    np.testing.assert_array_equal(only, drafted)
    assert np.all(full < drafted)


def test_specserve_releases_state():
    policy = SpecServePolicy(COST, 8)
    work = SyntheticWorkload(np.random.default_rng(0))
    step = make_step(4)
    drive_step(policy, step, work, np.full(4, 0.7))
    assert len(policy.history) == 4
    for rid in step.request_ids:
        policy.release(rid)
    assert len(policy.history) == 0


def test_empty_batch():
    step = make_step(0)
    for spec in POLICY_NAMES:
        plan = make_policy(spec, COST, k_max=8).plan(step)
        assert plan.drafting.shape == (0,)
        k = plan.verify_lengths(np.zeros((0, 0)), np.zeros(0, dtype=np.int64))
        assert k.shape == (0,)


@pytest.mark.parametrize("cost", [COST, KNEE_COST, SETUP_COST], ids=["linear", "knee", "setup"])
@pytest.mark.parametrize("seed", range(10))
def test_specserve_incremental_plan_matches_the_reference(seed, cost):
    """The drafter's running tokens / step time equal the non-incremental estimator, and
    the verifier's fast path (drafter state) equals the slow path (from confidences)."""
    rng = np.random.default_rng(seed)
    B = int(rng.integers(1, 48))
    step = make_step(
        B,
        context=rng.integers(10, 4000, B),
        lag=rng.integers(0, 3, B),
        slo=np.where(rng.random(B) < 0.5, 0.4, np.inf),
    )
    policy = SpecServePolicy(cost, 8, prior=float(rng.uniform(0.5, 0.95)))
    work = SyntheticWorkload(rng)
    mean = rng.uniform(0.3, 0.99, B)
    conf = np.full((B, 8), np.nan)
    drafted = np.zeros(B, dtype=np.int64)
    d = policy.plan(step)
    drafting = d.drafting
    j = 0
    while drafting.any() and j < 8:
        conf[drafting, j] = work.confidences(mean)[drafting]
        drafted += drafting
        j += 1
        drafting = d.extend(conf[:, :j], drafting)
    # the drafter's catch-up pricing: amortized without a binding SLO, real under one
    lag_cap = policy.options.lag_cap if binding_slo(step) == np.inf else None
    timer = StepTimer(cost, step, lag_cap=lag_cap)
    assert d.time == pytest.approx(timer.plan(drafted, drafted), rel=1e-9)
    P = chain_probs(policy.calibrator(conf[:, : max(j, 1)]))
    assert d.tokens == pytest.approx(B + P.sum(), rel=1e-9)
    if drafted.any():
        assert d.time <= binding_slo(step)
    assert d.j_done == j  # every drafted position went through extend
    fast = d.verify_lengths(conf[:, : max(j, 1)], drafted)
    slow = SpecServePolicy(cost, 8, calibrator=policy.calibrator).plan(step).verify_lengths(
        conf[:, : max(j, 1)], drafted
    )
    np.testing.assert_array_equal(fast, slow)


def test_specserve_sees_the_last_rounds_confidences():
    """Callers call extend after every draft round, the k_max-th included (it names no one to
    draft further): the verifier sees that position's real confidence."""
    B, k_max = 4, 3
    step = make_step(B, k_max=k_max)
    policy = SpecServePolicy(cpu_cost_model(), k_max, prior=0.99)
    conf = np.full((B, k_max), 0.99)
    d = policy.plan(step)
    drafting = d.drafting
    assert drafting.all()
    for j in (1, 2):
        drafting = d.extend(conf[:, :j], drafting)
    assert drafting.all()  # position 3 planned for everyone
    conf[:, 2] = 0.01  # ... and it came out hopeless
    assert not d.extend(conf, drafting).any()  # k_max reached: nobody drafts a 4th
    drafted = np.full(B, 3)
    k = d.verify_lengths(conf, drafted)
    assert d.j_done == 3
    assert d.tokens == pytest.approx(B + chain_probs(policy.calibrator(conf)).sum(), rel=1e-9)
    np.testing.assert_array_equal(k, [2, 2, 2, 2])  # the hopeless tail is trimmed


def test_slo_guard_learns_how_much_steps_overrun_the_cost_model():
    """Worst-case SLO rule: once speculative steps measured 1.5x their predicted time, a plan
    predicted to fit the SLO with less than that headroom is refused."""
    timer = StepTimer(COST, make_step(8))
    slo = 1.4 * timer.uniform(4)[1]  # k = 1 fits the SLO by 40% on the model (guard: 30%)
    step = make_step(8, slo=np.full(8, slo))
    policy = SpecServePolicy(COST, 4, prior=0.95, start_margin=0.0, initial_overrun=1.3)
    plan = policy.plan(step)
    assert plan.drafting.all()
    ones = np.ones(8, dtype=np.int64)
    predicted = StepTimer(COST, step).plan(ones, ones)
    policy.observe(plan, VerifyOutcome(drafted=ones, verified=ones, accepted=ones,
                                       confidences=np.full((8, 1), 0.9),
                                       step_time=1.5 * predicted, draft_time=0.0))
    assert policy.guard.scale == pytest.approx(1.5)
    step = make_step(8, slo=np.full(8, slo))
    later = policy.plan(step).drafting.astype(np.int64)
    assert later.sum() < 8  # the full k = 1 plan no longer fits SLO / 1.5 ...
    assert StepTimer(COST, step).plan(later, later) <= slo / 1.5  # ... a smaller one does
    assert policy.plan(make_step(8)).drafting.all()  # no SLO: speculation is still on


def test_slo_guard_assumes_the_worst_until_its_window_has_measured_the_machine():
    """By default the guard starts at 2x (the most it allows): a k = 1 plan that fits the
    SLO by 40% on the model waits until `overrun_window` steps have measured how far this
    machine's steps run over; they ran as predicted here, so it then speculates."""
    timer = StepTimer(COST, make_step(8))
    slo = 1.4 * timer.uniform(4)[1]
    policy = SpecServePolicy(COST, 4, prior=0.95, overrun_window=16)
    zeros = np.zeros(8, dtype=np.int64)
    for i in range(16):
        step = make_step(8, slo=np.full(8, slo))
        plan = policy.plan(step)
        assert not plan.drafting.any(), f"speculated at step {i}, before the window filled"
        policy.observe(plan, VerifyOutcome(drafted=zeros, verified=zeros, accepted=zeros,
                                           confidences=np.zeros((8, 0)),
                                           step_time=StepTimer(COST, step).plain,
                                           draft_time=0.0))
    assert policy.guard.scale == pytest.approx(1.0)
    assert policy.plan(make_step(8, slo=np.full(8, slo))).drafting.all()


def test_slo_guard_counts_plain_steps_that_run_long_but_not_prefill_steps():
    """A plain decode step that ran 1.6x its predicted time (the machine, not the plan) raises
    the guard as a speculative one would; a step carrying a prefill chunk does not."""
    slo = 10.0
    policy = SpecServePolicy(COST, 4, prior=0.95, start_margin=0.0, initial_overrun=1.0)
    zeros = np.zeros(8, dtype=np.int64)
    step = make_step(8, slo=np.full(8, slo))
    plain = StepTimer(COST, step).plain
    policy.observe(policy.plan(step), VerifyOutcome(drafted=zeros, verified=zeros,
                                                    accepted=zeros, confidences=np.zeros((8, 0)),
                                                    step_time=1.6 * plain, draft_time=0.0))
    assert policy.guard.scale == pytest.approx(1.6)
    prefill = dataclasses.replace(make_step(8, slo=np.full(8, slo)), prefill_tokens=64)
    fresh = SpecServePolicy(COST, 4, prior=0.95, start_margin=0.0, initial_overrun=1.0)
    fresh.observe(fresh.plan(prefill), VerifyOutcome(drafted=zeros, verified=zeros,
                                                     accepted=zeros, confidences=np.zeros((8, 0)),
                                                     step_time=3.0 * plain, draft_time=0.0))
    assert fresh.guard.scale == 1.0


@pytest.mark.parametrize("batch", [1, 12])  # the Python-float plan and the numpy one
def test_specserve_new_requests_of_a_hopeless_draft_stop_after_their_first_round(batch):
    """Where the running prior has fallen (requests before accepted little), a new request
    still drafts its first round at the configured prior (the test above), but its
    confidences then correct the running prior, not that floor: one whose draft agrees with
    nothing stops after that round instead of drafting on for several steps while its
    estimate sinks from 0.6 (the weak draft inside SGLang at C = 1 drafted ~4 steps a
    request so)."""
    rng = np.random.default_rng(3)
    work = SyntheticWorkload(rng, concentration=30.0)
    step = make_step(batch)
    policy = SpecServePolicy(COST, 8)
    policy.prior = 0.15  # the running prior after hopeless requests
    steps_drafting = np.zeros(batch)
    for _ in range(12):
        steps_drafting += drive_step(policy, step, work, np.full(batch, 0.05)).drafted > 0
    assert steps_drafting.min() >= 1  # each was measured once ...
    assert steps_drafting.max() == 1  # ... and that was enough
    # good newcomers on the same fallen prior still go on drafting (their first token
    # weighs as much as the prior: test_specserve_measures_new_requests_after_the_prior_fell)
    good = make_step(batch, ids=[f"g{i}" for i in range(batch)])
    policy.prior = 0.15
    drafted = [drive_step(policy, good, work, np.full(batch, 0.95)).drafted.sum()
               for _ in range(6)]
    assert min(drafted) >= batch


@pytest.mark.parametrize("small_batch", [8, 0])  # the Python-float plan and the numpy one
def test_specserve_newcomers_of_a_weak_draft_are_planned_at_its_pooled_acceptance(small_batch):
    """A weak draft whose few most confident tokens are accepted often enough that a round
    planned at the map's top pays, while its tokens are accepted at 0.07 overall (the
    weak draft inside SGLang on the AVX-512 EPYC: top 0.25, pooled 0.07). A newcomer's
    first round is a guess at a token whose confidence is not known yet: its expected
    acceptance is the pair's pooled one, not the best bin's. Planned at the top, every
    newcomer drafted a round that does not pay (1 in ~60 steps at C = 1, each 1.4x a plain
    step); floored at the pooled acceptance (not at the configured prior) once the map has
    learnt online, later newcomers start from the running prior and do not."""
    rng = np.random.default_rng(3)

    def truth(c: np.ndarray) -> np.ndarray:
        return np.where(c > 0.9, 0.3, 0.03)

    work = SyntheticWorkload(rng, truth=truth, concentration=8.0)
    policy = SpecServePolicy(COST, 8, small_batch=small_batch)
    batch = 1  # where a round at the top pays (COST: above ~0.18), at the pooled one not
    mean = np.full(batch, 0.5)
    first_rounds = []
    for wave in range(16):
        step = make_step(batch, ids=[f"w{wave}-{i}" for i in range(batch)])
        first_rounds.append(int(policy.plan(step).drafting.sum()))
        for _ in range(8):
            drive_step(policy, step, work, mean)
        for rid in step.request_ids:
            policy.release(rid)
    g = policy.calibrator
    assert g.online and g.pooled is not None and g.pooled < 0.15 and g.top > 2 * g.pooled
    assert sum(first_rounds[:2]) > 0  # the first newcomers are measured
    assert sum(first_rounds[-6:]) == 0  # later ones are not: 0.07 does not pay a round


@pytest.mark.parametrize("batch,small_batch", [(1, 8), (2, 0)])  # Python floats, numpy
def test_specserve_first_rounds_planned_at_first_tokens_not_at_where_chains_stopped(
        batch, small_batch):
    """Every request's confidences are i.i.d. around 0.6, so a step's first draft token has
    the same expected g(c) as any. A chain stops on a low token, and the running prediction
    pred (an EMA over every draft token) ends each step having absorbed it: planned at
    pred (first_estimate off), first rounds were planned ~5 points below what their tokens
    turned out to be. The first-token estimate (history.first) is planned within a point."""
    gap = {}
    for on in (True, False):
        rng = np.random.default_rng(23)
        work = SyntheticWorkload(rng, concentration=3.0)
        policy = SpecServePolicy(COST, 8, first_estimate=on, small_batch=small_batch)
        step = make_step(batch)
        mean = np.full(batch, 0.6)
        planned, got = [], []
        for i in range(300):
            first = np.asarray(policy.plan(step).first_predictions(), dtype=float).copy()
            o = drive_step(policy, step, work, mean)  # (plans the same step again, alike)
            if i >= 20:  # past the newcomers' first rounds
                d = o.drafted > 0
                planned += first[d].tolist()
                got += policy.g(o.confidences[d, 0]).tolist()
        assert len(planned) > 200
        gap[on] = float(np.mean(got) - np.mean(planned))
    assert abs(gap[True]) < 0.01, gap
    assert gap[False] > 0.03, gap
