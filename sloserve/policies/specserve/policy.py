"""SpecServe: adaptive drafter + confidence-prior verifier + SLO-aware estimator.

`specserve-drafter` is the paper's "SpecServe-" ablation (Table 2): the adaptive drafter
alone, verifying every drafted token. `specserve` adds the confidence-prior verifier
(Alg. 2), which trims low-probability draft tails per request before the verify forward.

The policy holds what is learned across steps; each step's decisions live in its plan
(plan.py, small_plan.py):
    g          the confidence -> acceptance calibration map (one per policy, i.e. per pair)
    history    each live request's EMA of g(c), its prediction of the next acceptance
    prior      a global EMA of the predictions: what a new request starts from
    correction the online scales of the profiled cost model (estimator/online_cost.py)
    guard      how far steps ran over the cost model lately (overrun.py)
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import numpy as np

from sloserve.estimator.acceptance import ConfidenceCalibrator
from sloserve.estimator.cost_model import CostModel
from sloserve.estimator.online_cost import (
    PROFILE_MAX_SCALE,
    ROUGH_MAX_SCALE,
    BatchCorrections,
    StepCostCorrection,
)
from sloserve.estimator.step_time import draft_time
from sloserve.policies.request_clock import StepStalls
from sloserve.policies.request_table import RequestTable
from sloserve.policies.specserve.options import (
    CALIBRATE_EVERY,
    PRIOR_EMA,
    RELAX_SAMPLES,
    VERIFY_BATCH_EMA,
    SpecServeOptions,
)
from sloserve.policies.specserve.overrun import OverrunGuard
from sloserve.policies.specserve.plan import PlanInputs, Prices, SpecServePlan
from sloserve.policies.specserve.small_plan import SmallSpecServePlan
from sloserve.speculation import SpecPlan, SpecPolicy, StepInfo, VerifyOutcome


class SpecServePolicy(SpecPolicy):
    """SLO-aware adaptive speculation; `verifier=False` gives the drafter-only ablation.
    Options: a SpecServeOptions, or its fields as keywords (`prior=0.8`)."""

    def __init__(
        self,
        cost: CostModel,
        k_max: int,
        *,
        verifier: bool = True,
        calibrator: ConfidenceCalibrator | None = None,
        options: SpecServeOptions | None = None,
        **option_fields: Any,
    ) -> None:
        if k_max < 0:
            raise ValueError(f"k_max must be >= 0, got {k_max}")
        self.options = opts = replace(options or SpecServeOptions(), **option_fields)
        self.profile_cost = cost
        self.k_max = k_max
        self.verifier = verifier
        self.name = "specserve" if verifier else "specserve-drafter"
        self.g = calibrator or ConfidenceCalibrator()
        self.history = RequestTable()
        self.prior = opts.prior
        # the online correction, one fit per band of batch sizes (online_cost.py)
        self.corrections = (BatchCorrections(lambda: StepCostCorrection(
            verify_fixed=cost.verify_fixed, clip=opts.price_clip, anchor=opts.price_anchor,
            max_scale=ROUGH_MAX_SCALE if cost.rough else PROFILE_MAX_SCALE))
            if opts.correct_cost else None)
        self.prices = Prices(cost)
        self.guard = OverrunGuard(opts.overrun_window, opts.initial_overrun)
        # the seconds between decode steps every continuing request waits (another's
        # prefill, scheduling): its TPOT counts them, so the SLO rule leaves them room
        self.stalls = StepStalls()
        self._outcomes: list[tuple] = []  # verify outcomes not counted into g yet
        # log2 of the batch sizes the steps that verified drafts ran at (an EMA, weight
        # VERIFY_BATCH_EMA): where the correction's verified-token scale was learnt
        self._verify_batch: float | None = None
        self._shape_arrays: tuple[np.ndarray, np.ndarray] = (np.zeros(0), np.zeros(0))

    @property
    def calibrator(self) -> ConfidenceCalibrator:
        return self.g

    def seed_calibration(self, counts: np.ndarray) -> None:
        """Start the calibration map from the pair's offline one (the profile's)."""
        self.g.seed(counts)

    # ----- the protocol
    def plan(self, step: StepInfo) -> SpecPlan:
        B = step.batch_size
        stall = self.stalls.mean
        if stall > 0.0 and step.step_allowance is None and B:
            slo = np.asarray(step.tpot_slo, dtype=np.float64)
            if np.isfinite(slo).any():
                # the tightest-SLO rule: a request's TPOT for the step is the step and its
                # stall (request_clock.StepStalls)
                step = replace(step, step_allowance=slo - stall)
        ones, counts = self._shape_arrays
        if ones.size != B:
            ones, counts = self._shape_arrays = np.ones(B), np.arange(1.0, B + 1.0)
        inputs = PlanInputs(self._current_prices(B), self.g, self.options, self.k_max,
                            self.slo_scale(), self.verifier, ones, counts)
        slots = self.history.slots(step.request_ids, fill=self.prior)
        pred = self.history.values[slots]  # fancy index: a copy the plan owns
        # a request none of whose own drafts was seen yet has its first round planned at
        # least at the configured prior: that round is what measures it. The running prior
        # is a mean over other requests; where it fell low enough that new requests never
        # drafted, nothing was learned any more and speculation stayed off for good (the
        # SGLang plan test, built-in pair: 2 runs in 4 stopped at batch 12 with the prior at
        # 0.39 while the greedy rows accepted 0.75 and k = 2 decoded 15% faster). Its
        # confidences then correct the running prior, not that floor: started from the
        # floor, a new request of a draft that agrees with nothing drafted ~4 steps before
        # its estimate fell below a round's price (SGLang, the weak draft at C = 1: 100 such
        # steps in 1,318, each ~35 ms dearer; design sec. 5). That first round is planned
        # no higher than the calibration map's top, g(1), the floor and the running prior
        # alike: no confidence can correct the estimate above it, so a round planned higher
        # only measures a request that cannot draft on. A draft whose most confident tokens
        # the target rejects (the weak draft, its map's top at 0.17) had every new request
        # draft once, with its prompt's catch-up: 1.25% of the run at C = 1 (2026-12-04,
        # BENCHMARKS.md). Only a map that learns online caps it (steps whose confidences
        # are never told, uniform ones, would otherwise never measure anyone again).
        # Nor is the floor above the pair's pooled acceptance once the map has learnt
        # online from enough samples: the first round guesses a token whose confidence is
        # not known yet, so its expected acceptance is the pooled one, not the top bin's.
        # A weak draft whose few most confident tokens are accepted (top 0.25, pooled 0.07:
        # the weak draft on the AVX-512 EPYC) had every newcomer draft a round that paid
        # only at the top (2026-12-04, BENCHMARKS.md); a pair whose pooled acceptance is
        # above the configured prior keeps the floor there.
        # A first round is planned at the request's own estimate of a first draft token's
        # acceptance (history.first, learnt in `_learn_first`), not at `pred`: pred ends a
        # step having absorbed the token its chain stopped on, which is a low one by the
        # stopping rule, so it under-predicts the next step's first token
        first = self.history.first[slots] if self.options.first_estimate else None
        fresh = self.history.fresh[slots]
        if fresh.any():
            if first is None:
                first = pred.copy()
            g = self.g
            top = g.top if g.online else 1.0
            floor = min(self.options.prior, top)
            pooled = self._pooled_anchor() if g.online else None
            if pooled is not None:
                floor = min(floor, pooled)
            np.clip(first, floor, top, out=first, where=fresh)
        seen = self.history.seen[slots]
        credit = self._lag_credit(step, slots, inputs.prices.cost)
        if B <= self.options.small_batch:
            return SmallSpecServePlan(step, slots, pred, inputs, credit, first, seen)
        return SpecServePlan(step, slots, pred, inputs, credit, first, seen)

    def _lag_credit(self, step: StepInfo, slots: np.ndarray, cost: CostModel
                    ) -> np.ndarray | None:
        """[B] catch-up tokens each request's credit pays for (lag_credit), None when no
        request owes more than one token (the credit changes nothing then)."""
        lag = step.draft_lag
        if not self.options.lag_credit or lag is None or not len(lag) or int(lag.max()) <= 1:
            return None
        row = cost.draft.b  # seconds a catch-up token adds to the draft's first forward
        credit = self.history.credit[slots]
        return credit / row if row > 0.0 else np.full(len(slots), np.inf)

    def _earn_credit(self, plan: SpecServePlan, drafted: np.ndarray) -> None:
        """After a step with catch-up owed: a request that drafted has paid its catch-up (its
        credit restarts at 0); one that did not adds what its next draft token would have
        saved, had its catch-up been paid: its predicted acceptance (weighed by the start
        margin, as the plan weighs it) times the seconds a token of plain decoding takes
        here, less the draft and verify seconds of that token and its share of the step's
        fixed draft and verify seconds (sec. 5, lag_credit)."""
        timer, d = plan.timer, plan.cost.draft
        B = timer.batch_size
        # [B] what its next draft token, a first round's, is predicted to be accepted at
        pred = np.asarray(plan.first_predictions() if self.options.first_estimate
                          else plan.predictions(), dtype=np.float64)
        per_token = (timer.plain - timer.prefill) / B
        # a draft token also needs a draft forward and the verify path, fixed costs its
        # step's drafters share: at least 1 / B of them each. Without that share, a batch
        # of 16 where drafting hardly pays still earned ~0.25 ms a request a step, and once
        # the credit covered the lags every request drafted with its whole catch-up (up to
        # 1,700 rows, a 580 ms step against 78; SGLang, distilled pair, 2026-12-05)
        fixed = (d.c + timer.step_fixed) / B
        # saved as the plan counts it: its first round drafts where E beats plain decoding's
        # times (1 + start_margin), so a token saves (1 + pred) / (1 + start_margin) - 1
        # plain tokens' seconds (pred at no margin). Counted without the margin, a pair the
        # plan drafts on only below plain decoding's E (a margin < 0) earned no credit, and
        # a request that paused once, or owed its prompt, never drafted again (the tiny
        # pair's SGLang tests on the AMX Xeon, 2026-12-05)
        saved = (1.0 + pred) / (1.0 + self.options.start_margin) - 1.0  # [B] tokens
        value = saved * per_token - (d.a * timer.n + d.b + timer.token_time + fixed)  # [B] s
        credit = self.history.credit
        slots = plan.slots
        credit[slots] = np.where(drafted > 0, 0.0, credit[slots] + np.maximum(value, 0.0))

    def observe(self, plan: SpecPlan, outcome: VerifyOutcome) -> None:
        """Calibrate g, keep the per-request histories, refresh the global prior, correct
        the prices and track how much longer steps ran than the cost model said."""
        assert isinstance(plan, SpecServePlan)
        self.stalls.record(plan.step.request_ids, outcome.step_time, outcome.end_time)
        # calibration outcomes are counted a few steps at a time (options.py)
        self._outcomes.append((outcome.confidences, outcome.verified, outcome.accepted))
        if len(self._outcomes) >= CALIBRATE_EVERY:
            for conf, verified, accepted in self._outcomes:
                self.g.update(conf, verified, accepted)
            self._outcomes.clear()
        step = plan.step
        # a step whose rounds the plan did not steer (a uniform step, its confidences told
        # or not): the predictions learn from the accepted counts
        if plan.j_done == 0 and np.count_nonzero(outcome.verified):
            plan.absorb_counts(outcome.verified, outcome.accepted)
        if np.count_nonzero(outcome.verified):
            b = float(np.log2(max(step.batch_size, 1)))
            vb = self._verify_batch
            self._verify_batch = b if vb is None else vb + VERIFY_BATCH_EMA * (b - vb)
        # a cold step's times (a shape's first run: one-time costs) are no evidence of the
        # prices or of how far steps overrun them. One such step at batch 4 moved the verified
        # tokens' scale from 0.25 to 3.4 and no request drafted for the next ~100 steps, the
        # scale learning only from steps that verify (SGLang, C = 4, 2026-12-06)
        if outcome.step_time > 0.0 and not outcome.cold:
            predicted, drafting = self._predicted(plan, outcome)
            if self.corrections is not None and not step.prefill_tokens:
                self._correct_prices(plan, outcome, predicted, drafting)
            # overruns matter only to the SLO rule: measured on steps with an SLO
            if plan.slo < float("inf"):
                measured = not step.prefill_tokens and predicted > 0.0
                self.guard.record(outcome.step_time / predicted if measured else 1.0, measured)
        if step.batch_size:
            if plan.lag_credit is not None:
                self._earn_credit(plan, outcome.drafted)
            # (a request released during the step writes a free slot: refilled on reuse)
            slots = plan.slots
            self._learn_first(plan, outcome)
            self.history.values[slots] = plan.predictions()
            self.history.seen[slots] = plan.observed()
            fresh = self.history.fresh
            paused = outcome.drafted == 0  # [B]
            fresh[slots] &= paused
            self._relax_paused(slots, paused & ~fresh[slots])
            # the prior follows the mean prediction over the live requests measured so far
            seen = ~fresh[slots]
            if seen.all():
                self.prior += PRIOR_EMA * (plan.mean_prediction() - self.prior)
            elif seen.any():
                mean = float(np.asarray(plan.predictions())[seen].mean())
                self.prior += PRIOR_EMA * (mean - self.prior)

    @property
    def correction(self) -> StepCostCorrection | None:
        """The online correction of the batch band the policy priced or learnt from last
        (None: correct_cost off)."""
        return self.corrections.last if self.corrections is not None else None

    def _learn_first(self, plan: SpecServePlan, outcome: VerifyOutcome) -> None:
        """Update the requests' first-round predictions (history.first) from this step.
        Steered rounds: each request that drafted a first token folds in that token's g(c)
        (the plan's P[0]), with pred's weights (max(ema, 1 / (seen + 2)), seen counted
        before this step). The first token of a step is drafted on the prediction before
        its confidence is seen, so its g(c) is a sample the stopping rule did not select,
        unlike the token a chain stopped on. Uniform steps (nothing steered, outcomes
        counted by absorb_counts from `first`): the counted prediction, as pred."""
        slots, first = plan.slots, self.history.first
        if plan.j_done == 0:
            if np.count_nonzero(outcome.verified):
                first[slots] = plan.predictions()
            return
        g1 = plan.P[0]  # [B] g(c) of the step's first draft token, +inf where not drafted
        drafted = np.isfinite(g1)
        if not drafted.any():
            return
        weight = np.maximum(self.options.ema, 1.0 / (self.history.seen[slots] + 2.0))
        cur = first[slots]
        first[slots] = np.where(drafted, cur + weight * (np.where(drafted, g1, cur) - cur), cur)

    def _pooled_anchor(self) -> float | None:
        """The pair's pooled acceptance (the map's accepted share of all its samples), None
        until the map counted RELAX_SAMPLES: a few samples say little (one is 0 or 1)."""
        if float(self.g.counts.sum()) < RELAX_SAMPLES:
            return None
        return self.g.pooled

    def _relax_paused(self, slots: np.ndarray, paused: np.ndarray) -> None:
        """Move the predictions of the requests measured before that did not draft this step
        ([B] paused) pause_relax of the way to the pair's pooled acceptance (sec. 5): a
        prediction is a request's recent acceptance, and the longer it goes unmeasured the
        less it says about the next token. Chains stop after a low-confidence token, whose
        g(c) is what the prediction absorbed last, so a request that paused kept a
        prediction below its next token's acceptance and never drafted again."""
        rate = self.options.pause_relax
        if not rate or not paused.any():
            return
        anchor = self._pooled_anchor()
        if anchor is None:
            return
        idx = slots[paused]
        for values in (self.history.values, self.history.first):
            values[idx] += rate * (anchor - values[idx])

    def release(self, request_id: str) -> None:
        self.history.release(request_id)

    def slo_scale(self) -> float:
        """What plans divide their SLO limits by (overrun.py): the window's worst overrun,
        SpecServe's rule holding every step to the SLO."""
        return self.guard.scale

    # ----- prices
    def _current_prices(self, batch: int | None = None) -> Prices:
        """The profile with the correction's current scales (rebuilt when they moved), for a
        step of `batch` requests (None: as learnt, whatever the batch)."""
        prices = self.prices
        if self.corrections is None:
            return prices
        corr = (self.corrections.last if batch is None
                else self.corrections.for_batch(batch))
        overhead = corr.overhead
        theta_verify = corr.theta_verify
        # A verified token's price moves with the batch in ways one scale cannot follow
        # (SGLang's CPU engine: ~free at batch 1, where the verify path's fixed cost took the
        # whole difference, ~2.4 ms at 16), and the scale learns only from steps that
        # verify. So a scale that makes verifying cheaper than the profile says holds within
        # 2x of the batch sizes it was learnt at; further off, the profile's price does,
        # until steps there verify (without this, a server that ran at batch 1 and then at
        # 16 priced batch 16's tokens at 1/64 of theirs and verified 20-38 tokens a step for
        # 27 steps, -12% on that loop, BENCHMARKS.md 2026-12-03)
        vb = self._verify_batch
        if (batch is not None and vb is not None and theta_verify < 1.0
                and corr.verify_fixed_prior > 0.0  # (the one-scale fit ties it to the target's)
                and abs(float(np.log2(max(batch, 1))) - vb) > 1.0):
            theta_verify = 1.0
        seen = (overhead, corr.verify_fixed, theta_verify)
        if (corr.theta_target, corr.theta_draft) != (prices.theta_target, prices.theta_draft) \
                or seen != self._seen:
            c = self.profile_cost
            t = corr.theta_target
            target, verify_token = c.scaled_target(t)
            cost = CostModel(target, c.draft.scaled(corr.theta_draft),
                             c.overhead * t if overhead is None else overhead,
                             corr.verify_fixed, c.token_scale * theta_verify / t,
                             verify_token)
            self.prices = prices = Prices(cost, t, corr.theta_draft)
            self._seen = seen
        return prices

    # the overhead, verify_fixed and theta_verify the prices were made with
    _seen: tuple[float | None, float, float] = (None, 0.0, 1.0)

    def _predicted(self, plan: SpecServePlan, outcome: VerifyOutcome) -> tuple[float, float | None]:
        """The step time the prices predicted for what ran, and its drafting seconds when
        known without computing them."""
        timer = plan.timer
        n_drafted = int(outcome.drafted.sum())
        if not n_drafted:
            return timer.plain, 0.0
        if n_drafted == plan.k_total:
            # the caller drafted exactly the plan (it can only draft a subset of it): its
            # time is known, less the verify tokens that elimination removed
            tt, vf = timer.token_time, timer.verify_fixed  # (verify_extra on Python floats)
            planned_verify = tt * timer.paid_verify(n_drafted) + vf
            drafting = plan.time - timer.plain - planned_verify
            n_verified = int(outcome.verified.sum())
            predicted = plan.time - planned_verify + (
                tt * timer.paid_verify(n_verified) + vf if n_verified else 0.0)
            return predicted, drafting
        return timer.plan(outcome.drafted, outcome.verified), None

    def _correct_prices(self, plan: SpecServePlan, outcome: VerifyOutcome, predicted: float,
                        drafting: float | None) -> None:
        """Feed the correction this step in profile seconds (its features). Steps with
        prefill chunks stay out: their time is mostly the prefill, priced apart, whose error
        the fit would spread over the speculation scales."""
        assert self.corrections is not None
        correction = self.corrections.for_batch(plan.timer.batch_size)
        timer, prices = plan.timer, plan.inputs.prices
        if drafting is None:
            drafting = draft_time(prices.cost.draft, timer.n, timer.lag, outcome.drafted)
        verify = max(0.0, predicted - timer.plain - drafting) / prices.theta_target
        if outcome.verify_time is not None:  # the target forward measured apart
            c = self.profile_cost
            n_verified = float(outcome.verified.sum())
            plain, tokens = c.fit_features(timer.verify_ctx, timer.verify_q0,
                                           timer.batch_size, n_verified)
            if c.verify_fixed:  # the fit's features: the verified tokens' profiled seconds
                verify = tokens
            correction.observe(
                plain + verify,
                drafting / prices.theta_draft, outcome.step_time, outcome.draft_time,
                measured_target=outcome.verify_time, overhead=c.overhead,
                verify_part=verify if n_verified else None)
        else:
            correction.observe(timer.plain / prices.theta_target + verify,
                                    drafting / prices.theta_draft, outcome.step_time,
                                    outcome.draft_time)
