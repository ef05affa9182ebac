"""Synthetic workloads: arrival processes and token-length distributions, seeded.

Arrivals: `poisson_arrivals` (exponential inter-arrival times, CV = 1) and `gamma_arrivals`
(Gamma inter-arrival times with shape 1/CV^2 and mean 1/rate, as in the Synergy paper; CV > 1
is burstier than Poisson). The first request arrives at t = 0 (like `vllm bench serve`, which
sends the first request immediately), so n requests use n - 1 inter-arrival gaps.

Lengths: `FixedLength`, `UniformLength` (inclusive bounds), `LogNormalLength` (median and
log-space sigma, clamped), parsed from CLI strings by `parse_length_dist`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from sloserve.replay.trace import TraceRequest


def poisson_arrivals(rate: float, n: int, rng: np.random.Generator) -> np.ndarray:
    """[n] float64 arrival times (s) of a Poisson process with `rate` requests/s."""
    return gamma_arrivals(rate, 1.0, n, rng)


def gamma_arrivals(rate: float, cv: float, n: int, rng: np.random.Generator) -> np.ndarray:
    """[n] float64 arrival times (s) with Gamma(shape=1/cv^2, mean=1/rate) inter-arrivals."""
    if rate <= 0 or cv <= 0:
        raise ValueError(f"rate and cv must be > 0, got rate={rate} cv={cv}")
    if n <= 0:
        return np.zeros(0)
    shape = 1.0 / (cv * cv)
    gaps = rng.gamma(shape, 1.0 / (rate * shape), size=n - 1)  # mean = shape * scale
    return np.concatenate([[0.0], np.cumsum(gaps)])


class LengthDist(Protocol):
    """A token-length distribution."""

    def sample(self, n: int, rng: np.random.Generator) -> np.ndarray:
        """[n] int64 lengths >= 1."""
        ...


@dataclass(frozen=True)
class FixedLength:
    """Every request has `value` tokens."""

    value: int

    def sample(self, n: int, rng: np.random.Generator) -> np.ndarray:
        return np.full(n, self.value, dtype=np.int64)


@dataclass(frozen=True)
class UniformLength:
    """Uniform integer lengths in [low, high], both inclusive."""

    low: int
    high: int

    def sample(self, n: int, rng: np.random.Generator) -> np.ndarray:
        return rng.integers(self.low, self.high + 1, size=n, dtype=np.int64)


@dataclass(frozen=True)
class LogNormalLength:
    """Lengths exp(N(log(median), sigma^2)), rounded, clamped to [low, high]."""

    median: float
    sigma: float
    low: int = 1
    high: int | None = None

    def sample(self, n: int, rng: np.random.Generator) -> np.ndarray:
        x = np.rint(rng.lognormal(np.log(self.median), self.sigma, size=n)).astype(np.int64)
        return np.clip(x, self.low, self.high if self.high is not None else None)


def parse_length_dist(spec: str) -> LengthDist:
    """Parse "fixed:N", "uniform:LOW:HIGH" or "lognormal:MEDIAN:SIGMA[:LOW:HIGH]"."""
    kind, *args = spec.split(":")
    try:
        if kind == "fixed" and len(args) == 1:
            dist: LengthDist = FixedLength(int(args[0]))
            ok = int(args[0]) >= 1
        elif kind == "uniform" and len(args) == 2:
            dist = UniformLength(int(args[0]), int(args[1]))
            ok = 1 <= int(args[0]) <= int(args[1])
        elif kind == "lognormal" and len(args) in (2, 4):
            bounds = (int(args[2]), int(args[3])) if len(args) == 4 else (1, None)
            dist = LogNormalLength(float(args[0]), float(args[1]), *bounds)
            ok = float(args[0]) > 0 and float(args[1]) >= 0 and bounds[0] >= 1
        else:
            ok = False
    except ValueError:
        ok = False
    if not ok:
        raise ValueError(
            f"bad length distribution {spec!r}; expected fixed:N, uniform:LOW:HIGH or "
            "lognormal:MEDIAN:SIGMA[:LOW:HIGH] with lengths >= 1"
        )
    return dist


def synthetic_trace(
    arrivals: np.ndarray,
    input_dist: LengthDist,
    output_dist: LengthDist,
    rng: np.random.Generator,
    categories: Sequence[str] | None = None,
) -> list[TraceRequest]:
    """Combine arrival times with sampled lengths; categories (if given) are drawn uniformly."""
    n = len(arrivals)
    inputs = input_dist.sample(n, rng)
    outputs = output_dist.sample(n, rng)
    cats: list[str | None] = [None] * n
    if categories:
        cats = [categories[i] for i in rng.integers(0, len(categories), size=n)]
    return [
        TraceRequest(float(t), int(i), int(o), category=c)
        for t, i, o, c in zip(arrivals, inputs, outputs, cats)
    ]
