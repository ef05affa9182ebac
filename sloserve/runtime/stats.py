"""Engine-wide counters: tokens, speculation (per draft position), step times, SLO misses.
Read by /metrics, /server_info and the benchmarks; written only by step_books.account_step
(the engine's and the simulator's step)."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import NamedTuple


class StepRecord(NamedTuple):
    t: float  # wall-clock time.time() at the end of the step
    batch: int  # requests in the step (decoding + prefilling)
    decodes: int  # decoding requests
    mean_proposed: float  # draft tokens proposed per decoding request
    mean_verified: float  # draft tokens verified per decoding request
    step_s: float  # step duration in seconds


@dataclass
class EngineStats:
    k_max: int = 8
    steps: int = 0
    prompt_tokens: int = 0
    generated_tokens: int = 0
    requests_finished: int = 0
    requests_aborted: int = 0
    requests_failed: int = 0  # ended alone by an error in their step's work (isolation)
    preemptions: int = 0
    spec_steps: int = 0  # steps that verified at least one draft token
    verify_steps: int = 0  # request-steps that verified >= 1 draft token
    proposed: int = 0
    verified: int = 0
    accepted: int = 0
    draft_forwards: int = 0
    slo_step_misses: int = 0  # decode steps slower than the tightest TPOT SLO in the batch
    chosen_k: list[int] = field(default_factory=list)  # histogram of verify lengths 0..k_max
    # histogram of accepted draft tokens 0..k_max over request-steps that verified any
    accepted_k: list[int] = field(default_factory=list)
    history: deque = field(default_factory=lambda: deque(maxlen=100000))  # StepRecord per step
    step_time_total: float = 0.0
    policy_time_total: float = 0.0

    def __post_init__(self):
        self.chosen_k = [0] * (self.k_max + 1)
        self.accepted_k = [0] * (self.k_max + 1)

    @property
    def verified_at(self) -> list[int]:
        """[k_max] verifications per draft position: request-steps that verified > j."""
        return _tail_sums(self.chosen_k)

    @property
    def accepted_at(self) -> list[int]:
        """[k_max] acceptances per draft position: request-steps that accepted > j."""
        return _tail_sums(self.accepted_k)

    @property
    def acceptance_rate(self) -> float:
        """accepted / proposed (docs/design.md sec. 11)."""
        return self.accepted / self.proposed if self.proposed else 0.0

    @property
    def verified_acceptance_rate(self) -> float:
        """accepted / verified: acceptance of the tokens the target actually checked."""
        return self.accepted / self.verified if self.verified else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """1 + accepted / verify steps (bonus token included), as SGLang reports it."""
        return 1.0 + self.accepted / self.verify_steps if self.verify_steps else 1.0

    def snapshot(self) -> dict:
        d = {k: v for k, v in vars(self).items() if k not in ("history", "accepted_k")}
        d["verified_at"] = self.verified_at
        d["accepted_at"] = self.accepted_at
        d["acceptance_rate"] = self.acceptance_rate
        d["verified_acceptance_rate"] = self.verified_acceptance_rate
        d["mean_accepted_length"] = self.mean_accepted_length
        return d


def _tail_sums(hist: list[int]) -> list[int]:
    """[len(hist) - 1] out[j] = sum(hist[j + 1:])."""
    out, total = [0] * (len(hist) - 1), 0
    for j in range(len(hist) - 1, 0, -1):
        total += hist[j]
        out[j - 1] = total
    return out
