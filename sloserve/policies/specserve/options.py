"""The SpecServe policy's settings: one frozen value, built once (docs/design.md sec. 5)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

# Fixed rules (not settings): a request whose chain probability falls below COLLAPSE (at most
# 1 in 20 chances the next token is even reached) leaves the draft batch; the prior of new
# requests follows the batch's mean prediction with weight PRIOR_EMA per step; verify
# outcomes are counted into the calibration map CALIBRATE_EVERY steps at a time (the first
# numpy call after a forward runs on cold caches, the next ones warm).
COLLAPSE = 0.05
PRIOR_EMA = 0.05
# Without confidences a request's prediction learns from 0/1 outcomes, far noisier than
# g(c): a weight of 0.3 let one rejection cut a 0.9 prediction to 0.63; 0.1 averages ~10.
COUNT_EMA = 0.1
CALIBRATE_EVERY = 8
# a request's own draft tokens counted towards its prediction's weights (1 / (n + 1) for
# the n-th, the running prior counting as one, until below `ema`): a few are enough
SEEN_CAP = 8.0
# the weight of each verifying step's batch size in where the verified-token scale was
# learnt (policy.py, _current_prices): ~10 steps
VERIFY_BATCH_EMA = 0.1
SMALL_BATCH = 8
# the calibration samples (seeded ones included) the pooled acceptance needs before paused
# requests' predictions move towards it (pause_relax)
RELAX_SAMPLES = 32.0


@dataclass(frozen=True)
class SpecServeOptions:
    """Every option has its measured reason in docs/design.md; the defaults are what runs."""

    ema: float = 0.3  # weight of the newest draft token in a request's EMA of g(c)
    # the running prior's start (a new request's prediction), and the least a request's
    # first draft round is planned at until one of its own drafts is seen (policy.py)
    prior: float = 0.6
    # speculation starts only if its predicted E beats plain decoding by this fraction
    start_margin: float = 0.0
    # a strict subset of the candidates drafts (a tail is trimmed) only if it raises E by
    # more than this fraction over the uniform choice
    uniform_margin: float = 0.06
    # a draft round that does not raise E by itself still runs if the same requests drafting
    # on at their predictions would (the verify path's once-a-step cost and the draft
    # forward's fixed cost make a first round dearer than the ones after it). Off: on
    # SGLang's CPU engine with the real pair it drafted 8x the rounds at C = 16 and lost
    # 9% / 6% to the plan without it at C = 4 / 16 (+7% at C = 1; BENCHMARKS.md,
    # 2026-12-02): the predictions it extrapolates are too optimistic for the rounds it adds
    lookahead: bool = False
    # the SLO guard: plans are held to SLO / (the worst measured / predicted step time of
    # the last `overrun_window` steps), assumed `initial_overrun` until measured
    overrun_window: int = 1024
    initial_overrun: float = 2.0
    # specserve-slo prices its budgets' plain step and divides its plans' limits by the
    # guard's mean overrun, not its worst (slo_policy.py `slo_scale`): its rule is one of
    # expectation, corrected by each request's clock. Off (the worst, as specserve): side by
    # side in SGLang's load sweep on the 2-core EPYC (the worst at the 2x clip, the mean at
    # 1.02 in most steps) it moved the batch bands' draft shares by a few points and the
    # goodput by +20 / -16 / -6 / -5% at 0.3 / 0.6 / 1 / 1.5x, -1.9% by the loads' mean,
    # each within the seeds' range (docs/design.md sec. 14, BENCHMARKS.md 2026-12-08)
    mean_guard: bool = False
    # catch-up tokens priced per request when no TPOT SLO binds (None: all of them)
    lag_cap: float | None = 1.0
    # price the catch-up of a paused request in full less what it forwent by not drafting
    # (its credit: each step it did not draft adds the seconds its next draft token would
    # have saved), never below lag_cap's price: a pause ends once the gains it missed
    # cover the catch-up (a ski-rental rule). Off: lag_cap alone, the catch-up unpriced
    # past it, and a batch that drafts once in a while pays every request's catch-up
    # each time (SGLang's CPU engine at C = 16: 2% of steps, each 190 ms over a decode
    # step, BENCHMARKS.md 2026-12-03)
    lag_credit: bool = True
    # each step a request measured before does not draft, its prediction moves this share
    # of the way to the pair's pooled acceptance (the calibration map's accepted / counted
    # samples): what it was last measured at ages. 0: it keeps the prediction it paused
    # at, and a pause on a chain's low-confidence tail lasted the request's life (SGLang,
    # the distilled draft at C = 1: 74% of steps drafted nothing where a draft token was
    # accepted at 0.54 on average; BENCHMARKS.md 2026-12-04)
    pause_relax: float = 0.05
    # a first draft round is planned at the request's own estimate of a step's first draft
    # token (the g(c) of its steps' first tokens, policy.py `_learn_first`). Off: at pred,
    # its EMA over every draft token, which ends each step on the token its chain stopped
    # on (a low one, by the stopping rule) and so under-predicts the next first token
    first_estimate: bool = True
    correct_cost: bool = True  # correct the profile online from measured step times
    # a step's measured seconds count at most this many times, and at least its inverse,
    # the correction's prediction (online_cost.py `clip`): a GC pause or a preempted step
    # must not swing the prices
    price_clip: float = 2.0
    # the forgetting factor of a slow fit of the same prices (online_cost.py `anchor`, ~500
    # steps) whose scales are the windowed fit's priors: over a pause the prices return to
    # what the run measured rather than to the profile. 0: off, the profile's priors. With
    # it, SGLang's per-request mode on the real pair at C = 16 / 4 / 1 ran +3.5% / +8.8% /
    # +4.6% over the same server without (2-core AMX Xeon, 2026-12-07, BENCHMARKS.md): at
    # batch 4 the window had priced the verify path at 18 ms against 7 anchored
    price_anchor: float = 0.998
    # specserve-slo: a request whose budget this step is below the plain step and its stall
    # (it meets its SLO only with more than one token a step) counts its expected draft
    # tokens slo_weight times in the plan's objective (budgets.token_weights), so
    # speculation that costs the batch a few tokens a second but keeps those requests on
    # their SLOs is taken (AdaServe's SLO-customised selection, in SpecServe's objective);
    # the plan's tokens, its step limits and the elimination stay unweighted. 0 or 1: off.
    # On: in SGLang's load sweep on the 2-core EPYC, side by side with off, +4.6% by the mean
    # of the four loads' paired means, each inside its seeds' range (docs/design.md sec. 14,
    # BENCHMARKS.md 2026-12-07)
    slo_weight: float = 2.0
    score_prefill: bool = False  # True: the paper's E over the whole step, prefill included
    small_batch: int = SMALL_BATCH  # at most this many requests: plans on Python floats

    def __post_init__(self) -> None:
        if not 0.0 < self.ema <= 1.0:
            raise ValueError(f"ema must be in (0, 1], got {self.ema}")
        if not 0.0 <= self.prior <= 1.0:
            raise ValueError(f"prior must be in [0, 1], got {self.prior}")
        if not 0.0 <= self.pause_relax <= 1.0:
            raise ValueError(f"pause_relax must be in [0, 1], got {self.pause_relax}")
        if not self.price_clip > 1.0:
            raise ValueError(f"price_clip must be > 1, got {self.price_clip}")
        if not (self.price_anchor == 0.0 or 0.98 <= self.price_anchor <= 1.0):
            raise ValueError(f"price_anchor must be 0 (off) or in [0.98, 1], got "
                             f"{self.price_anchor}")
        if not (self.slo_weight == 0.0 or self.slo_weight >= 1.0):
            raise ValueError(f"slo_weight must be 0 (off) or >= 1, got {self.slo_weight}")
        if self.overrun_window < 1 or self.initial_overrun < 1.0:
            raise ValueError("overrun_window must be >= 1 and initial_overrun >= 1")


def parse_options(pairs: Sequence[tuple[str, str]]) -> SpecServeOptions:
    """SpecServeOptions from (name, value) text pairs: values typed like the fields'
    defaults, `none` where a field may be None; ValueError naming the field otherwise."""
    fields = {f.name: f for f in dataclasses.fields(SpecServeOptions)}
    out: dict[str, Any] = {}
    for name, value in pairs:
        if name not in fields:
            raise ValueError(f"unknown policy option {name!r}; valid: {', '.join(fields)}")
        default: Any = fields[name].default  # every option has a default
        v = value.strip().lower()
        try:
            if v == "none" and "None" in str(fields[name].type):
                out[name] = None
            elif isinstance(default, bool):
                out[name] = {"true": True, "1": True, "false": False, "0": False}[v]
            else:
                out[name] = type(default)(value)  # int or float
        except (KeyError, ValueError):
            raise ValueError(f"bad value for policy option {name}: {value!r}") from None
    return SpecServeOptions(**out)  # its own range checks
