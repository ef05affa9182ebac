"""Shared builders for the simulator tests."""

from __future__ import annotations

import numpy as np

from sloserve.estimator.cost_model import CostModel, ForwardCost
from sloserve.runtime.config import EngineConfig
from sloserve.runtime.scheduler import SchedulerConfig
from sloserve.sim.acceptance import AcceptanceModel, Calibration, ConfidenceDist
from sloserve.sim.engine import SimRequest

# round numbers so hand-computed step times are exact enough to compare with ==~
COST = CostModel(ForwardCost(1e-6, 1e-4, 1e-2), ForwardCost(1e-7, 1e-5, 1e-3), 5e-4)


def cfg(policy: str = "specserve", **kw) -> EngineConfig:
    sched = kw.pop("scheduler", SchedulerConfig(max_running_requests=16, max_step_tokens=256))
    kw.setdefault("dtype", "float32")  # the profiles and golden runs are float32
    return EngineConfig(spec_policy=policy, kv_cache_tokens=kw.pop("kv_cache_tokens", 8192),
                        block_size=kw.pop("block_size", 8), scheduler=sched, **kw)


def constant_acceptance(p: float) -> AcceptanceModel:
    """Every draft token is accepted with probability p (g constant, confidence ~0.5)."""
    return AcceptanceModel(Calibration((0.0, 1.0), (p, p)), ConfidenceDist(0.5, 50.0, 50.0))


def poisson_requests(n: int, rate: float, seed: int = 0, prompt=(8, 120), out=(4, 60),
                     ) -> list[SimRequest]:
    rng = np.random.default_rng(seed)
    arrivals = np.concatenate([[0.0], np.cumsum(rng.exponential(1 / rate, n - 1))])
    return [SimRequest(f"q{i}", float(arrivals[i]), int(rng.integers(*prompt)),
                       int(rng.integers(*out))) for i in range(n)]
