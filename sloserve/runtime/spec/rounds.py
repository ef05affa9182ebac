"""Draft rounds steered by a plan (sloserve.speculation), then its verify lengths.

Shared by the engine (runtime/step.py, draft model or n-gram lookup) and the simulator
(sim/step.py, a stand-in source): the same calls in the same order, so a policy cannot tell
them apart.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import torch

from sloserve.runtime.request import Request
from sloserve.speculation import SpecPlan, StepInfo


@dataclass
class DraftRound:
    """One draft forward's proposals for the n requests it ran on, column by column."""

    tokens: list[int] | np.ndarray  # [n] proposed token (any value where missing)
    conf: list[float] | np.ndarray  # [n] its confidence (any value where missing)
    q: list[torch.Tensor | None] | None = None  # [n] processed distributions, sampling rows
    missing: list[int] | None = None  # positions in 0..n-1 with no proposal (n-gram misses)


class DraftSource(Protocol):
    """Proposes one draft token per request per call: the draft model, n-gram lookup
    (draft_sources.py) or the simulator's stand-in (sim/drafter.py). `kind` is "model" (a
    forward per call, a draft KV cache to keep) or "ngram" (no forward)."""

    @property
    def kind(self) -> str: ...

    def step(self, reqs: list[Request], drafts: np.ndarray) -> DraftRound:
        """One draft token for each request. drafts: [n, j] int64, the j tokens each request
        drafted so far this step (all requests in one call have drafted the same number)."""
        ...

    def release(self, rid: str) -> None:
        """The request finished: drop its state."""
        ...


@dataclass
class DraftResult:
    tokens: np.ndarray  # [B, k_max] int64 proposed tokens; row r valid up to drafted[r]
    drafted: np.ndarray  # [B] int64 s_r: draft tokens proposed per request
    confidences: np.ndarray  # [B, k_max] float, NaN beyond s_r
    # [B][s_r] processed draft distributions of sampling requests; None when no request sampled
    q: list[list[torch.Tensor]] | None
    k: np.ndarray  # [B] verify lengths chosen by the plan (zeros until choose_verify_lengths)
    longest: int = 0  # max_r s_r
    draft_time: float = 0.0  # wall time of the drafting loop (forwards + plan calls)
    policy_time: float = 0.0  # wall time inside the plan's extend / verify_lengths
    forwards: int = 0
    batch_sizes: list[int] = field(default_factory=list)  # requests per draft forward


def draft_rounds(source: DraftSource, plan: SpecPlan, reqs: list[Request],
                 k_max: int, room: np.ndarray | None = None) -> DraftResult:
    """Draft rounds for the decode batch as the plan steers them (extend after each).
    room: [B] most draft tokens each request may have (the context window's room: a draft
    verified at a position beyond the window has no position embedding); None: k_max."""
    B = len(reqs)
    tokens = np.zeros((B, k_max), dtype=np.int64)
    conf = np.full((B, k_max), np.nan)  # NaN exactly where nothing was drafted
    res = DraftResult(tokens, np.zeros(B, dtype=np.int64), conf, None,
                      np.zeros(B, dtype=np.int64))
    t0 = time.perf_counter()
    active = np.asarray(plan.drafting, dtype=bool).copy() if k_max > 0 else np.zeros(B, bool)
    if room is not None:
        active &= room > 0
    j = 0
    # few numpy calls per round: this runs per draft round of every step, mostly at small
    # batch sizes where each call's fixed cost dominates (the simulator's hot path)
    while j < k_max:
        rows = active.nonzero()[0]  # [n]; all of them drafted exactly j tokens so far
        if not len(rows):
            break
        rnd = source.step([reqs[i] for i in rows.tolist()], tokens[rows, :j])
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
        if not rnd.missing or np.count_nonzero(active):
            tp = time.perf_counter()
            active &= np.asarray(plan.extend(conf[:, :j], active), dtype=bool)
            res.policy_time += time.perf_counter() - tp
        if room is not None:
            active &= room > j
    res.draft_time = time.perf_counter() - t0
    if j:
        res.drafted = drafted = np.isfinite(conf[:, :j]).sum(axis=1)  # [B] s_r
        # most draft tokens of any request: j, unless the last round proposed nothing
        res.longest = int(drafted[drafted.argmax()])
    return res


def choose_verify_lengths(plan: SpecPlan, res: DraftResult) -> None:
    """Ask the plan how many of its drafted tokens each request verifies (res.k)."""
    s = res.longest
    if not s:
        return
    tp = time.perf_counter()
    k = np.asarray(plan.verify_lengths(res.confidences[:, :s], res.drafted.copy()))
    res.policy_time += time.perf_counter() - tp
    # 0 <= k <= drafted whatever the plan returned
    res.k = np.minimum(np.maximum(k.astype(np.int64), 0), res.drafted)


def step_info(reqs: list[Request], k_max: int, default_slo: float | None,
              prefill_tokens: int, prefill_context: int) -> StepInfo:
    """The decode batch as a policy sees it."""
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
