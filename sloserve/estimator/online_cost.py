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

Each is an exponentially weighted least-squares fit (forgetting factor `forget`: an
effective window of 1 / (1 - forget) steps; every step fades every sum) with a prior at 1,
scaled to the features' typical magnitudes: `prior_weight` pseudo-steps that fade like the
samples (the fit starts at the profile and moves as evidence comes) on top of `ridge`
pseudo-steps that stay. The ridge biases a scale with steady evidence by
~ridge * (1 - forget), 0.5% by default; a scale whose evidence stops (theta_draft while
speculation is off) returns to the profile within a few hundred steps, so a pessimistic
price learned from a few slow steps cannot turn speculation off for good. A sample more
than `clip` times off the current prediction is clipped to that ratio (a GC pause or a
preempted step must not swing the fit), and every scale stays in
[1 / max_scale, max_scale].
"""

from __future__ import annotations


class StepCostCorrection:
    def __init__(self, forget: float = 0.98, prior_weight: float = 8.0, ridge: float = 0.25,
                 clip: float = 2.0, max_scale: float = 2.0) -> None:
        if not 0.0 < forget <= 1.0:
            raise ValueError(f"forget must be in (0, 1], got {forget}")
        self.forget = forget
        self.prior_left = prior_weight  # the fading prior's pseudo-steps
        self.ridge = ridge
        self.clip = clip
        self.max_scale = max_scale
        self.theta_target = self.theta_draft = 1.0
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
                overhead: float = 0.0) -> None:
        """One step: its profiled target seconds (the target forward, or without
        `measured_target` the whole step outside drafting, overhead included), its profiled
        draft seconds, its measured seconds and the measured seconds of its drafting (None:
        not measured, taken at the current scale). measured_target: the measured seconds of
        its target forward; `overhead`, the profiled seconds outside the forwards, is then
        the prior of `self.overhead`."""
        if target <= 0.0 or measured <= 0.0 or draft < 0.0:
            return
        w, m_draft = self._observe_draft(draft, measured_draft)
        f = self.forget
        if measured_target is not None and measured_target > 0.0:
            y = self._clipped(measured_target, self.theta_target * target)
            self.stt = f * self.stt + target * target
            self.stm = f * self.stm + target * y
            self.n_target = f * self.n_target + 1.0
            lam = w * self.stt / self.n_target
            self.theta_target = self._bound((self.stm + lam) / (self.stt + lam))
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
        self.theta_target = self._bound((self.sxy + lam) / (self.sxx + lam))

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
