"""Requests and sampling parameters: the single source of truth for a request's lengths.

Invariants (target model): `kv_len` tokens of `all_ids` are in the target KV cache; the tokens
`all_ids[kv_len:]` are still to be computed (a prefill chunk, or the last token of a decode).
While decoding, kv_len == len(all_ids) - 1. The draft model's cache holds `draft_kv_len` <=
len(all_ids) - 1 tokens (it may lag: it catches up before its next draft token).
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from sloserve.runtime.errors import InvalidRequest
from sloserve.runtime.sampling_params import (  # noqa: F401  # re-exported: callers' old path
    GREEDY_TEMPERATURE,
    SEED_RANGE,
    SamplingParams,
    expand_samples,
)

if TYPE_CHECKING:
    from sloserve.runtime.constraints import RequestConstraints
    from sloserve.runtime.logprobs import TokenLogprobs

__all__ = ["InvalidRequest", "SamplingParams", "Request", "expand_samples"]


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class FinishReason(enum.Enum):
    LENGTH = "length"
    STOP = "stop"  # EOS, a stop token id or a stop string
    ABORT = "abort"


@dataclass
class SpecStats:
    verify_steps: int = 0  # steps in which the request verified >= 1 draft token
    proposed: int = 0  # draft tokens generated
    verified: int = 0  # draft tokens sent to the target
    accepted: int = 0  # draft tokens accepted


@dataclass
class Request:
    rid: str
    prompt_ids: list[int]
    params: SamplingParams
    arrival: float = 0.0
    output_ids: list[int] = field(default_factory=list)
    status: Status = Status.WAITING
    finish_reason: FinishReason | None = None
    matched_stop: str | int | None = None
    blocks: list[int] = field(default_factory=list)  # KV blocks, shared by target and draft
    kv_len: int = 0  # tokens of all_ids in the target KV cache
    draft_kv_len: int = 0  # tokens of all_ids in the draft KV cache
    num_preemptions: int = 0
    generator: torch.Generator | None = None
    spec: SpecStats = field(default_factory=SpecStats)
    first_token_time: float | None = None
    finish_time: float | None = None
    output_text: str = ""  # detokenized output, stop string trimmed
    text_sent: int = 0  # characters of output_text already handed to the client
    # penalties / grammar / min_new_tokens state (None when params.constrained is False)
    constraints: RequestConstraints | None = None
    # output token log-probabilities so far (None unless params.logprobs is set)
    logprobs: TokenLogprobs | None = None
    # why the engine ended this request alone (its step's work raised); None otherwise
    error: str | None = None

    def __post_init__(self):
        if self.params.seed is not None:
            self.generator = torch.Generator().manual_seed(self.params.seed)

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def pending_len(self) -> int:
        """Tokens to run through the target before the next token can be sampled."""
        return self.num_tokens - self.kv_len

    @property
    def is_decoding(self) -> bool:
        return self.status is Status.RUNNING and self.pending_len == 1

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED

    def room(self, max_context: int | None = None) -> int:
        """Tokens it may still append before a length limit stops it: max_new_tokens, and
        the context window when given."""
        left = self.params.max_new_tokens - len(self.output_ids)
        if max_context is not None:
            left = min(left, max_context - self.num_tokens)
        return left

    def reset_for_recompute(self) -> None:
        """Preemption by recompute: the caller freed the blocks; all KV is gone."""
        self.blocks = []
        self.kv_len = 0
        self.draft_kv_len = 0
        self.status = Status.WAITING
        self.num_preemptions += 1


def validate_prompt(prompt_ids: Sequence[int], vocab_size: int, max_context: int) -> None:
    if len(prompt_ids) == 0:
        raise InvalidRequest("prompt", "is empty")
    if len(prompt_ids) >= max_context:
        raise InvalidRequest(
            "prompt",
            f"has {len(prompt_ids)} tokens; the context window is {max_context} "
            "(prompt + at least one generated token must fit)",
        )
    bad = [t for t in prompt_ids if not (0 <= int(t) < vocab_size)]
    if bad:
        raise InvalidRequest("input_ids", f"token id {bad[0]} outside the vocabulary [0, {vocab_size})")
