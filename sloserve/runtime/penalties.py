"""Repetition penalties and min_new_tokens, exact under speculation.

Definitions (SGLang's penaltylib and vLLM agree on each term; the OpenAI API defines the first
two):
- frequency_penalty f: logit[t] -= f * n_out(t), n_out(t) = times t occurs in the output;
- presence_penalty r: logit[t] -= r * [n_out(t) > 0];
- repetition_penalty p (HF and vLLM; SGLang's penaltylib counted the prompt in older versions,
  only the output in its current one): for every t in prompt + output, logit[t] / p if
  logit[t] > 0 else logit[t] * p;
- min_new_tokens m: while the output holds fewer than m tokens, EOS and stop_token_ids are
  forbidden (-inf).
Order, as SGLang's `apply_logits_bias`: the additive terms (frequency, presence), then the
multiplicative repetition term. (vLLM scales first; the two differ only when both kinds are set.)

Position-dependence under speculation: the row of verified position j follows draft tokens
0..j-1, so its output counts are the committed output's plus those drafts. `apply_penalties`
does the whole [R, V] block in one vectorised pass: the committed counts' penalty on the columns
of the tokens seen so far (computed once per step) for every row, then an exact fix-up of the
few (row, draft token) entries the drafts change. Only those columns are touched, so the cost
does not grow with the vocabulary beyond one copy of the rows.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch

from sloserve.runtime.errors import InvalidRequest

_F32_MAX = torch.finfo(torch.float32).max


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
    seen: the distinct tokens of prompt + output, in order of first appearance (the only columns
    a penalty changes: every other token has count 0 and is not in the prompt);
    num_output: committed output length (for min_new_tokens).
    """

    def __init__(self, vocab_size: int, prompt_ids: Sequence[int] = ()):
        self.vocab_size = vocab_size
        self.counts = torch.zeros(vocab_size, dtype=torch.float32)
        self.seen: dict[int, int] = {}  # token -> its column among the seen tokens
        for t in prompt_ids:
            self.seen.setdefault(int(t), len(self.seen))
        self.num_output = 0
        self._cached: tuple[PenaltyParams, _Columns] | None = None

    def add(self, tokens: Sequence[int]) -> None:
        """Commit emitted output tokens (in order; repeats count)."""
        if not len(tokens):
            return
        toks = [int(t) for t in tokens]
        self.counts.index_add_(0, torch.tensor(toks), torch.ones(len(toks)))
        self.num_output += len(toks)
        for t in toks:
            self.seen.setdefault(t, len(self.seen))
        self._cached = None

    def columns(self, params: PenaltyParams) -> _Columns:
        """The seen columns and their committed penalty, computed once per step (the verify and
        every draft row of the step share them)."""
        if self._cached is None or self._cached[0] != params:
            cols = torch.tensor(list(self.seen), dtype=torch.long)
            c = self.counts[cols]
            self._cached = (params, _Columns(cols, c, _additive(params, c)))
        return self._cached[1]


class _Columns(NamedTuple):
    cols: torch.Tensor  # [S] long, the seen tokens
    counts: torch.Tensor  # [S] float32, their committed output counts
    sub: torch.Tensor  # [S] float32, their additive penalty


def _additive(params: PenaltyParams, n: torch.Tensor) -> torch.Tensor:
    """f * n + r * [n > 0] for output counts n (any shape, float32)."""
    return params.frequency_penalty * n + params.presence_penalty * (n > 0)


def apply_penalties(
    logits: torch.Tensor,  # [R, V] float32; row r is position first + r of this step
    params: PenaltyParams,
    stats: TokenCounts,
    drafts: Sequence[int],  # the step's draft tokens; row r follows drafts[:first + r]
    first: int = 0,
) -> torch.Tensor:
    """Penalised logits [R, V] (a new tensor, or `logits` itself when no penalty is on).

    Verify: logits [k + 1, V], drafts the k verified tokens, first 0. A draft-model row at draft
    position j: logits [1, V], drafts[:j] (at least), first j. Only the columns of tokens seen
    so far (and the drafts) are computed: O(R * (S + k)) after one copy of the rows.
    """
    if not params.penalizes:
        return logits
    R = logits.shape[0]
    n = first + R - 1  # drafts that precede the last row
    if n > 0 and len(drafts) < n:
        raise ValueError(f"rows up to position {n} need {n} draft tokens, got {len(drafts)}")
    d = [int(t) for t in drafts[: max(n, 0)]]
    col = stats.columns(params)
    cols, counts, sub = col.cols, col.counts, col.sub  # [S]: the committed view
    if d:
        seen = stats.seen  # token -> column
        new = [t for t in dict.fromkeys(d) if t not in seen]  # drafted, never seen before
        col_of = {t: seen[t] for t in d if t in seen} | {t: len(seen) + i for i, t in enumerate(new)}
        if new:
            cols = torch.cat([cols, torch.tensor(new)])
            counts = torch.cat([counts, torch.zeros(len(new))])
        # extra[r, s]: times column s's token was drafted before row r
        pairs = torch.tensor([(r, col_of[t]) for r in range(R) for t in d[: first + r]])  # [m, 2]
        extra = torch.zeros(R, len(cols)).index_put_(
            (pairs[:, 0], pairs[:, 1]), torch.ones(len(pairs)), accumulate=True)
        # the same float32 formula as the committed `sub`: a value does not depend on whether
        # its token was committed or drafted (greedy speculation equals plain decoding)
        sub = _additive(params, counts + extra)  # [R, S']
    out = logits.clone()
    if len(cols):
        x = logits[:, cols] - sub  # [R, S']
        if params.repetition_penalty != 1.0:
            # factor 1 / p (positive logits) or p, in float32: 1 / p saturates at float32's
            # largest value (p = 1e-300 is a valid penalty, 1e300 is no float32), and so do
            # the penalised logits, so that no finite logit turns into inf (and NaN later)
            p = params.repetition_penalty
            factor = torch.where(x > 0, min(1.0 / p, _F32_MAX), p)
            S = len(col.cols)
            if len(cols) > S:  # a new column is seen only from the row after its first draft
                factor[:, S:] = torch.where(extra[:, S:] > 0, factor[:, S:], 1.0)
            x *= factor
            x.clamp_(-_F32_MAX, _F32_MAX)
        out[:, cols] = x
    return out


def min_tokens_rows(params: PenaltyParams, num_output: int, rows: int, first: int = 0) -> int:
    """How many leading rows (row r = position first + r of the step) must forbid EOS and the
    stop token ids: those where the output would still be shorter than min_new_tokens."""
    return max(0, min(rows, params.min_new_tokens - num_output - first))
