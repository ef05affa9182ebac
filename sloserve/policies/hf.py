"""Hugging Face transformers' dynamic assisted generation (the SpecServe paper's
"threshold-based" baseline), applied per request of a batch.

Source rules (transformers `generation/candidate_generator.py`, AssistedCandidateGenerator):

* `num_assistant_tokens_schedule="heuristic"` (update_candidate_strategy): after each verify,
  if every candidate was accepted, num_assistant_tokens += 2, else
  num_assistant_tokens = max(1, num_assistant_tokens - 1). The starting value is 5, the
  `num_assistant_tokens` default transformers shipped while "heuristic" was the default
  schedule (<= 4.44). HF keeps one counter per assistant model (batch size 1); here every
  request has its own, clamped to [1, k_max].
* `assistant_confidence_threshold=0.4` (ConfidenceCriteria, schedule "constant" with the
  current default num_assistant_tokens=20): drafting stops right after a draft token whose
  probability is below the threshold (that token is still verified). Newer transformers
  also retune the threshold from a ROC curve of past matches (sklearn-only); the paper's
  baseline, and this one, keep it fixed.
"""

from __future__ import annotations

import numpy as np

from sloserve.policies.lengths import LengthPlan, TargetLengthPolicy
from sloserve.policies.request_table import RequestTable
from sloserve.speculation import SpecPlan, StepInfo, VerifyOutcome

HF_HEURISTIC_START = 5
HF_CONSTANT_TOKENS = 20
HF_CONFIDENCE_THRESHOLD = 0.4


class HeuristicPlan(LengthPlan):
    """A LengthPlan that remembers the requests' slots in the policy's length table."""

    def __init__(self, step: StepInfo, target: np.ndarray, slots: np.ndarray) -> None:
        super().__init__(step, target)
        self.slots = slots  # [B] rows of HFHeuristicPolicy.lengths


class HFHeuristicPolicy(TargetLengthPolicy):
    """Per-request num_assistant_tokens: +2 when all drafts were accepted, else -1 (>= 1)."""

    name = "hf-heuristic"

    def __init__(self, k_max: int, start: int = HF_HEURISTIC_START) -> None:
        super().__init__(k_max)
        self.initial = float(max(1, min(start, k_max)))
        self.lengths = RequestTable()

    def target_lengths(self, step: StepInfo) -> np.ndarray:
        slots = self.lengths.slots(step.request_ids, fill=self.initial)
        return self.lengths.values[slots].astype(np.int64)

    def plan(self, step: StepInfo) -> SpecPlan:
        slots = self.lengths.slots(step.request_ids, fill=self.initial)
        target = self.lengths.values[slots].astype(np.int64)
        return HeuristicPlan(step, self.clipped(step, target), slots)

    def observe(self, plan: SpecPlan, outcome: VerifyOutcome) -> None:
        assert isinstance(plan, HeuristicPlan)
        verified = np.asarray(outcome.verified)
        tried = verified > 0  # requests that did not verify anything keep their length
        all_ok = np.asarray(outcome.accepted) >= verified
        k = self.lengths.values[plan.slots]
        k = k + tried * np.where(all_ok, 2.0, -1.0)
        self.lengths.values[plan.slots] = np.minimum(np.maximum(k, 1.0), max(1.0, self.k_max))

    def release(self, request_id: str) -> None:
        self.lengths.release(request_id)


class ThresholdPlan(LengthPlan):
    """A LengthPlan whose requests also stop after a draft token below `threshold`."""

    def __init__(self, step: StepInfo, target: np.ndarray, threshold: float) -> None:
        super().__init__(step, target)
        self.threshold = threshold

    def extend(self, confidences: np.ndarray, drafting: np.ndarray) -> np.ndarray:
        latest = confidences[:, -1]  # [B], NaN where the request did not draft
        # NaN >= t is False, so non-drafting rows stay out
        return super().extend(confidences, drafting) & (latest >= self.threshold)


class HFThresholdPolicy(TargetLengthPolicy):
    """Draft up to min(20, k_max) tokens; a request stops after a token whose draft
    probability is below the threshold."""

    name = "hf-threshold"

    def __init__(self, k_max: int, threshold: float = HF_CONFIDENCE_THRESHOLD) -> None:
        if not 0.0 <= threshold <= 1.0:
            raise ValueError(f"hf-threshold needs a threshold in [0, 1], got {threshold}")
        super().__init__(k_max)
        self.threshold = threshold

    def target_lengths(self, step: StepInfo) -> np.ndarray:
        return np.full(step.batch_size, HF_CONSTANT_TOKENS, dtype=np.int64)

    def plan(self, step: StepInfo) -> SpecPlan:
        return ThresholdPlan(step, self.clipped(step, self.target_lengths(step)), self.threshold)
