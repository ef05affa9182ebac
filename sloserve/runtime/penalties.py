"""Repetition penalties and min_new_tokens, exact under speculation.

Definitions (SGLang's penaltylib and vLLM agree on each term; the OpenAI API defines the first
two):
- frequency_penalty f: logit[t] -= f * n_out(t), n_out(t) = times t occurs in the output;
- presence_penalty r: logit[t] -= r * [n_out(t) > 0];
- repetition_penalty p (HF / vLLM / SGLang before its speculative rewrite): for every t in
  prompt + output, logit[t] / p if logit[t] > 0 else logit[t] * p;
- min_new_tokens m: while the output holds fewer than m tokens, EOS and stop_token_ids are
  forbidden (-inf).
Order, as SGLang's `apply_logits_bias`: the additive terms (frequency, presence), then the
multiplicative repetition term. (vLLM scales first; the two differ only when both kinds are set.)

Position-dependence under speculation: the row of verified position j follows draft tokens
0..j-1, so its output counts are the committed output's plus those drafts. `apply_penalties`
does the whole [R, V] block in one vectorised pass: a broadcast of the committed counts' penalty
(as [V] vectors computed once per step) over every row, then an exact fix-up of the few
(row, draft token) entries the drafts change (O(R * k) scalars, never O(R * V) counts).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch

from sloserve.runtime.request import InvalidRequest


@dataclass(frozen=True)
class PenaltyParams:
    frequency_penalty: float = 0.0  # [-2, 2], 0 = off
    presence_penalty: float = 0.0  # [-2, 2], 0 = off
    repetition_penalty: float = 1.0  # (0, 2], 1 = off
    min_new_tokens: int = 0  # [0, max_new_tokens]

    @property
    def penalizes(self) -> bool:
        """Whether any logit-changing penalty is on (min_new_tokens is a mask, not counted)."""
        return (self.frequency_penalty != 0.0 or self.presence_penalty != 0.0
                or self.repetition_penalty != 1.0)

    def validate(self, max_new_tokens: int | None = None) -> None:
        """Raise InvalidRequest naming the field, with SGLang's ranges."""
        for name in ("frequency_penalty", "presence_penalty"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and math.isfinite(v) and -2.0 <= v <= 2.0):
                raise InvalidRequest(name, f"must be in [-2, 2], got {v!r}")
        v = self.repetition_penalty
        if not (isinstance(v, (int, float)) and math.isfinite(v) and 0.0 < v <= 2.0):
            raise InvalidRequest("repetition_penalty", f"must be in (0, 2], got {v!r}")
        m = self.min_new_tokens
        if not isinstance(m, int) or isinstance(m, bool) or m < 0:
            raise InvalidRequest("min_new_tokens", f"must be an integer >= 0, got {m!r}")
        if max_new_tokens is not None and m > max_new_tokens:
            raise InvalidRequest(
                "min_new_tokens", f"must be <= max_new_tokens ({max_new_tokens}), got {m}"
            )


class TokenCounts:
    """A request's committed token statistics, updated once per step by `add`.

    counts: [V] float32, occurrences of each token in the committed output;
    in_prompt: [V] bool, tokens of the prompt (for the repetition penalty);
    num_output: committed output length (for min_new_tokens).
    """

    def __init__(self, vocab_size: int, prompt_ids: Sequence[int] = ()):
        self.vocab_size = vocab_size
        self.counts = torch.zeros(vocab_size, dtype=torch.float32)
        self.in_prompt = torch.zeros(vocab_size, dtype=torch.bool)
        if len(prompt_ids):
            self.in_prompt[torch.as_tensor(list(prompt_ids), dtype=torch.long)] = True
        self.num_output = 0
        self._cached: tuple[PenaltyParams, _Vectors] | None = None

    def add(self, tokens: Sequence[int]) -> None:
        """Commit emitted output tokens (in order; repeats count)."""
        if not len(tokens):
            return
        idx = torch.as_tensor(list(tokens), dtype=torch.long)
        self.counts.index_add_(0, idx, torch.ones(len(idx)))
        self.num_output += len(idx)
        self._cached = None

    def vectors(self, params: PenaltyParams) -> _Vectors:
        """The committed counts' penalty as [V] vectors, computed once per step (the verify and
        every draft row of the step share them)."""
        if self._cached is None or self._cached[0] != params:
            c = self.counts
            sub = params.frequency_penalty * c + params.presence_penalty * (c > 0)
            p = params.repetition_penalty
            seen = self.in_prompt | (c > 0)
            one = torch.ones_like(c)
            self._cached = (params, _Vectors(
                sub, torch.where(seen, 1.0 / p, one), torch.where(seen, p, one)
            ))
        return self._cached[1]


class _Vectors(NamedTuple):
    sub: torch.Tensor  # [V] additive penalty: f * n + r * [n > 0]
    pos: torch.Tensor  # [V] factor for positive logits: 1 / p where seen, else 1
    neg: torch.Tensor  # [V] factor for the others: p where seen, else 1


def apply_penalties(
    logits: torch.Tensor,  # [R, V] float32; row r is position first + r of this step
    params: PenaltyParams,
    stats: TokenCounts,
    drafts: Sequence[int],  # the step's draft tokens; row r follows drafts[:first + r]
    first: int = 0,
) -> torch.Tensor:
    """Penalised logits [R, V] (a new tensor, or `logits` itself when no penalty is on).

    Verify: logits [k + 1, V], drafts the k verified tokens, first 0. A draft-model row at draft
    position j: logits [1, V], drafts[:j] (at least), first j.
    """
    if not params.penalizes:
        return logits
    R = logits.shape[0]
    vec = stats.vectors(params)
    out = logits - vec.sub  # additive terms, broadcast over rows
    if params.repetition_penalty != 1.0:
        out *= torch.where(out > 0, vec.pos, vec.neg)
    n = first + R - 1  # drafts that precede the last row
    if n <= 0:
        return out
    if len(drafts) < n:
        raise ValueError(f"rows up to position {n} need {n} draft tokens, got {len(drafts)}")
    # the (row, token) entries the drafts change: at most k (k + 1) / 2 of them
    d = [int(t) for t in drafts[:n]]
    rows, toks, extra = [], [], []
    for r in range(R):
        seen: dict[int, int] = {}
        for i in range(first + r):
            seen[d[i]] = seen.get(d[i], 0) + 1
        for t, m in seen.items():
            rows.append(r)
            toks.append(t)
            extra.append(m)
    # the same float32 operations as the broadcast above, so an entry's value does not depend on
    # whether its token was committed or drafted (greedy speculation equals plain decoding)
    cnt = stats.counts[toks] + torch.tensor(extra, dtype=torch.float32)  # [m]
    x = logits[rows, toks] - (params.frequency_penalty * cnt + params.presence_penalty * (cnt > 0))
    if params.repetition_penalty != 1.0:  # a drafted token is in the output: always seen
        p = params.repetition_penalty
        x *= torch.where(x > 0, torch.tensor(1.0 / p), torch.tensor(p))
    out[rows, toks] = x
    return out


def min_tokens_rows(params: PenaltyParams, num_output: int, rows: int, first: int = 0) -> int:
    """How many leading rows (row r = position first + r of the step) must forbid EOS and the
    stop token ids: those where the output would still be shorter than min_new_tokens."""
    return max(0, min(rows, params.min_new_tokens - num_output - first))
