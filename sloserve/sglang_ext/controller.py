"""The sloserve half of the SPECSERVE worker, free of SGLang imports (tested without SGLang):
the push side of a speculation session (sloserve.speculation.SpecSession).

SGLang's worker owns the draft loop, so it pushes the session's calls from inside it. Each
decode batch gets its own `SGLangStep` (a session plus the step's measured times), made by
`begin` and carried on SGLang's batch and on the result SGLang resolves, never in a slot of
this object; any policy of the registry runs in it (make_policy). Per step:

    step = spec.begin(rids, seq_lens, slos)   # before SGLang drafts: the rounds to prepare
    uniform steps (default): the session's batch_rounds() fixed the rounds; SGLang drafts
        them and verifies everything drafted
    trimmed steps: rounds fixed likewise; spec.chain_drafted(step, conf) once drafted, then
        spec.verify_lengths(step) -> k_r (the plan's verifier on the real confidences) for
        a ragged verify
    n-gram (lookup-first) steps, trimmed or per-request: spec.looked_up(step, conf) with the
        whole chain looked up before SGLang drafts: k_r at once, max k_r rounds prepared
    per-request steps: spec.after_round(step, conf) after every draft round (the plan's
        early stop), then spec.verify_lengths(step) -> k_r for a ragged verify
    spec.finish(step, num_correct_drafts)     # once SGLang resolved the accepted counts

The draft forwards' time is reported as the step's drafting; the draft reading the verified
window afterwards (which SGLang runs at every step, k = 0 included) counts in the step's
overhead. A uniform step tells the policy no confidences (it learns from the accepted
counts). `SGLangStepsPolicy` is the adapter SGLang's AdaptiveController drives: it keeps the
runtime state the worker switched to for the batch.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from sloserve.estimator.cost_model import ForwardCost
from sloserve.estimator.step_time import StepTimer, draft_lag
from sloserve.slo import slo_array
from sloserve.speculation import SpecPolicy, SpecSession, StepInfo, VerifyOutcome


@dataclass
class RequestSpec:
    """One request's speculation as this worker ran it."""

    proposed: int = 0  # draft tokens verified (sum of k_r over its decode steps)
    accepted: int = 0  # draft tokens accepted
    unsent: list[int] = field(default_factory=list)  # k of each decode step not yet reported
    unsent_drafted: list[int] = field(default_factory=list)  # s of each, likewise


def new_shapes(seen: set[tuple[int, int, int]], batch: int, rounds: int, verified: int) -> bool:
    """Whether a step runs a forward shape SGLang has not run before, adding its shapes to
    `seen`: the target forward's rows (batch + verified tokens; the decode path's and the
    verify path's apart) and the draft's (batch size, rounds). A new one carries one-time
    costs (kernels set up for a new row count, likely): on the 2-core AVX-512 EPYC (2026-12-06, 102
    steps of out/s54-s55's timings) steps with a new verify row count ran +3.0 ms median
    (+4.9 mean) over their batch size's fit, while the steps new only as a (batch size,
    rounds, verified tokens) triple, the key before this one, ran as warm ones (-1.9 / +0.3
    ms against -2.0 / 0.0; 542 and 11,128 steps). That key left 69% of the per-request
    mode's drafting steps at batch 16 out of the correction (22 of 32 in one C = 16 cell),
    whose verify the plan then priced at the profile's for ~20 steps after a change of load"""
    keys = ((0, batch + verified, int(verified > 0)), (1, batch, rounds))
    cold = keys[0] not in seen or keys[1] not in seen
    seen.update(keys)
    return cold


@dataclass
class SGLangStep:
    """One decode batch's speculation inside SGLang: the session and what the worker
    measured. Travels on SGLang's batch (`batch.sloserve_step`) and result."""

    session: SpecSession
    prepared: int  # draft rounds SGLang prepares (uniform: the rounds; per-request: k_max or 0)
    context: int  # KV tokens of the batch before the step
    started: float  # perf_counter when the step began
    index: int = 0  # steps begun before this one (the test-only forced lengths cycle on it)
    draft_time: float = 0.0  # measured seconds of the draft forwards (catch-up included)
    extend_time: float = 0.0  # ... of the draft reading the verified window
    # rows the draft's first round read besides the bonus tokens (prompts, steps without
    # drafting, the last accepted draft of the requests that draft: AlignedDraft.first_round)
    catch_up_rows: int = 0
    # ... their seconds beyond the rows the plan priced for the requests that drafted (its
    # StepTimer's lag: the catch-up less what lag_cap and each request's credit excuse), at
    # the draft's profiled price a row: earlier steps' deferred cost the plan chose not to
    # price, so the policy learns from the step less this
    catch_up_time: float = 0.0
    verify_time: float = 0.0  # ... of the target's verify forward
    # the step drafted nothing and ran as a plain decode step (worker._decode_step), not
    # through SGLang's verify of the bonus token
    decoded: bool = False
    chain_conf: np.ndarray | None = None  # [B, k] a uniform chain's confidences (profiling)
    first_pred: list[float] | None = None  # [B] the first round's predictions (step log)

    @property
    def per_request(self) -> bool:
        """The plan steered the rounds (per-request steps)."""
        return self.session.uniform is None

    @property
    def ragged(self) -> bool:
        """Requests may verify different lengths: a per-request step, or a uniform one
        whose chain confidences were told (trimmed)."""
        return self.session.uniform is None or self.session.chain_known

    @property
    def rounds(self) -> int:
        """Draft rounds run so far (a uniform step: its fixed length)."""
        return self.session.rounds

    def add_times(self, draft: float = 0.0, extend: float = 0.0, verify: float = 0.0) -> None:
        self.draft_time += draft
        self.extend_time += extend
        self.verify_time += verify


@dataclass
class StepController:
    policy: SpecPolicy  # any policy of the registry (policies/registry.make_policy)
    k_max: int  # the most draft steps a batch may run (SGLang's largest runtime state)
    default_tpot_slo: float | None = None  # seconds; a request's own tpot_slo overrides it
    # the draft's forward cost the policy prices with (catch-up rows: SGLangStep)
    draft_cost: ForwardCost | None = None
    per_request: bool = False  # per-request steps (the plan steers every round) or uniform
    # uniform steps whose verify the plan trims per request from the chain's confidences
    trim: bool = False
    requests: dict[str, RequestSpec] = field(default_factory=dict)
    # profiling (python -m sloserve.profiler --engine sglang): draft lengths to cycle through
    # instead of the policy's, and a file that gets one JSON line of timings per step
    sweep: tuple[int, ...] = ()
    timings_path: str | None = None
    _sweep_at: int = 0
    # TEST ONLY: every request drafts k_max positions and row i of the n-th per-request
    # step verifies min(forced[(i + n) % len], k_max); the plan still sees everything
    forced_lengths: tuple[int, ...] = ()
    _steps_begun: int = 0
    # the forward shapes SGLang has run (`new_shapes`): a step that runs a new one is cold
    # (VerifyOutcome.cold), its times kept from the policy's cost correction
    _shapes: set[tuple[int, int, int]] = field(default_factory=set)
    _last_finish: float | None = None  # perf_counter at the last step's finish (timings)
    # a file that gets one JSON line per per-request step: the verify lengths, and for a
    # SpecServe plan its chain probabilities and calibration map, for tests and debugging
    step_log_path: str | None = None
    # called with each step's [B] drafted, verified, accepted counts (the worker's Prometheus
    # counters, spec_metrics.py, when SGLang runs with --enable-metrics)
    on_outcome: Callable[[np.ndarray, np.ndarray, np.ndarray], None] | None = None

    def begin(self, rids: Sequence[str], seq_lens: Sequence[int],
              tpot_slos: Sequence[float | None],
              draft_lags: Sequence[int] | None = None) -> SGLangStep:
        """The speculation of a decode batch. seq_lens: tokens per request including the one
        this step feeds; tpot_slos: each request's own SLO (None: the server's default);
        draft_lags: positions each request's draft catch-up would read besides its bonus
        token if it drafted (AlignedDraft.lags; None: one each).
        A uniform step has its rounds fixed (the plan's batch_rounds, or the profiling
        sweep); a per-request step prepares k_max rounds if anyone drafts position 1."""
        B = len(rids)
        step = StepInfo(
            request_ids=list(rids),
            context_lens=np.asarray(seq_lens, dtype=np.int64) - 1,  # KV already cached
            tpot_slo=slo_array(tpot_slos, self.default_tpot_slo),
            k_max=self.k_max,
            draft_lag=(np.ones(B, dtype=np.int64) if draft_lags is None
                       else np.asarray(draft_lags, dtype=np.int64)),
        )
        session = SpecSession(self.policy, step)
        if self.sweep:
            prepared = session.fix_rounds(self.sweep[self._sweep_at % len(self.sweep)])
            self._sweep_at += 1
        elif not self.per_request:
            prepared = session.batch_rounds()
        else:
            if self.forced_lengths and B:
                session.drafting[:] = True
            prepared = self.k_max if session.drafting.any() else 0
        out = SGLangStep(session, prepared, int(step.context_lens.sum()), time.perf_counter(),
                         index=self._steps_begun)
        self._steps_begun += 1
        first = getattr(session.plan, "first_predictions", None)  # SpecServe plans
        if self.step_log_path and first is not None:
            out.first_pred = np.round(np.asarray(first(), dtype=np.float64), 4).tolist()
        return out

    def after_round(self, step: SGLangStep, confidences: Sequence[float] | np.ndarray) -> bool:
        """The batch drafted one more position; confidences: [B] the draft's probability of
        each proposed token (every row drafts in SGLang's batch forward; rows the plan had
        dropped are not counted), NaN where a request had no proposal (the n-gram drafter's
        misses: its chain ends there). Returns whether another round runs."""
        s = step.session
        conf = np.asarray(confidences, dtype=np.float64)
        drafting = s.after_round(conf, s.drafting & np.isfinite(conf))
        if self.forced_lengths:
            s.drafting = drafting = np.full(len(drafting), s.rounds < self.k_max)
        return bool(drafting.any())

    def chain_drafted(self, step: SGLangStep, confidences: np.ndarray) -> None:
        """A uniform step's chain was drafted: [B, k] confidences of the proposals. With
        `trim` the plan's verifier then picks each request's verify length from them."""
        step.chain_conf = confidences
        if self.trim and not step.per_request and not self.sweep:
            step.session.chain_drafted(confidences)

    def looked_up(self, step: SGLangStep, confidences: np.ndarray) -> int:
        """The n-gram drafter's whole chain, looked up before SGLang drafts ([B, k_max]
        confidences, NaN past each request's proposals): the plan's verifier picks k_r
        (SpecSession.looked_up) and the step prepares max_r k_r rounds, 0 = SGLang's plain
        path. Returns the rounds."""
        step.prepared = rounds = step.session.looked_up(confidences)
        step.chain_conf = np.asarray(confidences)[:, :rounds]
        return rounds

    def verify_lengths(self, step: SGLangStep) -> np.ndarray:
        """[B] int64 k_r <= s_r: draft tokens each request verifies (the plan's; the
        test-only forced lengths when set)."""
        s = step.session
        k = s.verify_lengths()
        if self.forced_lengths and step.per_request:
            n, B = len(self.forced_lengths), len(k)
            forced = np.array([self.forced_lengths[(i + step.index) % n] for i in range(B)],
                              dtype=np.int64)
            s.verified = k = np.minimum(forced, s.drafted)
        return k

    def finish(self, step: SGLangStep, num_correct_drafts: Sequence[int],
               now: float | None = None) -> VerifyOutcome | None:
        """The verify outcome of the step: accepted drafts per request (in batch order,
        bonus token excluded). None (and nothing learnt) for a result of another size."""
        s = step.session
        B = s.step.batch_size
        if len(num_correct_drafts) != B or s.outcome is not None:
            return None
        end = time.perf_counter() if now is None else now
        step_time = end - step.started
        # seconds between the last step's finish and this one's begin: the scheduler's
        # own work between decode steps (prefills included), for the timings lines
        gap = step.started - self._last_finish if self._last_finish is not None else None
        self._last_finish = end
        # what drafting cost this step: its rounds, not the catch-up rows past those the plan
        # priced, at the draft's price a row (query token and context token)
        extra = max(0.0, step.catch_up_rows - _priced_lag(s))
        d = self.draft_cost
        step.catch_up_time = (min(step.draft_time, (d.a + d.b) * extra)
                              if d is not None and extra else 0.0)
        drafting = (step.draft_time + step.extend_time - step.catch_up_time
                    if step.rounds else 0.0)
        verified_now = s.verified if s.verified is not None else s.drafted
        cold = new_shapes(self._shapes, B, step.rounds, int(verified_now.sum()))
        outcome = s.finish(num_correct_drafts, step_time - step.catch_up_time, drafting,
                           step.verify_time if step.verify_time > 0.0 else None, cold=cold,
                           end_time=end)
        drafted, verified, accepted = outcome.drafted, outcome.verified, outcome.accepted
        if self.on_outcome is not None:
            self.on_outcome(drafted, verified, accepted)
        if self.step_log_path and step.ragged:
            self._log_step(step, outcome)
        if self.timings_path:
            row: dict[str, Any] = {
                "batch": B, "context": step.context, "k": step.rounds,
                "draft": step.draft_time, "extend": step.extend_time,
                "catch_up": step.catch_up_time, "catch_up_rows": step.catch_up_rows,
                "verify": step.verify_time, "step": step_time,
                "accepted": int(accepted.sum()), "verified": int(verified.sum()),
                # seconds in the policy's Python (plan, after each round, verify lengths;
                # observe included) and whether the plan steered the rounds
                "policy": s.plan_time + s.policy_time,
                "per_request": step.per_request, "gap": gap, "cold": cold,
                "decode": step.decoded}
            corr = getattr(self.policy, "correction", None)
            if corr is not None:  # the online cost correction after this step
                row["theta"] = [round(corr.theta_target, 4), round(corr.theta_verify, 4),
                                round(corr.theta_draft, 4)]
                row["verify_fixed"] = round(corr.verify_fixed, 6)
            guard = getattr(self.policy, "guard", None)
            if guard is not None:  # the SLO rule's overrun scale after this step
                row["overrun"] = round(guard.scale, 4)
                row["overrun_mean"] = round(guard.mean, 4)
            stalls = getattr(self.policy, "stalls", None)
            if stalls is not None:  # seconds between steps the SLO rule now expects
                row["stall"] = round(stalls.mean, 6)
            if step.chain_conf is not None and step.chain_conf.shape[1] == step.rounds:
                # the chain's confidences [B][k] and each request's accepted drafts
                row["conf"] = _jsonable(step.chain_conf)
                row["accepted_per_request"] = accepted.tolist()
            with open(self.timings_path, "a") as f:
                f.write(json.dumps(row) + "\n")
        for rid, d, v, a in zip(s.step.request_ids, drafted.tolist(), verified.tolist(),
                                accepted.tolist()):
            r = self.requests.setdefault(rid, RequestSpec())
            r.unsent.append(v)
            r.unsent_drafted.append(d)
            r.proposed += v
            r.accepted += a
        return outcome

    def _log_step(self, step: SGLangStep, outcome: VerifyOutcome) -> None:
        """One JSON line: the step's per-request drafted / verified / accepted counts and raw
        confidences; for a SpecServe plan also its chain probabilities P_{r,j} = prod g(c)
        (null past s_r) and its calibration map g at the bin centres after this step."""
        s = step.session
        conf = s.confidences[:, :s.rounds]
        P = getattr(s.plan, "P", None)  # SpecServe diagnostics; other plans have none
        told = getattr(s.plan, "P_told", None)  # [B, s] a chain told at once (looked up)
        if told is not None and getattr(s.plan, "j_done", 0) == 0:
            P = told.T
        g = getattr(self.policy, "calibrator", None)
        rec = {"rids": list(s.step.request_ids), "rounds": s.rounds,
               "looked_up": s.lengths_fixed,  # the chain came whole (no round was planned)
               "drafted": outcome.drafted.tolist(), "verified": outcome.verified.tolist(),
               "accepted": outcome.accepted.tolist(), "conf": _jsonable(conf),
               "chain": _jsonable(P[:s.rounds].T) if P is not None else None,
               "g": g.table.tolist() if g is not None else None,
               "g_counts": g.counts.tolist() if g is not None else None}
        # what the first round was planned from (SpecServe): each request's prediction,
        # its draft lag (positions its catch-up reads) and the catch-up tokens its credit
        # pays for
        if step.first_pred is not None:
            rec["first"] = step.first_pred
        lag, credit = s.step.draft_lag, getattr(s.plan, "lag_credit", None)
        if lag is not None:
            rec["lag"] = np.asarray(lag).tolist()
        if credit is not None:
            rec["credit"] = np.round(np.asarray(credit, dtype=np.float64), 2).tolist()
        assert self.step_log_path is not None
        with open(self.step_log_path, "a") as f:
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


def _priced_lag(s: SpecSession) -> float:
    """Catch-up rows the step's plan priced for the requests that drafted: its StepTimer's
    lag (SpecServe's, less lag_cap and credit), else the step's draft_lag."""
    timer = getattr(s.plan, "timer", None)
    lag = timer.lag if isinstance(timer, StepTimer) else draft_lag(s.step)
    return float(lag[s.drafted > 0].sum())


def _jsonable(a: np.ndarray) -> list:
    return [[None if not np.isfinite(x) else round(float(x), 6) for x in row] for row in a]


class SGLangStepsPolicy:
    """SGLang's AdaptiveSpecPolicy protocol (speculative/adaptive_runtime_state.py): one
    runtime state per step count 0..k_max. The worker switches to the state of each batch's
    rounds itself before SGLang asks (`current()`: the active step count), so the answer
    by batch size keeps it."""

    def __init__(self, k_max: int, current: Callable[[], int]) -> None:
        self.k_max = k_max
        self.current = current
        self._graph_bs: list[int] | None = None

    @property
    def candidate_steps(self) -> list[int]:
        return list(range(self.k_max + 1))

    def set_cuda_graph_bs(self, cuda_graph_bs: list[int] | None) -> None:
        self._graph_bs = cuda_graph_bs

    def cuda_graph_bs_for_step(self, step: int) -> list[int] | None:
        return self._graph_bs

    def get_steps_for_batch(self, batch_size: int) -> int:
        return self.current()

    def on_verify_complete(self, num_correct_drafts_per_req: list[int],
                           batch_size: int) -> int | None:
        return None  # the next batch's state is chosen by its own session
