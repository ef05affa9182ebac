"""Vanilla speculative decoding with a preset length (SpecServe's "k = 1, 3, 5" baselines;
vLLM `num_speculative_tokens`, SGLang `speculative_num_steps` without adaptation)."""

from __future__ import annotations

import numpy as np

from sloserve.policies.lengths import TargetLengthPolicy
from sloserve.speculation import StepInfo


class FixedPolicy(TargetLengthPolicy):
    """Every request drafts k tokens every step and verifies all of them."""

    def __init__(self, k: int, k_max: int) -> None:
        if not 1 <= k <= k_max:
            raise ValueError(f"fixed:K needs 1 <= K <= k_max={k_max}, got {k} (use 'ar' for 0)")
        super().__init__(k_max)
        self.k = k
        self.name = f"fixed:{k}"

    def target_lengths(self, step: StepInfo) -> np.ndarray:
        return np.full(step.batch_size, self.k, dtype=np.int64)
