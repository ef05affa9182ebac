"""One SpecServe decode step: predict-execute-correct drafting (SpecServe Alg. 1) and the
confidence-prior verifier (Alg. 2), on the step's own values (docs/design.md sec. 5).

Predict: request r's next conditional acceptance is predicted by `pred[r]`, an EMA of g(c)
over its recent draft tokens (the policy keeps it across steps). Drafting position j + 1
for r adds gain_r = P_{r,j} * pred_r expected tokens and cost_r = a_d ctx_{r,j+1} + b_d +
b_t seconds (its share of the draft forward plus one more verified token), and the forward
itself adds c_d. The subset S maximising (tokens + sum_S gain) / (T + c_d + sum_S cost) is a
prefix of the requests sorted by gain / cost, so one sort and two prefix sums score every
candidate subset; prefixes whose step time breaks the (guarded) SLO score -inf.

Execute: the caller drafts for the chosen subset only if it beats the current plan's E;
otherwise drafting stops for everyone. A strict subset drafts only if it scores
`uniform_margin` above the whole candidate set (uniform plans first).

Correct (`extend`): the real confidences replace the prediction: P_{r,j+1} = P_{r,j}
g(c_{r,j+1}), the expected token sum is updated, and the request's EMA absorbs g(c), so the
next prediction already uses it. Requests whose chain probability fell below COLLAPSE leave
the draft batch.

Verify (`verify_lengths`): the tails with the lowest chain probabilities go while removing
one raises E (verifier/elimination.py), always a suffix of each request's draft.

State (arrays indexed by batch row, [B]; P position-major):
    pred     predicted acceptance of each request's next draft token
    p_last   chain probability of its last drafted position (0 once it stopped drafting)
    P        [k_max, B] chain probabilities of the drafted positions, +inf where not drafted
    tokens   expected tokens of the current plan (all drafts verified); time: its step time
    k_total  draft tokens in the plan; j_done: the last position absorbed by `extend`
`SmallSpecServePlan` (small_plan.py) makes the same decisions on Python floats.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from sloserve.estimator.acceptance import ConfidenceCalibrator, chain_probs
from sloserve.estimator.cost_model import CostModel
from sloserve.estimator.efficiency import binding_slo
from sloserve.estimator.step_time import StepTimer
from sloserve.policies.specserve.options import COLLAPSE, COUNT_EMA, SEEN_CAP, SpecServeOptions
from sloserve.speculation import SpecPlan, StepInfo
from sloserve.verifier.elimination import eliminate_padded, eliminate_plan

# prefix sums without ndarray.cumsum's dispatch overhead (~1 us per call at B = 64; a plan
# runs a few per draft forward)
_accumulate = np.add.accumulate


@dataclass(frozen=True)
class Prices:
    """The cost model a step is planned with: the profile's, corrected online."""

    cost: CostModel
    theta_target: float = 1.0  # the correction's scales the cost was made with
    theta_draft: float = 1.0


@dataclass(frozen=True)
class PlanInputs:
    """What the policy hands a new plan: its long-lived state, read-only here."""

    prices: Prices
    g: ConfidenceCalibrator  # confidence -> conditional acceptance
    options: SpecServeOptions
    k_max: int  # the policy's k_max
    slo_scale: float  # the SLO guard's divisor (overrun.py)
    verifier: bool  # False: the drafter-only ablation (verify everything drafted)
    ones: np.ndarray  # [B] ones, counts: [B] 1..B (cached per batch size by the policy)
    counts: np.ndarray


class SpecServePlan(SpecPlan):
    """A step planned on numpy arrays (batches above SpecServeOptions.small_batch)."""

    def __init__(self, step: StepInfo, slots: np.ndarray, pred: np.ndarray,
                 inputs: PlanInputs, lag_credit: np.ndarray | None = None,
                 first: np.ndarray | None = None, seen: np.ndarray | None = None) -> None:
        B = step.batch_size
        opts = inputs.options
        self.step = step
        self.inputs = inputs
        self.cost = cost = inputs.prices.cost
        k_max = max(0, min(inputs.k_max, step.k_max))
        self.k_max = k_max
        slo = binding_slo(step)
        # catch-up priced amortized only without a binding SLO, less each request's credit
        # ([B] tokens, lag_credit; docs/design.md sec. 5)
        self.timer = StepTimer(cost, step, opts.lag_cap if slo == float("inf") else None,
                               lag_credit)
        self.lag_credit = lag_credit
        self.slo = slo / inputs.slo_scale
        self.slo_all = self.slo  # every request drafting (batch_rounds' uniform steps)
        # per-request limits ([B] each, guarded) where a request's allowance counted its own
        # expected draft tokens (specserve-slo): a first round's prefix of drafters is held
        # to min(their allowances, the others' one-token limits), the rounds after it to the
        # limit of the prefix it chose (self.slo); None: one limit for all, self.slo
        self.split_limits: tuple[np.ndarray, np.ndarray] | None = None
        if step.one_token_limits is not None and B:
            self.split_limits = (np.asarray(step.step_limits, dtype=np.float64) / inputs.slo_scale,
                                 np.asarray(step.one_token_limits, dtype=np.float64)
                                 / inputs.slo_scale)
        self.slots = slots  # [B] the requests' rows in the policy's history (read-only)
        self.pred = pred  # [B], owned by the plan
        # [B] the predictions a first draft round is planned at (a request none of whose own
        # drafts was seen yet at least at the configured prior); pred itself, the estimate
        # the request's confidences correct, starts from the running prior
        self.first = pred if first is None else first
        # [B] draft tokens of its own each request's prediction has absorbed (capped): the
        # running prior counts as one, so the n-th token of a new request weighs 1 / (n + 1)
        # until that falls below the EMA's weight
        self.seen = np.zeros(B) if seen is None else seen
        self.p_last = np.ones(B)
        # [B] how much each request's expected draft tokens count when a round is chosen
        # (StepInfo.token_weights; None: 1 each). The plan's tokens stay unweighted.
        self.w = (None if step.token_weights is None
                  else np.asarray(step.token_weights, dtype=np.float64))
        self.tokens = float(B)  # plain decoding: one token each
        self.time = self.timer.plain
        # seconds of the step outside its scored E (its prefill chunks, unless score_prefill)
        self.unscored = 0.0 if opts.score_prefill else self.timer.prefill
        self.P = np.full((k_max, B), np.inf)
        self.P_told: np.ndarray | None = None  # [B, s] P of a chain told at once
        self.ones = inputs.ones  # x.dot(ones) sums x faster than x.sum()
        self.counts = inputs.counts
        self.k_total = 0
        self.j_done = 0
        self.linear = cost.draft.q0 <= 0.0 and cost.target.q0 <= 0.0
        self._prepare()
        if k_max <= 0 or B == 0:
            self.drafting = np.zeros(B, dtype=bool)
        else:
            self.drafting = self._first_round()

    # ----- the protocol
    def extend(self, confidences: np.ndarray, drafting: np.ndarray) -> np.ndarray:
        """Correct with position j's real confidences, then decide position j + 1."""
        j = confidences.shape[1]
        self._correct(j, confidences[:, j - 1], drafting)
        self.j_done = j
        if j >= self.k_max:
            self.drafting = np.zeros(self.step.batch_size, dtype=bool)
        else:
            self.drafting = self._next_round(j)
        return self.drafting

    def verify_lengths(self, confidences: np.ndarray, drafted: np.ndarray) -> np.ndarray:
        drafted = np.asarray(drafted, dtype=np.int64)
        # count_nonzero: any() without a reduction's overhead (this runs every step)
        if not self.inputs.verifier or confidences.shape[1] == 0 or not np.count_nonzero(drafted):
            return drafted.copy()
        opts = self.inputs.options
        s = int(drafted[drafted.argmax()])
        if s == self.j_done:  # every drafted position went through extend: P is this plan's
            n = int(drafted.sum())
            return eliminate_padded(
                self.P[:s].T, drafted, tokens=self.tokens, step_time=self.time,
                token_time=self.timer.token_time, slo=self.slo,
                paid_tokens=self.timer.paid_verify(float(n)), n_drafted=n,
                unscored_time=self.unscored, margin=opts.uniform_margin,
                fixed=self.timer.verify_fixed,
            )
        # a caller that drafted without telling the plan: P from the real confidences
        P = chain_probs(self.inputs.g(confidences))  # [B, s]
        self.P_told = P  # (the step log's chain probabilities of such a step)
        return eliminate_plan(self.timer, P, drafted, self.slo, self.unscored,
                              opts.uniform_margin)

    # ----- callers that fix one draft length for the whole batch before drafting
    def batch_rounds(self) -> int:
        """The k in 0..k_max maximising E(k) = (B + sum_r sum_{j<=k} pred_r^j) / T(k), every
        request drafting and verifying k tokens (T: StepTimer.uniform; E without the step's
        prefill seconds unless score_prefill), within the guarded SLO: the plan's own rule
        with each request's confidences at its prediction, for callers that cannot consult
        the plan between draft rounds (SGLang's speculative workers draft a fixed number of
        steps). The search stops at the first k that does not raise E, or with the
        `lookahead` option scores every k (the verify path's once-a-step cost can make k = 1
        score below k = 0 and k = 2 above it). The plan's tokens, time and k_total become
        that uniform plan's."""
        B, k_max = self.step.batch_size, self.k_max
        # every request drafts: held to the smallest allowance, not to the limit of the
        # first round's prefix (__init__ planned one)
        self.slo = self.slo_all
        if B == 0 or k_max <= 0:
            return 0
        times = self.timer.uniform(k_max)  # [k_max + 1]
        # every request's catch-up past its price (StepTimer.excused): in the time held
        # to the SLO, not in E
        hidden = float(self.timer.excused.sum()) if self.timer.has_excused else 0.0
        pred = np.asarray(self.first_predictions(), dtype=np.float64)  # [B]
        chain = np.ones(B)
        tokens = float(B)
        best_k, best_tokens = 0, tokens
        best_e = tokens / (times[0] - self.unscored) * (1.0 + self.inputs.options.start_margin)
        for k in range(1, k_max + 1):
            chain = chain * pred
            tokens += float(chain.sum() if self.w is None else chain.dot(self.w))
            if times[k] + hidden > self.slo:  # times rise with k: no longer plan fits either
                break
            e = tokens / (times[k] - self.unscored)
            if e <= best_e:
                if self.inputs.options.lookahead:
                    continue
                break
            best_k, best_tokens, best_e = k, tokens, e
        self.tokens, self.time = best_tokens, float(times[best_k])
        self.k_total = best_k * B
        if best_k:  # the limit of self.time from here on (verify_lengths' elimination)
            self.slo -= hidden
        return best_k

    def absorb_counts(self, verified: np.ndarray, accepted: np.ndarray) -> None:
        """Learn the predictions from verify outcomes when the caller has no confidences:
        each verified position up to the first rejection is one sample of the conditional
        acceptance (1 accepted, 0 rejected), folded into the request's EMA in order (weight
        COUNT_EMA), from the prediction its rounds were planned at (`first`: 0/1 outcomes
        are too noisy to be weighed against the running prior as confidences are)."""
        pred, first, ema = self.predictions(), self.first_predictions(), COUNT_EMA
        for r, (k, a) in enumerate(zip(np.asarray(verified).tolist(),
                                       np.asarray(accepted).tolist())):
            x = first[r]
            for j in range(min(a + 1, k)):
                x += ema * ((1.0 if j < a else 0.0) - x)
            pred[r] = x

    # ----- what the policy reads back in observe
    def predictions(self) -> np.ndarray | list[float]:
        """[B] the requests' predictions after this step (the policy keeps them)."""
        return self.pred

    def first_predictions(self) -> np.ndarray | list[float]:
        """[B] the predictions a first round is planned at (`first`)."""
        return self.first

    def observed(self) -> np.ndarray | list[float]:
        """[B] draft tokens each request's prediction has absorbed, after this step."""
        return self.seen

    def mean_prediction(self) -> float:
        return float(self.pred.dot(self.ones)) / self.step.batch_size

    # ----- planning on numpy arrays
    def _prepare(self) -> None:
        k_max, timer, d = self.k_max, self.timer, self.cost.draft
        self.costs = timer.draft_token_costs(k_max)  # [k_max, B] per-token seconds
        if d.b + self.cost.target.b <= 0.0:  # free tokens: keep gain / cost finite
            self.costs = np.maximum(self.costs, 1e-12)
        if self.linear:  # no knee: the per-request linear costs add up exactly
            return
        # [k_max, B] draft forward attention seconds per request at position j + 1 (the first
        # forward reads n - lag KV tokens) and [B] query tokens it feeds at j = 0 (lag + 1)
        self.ctx_costs = d.a * (timer.n + np.arange(k_max, dtype=np.float64)[:, None])
        if k_max and timer.has_lag:
            self.ctx_costs[0] -= d.a * timer.lag
        self.first_q = 1.0 + timer.lag
        # [B] the draft forward's query-token seconds when the prefix's requests feed one
        # token each (every forward but a first one with lag), and the verify's token_time
        # per prefix size: _prefix_times adds the knees from these
        self.draft_q_costs = d.b * np.maximum(self.counts - d.q0, 0.0)
        self.verify_costs = timer.token_time * self.counts

    def _first_round(self) -> np.ndarray:
        return self._grow(0, self.p_last if self.w is None else self.p_last * self.w)

    def _next_round(self, j: int) -> np.ndarray:
        # requests still drafting whose chain has not collapsed (p_last is 0 for the others)
        live = self.p_last >= COLLAPSE
        return self._grow(j, live if self.w is None else live * self.w)

    def _grow(self, j: int, weight: np.ndarray) -> np.ndarray:
        """Predict and pick the requests that draft position j + 1. weight: [B] 1 for
        candidates (0 or False for the others); with self.p_last it gives each one's gain."""
        opts = self.inputs.options
        pred = self.first if j == 0 else self.pred
        gain = self.p_last * pred
        gain *= weight  # [B] expected extra tokens (0 for non-candidates)
        cost = self.costs[j]  # [B] seconds, linear: ranks the requests
        # best tokens per second first (a stable sort: ties in the same order as the
        # small-batch plan's)
        order = (gain / cost).argsort(kind="stable")[::-1]
        tokens = gain.take(order)
        tokens[0] += self.tokens  # so the prefix sums start from the current plan
        _accumulate(tokens, out=tokens)  # [B] plan with the first i + 1 of order
        time = self._prefix_times(j, order)
        margin = 1.0 + opts.start_margin if j == 0 else 1.0
        score = tokens / (time - self.unscored)  # E of each prefix
        current = self.tokens / (self.time - self.unscored) * margin
        limit = self._prefix_limits(order) if j == 0 and self.split_limits is not None else None
        # [B] the first forward's catch-up past its price (StepTimer.excused) over each
        # prefix: held to the limit, not scored
        hidden = (_accumulate(self.timer.excused.take(order))
                  if j == 0 and self.timer.has_excused else None)
        held = time if hidden is None else time + hidden
        if limit is not None:
            score[held > limit] = -np.inf
        elif self.slo < float("inf"):
            score[held > self.slo] = -np.inf
        best = int(score.argmax())
        if opts.uniform_margin:
            # a strict subset of the candidates drafts only if it scores uniform_margin above
            # the whole set; otherwise the whole set drafts if it raises E, or nobody does
            full = int(np.count_nonzero(gain)) - 1  # the prefix of every candidate
            if full > best and score[full] * (1.0 + opts.uniform_margin) >= score[best]:
                best = full
        drafting = np.zeros(weight.size, dtype=bool)
        if limit is not None:  # the rounds after this one: the chosen drafters' limit
            self.slo = float(limit[best])
        # a prefix ending in a zero-gain request always scores lower than the one before
        if score[best] <= current:
            chosen = order[: best + 1].tolist()
            if not (opts.lookahead and self._pays_later(
                    j, gain.take(chosen).tolist(), pred.take(chosen).tolist(),
                    float(tokens[best]), float(time[best]), current)):
                return drafting
        drafting[order[: best + 1]] = True
        self.time = float(time[best])
        self.k_total += best + 1
        if hidden is not None:  # the limit of self.time in the rounds after this one
            self.slo -= float(hidden[best])
        return drafting

    def _prefix_limits(self, order: np.ndarray) -> np.ndarray:
        """[B] the step-time limit of the plan where the first i + 1 requests of `order` draft
        and the rest do not: the drafters' smallest allowance and the others' smallest
        one-token limit (split_limits)."""
        assert self.split_limits is not None
        drafts, ones = self.split_limits
        limit = np.minimum.accumulate(drafts.take(order))  # [B] over each prefix
        rest = np.minimum.accumulate(ones.take(order)[::-1])[::-1]  # [B] over order[i:]
        limit[:-1] = np.minimum(limit[:-1], rest[1:])  # the last prefix leaves nobody out
        return limit

    def _pays_later(self, j: int, gain: list[float], pred: list[float], tokens: float,
                    time: float, current: float) -> bool:
        """Whether position j + 1 for the chosen requests, which does not raise E by itself,
        pays with the rounds after it: the plan with it has `tokens` expected tokens in
        `time` seconds, gain [n] is each chosen request's expected token at j + 1 and pred
        [n] its prediction; each later round h adds gain * pred^(h - 1) tokens a request and
        the seconds of round j + 1 (less the step's once-a-step costs), within the
        guarded SLO and k_max. Python floats, so both plans decide alike."""
        later = time - self.time - (self.timer.step_fixed if self.k_total == 0 else 0.0)
        chain = gain
        for _ in range(self.k_max - j - 1):
            chain = [c * p for c, p in zip(chain, pred)]
            tokens += sum(chain)
            time += later
            if time > self.slo:
                return False
            if tokens / (time - self.unscored) > current:
                return True
        return False

    def _prefix_times(self, j: int, order: np.ndarray) -> np.ndarray:
        """[B] exact step time of the plan plus draft position j + 1 for the first i + 1
        requests of `order`: one more draft forward (its knee priced on the prefix's query
        tokens) and i + 1 more verified tokens (past the target's knee; the first verified
        token of the step also pays step_fixed: the drafter's setup and the verify path)."""
        d = self.cost.draft
        # the forward's fixed cost, and the step's (the drafter's setup, the verify path)
        # when nothing is drafted yet
        fixed = d.c + (self.timer.step_fixed if self.k_total == 0 else 0.0)
        if self.linear:  # no knee: the per-request linear costs add up exactly
            time = self.costs[j].take(order)
            time[0] += self.time + fixed
            return _accumulate(time, out=time)
        time = self.ctx_costs[j].take(order)  # [B] attention reads of the draft forward
        time[0] += self.time + fixed
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
        acc = self.inputs.g(np.fmax(conf, 0.0))  # [B] g(c); NaN (not drafted) -> g(0)
        p = self.p_last * acc
        p *= drafting
        self.p_last = p
        np.copyto(self.P[j - 1], p, where=drafting)
        self.tokens += float(p.dot(self.ones))  # p.sum(), without a reduction's overhead
        # weight max(ema, 1 / (seen + 2)): the running prior counts as one token
        weight = np.maximum(self.inputs.options.ema, 1.0 / (self.seen + 2.0))
        delta = acc - self.pred
        delta *= weight
        np.add(self.pred, delta, out=self.pred, where=drafting)  # only requests that drafted
        np.add(self.seen, 1.0, out=self.seen, where=drafting & (self.seen < SEEN_CAP))
