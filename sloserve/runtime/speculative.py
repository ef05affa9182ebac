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
    tokens: np.ndarray  # [B, k_max] int64 proposed tokens; row r valid up to drafted[r]
    drafted: np.ndarray  # [B] int64 s_r: draft tokens proposed per request
    confidences: np.ndarray  # [B, s_max] float, NaN beyond s_r
    # [B][s_r] processed draft distributions of sampling requests; None when no request sampled
    q: list[list[torch.Tensor]] | None
    k: np.ndarray  # [B] verify lengths chosen by the policy
    draft_time: float = 0.0  # wall time of the drafting loop (forwards + policy calls)
    policy_time: float = 0.0  # wall time inside the policy's start/extend/verify_lengths
    forwards: int = 0
    batch_sizes: list[int] = field(default_factory=list)  # requests per draft forward


@dataclass
class DraftRound:
    """One draft forward's proposals for the n requests it ran on, column by column."""

    tokens: list[int] | np.ndarray  # [n] proposed token (any value where missing)
    conf: list[float] | np.ndarray  # [n] its confidence (any value where missing)
    q: list[torch.Tensor | None] | None = None  # [n] processed distributions, sampling rows
    missing: list[int] | None = None  # positions in 0..n-1 with no proposal (n-gram misses)


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

    def step(self, reqs: list[Request], drafts: np.ndarray) -> DraftRound:
        """One draft token for each request. drafts: [n, j] int64, the j tokens each request
        drafted so far this step (every request in a draft forward has drafted the same
        number: a request that stops never restarts within the step)."""
        if self.runner is None:
            tokens, conf, missing = [], [], []
            for m, (req, d) in enumerate(zip(reqs, drafts.tolist())):
                prop = self._index(req).propose((req.all_ids + d)[-self.ngram_n :])
                if prop is None:
                    missing.append(m)
                    prop = (0, math.nan)
                tokens.append(prop[0])
                conf.append(prop[1])
            return DraftRound(tokens, conf, None, missing or None)
        if drafts.shape[1]:  # feed each request's previous draft token
            segs = [Segment(req.blocks, req.draft_kv_len, [t])
                    for req, t in zip(reqs, drafts[:, -1].tolist())]
        else:  # catch up on everything the draft cache has not seen
            segs = [Segment(req.blocks, req.draft_kv_len, req.all_ids[req.draft_kv_len :])
                    for req in reqs]
        logits, _ = self.runner.forward(segs)
        for req, seg in zip(reqs, segs):
            req.draft_kv_len = seg.kv_len
        return self._pick(reqs, logits)

    @staticmethod
    def _pick(reqs: list[Request], logits: torch.Tensor) -> DraftRound:
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


def run_drafting(drafter: Drafter, policy: SpecPolicy, reqs: list[Request], step: StepInfo) -> DraftResult:
    """Draft rounds for the decode batch as the policy steers them, then its verify lengths."""
    B, k_max = len(reqs), step.k_max
    tokens = np.zeros((B, k_max), dtype=np.int64)
    conf = np.full((B, k_max), np.nan)  # NaN exactly where nothing was drafted
    res = DraftResult(tokens, np.zeros(B, dtype=np.int64), conf, None,
                      np.zeros(B, dtype=np.int64))
    t0 = time.perf_counter()
    active = np.asarray(policy.start(step), dtype=bool).copy() if k_max > 0 else np.zeros(B, bool)
    res.policy_time += time.perf_counter() - t0
    j = 0
    # few numpy calls per round: this runs per draft round of every step, mostly at small
    # batch sizes where each call's fixed cost dominates (the simulator's hot path)
    while j < k_max:
        rows = active.nonzero()[0]  # [n]; all of them drafted exactly j tokens so far
        if not len(rows):
            break
        rnd = drafter.step([reqs[i] for i in rows.tolist()], tokens[rows, :j])
        res.forwards += 1
        res.batch_sizes.append(len(rows))
        if rnd.q is not None:
            if res.q is None:
                res.q = [[] for _ in range(B)]
            for i, qi in zip(rows.tolist(), rnd.q):
                if qi is not None:
                    res.q[i].append(qi)
        if rnd.missing:  # no proposal: those requests stop drafting
            active[rows[rnd.missing]] = False
            keep = np.ones(len(rows), dtype=bool)
            keep[rnd.missing] = False
            rows = rows[keep]
            tokens[rows, j] = np.asarray(rnd.tokens)[keep]
            conf[rows, j] = np.asarray(rnd.conf, dtype=np.float64)[keep]
        else:
            tokens[rows, j] = rnd.tokens
            conf[rows, j] = rnd.conf
        j += 1
        if j < k_max and (not rnd.missing or np.count_nonzero(active)):
            tp = time.perf_counter()
            active &= np.asarray(policy.extend(step, conf[:, :j], active), dtype=bool)
            res.policy_time += time.perf_counter() - tp
    res.draft_time = time.perf_counter() - t0
    s = 0  # most draft tokens of any request: j, unless the last round proposed nothing
    if j:
        res.drafted = drafted = np.isfinite(conf[:, :j]).sum(axis=1)  # [B] s_r
        s = int(drafted[drafted.argmax()])
    if s:
        tp = time.perf_counter()
        k = np.asarray(policy.verify_lengths(step, conf[:, :s], drafted.copy()))
        res.policy_time += time.perf_counter() - tp
        # 0 <= k <= drafted whatever the policy returned
        res.k = np.minimum(np.maximum(k.astype(np.int64), 0), drafted)
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
