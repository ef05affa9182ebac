"""The speculative mechanism: draft rounds steered by a policy, verify segments, rollback.

Draft KV bookkeeping: the draft cache holds `req.draft_kv_len` tokens of `req.all_ids`. Its first
draft forward of a step feeds every token it has not seen (`all_ids[draft_kv_len:]`, usually 1;
2 after a step where all drafts were accepted: the last draft token and the bonus token; more
after steps without drafting), later forwards feed the previous draft token. After verify the
draft cache keeps only the prefix that matches the accepted tokens.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from sloserve.drafter.ngram import NgramIndex
from sloserve.drafter.policy import SpecPolicy, StepInfo
from sloserve.runtime.batch import Segment
from sloserve.runtime.model_runner import ModelRunner
from sloserve.runtime.request import Request
from sloserve.runtime.sampler import draw, processed_probs


@dataclass
class DraftResult:
    tokens: list[list[int]]  # [B][s_r] proposed tokens
    confidences: np.ndarray  # [B, s_max] float, NaN beyond s_r
    q: list[list[torch.Tensor]]  # [B][s_r] processed draft distributions (sampling requests)
    k: np.ndarray  # [B] verify lengths chosen by the policy
    draft_time: float = 0.0  # wall time of the drafting loop (forwards + policy calls)
    policy_time: float = 0.0  # wall time inside the policy's start/extend/verify_lengths
    forwards: int = 0
    batch_sizes: list[int] = field(default_factory=list)  # requests per draft forward


class Drafter:
    """Produces one draft token per request per call, from a draft model or from n-grams."""

    def __init__(self, runner: ModelRunner | None, ngram_n: int = 3):
        self.runner = runner
        self.ngram_n = ngram_n
        self._indexes: dict[str, NgramIndex] = {}

    @property
    def kind(self) -> str:
        return "model" if self.runner is not None else "ngram"

    def release(self, rid: str) -> None:
        self._indexes.pop(rid, None)

    def _index(self, req: Request) -> NgramIndex:
        idx = self._indexes.get(req.rid)
        if idx is None or len(idx.tokens) > req.num_tokens:
            idx = self._indexes[req.rid] = NgramIndex(self.ngram_n)
        idx.extend(req.all_ids[len(idx.tokens) :])
        return idx

    def step(self, reqs: list[Request], drafts: list[list[int]]) -> list[tuple[int, float, torch.Tensor | None] | None]:
        """One draft token for each request (given its drafts so far this step).
        Returns per request (token, confidence, q) or None when the drafter has no proposal."""
        if self.runner is None:
            out = []
            for req, d in zip(reqs, drafts):
                prop = self._index(req).propose((req.all_ids + d)[-self.ngram_n :])
                out.append(None if prop is None else (prop[0], prop[1], None))
            return out
        segs = []
        for req, d in zip(reqs, drafts):
            if d:  # feed the previous draft token
                segs.append(Segment(req.blocks, req.draft_kv_len, [d[-1]]))
            else:  # catch up on everything the draft cache has not seen
                segs.append(Segment(req.blocks, req.draft_kv_len, req.all_ids[req.draft_kv_len :]))
        logits, _ = self.runner.forward(segs)
        for req, seg in zip(reqs, segs):
            req.draft_kv_len = seg.kv_len
        return self._pick(reqs, logits)

    @staticmethod
    def _pick(reqs: list[Request], logits: torch.Tensor):
        out: list = [None] * len(reqs)
        greedy = [i for i, r in enumerate(reqs) if r.params.greedy]
        if greedy:
            probs = torch.softmax(logits[greedy], dim=-1)
            conf, tok = probs.max(dim=-1)
            for i, t, c in zip(greedy, tok.tolist(), conf.tolist()):
                out[i] = (t, c, None)
        sampled = [i for i, r in enumerate(reqs) if not r.params.greedy]
        if sampled:
            q = processed_probs(logits[sampled], [reqs[i].params for i in sampled])
            for j, i in enumerate(sampled):
                t = draw(q[j], reqs[i].generator)
                out[i] = (t, float(q[j, t]), q[j])
        return out


def run_drafting(drafter: Drafter, policy: SpecPolicy, reqs: list[Request], step: StepInfo) -> DraftResult:
    """Draft rounds for the decode batch as the policy steers them, then its verify lengths."""
    B, k_max = len(reqs), step.k_max
    tokens: list[list[int]] = [[] for _ in range(B)]
    q: list[list] = [[] for _ in range(B)]
    conf = np.full((B, k_max), np.nan)
    res = DraftResult(tokens, conf, q, np.zeros(B, dtype=np.int64))
    t0 = time.perf_counter()
    active = np.asarray(policy.start(step), dtype=bool).copy() if k_max > 0 else np.zeros(B, bool)
    res.policy_time += time.perf_counter() - t0
    j = 0
    while active.any() and j < k_max:
        rows = np.flatnonzero(active)
        props = drafter.step([reqs[i] for i in rows], [tokens[i] for i in rows])
        res.forwards += 1
        res.batch_sizes.append(len(rows))
        for i, prop in zip(rows, props):
            if prop is None:
                active[i] = False
                continue
            tokens[i].append(prop[0])
            conf[i, j] = prop[1]
            if prop[2] is not None:
                q[i].append(prop[2])
        j += 1
        if j < k_max and active.any():
            tp = time.perf_counter()
            active = active & np.asarray(policy.extend(step, conf[:, :j], active), dtype=bool)
            res.policy_time += time.perf_counter() - tp
    res.draft_time = time.perf_counter() - t0
    drafted = np.array([len(t) for t in tokens], dtype=np.int64)
    res.confidences = conf
    if drafted.any():
        tp = time.perf_counter()
        k = np.asarray(policy.verify_lengths(step, conf[:, : max(1, int(drafted.max()))], drafted))
        res.policy_time += time.perf_counter() - tp
        res.k = np.clip(k.astype(np.int64), 0, drafted)
    return res


def step_info(reqs: list[Request], k_max: int, default_slo: float | None,
              prefill_tokens: int, prefill_context: int) -> StepInfo:
    slo = [r.params.tpot_slo or default_slo or math.inf for r in reqs]
    return StepInfo(
        request_ids=[r.rid for r in reqs],
        context_lens=np.array([r.kv_len for r in reqs], dtype=np.int64),
        tpot_slo=np.array(slo, dtype=np.float64),
        k_max=k_max,
        prefill_tokens=prefill_tokens,
        prefill_context=prefill_context,
        draft_lag=np.array([r.num_tokens - 1 - r.draft_kv_len for r in reqs], dtype=np.int64),
    )
