"""Online correction of the profiled step time from the engine's measured step times.

The offline profile times each model's forwards in isolation. Inside the engine a step also
pays what that cannot see: caches cold after the other model's forward, ragged padding of
verify segments, the controller's own calls between draft forwards; and this machine's
speed drifts. Measured on the built-in CPU pair at batch 4 (2026-11-22): plain steps ran 8%
faster than the profile said, speculative steps 2-12% slower, so the profile put the price
of speculation ~20% too low relative to plain decoding, and the controller speculated where
fixed small k or plain decoding did better.

Two scales (docs/design.md sec. 2): theta_draft for the draft forwards (the caller measures
the drafting loop on its own: a ratio fit), theta_target for the target's forward (plain
decoding plus what verified draft tokens add, one scale for both: fitted apart they were
poorly identified, since plain and verify time move together, and swung to the bounds
0.5-2.0 run to run on the built-in pair). Where the caller times the target forward apart
(`measured_target`), theta_target is fitted on it alone and the rest of the step, measured -
draft - target, is tracked as `overhead` (the engine's own per-step work: sampling, commit,
detokenizing, ~1.4 ms a step at batch 32 on the built-in CPU pair), so that work does not
raise the price of a verified token; otherwise theta_target is fitted on the step's seconds
outside drafting.

Where the profile has a verify path cost (`verify_fixed`, CostModel: SGLang's verify forward
over its decode forward), the target forward measured apart is fitted as

    measured target = theta_target * profiled plain forward
                      + theta_verify * profiled verified-token seconds
                      + v * [the step verified drafts]

three features, each with its prior (1, 1, the profile's verify_fixed). A verify forward is
another path than a decode forward, and on SGLang's CPU runtime its price per verified token
moves with the batch in a way the profile's one b cannot follow (~6 ms a token at batch 1,
~1.5 ms at 16, against a fitted 2 ms): one scale for all put the price of verifying wherever
the mix of plain and verify steps put it, so the plan verified long chains at batch 1 that
cost three times their price. Fitted on the steps the batch runs now (the forgetting window),
the three follow the operating point; but theta_verify learns only from steps that verify,
so the caller's verified-token feature should carry the profile's price at the step's
batch size where it has one (CostModel.token_time): then a scale learnt at batch 1 does not
price batch 16's tokens. Without a profiled verify_fixed the fit is the one-scale fit below.

Each is an exponentially weighted least-squares fit (forgetting factor `forget`: an
effective window of 1 / (1 - forget) steps; every step fades every sum) with a prior at 1,
scaled to the features' typical magnitudes: `prior_weight` pseudo-steps that fade like the
samples (the fit starts at the profile and moves as evidence comes) on top of `ridge`
pseudo-steps that stay. The ridge biases a scale with steady evidence by
~ridge * (1 - forget), 0.5% by default; a scale whose evidence stops (theta_draft while
speculation is off) returns to the profile within a few hundred steps, so a pessimistic
price learned from a few slow steps cannot turn speculation off for good.
The features that only some steps carry (the drafting, the verified tokens and the verify
path's price) never weigh less in all than at the start: their prior is the fading one or
what their faded evidence falls short of `prior_weight` by, whichever is more. While steps
carry them the prior fades as before; over a pause the evidence fades, the prior takes its
place, and a scale that returned to the profile is as sure of it as at the start, not held
by the ridge alone. With the ridge alone, the first drafting step after 500 steps at batch
16 that drafted nothing (its draft reading 88 rows of catch-up, 38 ms against ~12) set
theta_draft to its bound, 4x, and the verify path's price v to 7x, and drafting at batch 4
stayed off for the next hundreds of steps (SGLang, the smollm2 pair, 2026-12-05). A sample more
than `clip` times off the current prediction is clipped to that ratio (a GC pause or a
preempted step must not swing the fit), and every scale stays in
[1 / max_scale, max_scale] (v: within max_scale of the profile's, or up to a plain forward;
theta_verify within max_scale^2).

The anchor (`anchor` > 0, SpecServe's `price_anchor`): the windowed fits' priors are the
scales of slow fits of the same features (forgetting factor `anchor`, ~500 steps at 0.998)
whose priors are the profile's, not the profile's own. The fit's data follow the plan's
choices: a verify price estimated high stops the steps that would correct it, and over that
pause the window forgot towards the profile (at batch 4 on SGLang's CPU runtime the windowed
price of 8 verified tokens sat at a median 19 ms against 12 measured, where a whole-run fit
of the same steps priced 12.1; 2026-12-07, price_replay). Anchored, a pause forgets towards
what the run measured; a pause as long as the slow window returns to the profile.

The fit runs every step on Python floats: after a forward, numpy's calls run on cold caches
(the three-feature fit's array building and 3 x 3 solve took ~195 us a step cold against
~21 us warm, numpy's solve alone ~77 us; 2-core AVX2 EPYC, 2026-12-06), where a few dozen
float operations cost next to nothing.
"""

from __future__ import annotations

import math
from collections.abc import Callable

# the bound of every scale over a rough estimate (CostModel.rough: from the models' shapes,
# no profile), where a profile's is 2: SGLang's float32 decode forward on a 2-core Xeon ran
# 2-3x rough_cost's at batch 1-4 (2026-12-02: 44-67 ms against 22.5), an AVX2-only EPYC's
# ~2x that again, and a GPU's forwards run far below it; held at 2, the step's price sat at
# its bound and the plan priced every step a third too low
ROUGH_MAX_SCALE = 8.0
# the bound over a measured profile's costs: a profile from this machine is off by less
PROFILE_MAX_SCALE = 2.0


class StepCostCorrection:
    def __init__(self, forget: float = 0.98, prior_weight: float = 8.0, ridge: float = 0.25,
                 clip: float = 2.0, max_scale: float = PROFILE_MAX_SCALE,
                 verify_fixed: float = 0.0, anchor: float = 0.0) -> None:
        if not 0.0 < forget <= 1.0:
            raise ValueError(f"forget must be in (0, 1], got {forget}")
        if not (anchor == 0.0 or forget <= anchor <= 1.0):
            raise ValueError(f"anchor must be 0 (off) or in [forget, 1], got {anchor}")
        self.forget = forget
        self.prior_weight = prior_weight
        self.prior_left = prior_weight  # the fading prior's pseudo-steps
        # the faded counts of the steps that carried the features only some steps carry
        # (drafting; the verified tokens and v): their priors keep the count and the prior
        # together at prior_weight pseudo-steps at least (_prior_for)
        self.n_draft = self.n_verify = 0.0
        self.ridge = ridge
        self.clip = clip
        self.max_scale = max_scale
        self.theta_target = self.theta_draft = 1.0
        # the verify path's seconds over a decode forward: the profile's (the prior), then v;
        # the scale of the verified tokens' seconds; the three-feature fit's sums (features
        # x = (plain, tokens, verified), weighted x x^T [3][3] and x y [3], Python floats)
        # and the tokens feature's typical square over the steps that verified
        self.verify_fixed_prior = self.verify_fixed = verify_fixed
        self.theta_verify = 1.0  # theta_target's value where the fit has one scale
        self.sxx3 = [[0.0] * 3 for _ in range(3)]
        self.sxy3 = [0.0] * 3
        self.tok2 = 0.0
        # the anchor (anchor > 0): the same fits (the three-feature target fit and the
        # draft's ratio fit) with forgetting factor `anchor`, their priors the profile's;
        # the windowed fits' priors are their scales
        self.anchor = anchor
        self.slow = [[0.0] * 3 for _ in range(3)]
        self.slow_y = [0.0] * 3
        self.slow_n_verify = 0.0
        self.slow_prior_left = prior_weight
        self.slow_n = 0.0
        self.slow_tt = 0.0
        self.slow_dd = self.slow_dm = self.slow_n_draft = 0.0  # the slow draft ratio fit
        self.plain_typ = 0.0  # the plain forward feature's typical value (v's upper bound)
        # draft fit: exponentially weighted sums of d = profiled and m = measured draft
        # seconds, and d's typical square over the steps that drafted (it does not fade
        # while speculation is off, so the prior takes over again)
        self.sdd = self.sdm = 0.0
        self.d2 = 0.0
        # target fit with the forward measured apart: x = its profiled seconds, y = measured;
        # and the step's seconds outside both models' forwards, a weighted mean
        self.stt = self.stm = self.srest = 0.0
        self.n_target = 0.0
        self.overhead: float | None = None  # None until a step measured it
        # target fit without: x = the step's profiled seconds outside drafting
        self.sxx = self.sxy = 0.0
        self.n_step = 0.0

    @property
    def theta(self) -> tuple[float, float]:
        """(theta_target, theta_draft)."""
        return self.theta_target, self.theta_draft

    def _clipped(self, measured: float, predicted: float) -> float:
        return min(max(measured, predicted / self.clip), predicted * self.clip)

    def observe(self, target: float, draft: float, measured: float,
                measured_draft: float | None = None, measured_target: float | None = None,
                overhead: float = 0.0, verify_part: float | None = None) -> None:
        """One step: its profiled target seconds (the target forward, or without
        `measured_target` the whole step outside drafting, overhead included), its profiled
        draft seconds, its measured seconds and the measured seconds of its drafting (None:
        not measured, taken at the current scale). measured_target: the measured seconds of
        its target forward; `overhead`, the profiled seconds outside the forwards, is then
        the prior of `self.overhead`. verify_part: the profiled seconds of the verified
        draft tokens within `target` (None: the step verified none; its target forward took
        the decode path); `target` leaves the profile's verify_fixed out."""
        if target <= 0.0 or measured <= 0.0 or draft < 0.0:
            return
        w, m_draft = self._observe_draft(draft, measured_draft)
        f = self.forget
        if measured_target is not None and measured_target > 0.0:
            three = self.verify_fixed_prior > 0.0
            tokens = (verify_part or 0.0) if three else 0.0
            x = (target - tokens, tokens, 1.0 if verify_part is not None else 0.0)
            if three:
                predicted = (self.theta_target * x[0] + self.theta_verify * x[1]
                             + self.verify_fixed * x[2])
            else:
                predicted = self.theta_target * target
            y = self._clipped(measured_target, predicted)
            self.stt = f * self.stt + target * target
            self.stm = f * self.stm + target * y
            self.n_target = f * self.n_target + 1.0
            lam = w * self.stt / self.n_target
            if three:
                self._fit_three(f, x, y, lam, w)
            else:  # one scale: verified tokens' too
                self.theta_target = self.theta_verify = self._bound(
                    (self.stm + lam) / (self.stt + lam))
            # the rest: an exponentially weighted mean with the same fading prior as the
            # scales (the profile's overhead until measured steps outweigh it)
            self.srest = f * self.srest + max(0.0, measured - m_draft - measured_target)
            self.overhead = (self.srest + w * overhead) / (self.n_target + w)
            return
        y = self._clipped(measured - m_draft, self.theta_target * target)
        self.sxx = f * self.sxx + target * target
        self.sxy = f * self.sxy + target * y
        self.n_step = f * self.n_step + 1.0
        lam = w * self.sxx / self.n_step
        self.theta_target = self.theta_verify = self._bound((self.sxy + lam) / (self.sxx + lam))

    def _fit_three(self, f: float, x: tuple[float, float, float], y: float, lam: float,
                   w: float) -> None:
        """theta_target, theta_verify and v from the 3 x 3 normal equations of y = x .
        (theta_target, theta_verify, v), priors (1, 1, the profile's verify_fixed) weighted
        like the one-scale fit's: lam, w times the tokens feature's typical square, w."""
        sxx, sxy = self.sxx3, self.sxy3
        for i in range(3):
            row = sxx[i]
            for j in range(3):
                row[j] = f * row[j] + x[i] * x[j]
            sxy[i] = f * sxy[i] + x[i] * y
        if x[1] > 0.0:
            self.tok2 = self._typical(self.tok2, x[1] * x[1])
        self.plain_typ = self._typical(self.plain_typ, x[0])
        v0 = self.verify_fixed_prior
        # the bounds (each scale within max_scale of the profile, theta_verify's wider: the
        # profile's one b is furthest off there, 3x at batch 1; v within max_scale of the
        # profile's below, and above up to max_scale x it or one plain forward where that
        # is more: on a 2-core AMD EPYC (AVX2, float32) a batch-1 verify of two tokens took
        # ~290 ms against ~170 ms for the decode forward of one, 7x the profiled 16 ms).
        # v's floor: one fast verify step among few once set v to 0 and theta_verify to its
        # floor (its prior had faded to the ridge), and the plan then drafted 32 steps in a
        # row at batch 1 that accepted next to nothing (2026-12-02, BENCHMARKS.md)
        self.n_verify = f * self.n_verify + (1.0 if x[2] > 0.0 else 0.0)
        wv = self._prior_for(self.n_verify)
        prior_w = (lam, wv * self.tok2 if self.tok2 > 0.0 else lam, wv)
        means = self._anchor_means(x, y, v0) if self.anchor else (1.0, 1.0, v0)
        A = [[sxx[i][j] + (prior_w[i] if i == j else 0.0) for j in range(3)] for i in range(3)]
        b = [sxy[i] + prior_w[i] * p for i, p in enumerate(means)]
        # (solve3 overwrites A and b: the 2 x 2 refit below needs their first two rows)
        a00, a01, a02, a11, a12 = A[0][0], A[0][1], A[0][2], A[1][1], A[1][2]
        b0, b1 = b[0], b[1]
        theta = solve3(A, b)
        if theta is None:  # singular
            return
        v_max = max(self.max_scale * v0, self.plain_typ)
        v = min(max(float(theta[2]), v0 / self.max_scale), v_max)
        if v != theta[2]:
            # v at a bound: theta_target and theta_verify refitted given it. Clamped alone,
            # the tokens' scale kept what the unbounded v had traded it for: at batch 16 on
            # SGLang's CPU runtime the fit's v fell below its floor, theta_verify rose to
            # ~1.4 with it, and the floor then priced 16 verified tokens at 35 ms against
            # 14-23 measured (2026-12-07, price_replay; refitted 19-23 ms)
            det = a00 * a11 - a01 * a01
            if det > 0.0:
                r0, r1 = b0 - a02 * v, b1 - a12 * v
                theta = [(r0 * a11 - a01 * r1) / det, (a00 * r1 - a01 * r0) / det, v]
        # theta_target and theta_verify each clamped on its own, not refitted given the
        # other's bounds: with theta_target at its bound (a rough estimate more than
        # max_scale off), a refit would move the decode forward's misfit into v; clamped
        # alone, v stays the verify path's price over a decode forward, the difference the
        # plan weighs
        self.theta_target = self._bound(float(theta[0]))
        self.theta_verify = min(max(float(theta[1]), self.max_scale ** -2), self.max_scale ** 2)
        self.verify_fixed = v

    def _anchor_means(self, x: tuple[float, float, float], y: float,
                      v0: float) -> tuple[float, float, float]:
        """The slow fit's (theta_target, theta_verify, v) after this step: the windowed
        fit's prior means. Its own priors are the profile's, weighted as the windowed fit's
        are but fading at `anchor`, so over a pause of ~1 / (1 - forget) steps the windowed
        fit returns to what the run measured, not to the profile; over one of
        ~1 / (1 - anchor) steps both return to the profile. Bounded as the scales are."""
        fa = self.anchor
        S, Sy = self.slow, self.slow_y
        for i in range(3):
            row = S[i]
            for j in range(3):
                row[j] = fa * row[j] + x[i] * x[j]
            Sy[i] = fa * Sy[i] + x[i] * y
        self.slow_n = fa * self.slow_n + 1.0
        self.slow_tt = fa * self.slow_tt + (x[0] + x[1]) ** 2
        self.slow_n_verify = fa * self.slow_n_verify + (1.0 if x[2] > 0.0 else 0.0)
        w = self.slow_prior_left + self.ridge
        lam = w * self.slow_tt / self.slow_n
        wv = max(self.slow_prior_left, self.prior_weight - self.slow_n_verify) + self.ridge
        prior_w = (lam, wv * self.tok2 if self.tok2 > 0.0 else lam, wv)
        A = [[S[i][j] + (prior_w[i] if i == j else 0.0) for j in range(3)] for i in range(3)]
        b = [Sy[i] + prior_w[i] * p for i, p in enumerate((1.0, 1.0, v0))]
        theta = solve3(A, b)
        if theta is None:
            return 1.0, 1.0, v0
        v_max = max(self.max_scale * v0, self.plain_typ)
        return (self._bound(float(theta[0])),
                min(max(float(theta[1]), self.max_scale ** -2), self.max_scale ** 2),
                min(max(float(theta[2]), v0 / self.max_scale), v_max))

    def _observe_draft(self, draft: float, measured_draft: float | None) -> tuple[float, float]:
        """Fade every sum by one step and fit theta_draft on this step's drafting. Returns
        the prior's weight now and the step's draft seconds: measured (clipped), or at the
        scale so far where not measured."""
        f = self.forget
        self.prior_left *= f
        w = self.prior_left + self.ridge
        self.sdd *= f
        self.sdm *= f
        fa = self.anchor
        self.slow_prior_left *= fa
        self.slow_dd *= fa
        self.slow_dm *= fa
        self.slow_n_draft *= fa
        if draft > 0.0 and measured_draft is not None and measured_draft > 0.0:
            m_draft = self._clipped(measured_draft, self.theta_draft * draft)
            self.sdd += draft * draft
            self.sdm += draft * m_draft
            self.d2 = self._typical(self.d2, draft * draft)
            self.n_draft = f * self.n_draft + 1.0
            if fa:
                self.slow_dd += draft * draft
                self.slow_dm += draft * m_draft
                self.slow_n_draft += 1.0
        else:
            m_draft = self.theta_draft * draft
            self.n_draft *= f
        if self.d2 > 0.0:
            lam = self._prior_for(self.n_draft) * self.d2
            mean = 1.0
            if fa:  # the slow ratio fit's scale, its prior the profile's
                lam_s = (max(self.slow_prior_left, self.prior_weight - self.slow_n_draft)
                         + self.ridge) * self.d2
                mean = self._bound((self.slow_dm + lam_s) / (self.slow_dd + lam_s))
            self.theta_draft = self._bound((self.sdm + lam * mean) / (self.sdd + lam))
        return w, m_draft

    def _prior_for(self, n: float) -> float:
        """The prior's pseudo-steps (ridge included) of a feature whose steps' faded count
        is n: the fading prior, or what n falls short of prior_weight by."""
        return max(self.prior_left, self.prior_weight - n) + self.ridge

    def _typical(self, mean: float, x: float) -> float:
        return x if mean == 0.0 else mean + (1.0 - self.forget) * (x - mean)

    def _bound(self, x: float) -> float:
        return min(max(x, 1.0 / self.max_scale), self.max_scale)


class BatchCorrections:
    """One StepCostCorrection per band of decode batch sizes ({1}, {2..7}, {8..31},
    {32..127}, ...: log2(batch) rounded to an even number), each made by `make` the first
    time its band runs and kept while other bands run. The fit follows the operating point
    through its window, but a window learnt at one batch size prices another for its length:
    after a minute at batch 1, where SGLang's CPU verify path costs ~20 ms over a decode
    forward, batch 16 (where it costs next to nothing) was priced with it and drafted
    nothing for 86-107 steps while it faded, in both SPECSERVE modes (2026-12-07,
    BENCHMARKS.md). A band's own fit starts at the profile and keeps what it learnt there."""

    def __init__(self, make: Callable[[], StepCostCorrection]) -> None:
        self._make = make
        self._bands: dict[int, StepCostCorrection] = {}
        self.last = self.for_batch(1)  # the band a step priced or observed last

    @staticmethod
    def band(batch: int) -> int:
        return int(math.floor(math.log2(max(batch, 1)) / 2.0 + 0.5))

    def for_batch(self, batch: int) -> StepCostCorrection:
        """The correction of `batch`'s band (made on its first use), now `last`."""
        b = self.band(batch)
        corr = self._bands.get(b)
        if corr is None:
            corr = self._bands[b] = self._make()
        self.last = corr
        return corr


def solve3(A: list[list[float]], b: list[float]) -> list[float] | None:
    """x with A x = b for a 3 x 3 A ([3][3], [3] Python floats; both overwritten), by
    Gaussian elimination with partial pivoting; None when A is singular (a zero pivot)."""
    for c in range(3):
        p = max(range(c, 3), key=lambda r: abs(A[r][c]))
        if A[p][c] == 0.0:
            return None
        if p != c:
            A[c], A[p] = A[p], A[c]
            b[c], b[p] = b[p], b[c]
        piv = A[c]
        for r in range(c + 1, 3):
            m = A[r][c] / piv[c]
            if m != 0.0:
                row = A[r]
                for k in range(c, 3):
                    row[k] -= m * piv[k]
                b[r] -= m * b[c]
    x = [0.0, 0.0, 0.0]
    for r in (2, 1, 0):
        acc = b[r]
        for k in range(r + 1, 3):
            acc -= A[r][k] * x[k]
        x[r] = acc / A[r][r]
    return x
