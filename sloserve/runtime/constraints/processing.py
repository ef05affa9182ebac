"""From raw logits to the distribution a request samples from, per position, exactly as under
plain decoding, so that the acceptance rule compares the right target and draft distributions.

Order (SGLang: `SamplingBatchInfo.apply_logits_bias`, then the sampler):
  1. penalties: frequency and presence (additive), then repetition (multiplicative), with the
     row's output counts = committed output + the drafts before that row;
  1b. logit_bias: added to its tokens' logits (after the penalties, as SGLang adds it);
  2. grammar mask: forbidden tokens -> -inf (xgrammar bitmask of that row's position);
  3. min_new_tokens: EOS and stop_token_ids -> -inf on rows whose output is still too short;
     where that would leave no token (the grammar allows only a stop token) the grammar wins;
  4. temperature, top-k, top-p (`sloserve.runtime.sampler.processed_probs`); greedy requests
     take the argmax of the logits after 1-3.

`RequestConstraints.target` processes the k + 1 verified rows of a step (advancing the grammar
tentatively through the drafts), `RequestConstraints.draft` one draft-model row; the same
function does both, so p and q are processed alike. Speculative sampling stays lossless for any
q as long as the draft token was drawn from the q handed to the rule; processing the draft the
same way keeps the acceptance rate up (a draft that proposes masked tokens is always rejected).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from sloserve.runtime.constraints.bitmask import apply_
from sloserve.runtime.constraints.grammar_state import GrammarState
from sloserve.runtime.errors import InvalidRequest
from sloserve.runtime.penalties import PenaltyParams, TokenCounts, apply_penalties, min_tokens_rows
from sloserve.runtime.sampler import F32_MAX, processed_probs
from sloserve.runtime.sampling_params import SamplingParams


@dataclass
class Processed:
    logits: torch.Tensor  # [R, V] after penalties and masks (before temperature)
    probs: torch.Tensor | None  # [R, V] the sampled-from distributions; None for greedy requests
    argmax: list[int]  # [R] argmax of logits: the greedy choice per row
    n_valid: int  # drafts the grammar accepts (target rows; len(drafts) without a grammar)

    def confidence(self, row: int, token: int) -> float:
        """A draft token's confidence for the controller, from the processed distribution: its
        probability (sampling) or the softmax of the processed logits (greedy, temperature 1,
        as the unconstrained greedy drafter reports)."""
        if self.probs is not None:
            return float(self.probs[row, token])
        return float(torch.softmax(self.logits[row], dim=-1)[token])


def mask_stop_tokens(logits: torch.Tensor, rows: int, stop_ids: torch.Tensor) -> None:
    """min_new_tokens, in place: stop_ids -> -inf on the first `rows` rows of logits [R, V],
    except on rows where nothing else is left (the grammar allows only a stop token)."""
    if rows <= 0 or not len(stop_ids):
        return
    idx = (torch.arange(rows)[:, None], stop_ids[None, :])  # [rows, n_stop] entries
    saved = logits[idx]
    logits[idx] = float("-inf")
    dead = torch.isneginf(logits[:rows].amax(dim=-1))  # [rows] rows with no token left
    if bool(dead.any()):
        logits[idx] = torch.where(dead[:, None], saved, logits[idx])


class LogitBias:
    """A request's logit_bias as tensors: cols [B] long, values [B] float32."""

    def __init__(self, pairs: Sequence[tuple[int, float]], vocab_size: int):
        bad = [t for t, _ in pairs if not 0 <= t < vocab_size]
        if bad:
            raise InvalidRequest("logit_bias", f"token id {bad[0]} outside the vocabulary "
                                 f"[0, {vocab_size})")
        self.cols = torch.tensor([t for t, _ in pairs], dtype=torch.long)
        self.values = torch.tensor([v for _, v in pairs], dtype=torch.float32)

    def add_(self, logits: torch.Tensor) -> None:
        """In place on logits [R, V] float32: every row gets the bias; -inf stays -inf and a
        sum saturates at float32's range (no finite logit turns into inf)."""
        x = logits[:, self.cols] + self.values
        logits[:, self.cols] = x.clamp_(min=-F32_MAX, max=F32_MAX).where(
            ~torch.isneginf(logits[:, self.cols]), float("-inf"))


def process(
    logits: torch.Tensor,  # [R, V]; row r is position first + r of the step
    params: SamplingParams,
    penalties: PenaltyParams,
    counts: TokenCounts | None,
    drafts: Sequence[int],  # row r follows drafts[:first + r]
    first: int,
    bitmask: torch.Tensor | None,  # [R, W] int32 grammar masks of the rows, or None
    stop_ids: torch.Tensor,  # [n] int64 EOS and stop_token_ids (for min_new_tokens)
    bias: LogitBias | None = None,
) -> torch.Tensor:
    """Steps 1-3 of the module docstring: [R, V] float32, a new tensor."""
    out = logits.float()
    if counts is not None and penalties.penalizes:
        out = apply_penalties(out, penalties, counts, drafts, first)
    if out is logits:
        out = logits.clone()
    if bias is not None:
        bias.add_(out)
    if bitmask is not None:
        apply_(out, bitmask)
    n_out = counts.num_output if counts is not None else 0
    mask_stop_tokens(out, min_tokens_rows(penalties, n_out, out.shape[0], first), stop_ids)
    return out


def finish(out: torch.Tensor, params: SamplingParams, n_valid: int) -> Processed:
    """Step 4: the distributions (sampling) and the argmax (always)."""
    probs = None if params.greedy else processed_probs(out, [params] * out.shape[0])
    return Processed(out, probs, out.argmax(dim=-1).tolist(), n_valid)


class RequestConstraints:
    """One request's penalties, grammar and min_new_tokens, kept across steps.

    Protocol per step: draft rounds call `draft` then `push_draft` (the grammar advances
    tentatively); verification calls `target` with the chain it verifies; `commit` with the
    emitted tokens. A request with no drafts this step calls `target(logits[-1:], [])`.
    """

    def __init__(
        self,
        params: SamplingParams,
        vocab_size: int,
        prompt_ids: Sequence[int],
        *,
        penalties: PenaltyParams | None = None,
        grammar: GrammarState | None = None,
        stop_ids: Sequence[int] = (),
    ):
        self.params = params
        self.penalties = penalties or PenaltyParams()
        self.grammar = grammar
        self.vocab_size = vocab_size
        # counts are kept whenever min_new_tokens or a penalty needs them
        needs = self.penalties.penalizes or self.penalties.min_new_tokens > 0
        self.counts = TokenCounts(vocab_size, prompt_ids) if needs else None
        self.stop_ids = torch.tensor(sorted({int(t) for t in stop_ids if 0 <= t < vocab_size}),
                                     dtype=torch.long)
        bias = params.logit_bias  # normalised to ((token, bias), ...) by SamplingParams
        self.bias = LogitBias(tuple(bias), vocab_size) if isinstance(bias, tuple) and bias else None

    @property
    def active(self) -> bool:
        """Whether processing differs from plain temperature / top-k / top-p sampling."""
        return self.counts is not None or self.grammar is not None or self.bias is not None

    def target(self, logits: torch.Tensor, drafts: Sequence[int]) -> Processed:
        """logits [k + 1, V] of the verified positions, drafts the k verified tokens."""
        if logits.shape[0] != len(drafts) + 1:
            raise ValueError(f"{logits.shape[0]} rows for {len(drafts)} drafts")
        bm, n_valid = (self.grammar.verify_bitmask(drafts) if self.grammar is not None
                       else (None, len(drafts)))
        out = process(logits, self.params, self.penalties, self.counts, drafts, 0, bm,
                      self.stop_ids, self.bias)
        return finish(out, self.params, n_valid)

    def draft(self, logits: torch.Tensor, drafts: Sequence[int]) -> Processed:
        """logits [1, V] (or [V]) of draft position j = len(drafts), drafts the tokens this step
        already drafted (and pushed)."""
        row = logits.reshape(1, -1)
        bm = None
        if self.grammar is not None:
            if self.grammar.num_tentative != len(drafts):
                raise ValueError("push_draft each draft token before drafting the next")
            bm = self.grammar.bitmask()[None]
        out = process(row, self.params, self.penalties, self.counts, drafts, len(drafts), bm,
                      self.stop_ids, self.bias)
        return finish(out, self.params, len(drafts))

    def push_draft(self, token: int) -> bool:
        """Record a draft token; False when the grammar forbids it (stop drafting there)."""
        return self.grammar.push(token) if self.grammar is not None else True

    def drop_drafts(self) -> None:
        if self.grammar is not None:
            self.grammar.drop_drafts()

    def commit(self, emitted: Sequence[int]) -> None:
        """The tokens appended to the output this step (accepted drafts, then the target's)."""
        if self.counts is not None:
            self.counts.add(emitted)
        if self.grammar is not None:
            self.grammar.commit(emitted)
