"""Step time of a candidate speculative plan (docs/design.md sec. 2).

A plan gives every request r of the decode batch a number of draft steps s_r and a number
k_r <= s_r of draft tokens it sends to verification. One step then costs

    T_draft  = sum_{j=1..max s} T_fwd(draft; sum_{r: s_r >= j} ctx_{r,j},
                                         B_j + [j == 1] * sum_{r: s_r > 0} lag_r)
               + first_draft * [max s > 0]
    T_verify = T_fwd(target; sum_r n_r + prefill_context,
                             sum_r (k_r + 1) + prefill_tokens)
               + verify_fixed * [sum_r k_r > 0]
    T_step   = T_draft + T_verify + overhead

verify_fixed (CostModel) is what the target's verify path costs over its decode path: a
step that verifies no draft token runs the decode forward, one that verifies any pays it
once, whoever verifies. first_draft (the draft's ForwardCost.first) is the drafter's
per-step setup, likewise paid once by a step that drafts.

T_fwd has the knee of cost_model.py: b is paid only for query tokens past q0 in each forward.

with B_j the requests still drafting at draft step j, n_r the target KV length
(StepInfo.context_lens) and lag_r the tokens the draft model must catch up on
(StepInfo.draft_lag). As for the target (context = KV tokens before the forward), a draft
forward's context is the draft KV length before it: n_r - lag_r at j = 1 (the first forward
feeds lag_r + 1 tokens), n_r + j - 1 after. Draft steps are contiguous from 1 for every
request, so the sums have closed forms and no [B, s] matrix is ever built:

    sum_j ctx_j = sum_r s_r n_r + sum_r s_r (s_r - 1) / 2 - sum_{r: s_r > 0} lag_r
    sum_j B_j   = sum_r s_r,      number of draft forwards = max_r s_r
"""

from __future__ import annotations

import numpy as np

from sloserve.estimator.cost_model import CostModel, ForwardCost
from sloserve.speculation import StepInfo


def draft_lag(step: StepInfo) -> np.ndarray:
    """[B] float64 draft catch-up tokens (zeros when the engine did not say)."""
    if step.draft_lag is None:
        return np.zeros(step.batch_size)
    return np.asarray(step.draft_lag, dtype=np.float64)


def draft_time(draft: ForwardCost, n: np.ndarray, lag: np.ndarray, steps: np.ndarray) -> float:
    """Seconds of the draft forwards when request r drafts steps[r] tokens.

    n: [B] target KV lengths; lag: [B] draft catch-up tokens; steps: [B] int.
    """
    s = np.asarray(steps, dtype=np.float64)  # [B]
    if s.size == 0:
        return 0.0
    n_fwd = float(s.max())
    if n_fwd <= 0.0:
        return 0.0
    lag_drafting = float(lag[s > 0].sum())
    ctx = float(s @ n) + float(s @ (s - 1.0)) * 0.5 - lag_drafting
    if draft.q0 > 0.0:  # the knee applies per forward: B_j = requests drafting step j
        rounds = np.arange(1.0, n_fwd + 1.0)  # [n_fwd]
        batch_j = (s[None, :] >= rounds[:, None]).sum(axis=1).astype(np.float64)  # [n_fwd]
        batch_j[0] += lag_drafting
        q = float(np.maximum(batch_j - draft.q0, 0.0).sum())
    else:
        q = float(s.sum()) + lag_drafting
    return draft.a * ctx + draft.b * q + draft.c * n_fwd + draft.first


def verify_time(target: ForwardCost, ctx_total: float, q_total: float) -> float:
    """Seconds of the one ragged target forward over q_total query tokens."""
    return target.time(ctx_total, q_total)


class StepTimer:
    """Per-step cached quantities of the cost model: build once per decode step.

    Every policy that scores plans during a step shares these sums, so each score is a
    handful of float operations. Catch-up pricing (SpecServe's, policies/specserve/plan.py):
    lag_cap prices at most this many catch-up tokens per request, None the real lag;
    lag_credit ([B] tokens) prices request r's lag less lag_credit[r] but never below
    min(lag, lag_cap) (lag_cap None: 0), the catch-up its forgone gains have paid for.
    Either prices a plan's catch-up below what it takes: `excused` ([B] seconds, the draft's
    b a token) is what each request's catch-up takes past its price, which the plans add
    back where a step's time is held to a TPOT limit (a credit is a reason to draft, not
    a faster forward).
    """

    def __init__(self, cost: CostModel, step: StepInfo, lag_cap: float | None = None,
                 lag_credit: np.ndarray | None = None) -> None:
        self.cost = cost
        self.batch_size = step.batch_size
        self.n = np.asarray(step.context_lens, dtype=np.float64)  # [B] target KV lengths
        self.lag = draft_lag(step)  # [B]
        full = self.lag
        if lag_credit is not None:
            floor = np.minimum(self.lag, lag_cap) if lag_cap is not None else 0.0
            self.lag = np.maximum(self.lag - lag_credit, floor)
        elif lag_cap is not None:
            self.lag = np.minimum(self.lag, lag_cap)
        self.has_lag = bool(np.count_nonzero(self.lag))
        self.excused = cost.draft.b * (full - self.lag)  # [B] seconds, >= 0
        self.has_excused = bool(np.count_nonzero(self.excused))
        self.verify_ctx = float(self.n.sum()) + float(step.prefill_context)
        self.verify_q0 = float(self.batch_size + step.prefill_tokens)  # query tokens at k = 0
        # T of plain decoding (k = 0 for all, no draft forward); a speculating engine's draft
        # model reads the step's prefill chunks too (free for model-free drafters)
        self.plain = verify_time(cost.target, self.verify_ctx, self.verify_q0) + cost.overhead
        # seconds of the step's prefill chunks within plain: what plain decoding of the same
        # decode batch would not pay (0 in a decode-only step)
        self.prefill = 0.0
        if step.prefill_tokens:
            self.plain += cost.draft.time(step.prefill_context, step.prefill_tokens)
            decode_only = verify_time(cost.target, float(self.n.sum()), float(self.batch_size))
            self.prefill = max(0.0, self.plain - decode_only - cost.overhead)
        # verify seconds per extra draft token past the knee
        self.token_time = cost.token_time(self.batch_size)
        # seconds the first verified draft token adds on top of token_time (the verify path)
        self.verify_fixed = cost.verify_fixed
        # seconds a step pays once for its first draft token: the drafter's per-step setup
        # and the verify path (what plans charge when k_total goes from 0 to 1)
        self.step_fixed = cost.draft.first + cost.verify_fixed
        # draft tokens the verify forward takes in before they cost token_time each
        self.free_verify = max(0.0, cost.target.q0 - self.verify_q0)

    def verify_extra(self, k_total):
        """Seconds that verifying k_total draft tokens adds to plain decoding (scalar or
        array): token_time for each token past the target's knee, and verify_fixed once
        for any."""
        k = np.asarray(k_total, dtype=np.float64)
        extra = self.token_time * np.maximum(k - self.free_verify, 0.0)
        if self.verify_fixed:
            extra = extra + np.where(k > 0.0, self.verify_fixed, 0.0)
        return extra

    def paid_verify(self, k_total: float) -> float:
        """How many of k_total verified draft tokens lie past the target's knee."""
        return max(0.0, k_total - self.free_verify)

    def plan(self, drafted: np.ndarray, verified: np.ndarray) -> float:
        """T_step of a plan: drafted [B] draft steps, verified [B] tokens verified."""
        t_draft = draft_time(self.cost.draft, self.n, self.lag, drafted)
        k_total = float(np.sum(verified))
        return t_draft + self.plain + float(self.verify_extra(k_total))

    def draft_token_cost(self, j: int) -> np.ndarray:
        """[B] row j of draft_token_costs: drafting position j + 1 (j = drafted so far)."""
        return self.draft_token_costs(j + 1)[j]

    def draft_token_costs(self, k_max: int) -> np.ndarray:
        """[k_max, B] seconds request r adds to the step by drafting position j + 1 and
        verifying it, excluding the draft forward's fixed cost c, as if no knee: the linear
        part that ranks requests (the adaptive drafter prices the knees exactly per plan)."""
        d = self.cost.draft
        row = d.a * self.n  # [B] j = 0 part, then + a_d j per later position
        row += d.b + self.token_time
        cost = row + (d.a * np.arange(k_max, dtype=np.float64))[:, None]  # [k_max, B]
        if k_max and self.has_lag:
            cost[0] += (d.b - d.a) * self.lag
        return cost

    def uniform(self, k_max: int) -> np.ndarray:
        """[k_max + 1] T_step when every request drafts and verifies k = 0..k_max tokens.

        With S_n = sum_r n_r, S_lag = sum_r lag_r and paid_d(q) = max(0, q - q0_draft):
        T(k) = plain + verify_extra(k B) (verify_fixed included) + k c_d + a_d (k S_n + k (k - 1) B / 2 - S_lag)
        + b_d (paid_d(B + S_lag) + (k - 1) paid_d(B)) + first_d for k >= 1.
        """
        d = self.cost.draft
        b = float(self.batch_size)
        lag = float(self.lag.sum())
        k = np.arange(k_max + 1, dtype=np.float64)  # [K]
        t = self.plain + self.verify_extra(k * b)
        t += k * (d.c + d.a * float(self.n.sum())) + k * (k - 1.0) * (0.5 * d.a * b)
        t[1:] += d.b * (d.paid(b + lag) + (k[1:] - 1.0) * d.paid(b)) - d.a * lag + d.first
        return t


def step_time(cost: CostModel, step: StepInfo, drafted: np.ndarray, verified: np.ndarray) -> float:
    """T_step (seconds) of one plan; see the module docstring."""
    return StepTimer(cost, step).plan(drafted, verified)
