"""A SpecServe plan driven by a minimal caller with no engine and no model, the way an SGLang
worker drives it: the caller keeps its own batch (request ids, context lengths, per-request
SLOs), a stand-in draft model (fixed per-request confidences) and a stand-in verifier
(acceptance drawn from those confidences), and talks to the policy only through
sloserve.speculation: plan -> extend after every round -> verify_lengths -> observe."""

from __future__ import annotations

import numpy as np

from sloserve.bench.synthetic import cpu_cost_model
from sloserve.estimator.step_time import StepTimer
from sloserve.policies.registry import make_policy
from sloserve.speculation import SpecPolicy, StepInfo, VerifyOutcome

COST = cpu_cost_model()


class FakeWorker:
    """A decode batch that advances by accepted + 1 tokens a step."""

    def __init__(self, policy: SpecPolicy, k_max: int, seed: int = 0) -> None:
        self.policy, self.k_max = policy, k_max
        self.rng = np.random.default_rng(seed)
        self.ctx: dict[str, int] = {}
        self.slo: dict[str, float] = {}
        self.quality: dict[str, float] = {}  # the draft's confidence for this request
        self.drafted_per_step: list[float] = []

    def add(self, rid: str, prompt: int, quality: float, slo: float = np.inf) -> None:
        self.ctx[rid], self.quality[rid], self.slo[rid] = prompt, quality, slo

    def finish(self, rid: str) -> None:
        del self.ctx[rid], self.slo[rid], self.quality[rid]
        self.policy.release(rid)

    def step(self) -> VerifyOutcome:
        rids = list(self.ctx)
        B = len(rids)
        step = StepInfo(rids, np.array([self.ctx[r] for r in rids]),
                        np.array([self.slo[r] for r in rids]), self.k_max,
                        draft_lag=np.ones(B, dtype=np.int64))
        plan = self.policy.plan(step)
        quality = np.array([self.quality[r] for r in rids])
        conf = np.full((B, self.k_max), np.nan)
        drafting, j = plan.drafting.copy(), 0
        while j < self.k_max and drafting.any():
            conf[drafting, j] = quality[drafting]  # the "draft forward"
            j += 1
            nxt = plan.extend(conf[:, :j], drafting)
            assert not np.any(nxt & ~drafting)  # a subset of who drafted
            drafting = nxt
        drafted = np.isfinite(conf).sum(axis=1)
        s = int(drafted.max(initial=0))
        verified = plan.verify_lengths(conf[:, :s], drafted) if s else drafted
        assert np.all((0 <= verified) & (verified <= drafted))
        # the "target": position j accepted with probability quality, until a rejection
        ok = self.rng.random((B, max(s, 1))) < quality[:, None]
        ok &= np.arange(max(s, 1))[None, :] < verified[:, None]
        accepted = np.argmin(np.concatenate([ok, np.zeros((B, 1), bool)], 1), axis=1)
        step_time = StepTimer(COST, step).plan(drafted, verified)
        outcome = VerifyOutcome(drafted, np.asarray(verified), accepted, conf[:, :s],
                                step_time, 0.0, None)
        self.policy.observe(plan, outcome)
        for r, a in zip(rids, accepted.tolist()):
            self.ctx[r] += a + 1
        self.drafted_per_step.append(float(drafted.mean()) if B else 0.0)
        return outcome


def test_a_fake_caller_drives_specserve_and_it_adapts():
    policy = make_policy("specserve", COST, k_max=6)
    w = FakeWorker(policy, k_max=6)
    w.add("sure", 200, quality=0.95)
    w.add("hopeless", 200, quality=0.1)
    got = [w.step() for _ in range(30)]
    late = np.sum([o.drafted for o in got[10:]], axis=0)
    assert late[0] > 2 * max(late[1], 1)  # the predictable request drafts far more
    # more requests: less speculation per request (the verify forward gets dearer)
    alone = float(np.mean(w.drafted_per_step[10:]))
    for i in range(30):
        w.add(f"more{i}", 200, quality=0.95)
    crowded = [w.step().drafted.mean() for _ in range(15)]
    assert np.mean(crowded[5:]) < alone
    # a request whose TPOT SLO is below a speculative step's time turns speculation off
    # for the whole batch it is in
    plain = StepTimer(COST, StepInfo(list(w.ctx), np.array(list(w.ctx.values())),
                                     np.full(len(w.ctx), np.inf), 6)).plain
    w.add("tight", 200, quality=0.95, slo=1.05 * plain)
    assert all(w.step().drafted.sum() == 0 for _ in range(5))
    w.finish("tight")
    for rid in list(w.ctx):
        w.finish(rid)
    assert len(policy.history) == 0  # every request's state released


def test_every_policy_serves_the_fake_caller():
    for spec in ("ar", "fixed:3", "hf-threshold", "goodput", "lut", "sglang-adaptive",
                 "specserve-drafter", "specserve"):
        w = FakeWorker(make_policy(spec, COST, k_max=4), k_max=4, seed=1)
        for i in range(5):
            w.add(f"r{i}", 100 + 50 * i, quality=0.5 + 0.1 * i)
        for _ in range(10):
            o = w.step()
            assert o.drafted.max() <= 4


class StepLevelWorker(FakeWorker):
    """A caller that fixes one draft length for the batch before drafting and never learns
    the draft tokens' confidences (SGLang's speculative workers): batch_rounds, then
    observe with [B, 0] confidences."""

    def step(self) -> VerifyOutcome:
        rids = list(self.ctx)
        B = len(rids)
        step = StepInfo(rids, np.array([self.ctx[r] for r in rids]),
                        np.array([self.slo[r] for r in rids]), self.k_max,
                        draft_lag=np.ones(B, dtype=np.int64))
        plan = self.policy.plan(step)
        k = plan.batch_rounds()
        quality = np.array([self.quality[r] for r in rids])
        drafted = np.full(B, k, dtype=np.int64)
        ok = self.rng.random((B, max(k, 1))) < quality[:, None]
        ok &= np.arange(max(k, 1))[None, :] < k
        accepted = np.argmin(np.concatenate([ok, np.zeros((B, 1), bool)], 1), axis=1)
        outcome = VerifyOutcome(drafted, drafted.copy(), accepted, np.zeros((B, 0)),
                                StepTimer(COST, step).plan(drafted, drafted), 0.0, None)
        self.policy.observe(plan, outcome)
        for r, a in zip(rids, accepted.tolist()):
            self.ctx[r] += a + 1
        self.drafted_per_step.append(float(k))
        return outcome


def test_a_step_level_caller_gets_one_draft_length_that_follows_load_and_acceptance():
    def mean_k(n: int, quality: float, steps: int = 40) -> float:
        w = StepLevelWorker(make_policy("specserve", COST, k_max=6), k_max=6, seed=n)
        for i in range(n):
            w.add(f"r{i}", 300, quality=quality)
        for _ in range(steps):
            w.step()
        return float(np.mean(w.drafted_per_step[steps // 2:]))

    one, sixteen = mean_k(1, 0.9), mean_k(16, 0.9)
    assert one > sixteen and one >= 2  # speculation falls as the batch grows
    assert mean_k(1, 0.9) > mean_k(1, 0.2)  # ... and rises with the observed acceptance
    # the predictions were learned from accepted counts alone
    w = StepLevelWorker(make_policy("specserve", COST, k_max=6), k_max=6)
    w.add("a", 300, quality=0.95)
    for _ in range(30):
        w.step()
    assert w.policy.history.values[w.policy.history.slots(["a"], fill=0.0)][0] > 0.8


def test_batch_rounds_respects_the_slo():
    policy = make_policy("specserve", COST, k_max=6)
    step = StepInfo(["a"], np.array([300]), np.array([np.inf]), 6)
    timer = StepTimer(COST, step)
    assert policy.plan(step).batch_rounds() > 0
    # an SLO between plain decoding and k = 1 (guard at 2x until measured: halve it)
    tight = 2.0 * (timer.plain + 0.5 * (timer.uniform(1)[1] - timer.plain))
    step = StepInfo(["a"], np.array([300]), np.array([tight]), 6)
    assert policy.plan(step).batch_rounds() == 0
