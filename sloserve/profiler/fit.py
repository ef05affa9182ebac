"""Least-squares fit of the forward cost model T = a * N_ctx + b * N_q + c (DESIGN.md sec. 2).

The measuring half of the profiler (which runs forwards on the engine) hands this module
lists of samples (n_ctx, n_q, seconds). The fit minimises relative squared error by default
(timings span orders of magnitude, and MAPE is what the estimator's decisions feel), and
keeps every coefficient non-negative: with three unknowns the exact non-negative least
squares solution is the best of the unconstrained fits over the 7 column subsets whose
coefficients all come out >= 0.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from itertools import combinations

import numpy as np

from sloserve.estimator.cost_model import ForwardCost


@dataclass(frozen=True)
class FitStats:
    """Quality of a fit on its own samples."""

    r2: float  # coefficient of determination on seconds
    mape: float  # mean absolute percentage error as a fraction (0.02 = 2 %)
    max_ape: float  # worst absolute percentage error as a fraction
    n_samples: int


@dataclass(frozen=True)
class FitResult:
    cost: ForwardCost
    stats: FitStats


def _as_arrays(samples: Iterable[Sequence[float]]) -> tuple[np.ndarray, np.ndarray]:
    data = np.asarray([tuple(s) for s in samples], dtype=np.float64)  # [N, 3]
    if data.ndim != 2 or data.shape[1] != 3:
        raise ValueError("samples must be (n_ctx, n_q, seconds) triples")
    if data.shape[0] < 3:
        raise ValueError(f"need at least 3 samples to fit 3 coefficients, got {data.shape[0]}")
    if np.any(data[:, 2] <= 0) or not np.all(np.isfinite(data)):
        raise ValueError("sample times must be finite and positive")
    X = np.column_stack([data[:, 0], data[:, 1], np.ones(data.shape[0])])  # [N, 3]
    return X, data[:, 2]


def _nnls3(X: np.ndarray, y: np.ndarray, w: np.ndarray) -> np.ndarray:
    """[3] non-negative weighted least squares by enumerating column subsets."""
    Xw, yw = X * w[:, None], y * w
    best, best_sse = np.zeros(3), float(yw @ yw)
    for size in (3, 2, 1):
        for cols in combinations(range(3), size):
            coef, *_ = np.linalg.lstsq(Xw[:, cols], yw, rcond=None)
            if np.any(coef < 0):
                continue
            full = np.zeros(3)
            full[list(cols)] = coef
            r = yw - Xw @ full
            sse = float(r @ r)
            if sse < best_sse - 1e-18 * max(1.0, best_sse):
                best, best_sse = full, sse
    return best


def fit_stats(cost: ForwardCost, samples: Iterable[Sequence[float]]) -> FitStats:
    """R^2 and percentage errors of `cost` on samples (use on held-out samples too)."""
    X, y = _as_arrays(samples)
    pred = X @ np.array([cost.a, cost.b, cost.c])
    ape = np.abs(pred - y) / y
    ss_tot = float(((y - y.mean()) ** 2).sum())
    ss_res = float(((y - pred) ** 2).sum())
    r2 = 1.0 - ss_res / ss_tot if ss_tot > 0 else float(ss_res == 0.0)
    return FitStats(r2=r2, mape=float(ape.mean()), max_ape=float(ape.max()), n_samples=y.size)


def fit_forward_cost(samples: Iterable[Sequence[float]], *, relative: bool = True) -> FitResult:
    """Fit (a, b, c) >= 0 from (n_ctx, n_q, seconds) samples.

    relative=True weights each sample by 1 / seconds (minimises squared relative error);
    False is ordinary least squares on seconds.
    """
    samples = list(samples)
    X, y = _as_arrays(samples)
    w = 1.0 / y if relative else np.ones_like(y)
    a, b, c = (float(v) for v in _nnls3(X, y, w))
    cost = ForwardCost(a=a, b=b, c=c)
    return FitResult(cost=cost, stats=fit_stats(cost, samples))
