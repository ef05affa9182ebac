"""Synthetic decode steps for exercising policies without an engine or a model.

`drive_step` makes the same calls, in the same order, as the engine does every decode step
(see sloserve/speculation.py); confidences come from per-request Beta distributions and
acceptance from a known confidence -> acceptance map, so tests can check what a policy
learns and decides.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from sloserve.estimator.cost_model import CostModel, ForwardCost
from sloserve.estimator.step_time import StepTimer
from sloserve.speculation import SpecPolicy, StepInfo, VerifyOutcome


def cpu_cost_model() -> CostModel:
    """Roughly the CPU pair of docs/design.md sec. 1 (~100M target, ~15M draft): target forward
    ~30 ms at batch 1, ~110 ms at batch 32 with 512-token contexts."""
    return CostModel(
        target=ForwardCost(a=2.0e-6, b=1.5e-3, c=28e-3),
        draft=ForwardCost(a=2.0e-7, b=1.0e-4, c=4e-3),
        overhead=1e-3,
    )


def make_step(
    batch: int,
    *,
    context: int | np.ndarray = 512,
    k_max: int = 8,
    slo: float | np.ndarray = np.inf,
    ids: list[str] | None = None,
    lag: np.ndarray | None = None,
) -> StepInfo:
    return StepInfo(
        request_ids=ids if ids is not None else [f"r{i}" for i in range(batch)],
        context_lens=np.broadcast_to(np.asarray(context, dtype=np.int64), (batch,)).copy(),
        tpot_slo=np.broadcast_to(np.asarray(slo, dtype=np.float64), (batch,)).copy(),
        k_max=k_max,
        draft_lag=lag,
    )


@dataclass
class SyntheticWorkload:
    """Per-request mean confidences; acceptance P(accept | c) = truth(c)."""

    rng: np.random.Generator
    truth: Callable[[np.ndarray], np.ndarray] = lambda c: c
    concentration: float = 8.0  # Beta(mu * kappa, (1 - mu) * kappa)

    def confidences(self, mean: np.ndarray) -> np.ndarray:
        """[B] one draft position's confidences for requests with these means."""
        k = self.concentration
        return self.rng.beta(mean * k, (1.0 - mean) * k)

    def accept(self, conf: np.ndarray, verified: np.ndarray) -> np.ndarray:
        """[B] accepted counts: position j accepted w.p. truth(c_j) until the first reject."""
        s = conf.shape[1]
        ok = self.rng.random(conf.shape) < self.truth(np.nan_to_num(conf, nan=0.0))  # [B, s]
        ok &= np.arange(s)[None, :] < verified[:, None]
        return np.argmin(np.concatenate([ok, np.zeros((conf.shape[0], 1), bool)], 1), axis=1)


def drive_step(
    policy: SpecPolicy,
    step: StepInfo,
    work: SyntheticWorkload,
    mean: np.ndarray,
    cost: CostModel | None = None,
) -> VerifyOutcome:
    """One decode step through the policy in engine call order; returns the outcome it saw."""
    B = step.batch_size
    conf = np.full((B, step.k_max), np.nan)  # [B, k_max]
    drafted = np.zeros(B, dtype=np.int64)
    plan = policy.plan(step)
    drafting = plan.drafting
    j = 1
    while drafting.any() and j <= step.k_max:
        conf[drafting, j - 1] = work.confidences(mean)[drafting]
        drafted += drafting
        new = plan.extend(conf[:, :j], drafting)
        assert not np.any(new & ~drafting), "extend must return a subset of drafting"
        drafting = new
        j += 1
    s = int(drafted.max()) if B else 0
    verified = plan.verify_lengths(conf[:, :s], drafted)
    accepted = work.accept(conf[:, :s], verified)
    t = StepTimer(cost, step).plan(drafted, verified) if cost is not None else 0.0
    outcome = VerifyOutcome(drafted, verified, accepted, conf[:, :s], t, 0.0)
    policy.observe(plan, outcome)
    return outcome
