"""The multi-SLO load sweep: SLO classes, cells, per-run numbers and the command end to end
on the simulator."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from sloserve.cli.sweep import main as sweep_main
from sloserve.replay.formats import write_native
from sloserve.replay.metrics import SloConfig
from sloserve.replay.records import PolicyRun, RequestRecord
from sloserve.replay.shaping import Scaling
from sloserve.replay.slo_mix import DEFAULT_MIX, SloClass, assign_classes, parse_mix
from sloserve.replay.sweep_cells import burst, make_cell
from sloserve.replay.sweep_stats import aggregate, run_stats
from sloserve.replay.trace import TraceRequest, describe
from sloserve.sim.target import LengthOnlySource

REPO = Path(__file__).resolve().parents[2]
H100 = REPO / "configs/profiles/gpu/llama-2-7b-hf__llama-160m__cuda-h100-sxm-80gb__bfloat16.json"


def trace(n: int = 300, seed: int = 0) -> list[TraceRequest]:
    rng = np.random.default_rng(seed)
    t = np.cumsum(rng.exponential(0.2, n)) - 0.1
    return [TraceRequest(float(max(x, 0.0)), int(rng.integers(20, 400)), int(rng.integers(5, 80)))
            for x in t]


def test_parse_mix():
    mix = parse_mix(DEFAULT_MIX)
    assert [c.name for c in mix] == ["tight", "base", "loose"]
    assert (mix[0].tpot_x, mix[0].ttft_x, mix[2].tpot_x) == (0.5, 0.5, 2.0)
    assert parse_mix("a:1:2:3")[0].weight == 3.0
    for bad in ("a:1", "a:1:x", "a:1:1,a:2:2", "a:0:1", "a:1:1:0"):
        with pytest.raises(ValueError):
            parse_mix(bad)


def test_classes_set_each_request_its_own_slos_by_weight():
    mix = (SloClass("t", 0.5, 0.25, 1.0), SloClass("l", 2.0, 4.0, 3.0))
    out, names = assign_classes(trace(2000), mix, 0.02, 1.0, np.random.default_rng(1))
    for r, c in zip(out, names):
        x = mix[0] if c == "t" else mix[1]
        assert r.tpot_slo_s == pytest.approx(0.02 * x.tpot_x)
        assert r.ttft_slo_s == pytest.approx(1.0 * x.ttft_x)
    assert 0.2 < names.count("t") / len(names) < 0.3  # weight 1 of 4


def cell(seed: int, load: float = 2.0, cv: float | None = None):
    return make_cell(trace(), n=120, seed=seed, load=load, rate_unit=1.5,
                     lengths=Scaling(output_max=40), arrivals_cv=cv, mix=parse_mix(DEFAULT_MIX),
                     tpot_s=0.02, ttft_s=1.0, source=LengthOnlySource())


def test_cells_are_reproducible_and_at_the_asked_rate():
    a, b, c = cell(0), cell(0), cell(1)
    assert a.requests == b.requests and a.classes == b.classes
    assert a.requests != c.requests
    assert len(a.requests) == 120
    assert describe(a_trace := [TraceRequest(r.arrival_s, 1, 1) for r in a.requests])[
        "rate_rps"] == pytest.approx(3.0)
    assert a_trace[0].arrival_s == 0.0
    assert max(r.max_new_tokens for r in a.requests) <= 40
    g = cell(0, load=2.0, cv=3.0)
    gaps = np.diff([r.arrival_s for r in g.requests])
    assert np.std(gaps) / np.mean(gaps) > 1.5  # bursty: CV well above Poisson's 1
    assert all(r.arrival_s == 0.0 for r in burst(a))


def record(rid: str, ttft: float, tpot: float, n: int = 11, tpot_slo: float = 0.02):
    chunks = tuple(ttft + tpot * i for i in range(n))
    return RequestRecord(rid, 0.0, 0.0, chunks[-1], chunks, tuple(range(1, n + 1)),
                         output_tokens=n, ttft_slo_s=1.0, tpot_slo_s=tpot_slo)


def test_run_stats_count_each_request_against_its_own_slo():
    recs = (record("a", 0.1, 0.015, tpot_slo=0.01),  # tight class: misses its TPOT
            record("b", 0.1, 0.015, tpot_slo=0.02),  # base: meets
            record("c", 2.0, 0.001, tpot_slo=0.04))  # loose: misses TTFT (1 s)
    stats = run_stats(PolicyRun("p", recs), {"a": "tight", "b": "base", "c": "loose"},
                      SloConfig(1.0, 0.02))
    assert stats["class_attainment"] == {"base": 1.0, "loose": 0.0, "tight": 0.0}
    assert stats["attainment"] == pytest.approx(1 / 3)
    assert stats["goodput_rps"] == pytest.approx(1 / recs[2].end_s)
    # each request's own row: class, TTFT and TPOT in ms, whether it met both
    assert [r[0] for r in stats["requests"]] == ["tight", "base", "loose"]
    assert stats["requests"][0][1:] == [pytest.approx(100.0), pytest.approx(15.0), False]
    assert [r[3] for r in stats["requests"]] == [False, True, False]


def test_aggregate_pairs_seeds():
    def s(g):
        return {"goodput_rps": g, "attainment": 0.5, "class_attainment": {"x": 0.5},
                "mean_k": None}
    runs = [{"policy": "ref", "seed": 0, "stats": s(2.0)}, {"policy": "ref", "seed": 1,
                                                            "stats": s(4.0)},
            {"policy": "p", "seed": 0, "stats": s(3.0)}, {"policy": "p", "seed": 1,
                                                          "stats": s(4.0)}]
    agg = aggregate(runs, "ref")
    assert agg["p"]["vs_reference"]["mean"] == pytest.approx(0.25)  # +50% and +0%
    assert agg["p"]["goodput_rps"]["mean"] == pytest.approx(3.5)


def test_sweep_command_on_the_simulator(tmp_path):
    path = tmp_path / "t.jsonl"
    write_native(path, trace(200))
    out = tmp_path / "out"
    assert sweep_main(["--target", "sim", "--profile", str(H100), "--trace", str(path),
                       "--loads", "1,4", "--seeds", "0,1", "--requests", "100",
                       "--policies", "ar,specserve-slo,adaserve", "--tpot-slo-ms", "15",
                       "--out", str(out)]) == 0
    report = json.loads((out / "sweep.json").read_text())
    assert [c["load"] for c in report["loads"]] == [1.0, 4.0]
    cell = report["loads"][1]
    assert set(cell["policies"]) == {"ar", "specserve-slo", "adaserve"}
    assert cell["policies"]["ar"]["goodput_rps"]["n"] == 2
    assert set(cell["paired"]) == {"ar", "adaserve"}
    for name in ("sweep.md", "goodput_vs_load.png", "class_attainment.png",
                 "mean_k_over_time.png"):
        assert (out / name).stat().st_size > 0
    assert "| 4x |" in (out / "sweep.md").read_text()


def test_the_capacity_probe_can_be_smaller_than_a_cell(tmp_path, monkeypatch):
    """--probe-requests sets how many requests the capacity probe bursts (the rate unit),
    apart from --requests a cell; without it the probe is a cell's size. A bad count is a
    CLI error naming the option."""
    from sloserve.cli import sweep as sweep_cli

    path = tmp_path / "t.jsonl"
    write_native(path, trace(200))
    argv = ["--target", "sim", "--profile", str(H100), "--trace", str(path), "--loads", "1",
            "--rate-unit", "ar", "--seeds", "0", "--requests", "60", "--policies", "ar,fixed:2", "--default-policy", "fixed:2", "--no-plots"]
    replay = sweep_cli.Sweep.replay
    sizes: list[int] = []

    def counts(self, policy, seed, requests):
        sizes.append(len(requests))
        return replay(self, policy, seed, requests)

    monkeypatch.setattr(sweep_cli.Sweep, "replay", counts)
    assert sweep_main(argv + ["--probe-requests", "12", "--out", str(tmp_path / "a")]) == 0
    assert sizes == [12, 60, 60]  # the probe, then the cell for each policy
    assert "all 12 requests" in (tmp_path / "a" / "sweep.md").read_text()
    sizes.clear()
    assert sweep_main(argv + ["--out", str(tmp_path / "b")]) == 0
    assert sizes == [60, 60, 60]
    with pytest.raises(SystemExit, match="--probe-requests"):
        sweep_main(argv + ["--probe-requests", "0", "--out", str(tmp_path / "c")])


def test_a_sweep_resumes_from_its_checkpoint(tmp_path, monkeypatch):
    """--resume replays only the runs --out/runs.jsonl lacks (a sweep cut off by the end of
    a session goes on in the next), and reports what an uninterrupted sweep reports; other
    settings than the checkpoint's are refused."""
    from sloserve.cli import sweep as sweep_cli

    path = tmp_path / "t.jsonl"
    write_native(path, trace(200))
    argv = ["--target", "sim", "--profile", str(H100), "--trace", str(path), "--loads", "1,4",
            "--seeds", "0", "--requests", "60", "--policies", "ar,specserve-slo",
            "--no-plots"]
    whole = tmp_path / "whole"
    assert sweep_main(argv + ["--out", str(whole)]) == 0
    cut = tmp_path / "cut"
    replay = sweep_cli.Sweep.replay
    calls: list[str] = []

    def dies_after_three(self, policy, seed, requests):
        if len(calls) == 3:
            raise KeyboardInterrupt  # the session ends
        calls.append(policy)
        return replay(self, policy, seed, requests)

    monkeypatch.setattr(sweep_cli.Sweep, "replay", dies_after_three)
    with pytest.raises(KeyboardInterrupt):
        sweep_main(argv + ["--out", str(cut)])
    assert len((cut / "runs.jsonl").read_text().splitlines()) == 3  # probe + 2 runs
    assert "[3/5]" in (cut / "STATUS").read_text()
    calls.clear()
    monkeypatch.setattr(sweep_cli.Sweep, "replay", lambda self, p, s, r: (calls.append(p), replay(self, p, s, r))[1])
    assert sweep_main(argv + ["--out", str(cut), "--resume"]) == 0
    assert calls == ["ar", "specserve-slo"]  # the 4x cell only
    a, b = (json.loads((d / "sweep.json").read_text()) for d in (whole, cut))
    for la, lb in zip(a["loads"], b["loads"]):
        assert la["policies"] == lb["policies"] and la["runs"] == lb["runs"]
    with pytest.raises(SystemExit, match="another sweep"):
        sweep_main([x if x != "60" else "61" for x in argv] + ["--out", str(cut), "--resume"])
