"""Acceptance (speculative 1): greedy speculative output equals plain greedy output token for
token, for fixed k, random per-request verify lengths (including 0), batch sizes 1..32 with
staggered arrivals, preemption, the n-gram drafter, and stops inside accepted runs."""

from __future__ import annotations

import numpy as np
import pytest
from sloserve_testing import prompts_of_lengths

from sloserve.runtime.request import SamplingParams, Status
from sloserve.speculation import SpecPlan, SpecPolicy, StepInfo


class RandomPlan(SpecPlan):
    """Drafts a random subset, stops drafting at random, verifies a random prefix (0 allowed)."""

    def __init__(self, step: StepInfo, rng: np.random.Generator):
        self.step, self.rng = step, rng
        self.drafting = rng.random(step.batch_size) < 0.8

    def extend(self, confidences, drafting):
        return drafting & (self.rng.random(self.step.batch_size) < 0.75)

    def verify_lengths(self, confidences, drafted):
        return np.array([self.rng.integers(0, d + 1) for d in drafted], dtype=np.int64)


class RandomPolicy(SpecPolicy):
    name = "random"

    def __init__(self, seed: int):
        self.rng = np.random.default_rng(seed)

    def plan(self, step: StepInfo) -> SpecPlan:
        return RandomPlan(step, self.rng)


def _run(eng, prompts, n, per_step=4, **kw):
    reqs, pending = [], list(prompts)
    while pending or eng.has_work:
        for p in pending[:per_step]:
            reqs.append(eng.add_request(p, SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True, **kw)))
        pending = pending[per_step:]
        eng.step()
    assert all(r.status is Status.FINISHED for r in reqs)
    return [r.output_ids for r in reqs]


@pytest.fixture(scope="module")
def prompts():
    return prompts_of_lengths([5 + (i * 7) % 31 for i in range(32)], seed=11)


@pytest.fixture
def reference(make_engine, prompts):
    return _run(make_engine(spec_policy="ar"), prompts, 24)


def _check_exercised(eng):
    s = eng.stats
    assert s.verified > 0 and 0 < s.accepted < s.verified, "test must see accepts and rejects"


@pytest.mark.parametrize("k", [1, 3, 5, 8])
def test_fixed_k_equals_greedy(make_engine, prompts, reference, k):
    eng = make_engine(spec_policy=f"fixed:{k}")
    assert _run(eng, prompts, 24) == reference
    _check_exercised(eng)


def test_random_verify_lengths_equal_greedy(make_engine, prompts, reference):
    eng = make_engine(spec_policy="fixed:1", k_max=6)
    eng.runner.policy = RandomPolicy(seed=3)
    assert _run(eng, prompts, 24) == reference
    _check_exercised(eng)
    assert eng.stats.chosen_k[0] > 0  # some requests verified nothing while others did


@pytest.mark.parametrize("batch", [1, 2, 7, 16, 32])
def test_batch_sizes_staggered(make_engine, prompts, reference, batch):
    eng = make_engine(spec_policy="fixed:4", max_running=batch)
    assert _run(eng, prompts, 24, per_step=3) == reference


def test_preemption_with_speculation(make_engine, prompts, reference):
    eng = make_engine(spec_policy="fixed:3", kv_cache_tokens=320, max_step_tokens=96)
    assert _run(eng, prompts, 24, per_step=8) == reference
    assert eng.stats.preemptions > 0


def test_ngram_drafter_equals_greedy(make_engine, reference, prompts):
    # repetitive prompts so prompt lookup finds matches
    rep = [(p[:6] * 6)[: 10 + i] for i, p in enumerate(prompts[:12])]
    ref = _run(make_engine(spec_policy="ar"), rep, 24)
    eng = make_engine(spec_policy="fixed:4", drafter="ngram")
    assert _run(eng, rep, 24) == ref
    assert eng.parts.draft is None and eng.stats.verified > 0


def test_stops_inside_accepted_runs(make_engine, prompts):
    """A stop token, a stop string or EOS that falls inside an accepted run ends the request
    exactly where plain decoding would."""
    plain = make_engine(spec_policy="ar")
    spec = make_engine(spec_policy="fixed:8")
    full = _run(plain, prompts[:8], 30)
    stop_ids = tuple({f[12] for f in full})
    assert _run(spec, prompts[:8], 30, stop_token_ids=stop_ids) == _run(plain, prompts[:8], 30, stop_token_ids=stop_ids)
    texts = [plain.tokenizer.decode(f) for f in full]
    stops = tuple(t[8:11] for t in texts if t[8:11].strip())
    a = [plain.add_request(p, SamplingParams(max_new_tokens=30, temperature=0.0, ignore_eos=True, stop=stops)) for p in prompts[:8]]
    b = [spec.add_request(p, SamplingParams(max_new_tokens=30, temperature=0.0, ignore_eos=True, stop=stops)) for p in prompts[:8]]
    while plain.has_work or spec.has_work:
        plain.step()
        spec.step()
    assert [r.output_text for r in a] == [r.output_text for r in b]
    assert [r.output_ids for r in a] == [r.output_ids for r in b]
    assert sum(r.finish_reason.value == "stop" for r in b) >= 4
    # EOS inside an accepted run
    for e in (plain, spec):
        e.runner.eos = frozenset(stop_ids)
    assert _run(spec, prompts[:8], 30) == _run(plain, prompts[:8], 30)


from sloserve.policies.registry import POLICY_NAMES  # noqa: E402


@pytest.mark.parametrize("policy", POLICY_NAMES)
def test_every_policy_keeps_greedy_output(make_engine, prompts, reference, policy):
    """Controller acceptance 2: the same equivalence for every registered policy, with an SLO
    so the SLO-aware paths run too."""
    eng = make_engine(spec_policy=policy, tpot_slo=0.05)
    assert _run(eng, prompts, 24) == reference


@pytest.mark.parametrize("policy", ["specserve", "goodput", "hf-threshold"])
def test_policies_with_ngram_drafter_keep_greedy_output(make_engine, prompts, policy):
    rep = [(p[:5] * 8)[: 12 + i] for i, p in enumerate(prompts[:10])]
    ref = _run(make_engine(spec_policy="ar"), rep, 20)
    assert _run(make_engine(spec_policy=policy, drafter="ngram"), rep, 20) == ref


def test_greedy_requests_batched_with_sampling_ones(make_engine, prompts, reference):
    """Greedy and sampling requests in the same draft forwards: the greedy ones still equal
    plain greedy, and the sampling ones (their draft distributions kept for the acceptance
    rule) finish."""
    eng = make_engine(spec_policy="fixed:3")
    greedy = SamplingParams(max_new_tokens=24, temperature=0.0, ignore_eos=True)
    reqs = []
    for i, p in enumerate(prompts[:16]):
        params = greedy if i % 2 == 0 else SamplingParams(
            max_new_tokens=24, temperature=0.8, seed=i, ignore_eos=True)
        reqs.append(eng.add_request(p, params))
    while eng.has_work:
        eng.step()
    assert all(r.status is Status.FINISHED and len(r.output_ids) == 24 for r in reqs)
    assert [r.output_ids for r in reqs[::2]] == reference[:16:2]
    _check_exercised(eng)
    # the greedy rows' drafts are the draft model's argmax (not, e.g., another row's token):
    # they are accepted as often as in an all-greedy batch
    solo = make_engine(spec_policy="fixed:3")
    _run(solo, prompts[:16:2], 24, per_step=8)
    rate = sum(r.spec.accepted for r in reqs[::2]) / sum(r.spec.verified for r in reqs[::2])
    assert rate == pytest.approx(solo.stats.accepted / solo.stats.verified, abs=0.05)


class RecordingPolicy(RandomPolicy):
    """RandomPolicy that keeps the outcomes the engine reports."""

    def __init__(self, seed: int):
        super().__init__(seed)
        self.outcomes = []

    def observe(self, plan, outcome):
        self.outcomes.append(outcome)


def test_engine_reports_the_measured_parts_of_a_step(make_engine, prompts):
    """Every outcome carries the step's measured draft and target-forward seconds, and they
    fit inside the step (the online cost correction splits the step on them)."""
    eng = make_engine(spec_policy="fixed:1", k_max=4)
    eng.runner.policy = policy = RecordingPolicy(seed=5)
    _run(eng, prompts[:8], 8)
    assert policy.outcomes
    for o in policy.outcomes:
        assert o.verify_time is not None and 0.0 < o.verify_time
        assert o.draft_time + o.verify_time <= o.step_time
