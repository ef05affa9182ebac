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
from sloserve.runtime.model_runner import ModelRunner
from sloserve.runtime.request import Request
from sloserve.runtime.sampler import draw, processed_probs
from sloserve.runtime.spec.ngram import NgramIndex
from sloserve.runtime.spec.rounds import DraftRound


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
        return pick(reqs, logits)

    def read_prefill(self, segs: list[Segment]) -> None:
        """The draft model reads prefill chunks (the engine's catch-up of a new prompt)."""
        self.runner.forward(segs)


def pick(reqs: list[Request], logits: torch.Tensor) -> DraftRound:
    """The draft token of each row of logits [n, V]: the argmax for greedy requests, a
    sample from the processed distribution (kept as q for the acceptance rule) otherwise;
    its confidence is that distribution's probability of it."""
    greedy = [i for i, r in enumerate(reqs) if r.params.greedy]
    if len(greedy) == len(reqs):  # the common case: no per-row work
        conf, tok = torch.softmax(logits, dim=-1).max(dim=-1)
        return DraftRound(tok.tolist(), conf.tolist())
    tokens, confs = [0] * len(reqs), [0.0] * len(reqs)
    q: list[torch.Tensor | None] = [None] * len(reqs)
    if greedy:
        conf, tok = torch.softmax(logits[greedy], dim=-1).max(dim=-1)
        for i, t, c in zip(greedy, tok.tolist(), conf.tolist()):
            tokens[i], confs[i] = t, c
    sampled = [i for i, r in enumerate(reqs) if not r.params.greedy]
    probs = processed_probs(logits[sampled], [reqs[i].params for i in sampled])
    for j, i in enumerate(sampled):
        t = draw(probs[j], reqs[i].generator)
        tokens[i], confs[i], q[i] = t, float(probs[j, t]), probs[j]
    return DraftRound(tokens, confs, q)


class NgramDrafter:
    """Prompt lookup: the token that most often followed the longest matching suffix
    n-gram (ngram.py); no forward, no draft KV. Its proposals are deterministic, so the
    acceptance rule takes q one-hot on them."""

    kind = "ngram"

    def __init__(self, n: int = 3) -> None:
        self.n = n
        self._indexes: dict[str, NgramIndex] = {}

    def release(self, rid: str) -> None:
        self._indexes.pop(rid, None)

    def _index(self, req: Request) -> NgramIndex:
        idx = self._indexes.get(req.rid)
        if idx is None or len(idx.tokens) > req.num_tokens:
            idx = self._indexes[req.rid] = NgramIndex(self.n)
        idx.extend(req.all_ids[len(idx.tokens) :])
        return idx

    def step(self, reqs: list[Request], drafts: np.ndarray) -> DraftRound:
        tokens, conf, missing = [], [], []
        for m, (req, d) in enumerate(zip(reqs, drafts.tolist())):
            prop = self._index(req).propose((req.all_ids + d)[-self.n :])
            if prop is None:
                missing.append(m)
                prop = (0, math.nan)
            tokens.append(prop[0])
            conf.append(prop[1])
        return DraftRound(tokens, conf, None, missing or None)
