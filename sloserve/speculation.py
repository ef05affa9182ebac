"""The speculation contract: what a caller (the built-in engine, the simulator, an SGLang
worker) and a speculation policy exchange every decode step, as plain values.

A policy lives across steps and holds what it learns (calibration, per-request histories,
cost corrections). Each decode step it hands the caller a plan; everything that belongs to
that one step lives in the plan, which the caller carries through the step and hands back:

    plan = policy.plan(step)                  # StepInfo -> SpecPlan
    drafting = plan.drafting                  # [B] bool: who drafts position 1
    j = 0
    while j < step.k_max and drafting.any():
        one draft round for the requests in `drafting`: confidences[:, j]
        j += 1
        drafting = plan.extend(confidences[:, :j], drafted_now)   # after EVERY round
    k = plan.verify_lengths(confidences[:, :s], drafted)           # [B] 0 <= k_r <= s_r
    ... one ragged target forward verifies k_r + 1 tokens per request ...
    policy.observe(plan, outcome)             # VerifyOutcome

A caller that must fix one draft length for the whole batch before drafting (SGLang's
speculative workers run a fixed number of draft steps) asks the plan `batch_rounds()`, a
question every plan answers, instead of calling extend, and reports [B, 0] confidences.

Callers do not write this loop themselves: `SpecSession` is one step of it, an object made
from the policy and the StepInfo that the caller drives. The built-in engine and the
simulator pull (runtime/drafter/rounds.py `draft_rounds`: the loop asks the session after each
round), SGLang's worker pushes (its draft forwards call `after_round` from inside SGLang's
draft loop, the session travelling on SGLang's batch); both end in `finish`, the one place
a VerifyOutcome is built and the policy observes it.

`drafted_now` is the subset of `drafting` that really drafted position j (a model-free
drafter may find no proposal for some); `extend` returns a subset of it (nobody past
step.k_max). `confidences[r, j]` is the drafter's probability of the token it proposed at
draft position j (the draft model's processed distribution, or the n-gram drafter's
empirical frequency), NaN where request r did not draft position j. A request that stops
drafting never restarts within the step (the built-in engine's and the simulator's loop:
sloserve/runtime/drafter/rounds.py). Policies see only CPU-side numbers (numpy arrays),
never tensors or models, so each is tested without a model. Request-level state is keyed by
request id and dropped on `release`. The design and its math: docs/design.md.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class StepInfo:
    """The decode batch of one step, as the policy sees it. Arrays are indexed by batch row."""

    request_ids: Sequence[str]  # [B] stable ids of the decoding requests
    context_lens: np.ndarray  # [B] int64: tokens already in the target KV cache per request
    tpot_slo: np.ndarray  # [B] float64 seconds; np.inf where the request has no TPOT SLO
    k_max: int  # most draft tokens any request may get this step
    prefill_tokens: int = 0  # query tokens of prefill chunks sharing this step's target forward
    prefill_context: int = 0  # context tokens those prefill chunks attend to
    draft_lag: np.ndarray | None = None  # [B] int64: tokens the draft model must catch up on
    # before its first draft token (0 or 1 usually; >1 after steps without drafting)
    # [B] float64 seconds this step may take for request r, where a policy derived it from
    # the SLO (specserve-slo: SLO + slack, scaled by the expected tokens); None: tpot_slo
    step_allowance: np.ndarray | None = None
    # [B] float64 seconds this step may take for request r if r drafts nothing in it (one
    # token from the step), where a policy's allowance counted r's expected draft tokens;
    # None: the same as step_limits
    one_token_limits: np.ndarray | None = None
    # [B] float64 >= 1: how much each request's expected draft tokens count in the plan's
    # objective (specserve-slo's slo_weight: a request behind its SLO needs them to meet
    # it); None: 1 each
    token_weights: np.ndarray | None = None

    @property
    def batch_size(self) -> int:
        return len(self.request_ids)

    @property
    def step_limits(self) -> np.ndarray:
        """[B] seconds the step may take per request: step_allowance, else tpot_slo."""
        return self.tpot_slo if self.step_allowance is None else self.step_allowance


@dataclass(frozen=True)
class VerifyOutcome:
    """What one verify pass produced, fed back to the policy."""

    drafted: np.ndarray  # [B] int: draft tokens proposed per request (s_r)
    verified: np.ndarray  # [B] int: draft tokens sent to verification (k_r <= s_r)
    accepted: np.ndarray  # [B] int: draft tokens accepted (<= k_r); emitted = accepted + 1
    # [B, s_max] float, NaN beyond s_r; [B, 0] from a caller that drafted without knowing the
    # draft tokens' confidences (the policy then learns from the accepted counts alone)
    confidences: np.ndarray
    step_time: float  # measured wall time of the whole step in seconds (draft + verify + rest)
    draft_time: float  # measured wall time of the draft forwards in seconds
    # measured wall time of the target (verify) forward in seconds; None where not measured
    verify_time: float | None = None
    # the engine ran this step's shape (batch size, rounds, verified tokens) for the first
    # time: its times carry one-time costs (SGLang on a CPU: a batch size's first drafting
    # steps ran 10-28 ms over the same shape's later verify forwards, 2026-12-06), so they
    # are no evidence of what the shape costs; the step's tokens and acceptance still are
    cold: bool = False
    # the caller's clock at the step's end in seconds (time.perf_counter for an engine, the
    # simulated time for the simulator), None where not told: the SLO policies count a
    # request's TPOT seconds from it, the time between its steps included (request_clock.py)
    end_time: float | None = None


class SpecPlan(ABC):
    """One decode step's speculation decisions. Built by `SpecPolicy.plan`; valid for that
    step only. `drafting` ([B] bool) is who drafts the next position: at creation, position
    1 (all False = plain decoding); `extend` replaces it."""

    step: StepInfo
    drafting: np.ndarray

    @abstractmethod
    def extend(self, confidences: np.ndarray, drafting: np.ndarray) -> np.ndarray:
        """After draft position j = confidences.shape[1], which the requests in `drafting`
        drafted: [B] bool, a subset of `drafting`, of requests that draft position j + 1
        (none once j reaches step.k_max). Called after every draft round."""

    @abstractmethod
    def verify_lengths(self, confidences: np.ndarray, drafted: np.ndarray) -> np.ndarray:
        """[B] int64 k_r with 0 <= k_r <= drafted[r]: draft tokens each request verifies.
        confidences: [B, s] with s = drafted.max()."""

    def batch_rounds(self) -> int:
        """One draft length for the whole batch, chosen before drafting (0 = plain decoding),
        for callers that cannot consult the plan between rounds: every request then drafts
        and verifies that many tokens. Default: the rounds the plan's own drafting reaches
        when no confidence is known (extend asked with NaN confidences, every request that
        drafts drafting); plans whose extend learns from what it is told override it."""
        B, k_max = self.step.batch_size, self.step.k_max
        drafting = np.asarray(self.drafting, dtype=bool)
        j = 0
        while j < k_max and drafting.any():
            j += 1
            drafting = np.asarray(self.extend(np.full((B, j), np.nan), drafting), dtype=bool)
        return j


class SpecPolicy(ABC):
    """Decides, every step and per request, how many tokens to draft and to verify."""

    name: str = "policy"

    @abstractmethod
    def plan(self, step: StepInfo) -> SpecPlan:
        """The plan of a new decode step."""

    def observe(self, plan: SpecPlan, outcome: VerifyOutcome) -> None:  # noqa: B027
        """Feedback after verification (calibration, moving averages). Default: nothing."""

    def release(self, request_id: str) -> None:  # noqa: B027
        """The request finished or was aborted: drop its state. Default: nothing."""

    @property
    def speculates(self) -> bool:
        """False for policies that never draft (the caller then skips the draft model)."""
        return True


class SpecSession:
    """One decode step of speculation, driven by its caller: made from the policy and the
    step's StepInfo (the policy plans it), then

        session.drafting                       [B] bool: who drafts the next position
        session.after_round(conf, drafted_now) after every draft round -> who drafts on
        session.verify_lengths()               [B] k_r once drafting stopped
        session.finish(accepted, times)        -> the VerifyOutcome the policy observed

    or, for a caller that fixes one length for the batch before drafting,
    `batch_rounds()` (or `fix_rounds(k)`) instead of after_round / verify_lengths; such a
    caller may still hand the chain's confidences over once drafted (`chain_drafted`), and
    `verify_lengths()` then trims each request's verify by the plan's verifier. A pull
    caller loops over the session (runtime/drafter/rounds.py); a push caller calls it from its
    own loop (SGLang's draft forwards). Both see the same decisions for the same inputs."""

    def __init__(self, policy: SpecPolicy, step: StepInfo) -> None:
        self.policy = policy
        self.step = step
        B = step.batch_size
        t = time.perf_counter()
        self.plan = plan = policy.plan(step)
        self.plan_time = time.perf_counter() - t  # seconds in policy.plan
        self.policy_time = 0.0  # seconds in the plan's extend / verify_lengths
        self.k_max = k_max = step.k_max
        self.drafting: np.ndarray = (np.asarray(plan.drafting, dtype=bool).copy()
                                     if k_max > 0 and B else np.zeros(B, dtype=bool))
        self.confidences = np.full((B, k_max), np.nan)  # [B, k_max], NaN: not drafted
        self.drafted = np.zeros(B, dtype=np.int64)  # [B] s_r so far
        self.rounds = 0  # draft rounds run (columns of confidences in use)
        self.verified: np.ndarray | None = None  # [B] k_r once chosen
        self.uniform: int | None = None  # the batch's one length, for a uniform step
        self.chain_known = False  # a uniform step whose caller told its confidences
        self.lengths_fixed = False  # verified was decided before drafting (cut_rounds)
        self.outcome: VerifyOutcome | None = None

    # ----- per-request steps: the plan steers every round
    def after_round(self, confidences: np.ndarray | Sequence[float],
                    drafted_now: np.ndarray | None = None) -> np.ndarray:
        """The requests in drafted_now (default: all of `drafting`) drafted one more position
        with these [B] confidences (read only where drafted). Returns and stores who drafts
        the next position (none past k_max)."""
        now = self.drafting if drafted_now is None else np.asarray(drafted_now, dtype=bool)
        j = self.rounds
        if j >= self.k_max:
            raise RuntimeError(f"draft round {j + 1} past k_max {self.k_max}")
        col = np.asarray(confidences, dtype=np.float64)
        self.confidences[:, j] = np.where(now, col, np.nan)
        self.drafted += now
        self.rounds = j = j + 1
        if not np.count_nonzero(now):  # nobody drafted: the plan has nothing to decide
            self.drafting = now.copy()
            return self.drafting
        t = time.perf_counter()
        nxt = np.asarray(self.plan.extend(self.confidences[:, :j], now), dtype=bool)
        self.policy_time += time.perf_counter() - t
        self.drafting = nxt & now if j < self.k_max else np.zeros_like(now)
        return self.drafting

    @property
    def longest(self) -> int:
        """max_r s_r."""
        return int(self.drafted.max()) if len(self.drafted) else 0

    def verify_lengths(self) -> np.ndarray:
        """[B] int64 k_r, 0 <= k_r <= s_r: the plan's verify lengths (whatever it returned,
        clipped); the uniform length for a uniform step whose confidences are unknown."""
        if self.lengths_fixed and self.verified is not None:
            return self.verified
        if (self.uniform is not None and not self.chain_known) or not self.longest:
            self.verified = self.drafted.copy()
            return self.verified
        s = self.longest
        t = time.perf_counter()
        k = np.asarray(self.plan.verify_lengths(self.confidences[:, :s], self.drafted.copy()))
        self.policy_time += time.perf_counter() - t
        self.verified = np.minimum(np.maximum(k.astype(np.int64), 0), self.drafted)
        return self.verified

    # ----- uniform steps: one length for the batch, fixed before drafting
    def batch_rounds(self) -> int:
        """The plan's one draft length for the batch (0..k_max); the step becomes uniform:
        every request drafts and verifies that many tokens."""
        if not self.step.batch_size or self.k_max <= 0:
            return self.fix_rounds(0)
        t = time.perf_counter()
        k = self.plan.batch_rounds()
        self.policy_time += time.perf_counter() - t
        return self.fix_rounds(k)

    def fix_rounds(self, k: int) -> int:
        """Make this a uniform step of k rounds (clipped to 0..k_max) whatever the plan
        said (profiling sweeps); returns k."""
        k = max(0, min(int(k), self.k_max))
        self.uniform = self.rounds = k
        self.drafted = np.full(self.step.batch_size, k, dtype=np.int64)
        self.drafting = np.zeros(self.step.batch_size, dtype=bool)
        return k

    def chain_drafted(self, confidences: np.ndarray) -> None:
        """A uniform step's chain was drafted: confidences [B, k] (k = the step's rounds) of
        every request's proposals, NaN from where a request had no proposal (its chain
        ended: drafted counts the proposals before). The plan's verifier then picks each
        request's verify length from them (verify_lengths), and the policy observes them."""
        if self.uniform is None:
            raise RuntimeError("chain_drafted is for uniform steps (batch_rounds / fix_rounds)")
        conf = np.asarray(confidences, dtype=np.float64)
        if conf.shape != (self.step.batch_size, self.uniform):
            raise ValueError(f"chain confidences of shape {conf.shape}, expected "
                             f"{(self.step.batch_size, self.uniform)}")
        proposed = np.cumprod(np.isfinite(conf), axis=1)  # [B, k] 1 up to the first miss
        self.confidences[:, :self.uniform] = np.where(proposed > 0, conf, np.nan)
        self.drafted = proposed.sum(axis=1).astype(np.int64)
        self.chain_known = self.uniform > 0

    def looked_up(self, confidences: np.ndarray) -> int:
        """A drafter without a forward (prompt lookup) proposed the whole chain before the
        step runs: confidences [B, s] (NaN from where a request had no proposal). Drafting
        it cost nothing, so there is nothing for the plan's rounds to decide: its verifier
        picks each request's k_r from the real confidences at once, and the step becomes a
        uniform one of max_r k_r rounds (0: plain decoding, no verify at all), verifying
        k_r of them. Returns those rounds."""
        conf = np.asarray(confidences, dtype=np.float64)
        self.fix_rounds(conf.shape[1])
        self.chain_drafted(conf)
        k = self.verify_lengths()
        rounds = int(k.max()) if k.size else 0
        self.uniform = self.rounds = rounds
        self.drafted = np.minimum(self.drafted, rounds)
        self.confidences[:, rounds:] = np.nan
        self.chain_known = rounds > 0
        self.lengths_fixed = True
        return rounds

    # ----- the end of the step
    def finish(self, accepted: np.ndarray | Sequence[int], step_time: float,
               draft_time: float, verify_time: float | None = None,
               cold: bool = False, end_time: float | None = None) -> VerifyOutcome:
        """The verify outcome (accepted drafts per request, bonus excluded; clipped to the
        verified ones) handed to the policy's observe; returned to the caller. cold: the
        step's shape ran for the first time (VerifyOutcome.cold); end_time: the caller's
        clock at the step's end (VerifyOutcome.end_time)."""
        if self.outcome is not None:
            raise RuntimeError("the session's step already finished")
        verified = self.verified if self.verified is not None else self.verify_lengths()
        B = self.step.batch_size
        # a uniform step's confidences are unknown to the plan unless told: [B, 0]
        conf = (np.zeros((B, 0)) if self.uniform is not None and not self.chain_known
                else self.confidences[:, :self.rounds] if self.chain_known
                else self.confidences)
        self.outcome = outcome = VerifyOutcome(
            drafted=self.drafted.copy(), verified=verified.copy(),
            accepted=np.minimum(np.asarray(accepted, dtype=np.int64), verified),
            confidences=conf, step_time=step_time, draft_time=draft_time,
            verify_time=verify_time, cold=cold, end_time=end_time)
        t = time.perf_counter()
        self.policy.observe(self.plan, outcome)
        self.policy_time += time.perf_counter() - t
        return outcome
