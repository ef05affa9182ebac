"""Reference computations the constraint tests compare against."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import xgrammar as xgr

from sloserve.runtime.constraints import CompiledGrammar, RequestConstraints
from sloserve.runtime.constraints.bitmask import allocate, to_bool
from sloserve.runtime.constraints.byte_guard import BOUND


def reference_masks(grammar: CompiledGrammar, tokens: Sequence[int]) -> torch.Tensor:
    """[len(tokens) + 1, V] bool: a fresh xgrammar matcher stepped token by token, the mask read
    before each token and after the last (ANDed with the grammar's byte guard)."""
    m = xgr.GrammarMatcher(grammar.compiled)
    bm = allocate(len(tokens) + 1, grammar.vocab_size)
    for j, t in enumerate(tokens):
        m.fill_next_token_bitmask(bm, j)
        assert m.accept_token(t), f"reference matcher rejects token {t} at {j}"
    if m.is_terminated():
        bm[len(tokens)].fill_(-1)
    else:
        m.fill_next_token_bitmask(bm, len(tokens))
    if grammar.guard is not None:  # the guard's DFA walked over the same tokens
        state = BOUND
        for j in range(len(tokens) + (0 if m.is_terminated() else 1)):
            bm[j] &= grammar.guard.masks[state]
            if j < len(tokens):
                state = grammar.guard.next(state, tokens[j])
    return to_bool(bm, grammar.vocab_size)


def random_walk(rc: RequestConstraints, vocab: int, gen: torch.Generator, eos: int,
                max_steps: int = 400, scale: float = 3.0) -> list[int]:
    """Sample from random logits under the request's processing until EOS (or max_steps)."""
    out: list[int] = []
    for _ in range(max_steps):
        pr = rc.target(torch.randn(1, vocab, generator=gen) * scale, [])
        t = int(torch.multinomial(pr.probs[0], 1, generator=gen))
        rc.commit([t])
        out.append(t)
        if t == eos:
            break
    return out
