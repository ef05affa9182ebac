"""specserve-slo: SpecServe with per-request TPOT budgets instead of the batch's tightest SLO.

Each step, every request's budget (budgets.py) comes from its own SLO and the slack it has
accumulated (request_clock.py); requests no plan can keep this step bind nothing; a binding
request allows a step of budget * (1 + its predicted acceptance), which keeps its expected
TPOT within the budget; the plan is SpecServe's (adaptive drafter, confidence-prior verifier,
SLO guard, online costs) held to the smallest allowance, so the seconds the binding requests
allow go to tokens per second.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import numpy as np

from sloserve.estimator.cost_model import CostModel
from sloserve.estimator.step_time import StepTimer
from sloserve.policies.request_clock import RequestClock
from sloserve.policies.specserve.budgets import (
    SLACK_SHARE,
    expected_allowance,
    step_budgets,
    token_weights,
)
from sloserve.policies.specserve.policy import SpecServePolicy
from sloserve.speculation import SpecPlan, StepInfo, VerifyOutcome


class SloSpecServePolicy(SpecServePolicy):
    """SpecServe held to per-request budgets (SLO + slack), not the tightest SLO."""

    def __init__(self, cost: CostModel, k_max: int, *, slack_share: float = SLACK_SHARE,
                 **kwargs: Any) -> None:
        super().__init__(cost, k_max, **kwargs)
        if not 0.0 <= slack_share <= 1.0:
            raise ValueError(f"slack_share must be in [0, 1], got {slack_share}")
        self.name = "specserve-slo"
        self.slack_share = slack_share
        self.clock = RequestClock()

    def budgets(self, step: StepInfo) -> np.ndarray:
        """[B] the step time each request allows this step, in seconds (inf: binds nothing)."""
        return self.limits(step)[0]

    def limits(self, step: StepInfo) -> tuple[np.ndarray, np.ndarray]:
        """([B] the step time each request allows if it drafts, [B] if it drafts nothing and
        gets one token from the step), seconds (inf: binds nothing)."""
        allow, one, _ = self._limits(step)
        return allow, one

    def _limits(self, step: StepInfo) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
        """limits' two arrays and the [B] token weights (budgets.token_weights; None where
        slo_weight is off or no request has an SLO), from one plain step, stall and slack."""
        slo = np.asarray(step.tpot_slo, dtype=np.float64)
        if not np.isfinite(slo).any():
            return slo.copy(), slo.copy(), None
        plain = StepTimer(self._current_prices(step.batch_size).cost, step).plain * self.slo_scale()
        stall = self.stalls.mean
        slack = self.clock.slack(step.request_ids, slo)
        budget = step_budgets(slo, slack, plain, self.slack_share, stall)
        predicted = self.history.values[self.history.slots(step.request_ids, fill=self.prior)]
        cap = self.options.slo_weight
        weights = (token_weights(slo, slack, plain, cap, self.slack_share, stall)
                   if cap > 1.0 else None)
        return (expected_allowance(budget, predicted, stall, slack, plain + stall),
                budget - stall, weights)

    def slo_scale(self) -> float:
        """With options.mean_guard the mean overrun, not the window's worst: this rule holds
        a request's TPOT to its budget in expectation and its clock's slack corrects the
        steps that ran long, where the worst step of the window prices every plain step at
        2x on a shared CPU and makes a 150 ms SLO look as unkeepable as a 75 ms one. Off
        by default: not shown to matter (options.py)."""
        return self.guard.mean if self.options.mean_guard else self.guard.scale

    def plan(self, step: StepInfo) -> SpecPlan:
        self.clock.track(step.request_ids)
        if step.batch_size == 0:
            return super().plan(step)
        # the allowances are step times, not SLOs: they travel as step_allowance (a request
        # that drafts) and one_token_limits (one that does not: no expected tokens of its
        # own pay for a longer step)
        allow, one, weights = self._limits(step)
        return super().plan(replace(step, step_allowance=allow, one_token_limits=one,
                                    token_weights=weights))

    def observe(self, plan: SpecPlan, outcome: VerifyOutcome) -> None:
        super().observe(plan, outcome)
        self.clock.record(plan.step.request_ids, outcome.step_time,
                          np.asarray(outcome.accepted) + 1, outcome.end_time)

    def release(self, request_id: str) -> None:
        super().release(request_id)
        self.clock.release(request_id)
