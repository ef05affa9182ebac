"""Least-squares fit of the forward cost model T = a * N_ctx + b * max(0, N_q - q0) + c
(docs/design.md sec. 2, with the roofline knee q0 of cost_model.py; q0 = 0 is the linear model).

The measuring half of the profiler (which runs forwards on the engine) hands this module
lists of samples (n_ctx, n_q, seconds). The fit minimises relative squared error by default
(timings span orders of magnitude, and MAPE is what the estimator's decisions feel), and
keeps every coefficient non-negative: with three unknowns the exact non-negative least
squares solution is the best of the unconstrained fits over the 7 column subsets whose
coefficients all come out >= 0. The knee is searched over the sampled N_q values (and the
midpoints between them): for each candidate the fit above runs on max(0, N_q - q0); a knee is
kept only when it cuts the weighted squared error by KNEE_GAIN or more over the linear fit, so
timings that are linear keep q0 = 0 and noise does not invent a knee.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from itertools import combinations

import numpy as np

from sloserve.estimator.cost_model import ForwardCost
from sloserve.estimator.profile_file import FitStats


@dataclass(frozen=True)
class FitResult:
    cost: ForwardCost
    stats: FitStats


KNEE_GAIN = 0.05  # fraction of the linear fit's weighted SSE a knee must remove


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


def _nnls(X: np.ndarray, y: np.ndarray, w: np.ndarray) -> tuple[np.ndarray, float]:
    """[m] (m = X's columns, 3 or 4) non-negative weighted least squares by enumerating
    column subsets, and its SSE."""
    m = X.shape[1]
    Xw, yw = X * w[:, None], y * w
    best, best_sse = np.zeros(m), float(yw @ yw)
    for size in range(m, 0, -1):
        for cols in combinations(range(m), size):
            coef, *_ = np.linalg.lstsq(Xw[:, cols], yw, rcond=None)
            if np.any(coef < 0):
                continue
            full = np.zeros(m)
            full[list(cols)] = coef
            r = yw - Xw @ full
            sse = float(r @ r)
            if sse < best_sse - 1e-18 * max(1.0, best_sse):
                best, best_sse = full, sse
    return best, best_sse


def fit_stats(cost: ForwardCost, samples: Iterable[Sequence[float]]) -> FitStats:
    """R^2 and percentage errors of `cost` on samples (use on held-out samples too)."""
    X, y = _as_arrays(samples)
    X[:, 1] = np.maximum(X[:, 1] - cost.q0, 0.0)
    pred = X @ np.array([cost.a, cost.b, cost.c])
    ape = np.abs(pred - y) / y
    ss_tot = float(((y - y.mean()) ** 2).sum())
    ss_res = float(((y - pred) ** 2).sum())
    r2 = 1.0 - ss_res / ss_tot if ss_tot > 0 else float(ss_res == 0.0)
    return FitStats(r2=r2, mape=float(ape.mean()), max_ape=float(ape.max()), n_samples=y.size)


def fit_forward_cost(
    samples: Iterable[Sequence[float]], *, relative: bool = True, knee: bool = True
) -> FitResult:
    """Fit (a, b, c) >= 0 and the knee q0 >= 0 from (n_ctx, n_q, seconds) samples.

    relative=True weights each sample by 1 / seconds (minimises squared relative error);
    False is ordinary least squares on seconds. knee=False fits the linear model (q0 = 0).
    """
    samples = list(samples)
    X, y = _as_arrays(samples)
    w = 1.0 / y if relative else np.ones_like(y)

    def design(q0: float) -> np.ndarray:  # [N, 3] columns for (a, b, c)
        return np.column_stack([X[:, 0], np.maximum(X[:, 1] - q0, 0.0), X[:, 2]])

    coef, q0 = _fit_knee(design, X[:, 1], y, w, knee)
    a, b, c = (float(v) for v in coef)
    cost = ForwardCost(a=a, b=b, c=c, q0=q0)
    return FitResult(cost=cost, stats=fit_stats(cost, samples))


def fit_step_cost(steps: Iterable[Sequence[float]]) -> FitResult:
    """A drafter's forward cost and its per-step setup (ForwardCost.first) from whole
    drafting steps (k, n_ctx, n_q, seconds): k forwards of mean context n_ctx and n_q query
    tokens each, whose seconds are first + k * (a * n_ctx + b * max(0, n_q - q0) + c). The
    same non-negative, relative least squares and knee search as fit_forward_cost, with
    the setup a fourth coefficient; the stats are the mean forward's, as there."""
    data = np.asarray([tuple(s) for s in steps], dtype=np.float64)  # [N, 4]
    if data.ndim != 2 or data.shape[1] != 4 or data.shape[0] < 4:
        raise ValueError("need at least 4 (k, n_ctx, n_q, seconds) steps")
    if np.any(data[:, 0] <= 0) or np.any(data[:, 3] <= 0) or not np.all(np.isfinite(data)):
        raise ValueError("steps need k >= 1 and finite positive seconds")
    k, y = data[:, 0], data[:, 3]
    w = 1.0 / y

    def design(q0: float) -> np.ndarray:  # [N, 4] columns for (a, b, c, first)
        return np.column_stack([k * data[:, 1], k * np.maximum(data[:, 2] - q0, 0.0), k,
                                np.ones_like(k)])

    coef, q0 = _fit_knee(design, data[:, 2], y, w)
    a, b, c, first = (float(v) for v in coef)
    cost = ForwardCost(a=a, b=b, c=c, q0=q0, first=first)
    per_forward = [(n_ctx, n_q, max(secs - first, 1e-9) / k_i)
                   for k_i, n_ctx, n_q, secs in data.tolist()]
    return FitResult(cost=cost, stats=fit_stats(cost, per_forward))


def _fit_knee(design: Callable[[float], np.ndarray], n_q: np.ndarray, y: np.ndarray,
              w: np.ndarray, knee: bool = True) -> tuple[np.ndarray, float]:
    """The non-negative fit of y on design(q0) [N, m] (column 1 the query tokens past q0)
    and its knee q0: the linear fit (q0 = 0), or the best candidate knee where it cuts the
    weighted SSE by KNEE_GAIN or more and keeps b > 0."""
    coef, sse = _nnls(design(0.0), y, w)
    linear_sse, q0 = sse, 0.0
    for cand in _knee_candidates(n_q) if knee else ():
        c_k, sse_k = _nnls(design(float(cand)), y, w)
        if sse_k < sse and sse_k <= (1.0 - KNEE_GAIN) * linear_sse and c_k[1] > 0.0:
            coef, sse, q0 = c_k, sse_k, float(cand)
    return coef, q0


def _knee_candidates(n_q: np.ndarray) -> np.ndarray:
    """Sampled query-token counts and the midpoints between them, leaving at least three
    distinct counts past the knee so b stays determined, and none at or below the smallest
    count: such a knee fits exactly as well as none (c absorbs b q0), so rounding alone
    would pick it, and a forward over fewer query tokens than sampled would be mispriced."""
    values = np.unique(n_q)
    if values.size < 4:
        return np.zeros(0)
    mids = (values[:-1] + values[1:]) / 2.0
    cands = np.unique(np.concatenate([values, mids]))
    return cands[(cands > values[0]) & (cands < values[-3])]
