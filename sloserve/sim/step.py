"""One simulated engine step: the real scheduler and policy, model forwards priced by the cost
model, verify outcomes drawn from the acceptance process.

Mirrors `sloserve.runtime.step.StepRunner.step` line for line where it keeps books:
schedule -> drafting via `run_drafting` (the `SimDrafter`) -> one target "forward" over
prefill chunks and decode/verify segments -> accepted counts -> commit (append tokens with
max_new_tokens semantics; kv_len, draft_kv_len, scheduler.trim) -> EngineStats ->
policy.observe. The step's simulated duration is

    T_step = T_draft (sum of the draft forwards run_drafting made)
           + T_fwd(target; N_ctx = sum_seg (start + q_len), N_q = sum_seg q_len)
           + cost.overhead

with one segment per prefill chunk (q_len = chunk) and per decode (q_len = 1 + k_r).

Same invariants after every step as the real step: a decoding request has
kv_len == num_tokens - 1 and draft_kv_len <= num_tokens - 1, and holds no block beyond its
num_tokens positions (rejected tail blocks are freed; the scheduler reserves the next
step's). Every commit appends a chunk (step end, cumulative output tokens) to the request's
stream; finished requests are queued in `finished` for the event loop.

The per-request loops are written out (not helper calls) because they run ~10^6 times in
a full-trace replay; EngineStats.verified_at / accepted_at are filled from histograms in
`finalize_stats`.
"""

from __future__ import annotations

import math
import time
from typing import Protocol

import numpy as np

from sloserve.drafter.policy import SpecPolicy, VerifyOutcome
from sloserve.estimator.cost_model import CostModel
from sloserve.runtime.config import EngineConfig
from sloserve.runtime.kv_cache import BlockAllocator
from sloserve.runtime.request import FinishReason, Request, Status
from sloserve.runtime.scheduler import Scheduler
from sloserve.runtime.speculative import DraftResult, run_drafting, step_info
from sloserve.runtime.stats import EngineStats, StepRecord
from sloserve.sim.drafter import DUMMY_TOKEN, SimDrafter


class Stream(Protocol):
    """What the client of one request sees: chunk end times and cumulative token counts."""

    chunk_s: list[float]
    chunk_tokens: list[int]


class SimStepRunner:
    """Engine books without models; `step(now)` returns the step's simulated seconds."""

    def __init__(self, cfg: EngineConfig, cost: CostModel, policy: SpecPolicy,
                 stats: EngineStats, max_context: int | None = None):
        self.cfg = cfg
        self.cost = cost
        self.policy = policy
        self.stats = stats
        self.max_context = max_context  # the target's max_position_embeddings (None: no cap)
        self.alloc = BlockAllocator(cfg.num_blocks, cfg.block_size)  # sized like the engine's
        self.scheduler = Scheduler(cfg.scheduler, self.alloc)
        self.conf: dict[str, list[float]] = {}  # rid -> draft confidence per output position
        self.run: dict[str, list[int]] = {}  # rid -> accepted run length per output position
        self.streams: dict[str, Stream] = {}
        self.finished: list[Request] = []  # finished since the event loop last looked
        self.drafter: SimDrafter | None = None
        if cfg.drafter in ("model", "ngram"):
            self.drafter = SimDrafter(cost.draft, self.conf, kind=cfg.drafter)
        self.speculative = self.drafter is not None and policy.speculates and cfg.k_max > 0
        self._accepted_hist = [0] * (cfg.k_max + 1)  # verifies by accepted count
        self._own_slo = 0  # live requests with their own TPOT SLO
        self._zeros = [[DUMMY_TOKEN] * n for n in range(cfg.k_max + 2)]

    # ----- request lifecycle
    def add(self, req: Request, conf: list[float], run: list[int], stream: Stream) -> None:
        """Queue a request with its acceptance draws (module sloserve.sim.acceptance)."""
        self.conf[req.rid] = conf
        self.run[req.rid] = run
        self.streams[req.rid] = stream
        self.stats.prompt_tokens += len(req.prompt_ids)
        self._own_slo += req.params.tpot_slo is not None
        self.scheduler.add(req)

    def finish(self, req: Request, end: float) -> None:
        req.status = Status.FINISHED
        req.finish_reason = FinishReason.LENGTH
        req.finish_time = end
        self.scheduler.remove(req)
        self.policy.release(req.rid)
        if self.drafter is not None:
            self.drafter.release(req.rid)
        del self.conf[req.rid], self.run[req.rid], self.streams[req.rid]
        self._own_slo -= req.params.tpot_slo is not None
        self.stats.requests_finished += 1
        self.finished.append(req)

    def _prefill_draft(self, prefills) -> float:
        """Seconds of the draft model reading this step's prefill chunks (the engine's
        StepRunner._prefill_draft); 0 for model-free drafters."""
        if not prefills or self.cfg.drafter != "model":
            return 0.0
        ctx = q = 0
        for r, n in prefills:
            end = r.kv_len + n
            if r.draft_kv_len < end:
                q += end - r.draft_kv_len
                ctx += end
                r.draft_kv_len = end
        return self.cost.draft.time(ctx, q) if q else 0.0

    # ----- the step
    def step(self, now: float) -> float:
        """Run one step starting at simulated time `now`; 0.0 if nothing was scheduled."""
        sched = self.scheduler.schedule(self.cfg.k_max if self.speculative else 0)
        if sched.preempted:
            self.stats.preemptions += len(sched.preempted)
        if sched.empty:
            return 0.0
        decodes = sched.decodes
        n_ctx = n_q = 0
        for r, n in sched.prefills:
            n_ctx += r.kv_len + n
            n_q += n
        draft_prefill = self._prefill_draft(sched.prefills) if self.speculative else 0.0
        draft = self._draft(decodes, n_q, n_ctx) if decodes and self.speculative else None
        ks = draft.k.tolist() if draft is not None else [0] * len(decodes)
        # target segments: start = kv_len, q = 1 + k; N_ctx counts start + q
        k_sum = sum(ks)
        n_ctx += sum([r.kv_len for r in decodes]) + len(decodes) + k_sum
        n_q += len(decodes) + k_sum
        t = self.cost.target
        draft_time = self.drafter.time if draft is not None else 0.0
        verify_time = t.time(n_ctx, n_q)
        dt = draft_prefill + draft_time + verify_time + self.cost.overhead
        end = now + dt
        for r, n in sched.prefills:
            r.kv_len += n
            if r.kv_len == r.num_tokens:  # prompt (or recompute) done: first new token
                self._commit(r, 1, end)
        accepted = [0] * len(decodes)
        if k_sum:
            runs = self.run
            for i, r in enumerate(decodes):
                k = ks[i]
                if k:  # k drafts from output position len(output_ids): the leading accepted run
                    a = runs[r.rid][len(r.output_ids)]
                    accepted[i] = k if a > k else a
        self._commit_decodes(decodes, accepted, end)
        self._account(decodes, draft, ks, k_sum, accepted, dt, draft_time, len(sched.prefills),
                      end, verify_time)
        return dt

    def _draft(self, decodes: list[Request], prefill_tokens: int,
               prefill_context: int) -> DraftResult:
        info = step_info(decodes, self.cfg.k_max, self.cfg.tpot_slo,
                         prefill_tokens=prefill_tokens, prefill_context=prefill_context)
        self.drafter.time = 0.0
        t = time.perf_counter()
        res = run_drafting(self.drafter, self.policy, decodes, info)
        # host seconds in the policy (run_drafting's own timer covers the drafter calls)
        self.stats.policy_time_total += time.perf_counter() - t - res.draft_time
        if self.drafter.kind == "model":
            self.stats.draft_forwards += res.forwards
        self._step_info = info
        return res

    # ----- commit: append tokens, length stop, KV rollback
    def _commit(self, r: Request, n: int, end: float) -> None:
        """Append up to n dummy tokens (fewer at max_new_tokens or the context limit)."""
        out = r.output_ids
        m = r.params.max_new_tokens - len(out)  # room left; >= 1 for a running request
        if self.max_context is not None:
            m = min(m, self.max_context - len(r.prompt_ids) - len(out))
        done = n >= m  # no EOS or stop strings in dummy tokens: only length rules stop
        if not done:
            m = n
        out += self._zeros[m] if m < len(self._zeros) else [DUMMY_TOKEN] * m
        if r.first_token_time is None:
            r.first_token_time = end
        self.stats.generated_tokens += m
        stream = self.streams[r.rid]
        stream.chunk_s.append(end)
        stream.chunk_tokens.append(len(out))
        if done:
            self.finish(r, end)
            return
        num = len(r.prompt_ids) + len(out)
        r.kv_len = num - 1
        if r.draft_kv_len > num - 1:
            r.draft_kv_len = num - 1
        if len(r.blocks) > self.alloc.blocks_for(num):  # rejected tail blocks
            self.scheduler.trim(r, num)

    def _commit_decodes(self, decodes: list[Request], accepted: list[int], end: float) -> None:
        """_commit for every decode (accepted + 1 tokens each), its common path inlined."""
        zeros, streams, bs = self._zeros, self.streams, self.alloc.block_size
        gen = 0
        for i, r in enumerate(decodes):
            n = accepted[i] + 1
            out = r.output_ids
            if n >= r.params.max_new_tokens - len(out) or self.max_context is not None:
                self._commit(r, n, end)  # may finish: the general path
                continue
            out += zeros[n]
            gen += n
            stream = streams[r.rid]
            stream.chunk_s.append(end)
            stream.chunk_tokens.append(len(out))
            num = len(r.prompt_ids) + len(out)
            r.kv_len = num - 1
            if r.draft_kv_len >= num:
                r.draft_kv_len = num - 1
            if len(r.blocks) > (num + bs - 1) // bs:  # rejected tail blocks
                self.scheduler.trim(r, num)
        self.stats.generated_tokens += gen

    # ----- accounting (StepRunner._account with simulated times)
    def _account(self, decodes, draft: DraftResult | None, ks: list[int], k_sum: int,
                 accepted: list[int], step_time: float, draft_time: float, n_prefill: int,
                 end: float, verify_time: float | None = None) -> None:
        s = self.stats
        s.steps += 1
        s.step_time_total += step_time
        n = len(decodes)
        chosen = s.chosen_k
        drafted = draft.drafted.tolist() if draft is not None else []
        proposed = sum(drafted)
        if not k_sum:  # plain decoding: record_verify(0, 0) per request
            chosen[0] += n
        else:  # EngineStats.record_verify, batched (per-position counts: finalize_stats)
            k_top = len(chosen) - 1
            acc_hist = self._accepted_hist
            v_steps = 0
            for i, r in enumerate(decodes):
                k = ks[i]
                chosen[k if k < k_top else k_top] += 1
                if k:
                    a = accepted[i]
                    acc_hist[a] += 1
                    v_steps += 1
                    sp = r.spec
                    sp.verify_steps += 1
                    sp.verified += k
                    sp.accepted += a
            s.verify_steps += v_steps
            s.verified += k_sum
            s.accepted += sum(accepted)
            s.spec_steps += 1
        if draft is not None:
            s.proposed += proposed
            for i, r in enumerate(decodes):
                r.spec.proposed += drafted[i]
        if n:
            slo = self.cfg.tpot_slo or math.inf
            if self._own_slo:  # some live request has its own TPOT SLO
                slo = min((r.params.tpot_slo or self.cfg.tpot_slo or math.inf) for r in decodes)
            if step_time > slo:
                s.slo_step_misses += 1
        s.history.append(StepRecord(
            end, n + n_prefill, n, proposed / n if drafted else 0.0, k_sum / n if n else 0.0,
            step_time,
        ))
        if draft is not None:
            self.policy.observe(self._step_info, VerifyOutcome(
                drafted=draft.drafted.copy(), verified=draft.k.copy(),
                accepted=np.array(accepted, dtype=np.int64), confidences=draft.confidences,
                step_time=step_time, draft_time=draft_time, verify_time=verify_time,
            ))

    def finalize_stats(self) -> None:
        """Fill EngineStats.verified_at / accepted_at (per draft position) from the
        histograms: a verify of k tokens accepting a counts at positions < k and < a."""
        s = self.stats
        ver = np.cumsum(np.asarray(s.chosen_k[::-1], dtype=np.int64))[::-1]  # [k_max + 1]
        acc = np.cumsum(np.asarray(self._accepted_hist[::-1], dtype=np.int64))[::-1]
        s.verified_at = ver[1:].tolist()
        s.accepted_at = acc[1:].tolist()
