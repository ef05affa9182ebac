"""A toy setting for exact checks of speculative decoding under constraints: a 10-token vocabulary
(xgrammar over its raw strings), a target and a draft "model" whose logits are fixed pseudo-random
functions of the context, and the two decoding loops (plain and speculative) the engine will run,
written with the components under test."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import cache

import torch
import xgrammar as xgr

from sloserve.runtime.constraints import (
    GrammarCompiler,
    GrammarState,
    Processed,
    RequestConstraints,
    grammar_spec,
)
from sloserve.runtime.constraints.bitmask import apply_
from sloserve.runtime.constraints.processing import finish, process
from sloserve.runtime.penalties import PenaltyParams
from sloserve.runtime.request import SamplingParams
from sloserve.runtime.sampler import processed_probs
from sloserve.verifier.acceptance import draw, greedy_accept, speculative_accept

VOCAB = ["a", "b", "ab", "ba", "aab", "c", "x", "bb", "q", "<eos>"]
V = len(VOCAB)
EOS = V - 1
PROMPT = (0, 5, 1)


def compiler() -> GrammarCompiler:
    info = xgr.TokenizerInfo(VOCAB, xgr.VocabType.RAW, stop_token_ids=[EOS])
    return GrammarCompiler(info)


@cache
def _logits(ctx: tuple[int, ...], seed: int, scale: float) -> torch.Tensor:
    g = torch.Generator().manual_seed(hash((seed, ctx)) % (2**31))
    return torch.randn(V, generator=g) * scale


def target_logits(ctx: Sequence[int]) -> torch.Tensor:
    """[V] for the next token after ctx (prompt + output + drafts)."""
    return _logits(tuple(ctx), 1, 2.0)


def draft_logits(ctx: Sequence[int]) -> torch.Tensor:
    """The target's logits plus a context-dependent disagreement."""
    return target_logits(ctx) + _logits(tuple(ctx), 2, 1.5)


def make(pattern: str | None, params: SamplingParams, penalties: PenaltyParams,
         comp: GrammarCompiler | None = None) -> RequestConstraints:
    grammar = None
    if pattern is not None:
        grammar = GrammarState((comp or compiler()).compile(grammar_spec(regex=pattern)))
    return RequestConstraints(params, V, PROMPT, penalties=penalties, grammar=grammar,
                              stop_ids=[EOS])


def pick(pr: Processed, row: int, gen: torch.Generator | None) -> int:
    return pr.argmax[row] if pr.probs is None else draw(pr.probs[row], gen)


def plain_decode(rc: RequestConstraints, gen, max_new: int = 12) -> list[int]:
    out: list[int] = []
    while len(out) < max_new and (not out or out[-1] != EOS):
        t = pick(rc.target(target_logits(PROMPT + tuple(out))[None], []), 0, gen)
        rc.commit([t])
        out.append(t)
    return out


DraftFn = Callable[[RequestConstraints, list[int], list[int], torch.Generator | None],
                   tuple[int, torch.Tensor | None]]


def draft_processed(rc, out, drafts, gen):
    """The correct drafter: the draft row processed like the target's (penalties counting the
    drafts so far, the grammar mask of this position); returns (token, q row)."""
    pr = rc.draft(draft_logits(PROMPT + tuple(out) + tuple(drafts)), drafts)
    return pick(pr, 0, gen), (None if pr.probs is None else pr.probs[0])


def spec_decode(rc: RequestConstraints, gen, k: int, max_new: int = 12,
                drafter: DraftFn = draft_processed, target_fn=None) -> list[int]:
    """Draft k tokens (each pushed into the grammar), verify the chain, accept, commit."""
    out: list[int] = []
    while len(out) < max_new and (not out or out[-1] != EOS):
        drafts, qs = [], []
        for _ in range(min(k, max_new - len(out) - 1)):
            t, q = drafter(rc, out, drafts, gen)
            if not rc.push_draft(t):
                break
            drafts.append(t)
            qs.append(q)
            if t == EOS:
                break
        logits = torch.stack([target_logits(PROMPT + tuple(out) + tuple(drafts[:j]))
                              for j in range(len(drafts) + 1)])
        p = (target_fn or rc.target)(logits, drafts)
        if p.probs is None:
            emitted = greedy_accept(drafts, p.argmax)
        elif drafts:
            emitted = speculative_accept(drafts, torch.stack(qs), p.probs, gen)
        else:
            emitted = [draw(p.probs[0], gen)]
        if EOS in emitted:
            emitted = emitted[: emitted.index(EOS) + 1]
        rc.commit(emitted)
        out += emitted
    return out[:max_new]


# ----- deliberately wrong variants: the checks must catch them
def stale_target(rc: RequestConstraints):
    """Verify rows penalised with the committed output only (drafts before the row not counted),
    the bug position-dependent processing exists to avoid."""
    def target(logits: torch.Tensor, drafts: Sequence[int]) -> Processed:
        bm, n_valid = (rc.grammar.verify_bitmask(drafts) if rc.grammar is not None
                       else (None, len(drafts)))
        rows = [process(logits[j : j + 1], rc.params, rc.penalties, rc.counts, [], 0,
                        None if bm is None else bm[j : j + 1], rc.stop_ids)
                for j in range(logits.shape[0])]
        return finish(torch.cat(rows), rc.params, n_valid)
    return target


def draft_unpenalised(rc, out, drafts, gen):
    """Samples the draft token from the grammar-masked but unpenalised draft distribution while
    handing the rule the fully processed q: the draft is not distributed as the rule assumes."""
    raw = draft_logits(PROMPT + tuple(out) + tuple(drafts))
    q = rc.draft(raw, drafts).probs[0]
    masked = raw.clone()[None]
    if rc.grammar is not None:
        apply_(masked, rc.grammar.bitmask()[None])
    return draw(processed_probs(masked, [rc.params])[0], gen), q
