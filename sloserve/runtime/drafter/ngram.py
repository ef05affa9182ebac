"""Model-free drafter: prompt lookup over the request's own prompt and output (n-gram match).

Each request keeps an index from n-grams (n = 1..n_max) to the positions that followed them.
A proposal for the next token looks up the longest suffix n-gram seen before and proposes the
token that most often followed it (ties: the most recent). Its confidence is that frequency:
the share of earlier occurrences of the n-gram followed by the proposed token, discounted when
the n-gram is short. Draft cost is a few dictionary look-ups.
"""

from __future__ import annotations

from collections import Counter, defaultdict


class NgramIndex:
    def __init__(self, n_max: int = 3):
        self.n_max = n_max
        self.tokens: list[int] = []
        # (n-gram tuple) -> next tokens, in order of occurrence
        self.follow: dict[tuple[int, ...], list[int]] = defaultdict(list)

    def extend(self, tokens: list[int]) -> None:
        for t in tokens:
            L = len(self.tokens)
            for n in range(1, min(self.n_max, L) + 1):
                self.follow[tuple(self.tokens[L - n :])].append(t)
            self.tokens.append(t)

    def propose(self, context_tail: list[int]) -> tuple[int, float] | None:
        """Next token after `context_tail` (the last tokens, drafts included), or None."""
        for n in range(min(self.n_max, len(context_tail)), 0, -1):
            nxt = self.follow.get(tuple(context_tail[-n:]))
            if nxt:
                counts = Counter(nxt)
                best = max(counts.values())
                token = next(t for t in reversed(nxt) if counts[t] == best)
                conf = best / len(nxt) * (n / self.n_max) ** 0.5
                return token, conf
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
