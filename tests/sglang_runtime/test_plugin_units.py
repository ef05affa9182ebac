"""The SGLang-free parts of sloserve's SGLang plugin, in the main environment: the step
controller the SPECSERVE worker drives, the adapter SGLang's AdaptiveController calls, the
request SLO field, and the launch command `--engine sglang` builds."""

from __future__ import annotations

import json
import types

import numpy as np
import pytest

from sloserve.bench.synthetic import cpu_cost_model
from sloserve.estimator.step_time import StepTimer
from sloserve.policies.registry import make_policy
from sloserve.sglang_plugin import settings
from sloserve.sglang_plugin.controller import SGLangStepsPolicy, StepController
from sloserve.sglang_plugin.launch import sglang_args
from sloserve.speculation import StepInfo

COST = cpu_cost_model()


def _controller(k_max: int = 4, slo: float | None = None) -> StepController:
    return StepController(make_policy("specserve", COST, k_max=k_max), k_max, slo)


def _run(ctl: StepController, n: int, accept: float, steps: int, seed: int = 0) -> list[int]:
    """Decode steps of n requests whose drafts are each accepted with probability `accept`,
    each taking the cost model's time; the draft lengths chosen."""
    rng = np.random.default_rng(seed)
    rids = [f"r{i}" for i in range(n)]
    lens = [300] * n
    ks = []
    for _ in range(steps):
        k = ctl.decide(rids, lens, [None] * n)
        ok = rng.random((n, max(k, 1))) < accept
        correct = [int(np.argmin(np.append(row[:k], False))) for row in ok]
        d = ctl.pending
        timer = StepTimer(COST, d.plan.step)
        ctl.feedback(correct, now=d.started + timer.plan(np.full(n, k), np.full(n, k)))
        lens = [x + c + 1 for x, c in zip(lens, correct)]
        ks.append(k)
    return ks


def test_draft_length_follows_batch_size_and_acceptance():
    one = np.mean(_run(_controller(), 1, 0.7, 40)[20:])
    many = np.mean(_run(_controller(), 16, 0.7, 40)[20:])
    poor = np.mean(_run(_controller(), 1, 0.1, 40)[20:])
    assert one > many and one > poor and one >= 2


def test_a_request_slo_below_a_speculative_step_turns_speculation_off():
    ctl = _controller()
    step = StepInfo(["a", "b"], np.array([299, 299]), np.full(2, np.inf), 4)
    plain = StepTimer(COST, step).plain
    assert ctl.decide(["a", "b"], [300, 300], [None, None]) > 0
    ctl.feedback([1, 1])
    assert ctl.decide(["a", "b"], [302, 302], [None, 1.1 * plain]) == 0
    ctl.feedback([0, 0])


def test_per_request_steps_are_reported_once_and_dropped_at_finish():
    ctl = _controller()
    ks = _run(ctl, 2, 0.8, 5)
    assert ctl.take_steps("r0", finished=False) == ks
    assert ctl.take_steps("r0", finished=False) == []
    _run(ctl, 2, 0.8, 2, seed=1)
    assert len(ctl.take_steps("r1", finished=True)) == 7
    assert "r1" not in ctl.requests
    ctl.release_policy("r0")
    ctl.release_policy("r1")
    assert len(ctl.policy.history) == 0


def test_feedback_without_a_decision_is_ignored():
    ctl = _controller()
    ctl.feedback([1, 2])  # an idle or prefill batch: nothing planned
    k = ctl.decide(["a"], [10], [None])
    ctl.feedback([0, 0])  # a batch of another size than planned
    assert ctl.pending is None and "a" not in ctl.requests and k >= 0


def test_adapter_switches_to_the_decided_state():
    ctl = _controller(k_max=3)
    adapter = SGLangStepsPolicy(ctl)
    assert adapter.candidate_steps == [0, 1, 2, 3]
    adapter.set_cuda_graph_bs([1, 2, 4])
    assert adapter.cuda_graph_bs_for_step(2) == [1, 2, 4]
    k = ctl.decide(["a"], [50], [None])
    assert adapter.get_steps_for_batch(1) == k
    assert adapter.on_verify_complete([k], 1) is None


@pytest.mark.parametrize("value, want", [(0.03, 0.03), (30, 30.0), (0, None), (-1, None),
                                         ("0.03", None), (True, None), (float("inf"), None)])
def test_request_slo_from_custom_params(value, want):
    sp = types.SimpleNamespace(custom_params={"tpot_slo": value})
    assert settings.request_tpot_slo(sp) == want
    assert settings.request_tpot_slo(types.SimpleNamespace(custom_params=None)) is None


def test_launch_command_for_the_built_in_pair_on_cpu(monkeypatch):
    monkeypatch.setattr("sloserve.sglang_plugin.launch.cuda_available", lambda: False)
    cmd, env = sglang_args(["--tpot-slo", "30ms", "--port", "31234", "--log-level", "warning"])
    assert cmd[1:3] == ["-m", "sglang.launch_server"]
    args = " ".join(cmd)
    for part in ("--speculative-algorithm SPECSERVE", "--speculative-num-steps 4",
                 "--speculative-num-draft-tokens 5", "--speculative-eagle-topk 1",
                 "--disable-overlap-schedule", "--device cpu", "--attention-backend intel_amx",
                 "--port 31234", "--log-level warning"):
        assert part in args
    assert float(env[settings.ENV_TPOT_SLO]) == pytest.approx(0.03)
    assert env["SGLANG_USE_CPU_ENGINE"] == "1" and "cpu_shim" in env["PYTHONPATH"]
    plain, _ = sglang_args(["--spec-policy", "ar"])
    assert "--speculative-algorithm" not in plain and "--disable-overlap-schedule" not in plain


def _per_request_step(ctl: StepController, rids: list[str], lens: list[int],
                      conf: np.ndarray) -> tuple[int, np.ndarray]:
    """One per-request step with the given [B, k_max] confidences: rounds drafted, k_r."""
    k = ctl.begin(rids, lens, [None] * len(rids))
    rounds = 0
    while k and rounds < k and ctl.after_round(conf[:, rounds]):
        rounds += 1
    return ctl.pending.k if k else 0, ctl.verify_lengths()


def test_per_request_step_stops_drafting_and_trims_lowest_chain_probabilities():
    ctl = _controller(k_max=4)
    rids = [f"r{i}" for i in range(6)]
    confident = np.full((6, 4), 0.97)
    confident[3:] = 0.02  # three requests whose draft the target will hardly accept
    for _ in range(30):  # learn the calibration: confident drafts accepted, the others not
        rounds, k = _per_request_step(ctl, rids, [300] * 6, confident)
        d = ctl.pending
        accepted = np.where(np.arange(6) < 3, k, 0)
        ctl.feedback(accepted.tolist())
    rounds, k = _per_request_step(ctl, rids, [300] * 6, confident)
    d = ctl.pending
    assert 1 <= rounds <= 4 and (d.drafted <= rounds).all() and (k <= d.drafted).all()
    assert k[:3].min() > k[3:].max()  # the unlikely drafts go first
    P = d.plan.P[:rounds].T
    kept = [P[r, j] for r in range(6) for j in range(k[r])]
    trimmed = [P[r, j] for r in range(6) for j in range(k[r], d.drafted[r])]
    assert not trimmed or max(trimmed) <= min(kept)
    ctl.feedback([int(x) for x in k[:3]] + [0, 0, 0])
    assert ctl.take_steps("r0", finished=False)[-1] == k[0]


def test_forced_lengths_are_a_test_setting_that_drafts_k_max():
    ctl = StepController(make_policy("specserve", COST, k_max=4), 4, forced_lengths=(0, 4, 2))
    rids = ["a", "b", "c", "d"]
    rounds, k = _per_request_step(ctl, rids, [50] * 4, np.full((4, 4), 0.5))
    assert rounds == 4 and sorted(k.tolist()[:3]) == [0, 2, 4]
    ctl.feedback([0, 3, 1, 0])
    assert ctl.take_drafted("b") == [4]


def test_closed_loop_benchmark_runs_each_system_as_named():
    """sloserve.bench.sglang_specserve: SGLang's own STANDALONE gets its own flags and no
    sloserve speculation; the SPECSERVE systems differ only in the lengths mode."""
    from sloserve.bench.sglang_specserve import SYSTEMS, system_args, system_env

    assert system_args("plain", "T", "D") == ["--model-path", "T", "--draft-model-path", "D",
                                             "--spec-policy", "ar"]
    own = system_args("standalone:3", "T", "D")
    assert own[own.index("--speculative-algorithm") + 1] == "STANDALONE"
    assert own[own.index("--speculative-num-steps") + 1] == "3"
    assert own[own.index("--speculative-num-draft-tokens") + 1] == "4"
    assert "--draft-model-path" not in own and own[own.index("--spec-policy") + 1] == "ar"
    assert system_args("specserve", "T", "D") == system_args("specserve:per-request", "T", "D")
    assert {"plain", "standalone:1", "standalone:3", "specserve"} <= set(SYSTEMS)
    assert system_env("plain") == {}
    assert system_env("specserve") == {"SLOSERVE_SGLANG_LENGTHS": "uniform",
                                       "SLOSERVE_SPEC_OPTIONS": ""}
    assert system_env("specserve:per-request:uniform_margin=0+prior=0.7") == {
        "SLOSERVE_SGLANG_LENGTHS": "per-request",
        "SLOSERVE_SPEC_OPTIONS": "uniform_margin=0,prior=0.7"}


def test_policy_options_from_the_environment():
    assert settings.spec_options("") == {}
    assert settings.spec_options("uniform_margin=0, correct_cost=false,lag_cap=none") == {
        "uniform_margin": 0.0, "correct_cost": False, "lag_cap": None}
    assert settings.spec_options("small_batch=4") == {"small_batch": 4}
    for bad, names in [("foo=1", "foo"), ("uniform_margin", "uniform_margin"),
                       ("correct_cost=maybe", "correct_cost"), ("ema=2", "ema"),
                       ("ema=none", "ema")]:
        with pytest.raises(ValueError, match=f"SLOSERVE_SPEC_OPTIONS.*{names}"):
            settings.spec_options(bad)


def test_profiling_rows_carry_confidences_and_fit_the_calibration(tmp_path):
    """In sweep mode the controller logs each uniform step's chain confidences with every
    request's accepted drafts; the SGLang profiler's calibration counts each position up to
    and including the first rejection in its confidence bin (row 0 rejected, row 1
    accepted)."""
    from sloserve.sglang_plugin.profile import calibration_counts

    timings = tmp_path / "rows.jsonl"
    ctl = StepController(make_policy("specserve", COST, k_max=3), 3, sweep=(0, 3),
                         timings_path=str(timings))
    rids = ["a", "b"]
    assert ctl.decide(rids, [40, 50], [None, None]) == 0
    ctl.feedback([0, 0])
    assert ctl.decide(rids, [41, 51], [None, None]) == 3
    ctl.record_chain(np.array([[0.95, 0.90, 0.10], [0.30, 0.95, 0.95]]))
    ctl.feedback([3, 0])  # a: all three accepted; b: its first draft rejected
    rows = [json.loads(x) for x in timings.read_text().splitlines()]
    assert "conf" not in rows[0] and rows[1]["accepted_per_request"] == [3, 0]
    counts = np.array(calibration_counts(rows))  # [2, 16]
    hit = {int(c * 16) for c in (0.95, 0.90, 0.10)}
    assert counts[1].sum() == 3 and {int(i) for i in np.nonzero(counts[1])[0]} == hit
    assert counts[0].sum() == 1 and counts[0][int(0.30 * 16)] == 1  # b's later drafts unseen
    assert calibration_counts(rows[:1]) is None
