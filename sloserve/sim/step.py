"""One simulated engine step: the real scheduler, policy and step books, model forwards priced
by the cost model, verify outcomes drawn from the acceptance process.

`SimStepRunner.step` follows `sloserve.runtime.step.StepRunner.step` call for call: the
same schedule, the same plan and draft rounds (`draft_rounds` over the `SimDrafter`), the
same books (runtime/step_books.py: prefill progress, the draft's prefill catch-up, KV
rollback, counters). Only two things differ: the step's duration is priced,

    T_step = T_draft (sum of the draft forwards the rounds made) + T_draft_prefill
           + T_fwd(target; N_ctx = sum_seg (start + q_len), N_q = sum_seg q_len)
           + cost.verify_fixed * [any draft token verified] + cost.overhead

with one segment per prefill chunk (q_len = chunk) and per decode (q_len = 1 + k_r), and
the tokens are dummies whose acceptance was drawn when the request arrived. Every commit
appends a chunk (step end, cumulative output tokens) to the request's stream; finished
requests are queued in `finished` for the event loop.
"""

from __future__ import annotations

from typing import Protocol

from sloserve.estimator.cost_model import CostModel
from sloserve.runtime.config import EngineConfig
from sloserve.runtime.drafter.rounds import DraftResult, draft_rounds, step_info
from sloserve.runtime.kv_cache import BlockAllocator
from sloserve.runtime.request import FinishReason, Request, Status
from sloserve.runtime.scheduler import Scheduler
from sloserve.runtime.stats import EngineStats
from sloserve.runtime.step_books import (
    Prefills,
    account_step,
    advance_prefills,
    binding_tpot,
    prefill_load,
    settle_kv,
    take_draft_prefill,
)
from sloserve.sim.drafter import DUMMY_TOKEN, SimDrafter
from sloserve.slo import effective_slo
from sloserve.speculation import SpecPolicy, SpecSession


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

    # ----- the step
    def step(self, now: float) -> float:
        """Run one step starting at simulated time `now`; 0.0 if nothing was scheduled."""
        sched = self.scheduler.schedule(self.cfg.k_max if self.speculative else 0)
        if sched.preempted:
            self.stats.preemptions += len(sched.preempted)
        if sched.empty:
            return 0.0
        prefills, decodes = sched.prefills, sched.decodes
        n_q, n_ctx = prefill_load(prefills)
        draft_prefill = self._draft_reads_prefill(prefills) if self.speculative else 0.0
        draft: DraftResult | None = None
        if decodes and self.speculative:
            draft = self._speculate(decodes, n_q, n_ctx)
        ks = draft.k.tolist() if draft is not None else [0] * len(decodes)
        # target segments: start = kv_len, q = 1 + k; N_ctx counts start + q
        k_sum = sum(ks)
        n_ctx += sum([r.kv_len for r in decodes]) + len(decodes) + k_sum
        n_q += len(decodes) + k_sum
        draft_time = self.drafter.time if draft is not None and self.drafter else 0.0
        verify_time = self.cost.target.time(n_ctx, n_q)
        if k_sum:
            verify_time += self.cost.verify_fixed
        dt = draft_prefill + draft_time + verify_time + self.cost.overhead
        end = now + dt
        for i in advance_prefills(prefills):
            self._commit(prefills[i][0], 1, end)
        accepted = [0] * len(decodes)
        if k_sum:
            runs = self.run
            for i, r in enumerate(decodes):
                k = ks[i]
                if k:  # k drafts from output position len(output_ids): the leading accepted run
                    a = runs[r.rid][len(r.output_ids)]
                    accepted[i] = k if a > k else a
        self._commit_decodes(decodes, accepted, end)
        slo = effective_slo(None, self.cfg.tpot_slo)
        if self._own_slo:  # some live request has its own TPOT SLO
            slo = binding_tpot(decodes, self.cfg.tpot_slo)
        account_step(self.stats, decodes, draft, accepted, dt, len(prefills), slo, end)
        if draft is not None:
            draft.session.finish(accepted, dt, draft_time, verify_time, end_time=end)
        return dt

    def _speculate(self, decodes: list[Request], prefill_tokens: int,
                   prefill_context: int) -> DraftResult:
        """Session (the plan), draft rounds (priced by the SimDrafter), verify lengths."""
        assert self.drafter is not None
        info = step_info(decodes, self.cfg.k_max, self.cfg.tpot_slo, prefill_tokens,
                         prefill_context)
        self.drafter.time = 0.0
        draft = draft_rounds(self.drafter, SpecSession(self.policy, info), decodes)
        # host seconds in the policy (the drafter's forwards cost no host time here)
        self.stats.policy_time_total += draft.policy_time
        if self.drafter.kind == "model":
            self.stats.draft_forwards += draft.forwards
        return draft

    def _draft_reads_prefill(self, prefills: Prefills) -> float:
        """Seconds of the draft model reading this step's prefill chunks (the engine's
        take_draft_prefill forward); 0 for model-free drafters."""
        if not prefills or self.cfg.drafter != "model":
            return 0.0
        ctx = q = 0
        for _, start, end in take_draft_prefill(prefills):
            q += end - start
            ctx += end
        return self.cost.draft.time(ctx, q) if q else 0.0

    # ----- commit: append tokens, length stop, KV rollback
    def _commit(self, r: Request, n: int, end: float) -> None:
        """Append up to n dummy tokens (fewer at max_new_tokens or the context limit)."""
        out = r.output_ids
        m = r.room(self.max_context)  # >= 1 for a running request
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
        settle_kv(r, self.scheduler)

    def _commit_decodes(self, decodes: list[Request], accepted: list[int], end: float) -> None:
        """_commit for every decode (accepted + 1 tokens each), its common path inlined
        (it runs ~10^6 times in a full-trace replay)."""
        zeros, streams = self._zeros, self.streams
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
            settle_kv(r, self.scheduler)
        self.stats.generated_tokens += gen
