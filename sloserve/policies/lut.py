"""Batch-size lookup table of draft lengths.

Source rules: Synergy of speculative decoding and batching (Su et al., sec. 4: profile once,
store the best speculation length for batch sizes 1, 2, 4, ...; between two profiled sizes
take the smaller length of the two neighbours); TensorRT-LLM
`speculative_config.draft_len_schedule` ({4: 4, 8: 2, 32: 1}: batch sizes up to 4 draft 4,
5-8 draft 2, 9-32 draft 1, above the largest key speculation is off); vLLM's per-batch-size
speculative token settings follow the same shape.

Lookup (TensorRT-LLM semantics): the entry of the smallest key >= batch size; 0 above the
largest key. For a non-increasing table this equals Synergy's "smaller of the two
neighbours".

Spec strings: `lut` builds the default table from the cost model, the way Synergy's offline
profiling would: for B = 1, 2, 4, ..., 256 the uniform k maximising B * l(a, k) / T_step(k)
at acceptance a = 0.7 and 512 context tokens per request. `lut:1=4,8=2,32=0` gives the table
explicitly (batch size = draft length pairs).
"""

from __future__ import annotations

import numpy as np

from sloserve.estimator.cost_model import CostModel
from sloserve.estimator.efficiency import uniform_efficiency
from sloserve.estimator.step_time import StepTimer
from sloserve.policies.lengths import TargetLengthPolicy
from sloserve.speculation import StepInfo

DEFAULT_ACCEPTANCE = 0.7
DEFAULT_CONTEXT = 512
DEFAULT_MAX_BATCH = 256


def parse_table(text: str) -> dict[int, int]:
    """'1=4,8=2,32=0' -> {1: 4, 8: 2, 32: 0}. Raises ValueError on malformed input."""
    table: dict[int, int] = {}
    for item in text.split(","):
        key, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"lut entry {item!r} is not 'batch=k'")
        bs, k = int(key), int(value)
        if bs < 1 or k < 0:
            raise ValueError(f"lut entry {item!r}: need batch >= 1 and k >= 0")
        table[bs] = k
    return table


def default_table(
    cost: CostModel,
    k_max: int,
    *,
    acceptance: float = DEFAULT_ACCEPTANCE,
    context: int = DEFAULT_CONTEXT,
    max_batch: int = DEFAULT_MAX_BATCH,
) -> dict[int, int]:
    """{batch size: best uniform k} for powers of two up to max_batch, from the cost model."""
    table: dict[int, int] = {}
    bs = 1
    while bs <= max_batch:
        step = StepInfo(
            request_ids=[str(i) for i in range(bs)],
            context_lens=np.full(bs, context, dtype=np.int64),
            tpot_slo=np.full(bs, np.inf),
            k_max=k_max,
        )
        table[bs] = int(np.argmax(uniform_efficiency(StepTimer(cost, step), acceptance, k_max)))
        bs *= 2
    return table


class LookupTablePolicy(TargetLengthPolicy):
    """Uniform k looked up from the batch size."""

    name = "lut"

    def __init__(self, table: dict[int, int], k_max: int) -> None:
        if not table:
            raise ValueError("lut needs at least one entry")
        super().__init__(k_max)
        self.table = dict(sorted(table.items()))
        self._keys = np.array(list(self.table), dtype=np.int64)  # [n] ascending batch sizes
        self._values = np.array(list(self.table.values()), dtype=np.int64)  # [n]

    def k_for(self, batch_size: int) -> int:
        i = int(np.searchsorted(self._keys, batch_size, side="left"))
        return int(self._values[i]) if i < self._keys.size else 0

    def target_lengths(self, step: StepInfo) -> np.ndarray:
        return np.full(step.batch_size, self.k_for(step.batch_size), dtype=np.int64)
