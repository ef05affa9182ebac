"""Token counts and KV blocks: the simulator keeps the engine's books."""

from __future__ import annotations

import pytest
from sim_cases import COST, cfg, poisson_requests

from sloserve.policies.registry import POLICY_NAMES
from sloserve.sim.engine import SimRequest, Simulator


def checked(sim: Simulator) -> list[int]:
    """Wrap the step: after every step, the allocator agrees with the live requests and
    every decoding request satisfies the engine's KV invariants. Returns a step counter."""
    runner, count = sim.runner, [0]
    step = runner.step

    def step_and_check(now):
        out = step(now)
        count[0] += 1
        sim.check_idle_integrity()
        for r in runner.scheduler.running:
            assert r.draft_kv_len <= r.num_tokens - 1
            if r.is_decoding:
                assert r.kv_len == r.num_tokens - 1
                # blocks cover the cached positions; rejected tail blocks were freed
                n = len(r.blocks)
                assert runner.alloc.blocks_for(r.kv_len) <= n <= runner.alloc.blocks_for(
                    r.num_tokens)
        return out

    runner.step = step_and_check
    return count


@pytest.mark.parametrize("policy", POLICY_NAMES)
def test_every_policy_generates_exactly_max_new_tokens_and_frees_all_blocks(policy):
    sim = Simulator(cfg(policy, tpot_slo=0.05), COST)
    steps = checked(sim)
    reqs = poisson_requests(24, rate=30.0, seed=1)
    out = sim.run(reqs)
    assert steps[0] == sim.stats.steps
    assert [o.output_tokens for o in out] == [r.max_new_tokens for r in reqs]
    assert all(o.error is None for o in out)
    assert sim.stats.generated_tokens == sum(r.max_new_tokens for r in reqs)
    assert sim.stats.prompt_tokens == sum(r.prompt_tokens for r in reqs)
    assert sim.stats.requests_finished == len(reqs)
    alloc = sim.runner.alloc
    assert alloc.num_free == alloc.num_blocks
    sim.check_idle_integrity()
    assert not (sim.runner.conf or sim.runner.run or sim.runner.streams)  # dropped at finish
    for o, r in zip(out, reqs):  # chunks rise, start after the arrival
        assert o.chunk_s[0] > r.arrival_s
        assert all(b > a for a, b in zip(o.chunk_tokens, o.chunk_tokens[1:]))


def test_speculation_counters_are_consistent():
    sim = Simulator(cfg("fixed:3", k_max=4), COST)
    sim.run(poisson_requests(20, rate=30.0, seed=2))
    s = sim.stats
    assert s.verified == sum(s.verified_at) and s.accepted == sum(s.accepted_at)
    assert s.verified == 3 * s.verify_steps == s.proposed
    assert s.chosen_k[3] == s.verify_steps
    assert all(a <= v for a, v in zip(s.accepted_at, s.verified_at))
    # emitted = accepted + 1 per request-step, plus one token per prefill
    decode_request_steps = sum(s.chosen_k)
    assert s.generated_tokens <= s.accepted + decode_request_steps + 20


def test_preemption_under_a_small_kv_cache_keeps_the_books():
    """A pool too small for the batch forces preemption by recompute; everything still
    finishes with exact token counts and the pool ends all free."""
    sim = Simulator(cfg("fixed:3", k_max=4, kv_cache_tokens=512), COST)
    checked(sim)
    reqs = [SimRequest(f"p{i}", 0.0, 60, 80) for i in range(6)]
    out = sim.run(reqs)
    assert sim.stats.preemptions > 0
    assert [o.output_tokens for o in out] == [80] * 6
    assert sim.runner.alloc.num_free == sim.runner.alloc.num_blocks


def test_invalid_requests_fail_like_the_engine():
    sim = Simulator(cfg("ar", kv_cache_tokens=256), COST, max_context=100)
    out = sim.run([SimRequest("long", 0.0, 150, 4), SimRequest("big", 0.0, 99, 4),
                   SimRequest("ok", 0.0, 90, 50)])
    assert out[0].error and "context window" in out[0].error
    assert out[1].output_tokens == 1  # 99 prompt tokens + 1 reach the 100-token window
    assert out[2].output_tokens == 10  # stops at the context limit, like the engine
    assert sim.runner.alloc.num_free == sim.runner.alloc.num_blocks
