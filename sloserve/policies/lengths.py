"""Shared shape of the baseline policies: a draft length per request, decided at `plan`.

Every baseline except the threshold rule and SpecServe decides all lengths before the
first draft forward: draft min(target_r, k_max) tokens, verify everything drafted.
"""

from __future__ import annotations

from abc import abstractmethod

import numpy as np

from sloserve.speculation import SpecPlan, SpecPolicy, StepInfo


class LengthPlan(SpecPlan):
    """Draft target[r] tokens for request r (fewer if its drafter runs dry), verify all of
    them: no more than target[r] where a drafter handed over more (prompt lookup's whole
    chain, looked up before the step at no cost)."""

    def __init__(self, step: StepInfo, target: np.ndarray) -> None:
        self.step = step
        self.target = target  # [B] int64, already within 0..k_max
        self.drafting = target > 0

    def extend(self, confidences: np.ndarray, drafting: np.ndarray) -> np.ndarray:
        return drafting & (self.target > confidences.shape[1])

    def verify_lengths(self, confidences: np.ndarray, drafted: np.ndarray) -> np.ndarray:
        return np.minimum(np.asarray(drafted, dtype=np.int64), self.target)


class TargetLengthPolicy(SpecPolicy):
    """Drafts target_lengths(step)[r] tokens for request r and verifies all of them."""

    def __init__(self, k_max: int) -> None:
        if k_max < 0:
            raise ValueError(f"k_max must be >= 0, got {k_max}")
        self.k_max = k_max

    @abstractmethod
    def target_lengths(self, step: StepInfo) -> np.ndarray:
        """[B] int: draft tokens each request should get this step (0 = none)."""

    def step_k_max(self, step: StepInfo) -> int:
        return max(0, min(self.k_max, step.k_max))

    def clipped(self, step: StepInfo, target: np.ndarray) -> np.ndarray:
        """[B] int64 lengths within 0..step_k_max."""
        target = np.asarray(target, dtype=np.int64)
        # np.minimum / np.maximum: np.clip costs ~5 us of argument handling per call
        return np.minimum(np.maximum(target, 0), self.step_k_max(step))

    def plan(self, step: StepInfo) -> SpecPlan:
        return LengthPlan(step, self.clipped(step, self.target_lengths(step)))
