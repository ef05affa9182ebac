"""The SGLang-free parts of sloserve's SGLang plugin, in the main environment: the step
controller the SPECSERVE worker drives, the adapter SGLang's AdaptiveController calls, the
request SLO field, and the launch command `--engine sglang` builds."""

from __future__ import annotations

import json
import time
import types

import numpy as np
import pytest

from sloserve.bench.synthetic import cpu_cost_model
from sloserve.cli.sglang_launch import sglang_args
from sloserve.estimator.step_time import StepTimer
from sloserve.policies.registry import make_policy
from sloserve.policies.request_clock import STALL_EMA
from sloserve.policies.specserve import SpecServePolicy
from sloserve.runtime.config import EngineConfig
from sloserve.sglang_ext import settings
from sloserve.sglang_ext.controller import SGLangStepsPolicy, StepController, new_shapes
from sloserve.slo import slos_into_custom_params, stated_slo, valid_slo
from sloserve.spec_config import SpeculationConfig
from sloserve.speculation import StepInfo

COST = cpu_cost_model()


def _controller(k_max: int = 4, slo: float | None = None,
                per_request: bool = False) -> StepController:
    return StepController(make_policy("specserve", COST, k_max=k_max), k_max, slo,
                          per_request=per_request)


def _run(ctl: StepController, n: int, accept: float, steps: int, seed: int = 0) -> list[int]:
    """Decode steps of n requests whose drafts are each accepted with probability `accept`,
    each taking the cost model's time; the draft lengths chosen."""
    rng = np.random.default_rng(seed)
    rids = [f"r{i}" for i in range(n)]
    lens = [300] * n
    ks = []
    for _ in range(steps):
        d = ctl.begin(rids, lens, [None] * n)
        k = d.prepared
        ok = rng.random((n, max(k, 1))) < accept
        correct = [int(np.argmin(np.append(row[:k], False))) for row in ok]
        timer = StepTimer(COST, d.session.step)
        ctl.finish(d, correct, now=d.started + timer.plan(np.full(n, k), np.full(n, k)))
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
    d = ctl.begin(["a", "b"], [300, 300], [None, None])
    assert d.prepared > 0
    ctl.finish(d, [1, 1])
    d = ctl.begin(["a", "b"], [302, 302], [None, 1.1 * plain])
    assert d.prepared == 0
    ctl.finish(d, [0, 0])


def test_the_time_between_steps_reaches_the_slo_rules():
    """A step's end on the controller's clock travels with its outcome: the policy learns the
    stall between two decode steps (SGLang's prefill of a newcomer: 50 ms here) and the
    request's clock counts it (request_clock.py)."""
    ctl = StepController(make_policy("specserve-slo", COST, k_max=4), 4, 0.2)
    d = ctl.begin(["a"], [300], [None])
    end = d.started + 0.03
    assert ctl.finish(d, [0], now=end).end_time == end
    d = ctl.begin(["a", "b"], [301, 40], [None, None])
    d.started = end + 0.05  # the newcomer's prefill ran in between
    ctl.finish(d, [0, 0], now=d.started + 0.03)
    policy = ctl.policy
    assert policy.stalls.mean == pytest.approx(STALL_EMA * 0.05)
    elapsed, tokens = policy.clock.progress(["a", "b"])
    np.testing.assert_allclose(elapsed, [0.03 + 0.08, 0.03])
    np.testing.assert_allclose(tokens, [2, 1])


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


def test_a_result_of_another_size_is_ignored():
    ctl = _controller()
    d = ctl.begin(["a"], [10], [None])
    assert ctl.finish(d, [0, 0]) is None  # a batch of another size than planned
    assert "a" not in ctl.requests and d.session.outcome is None
    assert ctl.finish(d, [0]) is not None and ctl.finish(d, [0]) is None  # once


def test_adapter_keeps_the_state_the_worker_switched_to():
    ctl = _controller(k_max=3)
    active = [3]
    adapter = SGLangStepsPolicy(3, lambda: active[0])
    assert adapter.candidate_steps == [0, 1, 2, 3]
    adapter.set_cuda_graph_bs([1, 2, 4])
    assert adapter.cuda_graph_bs_for_step(2) == [1, 2, 4]
    active[0] = ctl.begin(["a"], [50], [None]).prepared
    assert adapter.get_steps_for_batch(1) == active[0]
    assert adapter.on_verify_complete([active[0]], 1) is None


@pytest.mark.parametrize("spec", ["fixed:3", "lut", "hf-heuristic", "adaserve",
                                  "specserve-slo"])
def test_any_registry_policy_runs_in_the_worker_controller(spec):
    ctl = StepController(make_policy(spec, COST, k_max=4), 4)
    d = ctl.begin(["a", "b"], [50, 60], [None, 0.5])
    assert 0 <= d.prepared <= 4
    assert ctl.finish(d, [d.prepared, 0]) is not None
    if spec == "fixed:3":
        assert d.prepared == 3


@pytest.mark.parametrize("value, want", [(0.03, 0.03), (30, 30.0), (0, None), (-1, None),
                                         ("0.03", None), (True, None), (float("inf"), None)])
def test_request_slo_from_custom_params(value, want):
    sp = types.SimpleNamespace(custom_params={"tpot_slo": value})
    assert valid_slo(stated_slo(sp, "tpot_slo")) == want
    assert stated_slo(types.SimpleNamespace(custom_params=None), "tpot_slo") is None


def test_slo_fields_move_into_custom_params():
    """What SGLang's contract gate and SamplingParams see of sloserve's spelling."""
    params = {"max_new_tokens": 4, "tpot_slo": 0.05, "ttft_slo": None,
              "custom_params": {"tpot_slo": 9.0, "x": 1}}
    moved = slos_into_custom_params(params)
    assert moved == {"max_new_tokens": 4, "custom_params": {"tpot_slo": 0.05, "x": 1}}
    assert params["tpot_slo"] == 0.05  # a copy
    assert slos_into_custom_params({"ttft_slo": None}) == {}
    assert stated_slo(moved, "tpot_slo") == stated_slo(params, "tpot_slo") == 0.05


def test_launch_command_for_the_built_in_pair_on_cpu(monkeypatch):
    monkeypatch.setattr("sloserve.cli.sglang_launch.cuda_available", lambda: False)
    cmd, env = sglang_args(["--tpot-slo", "30ms", "--port", "31234", "--log-level", "warning"])
    assert cmd[1:3] == ["-m", "sglang.launch_server"]
    args = " ".join(cmd)
    for part in ("--speculative-algorithm SPECSERVE", "--speculative-num-draft-tokens 9", "--speculative-eagle-topk 1",
                 "--disable-overlap-schedule", "--device cpu", "--attention-backend intel_amx",
                 "--port 31234", "--log-level warning"):
        assert part in args
    cfg = settings.WorkerConfig.from_json(env[settings.ENV_CONFIG])
    assert cfg.spec.tpot_slo == pytest.approx(0.03)
    # the built-in engine's defaults, from the one shared config
    assert (cfg.spec.policy, cfg.spec.k_max) == (EngineConfig().spec_policy,
                                                  EngineConfig().k_max)
    assert "--speculative-num-steps 8" in args
    assert env["SGLANG_USE_CPU_ENGINE"] == "1" and "cpu_shim" in env["PYTHONPATH"]
    plain, _ = sglang_args(["--spec-policy", "ar"])
    assert "--speculative-algorithm" not in plain and "--disable-overlap-schedule" not in plain
    # SGLang's own options pass through untouched (SGLang serves --tool-call-parser itself)
    tools, _ = sglang_args(["--tool-call-parser", "qwen25"])
    assert tools[tools.index("--tool-call-parser") + 1] == "qwen25"


def _per_request_step(ctl: StepController, rids: list[str], lens: list[int],
                      conf: np.ndarray) -> tuple[int, np.ndarray]:
    """One per-request step with the given [B, k_max] confidences: rounds drafted, k_r."""
    d = ctl.begin(rids, lens, [None] * len(rids))
    rounds = 0
    while rounds < d.prepared:
        more = ctl.after_round(d, conf[:, rounds])
        rounds += 1
        if not more:
            break
    _STEPS[id(ctl)] = d
    return d.rounds, ctl.verify_lengths(d)


_STEPS: dict = {}


def test_per_request_step_stops_drafting_and_trims_lowest_chain_probabilities():
    ctl = _controller(k_max=4, per_request=True)
    rids = [f"r{i}" for i in range(6)]
    confident = np.full((6, 4), 0.97)
    confident[3:] = 0.02  # three requests whose draft the target will hardly accept
    for _ in range(30):  # learn the calibration: confident drafts accepted, the others not
        rounds, k = _per_request_step(ctl, rids, [300] * 6, confident)
        accepted = np.where(np.arange(6) < 3, k, 0)
        ctl.finish(_STEPS[id(ctl)], accepted.tolist())
    rounds, k = _per_request_step(ctl, rids, [300] * 6, confident)
    d = _STEPS[id(ctl)].session
    assert 1 <= rounds <= 4 and (d.drafted <= rounds).all() and (k <= d.drafted).all()
    assert k[:3].min() > k[3:].max()  # the unlikely drafts go first
    P = d.plan.P[:rounds].T
    kept = [P[r, j] for r in range(6) for j in range(k[r])]
    trimmed = [P[r, j] for r in range(6) for j in range(k[r], d.drafted[r])]
    assert not trimmed or max(trimmed) <= min(kept)
    ctl.finish(_STEPS[id(ctl)], [int(x) for x in k[:3]] + [0, 0, 0])
    assert ctl.take_steps("r0", finished=False)[-1] == k[0]


def test_forced_lengths_are_a_test_setting_that_drafts_k_max():
    ctl = StepController(make_policy("specserve", COST, k_max=4), 4, per_request=True,
                         forced_lengths=(0, 4, 2))
    rids = ["a", "b", "c", "d"]
    rounds, k = _per_request_step(ctl, rids, [50] * 4, np.full((4, 4), 0.5))
    assert rounds == 4 and sorted(k.tolist()[:3]) == [0, 2, 4]
    ctl.finish(_STEPS[id(ctl)], [0, 3, 1, 0])
    assert ctl.take_drafted("b") == [4]


def test_closed_loop_benchmark_runs_each_system_as_named():
    """sloserve.bench.sglang_specserve: SGLang's own STANDALONE gets its own flags and no
    sloserve speculation; the SPECSERVE systems differ only in the lengths mode."""
    from sloserve.bench.sglang_specserve import SYSTEMS, system_args

    assert system_args("plain", "T", "D") == ["--model-path", "T", "--draft-model-path", "D",
                                             "--spec-policy", "ar"]
    assert system_args("plain:sync", "T", "D")[-1] == "--disable-overlap-schedule"
    own = system_args("standalone:3", "T", "D")
    assert own[own.index("--speculative-algorithm") + 1] == "STANDALONE"
    assert own[own.index("--speculative-num-steps") + 1] == "3"
    assert own[own.index("--speculative-num-draft-tokens") + 1] == "4"
    assert "--draft-model-path" not in own and own[own.index("--spec-policy") + 1] == "ar"
    assert system_args("specserve", "T", "D")[-6:] == [
        "--spec-policy", "specserve", "--spec-lengths", "uniform", "--spec-options", ""]
    per = system_args("specserve:per-request:uniform_margin=0+prior=0.7", "T", "D")
    assert per[-4:] == ["--spec-lengths", "per-request", "--spec-options",
                        "uniform_margin=0,prior=0.7"]
    assert {"plain", "standalone:1", "standalone:3", "specserve"} <= set(SYSTEMS)
    ng = system_args("sloserve-ngram::per-request/no-profile", "T", "D")
    assert ng[ng.index("--drafter") + 1] == "ngram"
    assert ng[-2:] == ["--spec-profile", "none"] and "--spec-lengths" in ng
    default = system_args("sloserve-ngram", "T", "D")  # the launcher's default lengths
    assert "--spec-lengths" not in default
    model = system_args("sloserve:fixed=3", "T", "D")
    assert model[model.index("--drafter") + 1] == "model"
    assert model[model.index("--spec-policy") + 1] == "fixed:3"
    weak = system_args("sloserve@/w/d/no-profile", "T", "D")  # another draft, no profile
    assert weak[weak.index("--draft-model-path") + 1] == "/w/d"
    assert weak[-2:] == ["--spec-profile", "none"] and weak[weak.index("--drafter") + 1] == "model"
    from sloserve.bench.sglang_specserve import file_stem, system_env

    row = system_args("sloserve@/w/d/no-profile/row", "T", "D")  # SGLang's weight layout
    assert row == weak and system_env("sloserve@/w/d/no-profile/row") == {
        "SLOSERVE_CPU_WEIGHTS": "row"}
    assert system_env("plain") == {} and system_args("plain/row", "T", "D") == \
        system_args("plain", "T", "D")
    both = "sloserve@/w/d/no-profile/f32-draft/row"  # the draft in float32 as well
    assert system_args(both, "T", "D") == weak and system_env(both) == {
        "SLOSERVE_CPU_WEIGHTS": "row", "SLOSERVE_CPU_DRAFT_DTYPE": "float32"}
    assert system_env("sloserve/row/f32-draft") == system_env(both)
    assert system_env("plain/column") == {"SLOSERVE_CPU_WEIGHTS": "column"}
    assert system_env("sloserve/f32-draft/packed") == {
        "SLOSERVE_CPU_WEIGHTS": "packed", "SLOSERVE_CPU_DRAFT_DTYPE": "float32"}
    assert system_env("sloserve/sglang-verify") == {"SLOSERVE_DECODE_STEP": "0"}
    assert system_args("sloserve/sglang-verify", "T", "D") == system_args("sloserve", "T", "D")

    assert file_stem("sloserve-ngram::per-request/no-profile") == \
        "sloserve-ngram--per-request-no-profile"
    from sloserve.bench.sglang_specserve import ours

    # policy ar starts plain SGLang (no SPECSERVE worker, no timings lines to read)
    assert ours("sloserve") and ours("sloserve:lut") and ours("sloserve-ngram::per-request")
    assert not ours("sloserve:ar") and not ours("sloserve:ar@/w/d/row")
    assert not ours("plain") and not ours("standalone:1")


def test_interleaved_repeats_give_every_system_the_same_mean_position():
    """--interleave's order (cell_order): each pair of repeats runs one order and its reverse,
    so under a linear drift every system's mean slot is the same; pairs rotate."""
    from sloserve.bench.sglang_specserve import cell_order

    runs = ["a", "b", "c", "d", "e"]
    orders = [cell_order(runs, rep) for rep in range(4)]
    assert orders[0] == runs and orders[1] == runs[::-1]
    assert orders[2] == ["b", "c", "d", "e", "a"] and orders[3] == orders[2][::-1]
    for pair in (orders[:2], orders[2:]):
        slots = {r: sum(o.index(r) for o in pair) for r in runs}
        assert set(slots.values()) == {len(runs) - 1}
    assert all(sorted(o) == runs for o in orders)


@pytest.mark.parametrize("restart", [False, True])
def test_restart_starts_fresh_servers_for_every_repeat(monkeypatch, tmp_path, restart):
    """--restart: each repeat on servers started (and warmed) for it, every server stopped
    before the next repeat's start; without it one start serves every repeat. The servers
    are stood in for (their process is the outside world of this loop)."""
    import sloserve.bench.sglang_specserve as bench

    events: list[tuple] = []

    class FakeServer:
        def __init__(self, system: str, start: int) -> None:
            self.system, self.start = system, start

        def wait(self) -> None:
            events.append(("up", self.system, self.start))

        def stop(self) -> None:
            events.append(("stop", self.system, self.start))

    class FakeRunning:
        def __init__(self, system, python, target, draft, logs, port, k_max, timings,
                     start=0, seconds=None, step_logs=False, step_clock=False):
            self.system, self.server = system, FakeServer(system, start)

        def warm(self, *args) -> None:
            events.append(("warm", self.system, self.server.start))

        def measure(self, prompts, c, new_tokens, ignore_eos, part=0, parts=1) -> dict:
            events.append(("measure", self.system, self.server.start, c))
            return _loop_sums(tokens=8, wall=1.0)

    monkeypatch.setattr(bench, "Running", FakeRunning)
    saved = []
    out = bench.run_systems(["a", "b"], "py", "t", "d", [1, 4], 3, 8, [[1]], tmp_path, 1,
                            interleave=True, restart=restart,
                            on_repeat=lambda r: saved.append(len(r["a"][1])))
    assert {s: {c: len(v) for c, v in r.items()} for s, r in out.items()} == \
        {"a": {1: 3, 4: 3}, "b": {1: 3, 4: 3}}
    assert saved == [1, 2, 3]
    starts = [e[2] for e in events if e[0] == "up"]
    assert starts == ([0, 0, 1, 1, 2, 2] if restart else [0, 0])
    # every measurement on a server that is up: started, not yet stopped
    live: set[tuple] = set()
    for e in events:
        if e[0] == "up":
            live.add(e[1:3])
        elif e[0] == "stop":
            live.discard(e[1:3])
        elif e[0] == "measure":
            assert e[1:3] in live, e
    assert not live


def _loop_sums(**kw) -> dict:
    """A closed loop's sums (sglang_specserve.SUMS), zeros but for kw."""
    from sloserve.bench.sglang_specserve import SUMS

    return {**dict.fromkeys(SUMS, 0), "steady_s": 1.0, **kw}


def test_a_cells_slices_add_up_to_one_loop():
    """--slices: a cell's figures are its slices' sums over their seconds (not a mean of
    their rates), tokens per verify and mean k likewise; nothing verified: None."""
    from sloserve.bench.sglang_specserve import merge_loops

    a = _loop_sums(wall=10.0, tokens=100, steady_s=8.0, steady_tokens=90, verify_ct=50,
                   draft_steps=40, drafted=20)
    b = _loop_sums(wall=30.0, tokens=100, steady_s=22.0, steady_tokens=60, verify_ct=50,
                   draft_steps=60, drafted=80)
    m = merge_loops([a, b])
    assert m["tok_s"] == pytest.approx(200 / 40) and m["steady_tok_s"] == pytest.approx(5.0)
    assert m["accept_len"] == pytest.approx(2.0) and m["mean_k"] == pytest.approx(1.0)
    assert m["slices"] == 2 and m["wall"] == 40.0
    plain = merge_loops([_loop_sums(wall=2.0, tokens=10)])
    assert plain["accept_len"] is None and plain["mean_k"] is None
    assert plain["tok_s"] == pytest.approx(5.0)


def test_slices_are_paired_one_by_one_across_repeats():
    """A cell keeps each slice's own rate (merging merged cells keeps them in order), and
    `paired_slices` divides the two systems' rates slice by slice over the repeats: a swing
    of the machine's speed shared by the two slices of one turn cancels."""
    from sloserve.bench.sglang_specserve import merge_loops, paired_slices

    def cell(*rates: float) -> dict:  # one slice of 2 s per rate
        return merge_loops([merge_loops([_loop_sums(wall=2.0, tokens=2 * r)]) for r in rates])

    fast_then_slow = cell(120.0, 60.0)  # the machine halves its speed between the slices
    assert fast_then_slow["slice_tok_s"] == pytest.approx([120.0, 60.0])
    mine = [fast_then_slow, cell(110.0, 55.0)]
    base = [cell(100.0, 50.0), cell(100.0, 50.0)]
    assert paired_slices(mine, base) == pytest.approx([1.2, 1.2, 1.1, 1.1])


def test_slices_take_turns_and_cover_the_cells_requests_once(monkeypatch, tmp_path):
    """--slices 3 --interleave: every cell runs each system's slices in turn (the order of
    cell_order per slice, so each system goes first in some slice), and the slices of a cell
    are consecutive runs of its max(4 C, 8) requests, each at least C long, together each
    request once."""
    import sloserve.bench.sglang_specserve as bench

    loops: list[tuple] = []

    def fake_loop(server, prompts, c, n, new_tokens, ignore_eos, first=0):
        loops.append((server, c, first, n))
        return bench.merge_loops([_loop_sums(wall=1.0, tokens=n * new_tokens)])

    class FakeServer:
        def __init__(self, *args, **kw) -> None:
            pass

        def wait(self) -> None:
            pass

        def stop(self) -> None:
            pass

    monkeypatch.setattr(bench, "closed_loop", fake_loop)
    monkeypatch.setattr(bench, "Server", FakeServer)
    monkeypatch.setattr(bench.Running, "warm", lambda self, *a: None)
    out = bench.run_systems(["plain", "sloserve"], "py", "t", "d", [1, 4], 2, 8, [[1]],
                            tmp_path, 1, interleave=True, slices=3)
    # 2 repeats x 2 levels x 3 slices x 2 systems
    assert len(loops) == 24
    for cell in range(4):
        cell_loops = loops[6 * cell: 6 * cell + 6]
        c = cell_loops[0][1]
        firsts: dict[object, list[tuple[int, int]]] = {}
        for server, cc, first, n in cell_loops:
            assert cc == c and n >= c
            firsts.setdefault(server, []).append((first, n))
        for runs in firsts.values():
            covered = [i for first, n in runs for i in range(first, first + n)]
            assert covered == list(range(max(4 * c, 8)))
        slices = [[server for server, *_ in cell_loops[i: i + 2]] for i in (0, 2, 4)]
        assert all(len(set(pair)) == 2 for pair in slices)  # each system once a slice
        assert len({pair[0] for pair in slices}) == 2  # and each goes first in some slice
    for s in ("plain", "sloserve"):
        assert [r["tokens"] for r in out[s][4]] == [16 * 8] * 2
        assert all(r["slices"] == 3 for c in (1, 4) for r in out[s][c])


def test_requests_verify_their_own_lengths_by_default(monkeypatch):
    """--spec-lengths defaults to per-request with either drafter (prompt lookup: its chain
    looked up whole; a draft model: the plan stops drafting round by round); an explicit
    mode wins."""
    monkeypatch.setattr("sloserve.cli.sglang_launch.cuda_available", lambda: False)
    for extra, want in ((["--drafter", "ngram"], "per-request"), ([], "per-request"),
                        (["--drafter", "model"], "per-request"),
                        (["--drafter", "ngram", "--spec-lengths", "uniform"], "uniform"),
                        (["--spec-lengths", "uniform"], "uniform")):
        _, env = sglang_args(["--spec-policy", "specserve", *extra])
        assert settings.WorkerConfig.from_json(env[settings.ENV_CONFIG]).lengths == want


def test_policy_options_travel_in_the_one_config(monkeypatch):
    monkeypatch.setattr("sloserve.cli.sglang_launch.cuda_available", lambda: False)
    _, env = sglang_args(["--spec-policy", "specserve", "--spec-options",
                          "uniform_margin=0, correct_cost=false,lag_cap=none",
                          "--spec-lengths", "per-request", "--k-max", "4"])
    cfg = settings.WorkerConfig.from_json(env[settings.ENV_CONFIG])
    assert cfg.per_request and cfg.spec.k_max == 4
    policy = make_policy(cfg.spec.policy, COST, k_max=4, options=cfg.spec.options)
    assert (policy.options.uniform_margin, policy.options.correct_cost,
            policy.options.lag_cap) == (0.0, False, None)
    for bad, names in [("foo=1", "foo"), ("uniform_margin", "uniform_margin"),
                       ("correct_cost=maybe", "correct_cost"), ("ema=2", "ema"),
                       ("ema=none", "ema")]:
        with pytest.raises(SystemExit):
            sglang_args(["--spec-policy", "specserve", "--spec-options", bad])
        with pytest.raises(ValueError, match=names):
            make_policy("specserve", COST, k_max=4,
                        options=SpeculationConfig.parse_options(bad))
    with pytest.raises(ValueError, match="takes no options"):
        make_policy("fixed:3", COST, k_max=4, options=(("ema", "0.5"),))


def test_per_request_steps_in_sglang_default_to_no_uniform_margin(monkeypatch):
    """Inside SGLang a SpecServe policy's per-request steps with the draft model run with
    uniform_margin 0 (settings.SGLANG_UNIFORM_MARGIN: measured on the real pair) unless the
    user sets it; uniform steps, the n-gram drafter and the built-in engine keep
    SpecServeOptions' default."""
    monkeypatch.setattr("sloserve.cli.sglang_launch.cuda_available", lambda: False)

    def margin(*flags: str) -> float | None:
        _, env = sglang_args(["--spec-policy", "specserve-slo", *flags])
        cfg = settings.WorkerConfig.from_json(env[settings.ENV_CONFIG])
        policy = make_policy(cfg.spec.policy, COST, k_max=4,
                             options=settings.policy_options(cfg))
        return getattr(getattr(policy, "options", None), "uniform_margin", None)

    default = SpecServePolicy(COST, 4).options.uniform_margin
    assert default > 0.0
    assert margin() == 0.0  # per-request by default (previous test)
    assert margin("--spec-lengths", "uniform") == default
    assert margin("--spec-options", "uniform_margin=0.1") == pytest.approx(0.1)
    assert margin("--drafter", "ngram") == default  # measured with the draft model only
    _, env = sglang_args(["--spec-policy", "fixed:2"])  # a policy without options
    assert settings.policy_options(settings.WorkerConfig.from_json(
        env[settings.ENV_CONFIG])) == ()


def test_profiling_rows_carry_confidences_and_fit_the_calibration(tmp_path):
    """In sweep mode the controller logs each uniform step's chain confidences with every
    request's accepted drafts; the SGLang profiler's calibration counts each position up to
    and including the first rejection in its confidence bin (row 0 rejected, row 1
    accepted)."""
    from sloserve.cli.sglang_profile import calibration_counts

    timings = tmp_path / "rows.jsonl"
    ctl = StepController(make_policy("specserve", COST, k_max=3), 3, sweep=(0, 3),
                         timings_path=str(timings))
    rids = ["a", "b"]
    d = ctl.begin(rids, [40, 50], [None, None])
    assert d.prepared == 0
    ctl.finish(d, [0, 0])
    d = ctl.begin(rids, [41, 51], [None, None])
    assert d.prepared == 3
    d.chain_conf = np.array([[0.95, 0.90, 0.10], [0.30, 0.95, 0.95]])
    ctl.finish(d, [3, 0])  # a: all three accepted; b: its first draft rejected
    rows = [json.loads(x) for x in timings.read_text().splitlines()]
    assert "conf" not in rows[0] and rows[1]["accepted_per_request"] == [3, 0]
    counts = np.array(calibration_counts(rows))  # [2, 16]
    hit = {int(c * 16) for c in (0.95, 0.90, 0.10)}
    assert counts[1].sum() == 3 and {int(i) for i in np.nonzero(counts[1])[0]} == hit
    assert counts[0].sum() == 1 and counts[0][int(0.30 * 16)] == 1  # b's later drafts unseen
    assert calibration_counts(rows[:1]) is None


def test_a_drafting_step_learns_its_rounds_without_the_catch_up_rows(tmp_path):
    """The draft's first round reads what the draft lacked (a prompt, skipped steps) as
    rows of its forward (draft_chain.first_round); the rows past the one a request the
    cost model prices are earlier steps' deferred cost, taken out of the step's drafting
    seconds at the draft's price a row (capped at what the draft took), and logged."""
    timings = tmp_path / "rows.jsonl"
    ctl = StepController(make_policy("specserve", COST, k_max=3), 3, sweep=(2,),
                         timings_path=str(timings), draft_cost=COST.draft)
    price = COST.draft.a + COST.draft.b
    for rows, draft_s, want in ((2, 0.05, 0.0), (302, 0.05, min(0.05, 300 * price)),
                                (2002, 0.01, 0.01)):
        d = ctl.begin(["a", "b"], [40, 50], [None, None])
        d.catch_up_rows = rows
        d.add_times(draft=draft_s, verify=0.1)
        ctl.finish(d, [1, 1])
        row = json.loads(timings.read_text().splitlines()[-1])
        assert row["catch_up_rows"] == rows
        assert row["catch_up"] == pytest.approx(want)
    assert 0.0 < 300 * price < 0.05  # the middle case is priced, not capped


def test_step_breakdown_prices_a_token_within_the_server(tmp_path):
    """The bench's per-cell step log summary: ms a token over the steps that drafted
    nothing, those that drafted and all, and what speculation saved in that server."""
    from sloserve.bench.sglang_specserve import step_breakdown

    def line(k: int, step: float, accepted: int) -> str:
        return json.dumps({"batch": 4, "k": k, "step": step, "accepted": accepted,
                           "verified": 4 * k, "draft": 0.01 * k, "verify": step - 0.01 * k})

    log = tmp_path / "t.jsonl"
    log.write_text("\n".join([line(0, 0.05, 0)] * 3 + [line(1, 0.07, 2)] * 2) + "\n")
    b = step_breakdown(log, 0)
    assert b["plain_token_ms"] == pytest.approx(12.5)  # 0.15 s / 12 tokens
    assert b["spec_token_ms"] == pytest.approx(140 / 12, abs=1e-3)  # 0.14 s / 12 tokens
    assert b["token_ms"] == pytest.approx(290 / 24, abs=1e-3)
    assert b["in_server_gain"] == pytest.approx(12.5 / (290 / 24) - 1.0, abs=1e-4)
    log.write_text("\n".join([line(0, 0.05, 0)] * 3) + "\n")  # nothing drafted: no gain
    assert step_breakdown(log, 0)["in_server_gain"] is None


def test_the_catch_up_the_plan_priced_stays_in_the_steps_drafting(tmp_path):
    """With each request's real lag (AlignedDraft.lags) the plan prices a catch-up in full
    until the request's credit pays for it (SpecServeOptions.lag_credit): only rows past
    those come out of the step's drafting seconds."""
    timings = tmp_path / "rows.jsonl"
    price = COST.draft.a + COST.draft.b
    for credit, want in ((True, 0.0), (False, 299 * price)):
        policy = SpecServePolicy(COST, 3, lag_credit=credit)
        ctl = StepController(policy, 3, sweep=(2,), timings_path=str(timings),
                             draft_cost=COST.draft)
        d = ctl.begin(["a", "b"], [340, 50], [None, None], draft_lags=[300, 0])
        np.testing.assert_array_equal(d.session.step.draft_lag, [300, 0])
        d.catch_up_rows = 300
        d.add_times(draft=0.5, verify=0.1)
        ctl.finish(d, [1, 1])
        row = json.loads(timings.read_text().splitlines()[-1])
        assert row["catch_up"] == pytest.approx(want)


def test_sglang_profile_fits_the_draft_from_drafting_steps_only(tmp_path):
    """python -m sloserve.profiler --engine sglang: no step reads its verified window into
    the draft (`extend` is the book's ~0.1 ms) and steps that draft nothing run no draft
    forward; a drafting step's first round also reads the rows the draft had not read
    (`catch_up_rows`, inside `draft`), which the draft's fit must count as that forward's
    rows. Plain steps' target forward takes the decode path, cheaper than the verify path by verify_fixed,
    which the fit finds apart from c. A drafting step also pays the drafter's setup once
    (the draft's `first`), which the fit finds apart from the forwards' c: spread over them,
    a step of one round was priced low and every later round high."""
    from sloserve.cli.sglang_profile import fit_rows
    from sloserve.estimator.cost_model import ForwardCost
    from sloserve.estimator.profile_file import read_profile, write_profile

    target = ForwardCost(a=5e-5, b=2.7e-3, c=0.064, q0=0.0)
    draft = ForwardCost(a=1e-5, b=1.2e-4, c=0.0106, q0=0.0)
    overhead = 0.0014
    verify_fixed = 0.015  # the verify path over the decode path (worker._plain_verify)
    setup = 0.004  # the draft's per-step setup (its metadata, the first round's extend)
    rng = np.random.default_rng(0)
    rows, skipped = [], 0
    for _ in range(400):
        B, k, ctx = int(rng.choice([1, 2, 4, 8, 16])), int(rng.integers(0, 9)), 0
        ctx = B * int(rng.integers(50, 400))
        q = B * (k + 1)
        verify = target.time(ctx + q, q) + (verify_fixed if k else 0.0)
        if k == 0:
            skipped += 1
            rows.append({"batch": B, "k": 0, "context": ctx, "verify": verify,
                         "extend": 1e-4, "draft": 0.0, "catch_up_rows": 0,
                         "step": verify + overhead})
            continue
        # the first round reads B rows per skipped step (and a prompt now and then) besides
        # the bonus tokens
        extra = B * skipped + (int(rng.integers(20, 200)) if rng.random() < 0.2 else 0)
        skipped = 0
        mid = ctx + B * (k + 1) / 2.0
        rounds = setup + draft.time(mid, B + extra) + (k - 1) * draft.time(mid, B)
        extend = 1e-4
        rows.append({"batch": B, "k": k, "context": ctx, "verify": verify, "extend": extend,
                     "draft": rounds, "catch_up_rows": extra,
                     "step": verify + rounds + extend + overhead})
    for name in ("t", "d"):  # the profile names each model by its config's hash
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text("{}")
    profile = fit_rows(rows, str(tmp_path / "t"), str(tmp_path / "d"), "cpu", "float32",
                       [1, 2, 4, 8, 16])
    assert profile.draft.fit is not None and profile.draft.fit.r2 > 0.99
    assert profile.draft.cost.c == pytest.approx(draft.c, rel=0.05)
    assert profile.draft.cost.first == pytest.approx(setup, rel=0.05)
    back = read_profile(write_profile(profile, tmp_path / "p.json"))
    assert back.draft.cost == profile.draft.cost
    assert "first" not in json.loads((tmp_path / "p.json").read_text())["target"]["cost"]
    assert profile.target.cost.c == pytest.approx(target.c, rel=0.05)
    assert profile.verify_fixed == pytest.approx(verify_fixed, rel=0.05)
    assert profile.overhead == pytest.approx(overhead, rel=0.05)


def test_sglang_profile_prices_a_verified_token_by_batch_size(tmp_path):
    """A verified token's price differs by batch size on a CPU (4.9 ms at batch 1, ~2 ms at
    4-16 on the 2-core Xeon): the profiler measures it per batch size of its sweep (the
    Theil-Sen slope, so a few slow forwards do not move it), leaves out batches passed
    through too rarely, and the table survives the profile file."""
    from sloserve.cli.sglang_profile import fit_rows
    from sloserve.estimator.cost_model import ForwardCost
    from sloserve.estimator.profile_file import read_profile, write_profile

    target = ForwardCost(a=2e-5, b=2.2e-3, c=0.08, q0=0.0)
    price = {1: 5e-3, 2: 3e-3, 4: 2e-3, 8: 2.2e-3, 16: 1.5e-3}
    rng = np.random.default_rng(4)
    rows = []
    for i in range(500):
        B = int(rng.choice([1, 2, 4, 8, 16])) if i < 480 else 3  # batch 3: passed through
        k, ctx = int(rng.integers(0, 9)), B * int(rng.integers(50, 400))
        q = B * (k + 1)
        verify = target.time(ctx + q, B) + (0.013 + price.get(B, 9e-3) * B * k if k else 0.0)
        if rng.random() < 0.05:
            verify *= 3.0  # a preempted forward
        rows.append({"batch": B, "k": k, "context": ctx, "verify": verify, "extend": 1e-4,
                     "draft": 0.01 * k, "catch_up_rows": 0, "step": verify + 0.01 * k + 1e-3})
    for name in ("t", "d"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text("{}")
    profile = fit_rows(rows, str(tmp_path / "t"), str(tmp_path / "d"), "cpu", "float32",
                       [1, 2, 4, 8, 16])
    batches = [b for b, _ in profile.verify_token]
    assert batches == [1.0, 2.0, 4.0, 8.0, 16.0]  # not 3
    for b, seconds in profile.verify_token:
        assert seconds == pytest.approx(price[int(b)], rel=0.15), b
    back = read_profile(write_profile(profile, tmp_path / "p.json"))
    assert back.verify_token == profile.verify_token
    cost = back.cost_model()
    assert cost.token_time(1) == pytest.approx(profile.verify_token[0][1])
    bad = json.loads((tmp_path / "p.json").read_text())
    bad["verify_token"] = [[4, 2e-3], [2, 3e-3]]
    (tmp_path / "bad.json").write_text(json.dumps(bad))
    with pytest.raises(ValueError, match="verify_token"):
        read_profile(tmp_path / "bad.json")


def test_sglang_profile_measures_the_draft_model_and_keys_prompt_lookup_apart(tmp_path):
    """The profiler starts SGLang with the draft model unless --drafter says otherwise (the
    launcher's default for smollm2 is prompt lookup, whose ~free "draft forwards" were once
    written under the draft model's name, pricing the draft at 37 us); a profile of prompt
    lookup is keyed "ngram", where the n-gram mode looks first."""
    from sloserve.cli.sglang_profile import fit_rows, profiled_drafter

    assert profiled_drafter(["--model", "smollm2"]) == (
        ["--model", "smollm2", "--drafter", "model"], "model")
    assert profiled_drafter(["--drafter", "ngram", "--model", "x"]) == (
        ["--drafter", "ngram", "--model", "x"], "ngram")
    (tmp_path / "t").mkdir()
    (tmp_path / "t" / "config.json").write_text("{}")
    rows = [{"batch": 2, "k": k, "context": 200 + 10 * i, "verify": 0.05 + 0.001 * k,
             "extend": 1e-5, "draft": 5e-4 if k else 0.0, "catch_up": 0.0,
             "step": 0.052 + 0.001 * k} for i in range(20) for k in range(4)]
    profile = fit_rows(rows, str(tmp_path / "t"), None, "cpu", "float32", [2])
    assert profile.draft.key == "ngram"


def test_steady_window_ends_when_the_first_client_runs_out_of_work():
    """The closed loop's steady window: two clients, three requests. The third starts at
    t = 4 when the second request ends; the next finish after it (the first request, t = 10)
    leaves a client with nothing to send, so the window ends there and counts the third
    request's tokens streamed by then (2 of 6), not those of its drain to t = 12."""
    from sloserve.bench.sglang_specserve import steady_window

    first = (0.0, [(1.0, 1), (5.0, 3), (10.0, 4)])
    second = (0.0, [(2.0, 2), (4.0, 5)])
    third = (4.0, [(6.0, 1), (9.5, 2), (11.0, 5), (12.0, 6)])
    assert steady_window([first, second, third]) == (10.0, 4 + 5 + 2)
    # one client: the window is the whole loop
    assert steady_window([(0.0, [(3.0, 8)]), (3.0, [(4.0, 2), (7.0, 8)])]) == (7.0, 16)


def test_timed_window_leaves_out_the_opening_and_cuts_at_the_end():
    """--seconds: two clients, a 10 s loop. The window opens when both first requests have
    their first token (t = 2) and closes at 10; a request's tokens count by arrival, so the
    first request's 1 token by t = 1 is left out and the third's after t = 10 too."""
    from sloserve.bench.sglang_specserve import timed_window

    first = (0.0, [(1.0, 1), (5.0, 3), (9.0, 4)])
    second = (0.0, [(2.0, 2), (4.0, 5)])
    third = (4.0, [(6.0, 1), (9.5, 2), (11.0, 5)])
    fourth = (9.0, [])  # aborted before its first token
    assert timed_window([first, second, third, fourth], 2, 10.0) == (8.0, (4 - 1) + (5 - 2) + 2)
    with pytest.raises(RuntimeError, match="make it longer"):  # a client without a token
        timed_window([first, fourth], 2, 10.0)


def test_timed_loop_stops_sending_aborts_what_runs_and_counts_its_window(monkeypatch):
    """timed_loop against a server that makes a token every 10 ms (64 a request) until
    aborted: clients stop sending at the deadline, the server is told to abort, every client
    returns, and the window's tokens are what streamed in it, by their arrival times."""
    import threading as th

    import sloserve.bench.sglang_specserve as bench

    aborted = th.Event()
    sent: list[float] = []
    made: list[list[tuple[float, int]]] = []  # each request's arrivals, in the order sent

    class TokenServer:
        url = "http://fake"

        def generate(self, ids, new_tokens, ignore_eos=True, stop=None):
            sent.append(time.perf_counter())
            arrivals: list[tuple[float, int]] = []
            made.append(arrivals)
            for k in range(1, new_tokens + 1):
                if aborted.is_set() and stop is not None and stop.is_set():
                    break
                time.sleep(0.01)
                arrivals.append((time.perf_counter(), k))
            return {"meta_info": {"spec_verify_ct": len(arrivals)}, "arrivals": arrivals}

    monkeypatch.setattr(bench, "abort_all", lambda url: aborted.set())
    t0 = time.perf_counter()
    r = bench.timed_loop(TokenServer(), [[1], [2]], 2, 1.5, 64)  # type: ignore[arg-type]
    assert aborted.is_set() and max(sent) - t0 < 1.5  # nothing sent after the deadline
    assert r["requests"] == len(sent) == len(made) >= 4  # >= 0.64 s a request, 2 clients
    assert any(len(a) < 64 for a in made)  # the requests running at the end were cut
    begin = max(made[0][0][0], made[1][0][0]) - t0  # both clients' first tokens
    assert r["wall"] == pytest.approx(1.5 - begin, abs=1e-3)
    # each request's tokens by arrival: those by the window's end less those by its start
    counted = sum(max((k for t, k in a if t - t0 <= 1.5), default=0)
                  - max((k for t, k in a if t - t0 <= begin), default=0) for a in made)
    assert r["tokens"] == counted > 0
    assert r["verify_ct"] == sum(len(a) for a in made)  # the fake verifies a token a step
    assert r["accept_len"] == pytest.approx(1.0)  # of all tokens made, not the window's
    assert bench.merge_loops([r, r])["accept_len"] == pytest.approx(1.0)  # a cell's slices


def _greedy_reference(logits, cand, k, depth):
    """SGLang's greedy chain acceptance on the whole [B, n, V] block, one request at a time."""
    import torch
    B, n, _ = logits.shape
    predict = torch.zeros(B * n, dtype=torch.int32)
    index = torch.full((B, depth), -1, dtype=torch.int32)
    lens = []
    for r in range(B):
        t = logits[r].argmax(dim=-1)
        m = 0
        while m < int(k[r]) and int(cand[r, m + 1]) == int(t[m]):
            m += 1
        for j in range(m + 1):
            predict[r * n + j] = int(t[j])
            index[r, j] = r * n + j
        lens.append(m + 1)
    return predict, torch.tensor(lens, dtype=torch.int32), index


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_greedy_chains_from_the_verified_rows_equal_the_whole_blocks_acceptance(seed):
    """The ragged verify's compact acceptance (worker._ragged_verify, all-greedy batches):
    from the logits of the k_r + 1 verified rows alone, the same predict / accept_lens /
    accept_index as the greedy rule over the whole block, drafts cut at k_r included."""
    import torch

    from sloserve.sglang_ext.chain_sampling import greedy_chains
    g = torch.Generator().manual_seed(seed)
    B, n, V = 7, 5, 11
    logits = torch.randn(B, n, V, generator=g)
    t = logits.argmax(dim=-1)  # [B, n]
    cand = torch.randint(0, V, (B, n), generator=g)
    # drafts that match the target for a random prefix, so every m_r 0..s occurs
    for r in range(B):
        agree = int(torch.randint(0, n, (1,), generator=g))
        cand[r, 1:agree + 1] = t[r, :agree]
    k = torch.tensor([0, 4, 2, 4, 1, 3, 4])
    keep = (torch.arange(n)[None, :] < (k + 1)[:, None]).reshape(-1)
    rows = keep.nonzero().squeeze(1)
    target = logits.reshape(B * n, V)[rows].argmax(dim=-1)
    got = greedy_chains(target, rows, cand, k, depth=n)
    want = _greedy_reference(logits, cand, k, n)
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    assert int(got[1].max()) > 1 and int(got[1].min()) == 1  # some chains accepted, some not


@pytest.mark.parametrize("B,depth", [(1, 1), (5, 4), (16, 9)])
def test_bonus_tokens_equal_greedy_chains_without_drafts(B, depth):
    """A step that drafted nothing (worker._argmax_acceptance): bonus_tokens' triple is
    greedy_chains' with n = 1 and k = 0, and the greedy rule's over the whole block."""
    import torch

    from sloserve.sglang_ext.chain_sampling import bonus_tokens, greedy_chains
    logits = torch.randn(B, 1, 13, generator=torch.Generator().manual_seed(B))
    target = logits[:, 0].argmax(dim=-1)
    cand = torch.randint(0, 13, (B, 1))
    got = bonus_tokens(target, depth)
    want = greedy_chains(target, torch.arange(B), cand, torch.zeros(B, dtype=torch.int64),
                         depth)
    ref = _greedy_reference(logits, cand, torch.zeros(B, dtype=torch.int64), depth)
    for a, b, c in zip(got, want, ref):
        assert a.dtype == b.dtype == torch.int32
        assert torch.equal(a, b) and torch.equal(a, c)


def test_sglang_profile_from_rows_refuses_what_is_not_a_sweep(tmp_path):
    """--from-rows refits a saved sweep (--rows-out); a missing file or one without step
    rows is an error naming the option, not a profile fitted on nothing."""
    from sloserve.cli.sglang_profile import _read_rows

    with pytest.raises(SystemExit, match="--from-rows: cannot read"):
        _read_rows(tmp_path / "absent.jsonl", "--from-rows")
    (tmp_path / "other.jsonl").write_text('{"rid": 1}\n')
    with pytest.raises(SystemExit, match="--from-rows: .* no sweep step rows"):
        _read_rows(tmp_path / "other.jsonl", "--from-rows")
    (tmp_path / "rows.jsonl").write_text('{"batch": 2, "k": 1}\n\n{"batch": 2, "k": 0}\n')
    assert _read_rows(tmp_path / "rows.jsonl", "--from-rows") == [
        {"batch": 2, "k": 1}, {"batch": 2, "k": 0}]


def test_a_shapes_first_step_is_cold_and_its_times_teach_the_policy_nothing(tmp_path):
    """SGLang's first steps of a forward shape carry one-time costs (a batch size's first
    drafting steps ran 10-28 ms over the shape's later verify forwards, 2026-12-06): the
    controller marks a shape's first step cold, and the policy's cost correction leaves its
    times out, while a second, equally slow step of the shape moves it."""
    timings = tmp_path / "rows.jsonl"
    policy = SpecServePolicy(COST, 3)
    ctl = StepController(policy, 3, sweep=(2,), timings_path=str(timings),
                         draft_cost=COST.draft)
    assert policy.corrections is not None
    corr = policy.corrections.for_batch(2)  # the band of the steps below

    def step(rids: list[str], verify: float) -> dict:
        d = ctl.begin(rids, [300] * len(rids), [None] * len(rids))
        d.add_times(draft=0.01, verify=verify)
        ctl.finish(d, [1] * len(rids), now=d.started + verify + 0.012)
        return json.loads(timings.read_text().splitlines()[-1])

    before = (corr.theta_target, corr.theta_verify, corr.verify_fixed)
    assert step(["a", "b"], 0.3)["cold"]  # a slow first step of its shape
    assert (corr.theta_target, corr.theta_verify, corr.verify_fixed) == before
    assert not step(["a", "b"], 0.3)["cold"]  # the shape again, as slow: evidence now
    assert (corr.theta_target, corr.theta_verify, corr.verify_fixed) != before
    assert step(["a", "b", "c"], 0.1)["cold"]  # another batch size: another shape


def test_a_step_is_cold_only_where_a_forward_shape_is_new():
    """The shapes are the target forward's rows (decode and verify apart) and the draft's
    (batch size, rounds): a new split of the same verified tokens over the batch, or another
    batch size with the same rows and rounds seen, is warm."""
    seen: set[tuple[int, int, int]] = set()
    assert new_shapes(seen, 4, 0, 0)  # the decode forward of 4 rows
    assert not new_shapes(seen, 4, 0, 0)
    assert new_shapes(seen, 4, 2, 5)  # a verify of 9 rows, the draft's 2 rounds at batch 4
    assert not new_shapes(seen, 4, 2, 5)  # 5 verified tokens split otherwise: same shapes
    assert new_shapes(seen, 4, 3, 5)  # 3 rounds at batch 4: a new draft shape
    assert new_shapes(seen, 5, 2, 4)  # 9 verify rows, but 2 rounds at batch 5 are new
    assert not new_shapes(seen, 5, 2, 4)
    assert new_shapes(seen, 4, 2, 4)  # 8 verify rows: new
    assert new_shapes(seen, 8, 0, 0)  # the decode forward of 8 rows, not the verify's 8
    assert new_shapes(seen, 8, 1, 1) and not new_shapes(seen, 8, 1, 1)


def test_sglang_profile_leaves_cold_steps_out_of_its_fit(tmp_path):
    """A shape's first step (the timings row's `cold`) is no sample of what it costs."""
    from sloserve.cli.sglang_profile import fit_rows

    rows = [{"batch": B, "k": k, "context": 100 * B, "verify": 0.05 + 0.002 * B * (k + 1),
             "extend": 0.0, "draft": 0.004 * k, "catch_up_rows": 0,
             "step": 0.052 + 0.002 * B * (k + 1) + 0.004 * k}
            for B in (1, 2, 4, 8) for k in range(4) for _ in range(8)]
    for name in ("t", "d"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text("{}")
    args = (str(tmp_path / "t"), str(tmp_path / "d"), "cpu", "float32", [1, 2, 4, 8])
    clean = fit_rows(rows, *args)
    slow = [dict(r, verify=3 * r["verify"], step=3 * r["step"], cold=True) for r in rows[::8]]
    assert fit_rows(rows + slow, *args).target.cost == clean.target.cost
    assert fit_rows(rows + [dict(r, cold=False) for r in slow],
                    *args).target.cost != clean.target.cost
