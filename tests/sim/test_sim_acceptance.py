"""The acceptance process: fitted to calibration bins, and what the simulator produces
matches the configured process within tolerance. Also determinism given a seed."""

from __future__ import annotations

import json

import numpy as np
import pytest
from sim_cases import COST, cfg, constant_acceptance, poisson_requests

from sloserve.sim.acceptance import (
    BUILTIN_PAIR_BINS,
    AcceptanceModel,
    ConfidenceDist,
    builtin_pair_model,
    fit_from_bins,
    from_pairs,
    load_acceptance,
    run_lengths,
    with_categories,
)
from sloserve.sim.engine import SimRequest, Simulator


def test_run_lengths():
    ok = np.array([1, 1, 0, 1, 0, 0, 1, 1, 1], dtype=bool)
    assert run_lengths(ok).tolist() == [2, 1, 0, 1, 0, 0, 3, 2, 1]
    assert run_lengths(np.ones(3, bool)).tolist() == [3, 2, 1]


def test_fit_matches_the_bins_moments_and_calibration():
    m = builtin_pair_model()
    n = np.array([b["n"] for b in BUILTIN_PAIR_BINS], dtype=float)
    mc = np.array([b["mean_confidence"] for b in BUILTIN_PAIR_BINS])
    acc = np.array([b["acceptance"] for b in BUILTIN_PAIR_BINS])
    assert m.default.mean == pytest.approx(float(n @ mc / n.sum()))
    assert m.calibration(mc) == pytest.approx(acc)
    # E[g(c)] ~ the pooled acceptance of the bins (~0.74) and the measured 0.73 at position 1
    assert m.expected_acceptance() == pytest.approx(float(n @ acc / n.sum()), abs=0.02)
    # the drawn confidences roughly reproduce the bins' token shares (a Beta is smoother
    # than the measured histogram: ~0.33 vs 0.42 in [0.2, 0.4), see the module docstring)
    rng = np.random.default_rng(0)
    conf = np.concatenate([m.draw(rng, 200).conf for _ in range(500)])
    share = np.histogram(conf, bins=[0, .2, .4, .6, .8, 1.0])[0] / len(conf)
    assert share == pytest.approx(n / n.sum(), abs=0.1)
    assert share[:2].sum() == pytest.approx(float(n[:2].sum() / n.sum()), abs=0.08)


@pytest.mark.parametrize("policy", ["fixed:1", "fixed:4"])
def test_simulated_acceptance_matches_the_process(policy):
    """Conditional acceptance at every draft position ~ E[g(c)]; per confidence bin ~ g.
    Requests are made alike here: with per-request levels, verify-weighted rates lean to
    the slow requests (they take more steps for the same output)."""
    base = builtin_pair_model()
    d = base.default
    model = AcceptanceModel(base.calibration, ConfidenceDist(d.mean, 1e4, 4.0))
    pairs: list[tuple[float, bool]] = []
    sim = Simulator(cfg(policy, k_max=4), COST, model, seed=3)
    observe = sim.policy.observe

    def record(plan, outcome):  # every verified position up to the first rejection
        for r in range(len(outcome.verified)):
            k, a = int(outcome.verified[r]), int(outcome.accepted[r])
            pairs.extend((float(outcome.confidences[r, j]), j < a) for j in range(min(k, a + 1)))
        observe(plan, outcome)

    sim.policy.observe = record
    sim.run([SimRequest(f"r{i}", 0.05 * i, 20, 120) for i in range(300)])
    s = sim.stats
    expect = model.expected_acceptance()
    cond = [s.accepted_at[0] / s.verified_at[0]]
    cond += [s.accepted_at[j] / s.accepted_at[j - 1] for j in range(1, int(policy[-1]))]
    assert cond == pytest.approx([expect] * len(cond), abs=0.03)
    c = np.array([p[0] for p in pairs])
    a = np.array([p[1] for p in pairs])
    for lo, hi in [(0.0, 0.2), (0.2, 0.4), (0.4, 0.6), (0.6, 0.8)]:
        sel = (c >= lo) & (c < hi)
        assert a[sel].mean() == pytest.approx(float(model.calibration(c[sel]).mean()), abs=0.04)


def test_requests_differ_in_acceptance():
    """The per-request level: request means spread as configured (K_req)."""
    m = builtin_pair_model()
    rng = np.random.default_rng(0)
    means = np.array([np.mean(m.draw(rng, 400).conf) for _ in range(400)])
    d = m.default
    assert means.mean() == pytest.approx(d.mean, abs=0.02)
    # var of a request's mean = var(mu) + E[mu (1 - mu)] / (K_tok + 1) / 400
    var_mu = d.mean * (1 - d.mean) / (d.request_concentration + 1)
    assert means.var() == pytest.approx(var_mu, rel=0.25)


def test_constant_acceptance_and_categories():
    sim = Simulator(cfg("fixed:2", k_max=2), COST, constant_acceptance(0.5), seed=0)
    sim.run([SimRequest(f"r{i}", 0.0, 10, 200) for i in range(40)])
    assert sim.stats.accepted_at[0] / sim.stats.verified_at[0] == pytest.approx(0.5, abs=0.03)
    m = with_categories(builtin_pair_model(), {"code": 0.7, "chat": 0.2})
    assert m.expected_acceptance("code") > m.expected_acceptance() > m.expected_acceptance("chat")
    rng = np.random.default_rng(0)
    code = np.mean([np.mean(m.draw(rng, 100, "code").conf) for _ in range(200)])
    assert code == pytest.approx(0.7, abs=0.03)


def test_acceptance_files(tmp_path):
    bench = tmp_path / "bench.json"
    bench.write_text(json.dumps({"calibration": [{"bin": "x", **b} for b in BUILTIN_PAIR_BINS]}))
    assert load_acceptance(bench) == builtin_pair_model()
    pairs = tmp_path / "pairs.json"
    rng = np.random.default_rng(0)
    logged = [[float(c), bool(rng.random() < c)] for c in rng.random(4000)]
    pairs.write_text(json.dumps({"schema": "sloserve.sim.acceptance", "pairs": logged}))
    m = load_acceptance(pairs)
    assert m.expected_acceptance() == pytest.approx(0.5, abs=0.03)
    d = m.draw(np.random.default_rng(1), 1000)
    assert min(d.conf) >= 0 and max(d.conf) <= 1
    assert from_pairs([(0.9, True), (0.1, False)]).pairs
    explicit = tmp_path / "explicit.json"
    explicit.write_text(json.dumps({
        "schema": "sloserve.sim.acceptance",
        "calibration": {"confidence": [0.0, 1.0], "acceptance": [0.3, 0.9]},
        "confidence": {"mean": 0.5, "request_concentration": 5, "token_concentration": 5},
        "categories": {"math": 0.8}}))
    e = load_acceptance(explicit)
    assert e.categories["math"].mean == 0.8 and e.calibration(np.array([0.5]))[0] == pytest.approx(0.6)
    with pytest.raises(ValueError):
        fit_from_bins([])


def test_deterministic_given_a_seed():
    reqs = poisson_requests(40, rate=25.0, seed=4)

    def run(seed):
        sim = Simulator(cfg("specserve", tpot_slo=0.05), COST, seed=seed)
        return [(o.chunk_s, o.chunk_tokens) for o in sim.run(reqs)], sim.stats.accepted

    first, again, other = run(7), run(7), run(8)
    assert first == again
    assert first != other
