"""SpecServe: adaptive drafter + confidence-prior verifier + SLO-aware estimator.

`specserve-drafter` is the paper's "SpecServe-" ablation (Table 2): the adaptive drafter
alone, verifying every drafted token. `specserve` adds the confidence-prior verifier
(Alg. 2), which trims low-probability draft tails per request before the verify forward.
Both learn one confidence -> acceptance calibration map per policy (one per engine, i.e.
per model pair) from the verify outcomes.
"""

from __future__ import annotations

import numpy as np

from sloserve.drafter.adaptive import AdaptiveDrafter
from sloserve.drafter.policy import SpecPolicy, StepInfo, VerifyOutcome
from sloserve.estimator.acceptance import ConfidenceCalibrator, chain_probs
from sloserve.estimator.cost_model import CostModel
from sloserve.estimator.efficiency import binding_slo
from sloserve.verifier.elimination import eliminate_padded, eliminate_plan


class SpecServePolicy(SpecPolicy):
    """SLO-aware adaptive speculation; `verifier=False` gives the drafter-only ablation."""

    def __init__(
        self,
        cost: CostModel,
        k_max: int,
        *,
        verifier: bool = True,
        calibrator: ConfidenceCalibrator | None = None,
        **drafter_options: float,
    ) -> None:
        if k_max < 0:
            raise ValueError(f"k_max must be >= 0, got {k_max}")
        self.cost = cost
        self.k_max = k_max
        self.use_verifier = verifier
        self.name = "specserve" if verifier else "specserve-drafter"
        self.calibrator = calibrator or ConfidenceCalibrator()
        self.drafter = AdaptiveDrafter(cost, self.calibrator, **drafter_options)

    def seed_calibration(self, counts: np.ndarray) -> None:
        """Start the calibration map from the pair's offline one (the profile's)."""
        self.calibrator.seed(counts)

    def start(self, step: StepInfo) -> np.ndarray:
        return self.drafter.start(step, max(0, min(self.k_max, step.k_max)))

    def extend(self, step: StepInfo, confidences: np.ndarray, drafting: np.ndarray) -> np.ndarray:
        return self.drafter.extend(step, confidences, drafting)

    def verify_lengths(
        self, step: StepInfo, confidences: np.ndarray, drafted: np.ndarray
    ) -> np.ndarray:
        drafted = np.asarray(drafted, dtype=np.int64)
        # count_nonzero: any() without a reduction's overhead (this runs every step)
        if not self.use_verifier or confidences.shape[1] == 0 or not np.count_nonzero(drafted):
            return drafted.copy()
        d = self.drafter
        if d.step is step and d.plan_matches(confidences, drafted):  # it tracked this plan
            s = int(drafted[drafted.argmax()])
            n = int(drafted.sum())
            return eliminate_padded(
                d.P[:s].T,
                drafted,
                tokens=d.tokens,
                step_time=d.time,
                token_time=d.timer.token_time,
                slo=d.slo,
                paid_tokens=d.timer.paid_verify(float(n)),
                n_drafted=n,
                rate=d.rate,
                unscored_time=d.unscored,
                margin=d.uniform_margin,
            )
        # P from the real confidences: exact even if the engine drafted other than planned
        P = chain_probs(self.calibrator(confidences))  # [B, s]
        slo = binding_slo(step)
        timer = self.drafter.timer_for(step, slo)
        unscored = 0.0 if self.drafter.score_prefill else timer.prefill
        return eliminate_plan(timer, P, drafted, slo / self.drafter.slo_scale, self.drafter.rate,
                              unscored, self.drafter.uniform_margin)

    def observe(self, step: StepInfo, outcome: VerifyOutcome) -> None:
        self.drafter.observe(step, outcome)

    def release(self, request_id: str) -> None:
        self.drafter.release(request_id)
