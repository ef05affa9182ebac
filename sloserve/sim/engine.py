"""The event-clock simulator (SmartSpec sec. 7.2): the real scheduler and speculation policy,
driven step by step on a simulated clock instead of the wall clock.

Clock: `now` starts at 0 (the run start, when arrival 0 is due). Before every step, every
request with arrival <= now joins the scheduler's queue (as the engine thread picks up
requests submitted during a step before its next step); the step then advances `now` by its
cost-model duration, and every token it emitted is streamed at the step's end. With nothing
to run, the clock jumps to the next arrival. Nothing sleeps: a run takes as long as its
Python work.

Randomness: one generator seeded by `seed` draws each request's acceptance sequence when
the request arrives, in arrival order, so a run is deterministic given the seed and every
policy sees the same per-token difficulty for the same request (common random numbers).

Not modelled: EOS and stop strings (outputs run to max_new_tokens or the context limit, as
replays use ignore_eos), sampling (temperature is ignored: acceptance follows the calibrated
greedy process), n-gram lookups that find nothing (the n-gram drafter always proposes, for
free), and host time outside the profile's `overhead` (policy and Python time per step).
"""

from __future__ import annotations

import gc
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from sloserve.estimator.cost_model import CostModel
from sloserve.policies.registry import make_policy
from sloserve.runtime.config import EngineConfig
from sloserve.runtime.request import InvalidRequest, Request, SamplingParams
from sloserve.runtime.stats import EngineStats
from sloserve.sim.acceptance import AcceptanceModel, builtin_pair_model, calibration_counts
from sloserve.sim.step import SimStepRunner


@dataclass(frozen=True)
class SimRequest:
    """What the simulator needs of a request: lengths, arrival, SLOs, category."""

    rid: str
    arrival_s: float
    prompt_tokens: int
    max_new_tokens: int
    category: str | None = None
    tpot_slo_s: float | None = None
    ttft_slo_s: float | None = None


@dataclass
class SimOutcome:
    """Simulated stream of one request: chunk_s[i] is the end of a step that gave it tokens,
    chunk_tokens[i] its cumulative output count after that chunk."""

    rid: str
    arrival_s: float
    chunk_s: list[float] = field(default_factory=list)
    chunk_tokens: list[int] = field(default_factory=list)
    error: str | None = None
    num_preemptions: int = 0

    @property
    def output_tokens(self) -> int:
        return self.chunk_tokens[-1] if self.chunk_tokens else 0

    @property
    def end_s(self) -> float:
        return self.chunk_s[-1] if self.chunk_s else self.arrival_s


class Simulator:
    """Replays requests through one policy on the simulated clock."""

    def __init__(self, cfg: EngineConfig, cost: CostModel, acceptance: AcceptanceModel | None = None,
                 *, seed: int = 0, max_context: int | None = None):
        if cfg.drafter != "model":  # no draft forwards: the profile's draft cost is moot
            cost = cost.without_draft()
        self.cfg = cfg
        self.cost = cost
        self.acceptance = acceptance or builtin_pair_model()
        self.seed = seed
        self.max_context = max_context
        self.stats = EngineStats(k_max=cfg.k_max)
        self.stats.history = deque()  # unbounded: the simulator downsamples it for reports
        drafter = "ngram" if cfg.drafter == "ngram" else "model"
        spec = cfg.spec_policy if cfg.drafter != "none" else "ar"
        self.policy = make_policy(spec, cost, k_max=cfg.k_max, drafter=drafter,
                                  calibration=calibration_counts(self.acceptance.calibration))
        self.runner = SimStepRunner(cfg, cost, self.policy, self.stats, max_context)
        self.now = 0.0

    def run(self, requests: Sequence[SimRequest],
            on_finish: Callable[[SimOutcome], None] | None = None) -> list[SimOutcome]:
        """Simulate until every request finished; outcomes in input order."""
        enabled = gc.isenabled()
        gc.disable()  # the loop allocates many short-lived objects and makes no cycles
        try:
            outcomes = self._run(requests, on_finish)
        finally:
            if enabled:
                gc.enable()
        return outcomes

    def _run(self, requests: Sequence[SimRequest],
             on_finish: Callable[[SimOutcome], None] | None) -> list[SimOutcome]:
        outcomes = [SimOutcome(r.rid, r.arrival_s) for r in requests]
        order = sorted(range(len(requests)), key=lambda i: requests[i].arrival_s)
        arrivals = [requests[i].arrival_s for i in order]
        # one stream of draws, consumed in arrival order: request i gets the same draws under
        # every policy (admission order does not depend on the policy)
        rng = np.random.default_rng(self.seed)
        runner, sched = self.runner, self.runner.scheduler
        by_rid: dict[str, SimOutcome] = {}
        now, nxt, total = 0.0, 0, len(order)
        while True:
            while nxt < total and arrivals[nxt] <= now:
                i = order[nxt]
                nxt += 1
                if self._admit(requests[i], outcomes[i], rng):
                    by_rid[requests[i].rid] = outcomes[i]
                elif on_finish is not None:
                    on_finish(outcomes[i])
            if not (sched.waiting or sched.running):
                if nxt >= total:
                    break
                now = max(now, arrivals[nxt])  # idle: jump to the next arrival
                continue
            dt = runner.step(now)
            if dt == 0.0:
                raise RuntimeError("the scheduler made no progress (a request that can never "
                                   "be scheduled?)")
            now += dt
            if runner.finished:
                for r in runner.finished:
                    out = by_rid.pop(r.rid)
                    out.num_preemptions = r.num_preemptions
                    if on_finish is not None:
                        on_finish(out)
                runner.finished.clear()
        self.now = now
        return outcomes

    def _admit(self, sr: SimRequest, out: SimOutcome, rng: np.random.Generator) -> bool:
        """Validate like Engine.add_request and queue; False (error recorded) if invalid."""
        try:
            if sr.prompt_tokens < 1:
                raise InvalidRequest("prompt", "is empty")
            if self.max_context is not None and sr.prompt_tokens >= self.max_context:
                raise InvalidRequest("prompt", f"has {sr.prompt_tokens} tokens; the context "
                                     f"window is {self.max_context}")
            alloc = self.runner.alloc
            if alloc.blocks_for(sr.prompt_tokens + 1 + self.cfg.k_max) > alloc.num_blocks:
                raise InvalidRequest("prompt", f"{sr.prompt_tokens} tokens do not fit the KV "
                                     f"cache ({self.cfg.kv_cache_tokens} tokens)")
            params = SamplingParams(max_new_tokens=sr.max_new_tokens, temperature=0.0,
                                    ignore_eos=True, tpot_slo=sr.tpot_slo_s,
                                    ttft_slo=sr.ttft_slo_s)
        except InvalidRequest as e:
            out.error = f"InvalidRequest: {e}"
            return False
        # output positions 0..max_new + k_max: a step may draft k_max past the last token
        draws = self.acceptance.draw(rng, sr.max_new_tokens + self.cfg.k_max + 1, sr.category)
        req = Request(rid=sr.rid, prompt_ids=[0] * sr.prompt_tokens, params=params,
                      arrival=sr.arrival_s)
        self.runner.add(req, draws.conf, draws.run, out)
        return True

    def check_idle_integrity(self) -> None:
        """Raise unless the KV pool is consistent with the live requests (all free if idle)."""
        sched = self.runner.scheduler
        live = list(sched.running) + list(sched.waiting)
        self.runner.alloc.check_integrity([r.blocks for r in live])
