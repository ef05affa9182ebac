"""Shared shape of the baseline policies: pick a draft length per request at `start`.

Every baseline except the threshold rule and SpecServe decides all lengths before the
first draft forward: draft min(target_r, k_max) tokens, verify everything drafted.
"""

from __future__ import annotations

from abc import abstractmethod

import numpy as np

from sloserve.drafter.policy import SpecPolicy, StepInfo


class TargetLengthPolicy(SpecPolicy):
    """Drafts target_lengths(step)[r] tokens for request r and verifies all of them."""

    def __init__(self, k_max: int) -> None:
        if k_max < 0:
            raise ValueError(f"k_max must be >= 0, got {k_max}")
        self.k_max = k_max
        self._target = np.zeros(0, dtype=np.int64)  # [B] this step's lengths

    @abstractmethod
    def target_lengths(self, step: StepInfo) -> np.ndarray:
        """[B] int: draft tokens each request should get this step (0 = none)."""

    def step_k_max(self, step: StepInfo) -> int:
        return max(0, min(self.k_max, step.k_max))

    def start(self, step: StepInfo) -> np.ndarray:
        target = np.asarray(self.target_lengths(step), dtype=np.int64)
        # np.minimum / np.maximum: np.clip costs ~5 us of argument handling per call
        self._target = np.minimum(np.maximum(target, 0), self.step_k_max(step))
        return self._target > 0

    def extend(self, step: StepInfo, confidences: np.ndarray, drafting: np.ndarray) -> np.ndarray:
        return drafting & (self._target > confidences.shape[1])

    def verify_lengths(
        self, step: StepInfo, confidences: np.ndarray, drafted: np.ndarray
    ) -> np.ndarray:
        return np.asarray(drafted, dtype=np.int64).copy()
