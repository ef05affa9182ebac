"""Requests and sampling parameters: the single source of truth for a request's lengths.

Invariants (target model): `kv_len` tokens of `all_ids` are in the target KV cache; the tokens
`all_ids[kv_len:]` are still to be computed (a prefill chunk, or the last token of a decode).
While decoding, kv_len == len(all_ids) - 1. The draft model's cache holds `draft_kv_len` <=
len(all_ids) - 1 tokens (it may lag: it catches up before its next draft token).
"""

from __future__ import annotations

import enum
import math
import numbers
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

# Below this temperature sampling is argmax, as in SGLang (its _SAMPLING_EPS): logits / T
# would overflow float32 (1e-40 is a float32 zero, 1e-300 too) and give NaN probabilities.
GREEDY_TEMPERATURE = 1e-6
SEED_RANGE = (-(2**63), 2**64 - 1)  # what torch.Generator.manual_seed accepts


class InvalidRequest(ValueError):
    """Bad input from a client; the message names the field."""

    def __init__(self, field_name: str, message: str):
        super().__init__(f"{field_name}: {message}")
        self.field = field_name


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 or 0 = off
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    tpot_slo: float | None = None  # seconds per output token this request asks for
    ttft_slo: float | None = None  # seconds to first token

    def __post_init__(self):
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        if not isinstance(self.stop, (list, tuple)):
            raise InvalidRequest("stop", f"must be a string or a list of strings, got "
                                 f"{self.stop!r:.40}")
        object.__setattr__(self, "stop", tuple(self.stop))
        ids = self.stop_token_ids
        if not isinstance(ids, (list, tuple)) or not all(_is_int(t) for t in ids):
            raise InvalidRequest("stop_token_ids", f"must be a list of integers, got {ids!r:.40}")
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in ids))
        self.validate()

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE

    def validate(self) -> None:
        def bad(name, msg):
            raise InvalidRequest(name, msg)

        # types first: the in-process API gets whatever a caller passes
        for name in ("temperature", "top_p", "tpot_slo", "ttft_slo"):
            v = getattr(self, name)
            if not (_is_real(v) or (v is None and name.endswith("_slo"))):
                bad(name, f"must be a number, got {v!r:.40}")
        if not isinstance(self.ignore_eos, bool):
            bad("ignore_eos", f"must be true or false, got {self.ignore_eos!r:.40}")
        if not _is_int(self.max_new_tokens):
            bad("max_new_tokens", f"must be an integer, got {self.max_new_tokens!r:.40}")
        if self.max_new_tokens <= 0:
            bad("max_new_tokens", f"must be > 0, got {self.max_new_tokens}")
        if not math.isfinite(self.temperature) or self.temperature < 0:
            bad("temperature", f"must be >= 0, got {self.temperature}")
        if not (0.0 < self.top_p <= 1.0):
            bad("top_p", f"must be in (0, 1], got {self.top_p}")
        if not _is_int(self.top_k) or self.top_k < -1:
            bad("top_k", f"must be -1 (off) or a positive integer, got {self.top_k!r}")
        if self.seed is not None and not (
                _is_int(self.seed) and SEED_RANGE[0] <= self.seed <= SEED_RANGE[1]):
            bad("seed", f"must be an integer in [-2**63, 2**64 - 1], got {self.seed!r:.40}")
        if any(not isinstance(s, str) or s == "" for s in self.stop):
            bad("stop", "stop strings must be non-empty strings")
        for name in ("tpot_slo", "ttft_slo"):
            v = getattr(self, name)
            if v is not None and not (v > 0 and math.isfinite(v)):
                bad(name, f"must be a positive number of seconds, got {v}")


def _is_int(x) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def _is_real(x) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, bool)


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
