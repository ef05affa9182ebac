"""The sloserve half of the SPECSERVE worker, free of SGLang imports (tested without SGLang).

SGLang's EAGLE-family workers draft a fixed number of steps per batch (one runtime state per
step count, switched by its AdaptiveController), so the worker asks a SpecServe plan for
one draft length per decode batch before drafting (`SpecServePlan.uniform_rounds`: the
plan's E and worst-case SLO rule with each request's predicted acceptance), then reports the
verify outcome back. Per step:

    k = controller.decide(rids, seq_lens, slos)      # before SGLang drafts
    ... SGLang drafts k steps, verifies, extends the draft cache ...
    controller.feedback(num_correct_drafts_per_req, step_time, draft_time, verify_time)

The draft forwards' time is reported as the step's drafting; the draft reading the verified
window afterwards (which SGLang runs at every step, k = 0 included) counts in the step's
overhead. Without draft confidences the policy learns each request's acceptance from its
accepted counts. `SGLangStepsPolicy` is the adapter SGLang's
AdaptiveController drives: it switches to the step count `decide` chose.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from sloserve.policies.specserve.plan import SpecServePlan
from sloserve.speculation import SpecPolicy, StepInfo, VerifyOutcome


@dataclass
class RequestSpec:
    """One request's speculation as this worker ran it."""

    proposed: int = 0  # draft tokens proposed (sum of k over its decode steps)
    accepted: int = 0  # draft tokens accepted
    unsent: list[int] = field(default_factory=list)  # k of each decode step not yet reported


@dataclass
class StepDecision:
    """What `decide` chose for one decode batch, kept until its feedback."""

    plan: SpecServePlan
    k: int
    rids: list[str]
    context: int  # KV tokens of the batch before the step
    started: float  # perf_counter when the step began
    draft_time: float = 0.0  # measured seconds of the draft forwards
    extend_time: float = 0.0  # ... of the draft reading the verified window
    verify_time: float = 0.0  # ... of the target's verify forward


@dataclass
class StepController:
    policy: SpecPolicy  # a SpecServe policy (its plans have uniform_rounds)
    k_max: int  # the most draft steps a batch may run (SGLang's largest runtime state)
    default_tpot_slo: float | None = None  # seconds; a request's own tpot_slo overrides it
    requests: dict[str, RequestSpec] = field(default_factory=dict)
    pending: StepDecision | None = None
    # profiling (python -m sloserve.profiler --engine sglang): draft lengths to cycle through
    # instead of the policy's, and a file that gets one JSON line of timings per step
    sweep: tuple[int, ...] = ()
    timings_path: str | None = None
    _sweep_at: int = 0

    def decide(self, rids: Sequence[str], seq_lens: Sequence[int],
               tpot_slos: Sequence[float | None]) -> int:
        """Draft steps (0 = plain decoding) for a decode batch. seq_lens: tokens per request
        including the one this step feeds; tpot_slos: each request's own SLO (None: the
        server's default)."""
        B = len(rids)
        slo = [s if s is not None else (self.default_tpot_slo or math.inf) for s in tpot_slos]
        step = StepInfo(
            request_ids=list(rids),
            context_lens=np.asarray(seq_lens, dtype=np.int64) - 1,  # KV already cached
            tpot_slo=np.asarray(slo, dtype=np.float64),
            k_max=self.k_max,
            draft_lag=np.ones(B, dtype=np.int64),  # the draft extend feeds last step's tokens
        )
        plan = self.policy.plan(step)
        if not isinstance(plan, SpecServePlan):
            raise TypeError(f"SPECSERVE needs a SpecServe policy, got {self.policy.name!r}")
        k = plan.uniform_rounds() if B else 0
        if self.sweep:
            k = min(self.sweep[self._sweep_at % len(self.sweep)], self.k_max)
            self._sweep_at += 1
        self.pending = StepDecision(plan, k, list(rids), int(step.context_lens.sum()),
                                    time.perf_counter())
        return k

    def add_times(self, draft: float = 0.0, extend: float = 0.0, verify: float = 0.0) -> None:
        """Measured seconds of the current step's draft forwards, draft extend and verify."""
        if self.pending is not None:
            self.pending.draft_time += draft
            self.pending.extend_time += extend
            self.pending.verify_time += verify

    def feedback(self, num_correct_drafts: Sequence[int], now: float | None = None) -> None:
        """The verify outcome of the step `decide` planned: accepted drafts per request (in
        batch order, bonus token excluded)."""
        d, self.pending = self.pending, None
        if d is None or len(num_correct_drafts) != len(d.rids):
            return  # not a step this controller planned (e.g. an idle batch)
        B, k = len(d.rids), d.k
        accepted = np.minimum(np.asarray(num_correct_drafts, dtype=np.int64), k)
        ks = np.full(B, k, dtype=np.int64)
        step_time = (time.perf_counter() if now is None else now) - d.started
        self.policy.observe(d.plan, VerifyOutcome(
            drafted=ks, verified=ks.copy(), accepted=accepted, confidences=np.zeros((B, 0)),
            step_time=step_time, draft_time=d.draft_time,
            verify_time=d.verify_time if d.verify_time > 0.0 else None,
        ))
        if self.timings_path:
            with open(self.timings_path, "a") as f:
                f.write(json.dumps({"batch": B, "context": d.context, "k": k,
                                    "draft": d.draft_time, "extend": d.extend_time,
                                    "verify": d.verify_time, "step": step_time,
                                    "accepted": int(accepted.sum()),
                                    "planned_time": d.plan.time}) + "\n")
        for rid, a in zip(d.rids, accepted.tolist()):
            r = self.requests.setdefault(rid, RequestSpec())
            r.unsent.append(k)
            r.proposed += k
            r.accepted += a

    def take_steps(self, rid: str, finished: bool) -> list[int]:
        """The draft steps of the request's decode steps since the last call (for its
        output); a finished request's counters are dropped."""
        r = self.requests.pop(rid, None) if finished else self.requests.get(rid)
        if r is None:
            return []
        out, r.unsent = r.unsent, []
        return out

    def release_policy(self, rid: str) -> None:
        """The request finished: drop the policy's state for it."""
        self.policy.release(rid)


class SGLangStepsPolicy:
    """SGLang's AdaptiveSpecPolicy protocol (speculative/adaptive_runtime_state.py) over a
    StepController: one runtime state per step count 0..k_max; the state switched to for a
    batch is the one the controller decided for it."""

    def __init__(self, controller: StepController) -> None:
        self.controller = controller
        self._graph_bs: list[int] | None = None

    @property
    def candidate_steps(self) -> list[int]:
        return list(range(self.controller.k_max + 1))

    def set_cuda_graph_bs(self, cuda_graph_bs: list[int] | None) -> None:
        self._graph_bs = cuda_graph_bs

    def cuda_graph_bs_for_step(self, step: int) -> list[int] | None:
        return self._graph_bs

    def get_steps_for_batch(self, batch_size: int) -> int:
        d = self.controller.pending
        return d.k if d is not None else self.controller.k_max

    def on_verify_complete(self, num_correct_drafts_per_req: list[int],
                           batch_size: int) -> int | None:
        return None  # the next batch's state is chosen by decide(), not by this outcome
