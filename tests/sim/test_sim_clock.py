"""The event clock advances by exactly the cost model's step times (hand-computed cases)."""

from __future__ import annotations

import pytest
from sim_cases import COST, cfg, constant_acceptance

from sloserve.sim.engine import SimRequest, Simulator


def fwd(c, n_ctx, n_q):
    return c.a * n_ctx + c.b * n_q + c.c


def test_plain_decoding_clock_and_idle_jump():
    t, o = COST.target, COST.overhead
    sim = Simulator(cfg("ar"), COST)
    reqs = [SimRequest("a", 0.0, 10, 3), SimRequest("b", 5.0, 4, 1)]
    out = sim.run(reqs)
    # a: prefill 10 tokens (attends 10), then decodes attending 11 and 12 KV tokens
    t1 = fwd(t, 10, 10) + o
    t2 = t1 + fwd(t, 11, 1) + o
    t3 = t2 + fwd(t, 12, 1) + o
    assert out[0].chunk_s == pytest.approx([t1, t2, t3], abs=1e-12)
    assert out[0].chunk_tokens == [1, 2, 3]
    # b arrives after a finished: the clock jumps to 5.0; its prefill gives its only token
    assert out[1].chunk_s == pytest.approx([5.0 + fwd(t, 4, 4) + o], abs=1e-12)
    assert sim.stats.steps == 4


def test_speculative_step_prices_draft_rounds_catch_up_and_verify():
    """fixed:2 with every draft accepted: draft catch-up, bonus-token KV bookkeeping."""
    t, d, o = COST.target, COST.draft, COST.overhead
    sim = Simulator(cfg("fixed:2", k_max=4), COST, constant_acceptance(1.0))
    out = sim.run([SimRequest("a", 0.0, 10, 7)])
    # prefill -> token 1, the draft reads the prompt too; num_tokens 11, kv 10, draft kv 10
    t1 = fwd(t, 10, 10) + fwd(d, 10, 10) + o
    # step 2: round 1 feeds the draft the one token it has not seen, round 2 1 draft token;
    # verify 1 + 2 tokens after kv 10; all accepted -> 3 tokens (4 total)
    s2 = fwd(d, 11, 1) + fwd(d, 12, 1) + fwd(t, 13, 3) + o
    # now num_tokens 14, kv 13, draft kv 12: round 1 feeds 2 tokens (last draft + bonus)
    s3 = fwd(d, 14, 2) + fwd(d, 15, 1) + fwd(t, 16, 3) + o  # 3 more tokens (7 total): done
    assert out[0].chunk_s == pytest.approx([t1, t1 + s2, t1 + s2 + s3], abs=1e-12)
    assert out[0].chunk_tokens == [1, 4, 7]
    assert sim.stats.draft_forwards == 4
    assert sim.stats.accepted == 4 and sim.stats.verified == 4


def test_rejections_emit_one_token_and_roll_back():
    """Acceptance 0: every verify emits only the bonus token; the draft cache keeps only
    the accepted prefix, so each step catches up on one token."""
    t, d, o = COST.target, COST.draft, COST.overhead
    sim = Simulator(cfg("fixed:3", k_max=4), COST, constant_acceptance(0.0))
    out = sim.run([SimRequest("a", 0.0, 5, 3)])
    t1 = fwd(t, 5, 5) + fwd(d, 5, 5) + o
    s2 = fwd(d, 6, 1) + fwd(d, 7, 1) + fwd(d, 8, 1) + fwd(t, 9, 4) + o  # kv 5 + 1 + 3
    # output 2 tokens: num_tokens 7, kv 6, draft kv min(8, 6) = 6 -> catch up 1 token
    s3 = fwd(d, 7, 1) + fwd(d, 8, 1) + fwd(d, 9, 1) + fwd(t, 10, 4) + o
    assert out[0].chunk_s == pytest.approx([t1, t1 + s2, t1 + s2 + s3], abs=1e-12)
    assert sim.stats.accepted == 0 and sim.stats.proposed == 6


def test_step_time_totals_match_the_clock():
    from sim_cases import poisson_requests

    sim = Simulator(cfg("specserve", tpot_slo=0.05), COST)
    reqs = poisson_requests(30, rate=20.0)
    out = sim.run(reqs)
    busy = sum(h.step_s for h in sim.stats.history)
    assert busy == pytest.approx(sim.stats.step_time_total)
    assert max(o.end_s for o in out) == pytest.approx(sim.now)
    assert busy <= sim.now + 1e-9
