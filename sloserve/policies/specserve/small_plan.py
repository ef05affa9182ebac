"""A SpecServe step planned on Python floats, for small decode batches.

In the engine every numpy call made after a forward runs on cold caches: ~20-30 us for the
first, ~5 us for each further one, against ~1 us warm. A draft round's decision (correct
with the real confidences, then pick who drafts the next position: plan.py) is ~25 such
calls, so at batch 4 on the built-in CPU pair the controller took ~3% of every step, about
all of the gap between `specserve` and the best fixed k. Over a few requests plain Python
loops are cheaper cold; this plan does the same arithmetic in the same order as
`SpecServePlan` (the same floats, hence the same decisions;
tests/controller/test_small_rounds.py runs both side by side) with three or four numpy
calls a round. The policy uses it for batches of at most SpecServeOptions.small_batch.

State (lists of Python floats, one entry per request; P stays the numpy array of plan.py):
    pred_l   the predicted acceptance of the next draft token (plan.py's `pred`)
    first_l  what a first round is planned at (`first`); seen_l: tokens absorbed (`seen`)
    p_last_l the chain probability of the last drafted position (`p_last`)
    n_l, lag_l  the StepTimer's context lengths and catch-up tokens (lag_l None: no lag)
    excused_l   the StepTimer's catch-up seconds past their price (None: none)
"""

from __future__ import annotations

import numpy as np

from sloserve.policies.specserve.options import COLLAPSE, SEEN_CAP
from sloserve.policies.specserve.plan import SpecServePlan


class SmallSpecServePlan(SpecServePlan):
    """SpecServePlan's decisions on Python floats: `_prepare`, `_grow`, `_correct`."""

    def _prepare(self) -> None:
        t = self.timer
        self.n_l = t.n.tolist()
        self.lag_l = t.lag.tolist() if t.has_lag else None
        self.excused_l = t.excused.tolist() if t.has_excused else None
        self.pred_l = self.pred.tolist()
        self.first_l = self.first.tolist() if self.first is not self.pred else self.pred_l
        self.seen_l = self.seen.tolist()
        self.p_last_l = [1.0] * self.step.batch_size

    def _first_round(self) -> np.ndarray:
        if self.w is None:
            return self._grow_small(0, self.p_last_l)
        return self._grow_small(0, [p * w for p, w in zip(self.p_last_l, self.w.tolist())])

    def _next_round(self, j: int) -> np.ndarray:
        live = [p >= COLLAPSE for p in self.p_last_l]
        if self.w is None:
            return self._grow_small(j, live)
        return self._grow_small(j, [w if x else 0.0 for x, w in zip(live, self.w.tolist())])

    def predictions(self) -> list[float]:
        return self.pred_l

    def first_predictions(self) -> list[float]:
        return self.first_l

    def observed(self) -> list[float]:
        return self.seen_l

    def mean_prediction(self) -> float:
        return sum(self.pred_l) / self.step.batch_size

    def _cost_row(self, j: int) -> list[float]:
        """Row j of StepTimer.draft_token_costs, operation for operation."""
        d = self.cost.draft
        a, base = d.a, d.b + self.timer.token_time
        aj = a * float(j)
        row = [(a * n + base) + aj for n in self.n_l]
        if j == 0 and self.lag_l is not None:
            row = [c + (d.b - a) * lag for c, lag in zip(row, self.lag_l)]
        if d.b + self.cost.target.b <= 0.0:
            row = [max(c, 1e-12) for c in row]
        return row

    def _prefix_times_small(self, j: int, order: list[int]) -> list[float]:
        """plan.py's `_prefix_times` on Python floats."""
        d = self.cost.draft
        t = self.time + (d.c + (self.timer.step_fixed if self.k_total == 0 else 0.0))
        times = []
        if self.linear:
            cost = self._cost_row(j)
            for i in order:
                t += cost[i]
                times.append(t)
            return times
        a, fj = d.a, float(j)
        lag = self.lag_l if j == 0 else None
        for i in order:
            ctx = a * (self.n_l[i] + fj)
            if lag is not None:
                ctx = ctx - a * lag[i]
            t += ctx
            times.append(t)
        if lag is not None:  # the first forward also feeds the lag tokens
            q = 0.0
            for m, i in enumerate(order):
                q += 1.0 + lag[i]
                times[m] = times[m] + d.b * max(q - d.q0, 0.0)
        else:
            for m in range(len(times)):
                times[m] = times[m] + d.b * max((m + 1.0) - d.q0, 0.0)
        tt = self.timer.token_time
        free = self.timer.free_verify - self.k_total
        if free > 0.0:
            paid_from = tt * free
            for m in range(len(times)):
                times[m] = times[m] + max(tt * (m + 1.0) - paid_from, 0.0)
        else:
            for m in range(len(times)):
                times[m] = times[m] + tt * (m + 1.0)
        return times

    def _grow_small(self, j: int, weight: list) -> np.ndarray:
        """plan.py's `_grow` on Python floats: [B] bool, who drafts position j + 1."""
        p_last = self.p_last_l
        pred = self.first_l if j == 0 else self.pred_l
        B = len(pred)
        gain = [p_last[i] * pred[i] * weight[i] for i in range(B)]
        cost = self._cost_row(j)
        ratio = [g / c for g, c in zip(gain, cost)]
        # numpy's stable ascending argsort, reversed (ties: the higher index first)
        order = sorted(range(B), key=ratio.__getitem__)[::-1]
        tokens = []
        acc = self.tokens
        for i in order:
            acc += gain[i]
            tokens.append(acc)
        time = self._prefix_times_small(j, order)
        opts = self.inputs.options
        margin = 1.0 + opts.start_margin if j == 0 else 1.0
        un = self.unscored
        score = [tk / (tm - un) for tk, tm in zip(tokens, time)]
        current = self.tokens / (self.time - un) * margin
        limit = self._prefix_limits_small(order) if j == 0 and self.split_limits is not None \
            else None
        held, hidden = time, None
        if j == 0 and self.excused_l is not None:  # plan.py's prefix sums of excused
            hidden, acc = [], 0.0
            for i in order:
                acc += self.excused_l[i]
                hidden.append(acc)
            held = [tm + h for tm, h in zip(time, hidden)]
        if limit is not None:
            score = [-np.inf if tm > lim else s for s, tm, lim in zip(score, held, limit)]
        elif self.slo < float("inf"):
            score = [-np.inf if tm > self.slo else s for s, tm in zip(score, held)]
        best = 0
        for m in range(1, B):
            if score[m] > score[best]:
                best = m
        if opts.uniform_margin:
            full = sum(1 for g in gain if g != 0.0) - 1
            if full > best and score[full] * (1.0 + opts.uniform_margin) >= score[best]:
                best = full
        drafting = np.zeros(B, dtype=bool)
        if limit is not None:  # the rounds after this one: the chosen drafters' limit
            self.slo = limit[best]
        if score[best] <= current:
            chosen = order[: best + 1]
            if not (opts.lookahead and self._pays_later(
                    j, [gain[i] for i in chosen], [pred[i] for i in chosen], tokens[best],
                    time[best], current)):
                return drafting
        drafting[order[: best + 1]] = True
        self.time = time[best]
        self.k_total += best + 1
        if hidden is not None:
            self.slo -= hidden[best]
        return drafting

    def _prefix_limits_small(self, order: list[int]) -> list[float]:
        """plan.py's `_prefix_limits` on Python floats."""
        assert self.split_limits is not None
        drafts, ones = (x.tolist() for x in self.split_limits)
        B = len(order)
        limit = [0.0] * B
        low = float("inf")
        for m, i in enumerate(order):
            low = min(low, drafts[i])
            limit[m] = low
        low = float("inf")
        for m in range(B - 1, 0, -1):  # ones over order[m:], for the prefix ending at m - 1
            low = min(low, ones[order[m]])
            limit[m - 1] = min(limit[m - 1], low)
        return limit

    def _correct(self, j: int, conf: np.ndarray, drafting: np.ndarray) -> None:
        """plan.py's `_correct` on Python floats (the calibration map stays numpy's)."""
        acc = self.inputs.g(np.fmax(conf, 0.0)).tolist()  # g(c); NaN (not drafted) -> g(0)
        drafted = drafting.tolist()
        p_last, pred, ema = self.p_last_l, self.pred_l, self.inputs.options.ema
        p = [p_last[i] * acc[i] * drafted[i] for i in range(len(acc))]
        self.p_last_l = p
        np.copyto(self.P[j - 1], p, where=drafting)
        total = 0.0
        for x in p:
            total += x
        self.tokens += total
        seen = self.seen_l
        for i, d in enumerate(drafted):
            if d:  # plan.py's weight max(ema, 1 / (seen + 2)), in its order of operations
                pred[i] = pred[i] + (acc[i] - pred[i]) * max(ema, 1.0 / (seen[i] + 2.0))
                if seen[i] < SEEN_CAP:
                    seen[i] = seen[i] + 1.0
