"""The request guard's limits (request_guard.py), apart from the guard: the launcher reads
their defaults for its options before SGLang starts, and the guard's own imports (xgrammar,
transformers: ~4 s on a 2-core CPU) then run beside SGLang's start instead of before it."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class GuardLimits:
    max_n: int = 64
    max_batch_prompts: int = 256
    max_top_logprobs_num: int = 100
    vocab_size: int | None = None  # prompt token ids must lie in [0, vocab_size)
