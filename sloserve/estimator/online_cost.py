"""Online correction of the profiled step time from the engine's measured step times.

The offline profile times each model's forwards in isolation. Inside the engine a step also
pays what that cannot see: caches cold after the other model's forward, ragged padding of
verify segments, the controller's own calls between draft forwards; and this machine's
speed drifts. Measured on the built-in CPU pair at batch 4 (2026-11-22): plain steps ran 8%
faster than the profile said, speculative steps 2-12% slower, so the profile put the price
of speculation ~20% too low relative to plain decoding, and the controller speculated where
fixed small k or plain decoding did better.

A step's profiled time splits into `plain` (the step without speculation), `draft` (its draft
forwards) and `verify` (what its verified draft tokens add to the target forward), each
corrected by its own scale:

    measured draft time        = theta_draft * draft
    measured step - draft time = theta_plain * plain + theta_verify * verify

The engine measures the drafting loop on its own, so theta_draft is a ratio fit and the
other two a two-feature fit, or with `tie_verify` one scale for both (a ratio fit on plain +
verify). The SpecServe drafter ties them: plain and verify time move together, so apart
they were poorly identified (theta_verify ended anywhere in [0.5, 2], often at a bound, on
the built-in pair) and mispriced verify tokens; tied, the profile's relative price of a
verified token stands and the scale follows the machine (closed loop at batch 4-32, same
run: 0.1-1.8 points closer to the best fixed k, BENCHMARKS.md).

Each is an exponentially weighted least-squares fit (forgetting factor `forget`: an
effective window of 1 / (1 - forget) steps; every step fades every sum) with a prior at 1,
scaled to the features' typical magnitudes: `prior_weight` pseudo-steps that fade like the
samples (the fit starts at the profile and moves as evidence comes) on top of `ridge`
pseudo-steps that stay. The ridge biases a scale with steady evidence by
~ridge * (1 - forget), 0.5% by default; a scale whose evidence stops (theta_draft and
theta_verify while speculation is off) returns to the profile within a few hundred steps,
so a pessimistic price learned from a few slow steps cannot turn speculation off for good.
A sample more than `clip` times off the current prediction is clipped to that ratio (a GC
pause or a preempted step must not swing the fit), and every scale stays in
[1 / max_scale, max_scale].
"""

from __future__ import annotations


class StepCostCorrection:
    def __init__(self, forget: float = 0.98, prior_weight: float = 8.0, ridge: float = 0.25,
                 clip: float = 2.0, max_scale: float = 2.0, tie_verify: bool = False) -> None:
        if not 0.0 < forget <= 1.0:
            raise ValueError(f"forget must be in (0, 1], got {forget}")
        self.forget = forget
        self.prior_left = prior_weight  # the fading prior's pseudo-steps
        self.ridge = ridge
        self.clip = clip
        self.max_scale = max_scale
        self.tie_verify = tie_verify  # one scale for plain and verify (a one-feature fit)
        # exponentially weighted sums: x = (plain, verify), y = measured step - draft time;
        # d = draft, m = measured draft time
        self.spp = self.spv = self.svv = 0.0
        self.spy = self.svy = 0.0
        self.sdd = self.sdm = 0.0
        self.n = 0.0  # weighted sample count
        # typical squares of draft and verify over the samples that had them (they do not
        # fade while speculation is off, so the prior takes over again)
        self.d2 = self.v2 = 0.0
        self.theta_plain = self.theta_draft = self.theta_verify = 1.0
        # with the target forward measured (observe's measured_target): its sums, and the
        # step's seconds outside both models' forwards, an exponentially weighted mean
        self.stt = self.stm = self.srest = 0.0
        self.n_target = 0.0
        self.overhead: float | None = None  # None until a step measured it

    @property
    def theta(self) -> tuple[float, float, float]:
        """(theta_plain, theta_draft, theta_verify)."""
        return self.theta_plain, self.theta_draft, self.theta_verify

    def _clipped(self, measured: float, predicted: float) -> float:
        return min(max(measured, predicted / self.clip), predicted * self.clip)

    def observe(self, plain: float, draft: float, verify: float, measured: float,
                measured_draft: float | None = None, measured_target: float | None = None,
                overhead: float = 0.0) -> None:
        """One step: its profiled plain, draft and verify seconds, its measured seconds and
        the measured seconds of its drafting (None: not measured, taken as predicted).

        measured_target: the measured seconds of the step's target forward. Given it (and
        the profiled `overhead` outside the forwards, the prior of `self.overhead`), `plain`
        is the target forward's part only and one scale is fitted to the target forward
        alone (a ratio fit on plain + verify), while the rest of the step, measured - draft
        - target, is tracked as `self.overhead`: the engine's own per-step work (sampling,
        commit, detokenizing: ~1.4 ms a step at batch 32 on the built-in CPU pair) then
        no longer inflates the price of a verified token."""
        if plain <= 0.0 or measured <= 0.0 or draft < 0.0 or verify < 0.0:
            return
        if measured_target is not None and measured_target > 0.0:
            self._observe_target(plain, draft, verify, measured, measured_draft,
                                 measured_target, overhead)
            return
        w, m_draft = self._observe_draft(draft, measured_draft)
        f = self.forget
        y = self._clipped(measured - m_draft,
                          self.theta_plain * plain + self.theta_verify * verify)
        if verify > 0.0:
            self.v2 = self._typical(self.v2, verify * verify)
        self.spp = f * self.spp + plain * plain
        self.spv = f * self.spv + plain * verify
        self.svv = f * self.svv + verify * verify
        self.spy = f * self.spy + plain * y
        self.svy = f * self.svy + verify * y
        self.n = f * self.n + 1.0
        self._solve(w)

    def _observe_target(self, plain: float, draft: float, verify: float, measured: float,
                        measured_draft: float | None, measured_target: float,
                        overhead: float) -> None:
        w, m_draft = self._observe_draft(draft, measured_draft)
        f = self.forget
        x = plain + verify  # profiled seconds of the target forward
        y = self._clipped(measured_target, self.theta_verify * x)
        self.stt = f * self.stt + x * x
        self.stm = f * self.stm + x * y
        self.n_target = f * self.n_target + 1.0
        lam = w * self.stt / self.n_target
        self.theta_plain = self.theta_verify = self._bound((self.stm + lam) / (self.stt + lam))
        # the rest: an exponentially weighted mean with the same fading prior as the scales
        # (the profile's overhead until measured steps outweigh it)
        self.srest = f * self.srest + max(0.0, measured - m_draft - measured_target)
        self.overhead = (self.srest + w * overhead) / (self.n_target + w)

    def _observe_draft(self, draft: float, measured_draft: float | None) -> tuple[float, float]:
        """Fade every sum by one step and fit theta_draft on this step's drafting. Returns
        the prior's weight now and the step's draft seconds: measured (clipped), or at the
        scale so far where not measured."""
        f = self.forget
        self.prior_left *= f
        w = self.prior_left + self.ridge
        self.sdd *= f
        self.sdm *= f
        if draft > 0.0 and measured_draft is not None and measured_draft > 0.0:
            m_draft = self._clipped(measured_draft, self.theta_draft * draft)
            self.sdd += draft * draft
            self.sdm += draft * m_draft
            self.d2 = self._typical(self.d2, draft * draft)
        else:
            m_draft = self.theta_draft * draft
        if self.d2 > 0.0:
            lam = w * self.d2
            self.theta_draft = self._bound((self.sdm + lam) / (self.sdd + lam))
        return w, m_draft

    def _typical(self, mean: float, x: float) -> float:
        return x if mean == 0.0 else mean + (1.0 - self.forget) * (x - mean)

    def _bound(self, x: float) -> float:
        return min(max(x, 1.0 / self.max_scale), self.max_scale)

    def _solve(self, w: float) -> None:
        if self.tie_verify:  # y = theta * (plain + verify): the sums of x = plain + verify
            sxx = self.spp + 2.0 * self.spv + self.svv
            lam = w * sxx / self.n
            self.theta_plain = self.theta_verify = self._bound(
                (self.spy + self.svy + lam) / (sxx + lam))
            return
        # pull toward (1, 1): w pseudo-steps of each feature's typical square (the plain one
        # stands in for verify until speculation has run)
        lam_p = w * self.spp / self.n
        lam_v = w * (self.v2 if self.v2 > 0.0 else self.spp / self.n)
        a11, a12, a22 = self.spp + lam_p, self.spv, self.svv + lam_v
        b1, b2 = self.spy + lam_p, self.svy + lam_v
        det = a11 * a22 - a12 * a12
        if det <= 0.0:
            return
        self.theta_plain = self._bound((a22 * b1 - a12 * b2) / det)
        self.theta_verify = self._bound((a11 * b2 - a12 * b1) / det)
