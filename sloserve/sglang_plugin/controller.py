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
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from sloserve.policies.specserve.plan import SpecServePlan
from sloserve.speculation import SpecPolicy, StepInfo, VerifyOutcome


@dataclass
class RequestSpec:
    """One request's speculation as this worker ran it."""

    proposed: int = 0  # draft tokens proposed (sum of k over its decode steps)
    accepted: int = 0  # draft tokens accepted
    unsent: list[int] = field(default_factory=list)  # k of each decode step not yet reported
    unsent_drafted: list[int] = field(default_factory=list)  # s of each, likewise


@dataclass
class StepDecision:
    """What `decide` (or `begin`) chose for one decode batch, kept until its feedback."""

    plan: SpecServePlan
    k: int  # draft rounds the batch runs (per-request steps: the most, k_max until known)
    rids: list[str]
    context: int  # KV tokens of the batch before the step
    started: float  # perf_counter when the step began
    draft_time: float = 0.0  # measured seconds of the draft forwards
    extend_time: float = 0.0  # ... of the draft reading the verified window
    verify_time: float = 0.0  # ... of the target's verify forward
    # per-request steps (`begin`/`after_round`/`verify_lengths`); None for uniform ones
    drafting: np.ndarray | None = None  # [B] bool: who drafts the next position
    drafted: np.ndarray | None = None  # [B] int64: positions each request drafted (s_r)
    confs: list[np.ndarray] = field(default_factory=list)  # per round: [B], NaN: not drafted
    verified: np.ndarray | None = None  # [B] int64: k_r, after verify_lengths


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
    # TEST ONLY (SLOSERVE_SGLANG_TEST_VERIFY_LENS): every request drafts k_max positions and
    # row i of the n-th per-request step verifies min(forced[(i + n) % len], k_max); the
    # plan still sees everything
    forced_lengths: tuple[int, ...] = ()
    _steps_begun: int = 0
    # a file that gets one JSON line per per-request step (SLOSERVE_SGLANG_STEP_LOG): the
    # verify lengths, chain probabilities and the calibration map, for tests and debugging
    step_log_path: str | None = None
    # called with each step's [B] drafted, verified, accepted counts (the worker's Prometheus
    # counters, spec_metrics.py, when SGLang runs with --enable-metrics)
    on_outcome: Callable[[np.ndarray, np.ndarray, np.ndarray], None] | None = None

    def decide(self, rids: Sequence[str], seq_lens: Sequence[int],
               tpot_slos: Sequence[float | None]) -> int:
        """Draft steps (0 = plain decoding) for a decode batch. seq_lens: tokens per request
        including the one this step feeds; tpot_slos: each request's own SLO (None: the
        server's default)."""
        B = len(rids)
        plan, step = self._plan(rids, seq_lens, tpot_slos)
        k = plan.uniform_rounds() if B else 0
        if self.sweep:
            k = min(self.sweep[self._sweep_at % len(self.sweep)], self.k_max)
            self._sweep_at += 1
        self.pending = StepDecision(plan, k, list(rids), int(step.context_lens.sum()),
                                    time.perf_counter())
        return k

    # ----- per-request steps: the plan's early stop while drafting, then its verify lengths
    def begin(self, rids: Sequence[str], seq_lens: Sequence[int],
              tpot_slos: Sequence[float | None]) -> int:
        """Plan a decode batch whose drafting the plan steers round by round: the draft
        rounds to prepare for (k_max if anyone drafts position 1, else 0 = plain decoding).
        Then after every round `after_round`, and `verify_lengths` once drafting stopped."""
        plan, step = self._plan(rids, seq_lens, tpot_slos)
        B = len(rids)
        drafting = np.asarray(plan.drafting, dtype=bool).copy() if B else np.zeros(0, bool)
        if self.forced_lengths and B:
            drafting[:] = True
        k = self.k_max if drafting.any() else 0
        self._steps_begun += 1
        self.pending = StepDecision(plan, k, list(rids), int(step.context_lens.sum()),
                                    time.perf_counter(), drafting=drafting,
                                    drafted=np.zeros(B, dtype=np.int64))
        return k

    def after_round(self, confidences: Sequence[float]) -> bool:
        """The batch drafted one more position; confidences: [B] the draft's probability of
        each proposed token (every row drafts in SGLang's batch forward; rows the plan had
        dropped are not counted). Returns whether another round runs."""
        d = self.pending
        assert d is not None and d.drafting is not None and d.drafted is not None
        conf = np.where(d.drafting, np.asarray(confidences, dtype=np.float64), np.nan)
        d.confs.append(conf)
        d.drafted += d.drafting
        j = len(d.confs)
        nxt = d.plan.extend(np.stack(d.confs, axis=1), d.drafting)
        if self.forced_lengths:
            nxt = np.full(len(d.rids), j < self.k_max)
        d.drafting = np.asarray(nxt, dtype=bool) & (j < self.k_max)
        d.k = j
        return bool(d.drafting.any())

    def verify_lengths(self) -> np.ndarray:
        """[B] int64 k_r <= s_r: draft tokens each request verifies (the plan's confidence-
        prior elimination; the test-only forced lengths when set)."""
        d = self.pending
        assert d is not None and d.drafted is not None
        B = len(d.rids)
        conf = np.stack(d.confs, axis=1) if d.confs else np.zeros((B, 0))
        k = np.asarray(d.plan.verify_lengths(conf, d.drafted), dtype=np.int64)
        if self.forced_lengths:
            n, at = len(self.forced_lengths), self._steps_begun
            forced = np.array([self.forced_lengths[(i + at) % n] for i in range(B)],
                              dtype=np.int64)
            k = np.minimum(forced, d.drafted)
        d.verified = k
        return k

    def _plan(self, rids: Sequence[str], seq_lens: Sequence[int],
              tpot_slos: Sequence[float | None]) -> tuple[SpecServePlan, StepInfo]:
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
        return plan, step

    def record_chain(self, confidences: np.ndarray) -> None:
        """[B, k] the draft's probability of each token of the chain a uniform step just
        drafted. Profiling only (the worker asks for them when timings are logged): the
        timing rows carry them with each request's accepted count, and the profiler fits
        the pair's confidence -> acceptance calibration from them (profile.py)."""
        d = self.pending
        if d is not None and d.drafted is None:
            d.confs = list(np.asarray(confidences, dtype=np.float64).T)

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
        if d.drafted is not None:  # a per-request step
            drafted = d.drafted
            verified = d.verified if d.verified is not None else np.zeros(B, dtype=np.int64)
            conf = np.stack(d.confs, axis=1) if d.confs else np.zeros((B, 0))
        else:  # a uniform step: the policy learns from the counts (plan.absorb_counts)
            drafted = np.full(B, k, dtype=np.int64)
            verified, conf = drafted.copy(), np.zeros((B, 0))
        accepted = np.minimum(np.asarray(num_correct_drafts, dtype=np.int64), verified)
        step_time = (time.perf_counter() if now is None else now) - d.started
        self.policy.observe(d.plan, VerifyOutcome(
            drafted=drafted, verified=verified, accepted=accepted, confidences=conf,
            step_time=step_time, draft_time=d.draft_time,
            verify_time=d.verify_time if d.verify_time > 0.0 else None,
        ))
        if self.on_outcome is not None:
            self.on_outcome(drafted, verified, accepted)
        if self.step_log_path and d.drafted is not None:
            self._log_step(d, conf, verified, accepted)
        if self.timings_path:
            row: dict[str, Any] = {
                "batch": B, "context": d.context, "k": k, "draft": d.draft_time,
                "extend": d.extend_time, "verify": d.verify_time, "step": step_time,
                "accepted": int(accepted.sum()), "planned_time": d.plan.time}
            if d.drafted is None and d.confs and len(d.confs) == k:
                # the chain's confidences [B][k] and each request's accepted drafts
                row["conf"] = _jsonable(np.stack(d.confs, axis=1))
                row["accepted_per_request"] = accepted.tolist()
            with open(self.timings_path, "a") as f:
                f.write(json.dumps(row) + "\n")
        for rid, s, v, a in zip(d.rids, drafted.tolist(), verified.tolist(), accepted.tolist()):
            r = self.requests.setdefault(rid, RequestSpec())
            r.unsent.append(v)
            r.unsent_drafted.append(s)
            r.proposed += v
            r.accepted += a

    def _log_step(self, d: StepDecision, conf: np.ndarray, verified: np.ndarray,
                  accepted: np.ndarray) -> None:
        """One JSON line: the step's per-request drafted / verified / accepted counts, the
        chain probabilities P_{r,j} = prod g(c) the plan used (null past s_r), the raw
        confidences, and the calibration map g at its bin centres after this step."""
        g = getattr(self.policy, "calibrator", None)
        assert d.drafted is not None
        s = conf.shape[1]
        P = d.plan.P[:s].T  # the plan's chain probabilities (+inf where not drafted)
        rec = {"rids": d.rids, "rounds": d.k, "drafted": d.drafted.tolist(),
               "verified": verified.tolist(), "accepted": accepted.tolist(),
               "conf": _jsonable(conf), "chain": _jsonable(P),
               "g": g.table.tolist() if g is not None else None,
               "g_counts": g.counts.tolist() if g is not None else None}
        with open(self.step_log_path, "a") as f:  # type: ignore[arg-type]
            f.write(json.dumps(rec) + "\n")

    def take_steps(self, rid: str, finished: bool) -> list[int]:
        """The draft tokens verified in each of the request's decode steps since the last call
        (for its output; `take_drafted` first, a finished request's counters are dropped)."""
        r = self.requests.pop(rid, None) if finished else self.requests.get(rid)
        if r is None:
            return []
        out, r.unsent = r.unsent, []
        return out

    def take_drafted(self, rid: str) -> list[int]:
        """The draft tokens drafted for the request in each decode step since the last call."""
        r = self.requests.get(rid)
        if r is None:
            return []
        out, r.unsent_drafted = r.unsent_drafted, []
        return out

    def release_policy(self, rid: str) -> None:
        """The request finished: drop the policy's state for it."""
        self.policy.release(rid)


def _jsonable(a: np.ndarray) -> list:
    return [[None if not np.isfinite(x) else round(float(x), 6) for x in row] for row in a]


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
