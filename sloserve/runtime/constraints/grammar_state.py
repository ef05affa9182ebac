"""Per-request grammar state for speculative decoding, over one xgrammar matcher.

The matcher has accepted the request's committed output followed by this step's tentative
tokens (drafts). Drafting pushes each proposed token tentatively and reads the mask of the next
position; verification needs the masks of positions 0..k of the chain, which are the same masks
(position j's mask depends only on the tokens before it), so they are cached and reused; commit
keeps the accepted drafts, rolls back the rest and accepts the bonus token. Every operation is
O(1) matcher calls per token: no replay of the output, no copy of the matcher.

After the grammar terminates (a stop token accepted) the output is unconstrained, as in SGLang:
masks allow every token and later tokens are recorded but not matched.

The grammar's ByteGuard (byte_guard.py) is part of the grammar here: its mask is ANDed into every
row xgrammar fills and `push` rejects what it forbids, so masks and pushes always agree. Should
the AND ever leave no token (a grammar that can only continue with malformed bytes), the guard is
switched off for the rest of the request rather than leave an empty mask.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
import xgrammar as xgr

from sloserve.runtime.constraints.bitmask import ALL_ALLOWED, allocate, to_bool
from sloserve.runtime.constraints.byte_guard import BOUND, REJECT
from sloserve.runtime.constraints.compiler import CompiledGrammar


class GrammarViolation(RuntimeError):
    """A token the grammar forbids was committed: the mask was not applied somewhere."""


class GrammarState:
    def __init__(self, grammar: CompiledGrammar, max_draft: int = 8):
        self.grammar = grammar
        self.vocab_size = grammar.vocab_size
        self._m = xgr.GrammarMatcher(grammar.compiled)
        self._tokens: list[int] = []  # committed tokens, then tentative ones
        self._steps: list[int] = []  # per token: 1 if the matcher took it, 0 if after termination
        self._u8: list[int] = []  # per token: the byte guard's DFA state after it
        self._guard = grammar.guard
        self._committed = 0
        # _masks[j]: the mask of tentative position j (after committed + j tentative tokens),
        # meaningful only where _have[j]; [rows, W] int32
        self._masks = allocate(max_draft + 1, self.vocab_size)
        self._np = self._masks.numpy()  # the same memory: numpy for the [W]-word row work
        # per DFA state, the guard's [W] words (numpy: an AND of 64 words is 1 us, not 5)
        self._guard_np = None if grammar.guard is None else grammar.guard.masks.numpy()
        self._have = [False] * (max_draft + 1)

    # ----- plain state
    @property
    def num_committed(self) -> int:
        return self._committed

    @property
    def num_tentative(self) -> int:
        return len(self._tokens) - self._committed

    @property
    def terminated(self) -> bool:
        """A stop token has been accepted (after the tentative tokens, if any)."""
        return self._m.is_terminated()

    @property
    def completed(self) -> bool:
        """The tokens so far form a complete match: the mask now allows the stop tokens."""
        return self._m.is_terminated() or self._m.is_completed()

    def bitmask(self) -> torch.Tensor:
        """[W] int32 mask of the current position (after committed + tentative tokens). A view
        into the cache: valid until the next push, rollback or commit."""
        j = self.num_tentative
        self._reserve(j + 1)
        if not self._have[j]:
            self._fill(j)
        return self._masks[j]

    def allowed(self) -> torch.Tensor:
        """[V] bool mask of the current position."""
        return to_bool(self.bitmask()[None], self.vocab_size)[0]

    def accept(self, token: int) -> None:
        """Commit one token (no tentative tokens pending or they match)."""
        self.commit([token])

    def rollback(self, n: int) -> None:
        """Remove the last n tokens of the history (tentative first, then committed)."""
        if not 0 <= n <= len(self._tokens):
            raise ValueError(f"cannot roll back {n} of {len(self._tokens)} tokens")
        self._pop(n)
        self._committed = min(self._committed, len(self._tokens))

    # ----- speculation
    def push(self, token: int) -> bool:
        """Accept a draft token tentatively; False (state unchanged) if the grammar forbids it."""
        token = int(token)
        if not 0 <= token < self.vocab_size:
            return False
        state = self._u8[-1] if self._u8 else BOUND
        if self._m.is_terminated():
            step = 0
        else:
            if self._guard is not None:
                state = self._guard.next(state, token)
                if state == REJECT:
                    return False
            if not self._m.accept_token(token):
                return False
            step = 1
        self._tokens.append(token)
        self._steps.append(step)
        self._u8.append(state)
        return True

    def drop_drafts(self) -> None:
        """Roll back every tentative token: the state is the committed output again."""
        self._pop(self.num_tentative)

    def verify_bitmask(self, drafts: Sequence[int]) -> tuple[torch.Tensor, int]:
        """Masks of the k + 1 verified positions of the chain `drafts` (k tokens).

        Returns (bitmask [k + 1, W] int32, n_valid): row j is the mask after drafts[:j] for
        j <= n_valid, where drafts[:n_valid] is the longest prefix the grammar accepts; rows past
        n_valid allow everything (never used: draft n_valid is masked out in row n_valid, so it
        is rejected there). Leaves drafts[:n_valid] tentatively accepted for `commit`. The rows
        are a view into the cache, valid until the next push, rollback or commit."""
        k = len(drafts)
        self._reserve(k + 1)
        c = self._common_prefix(drafts)
        # rows 0..c-1 are reused where drafting filled them; tokens pushed without reading
        # their row first (n-gram proposals) are rolled back and pushed again below
        c = next((j for j in range(c) if not self._have[j]), c)
        self._pop(self.num_tentative - c)
        n_valid = c
        while n_valid < k:
            if not self._have[n_valid]:
                self._fill(n_valid)
            if not self.push(drafts[n_valid]):
                break
            n_valid += 1
        if not self._have[n_valid]:
            self._fill(n_valid)
        for j in range(n_valid + 1, k + 1):
            self._np[j] = ALL_ALLOWED
            self._have[j] = False
        return self._masks[: k + 1], n_valid

    def commit(self, emitted: Sequence[int]) -> None:
        """Make `emitted` (accepted drafts, then the target's token) the next committed tokens:
        tentative tokens it starts with are kept, the others rolled back, the rest accepted.
        Raises GrammarViolation if the grammar forbids one of them."""
        c = self._common_prefix(emitted)
        self._pop(self.num_tentative - c)
        self._committed += c
        for t in emitted[c:]:
            if not self.push(t):
                self._invalidate(0)
                raise GrammarViolation(
                    f"token {t} is not allowed by the {self.grammar.spec.kind} grammar after "
                    f"{self._committed} tokens"
                )
            self._committed += 1
        self._invalidate(0)  # positions are counted from the new committed length

    # ----- internals
    def _common_prefix(self, tokens: Sequence[int]) -> int:
        tent = self._tokens[self._committed :]
        n = 0
        while n < len(tent) and n < len(tokens) and tent[n] == int(tokens[n]):
            n += 1
        return n

    def _pop(self, n: int) -> None:
        if n <= 0:
            return
        steps = sum(self._steps[-n:])
        del self._tokens[-n:], self._steps[-n:], self._u8[-n:]
        if steps:
            self._m.rollback(steps)
        self._invalidate(max(0, self.num_tentative + 1))

    def _invalidate(self, first_row: int) -> None:
        for j in range(first_row, len(self._have)):
            self._have[j] = False

    def _fill(self, j: int) -> None:
        """Row j := the mask of the current position, which must be tentative position j."""
        assert j == self.num_tentative, (j, self.num_tentative)
        row = self._np[j]
        if self._m.is_terminated():
            row[:] = ALL_ALLOWED
        else:
            self._m.fill_next_token_bitmask(self._masks, j)
            if self._guard_np is not None:
                np.bitwise_and(row, self._guard_np[self._u8[-1] if self._u8 else BOUND], out=row)
                if not row.any():  # nothing well-formed left: trust the grammar alone
                    self._guard = self._guard_np = None
                    self._m.fill_next_token_bitmask(self._masks, j)
        self._have[j] = True

    def _reserve(self, rows: int) -> None:
        if rows > self._masks.shape[0]:
            grown = allocate(max(rows, 2 * self._masks.shape[0]), self.vocab_size)
            grown[: self._masks.shape[0]] = self._masks
            self._have += [False] * (grown.shape[0] - len(self._have))
            self._masks, self._np = grown, grown.numpy()
