"""The speculation contract: what a caller (the built-in engine, the simulator, an SGLang
worker) and a speculation policy exchange every decode step, as plain values.

A policy lives across steps and holds what it learns (calibration, per-request histories,
cost corrections). Each decode step it hands the caller a plan; everything that belongs to
that one step lives in the plan, which the caller carries through the step and hands back:

    plan = policy.plan(step)                  # StepInfo -> SpecPlan
    drafting = plan.drafting                  # [B] bool: who drafts position 1
    j = 0
    while j < step.k_max and drafting.any():
        one draft round for the requests in `drafting`: confidences[:, j]
        j += 1
        drafting = plan.extend(confidences[:, :j], drafted_now)   # after EVERY round
    k = plan.verify_lengths(confidences[:, :s], drafted)           # [B] 0 <= k_r <= s_r
    ... one ragged target forward verifies k_r + 1 tokens per request ...
    policy.observe(plan, outcome)             # VerifyOutcome

A caller that must fix one draft length for the whole batch before drafting (SGLang's
speculative workers run a fixed number of draft steps) asks a SpecServe plan for
`uniform_rounds()` instead of calling extend, and reports [B, 0] confidences if it has none.

`drafted_now` is the subset of `drafting` that really drafted position j (a model-free
drafter may find no proposal for some); `extend` returns a subset of it (nobody past
step.k_max). `confidences[r, j]` is the drafter's probability of the token it proposed at
draft position j (the draft model's processed distribution, or the n-gram drafter's
empirical frequency), NaN where request r did not draft position j. A request that stops
drafting never restarts within the step (the built-in engine's and the simulator's loop:
sloserve/runtime/spec/rounds.py). Policies see only CPU-side numbers (numpy arrays),
never tensors or models, so each is tested without a model. Request-level state is keyed by
request id and dropped on `release`. The design and its math: docs/design.md.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class StepInfo:
    """The decode batch of one step, as the policy sees it. Arrays are indexed by batch row."""

    request_ids: Sequence[str]  # [B] stable ids of the decoding requests
    context_lens: np.ndarray  # [B] int64: tokens already in the target KV cache per request
    tpot_slo: np.ndarray  # [B] float64 seconds; np.inf where the request has no TPOT SLO
    k_max: int  # most draft tokens any request may get this step
    prefill_tokens: int = 0  # query tokens of prefill chunks sharing this step's target forward
    prefill_context: int = 0  # context tokens those prefill chunks attend to
    draft_lag: np.ndarray | None = None  # [B] int64: tokens the draft model must catch up on
    # before its first draft token (0 or 1 usually; >1 after steps without drafting)

    @property
    def batch_size(self) -> int:
        return len(self.request_ids)


@dataclass(frozen=True)
class VerifyOutcome:
    """What one verify pass produced, fed back to the policy."""

    drafted: np.ndarray  # [B] int: draft tokens proposed per request (s_r)
    verified: np.ndarray  # [B] int: draft tokens sent to verification (k_r <= s_r)
    accepted: np.ndarray  # [B] int: draft tokens accepted (<= k_r); emitted = accepted + 1
    # [B, s_max] float, NaN beyond s_r; [B, 0] from a caller that drafted without knowing the
    # draft tokens' confidences (the policy then learns from the accepted counts alone)
    confidences: np.ndarray
    step_time: float  # measured wall time of the whole step in seconds (draft + verify + rest)
    draft_time: float  # measured wall time of the draft forwards in seconds
    # measured wall time of the target (verify) forward in seconds; None where not measured
    verify_time: float | None = None


class SpecPlan(ABC):
    """One decode step's speculation decisions. Built by `SpecPolicy.plan`; valid for that
    step only. `drafting` ([B] bool) is who drafts the next position: at creation, position
    1 (all False = plain decoding); `extend` replaces it."""

    step: StepInfo
    drafting: np.ndarray

    @abstractmethod
    def extend(self, confidences: np.ndarray, drafting: np.ndarray) -> np.ndarray:
        """After draft position j = confidences.shape[1], which the requests in `drafting`
        drafted: [B] bool, a subset of `drafting`, of requests that draft position j + 1
        (none once j reaches step.k_max). Called after every draft round."""

    @abstractmethod
    def verify_lengths(self, confidences: np.ndarray, drafted: np.ndarray) -> np.ndarray:
        """[B] int64 k_r with 0 <= k_r <= drafted[r]: draft tokens each request verifies.
        confidences: [B, s] with s = drafted.max()."""


class SpecPolicy(ABC):
    """Decides, every step and per request, how many tokens to draft and to verify."""

    name: str = "policy"

    @abstractmethod
    def plan(self, step: StepInfo) -> SpecPlan:
        """The plan of a new decode step."""

    def observe(self, plan: SpecPlan, outcome: VerifyOutcome) -> None:  # noqa: B027
        """Feedback after verification (calibration, moving averages). Default: nothing."""

    def release(self, request_id: str) -> None:  # noqa: B027
        """The request finished or was aborted: drop its state. Default: nothing."""

    @property
    def speculates(self) -> bool:
        """False for policies that never draft (the caller then skips the draft model)."""
        return True
