"""The pull loop over a speculation session (sloserve.speculation.SpecSession): draft rounds
steered by the session, then its verify lengths.

Shared by the engine (runtime/step.py, draft model or n-gram lookup) and the simulator
(sim/step.py, a stand-in source): the same calls in the same order, so a policy cannot tell
them apart (SGLang's worker pushes the same calls from its own draft loop).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import torch

from sloserve.runtime.request import Request
from sloserve.slo import slo_array
from sloserve.speculation import SpecSession, StepInfo


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
    """What the drafting loop produced besides the session's decisions (the session holds
    who drafted what, the confidences and the verify lengths)."""

    session: SpecSession
    tokens: np.ndarray  # [B, k_max] int64 proposed tokens; row r valid up to drafted[r]
    # [B][s_r] processed draft distributions of sampling requests; None when no request sampled
    q: list[list[torch.Tensor]] | None = None
    draft_time: float = 0.0  # wall time of the drafting loop (forwards + plan calls)
    forwards: int = 0
    batch_sizes: list[int] = field(default_factory=list)  # requests per draft forward

    @property
    def drafted(self) -> np.ndarray:
        """[B] int64 s_r: draft tokens proposed per request."""
        return self.session.drafted

    @property
    def confidences(self) -> np.ndarray:
        """[B, k_max] float, NaN beyond s_r."""
        return self.session.confidences

    @property
    def k(self) -> np.ndarray:
        """[B] verify lengths chosen by the plan (zeros until the session chose them)."""
        v = self.session.verified
        return v if v is not None else np.zeros(self.session.step.batch_size, dtype=np.int64)

    @property
    def longest(self) -> int:
        return self.session.longest

    @property
    def policy_time(self) -> float:
        """Seconds inside the policy: plan, extend, verify_lengths (observe once finished)."""
        return self.session.plan_time + self.session.policy_time


def draft_rounds(source: DraftSource, session: SpecSession, reqs: list[Request],
                 room: np.ndarray | None = None) -> DraftResult:
    """The pull loop: draft rounds for the decode batch as the session steers them
    (after_round after each), then its verify lengths (res.k).
    room: [B] most draft tokens each request may have (the context window's room: a draft
    verified at a position beyond the window has no position embedding); None: k_max."""
    B, k_max = len(reqs), session.k_max
    tokens = np.zeros((B, k_max), dtype=np.int64)
    res = DraftResult(session, tokens)
    t0 = time.perf_counter()
    active = session.drafting.copy()
    if room is not None:
        active &= room > 0
    conf = np.full(B, np.nan)
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
            conf[rows] = np.asarray(rnd.conf, dtype=np.float64)[keep]
        else:
            tokens[rows, j] = rnd.tokens
            conf[rows] = rnd.conf
        j += 1
        active = session.after_round(conf, active).copy()
        if room is not None:
            active &= room > j
    res.draft_time = time.perf_counter() - t0
    session.verify_lengths()
    return res


def step_info(reqs: list[Request], k_max: int, default_slo: float | None,
              prefill_tokens: int, prefill_context: int) -> StepInfo:
    """The decode batch as a policy sees it."""
    return StepInfo(
        request_ids=[r.rid for r in reqs],
        context_lens=np.array([r.kv_len for r in reqs], dtype=np.int64),
        tpot_slo=slo_array([r.params.tpot_slo for r in reqs], default_slo),
        k_max=k_max,
        prefill_tokens=prefill_tokens,
        prefill_context=prefill_context,
        draft_lag=np.array([r.num_tokens - 1 - r.draft_kv_len for r in reqs], dtype=np.int64),
    )
