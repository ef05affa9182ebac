"""SmartSpec / TurboSpec goodput-guided speculation.

Source rule (SmartSpec sec. 4.4 + Alg. 1-2; TurboSpec sec. 4.1.3 + Listings 1-2): keep a
global moving-average token acceptance rate a; every step pick the uniform proposed length

    k* = argmax_{k in 0..k_max}  B * l(a, k) / T_step(k),   l(a, k) = (1 - a^(k+1)) / (1 - a)

with T_step from the fitted cost model, and verify everything proposed. No SLO rule.

With the model-free n-gram drafter (TurboSpec "PLD"): proposing is ~free, so every request
proposes k_max tokens (the lookup may find fewer) and the goodput argmax picks the
verification length instead, applied as min(drafted_r, k*).

Acceptance estimate: accepted / (accepted + rejections) per verify step (the maximum-
likelihood per-token rate of the geometric model behind l(a, k)), averaged over a window.
"""

from __future__ import annotations

import numpy as np

from sloserve.estimator.acceptance import MovingAverageAcceptance, geometric_tokens
from sloserve.estimator.cost_model import CostModel
from sloserve.estimator.efficiency import uniform_efficiency
from sloserve.estimator.step_time import StepTimer
from sloserve.policies.lengths import LengthPlan, TargetLengthPolicy
from sloserve.speculation import SpecPlan, StepInfo, VerifyOutcome


class VerifyArgmaxPlan(LengthPlan):
    """n-gram mode: every request proposes k_max; the goodput argmax picks how many verify."""

    def __init__(self, step: StepInfo, target: np.ndarray, policy: GoodputPolicy) -> None:
        super().__init__(step, target)
        self.policy = policy

    def verify_lengths(self, confidences: np.ndarray, drafted: np.ndarray) -> np.ndarray:
        drafted = np.asarray(drafted, dtype=np.int64)
        if not drafted.any():
            return drafted.copy()
        return np.minimum(drafted, self.policy.verify_argmax(self.step, drafted))


class GoodputPolicy(TargetLengthPolicy):
    """Uniform k maximising estimated goodput (draft model) or verification length (n-gram)."""

    name = "goodput"

    def __init__(
        self,
        cost: CostModel,
        k_max: int,
        *,
        drafter: str = "model",
        window: int = 32,
        prior: float = 0.7,
    ) -> None:
        super().__init__(k_max)
        self.cost = cost
        self.drafter = drafter
        self.acceptance = MovingAverageAcceptance(window=window, prior=prior)

    def best_k(self, step: StepInfo) -> int:
        """k* for this step (uniform over the batch)."""
        k_max = self.step_k_max(step)
        e = uniform_efficiency(StepTimer(self.cost, step), self.acceptance.value, k_max)
        return int(np.argmax(e))

    def target_lengths(self, step: StepInfo) -> np.ndarray:
        k = self.step_k_max(step) if self.drafter == "ngram" else self.best_k(step)
        return np.full(step.batch_size, k, dtype=np.int64)

    def plan(self, step: StepInfo) -> SpecPlan:
        target = self.clipped(step, self.target_lengths(step))
        if self.drafter == "ngram":
            return VerifyArgmaxPlan(step, target, self)
        return LengthPlan(step, target)

    def verify_argmax(self, step: StepInfo, drafted: np.ndarray) -> int:
        """TurboSpec GetVerificationLen for PLD: argmax over k of goodput, the draft cost
        being sunk; request r verifies min(drafted_r, k)."""
        timer = StepTimer(self.cost, step)
        k = np.arange(int(drafted.max()) + 1)  # [K]
        kk = np.minimum(drafted[:, None], k[None, :])  # [B, K]
        tokens = geometric_tokens(self.acceptance.value, kk).sum(axis=0)  # [K]
        times = timer.plain + timer.verify_extra(kk.sum(axis=0))  # [K]
        return int(np.argmax(tokens / times))

    def observe(self, plan: SpecPlan, outcome: VerifyOutcome) -> None:
        self.acceptance.update(outcome.verified, outcome.accepted)
