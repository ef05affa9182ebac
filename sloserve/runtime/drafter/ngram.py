"""Model-free drafter: prompt lookup over the request's own prompt and output (n-gram match).

Each request keeps an index from n-grams (n = 1..n_max) to the positions that followed them.
A proposal for the next token looks up the longest suffix n-gram seen before and proposes the
token that most often followed it (ties: the most recent). Its confidence is that frequency:
the share of earlier occurrences of the n-gram followed by the proposed token, discounted when
the n-gram is short. Draft cost is a few dictionary look-ups.
"""

from __future__ import annotations


class _Follow:
    """What followed one n-gram: each token's count, their total, and the proposal (the most
    frequent, ties: the most recent), kept as tokens arrive so a proposal is O(1)."""

    __slots__ = ("counts", "total", "best", "best_count")

    def __init__(self) -> None:
        self.counts: dict[int, int] = {}
        self.total = 0
        self.best = -1
        self.best_count = 0

    def add(self, t: int) -> None:
        c = self.counts.get(t, 0) + 1
        self.counts[t] = c
        self.total += 1
        if c >= self.best_count:  # reaching the best count last makes it the most recent
            self.best, self.best_count = t, c


class NgramIndex:
    def __init__(self, n_max: int = 3):
        self.n_max = n_max
        self.tokens: list[int] = []
        # (n-gram tuple) -> what followed it
        self.follow: dict[tuple[int, ...], _Follow] = {}

    def extend(self, tokens: list[int]) -> None:
        follow = self.follow
        for t in tokens:
            L = len(self.tokens)
            for n in range(1, min(self.n_max, L) + 1):
                key = tuple(self.tokens[L - n :])
                f = follow.get(key)
                if f is None:
                    f = follow[key] = _Follow()
                f.add(t)
            self.tokens.append(t)

    def propose(self, context_tail: list[int]) -> tuple[int, float] | None:
        """Next token after `context_tail` (the last tokens, drafts included), or None."""
        for n in range(min(self.n_max, len(context_tail)), 0, -1):
            f = self.follow.get(tuple(context_tail[-n:]))
            if f is not None:
                conf = f.best_count / f.total * (n / self.n_max) ** 0.5
                return f.best, conf
        return None


class NgramBook:
    """One NgramIndex per request, extended with the tokens the request committed since the
    last call (the built-in engine's NgramDrafter and SGLang's SPECSERVE n-gram chain)."""

    def __init__(self, n_max: int = 3) -> None:
        self.n_max = n_max
        self._indexes: dict[str, NgramIndex] = {}

    def __len__(self) -> int:
        return len(self._indexes)

    def index(self, rid: str, ids: list[int]) -> NgramIndex:
        """The request's index over `ids` (its committed tokens, prompt first). A shorter
        `ids` than indexed (the request was retracted and recomputed) starts it afresh."""
        idx = self._indexes.get(rid)
        if idx is None or len(idx.tokens) > len(ids):
            idx = self._indexes[rid] = NgramIndex(self.n_max)
        idx.extend(ids[len(idx.tokens):])
        return idx

    def release(self, rid: str) -> None:
        self._indexes.pop(rid, None)

    def retain(self, rids: set[str]) -> None:
        """Drop every index but those of `rids`."""
        self._indexes = {r: i for r, i in self._indexes.items() if r in rids}
