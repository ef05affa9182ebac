"""Synthetic arrivals (rate and CV within 5% over 10k samples) and length distributions."""

from __future__ import annotations

import numpy as np
import pytest

from sloserve.replay.synthetic import (
    FixedLength,
    LogNormalLength,
    UniformLength,
    gamma_arrivals,
    parse_length_dist,
    poisson_arrivals,
    synthetic_trace,
)

N = 10_000


def gap_stats(arrivals: np.ndarray) -> tuple[float, float]:
    gaps = np.diff(arrivals)
    return 1.0 / gaps.mean(), gaps.std() / gaps.mean()


def test_poisson_rate_and_cv():
    arrivals = poisson_arrivals(4.0, N, np.random.default_rng(0))
    assert arrivals[0] == 0.0 and len(arrivals) == N and np.all(np.diff(arrivals) >= 0)
    rate, cv = gap_stats(arrivals)
    assert rate == pytest.approx(4.0, rel=0.05)
    assert cv == pytest.approx(1.0, rel=0.05)


@pytest.mark.parametrize("rate, cv", [(2.0, 0.5), (2.0, 2.0), (10.0, 3.0)])
def test_gamma_rate_and_cv(rate, cv):
    rate_hat, cv_hat = gap_stats(gamma_arrivals(rate, cv, N, np.random.default_rng(1)))
    assert rate_hat == pytest.approx(rate, rel=0.05)
    assert cv_hat == pytest.approx(cv, rel=0.05)


def test_arrivals_are_seeded_and_validated():
    a = gamma_arrivals(2.0, 2.0, 50, np.random.default_rng(7))
    b = gamma_arrivals(2.0, 2.0, 50, np.random.default_rng(7))
    assert np.array_equal(a, b)
    assert len(gamma_arrivals(1.0, 1.0, 0, np.random.default_rng(0))) == 0
    with pytest.raises(ValueError):
        gamma_arrivals(0.0, 1.0, 5, np.random.default_rng(0))
    with pytest.raises(ValueError):
        gamma_arrivals(1.0, -1.0, 5, np.random.default_rng(0))


def test_length_distributions():
    rng = np.random.default_rng(0)
    assert set(FixedLength(7).sample(100, rng)) == {7}
    u = UniformLength(3, 5).sample(N, rng)
    assert set(u) == {3, 4, 5}
    ln = LogNormalLength(100, 0.5).sample(N, rng)
    assert np.median(ln) == pytest.approx(100, rel=0.05)
    clamped = LogNormalLength(100, 2.0, 10, 200).sample(N, rng)
    assert clamped.min() == 10 and clamped.max() == 200


def test_parse_length_dist():
    assert parse_length_dist("fixed:64") == FixedLength(64)
    assert parse_length_dist("uniform:8:16") == UniformLength(8, 16)
    assert parse_length_dist("lognormal:128:0.6") == LogNormalLength(128, 0.6)
    assert parse_length_dist("lognormal:128:0.6:16:1024") == LogNormalLength(128, 0.6, 16, 1024)
    for bad in ("fixed:0", "fixed", "uniform:9:3", "normal:1:2", "lognormal:x:1", "fixed:1:2"):
        with pytest.raises(ValueError, match="bad length distribution"):
            parse_length_dist(bad)


def test_synthetic_trace():
    rng = np.random.default_rng(3)
    arrivals = poisson_arrivals(2.0, 100, rng)
    reqs = synthetic_trace(arrivals, FixedLength(5), UniformLength(1, 3), rng, ["a", "b"])
    assert [r.arrival_s for r in reqs] == list(arrivals)
    assert {r.input_tokens for r in reqs} == {5}
    assert {r.category for r in reqs} == {"a", "b"}
    assert synthetic_trace(arrivals, FixedLength(5), FixedLength(1), rng)[0].category is None
