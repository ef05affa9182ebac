"""Autoregressive decoding: never drafts (the baseline every speedup is measured against)."""

from __future__ import annotations

import numpy as np

from sloserve.drafter.policy import SpecPolicy, StepInfo


class ARPolicy(SpecPolicy):
    """k = 0 for every request, every step; the engine skips the draft model entirely."""

    name = "ar"

    def start(self, step: StepInfo) -> np.ndarray:
        return np.zeros(step.batch_size, dtype=bool)

    def extend(self, step: StepInfo, confidences: np.ndarray, drafting: np.ndarray) -> np.ndarray:
        return np.zeros(step.batch_size, dtype=bool)

    def verify_lengths(
        self, step: StepInfo, confidences: np.ndarray, drafted: np.ndarray
    ) -> np.ndarray:
        return np.zeros(step.batch_size, dtype=np.int64)

    @property
    def speculates(self) -> bool:
        return False
