"""One step of speculation as a session (sloserve.speculation.SpecSession): the same policy
driven by a pull caller (the built-in engine's and the simulator's loop,
runtime/drafter/rounds.py draft_rounds) and by a push caller shaped like SGLang's worker
(sglang_ext/controller.py: its batch drafts every row each round and asks after each)
makes the same decisions and learns the same outcomes; and the request SLO reader."""

from __future__ import annotations

import types

import numpy as np
import pytest

from sloserve.bench.synthetic import cpu_cost_model
from sloserve.policies.registry import make_policy
from sloserve.runtime.drafter.rounds import DraftRound, draft_rounds
from sloserve.sglang_ext.controller import StepController
from sloserve.slo import effective_slo, request_slos, slo_array, stated_slo, valid_slo
from sloserve.speculation import SpecSession, StepInfo

COST = cpu_cost_model()
K_MAX = 4
B = 5


def _conf(step: int) -> np.ndarray:
    """[B, K_MAX] the draft's confidences of step `step` (deterministic, varied)."""
    rng = np.random.default_rng(100 + step)
    return rng.uniform(0.05, 0.99, size=(B, K_MAX))


def _accepted(conf: np.ndarray, verified: np.ndarray) -> np.ndarray:
    """Leading drafts with confidence above 0.5, at most the verified ones."""
    ok = conf > 0.5
    lead = np.array([int(np.argmin(np.append(row, False))) for row in ok])
    return np.minimum(lead, verified)


class _Source:
    """A pull caller's draft source: row r's j-th proposal has confidence conf[r, j]."""

    kind = "model"

    def __init__(self, conf: np.ndarray, index: dict[str, int]) -> None:
        self.conf, self.index = conf, index

    def step(self, reqs, drafts):
        j = drafts.shape[1]
        rows = [self.index[r.rid] for r in reqs]
        return DraftRound(tokens=[7] * len(rows), conf=self.conf[rows, j].tolist())

    def release(self, rid: str) -> None:
        pass


def _pull(spec: str, steps: int) -> list[tuple]:
    policy = make_policy(spec, COST, k_max=K_MAX)
    rids = [f"r{i}" for i in range(B)]
    reqs = [types.SimpleNamespace(rid=r) for r in rids]
    lens = np.full(B, 300)
    out = []
    for n in range(steps):
        info = StepInfo(rids, lens - 1, slo_array([None] * B, None), K_MAX,
                        draft_lag=np.ones(B, dtype=np.int64))
        conf = _conf(n)
        res = draft_rounds(_Source(conf, {r: i for i, r in enumerate(rids)}),
                           SpecSession(policy, info), reqs)
        s = res.session
        acc = _accepted(conf, s.verified)
        o = s.finish(acc, step_time=0.05, draft_time=0.01)
        out.append((s.rounds, o.drafted.tolist(), o.verified.tolist(), o.accepted.tolist()))
        lens = lens + o.accepted + 1
    return out


def _push(spec: str, steps: int) -> list[tuple]:
    ctl = StepController(make_policy(spec, COST, k_max=K_MAX), K_MAX, per_request=True)
    rids = [f"r{i}" for i in range(B)]
    lens = np.full(B, 300)
    out = []
    for n in range(steps):
        step = ctl.begin(rids, lens.tolist(), [None] * B)  # SGLang-shaped: before drafting
        conf = _conf(n)
        rounds = 0
        while rounds < step.prepared:  # SGLang's draft loop: every row drafts each round
            more = ctl.after_round(step, conf[:, rounds])
            rounds += 1
            if not more:
                break
        k = ctl.verify_lengths(step)
        o = ctl.finish(step, _accepted(conf, k).tolist(), now=step.started + 0.05)
        assert o is not None
        out.append((step.rounds, o.drafted.tolist(), o.verified.tolist(),
                    o.accepted.tolist()))
        lens = lens + o.accepted + 1
    return out


@pytest.mark.parametrize("spec", ["fixed:3", "lut", "hf-threshold", "hf-heuristic",
                                  "goodput", "adaserve", "specserve", "specserve-slo"])
def test_pull_and_push_callers_make_the_same_decisions(spec):
    pull, push = _pull(spec, 12), _push(spec, 12)
    assert pull == push
    assert any(d for _, d, _, _ in pull) or spec == "goodput"


def test_every_plan_answers_one_length_per_batch():
    info = StepInfo(["a", "b"], np.array([100, 100]), np.full(2, np.inf), K_MAX)
    for spec in ["ar", "fixed:3", "lut", "hf-threshold", "hf-heuristic", "goodput",
                 "sglang-adaptive", "adaserve", "specserve-drafter", "specserve",
                 "specserve-slo"]:
        s = SpecSession(make_policy(spec, COST, k_max=K_MAX), info)
        k = s.batch_rounds()
        assert 0 <= k <= K_MAX and s.rounds == k and (s.drafted == k).all()
        o = s.finish([k, 0], step_time=0.05, draft_time=0.01)
        assert o.verified.tolist() == [k, k] and o.confidences.shape == (2, 0)
    assert SpecSession(make_policy("fixed:3", COST, k_max=K_MAX), info).batch_rounds() == 3


def test_a_trimmed_step_drafts_the_batch_length_and_verifies_what_the_plan_keeps():
    """A push caller that fixes one length for the batch (SGLang's uniform steps) and hands
    the chain's confidences over once drafted (--spec-lengths trim): every request drafts
    batch_rounds() tokens, each verifies the plan's verifier's choice on those confidences
    (the elimination of a plan told the chain at once), the policy observes them, and its
    calibration learns from them while the predictions learn from the accepted counts."""
    policy = make_policy("specserve", COST, k_max=K_MAX)
    ctl = StepController(policy, K_MAX, trim=True)
    rids = [f"r{i}" for i in range(B)]
    lens = np.full(B, 300)
    trimmed = 0
    for n in range(40):
        step = ctl.begin(rids, lens.tolist(), [None] * B)
        k = step.prepared
        conf = _conf(n)[:, :k]
        conf[n % B] *= 0.1  # one request's chain far less likely than the others'
        if k:
            ctl.chain_drafted(step, conf)
            assert step.ragged and not step.per_request
        want = (step.session.plan.verify_lengths(conf, np.full(B, k)) if k
                else np.zeros(B, dtype=np.int64))
        got = ctl.verify_lengths(step)
        assert got.tolist() == np.minimum(want, k).tolist()
        assert (step.session.drafted == k).all() and (got <= k).all()
        trimmed += int((got < k).sum())
        o = ctl.finish(step, _accepted(conf, got).tolist(), now=step.started + 0.05)
        assert o is not None and o.confidences.shape == (B, k)
        lens = lens + o.accepted + 1
    assert trimmed > 0  # the unlikely tails went
    assert policy.calibrator.counts.sum() > 0  # g learned from the told confidences
    # a uniform step without confidences verifies everything drafted
    plain = StepController(make_policy("specserve", COST, k_max=K_MAX), K_MAX)
    step = plain.begin(rids, lens.tolist(), [None] * B)
    assert not step.ragged and (plain.verify_lengths(step) == step.prepared).all()
    with pytest.raises(RuntimeError):  # per-request steps are steered round by round
        SpecSession(policy, StepInfo(rids, lens, np.full(B, np.inf), K_MAX)).chain_drafted(
            np.zeros((B, 1)))


def test_a_looked_up_chain_is_verified_as_the_plan_keeps_it_and_nothing_is_plain():
    """A drafter without a forward (prompt lookup) hands the whole chain over before the
    step (SGLang's n-gram steps): the plan's verifier picks k_r at once (no proposal: 0),
    the step prepares max k_r rounds, and where verifying anything costs more than it
    brings (the verify path's fixed cost, CostModel.verify_fixed) it prepares none."""
    import dataclasses

    cost = dataclasses.replace(COST.without_draft(), verify_fixed=0.0)
    policy = make_policy("specserve", cost, k_max=K_MAX)
    ctl = StepController(policy, K_MAX, trim=True)
    rids = [f"r{i}" for i in range(B)]
    lens = np.full(B, 300)
    conf = np.full((B, K_MAX), 0.95)
    conf[0, :] = np.nan  # no match
    conf[1, 2:] = np.nan  # two proposals
    step = ctl.begin(rids, lens.tolist(), [None] * B)
    rounds = ctl.looked_up(step, conf.copy())
    k = ctl.verify_lengths(step)
    assert rounds == int(k.max()) > 0 and step.prepared == rounds
    assert k[0] == 0 and k[1] <= 2 and (k <= step.session.drafted).all()
    assert (step.session.drafted <= rounds).all() and step.ragged
    o = ctl.finish(step, np.minimum(k, 1).tolist(), now=step.started + 0.05)
    assert o is not None and o.verified.tolist() == k.tolist()
    # the same chain where verifying costs a fixed 3 plain steps: nothing is verified
    dear = dataclasses.replace(cost, verify_fixed=3 * 0.05)
    ctl = StepController(make_policy("specserve", dear, k_max=K_MAX), K_MAX, trim=True)
    step = ctl.begin(rids, lens.tolist(), [None] * B)
    low = np.where(np.isnan(conf), np.nan, 0.3)
    assert ctl.looked_up(step, low) == 0 and step.prepared == 0 and not step.ragged
    assert ctl.verify_lengths(step).tolist() == [0] * B


@pytest.mark.parametrize("spec, want", [("fixed:2", 2), ("lut:1=0", 0), ("ar", 0)])
def test_a_looked_up_chain_is_verified_no_longer_than_a_length_policy_says(spec, want):
    """Prompt lookup hands over its whole chain (K_MAX proposals) before the step: a policy
    of fixed lengths verifies its own length of it, not the chain (`--drafter ngram
    --spec-policy fixed:2` verified all 4; `lut:1=0` drafted on every step)."""
    ctl = StepController(make_policy(spec, COST, k_max=K_MAX), K_MAX, trim=True)
    rids = [f"r{i}" for i in range(B)]
    conf = np.full((B, K_MAX), 0.9)
    conf[1, 1:] = np.nan  # one proposal
    step = ctl.begin(rids, [300] * B, [None] * B)
    assert ctl.looked_up(step, conf) == want == step.prepared
    k = ctl.verify_lengths(step)
    assert k[1] == min(1, want) and (np.delete(k, 1) == want).all()


def test_a_session_finishes_once():
    info = StepInfo(["a"], np.array([10]), np.full(1, np.inf), K_MAX)
    s = SpecSession(make_policy("fixed:2", COST, k_max=K_MAX), info)
    s.after_round([0.9])
    assert not s.after_round([0.8]).any() and s.verify_lengths().tolist() == [2]
    s.finish([1], 0.05, 0.01)
    with pytest.raises(RuntimeError):
        s.finish([1], 0.05, 0.01)


def test_request_slo_spellings():
    assert stated_slo({"tpot_slo": 0.03}, "tpot_slo") == 0.03
    assert stated_slo({"custom_params": {"tpot_slo": 0.02}}, "tpot_slo") == 0.02
    assert stated_slo(types.SimpleNamespace(tpot_slo=None, custom_params={"tpot_slo": 1}),
                      "tpot_slo") == 1
    assert stated_slo({"tpot_slo": 0.03, "custom_params": {"tpot_slo": 0.5}},
                      "tpot_slo") == 0.03
    assert request_slos({"custom_params": {"ttft_slo": 2, "x": 1}}) == {
        "tpot_slo": None, "ttft_slo": 2, "custom_params": {"x": 1}}
    assert request_slos({"custom_params": {"tpot_slo": 1}})["custom_params"] is None
    assert [valid_slo(v) for v in (0.03, 0, -1, "1", True, float("inf"))] == [
        0.03, None, None, None, None, None]
    assert effective_slo(None, 0.05) == 0.05 and effective_slo(0.02, 0.05) == 0.02
    assert effective_slo(None, None) == float("inf")
