"""The price replay (sloserve/bench/price_replay.py): timings lines made from known prices are
fitted back to them, the measured columns are the steps' own medians, and its command line
writes a table and JSON and names a bad option."""

from __future__ import annotations

import json

import numpy as np
import pytest

from sloserve.bench.price_replay import features, main, replay
from sloserve.estimator.cost_model import CostModel, ForwardCost
from sloserve.estimator.profile_file import ModelProfile, Profile, write_profile

# a target whose first 6.5 rows are free, a verify path of 3 ms and 1.5 ms a verified token
COST = CostModel(target=ForwardCost(a=5e-6, b=1.5e-3, c=40e-3, q0=6.5),
                 draft=ForwardCost(a=5e-7, b=1.6e-4, c=3e-3), overhead=8e-4,
                 verify_fixed=3e-3, verify_token=((1.0, 1e-3), (16.0, 1.5e-3)))
THETA_T, THETA_V, V = 1.2, 0.8, 6e-3  # what the "server" ran at


def _lines(counts: list[int], batch: int = 4, noise: float = 0.0, seed: int = 0) -> list[dict]:
    """Timings lines of decode steps verifying counts[i] tokens, their verify forward at
    the known prices times (1 + noise * N(0, 1))."""
    rng = np.random.default_rng(seed)
    out = []
    for i, n in enumerate(counts):
        line = {"batch": batch, "context": 400 + batch * i, "verified": n}
        plain, tokens, verifies = features(COST, line)
        t = THETA_T * plain + (THETA_V * tokens + V if verifies else 0.0)
        t *= 1.0 + noise * float(rng.standard_normal())
        out.append({**line, "verify": t, "step": t + 0.01, "k": n // batch, "cold": False})
    return out


def test_steps_of_several_verified_counts_are_fitted_back_to_their_prices():
    counts = [0, 4, 8, 4, 0, 8, 12, 0] * 40  # every window holds several counts
    r = replay(COST, _lines(counts))
    b = r["batches"][4]
    # measured: the medians' differences, exactly the known prices here
    plain0, tok4, _ = features(COST, {"batch": 4, "context": 400, "verified": 4})
    assert b["measured1"] == pytest.approx(THETA_V * tok4 + V, rel=0.05)
    assert b["theta_verify"][1] == pytest.approx(THETA_V, rel=0.05)
    assert b["v"][1] == pytest.approx(V, rel=0.05)
    assert b["price2"][1] == pytest.approx(b["measured2"], rel=0.05)
    assert r["error_median"] < 0.01


def test_noise_on_one_verified_count_moves_the_split_not_the_measured_medians():
    """Stretches of one count leave theta_verify and v to trade off; the report shows the
    spread of the price against the medians the steps measured."""
    counts = ([0] * 30 + [4] * 60 + [8] * 60) * 4
    r = replay(COST, _lines(counts, noise=0.08, seed=1))
    b = r["batches"][4]
    assert b["measured1"] is not None and b["measured2"] is not None
    lo, mid, hi = b["price2"]
    assert lo <= mid <= hi and hi > lo  # a spread, not one value


def test_the_replay_reproduces_the_scales_a_server_logged(tmp_path):
    """Lines carrying the server's own scales (as the worker writes them) agree with the
    replay when made by the same fit; here the replay of the lines is fed its own scales."""
    lines = _lines([0, 4, 8, 0] * 20)
    first = replay(COST, lines)
    assert first["off_server"] == 0.0  # no line carries a scale yet
    from sloserve.estimator.online_cost import StepCostCorrection

    corr = StepCostCorrection(verify_fixed=COST.verify_fixed)
    for line in lines:
        plain, tokens, verifies = features(COST, line)
        corr.observe(plain + tokens, 0.0, line["step"], None, measured_target=line["verify"],
                     overhead=COST.overhead, verify_part=tokens if verifies else None)
        line["theta"] = [corr.theta_target, corr.theta_verify, 1.0]
        line["verify_fixed"] = corr.verify_fixed
    assert replay(COST, lines)["off_server"] == pytest.approx(0.0, abs=1e-12)
    lines[-1]["verify_fixed"] += 2e-3  # a server that priced its verify path 2 ms dearer
    assert replay(COST, lines)["off_server"] == pytest.approx(2.0)
    cold = [dict(line, cold=True) for line in lines]
    assert replay(COST, cold)["steps"] == 0  # cold steps stay out, as in the policy


def test_the_command_prints_a_table_writes_json_and_names_a_bad_option(tmp_path, capsys):
    profile = Profile(target=ModelProfile("t", "0", COST.target),
                      draft=ModelProfile("d", "0", COST.draft), device="cpu",
                      dtype="float32", overhead=COST.overhead,
                      verify_fixed=COST.verify_fixed, verify_token=COST.verify_token)
    prof = write_profile(profile, tmp_path / "p.json")
    timings = tmp_path / "s.timings.jsonl"
    timings.write_text("".join(json.dumps(x) + "\n" for x in _lines([0, 4, 8, 4] * 20)))
    out = tmp_path / "r.json"
    main(["--profile", str(prof), str(timings), "--out", str(out)])
    text = capsys.readouterr().out
    assert "s.timings.jsonl" in text and "theta_verify" in text
    data = json.loads(out.read_text())
    assert data["results"][str(timings)]["batches"]["4"]["steps"] == 80
    with pytest.raises(SystemExit):
        main(["--profile", str(prof), str(timings), "--clip", "1.0"])
    assert "--clip" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--profile", str(tmp_path / "missing.json"), str(timings)])
    assert "--profile" in capsys.readouterr().err
