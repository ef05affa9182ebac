"""Per-request TPOT budgets of one step: SpecServe's SLO rule made per request
(docs/design.md sec. 4 and 14).

SpecServe holds every speculative step to the tightest TPOT SLO in the batch: any request may
accept nothing and get one token, so its TPOT for the step is the step time. Measured over a
whole request, though, TPOT is (decode seconds) / (decode tokens), so a request that has run
ahead of its SLO (slack = s * tokens - elapsed > 0, request_clock.py) can absorb a longer step
and still finish within it. Request r's budget this step is

    budget_r = s_r + share * slack_r     (slack_r >= 0: spend a share of what was saved)
    budget_r = s_r + slack_r             (slack_r < 0: the step that puts it back on its SLO)

the longest step after which its running TPOT stays within s_r even if the step gives it one
token. A request whose budget is below the plain step (k = 0 for all) cannot be kept by any
plan this step; holding the batch to it, as SpecServe does, only turns speculation off for
everyone while that request misses anyway. Its budget is the plain step instead: what
speculation can still do for it is add expected tokens (a request whose SLO is below the
plain step time meets it only that way), and held to plain decoding's pace in expectation
(the allowance below) no step takes its tokens slower than plain decoding would. Letting it
bind nothing, as this rule first did, let the others' allowances set steps that put the
requests just behind their SLO further behind (SGLang's load sweep on the real pair at 1.5x
plain's capacity, where the tight class's SLO is a few ms above plain decoding's pace:
docs/design.md sec. 14).

A speculative step gives a request more than one token in expectation: with predicted
acceptance a_r at least 1 + a_r for any k >= 1 (the first draft token is accepted with
probability a_r, later ones only add). The step a binding request allows is therefore
budget_r * (1 + a_r): its expected TPOT over the step stays within budget_r, and the running
slack above corrects for the luck of the draw on the next steps. Holding every speculative
step to the one-token worst case instead cost 6-17% goodput against fixed k on the load
sweep (BENCHMARKS.md, issue #20). The step is held to the smallest remaining allowance; the
rest of the plan maximises tokens per second as SpecServe does.

A request's TPOT counts the wall time between its steps, not only theirs: an engine that
runs new requests' prefills as forwards of their own (SGLang) stalls every decoding request
for them. With `stall` seconds a step brings on average (request_clock.StepStalls), the step
and its stall share the budget: the allowance is budget_r * (1 + a_r) - stall, and the
budget's floor is the plain step and its stall.
"""

from __future__ import annotations

import numpy as np

SLACK_SHARE = 0.5  # share of a request's saved seconds one step may spend


def step_budgets(tpot_slo: np.ndarray, slack: np.ndarray, plain_time: float,
                 share: float = SLACK_SHARE, stall: float = 0.0) -> np.ndarray:
    """[B] seconds of TPOT each request allows this step, its stall included, at least the
    plain step's (inf: no SLO, binds nothing).

    tpot_slo, slack: [B] seconds (inf where no SLO); plain_time: the step's time without
    speculation, already scaled by the SLO guard; stall: seconds the engine adds to a step on
    average (module docstring)."""
    slo = np.asarray(tpot_slo, dtype=np.float64)
    slack = np.asarray(slack, dtype=np.float64)
    with np.errstate(invalid="ignore"):  # inf - inf where no SLO: replaced below
        budget = slo + np.where(slack > 0.0, share * slack, slack)
    budget[~np.isfinite(slo)] = np.inf
    # no plan keeps it this step: held to plain decoding's pace (the module docstring)
    return np.maximum(budget, plain_time + stall)


def token_weights(tpot_slo: np.ndarray, slack: np.ndarray, plain_time: float,
                  cap: float, share: float = SLACK_SHARE, stall: float = 0.0) -> np.ndarray:
    """[B] >= 1: how much each request's expected draft tokens count in the plan's objective.
    A request whose budget (step_budgets' before its floor) is below the plain step and its
    stall meets its SLO only with more than one token a step: its tokens count `cap` times;
    the others, and requests without an SLO, once. A step, not the ratio (plain + stall) /
    budget: a request just on its SLO, whose ratio is ~1.3 where the SLO is a few ms above
    plain decoding's pace, needs its draft tokens as much as one far behind (each step
    without them puts it further behind), and a ratio that small did not take the draft
    round its catch-up made dear (SGLang's load sweep, docs/design.md sec. 14). Arguments as
    step_budgets'."""
    slo = np.asarray(tpot_slo, dtype=np.float64)
    slack = np.asarray(slack, dtype=np.float64)
    finite = np.isfinite(slo)
    raw = np.where(finite, slo, 0.0) + np.where(slack > 0.0, share * slack,
                                                 np.where(finite, slack, 0.0))
    return np.where(finite & (raw < plain_time + stall), max(cap, 1.0), 1.0)


def expected_allowance(budget: np.ndarray, acceptance: np.ndarray, stall: float = 0.0,
                       slack: np.ndarray | None = None, floor: float = 0.0) -> np.ndarray:
    """[B] the step time each request allows a speculative step: budget_r * (1 + a_r) -
    stall, the step after which (with its stall) its expected TPOT is within budget_r (module
    docstring). With `slack` ([B] seconds) the part past budget_r, budget_r * a_r, is capped
    by what the request has saved: a step that gives it one token after all then costs its
    slack, not its SLO; a request at the `floor` (no plan keeps it) keeps all of it.

    budget: [B] seconds from step_budgets (inf: binds nothing); acceptance: [B] predicted
    acceptance of the request's next draft token, in [0, 1]; stall: as step_budgets'."""
    a = np.clip(np.asarray(acceptance, dtype=np.float64), 0.0, 1.0)
    budget = np.asarray(budget, dtype=np.float64)
    finite = np.isfinite(budget)
    extra = np.where(finite, budget, 0.0) * a
    if slack is not None:
        saved = np.maximum(np.asarray(slack, dtype=np.float64), 0.0)
        extra = np.where(budget > floor, np.minimum(extra, saved), extra)
    return np.where(finite, budget + extra - stall, np.inf)
