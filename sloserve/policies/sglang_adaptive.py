"""SGLang's adaptive speculative steps (EMA of accepted length with hysteresis).

Source rules: sglang `speculative/adaptive_spec_params.py` (PR #21599,
AdaptiveSpeculativeParams) and its batch-size-aware controller (PR #24055):

* ema <- (1 - 0.2) * ema + 0.2 * mean accepted draft tokens of the verify step, starting at
  steps - 1;
* no change during the first 10 batches (warm-up), then a re-decision every 5 batches;
* over the sorted candidate steps, step down while ema <= prev_candidate - 0.5 +
  down_hysteresis (0.0), step up while ema > current - 0.5 + up_hysteresis (-0.25);
* one independent tracker per batch-size range, keyed by range lower bounds:
  [1, 64) candidates {1, 3, 7}, [64, 128) {1, 2, 5}, [128, inf) {1, 2, 6}.

Candidates are clipped to k_max. Every tracker starts at the candidate nearest to 3 (the
usual `speculative_num_steps`). The chosen steps apply uniformly to the batch; everything
drafted is verified (EAGLE chain: num_draft_tokens = steps + 1).
"""

from __future__ import annotations

import bisect

import numpy as np

from sloserve.policies.lengths import TargetLengthPolicy
from sloserve.speculation import SpecPlan, StepInfo, VerifyOutcome

BUCKETS: dict[int, tuple[int, ...]] = {1: (1, 3, 7), 64: (1, 2, 5), 128: (1, 2, 6)}
INITIAL_STEPS = 3


class EmaStepTracker:
    """One batch-size range's EMA of accepted length and its current steps."""

    def __init__(
        self,
        candidates: tuple[int, ...],
        *,
        initial: int = INITIAL_STEPS,
        alpha: float = 0.2,
        warmup: int = 10,
        interval: int = 5,
        down: float = 0.0,
        up: float = -0.25,
    ) -> None:
        self.candidates = sorted(set(candidates))
        self.steps = min(self.candidates, key=lambda c: (abs(c - initial), -c))
        self.ema = float(self.steps - 1)
        self.alpha, self.warmup, self.interval = alpha, warmup, interval
        self.down, self.up = down, up
        self.batches = 0

    def update(self, mean_accepted: float) -> None:
        self.ema = (1.0 - self.alpha) * self.ema + self.alpha * mean_accepted
        self.batches += 1
        if self.batches > self.warmup and (self.batches - self.warmup) % self.interval == 0:
            self._recompute()

    def _recompute(self) -> None:
        i = self.candidates.index(self.steps)
        while i > 0 and self.ema <= self.candidates[i - 1] - 0.5 + self.down:
            i -= 1
        while i < len(self.candidates) - 1 and self.ema > self.candidates[i] - 0.5 + self.up:
            i += 1
        self.steps = self.candidates[i]


class SGLangAdaptivePolicy(TargetLengthPolicy):
    """Uniform steps from the tracker of the batch's size range."""

    name = "sglang-adaptive"

    def __init__(self, k_max: int, buckets: dict[int, tuple[int, ...]] | None = None) -> None:
        super().__init__(k_max)
        if k_max < 1:
            raise ValueError("sglang-adaptive needs k_max >= 1")
        buckets = buckets or BUCKETS
        self._bounds = sorted(buckets)
        self.trackers = [
            EmaStepTracker(tuple(min(c, k_max) for c in buckets[b])) for b in self._bounds
        ]

    def tracker(self, batch_size: int) -> EmaStepTracker:
        i = max(0, bisect.bisect_right(self._bounds, batch_size) - 1)
        return self.trackers[i]

    def target_lengths(self, step: StepInfo) -> np.ndarray:
        k = self.tracker(step.batch_size).steps
        return np.full(step.batch_size, k, dtype=np.int64)

    def observe(self, plan: SpecPlan, outcome: VerifyOutcome) -> None:
        step = plan.step
        verified = np.asarray(outcome.verified)
        if step.batch_size == 0 or not verified.any():
            return
        self.tracker(step.batch_size).update(float(np.mean(outcome.accepted)))
