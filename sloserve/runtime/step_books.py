"""The books one step keeps, shared by the engine (runtime/step.py) and the simulator
(sim/step.py): what a step does to request lengths, KV and counters is the same whether its
forwards ran or were priced. Each caller keeps only what differs (tokens and time).

Invariants after every step, for every running request that is decoding (settle_kv):
    kv_len == num_tokens - 1  and  draft_kv_len <= num_tokens - 1,
and its blocks cover exactly the positions it may still need (rejected tail blocks freed).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from sloserve.runtime.drafter.rounds import DraftResult
from sloserve.runtime.request import Request
from sloserve.runtime.scheduler import Scheduler
from sloserve.runtime.stats import EngineStats, StepRecord
from sloserve.slo import effective_slo

Prefills = Sequence[tuple[Request, int]]  # (request, chunk length) as the scheduler gives them


def prefill_load(prefills: Prefills) -> tuple[int, int]:
    """(query tokens, context tokens) of the step's prefill chunks (before they run)."""
    return sum(n for _, n in prefills), sum(r.kv_len + n for r, n in prefills)


def take_draft_prefill(prefills: Prefills) -> list[tuple[Request, int, int]]:
    """(request, start, end): the tokens of each prefill chunk the draft model has not read,
    its draft_kv_len advanced to `end`. A speculating engine's draft model reads prefill
    chunks in the same step as the target, so a request starts decoding with its draft cache
    caught up (draft lag 0): otherwise its first draft forward would carry the whole prompt
    and the policy would price speculation for it out of reach. Call before
    advance_prefills (kv_len is still each chunk's start)."""
    out = []
    for r, n in prefills:
        end = r.kv_len + n
        if r.draft_kv_len < end:
            out.append((r, r.draft_kv_len, end))
            r.draft_kv_len = end
    return out


def advance_prefills(prefills: Prefills) -> list[int]:
    """Count each chunk into its request's KV. Returns the indices of the requests whose
    prompt (or recompute) is now complete: each emits its first new token this step."""
    done = []
    for i, (r, n) in enumerate(prefills):
        r.kv_len += n
        if r.kv_len == r.num_tokens:
            done.append(i)
    return done


def settle_kv(req: Request, scheduler: Scheduler) -> None:
    """After a running request appended this step's tokens (accepted drafts + one): the
    target KV holds all but the last token (it was computed from its prefix; the token
    itself is fed next step), the draft cache at most that (it drops its rejected drafts),
    and the blocks past the request's tokens return to the pool (rejected drafts' KV)."""
    num = req.num_tokens
    req.kv_len = num - 1
    if req.draft_kv_len > num - 1:
        req.draft_kv_len = num - 1
    scheduler.trim(req, num)


def binding_tpot(decodes: Sequence[Request], default: float | None) -> float:
    """The tightest TPOT SLO among the decoding requests (inf when none has one)."""
    return min((effective_slo(r.params.tpot_slo, default) for r in decodes), default=math.inf)


def account_step(stats: EngineStats, decodes: Sequence[Request], draft: DraftResult | None,
                 accepted: Sequence[int], step_time: float, n_prefill: int, slo: float,
                 t_end: float) -> None:
    """Count one step: speculation per request and in total, the SLO rule's misses and the
    step record. accepted: [B] draft tokens each decode accepted; slo: binding_tpot."""
    s = stats
    s.steps += 1
    s.step_time_total += step_time
    n = len(decodes)
    ks = draft.k.tolist() if draft is not None else []
    k_sum = sum(ks)
    chosen = s.chosen_k
    if not k_sum:  # plain decoding (or nothing verified): k = 0 for every request
        chosen[0] += n
    else:
        k_top, acc_hist = len(chosen) - 1, s.accepted_k
        v_steps = acc_sum = 0
        for i, r in enumerate(decodes):
            k = ks[i]
            chosen[k if k < k_top else k_top] += 1
            if k:
                a = accepted[i]
                acc_hist[a] += 1
                v_steps += 1
                acc_sum += a
                sp = r.spec
                sp.verify_steps += 1
                sp.verified += k
                sp.accepted += a
        s.verify_steps += v_steps
        s.verified += k_sum
        s.accepted += acc_sum
        s.spec_steps += 1
    proposed = 0
    if draft is not None:
        drafted = draft.drafted.tolist()
        proposed = sum(drafted)
        s.proposed += proposed
        for i, r in enumerate(decodes):
            r.spec.proposed += drafted[i]
    if n and step_time > slo:
        s.slo_step_misses += 1
    s.history.append(StepRecord(
        t_end, n + n_prefill, n, proposed / n if draft is not None else 0.0,
        k_sum / n if n else 0.0, step_time,
    ))
