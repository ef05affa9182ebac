"""What is sent (`ReplayRequest`) and what is measured (`RequestRecord`, `SpecStats`).

Times in records are seconds relative to the start of the run (the instant arrival 0 maps
to), measured by the client (the target's side of the wire), like `vllm bench serve`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass(frozen=True)
class ReplayRequest:
    """One request to send: exactly one of `text` / `input_ids` is set.

    max_new_tokens is the trace's output length; with ignore_eos the server generates exactly
    that many tokens, so the replayed load matches the trace whatever the model says.
    """

    request_id: str
    arrival_s: float  # seconds after the run start at which to send it (open loop)
    max_new_tokens: int
    text: str | None = None
    input_ids: tuple[int, ...] | None = None
    ignore_eos: bool = True
    category: str | None = None
    ttft_slo_s: float | None = None  # per-request SLOs (None: the run's default SLO)
    tpot_slo_s: float | None = None
    prompt_tokens: int | None = None  # expected prompt length in tokens, when known

    def __post_init__(self) -> None:
        if (self.text is None) == (self.input_ids is None):
            raise ValueError(f"{self.request_id}: set exactly one of text and input_ids")
        if self.max_new_tokens < 1:
            raise ValueError(f"{self.request_id}: max_new_tokens must be >= 1")


@dataclass(frozen=True)
class RequestRecord:
    """Client-side measurements of one request.

    chunk_s[i] is when the i-th streamed chunk carrying new tokens arrived and
    chunk_tokens[i] the cumulative output token count after it (a chunk may carry several
    tokens: speculative decoding emits accepted + 1 per step). Chunks that carry no new token
    are not recorded. For a successful request, output_tokens == chunk_tokens[-1].
    """

    request_id: str
    scheduled_s: float  # intended send time (the request's arrival)
    send_s: float  # actual send time
    end_s: float  # when the response finished (success) or failed
    chunk_s: tuple[float, ...] = ()
    chunk_tokens: tuple[int, ...] = ()
    prompt_tokens: int = 0
    output_tokens: int = 0
    success: bool = True
    error: str | None = None
    category: str | None = None
    ttft_slo_s: float | None = None
    tpot_slo_s: float | None = None

    def __post_init__(self) -> None:
        if len(self.chunk_s) != len(self.chunk_tokens):
            raise ValueError(f"{self.request_id}: chunk_s and chunk_tokens differ in length")
        if any(b < a for a, b in zip(self.chunk_s, self.chunk_s[1:])):
            raise ValueError(f"{self.request_id}: chunk times must be non-decreasing")
        if any(b <= a for a, b in zip(self.chunk_tokens, self.chunk_tokens[1:])) or (
            self.chunk_tokens and self.chunk_tokens[0] < 1
        ):
            raise ValueError(f"{self.request_id}: cumulative chunk tokens must be >= 1, rising")
        if self.success:
            if not self.chunk_s:
                raise ValueError(f"{self.request_id}: a successful request has >= 1 chunk")
            if self.output_tokens != self.chunk_tokens[-1]:
                raise ValueError(f"{self.request_id}: output_tokens != last cumulative count")
            if self.chunk_s[0] < self.send_s:
                raise ValueError(f"{self.request_id}: first chunk before the send time")

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["chunk_s"] = list(self.chunk_s)
        d["chunk_tokens"] = list(self.chunk_tokens)
        return d

    @staticmethod
    def from_dict(d: dict[str, Any]) -> RequestRecord:
        return RequestRecord(**{**d, "chunk_s": tuple(d["chunk_s"]),
                                "chunk_tokens": tuple(d["chunk_tokens"])})


@dataclass(frozen=True)
class StepSample:
    """One engine step, for the time-series plots."""

    t_s: float  # seconds since the run start
    batch_size: int  # decoding requests in the step
    mean_draft_len: float  # mean draft tokens proposed per request this step
    mean_verify_len: float = 0.0  # mean draft tokens verified per request this step


@dataclass(frozen=True)
class SpecStats:
    """Engine-side speculation counters of one run, passed through to the report.

    Field names and counting follow the engine's counters (sloserve/runtime/stats.py):
    verify_steps counts request-steps that verified >= 1 draft token, so mean accepted
    length = 1 + accepted / verify_steps is the tokens emitted per request per verify
    (SGLang's accept length); mean proposed / verified k are per such request-step.
    """

    steps: int = 0  # engine steps
    verify_steps: int = 0  # request-steps that verified >= 1 draft token
    proposed: int = 0  # draft tokens drafted
    verified: int = 0  # draft tokens sent to verification
    accepted: int = 0  # draft tokens accepted
    controller_time_s: float = 0.0  # total time in the speculation policy (policy_time_total)
    timeseries: tuple[StepSample, ...] = field(default_factory=tuple)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["timeseries"] = [asdict(s) for s in self.timeseries]
        return d

    @staticmethod
    def from_dict(d: dict[str, Any]) -> SpecStats:
        series = tuple(StepSample(**s) for s in d.get("timeseries", ()))
        return SpecStats(**{**d, "timeseries": series})


@dataclass(frozen=True)
class PolicyRun:
    """The outcome of replaying one workload with one policy."""

    policy: str
    records: tuple[RequestRecord, ...]
    spec_stats: SpecStats | None = None


Progress = Callable[[RequestRecord], None]  # called once per finished request
