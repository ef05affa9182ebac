"""SLO-aware efficiency estimator (docs/design.md sec. 4, SpecServe Alg. 3).

    E(k_1..k_B) = sum_r l_r(k_r) / T_step

Worst-case TPOT rule: a request may accept nothing and emit one token this step, so its TPOT
for the step is T_step. A speculative plan whose T_step exceeds the binding SLO (the
tightest TPOT SLO in the batch) scores -1; plain decoding (k = 0 for all, no draft forward)
is the fallback and is never rejected, so speculation is off whenever even k = 0 breaks the
SLO.

`score` / `scores` are the single scorer: the adaptive drafter and the confidence-prior
verifier both keep the token sum and the step time of their current plan incrementally
(StepTimer gives the per-token time deltas) and call these on the candidates.
"""

from __future__ import annotations

import numpy as np

from sloserve.estimator.acceptance import expected_tokens, geometric_tokens
from sloserve.estimator.cost_model import CostModel
from sloserve.estimator.step_time import StepTimer
from sloserve.speculation import StepInfo

SLO_VIOLATION = -1.0


def binding_slo(step: StepInfo) -> float:
    """The tightest step-time limit of the batch in seconds (inf when none has one): the
    TPOT SLOs, or the allowances a policy derived from them (StepInfo.step_limits)."""
    if step.batch_size == 0:
        return float("inf")
    slo = np.asarray(step.step_limits)
    return float(slo[slo.argmin()])  # min() without a reduction's overhead (every step)


def score(tokens: float, step_time: float, slo: float, plain: bool = False) -> float:
    """E of one plan: expected tokens per second, or -1 when a speculative plan breaks the
    SLO. `plain` marks the no-speculation plan, which is never rejected."""
    if not plain and step_time > slo:
        return SLO_VIOLATION
    return tokens / step_time


def scores(tokens: np.ndarray, step_times: np.ndarray, slo: float) -> np.ndarray:
    """Vectorised `score` over speculative candidates ([N] each)."""
    e = tokens / step_times
    if slo < float("inf"):
        e[step_times > slo] = SLO_VIOLATION
    return e


def plan_efficiency(
    cost: CostModel, step: StepInfo, P: np.ndarray, drafted: np.ndarray, verified: np.ndarray
) -> float:
    """Reference (non-incremental) E of a full plan. P: [B, s] chain probabilities;
    drafted, verified: [B] int. Used by tests and benchmarks; the policies use the
    incremental forms."""
    timer = StepTimer(cost, step)
    t = timer.plan(drafted, verified)
    tokens = float(expected_tokens(P, verified).sum())
    plain = not np.any(np.asarray(drafted) > 0)
    return score(tokens, t, binding_slo(step), plain=plain)


def uniform_efficiency(
    timer: StepTimer, acceptance: float, k_max: int, slo: float = float("inf")
) -> np.ndarray:
    """[k_max + 1] E when every request drafts and verifies the same k = 0..k_max tokens
    with per-token acceptance `acceptance` (SmartSpec Alg. 1, plus the SLO rule)."""
    k = np.arange(k_max + 1)
    tokens = timer.batch_size * geometric_tokens(acceptance, k)  # [K]
    e = scores(tokens, timer.uniform(k_max), slo)
    e[0] = tokens[0] / timer.plain  # plain decoding is never rejected
    return e
