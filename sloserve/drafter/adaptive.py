"""SpecServe adaptive drafter: predict-execute-correct (SpecServe Alg. 1, DESIGN.md sec. 5).

Predict: before each draft forward, request r's next conditional acceptance is predicted from
its history, an EMA of g(c) over its recent draft tokens (c the draft confidence, g the
calibration map; averaging g(c) rather than c estimates E[g(c)] directly). New requests start
from a global EMA of those predictions. Drafting position j + 1 for r then adds
gain_r = P_{r,j} * pred_r expected tokens and cost_r = a_d ctx_{r,j+1} + b_d + b_t seconds
(its share of the draft forward plus one more verified token), and the forward itself adds
c_d. The subset S maximising (tokens + sum_S gain) / (T + c_d + sum_S cost) is a prefix of the
requests sorted by gain / cost, so one sort and two prefix sums score every candidate subset;
prefixes whose step time breaks the SLO score -1 (the rule of `efficiency.score`).

Execute: the forward runs only for the best subset, and only if it beats the current plan's
E; otherwise drafting stops for everyone.

Correct: after the forward, the real confidences replace the prediction: P_{r,j+1} =
P_{r,j} g(c_{r,j+1}), the expected token sum is updated, and the request's EMA absorbs
g(c_{r,j+1}), so the next prediction already uses it. Requests whose chain probability fell
below `collapse` (default 0.05: at most 1 in 20 chances the next token is even reached) leave
the draft batch, which makes the remaining draft forwards cheaper.

`start` is the same decision at j = 0: draft at all only if one draft step is predicted to
beat plain decoding within the SLO (by `start_margin`, default 0). E over k is unimodal, so
stopping at the first step that does not raise E is where the search would stop anyway.

Uniform plans first (`uniform_margin`, default 6%): a strict subset of the candidates drafts
only if it scores more than the margin above the whole candidate set; otherwise the whole
set drafts if that raises E, or nobody does; the verifier likewise trims a tail only if
that raises E by the margin (the SLO rule trims regardless). Ragged plans cost what the
cost model does not see (a draft forward for a few requests still pays most of its fixed
cost and the engine's per-request work; the spread of k makes every step pay its longest
draft), and the confidences of a small draft say only so much: on the built-in CPU pair the
per-request choices lost 3-5% to a uniform k at batch 8-32 where the model said they won
by less than that (closed loop, BENCHMARKS.md).

Prefill chunks (`score_prefill`, default False): a step that also carries prefill chunks
pays their seconds whatever is drafted, and its prompt tokens are not counted in E, so the
step's own E over all its seconds (the paper's rule, score_prefill=True) is low there and
makes speculation look cheap: on the built-in pair at batch 32 it drafted 3+ tokens per
request beside prefills where a uniform k = 1 did 4-9% better. By default E is scored on
the step's seconds less its prefill's (StepTimer.prefill), so a draft token is worth the
same beside a prefill as in a pure decode step; the SLO rule still sees the whole step.

Prices: the profiled cost model, corrected online from the measured step times
(estimator/online_cost.py): draft forwards get one scale (measured directly), the target's
forward another (measured directly where the engine times it, as the real engine does), and
the rest of the step, the engine's own work, is measured as the overhead; so a profile that
prices draft forwards too low (or a machine that drifted since profiling) does not make the
drafter over-speculate. `correct_cost=False` scores with the profile alone.

Rate (an option, off by default): with `long_run_rate=True` the drafter scores a plan by
its net tokens, tokens - rate * time, with rate the engine's measured throughput (decode
tokens per second over the last ~1 / (1 - rate_forget) steps), and the verifier
trims at that rate: right when throughput is the goal (closed loop at batch 4-16 on the
built-in pair: 2-3 points closer to the best fixed k), wrong for latency under open-loop
traffic, where a step's own E is what its requests' TPOT feels (replay of the Azure
conversation trace on the GPU-class profile: 1.47x ar with it, 1.55x without).

Catch-up: a request that did not draft for m steps owes the draft model m tokens, fed in
its next first draft forward. The drafter prices at most `lag_cap` (default 1, the usual lag
after a verify) of them: the draft model reads them whenever the request speculates again,
so they are not a cost of speculating now rather than later. Charged in full to the step
that resumes, they made every pause permanent, since the lag grows a token per step while
speculation is off (measured on the built-in pair at batch 32: 28% of pure decode steps
speculated and fixed:1 beat the policy by 15%). Under a binding TPOT SLO the drafter prices
the real catch-up: the SLO rule is about this step's time, which the catch-up really adds
(amortized there, rare resumptions after prefill-heavy stretches broke the SLO, inflated the
overrun guard and turned speculation off: 0.96x ar at batch 8, 40 ms).

Per-step state is cached (StepTimer sums, the binding SLO, P, the plan's tokens and time), so
each call is a fixed handful of numpy operations, independent of B in count. Batches of at
most `small_batch` (8) requests make the per-round decisions on Python floats instead
(small_rounds.py): after a forward every numpy call runs on cold caches, and over a few
requests plain loops cost less.
"""

from __future__ import annotations

from collections import deque

import numpy as np

from sloserve.drafter.policy import StepInfo, VerifyOutcome
from sloserve.drafter.small_rounds import SMALL_BATCH, SmallRounds
from sloserve.drafter.state import RequestTable
from sloserve.estimator.acceptance import ConfidenceCalibrator
from sloserve.estimator.cost_model import CostModel
from sloserve.estimator.efficiency import binding_slo
from sloserve.estimator.online_cost import StepCostCorrection
from sloserve.estimator.step_time import StepTimer, draft_time

# prefix sums without ndarray.cumsum's dispatch overhead (~1 us per call at B = 64; the
# drafter runs a few per draft forward)
_accumulate = np.add.accumulate


class AdaptiveDrafter(SmallRounds):
    """Step-level draft length control, per request, with per-step cached state. Batches of
    at most `small_batch` requests are planned on Python floats (small_rounds.py)."""

    def __init__(
        self,
        cost: CostModel,
        calibrator: ConfidenceCalibrator,
        *,
        ema: float = 0.3,
        collapse: float = 0.05,
        start_margin: float = 0.0,
        overrun_window: int = 1024,
        initial_overrun: float = 2.0,
        prior: float = 0.6,
        prior_ema: float = 0.05,
        correct_cost: bool = True,
        lag_cap: float | None = 1.0,
        long_run_rate: bool = False,
        rate_forget: float = 0.98,
        calibrate_every: int = 8,
        score_prefill: bool = False,
        uniform_margin: float = 0.06,
        small_batch: int = SMALL_BATCH,
    ) -> None:
        self.small_batch = small_batch
        self.small = False  # the current step is planned on Python floats (small_rounds.py)
        # the whole candidate set drafts unless a smaller subset scores this much higher
        self.uniform_margin = uniform_margin
        # False: a step's prefill seconds stay out of the E it scores (see the docstring)
        self.score_prefill = score_prefill
        self.unscored = 0.0  # seconds of the current step outside its scored E
        self.calibrate_every = calibrate_every  # verify outcomes counted per batch
        self._outcomes: list[tuple] = []  # outcomes not counted yet
        # measured throughput: exponentially weighted decode tokens and seconds of steps
        self.use_rate = long_run_rate
        self.rate_forget = rate_forget
        self.rate_tokens = self.rate_time = 0.0
        self.rate: float | None = None  # tokens per second, once measured
        self.lag_cap = lag_cap  # catch-up tokens priced per request (None: all of them)
        self.profile_cost = cost
        # plain and verify share one scale: fitted apart they were poorly identified (plain
        # and verify time move together) and swung to the bounds, 0.5-2.0, run to run
        self.correction = StepCostCorrection(tie_verify=True) if correct_cost else None
        # the cost model of the current step: the profile's with the draft's times scaled by
        # theta_draft, the target's and the overhead by theta_verify, plain decoding by
        # theta_plain (plain_scale = theta_plain / theta_verify on top)
        self.cost = cost
        self.theta = (1.0, 1.0, 1.0)  # (plain, draft, verify) as of the current step
        self.overhead: float | None = None  # measured seconds outside the forwards, if known
        self.plain_scale = 1.0
        self.g = calibrator
        self.ema = ema  # weight of the newest draft token in a request's EMA
        self.collapse = collapse  # chain probability below which a request stops drafting
        # speculation starts only if its predicted E beats plain decoding by this fraction
        # (0 by default: with E scored without prefill seconds and uniform plans preferred,
        # the 5% it used to be kept batch 32 from the k = 1 that beat plain decoding by 4-9%)
        self.start_margin = start_margin
        # worst-case guard: the SLO rule compares predicted step times against
        # SLO / slo_scale, slo_scale = the largest measured / predicted time over the last
        # `overrun_window` steps with an SLO (clipped to [1, 2]), so neither a cost model that
        # under-prices the slowest steps nor a machine whose steps now and then run long (a
        # shared CPU: single decode steps at 1.5-1.8x their usual time) lets speculation
        # break the SLO. Steps without prefill chunks measure an overrun, plain ones too
        # (how long a step can run over is the machine's as much as the plan's); steps with
        # prefill count as 1 (a prefill's error is not the speculation's), so an overrun ages
        # out of the window and speculation is tried again rather than off for good after
        # one slow stretch (1024 steps of any kind). A machine's spikes show only now and
        # then, so the window is long: with 256 steps a batch-8 run at a 30 ms SLO speculated
        # once the last spike had aged out and the next one hit a k = 1 step (1 run of 3).
        # Until `overrun_window` steps have measured it, steps are assumed to run up to
        # `initial_overrun` x the model: by default 2, the most the guard allows (at 1.3 the
        # first k = 1 steps on this CPU, tried before a spike had been seen, were the misses)
        self.overrun_window = overrun_window
        # the window's running maximum: (step number, overrun) with decreasing overruns, so
        # its head is the maximum (a monotone queue: O(1) a step for any window length)
        self.overruns: deque[tuple[int, float]] = deque([(0, initial_overrun)])
        self.overrun_steps = 1  # overruns recorded so far, the initial one included
        self.slo_scale = initial_overrun
        self.prior = prior  # global EMA of g(c): the prediction for new requests
        self.prior_ema = prior_ema
        self.history = RequestTable()  # per-request EMA of g(confidence)
        self.step: StepInfo | None = None  # the step the fields below belong to
        self.timer: StepTimer | None = None
        self.k_max = 0
        self.slo = float("inf")
        self.slots = np.zeros(0, dtype=np.int64)  # [B]
        self.pred = np.zeros(0)  # [B] predicted acceptance of the next draft token
        self.p_last = np.zeros(0)  # [B] chain probability of the last drafted position
        self.tokens = 0.0  # expected tokens of the current plan (all drafts verified)
        self.time = 0.0  # step time of the current plan
        # [k_max, B] chain probabilities, position-major; +inf where not drafted
        self.P = np.zeros((0, 0))
        self.costs = np.zeros((0, 0))  # [k_max, B] StepTimer.draft_token_cost(j) rows
        self.ctx_costs = np.zeros((0, 0))  # [k_max, B] see _begin (knee costs only)
        self.draft_q_costs = np.zeros(0)  # [B] see _begin (knee costs only)
        self.verify_costs = np.zeros(0)  # [B] see _begin (knee costs only)
        self.first_q = np.zeros(0)  # [B]
        self.counts = np.zeros(0)  # [B] 1..B
        self.ones = np.zeros(0)  # [B] ones: x.dot(ones) sums x faster than x.sum()
        self.linear = True  # no knee in either cost: _prefix_times' fast path
        self.k_total = 0

    def start(self, step: StepInfo, k_max: int) -> np.ndarray:
        """[B] bool: who drafts position 1."""
        self._begin(step, k_max)
        if k_max <= 0 or step.batch_size == 0:
            return np.zeros(step.batch_size, dtype=bool)
        if self.small:
            return self._grow_small(0, self.p_last_l)
        return self._grow(0, self.p_last)

    def extend(self, step: StepInfo, confidences: np.ndarray, drafting: np.ndarray) -> np.ndarray:
        """Correct with position j's real confidences, then decide position j + 1."""
        if self.step is not step:  # called without start (tests, a confused caller)
            self._begin(step, step.k_max)
        j = confidences.shape[1]
        self._correct(j, confidences[:, j - 1], drafting)
        if j >= self.k_max:
            return np.zeros(step.batch_size, dtype=bool)
        # requests still drafting whose chain has not collapsed (p_last is 0 for the others)
        if self.small:
            collapse = self.collapse
            return self._grow_small(j, [p >= collapse for p in self.p_last_l])
        return self._grow(j, self.p_last >= self.collapse)

    def observe(self, step: StepInfo, outcome: VerifyOutcome) -> None:
        """Calibrate g, keep the per-request histories, refresh the global prior, and track
        how much longer speculative steps ran than the cost model said (the SLO guard)."""
        # calibration outcomes are counted a few steps at a time: the first numpy call after
        # a forward runs on cold caches (~4x its warm time in the engine), the next ones warm
        self._outcomes.append((outcome.confidences, outcome.verified, outcome.accepted))
        if len(self._outcomes) >= self.calibrate_every:
            for conf, verified, accepted in self._outcomes:
                self.g.update(conf, verified, accepted)
            self._outcomes.clear()
        tracked = self.step is step
        if outcome.step_time > 0.0:
            if self.use_rate:
                f = self.rate_forget
                self.rate_tokens = (f * self.rate_tokens + float(outcome.accepted.sum())
                                    + step.batch_size)
                self.rate_time = f * self.rate_time + outcome.step_time
                self.rate = self.rate_tokens / self.rate_time
            timer = self.timer if tracked else self.timer_for(step)
            n_drafted = int(outcome.drafted.sum())
            drafting = None  # seconds of the draft forwards, when known without computing
            if not n_drafted:
                predicted = timer.plain
                drafting = 0.0
            elif tracked and n_drafted == self.k_total:
                # the engine drafted exactly the plan (it can only draft a subset of it): its
                # time is known, less the verify tokens that elimination removed
                tt = timer.token_time  # (verify_extra on Python floats)
                planned_verify = tt * timer.paid_verify(n_drafted)
                drafting = self.time - timer.plain - planned_verify
                predicted = self.time - planned_verify + tt * timer.paid_verify(
                    int(outcome.verified.sum()))
            else:
                predicted = timer.plan(outcome.drafted, outcome.verified)
            # back to profile seconds: the fit's features. Steps with prefill chunks stay out:
            # their time is mostly the prefill, priced apart, whose error the fit would
            # spread over the speculation scales
            if self.correction is not None and not step.prefill_tokens:
                theta_plain, theta_draft, theta_verify = self.theta
                if drafting is None:
                    drafting = draft_time(self.cost.draft, timer.n, timer.lag, outcome.drafted)
                verify = max(0.0, predicted - timer.plain - drafting) / theta_verify
                if outcome.verify_time is not None:  # the target forward measured apart
                    c = self.profile_cost
                    self.correction.observe(
                        c.target.time(timer.verify_ctx, timer.verify_q0), drafting / theta_draft,
                        verify, outcome.step_time, outcome.draft_time,
                        measured_target=outcome.verify_time, overhead=c.overhead)
                else:
                    self.correction.observe(timer.plain / theta_plain, drafting / theta_draft,
                                            verify, outcome.step_time, outcome.draft_time)
            # overruns matter only to the SLO rule: measured on steps with an SLO
            has_slo = self.slo < float("inf") if tracked else binding_slo(step) < float("inf")
            if has_slo:
                measured = not step.prefill_tokens and predicted > 0.0
                self._record_overrun(outcome.step_time / predicted if measured else 1.0)
        if self.step is step and step.batch_size:
            if self.small:
                self.history.values[self.slots] = self.pred_l
                mean = sum(self.pred_l) / step.batch_size
            else:
                self.history.values[self.slots] = self.pred
                # the prior follows the mean prediction over the live requests
                mean = float(self.pred.dot(self.ones)) / step.batch_size
            self.prior += self.prior_ema * (mean - self.prior)

    def release(self, request_id: str) -> None:
        self.history.release(request_id)

    def _record_overrun(self, ratio: float) -> None:
        """Add one step's measured / predicted time; slo_scale = the window's largest."""
        t = self.overrun_steps
        self.overrun_steps = t + 1
        q = self.overruns
        while q and q[-1][1] <= ratio:
            q.pop()
        q.append((t, ratio))
        if q[0][0] <= t - self.overrun_window:  # aged out of the window
            q.popleft()
        self.slo_scale = min(2.0, max(1.0, q[0][1]))

    def timer_for(self, step: StepInfo, slo: float | None = None) -> StepTimer:
        """A StepTimer with the current step's corrected prices (catch-up amortized only
        without a binding SLO). slo: binding_slo(step), when the caller has it."""
        if slo is None:
            slo = binding_slo(step)
        lag_cap = self.lag_cap if slo == float("inf") else None
        return StepTimer(self.cost, step, self.plain_scale, lag_cap)

    def _begin(self, step: StepInfo, k_max: int) -> None:
        B = step.batch_size
        self.step = step
        corr = self.correction
        if corr is not None and (corr.theta != self.theta or corr.overhead != self.overhead):
            self.theta = theta_plain, theta_draft, theta_verify = corr.theta
            self.overhead = corr.overhead
            c = self.profile_cost
            overhead = c.overhead * theta_verify if self.overhead is None else self.overhead
            self.cost = CostModel(c.target.scaled(theta_verify), c.draft.scaled(theta_draft),
                                  overhead)
            self.plain_scale = theta_plain / theta_verify
        slo = binding_slo(step)
        self.timer = self.timer_for(step, slo)
        self.k_max = k_max
        self.slo = slo / self.slo_scale
        self.slots = self.history.slots(step.request_ids, fill=self.prior)
        self.pred = self.history.values[self.slots]  # fancy index: a copy
        self.p_last = np.ones(B)
        self.tokens = float(B)  # plain decoding: one token each
        self.time = self.timer.plain
        self.unscored = 0.0 if self.score_prefill else self.timer.prefill
        if self.P.shape == (k_max, B):  # steady decoding: reuse last step's buffer
            self.P.fill(np.inf)
        else:
            self.P = np.full((k_max, B), np.inf)
            self.ones = np.ones(B)
            self.counts = np.arange(1.0, B + 1.0)  # [B] prefix sizes
        self.k_total = 0  # draft tokens in the plan (all verified)
        self.linear = self.cost.draft.q0 <= 0.0 and self.cost.target.q0 <= 0.0
        self.small = B <= self.small_batch
        if self.small:  # costs are made per round on Python floats
            self._begin_small(B)
            return
        self.costs = self.timer.draft_token_costs(k_max)  # [k_max, B] per-token seconds
        if self.cost.draft.b + self.cost.target.b <= 0.0:  # free tokens: keep gain/cost finite
            self.costs = np.maximum(self.costs, 1e-12)
        if self.linear:  # no knee: the per-request linear costs add up exactly
            return
        # [k_max, B] draft forward attention seconds per request at position j + 1 (the first
        # forward reads n - lag KV tokens) and [B] query tokens it feeds at j = 0 (lag + 1)
        d = self.cost.draft
        self.ctx_costs = d.a * (self.timer.n + np.arange(k_max, dtype=np.float64)[:, None])
        if k_max and self.timer.has_lag:
            self.ctx_costs[0] -= d.a * self.timer.lag
        self.first_q = 1.0 + self.timer.lag
        # [B] the draft forward's query-token seconds when the prefix's requests feed one
        # token each (every forward but a first one with lag), and the verify's token_time
        # per prefix size: _prefix_times adds the knees from these
        self.draft_q_costs = d.b * np.maximum(self.counts - d.q0, 0.0)
        self.verify_costs = self.timer.token_time * self.counts

    def plan_matches(self, confidences: np.ndarray, drafted: np.ndarray) -> bool:
        """True when P, tokens and time describe the engine's plan exactly: every drafted
        position went through `extend`. An engine that skips the `extend` after the last
        draft forward is caught up here from `confidences` (that position was planned)."""
        s = int(drafted[drafted.argmax()]) if drafted.size else 0
        if s > self.P.shape[0]:
            return False
        missing = drafted - np.isfinite(self.P[:s]).sum(axis=0)  # [B]
        if not np.count_nonzero(missing):
            return True
        last = missing == 1
        if missing.min() < 0 or missing.max() > 1 or not np.all(drafted[last] == s):
            return False
        self._correct(s, confidences[:, s - 1], last)
        return True

    def _grow(self, j: int, weight: np.ndarray) -> np.ndarray:
        """Predict and pick the requests that draft position j + 1. weight: [B] 1 for
        candidates (0 or False for the others); with self.p_last it gives each one's gain."""
        gain = self.p_last * self.pred
        gain *= weight  # [B] expected extra tokens (0 for non-candidates)
        cost = self.costs[j]  # [B] seconds, linear: ranks the requests
        # best tokens per second first (a stable sort: ties in the same order as the
        # small-batch path's)
        order = (gain / cost).argsort(kind="stable")[::-1]
        tokens = gain.take(order)
        tokens[0] += self.tokens  # so the prefix sums start from the current plan
        _accumulate(tokens, out=tokens)  # [B] plan with the first i + 1 of order
        time = self._prefix_times(j, order)
        margin = 1.0 + self.start_margin if j == 0 else 1.0
        if self.rate is None:  # the step's own E (SpecServe) until a rate is measured
            score = tokens / (time - self.unscored)  # E of each prefix
            current = self.tokens / (self.time - self.unscored) * margin
        else:  # net tokens at the measured rate (the start margin raises the bar)
            lam = self.rate * margin
            score = tokens - lam * time
            current = self.tokens - lam * self.time
        if self.slo < float("inf"):
            score[time > self.slo] = -np.inf
        best = int(score.argmax())
        if self.uniform_margin and self.rate is None:
            # a strict subset of the candidates drafts only if it scores uniform_margin above
            # the whole set; otherwise the whole set drafts if it raises E, or nobody does
            full = int(np.count_nonzero(gain)) - 1  # the prefix of every candidate
            if full > best and score[full] * (1.0 + self.uniform_margin) >= score[best]:
                best = full
        drafting = np.zeros(weight.size, dtype=bool)
        # a prefix ending in a zero-gain request always scores lower than the one before
        if score[best] <= current:
            return drafting
        drafting[order[: best + 1]] = True
        self.time = float(time[best])
        self.k_total += best + 1
        return drafting

    def _prefix_times(self, j: int, order: np.ndarray) -> np.ndarray:
        """[B] exact step time of the plan plus draft position j + 1 for the first i + 1
        requests of `order`: one more draft forward (its knee priced on the prefix's query
        tokens) and i + 1 more verified tokens (past the target's knee)."""
        d = self.cost.draft
        if self.linear:  # no knee: the per-request linear costs add up exactly
            time = self.costs[j].take(order)
            time[0] += self.time + d.c
            return _accumulate(time, out=time)
        time = self.ctx_costs[j].take(order)  # [B] attention reads of the draft forward
        time[0] += self.time + d.c
        _accumulate(time, out=time)
        if j == 0 and self.timer.has_lag:  # the first forward also feeds the lag tokens
            q = _accumulate(self.first_q.take(order))
            time += d.b * np.maximum(q - d.q0, 0.0)
        else:
            time += self.draft_q_costs
        # verify tokens still inside the target's knee, then token_time each
        free = self.timer.free_verify - self.k_total
        if free > 0.0:
            time += np.maximum(self.verify_costs - self.timer.token_time * free, 0.0)
        else:
            time += self.verify_costs
        return time

    def _correct(self, j: int, conf: np.ndarray, drafting: np.ndarray) -> None:
        """Replace the prediction of position j (just drafted) by its real confidence."""
        if self.small:
            self._correct_small(j, conf, drafting)
            return
        acc = self.g(np.fmax(conf, 0.0))  # [B] g(c); NaN (not drafted) -> g(0)
        p = self.p_last * acc
        p *= drafting
        self.p_last = p
        np.copyto(self.P[j - 1], p, where=drafting)
        self.tokens += float(p.dot(self.ones))  # p.sum(), without a reduction's overhead
        delta = acc - self.pred
        delta *= self.ema
        np.add(self.pred, delta, out=self.pred, where=drafting)  # only requests that drafted
