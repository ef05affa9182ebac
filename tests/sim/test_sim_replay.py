"""`python -m sloserve.replay --target sim` produces a report; the GPU profiles load."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from sloserve.cli.replay import main
from sloserve.estimator.profile_file import read_profile
from sloserve.estimator.step_time import StepTimer

REPO = Path(__file__).resolve().parents[2]
GPU_PROFILES = sorted((REPO / "configs" / "profiles" / "gpu").glob("*.json"))
H100 = next(p for p in GPU_PROFILES if "h100" in p.name)


def replay(tmp_path: Path, name: str, *extra: str) -> dict:
    out = tmp_path / name
    argv = ["--synthetic", "gamma", "--arrival-rate", "8", "--cv", "2", "--num-requests", "60",
            "--input-len", "lognormal:300:0.6:16:2000", "--output-len", "lognormal:80:0.6:4:400",
            "--target", "sim", "--profile", str(H100), "--policies", "ar,fixed:3,specserve",
            "--no-progress", "--no-plots", "--out", str(out), *extra]
    assert main(argv) == 0
    return json.loads((out / "report.json").read_text())


def test_sim_target_report(tmp_path, capsys):
    report = replay(tmp_path, "one")
    assert "| specserve |" in capsys.readouterr().out
    assert report["meta"]["target"] == "sim" and report["meta"]["sim"]["profile"] == str(H100)
    runs = {r["policy"]: r for r in report["cells"][0]["runs"]}
    assert set(runs) == {"ar", "fixed:3", "specserve"}
    for r in runs.values():
        assert r["completed"] == r["num_requests"] == 60 and r["max_send_lag_ms"] == 0.0
        assert r["e2e_ms"]["mean"] > 0 and r["spec_stats"]["timeseries"]
    assert runs["ar"]["spec"]["acceptance_rate"] is None
    assert 0.3 < runs["fixed:3"]["spec"]["acceptance_rate"] < 0.8
    assert runs["fixed:3"]["spec"]["mean_verified_k"] == pytest.approx(3.0)
    records = (tmp_path / "one" / "records.jsonl").read_text().splitlines()
    assert len(records) == 180


def test_parallel_workers_give_the_same_report(tmp_path):
    a = replay(tmp_path, "serial")
    b = replay(tmp_path, "parallel", "--sim-workers", "2")
    strip = ("controller_ms_per_step",)  # host time in the policy differs run to run
    for ra, rb in zip(a["cells"][0]["runs"], b["cells"][0]["runs"]):
        assert ra["requests"] == rb["requests"]
        assert ra["e2e_ms"] == rb["e2e_ms"] and ra["tpot_ms"] == rb["tpot_ms"]
        sa = {k: v for k, v in (ra["spec"] or {}).items() if k not in strip}
        sb = {k: v for k, v in (rb["spec"] or {}).items() if k not in strip}
        assert sa == sb


def test_sim_target_needs_a_profile(capsys):
    assert main(["--synthetic", "poisson", "--num-requests", "2", "--target", "sim",
                 "--no-progress", "--policies", "ar"]) == 2
    assert "profile" in capsys.readouterr().err


def test_gpu_profiles_load_and_reproduce_their_source():
    assert len(GPU_PROFILES) >= 2
    for path in GPU_PROFILES:
        prof = read_profile(path)
        assert json.loads(path.read_text())["source"]["paper"]
        cost = prof.cost_model()
        assert cost.target.c > cost.draft.c > 0 and cost.target.b > cost.draft.b > 0
    # TurboSpec Fig. 2: 7.4 ms plain and 12.6 ms with k = 2 at batch 50 (256-token contexts)
    import numpy as np

    from sloserve.speculation import StepInfo

    cost = read_profile(H100).cost_model()
    step = StepInfo([f"r{i}" for i in range(50)], np.full(50, 256), np.full(50, np.inf), 8)
    timer = StepTimer(cost, step)
    # StepTimer's N_ctx leaves out the query tokens the profile counts: about 0.1 ms at batch 50
    assert timer.plain == pytest.approx(7.4e-3, abs=0.1e-3)
    assert timer.plan(np.full(50, 2), np.full(50, 2)) == pytest.approx(12.6e-3, abs=0.2e-3)
