"""The closed-loop benchmark's interleaved runner: policies stepped in turn on their own KV
pools finish every request, keep greedy output, and each clock counts only its own steps."""

from __future__ import annotations

import time

from sloserve_testing import prompts_of_lengths

from sloserve.bench.spec import ClosedLoop, policy_engine, run_loops


def test_interleaved_loops_finish_everything_on_their_own_clocks(make_engine):
    base = make_engine(spec_policy="fixed:1", k_max=4)
    engines = [policy_engine(base, name, 4, "model", kv_tokens=2048)
               for name in ("ar", "fixed:2", "specserve")]
    assert len({id(e.scheduler.alloc) for e in engines}) == 3  # no shared KV pool
    prompts = prompts_of_lengths([5, 9, 14, 7, 11], seed=3)
    loops = [ClosedLoop(e, prompts, 12, concurrency=2) for e in engines]
    t0 = time.perf_counter()
    results = run_loops(loops, requests=len(prompts))
    wall = time.perf_counter() - t0
    # greedy: every policy gives each prompt the same tokens (the prompts come in a cycle)
    outputs = [{tuple(r.prompt_ids): r.output_ids for r in lp.finished} for lp in loops]
    for out in outputs:
        assert len(out) == len(prompts) and all(len(o) == 12 for o in out.values())
        assert out == outputs[0]
    for lp, res in zip(loops, results):
        assert res["requests"] >= len(prompts) and not lp.live
        assert 0 < res["wall_s"] < wall  # its own steps only, not the others'
        assert len(res["tpots"]) == res["requests"] and all(t > 0 for t in res["tpots"])
        assert res["tokens"] >= 12 * res["requests"]  # aborted leftovers' tokens count too
        assert res["tok_s"] == res["tokens"] / res["wall_s"]
        lp.eng.check_idle_integrity()
        alloc = lp.eng.scheduler.alloc
        assert alloc.num_free == alloc.num_blocks
    assert len({res["steps"] for res in results}) == 1  # stepped in turn: same stretch of time
    assert results[0]["mean_k"] == 0 and results[1]["mean_k"] == 2
