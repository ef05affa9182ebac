"""Autoregressive decoding: never drafts (the baseline every speedup is measured against)."""

from __future__ import annotations

import numpy as np

from sloserve.policies.lengths import LengthPlan
from sloserve.speculation import SpecPlan, SpecPolicy, StepInfo


class ARPolicy(SpecPolicy):
    """k = 0 for every request, every step; the engine skips the draft model entirely."""

    name = "ar"

    def plan(self, step: StepInfo) -> SpecPlan:
        return LengthPlan(step, np.zeros(step.batch_size, dtype=np.int64))

    @property
    def speculates(self) -> bool:
        return False
