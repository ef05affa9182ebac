"""AdaServe's SLO-customized token selection (Li et al., "AdaServe: Accelerating Multi-SLO
LLM Serving with SLO-Customized Speculative Decoding", arXiv 2501.12162), on chains.

Source rule (the paper's speculate-select-verify pipeline): the draft model first builds a
candidate token tree per request; every candidate token carries its path probability (the
product of the draft's probabilities along its path), AdaServe's estimate of the chance the
target accepts it, so the expected accepted tokens of a selection are the sum of the selected
path probabilities. Selection then spends a per-iteration token budget (what the hardware
verifies at little extra latency) in two phases:
1. SLO-customized: each request needs enough expected accepted tokens this iteration to stay
   on its TPOT SLO; per request, the highest path probabilities are taken greedily until that
   need is met (the paper proves greedy by path probability optimal for a probability target
   under a budget; when the needs exceed the budget, not all can be met).
2. Throughput-optimized: the rest of the budget goes to the candidates with the highest path
   probability across all requests.
Then one verify forward checks the selected tokens. AdaServe also adapts its speculation
parameters to the load: the tree's depth follows the budget per request.

The paper's text is not in this repository; where it leaves a case open (needs beyond the
budget, the depth rule) we follow its authors' implementation (FlexFlow Serve, branch
`specscheduler`, src/runtime/request_manager.cc: `prune_token_tree`, `add_tokens_toward_slo`,
`update_token_tree_depth`), read for its rules, not copied. It:
- sizes the draft tree to the budget: depth = min(max depth, ceil(budget / B)), the budget
  counting every request's verify row (its root);
- caps each request's need at the tree's depth (at least the root), so a request that is
  already far behind needs no more than every token it drafted;
- meets the needs one request at a time in ascending need, each taking at most
  1.2 x budget / B tokens, until the budget is spent: the requests closest to their SLO are
  kept first, and a request that no single iteration can bring back is served last;
- spends what is left on the highest path probabilities across requests (phase 2).

Here (our adaptation):
- chains, not trees: every request drafts the step's depth greedily (topk 1), so its
  candidates are positions 1..depth and the selected tokens are always a prefix;
- path probability = the calibrated chain probability P_{r,j} = prod g(c) (docs/design.md
  sec. 3), the same map specserve uses, learned online from the verify outcomes;
- the need of request r with TPOT SLO s_r, after `elapsed_r` decode seconds and `tokens_r`
  tokens (request_clock.py), for a step predicted to take T (the cost model, everything
  drafted verified): emit (elapsed_r + T) / s_r - tokens_r tokens, i.e. expected accepted
  draft tokens need_r = that - 1 (the verify's own token), capped at the step's depth;
- the token budget (the verify forward's query tokens of the decode batch, its B own rows
  included): the target's roofline knee q0 when profiled, else c_t / b_t (where the
  forward's compute equals its fixed weight-read cost). The authors' engine runs prefill in
  iterations of its own, so its budget is a decode iteration's; ours fuses prefill chunks
  into the verify forward, and under the linear cost model a draft row costs b_t there
  whether a chunk rides along or not, so the budget stays the decode batch's and the chunk
  is priced in the step time only (spending it on the chunk first left 34% of the steps at
  4x load with no row for a draft token, and the old rule drafted 4 tokens there anyway);
- the depth of a step is min(D, ceil(budget / B)), 0 when the B verify rows use up the
  budget (nothing drafted could be verified); `adaserve:D` sets the most rounds D
  (default 4);
- the step time T of the needs carries the authors' correction factor 1.05 (the need of a
  request on its SLO is then a little over what keeps it there, not exactly that).
"""

from __future__ import annotations

import math

import numpy as np

from sloserve.estimator.acceptance import ConfidenceCalibrator, chain_probs
from sloserve.estimator.cost_model import CostModel
from sloserve.estimator.step_time import StepTimer
from sloserve.policies.request_clock import RequestClock
from sloserve.speculation import SpecPlan, SpecPolicy, StepInfo, VerifyOutcome

ADASERVE_DEPTH = 4
# most draft tokens one request takes toward its SLO, as a multiple of the budget per request
# (the authors' implementation: 1.2 x tokens per batch / requests)
SLO_SHARE = 1.2
# the step time of the needs is scaled by this (the authors' correction factor)
STEP_TIME_MARGIN = 1.05


def default_token_budget(cost: CostModel) -> int:
    """Verify query tokens per iteration: the target's knee, else where b_t N = c_t."""
    t = cost.target
    if t.q0 > 0.0:
        return max(1, int(t.q0))
    if t.b <= 0.0:
        return 1 << 20  # free tokens: no budget binds
    return max(1, int(t.c / t.b))


def step_depth(max_depth: int, rows: int, batch: int) -> int:
    """Draft rounds of the step for a budget of `rows` verify tokens, the B requests' own
    rows included: min(max_depth, ceil(rows / B)) (AdaServe's depth rule; ceil(rows / B) is
    ceil(draft share) + 1, so a chain reaches one token past its share of the draft tokens,
    which phase 2 gives to the likelier ones), 0 when the B rows use up `rows` (no draft
    token could be verified)."""
    if batch <= 0 or max_depth <= 0 or rows <= batch:
        return 0
    return min(max_depth, math.ceil(rows / batch))


def slo_cap(rows: int, batch: int) -> int:
    """Most draft tokens one request takes in phase 1: int(SLO_SHARE x rows / B)."""
    return max(0, int(SLO_SHARE * rows / batch)) if batch > 0 else 0


def select_tokens(P: np.ndarray, drafted: np.ndarray, need: np.ndarray, budget: int,
                  cap: int | None = None) -> np.ndarray:
    """[B] tokens each request verifies: phase 1 meets the needs, phase 2 spends what is left
    of `budget` (draft tokens) on the highest path probabilities.

    Phase 1 serves the requests with a need in ascending need (ties in batch order): each
    takes its fewest leading tokens whose path probabilities reach its need (all it drafted
    if none do), at most `cap` (None: no cap), while the budget lasts; the request the
    budget runs out on gets what is left, those after it nothing.

    P: [B, s] path probabilities (non-increasing along a row); drafted: [B] valid positions;
    need: [B] expected accepted tokens wanted (<= 0: none)."""
    B, s = P.shape
    drafted = np.asarray(drafted, dtype=np.int64)
    need = np.asarray(need, dtype=np.float64)
    k = np.zeros(B, dtype=np.int64)
    if B == 0 or s == 0 or budget <= 0:
        return k
    pos = np.arange(s)
    valid = pos[None, :] < drafted[:, None]  # [B, s]
    Pv = np.where(valid, P, 0.0)
    # phase 1: the fewest leading tokens whose path probabilities reach the need
    cum = np.cumsum(Pv, axis=1)
    reach = (cum >= need[:, None]) & valid
    first = np.where(reach.any(axis=1), reach.argmax(axis=1) + 1, drafted)
    want = np.where(need > 0.0, first, 0)
    if cap is not None:
        want = np.minimum(want, max(0, cap))
    order = np.argsort(need, kind="stable")  # ascending need; rows without one want 0
    wanted = want[order]
    before = np.cumsum(wanted) - wanted  # tokens the requests ahead took
    k[order] = np.clip(budget - before, 0, wanted)
    left = budget - int(k.sum())
    # phase 2: the highest path probabilities left, across requests
    if left > 0:
        cand = valid & (pos[None, :] >= k[:, None])
        rows, cols = np.nonzero(cand)  # row-major: within a row in position order
        if rows.size:
            top = np.argsort(-Pv[rows, cols], kind="stable")[:left]
            k += np.bincount(rows[top], minlength=B)
    return k


class AdaServePlan(SpecPlan):
    """Draft the step's depth each, then select what to verify (select_tokens)."""

    def __init__(self, step: StepInfo, policy: AdaServePolicy, depth: int) -> None:
        self.step = step
        self.policy = policy
        self.depth = depth
        self.drafting = np.full(step.batch_size, depth > 0)

    def extend(self, confidences: np.ndarray, drafting: np.ndarray) -> np.ndarray:
        return drafting & (confidences.shape[1] < self.depth)

    def verify_lengths(self, confidences: np.ndarray, drafted: np.ndarray) -> np.ndarray:
        drafted = np.asarray(drafted, dtype=np.int64)
        if confidences.shape[1] == 0 or not np.count_nonzero(drafted):
            return drafted.copy()
        pol, step = self.policy, self.step
        B = step.batch_size
        P = chain_probs(pol.g(np.asarray(confidences, dtype=np.float64)))
        predicted = StepTimer(pol.cost, step).plan(drafted, drafted)  # prefill included
        # a need past the chain asks for every token drafted: capped at the depth, phase 1
        # does not rank requests by how far behind they already are
        need = np.minimum(pol.needs(step, STEP_TIME_MARGIN * predicted), float(self.depth))
        budget = pol.token_budget
        return select_tokens(P, drafted, need, budget - B, slo_cap(budget, B))


class AdaServePolicy(SpecPolicy):
    """AdaServe's two-phase selection over greedy draft chains (see the module docstring)."""

    name = "adaserve"

    def __init__(self, cost: CostModel, k_max: int, *, depth: int = ADASERVE_DEPTH,
                 token_budget: int | None = None,
                 calibrator: ConfidenceCalibrator | None = None) -> None:
        if k_max < 0 or depth < 0:
            raise ValueError(f"k_max and depth must be >= 0, got {k_max}, {depth}")
        self.cost = cost
        self.k_max = k_max
        self.depth = min(depth, k_max)
        self.token_budget = default_token_budget(cost) if token_budget is None else token_budget
        self.g = calibrator or ConfidenceCalibrator()
        self.clock = RequestClock()

    def seed_calibration(self, counts: np.ndarray) -> None:
        self.g.seed(counts)

    def needs(self, step: StepInfo, step_time: float) -> np.ndarray:
        """[B] expected accepted draft tokens each request needs from a step of
        `step_time` seconds to be on its TPOT SLO after it (0 without an SLO)."""
        elapsed, tokens = self.clock.progress(step.request_ids)
        slo = np.asarray(step.tpot_slo, dtype=np.float64)
        need = (elapsed + step_time) / slo - tokens - 1.0  # inf SLO: -tokens - 1 <= -1
        return np.maximum(need, 0.0)

    def plan(self, step: StepInfo) -> SpecPlan:
        self.clock.track(step.request_ids)
        depth = step_depth(max(0, min(self.depth, step.k_max)), self.token_budget,
                           step.batch_size)
        return AdaServePlan(step, self, depth)

    def observe(self, plan: SpecPlan, outcome: VerifyOutcome) -> None:
        self.g.update(outcome.confidences, outcome.verified, outcome.accepted)
        self.clock.record(plan.step.request_ids, outcome.step_time,
                          np.asarray(outcome.accepted) + 1, outcome.end_time)

    def release(self, request_id: str) -> None:
        self.clock.release(request_id)
