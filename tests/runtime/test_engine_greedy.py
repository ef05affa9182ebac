"""Acceptance (runtime 3): greedy generation through the engine — continuous batching, 16+
requests of different lengths arriving at different steps, and a run that forces preemption —
equals transformers' greedy generate for each prompt, token for token."""

from __future__ import annotations

from sloserve_testing import hf_greedy, prompts_of_lengths

from sloserve.runtime.request import FinishReason, SamplingParams, Status

LENGTHS = [3, 17, 5, 40, 9, 1, 26, 12, 33, 7, 2, 21, 15, 48, 6, 11, 29, 4]


def _run_staggered(eng, prompts, new_tokens, per_step=3):
    """Add `per_step` requests before each step until all are in; run to completion."""
    reqs, pending = [], list(zip(prompts, new_tokens))
    while pending or eng.has_work:
        for p, n in pending[:per_step]:
            reqs.append(eng.add_request(p, SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True)))
        pending = pending[per_step:]
        eng.step()
    assert all(r.status is Status.FINISHED for r in reqs)
    return reqs


def test_continuous_batching_equals_transformers(make_engine, hf_target):
    eng = make_engine(spec_policy="ar", max_step_tokens=64)  # small budget: chunked prefill
    prompts = prompts_of_lengths(LENGTHS, seed=1)
    new = [8 + (i * 5) % 17 for i in range(len(prompts))]
    reqs = _run_staggered(eng, prompts, new)
    for r, p, n in zip(reqs, prompts, new):
        assert r.output_ids == hf_greedy(hf_target, p, n), f"prompt of {len(p)} tokens differs"


def test_preemption_by_recompute_keeps_greedy_output(make_engine, hf_target):
    # 24 blocks of 8 tokens cannot hold 16 requests growing to ~60 tokens: preemption must happen
    eng = make_engine(spec_policy="ar", kv_cache_tokens=192, max_step_tokens=128)
    prompts = prompts_of_lengths(LENGTHS[:16], seed=2)
    new = [24] * len(prompts)
    reqs = _run_staggered(eng, prompts, new, per_step=8)
    assert eng.stats.preemptions > 0
    assert any(r.num_preemptions for r in reqs)
    for r, p, n in zip(reqs, prompts, new):
        assert r.output_ids == hf_greedy(hf_target, p, n)


def test_generate_text_prompts_in_order(make_engine):
    eng = make_engine(spec_policy="ar")
    outs = eng.generate(["hello world", "a longer prompt with several words in it"],
                        SamplingParams(max_new_tokens=5, temperature=0.0, ignore_eos=True))
    assert [o["completion_tokens"] for o in outs] == [5, 5]
    assert outs[0]["prompt_tokens"] == len(eng.encode("hello world"))
    assert all(o["finish_reason"] == "length" for o in outs)


def test_speculation_up_to_the_context_window_edge(make_engine, hf_target):
    """Requests that end exactly at the context window draft only as far as it: a draft
    verified past the window would have no position (the step used to fail there)."""
    eng = make_engine(spec_policy="fixed:3")
    window = eng.max_context
    prompts = prompts_of_lengths([window - 10, window - 2], seed=3)
    outs = [eng.add_request(p, SamplingParams(max_new_tokens=window - len(p), temperature=0.0,
                                              ignore_eos=True)) for p in prompts]
    while eng.has_work:
        eng.step()
    for r, p in zip(outs, prompts):
        assert r.output_ids == hf_greedy(hf_target, p, window - len(p))
    capped = make_engine(spec_policy="fixed:3", context_length=40)
    r = capped.add_request(prompts_of_lengths([30], seed=4)[0],
                           SamplingParams(max_new_tokens=100, temperature=0.0, ignore_eos=True))
    while capped.has_work:
        capped.step()
    assert len(r.output_ids) == 10 and r.finish_reason is FinishReason.LENGTH
