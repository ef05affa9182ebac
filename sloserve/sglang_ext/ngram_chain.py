"""Prompt-lookup draft chains for SGLang's decode batches (SGLang-free, tested without it):
SPECSERVE's n-gram drafter (`--drafter ngram`), the built-in engine's prompt lookup
(runtime/drafter/ngram.py) on each request's committed tokens.

A step's chains start from each request's committed tokens (prompt, output, the bonus token
last) and grow one token a round: the token that most often followed the longest matching
suffix n-gram, its confidence that frequency (ngram.py). A request whose suffix matches
nothing has no proposal from there on: its later tokens are fillers (the last token again)
with confidence NaN, which the session reads as "not drafted" (controller.after_round,
SpecSession.chain_drafted), so a per-request step drafts and verifies only real proposals.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from sloserve.runtime.drafter.ngram import NgramBook, NgramIndex


class NgramChains:
    """The n-gram indexes of the requests SGLang runs, and one step's chains over them."""

    def __init__(self, n_max: int = 3, keep: int = 1024) -> None:
        self.n = n_max
        self.book = NgramBook(n_max)
        self.keep = keep  # more indexes than this: those of requests not in the batch go
        self._idx: list[NgramIndex] = []
        self._tails: list[list[int]] = []
        self._live = np.zeros(0, dtype=bool)

    def start(self, rids: Sequence[str], committed: Sequence[Sequence[int]],
              bonus: Sequence[int]) -> None:
        """A decode step's chains: committed[i] the request's tokens so far (prompt first;
        its bonus token last, or not yet there), bonus[i] the token at its next position."""
        if len(self.book) > self.keep:  # finished requests whose release never came
            self.book.retain(set(rids))
        self._idx, self._tails = [], []
        for rid, ids, b in zip(rids, committed, bonus):
            ids = list(ids)
            if not ids or ids[-1] != b:
                ids.append(b)
            self._idx.append(self.book.index(rid, ids))
            self._tails.append(ids[-self.n:])
        self._live = np.ones(len(self._idx), dtype=bool)

    def round(self) -> tuple[np.ndarray, np.ndarray]:
        """One more token of every chain: (tokens [bs] int64, confidences [bs] float64, NaN
        where the chain has no proposal)."""
        bs = len(self._idx)
        tokens = np.zeros(bs, dtype=np.int64)
        conf = np.full(bs, np.nan)
        for i, (idx, tail) in enumerate(zip(self._idx, self._tails)):
            prop = idx.propose(tail) if self._live[i] else None
            if prop is None:
                self._live[i] = False
                tokens[i] = tail[-1]  # a filler: verified only by a uniform step
            else:
                tokens[i], conf[i] = prop
            tail.append(int(tokens[i]))
            if len(tail) > self.n:
                del tail[0]
        return tokens, conf

    def live(self) -> bool:
        """Whether some chain of the step still has proposals."""
        return bool(self._live.any())

    def release(self, rid: str) -> None:
        self.book.release(rid)
