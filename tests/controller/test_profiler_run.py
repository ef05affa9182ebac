"""The profiler's measuring half, run for real on the tiny pair (no timings asserted)."""

from __future__ import annotations

import numpy as np

from sloserve.profiler.measure import Grid, build_profile, measure_drafting


def test_build_profile_on_the_tiny_pair(make_engine):
    eng = make_engine(spec_policy="ar", k_max=4)
    grid = Grid(batch_sizes=(1, 2, 4), context_lens=(8, 24), query_lens=(1, 2, 3, 5), reps=1)
    profile, samples = build_profile(eng, grid, "quick", log=lambda *a: None)
    assert len(samples["target"]) == len(samples["draft"]) == 3 * 2 * 4
    for m in (profile.target, profile.draft):
        c = m.cost
        assert min(c.a, c.b, c.c, c.q0) >= 0.0 and c.c > 0.0
        assert m.fit is not None and m.fit.n_samples == 24
    counts = np.asarray(profile.calibration)
    assert counts.shape == (2, 16) and counts.sum() > 50  # verified draft positions
    assert 0 < counts[1].sum() < counts.sum()  # the tiny pair accepts some, rejects some
    assert eng.scheduler.alloc.num_used == 0


def test_draft_round_cost_is_what_the_forward_fit_misses(make_engine):
    """Pricing the draft forward at zero, the whole measured round is the residual."""
    from sloserve.estimator.cost_model import ForwardCost

    eng = make_engine(spec_policy="ar", k_max=4)
    counts, free_forward = measure_drafting(eng, ForwardCost(0.0, 0.0, 0.0), prompts=4, tokens=16)
    _, huge_forward = measure_drafting(eng, ForwardCost(0.0, 0.0, 10.0), prompts=4, tokens=16)
    assert free_forward > 0.0 and huge_forward == 0.0  # clipped at zero
    assert counts.sum() > 0
