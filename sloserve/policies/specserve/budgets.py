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
everyone while that request misses anyway. It binds nothing (inf): what speculation can
still do for it is add expected tokens, and a request whose SLO is below the plain step time
meets it only that way.

A speculative step gives a request more than one token in expectation: with predicted
acceptance a_r at least 1 + a_r for any k >= 1 (the first draft token is accepted with
probability a_r, later ones only add). The step a binding request allows is therefore
budget_r * (1 + a_r): its expected TPOT over the step stays within budget_r, and the running
slack above corrects for the luck of the draw on the next steps. Holding every speculative
step to the one-token worst case instead cost 6-17% goodput against fixed k on the load
sweep (BENCHMARKS.md, issue #20). The step is held to the smallest remaining allowance; the
rest of the plan maximises tokens per second as SpecServe does.
"""

from __future__ import annotations

import numpy as np

SLACK_SHARE = 0.5  # share of a request's saved seconds one step may spend


def step_budgets(tpot_slo: np.ndarray, slack: np.ndarray, plain_time: float,
                 share: float = SLACK_SHARE) -> np.ndarray:
    """[B] seconds each request allows this step (inf: binds nothing).

    tpot_slo, slack: [B] seconds (inf where no SLO); plain_time: the step's time without
    speculation, already scaled by the SLO guard."""
    slo = np.asarray(tpot_slo, dtype=np.float64)
    slack = np.asarray(slack, dtype=np.float64)
    with np.errstate(invalid="ignore"):  # inf - inf where no SLO: replaced below
        budget = slo + np.where(slack > 0.0, share * slack, slack)
    budget[~np.isfinite(slo)] = np.inf
    budget[budget < plain_time] = np.inf  # no plan keeps it: it binds nothing
    return budget


def expected_allowance(budget: np.ndarray, acceptance: np.ndarray) -> np.ndarray:
    """[B] the step time each request allows a speculative step: budget_r * (1 + a_r), the
    step after which its expected TPOT is within budget_r (module docstring).

    budget: [B] seconds from step_budgets (inf: binds nothing); acceptance: [B] predicted
    acceptance of the request's next draft token, in [0, 1]."""
    a = np.clip(np.asarray(acceptance, dtype=np.float64), 0.0, 1.0)
    return np.asarray(budget, dtype=np.float64) * (1.0 + a)
