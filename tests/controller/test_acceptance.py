"""Acceptance model: calibration, chain probabilities, expected tokens (docs/design.md sec. 3)."""

from __future__ import annotations

import numpy as np
import pytest

from sloserve.bench.synthetic import SyntheticWorkload
from sloserve.estimator.acceptance import (
    ConfidenceCalibrator,
    MovingAverageAcceptance,
    chain_probs,
    expected_tokens,
    geometric_tokens,
    isotonic,
)


def truth(c: np.ndarray) -> np.ndarray:
    """A draft model that is over-confident at low confidence and accurate at the top."""
    return np.clip(c, 0.0, 1.0) ** 2


def feed(cal: ConfidenceCalibrator, rng: np.random.Generator, steps: int, s: int = 6) -> None:
    work = SyntheticWorkload(rng, truth=truth, concentration=2.0)
    for _ in range(steps):
        B = 32
        conf = work.confidences(np.full((B, s), 0.5))  # [B, s]
        verified = rng.integers(1, s + 1, B)
        conf[np.arange(s)[None, :] >= verified[:, None]] = np.nan  # not drafted past verified
        accepted = work.accept(conf, verified)
        cal.update(conf, verified, accepted)


def test_calibrator_starts_at_identity():
    cal = ConfidenceCalibrator()
    c = np.linspace(0.05, 0.95, 19)
    np.testing.assert_allclose(cal(c), c, atol=1e-12)


def test_calibration_converges_to_known_map():
    rng = np.random.default_rng(0)
    cal = ConfidenceCalibrator(n_bins=16)
    feed(cal, rng, steps=600)
    c = np.linspace(0.1, 0.9, 9)
    # identity would be off by up to 0.25 here; the learned map must be within 0.04
    assert np.max(np.abs(c - truth(c))) > 0.2
    np.testing.assert_allclose(cal(c), truth(c), atol=0.04)
    assert np.all(np.diff(cal.table) >= 0.0)


def test_calibrator_ignores_positions_after_the_first_rejection():
    """Only 'accepted given all earlier accepted' samples count: a rejected first token
    says nothing about its successors, whose confidences are high here."""
    cal = ConfidenceCalibrator(prior_weight=1.0)
    conf = np.tile([0.25, 0.95, 0.95, 0.95], (50, 1))
    cal.update(conf, np.full(50, 4), np.zeros(50, dtype=int))  # all rejected at position 1
    cal.refit()
    assert cal.total.sum() == 50
    top = int(0.95 * cal.n_bins)
    assert cal.total[top] == 0  # no sample there: its value is the prior's
    assert cal.table[top] == pytest.approx(cal.prior_map()[top], abs=1e-9)
    assert cal(np.array([0.25]))[0] < 0.05


def test_a_draft_whose_confidences_mean_little_is_learned_in_every_bin():
    """A draft confident at 0.7-0.9 whose tokens the target accepts 1 time in 10 (the
    weak draft's at C = 1): after 40 verified tokens every bin, those without samples
    too, maps to less than half its confidence, where the identity prior per bin left
    the empty bins at their confidence. A calibrated draft keeps the identity prior."""
    rng = np.random.default_rng(4)
    weak, calibrated = ConfidenceCalibrator(), ConfidenceCalibrator()
    for _ in range(40):
        conf = rng.uniform(0.7, 0.9, (1, 1))
        weak.update(conf, np.ones(1, dtype=int), (rng.random(1) < 0.1).astype(int))
        calibrated.update(conf, np.ones(1, dtype=int), (rng.random(1) < conf[:, 0]).astype(int))
    c = np.array([0.3, 0.5, 0.65, 0.8, 0.95])
    assert np.all(weak(c) < 0.5 * c)
    np.testing.assert_allclose(calibrated.prior_map(), calibrated.centers, rtol=0.15)


def test_isotonic_pools_violators():
    out = isotonic([0.1, 0.5, 0.3, 0.2, 0.9], [1, 1, 1, 1, 1])
    np.testing.assert_allclose(out, [0.1, 1 / 3, 1 / 3, 1 / 3, 0.9])
    out = isotonic([0.6, 0.2], [3, 1])
    np.testing.assert_allclose(out, [0.5, 0.5])


def test_chain_probs_and_expected_tokens():
    p = np.array([[0.5, 0.5, 0.5], [0.9, np.nan, np.nan]])
    P = chain_probs(p)
    np.testing.assert_allclose(P, [[0.5, 0.25, 0.125], [0.9, 0.0, 0.0]])
    assert np.all(np.diff(P, axis=1) <= 0)
    np.testing.assert_allclose(expected_tokens(P, np.array([0, 1])), [1.0, 1.9])
    np.testing.assert_allclose(expected_tokens(P, np.array([3, 3])), [1.875, 1.9])


def test_geometric_tokens_closed_form():
    a, k = 0.7, np.arange(6)
    direct = np.array([sum(a**j for j in range(kk + 1)) for kk in k])
    np.testing.assert_allclose(geometric_tokens(a, k), direct)
    np.testing.assert_allclose(geometric_tokens(1.0, k), k + 1, rtol=1e-9)


def test_moving_average_recovers_per_token_acceptance():
    """With k drafts and i.i.d. acceptance a, accepted / (accepted + rejections) -> a."""
    rng = np.random.default_rng(1)
    ma = MovingAverageAcceptance(window=400, prior=0.1)
    a = 0.65
    for _ in range(400):
        verified = np.full(16, 5)
        ok = rng.random((16, 5)) < a
        accepted = np.argmin(np.concatenate([ok, np.zeros((16, 1), bool)], 1), axis=1)
        ma.update(verified, accepted)
    assert ma.value == pytest.approx(a, abs=0.02)


def test_the_maps_top_and_whether_it_learnt_online():
    """top is g(1), the most any draft token is predicted at; online says whether verify
    outcomes were counted (a profile's seeded counts are not: SpecServePolicy caps a new
    request's first round at top only then)."""
    g = ConfidenceCalibrator()
    assert not g.online and g.top == pytest.approx(g.centers[-1])
    g.seed(np.full((2, 16), 20.0))
    assert not g.online
    for _ in range(16):  # the first draft, at 0.99, rejected: one sample a step
        g.update(np.full((1, 8), 0.99), np.array([8]), np.array([0]))
    assert g.online
    assert g.top == pytest.approx(float(g(np.array([1.0]))[0])) and g.top < 0.5
