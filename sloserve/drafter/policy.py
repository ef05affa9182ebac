"""The speculation policy interface: how the engine asks "how much to speculate?".

The engine (mechanism) calls a policy at fixed points of every decode step; the policy only
sees CPU-side numbers (numpy arrays), never tensors or models, so every policy is unit-tested
without a model. Call order within one step:

    drafting = policy.start(step)                         # [B] bool, who drafts token 1
    j = 1
    while drafting.any() and j <= step.k_max:
        run one draft forward for the requests in `drafting`, giving confidences[:, j-1]
        if j < step.k_max:   # no extend after position k_max: drafting stops there anyway
            drafting = policy.extend(step, confidences[:, :j], drafting)  # subset of drafting
        j += 1
    k = policy.verify_lengths(step, confidences, drafted)  # [B] int, 0 <= k_r <= drafted_r
    ... one ragged target forward verifies k_r + 1 tokens per request ...
    policy.observe(step, outcome)

`confidences[r, j]` is the drafter's probability of the token it proposed at draft position
j (the draft model's processed distribution, or the n-gram drafter's empirical frequency);
NaN where request r did not draft position j. A request that stops drafting never restarts
within the same step. Request-level state (moving averages, histories) is keyed by request id
and dropped on `release`.
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
    confidences: np.ndarray  # [B, s_max] float, NaN beyond s_r
    step_time: float  # measured wall time of the whole step in seconds (draft + verify + rest)
    draft_time: float  # measured wall time of the draft forwards in seconds
    # measured wall time of the target (verify) forward in seconds; None where not measured
    verify_time: float | None = None


class SpecPolicy(ABC):
    """Decides, every step and per request, how many tokens to draft and to verify."""

    name: str = "policy"

    @abstractmethod
    def start(self, step: StepInfo) -> np.ndarray:
        """[B] bool: requests that draft a first token this step (all False = plain decode)."""

    @abstractmethod
    def extend(self, step: StepInfo, confidences: np.ndarray, drafting: np.ndarray) -> np.ndarray:
        """After draft position j = confidences.shape[1]: [B] bool, a subset of `drafting`,
        of requests that draft position j + 1. The engine stops at step.k_max anyway."""

    @abstractmethod
    def verify_lengths(
        self, step: StepInfo, confidences: np.ndarray, drafted: np.ndarray
    ) -> np.ndarray:
        """[B] int64 k_r with 0 <= k_r <= drafted[r]: draft tokens each request verifies."""

    def observe(self, step: StepInfo, outcome: VerifyOutcome) -> None:  # noqa: B027
        """Feedback after verification (calibration, moving averages). Default: nothing."""

    def release(self, request_id: str) -> None:  # noqa: B027
        """The request finished or was aborted: drop its state. Default: nothing."""

    @property
    def speculates(self) -> bool:
        """False for policies that never draft (the engine then skips the draft model)."""
        return True
