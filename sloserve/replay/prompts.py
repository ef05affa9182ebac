"""Prompt sources: give each trace request a prompt, then build `ReplayRequest`s.

A trace says when a request arrives and how many tokens go in and out, not what the prompt
is. A `PromptSource` fills that in:

- `SyntheticIdsSource`: random token ids of exactly the trace's input length (tokenizer-free;
  ids drawn from [id_low, vocab_size) so special tokens can be avoided). Requests carrying
  Mooncake `prefix_hash_ids` get one fixed random block per hash id, so requests sharing a
  prefix share those tokens (what prefix caching sees).
- `SyntheticTextSource`: text from a word list, sized to the trace's input length by a
  tokenizer callback `count_tokens(text) -> int` (binary search on the word count).
- `SpecBenchSource` (specbench.py): real Spec-Bench prompts picked by category.

The output length always comes from the trace: max_new_tokens = output_tokens with
ignore_eos, so the load does not depend on what the model generates.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from sloserve.replay.records import ReplayRequest
from sloserve.replay.trace import TraceRequest


@dataclass(frozen=True)
class Prompt:
    """A prompt: exactly one of text / input_ids; num_tokens when the length is known."""

    text: str | None = None
    input_ids: tuple[int, ...] | None = None
    num_tokens: int | None = None


class PromptSource(Protocol):
    """Chooses the prompt of a trace request (deterministic given the rng state)."""

    def prompt_for(self, request: TraceRequest, rng: np.random.Generator) -> Prompt:
        """The prompt for `request`, drawing any randomness from `rng`."""
        ...


def build_requests(
    trace: Sequence[TraceRequest],
    source: PromptSource,
    seed: int,
    ignore_eos: bool = True,
) -> list[ReplayRequest]:
    """One `ReplayRequest` per trace request (ids r000000, r000001, ... in arrival order)."""
    rng = np.random.default_rng(seed)
    out = []
    for i, req in enumerate(trace):
        if req.output_tokens < 1:
            raise ValueError(
                f"trace request {i} has output_tokens={req.output_tokens}; "
                "set Scaling.output_min >= 1"
            )
        prompt = source.prompt_for(req, rng)
        n_tokens = prompt.num_tokens
        if n_tokens is None and prompt.input_ids is not None:
            n_tokens = len(prompt.input_ids)
        out.append(ReplayRequest(
            request_id=f"r{i:06d}", arrival_s=req.arrival_s, max_new_tokens=req.output_tokens,
            text=prompt.text, input_ids=prompt.input_ids, ignore_eos=ignore_eos,
            category=req.category, ttft_slo_s=req.ttft_slo_s, tpot_slo_s=req.tpot_slo_s,
            prompt_tokens=n_tokens,
        ))
    return out


@dataclass(frozen=True)
class SyntheticIdsSource:
    """Random `input_ids` of exactly the trace's input length.

    block_tokens: tokens per Mooncake prefix block (512 in the source trace; scale it with
    the input lengths). None ignores prefix_hash_ids. Block contents depend only on
    (seed, hash id), so they are identical across requests and runs.
    """

    vocab_size: int
    id_low: int = 0
    block_tokens: int | None = None
    seed: int = 0

    def __post_init__(self) -> None:
        if not 0 <= self.id_low < self.vocab_size:
            raise ValueError(f"need 0 <= id_low < vocab_size, got {self.id_low}, "
                             f"{self.vocab_size}")

    def prompt_for(self, request: TraceRequest, rng: np.random.Generator) -> Prompt:
        n = request.input_tokens
        parts: list[np.ndarray] = []
        if self.block_tokens and request.prefix_hash_ids:
            for h in request.prefix_hash_ids:
                if sum(len(p) for p in parts) >= n:
                    break
                parts.append(self._block(h))
        prefix = np.concatenate(parts)[:n] if parts else np.zeros(0, dtype=np.int64)
        tail = rng.integers(self.id_low, self.vocab_size, size=n - len(prefix))
        ids = np.concatenate([prefix, tail]).astype(np.int64)
        return Prompt(input_ids=tuple(int(x) for x in ids), num_tokens=n)

    def _block(self, hash_id: int) -> np.ndarray:
        assert self.block_tokens is not None
        block_rng = np.random.default_rng([self.seed, hash_id])
        return block_rng.integers(self.id_low, self.vocab_size, size=self.block_tokens)


DEFAULT_WORDS = (
    "the", "of", "and", "to", "in", "is", "was", "for", "that", "on", "with", "as", "by", "at",
    "from", "his", "her", "this", "which", "or", "an", "be", "are", "were", "it", "not", "have",
    "has", "had", "one", "all", "their", "there", "when", "time", "would", "people", "year",
    "about", "into", "more", "other", "many", "some", "could", "these", "first", "water",
    "than", "been", "after", "made", "two", "called", "only", "over", "new", "most", "world",
    "state", "city", "between", "during", "number", "under", "part", "such", "system", "music",
    "river", "family", "history", "team", "school", "later", "large", "while", "where",
    "because", "against", "second", "since", "found", "several", "public", "government", "work",
    "well", "known", "both", "along", "small", "early", "three", "among", "group", "village",
    "station", "different", "house", "light", "market", "energy", "language", "method",
    "result", "process", "model", "value", "field",
)


@dataclass(frozen=True)
class SyntheticTextSource:
    """Text of random words sized to the trace's input length by a tokenizer callback.

    count_tokens(text) returns the prompt length the server will see (include BOS if the
    server adds one). The prompt is the longest word prefix with count <= input_tokens.
    """

    count_tokens: Callable[[str], int]
    words: Sequence[str] = DEFAULT_WORDS

    def prompt_for(self, request: TraceRequest, rng: np.random.Generator) -> Prompt:
        target = request.input_tokens
        picks = rng.integers(0, len(self.words), size=max(target, 1))
        words = [self.words[i] for i in picks]
        lo, hi = 1, len(words)  # find the largest n with count(words[:n]) <= target
        best_n, best_count = 1, self.count_tokens(words[0])
        while lo <= hi:
            mid = (lo + hi) // 2
            count = self.count_tokens(" ".join(words[:mid]))
            if count <= target:
                best_n, best_count = mid, count
                lo = mid + 1
            else:
                hi = mid - 1
        return Prompt(text=" ".join(words[:best_n]), num_tokens=best_count)

