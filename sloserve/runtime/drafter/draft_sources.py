"""Draft sources of the built-in engine (rounds.DraftSource): a draft model,
and prompt lookup over the request's own tokens.

Draft KV bookkeeping (model drafter): the draft cache holds `req.draft_kv_len` tokens of
`req.all_ids`. Its first draft forward of a step feeds every token it has not seen
(`all_ids[draft_kv_len:]`, usually 1; 2 after a step where all drafts were accepted: the
last draft token and the bonus token; more after steps without drafting), later forwards
feed the previous draft token. After verify the draft cache keeps only the prefix that
matches the accepted tokens (step_books.settle_kv).
"""

from __future__ import annotations

import math

import numpy as np
import torch

from sloserve.runtime.batch import Segment
from sloserve.runtime.constraints.batch import process_drafts
from sloserve.runtime.drafter.ngram import NgramBook
from sloserve.runtime.drafter.rounds import DraftRound
from sloserve.runtime.model_runner import ModelRunner
from sloserve.runtime.request import Request
from sloserve.runtime.sampler import processed_probs
from sloserve.verifier.acceptance import draw


class ModelDrafter:
    """One draft model forward per call over the requests still drafting."""

    kind = "model"

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner

    def release(self, rid: str) -> None:
        """Nothing per request: the draft KV lives in the request's blocks."""

    def step(self, reqs: list[Request], drafts: np.ndarray) -> DraftRound:
        """drafts: [n, j] this step's draft tokens so far (rounds.DraftSource)."""
        if drafts.shape[1]:  # feed each request's previous draft token
            segs = [Segment(req.blocks, req.draft_kv_len, [t])
                    for req, t in zip(reqs, drafts[:, -1].tolist())]
        else:  # catch up on everything the draft cache has not seen
            segs = [Segment(req.blocks, req.draft_kv_len, req.all_ids[req.draft_kv_len :])
                    for req in reqs]
        logits, _ = self.runner.forward(segs)
        for req, seg in zip(reqs, segs):
            req.draft_kv_len = seg.kv_len
        return pick(reqs, logits, drafts)

    def read_prefill(self, segs: list[Segment]) -> None:
        """The draft model reads prefill chunks (the engine's catch-up of a new prompt)."""
        self.runner.forward(segs)


def pick(reqs: list[Request], logits: torch.Tensor, drafts: np.ndarray) -> DraftRound:
    """The draft token of each row of logits [n, V]: the argmax for greedy requests, a
    sample from the processed distribution (kept as q for the acceptance rule) otherwise;
    its confidence is that distribution's probability of it. drafts: [n, j] the tokens each
    request drafted so far this step. Constrained requests draft from their processed row
    (grammar mask, penalties counting those drafts, min_new_tokens), the row verification will
    compare it with, and push the token into their grammar."""
    greedy = [i for i, r in enumerate(reqs) if r.params.greedy and r.constraints is None]
    if len(greedy) == len(reqs):  # the common case: no per-row work
        conf, tok = torch.softmax(logits, dim=-1).max(dim=-1)
        return DraftRound(tok.tolist(), conf.tolist())
    tokens, confs = [0] * len(reqs), [0.0] * len(reqs)
    q: list[torch.Tensor | None] = [None] * len(reqs)
    if greedy:
        conf, tok = torch.softmax(logits[greedy], dim=-1).max(dim=-1)
        for i, t, c in zip(greedy, tok.tolist(), conf.tolist()):
            tokens[i], confs[i] = t, c
    sampled = [i for i, r in enumerate(reqs) if not r.params.greedy and r.constraints is None]
    if sampled:
        probs = processed_probs(logits[sampled], [reqs[i].params for i in sampled])
        for j, i in enumerate(sampled):
            t = draw(probs[j], reqs[i].generator)
            tokens[i], confs[i], q[i] = t, float(probs[j, t]), probs[j]
    missing = _pick_constrained(reqs, logits, drafts, tokens, confs, q)
    return DraftRound(tokens, confs, q, missing or None)


def _pick_constrained(reqs: list[Request], logits: torch.Tensor, drafts: np.ndarray,
                      tokens: list[int], confs: list[float], q: list[torch.Tensor | None]
                      ) -> list[int]:
    """pick() for the constrained requests, in place; returns the rows with no proposal."""
    rows, items = [], []
    for i, r in enumerate(reqs):
        if r.constraints is not None:
            rows.append(i)
            items.append((r.constraints, logits[i], drafts[i].tolist()))
    if not rows:
        return []
    missing = []
    for i, (rc, _, _), pr in zip(rows, items, process_drafts(items)):
        t = pr.argmax[0] if pr.probs is None else draw(pr.probs[0], reqs[i].generator)
        if not rc.push_draft(t):  # (the mask allowed it, so the grammar takes it)
            missing.append(i)
            continue
        tokens[i], confs[i] = t, pr.confidence(0, t)
        if pr.probs is not None:
            q[i] = pr.probs[0]
    return missing


class NgramDrafter:
    """Prompt lookup: the token that most often followed the longest matching suffix
    n-gram (ngram.py); no forward, no draft KV. Its proposals are deterministic, so the
    acceptance rule takes q one-hot on them."""

    kind = "ngram"

    def __init__(self, n: int = 3) -> None:
        self.n = n
        self.book = NgramBook(n)

    def release(self, rid: str) -> None:
        self.book.release(rid)

    def step(self, reqs: list[Request], drafts: np.ndarray) -> DraftRound:
        """A constrained request's proposal is pushed into its grammar; one the grammar forbids
        is no proposal (its draft chain ends there)."""
        tokens, conf, missing = [], [], []
        for m, (req, d) in enumerate(zip(reqs, drafts.tolist())):
            prop = self.book.index(req.rid, req.all_ids).propose((req.all_ids + d)[-self.n :])
            if prop is not None and req.constraints is not None and not \
                    req.constraints.push_draft(prop[0]):
                prop = None
            if prop is None:
                missing.append(m)
                prop = (0, math.nan)
            tokens.append(prop[0])
            conf.append(prop[1])
        return DraftRound(tokens, conf, None, missing or None)
