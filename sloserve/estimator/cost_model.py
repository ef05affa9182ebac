"""Forward-time cost model (DESIGN.md section 2): T_fwd = a * N_ctx + b * N_q + c.

This file is the contract between the profiler (which fits the coefficients), the estimator
(which scores plans with them) and the simulator (which replaces forwards with them).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ForwardCost:
    """Time of one forward pass of one model over a batch, in seconds."""

    a: float  # seconds per context (KV) token read by attention, summed over the batch
    b: float  # seconds per query token computed in the pass
    c: float  # fixed seconds per pass (weights load, launch and Python overheads)

    def time(self, n_ctx: float, n_q: float) -> float:
        return self.a * n_ctx + self.b * n_q + self.c

    @staticmethod
    def free() -> ForwardCost:
        """A drafter with no forward pass (the n-gram drafter)."""
        return ForwardCost(0.0, 0.0, 0.0)


@dataclass(frozen=True)
class CostModel:
    """Costs of one speculative step: draft forwards + one ragged target verify forward."""

    target: ForwardCost
    draft: ForwardCost
    overhead: float = 0.0  # seconds per step outside the forwards (scheduling, sampling)
