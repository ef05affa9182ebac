"""Stop conditions (EOS, stop token ids, stop strings, max_new_tokens) and abort."""

from __future__ import annotations

import torch
from sloserve_testing import prompts_of_lengths

from sloserve.runtime.request import SamplingParams


def _greedy(n, **kw):
    return SamplingParams(max_new_tokens=n, temperature=0.0, **kw)


def test_stop_token_id_and_eos(make_engine):
    eng = make_engine(spec_policy="ar")
    p = prompts_of_lengths([12], seed=3)[0]
    full = eng.generate([p], _greedy(20, ignore_eos=True))[0]["output_ids"]
    stop_tok = full[7]
    first = full.index(stop_tok)
    out = eng.generate([p], _greedy(20, stop_token_ids=(stop_tok,)))[0]
    assert out["output_ids"] == full[: first + 1] and out["finish_reason"] == "stop"
    # EOS: make one of the tokens the model emits the EOS
    eng.runner.eos = frozenset({stop_tok})
    out = eng.generate([p], _greedy(20))[0]
    assert out["output_ids"] == full[: first + 1] and out["finish_reason"] == "stop"
    out = eng.generate([p], _greedy(20, ignore_eos=True))[0]
    assert out["output_ids"] == full


def test_stop_string_trims_text(make_engine):
    eng = make_engine(spec_policy="ar")
    p = prompts_of_lengths([9], seed=4)[0]
    full = eng.generate([p], _greedy(30, ignore_eos=True))[0]
    text = full["text"]
    needle = text[10:13]
    assert needle.strip(), "pick a printable stop string"
    out = eng.generate([p], _greedy(30, ignore_eos=True, stop=(needle,)))[0]
    assert out["finish_reason"] == "stop"
    assert out["text"] == text[: text.index(needle)]
    assert len(out["output_ids"]) < 30


def test_abort_frees_blocks_and_others_continue(make_engine):
    eng = make_engine(spec_policy="fixed:3")
    a = eng.add_request(prompts_of_lengths([30])[0], _greedy(50, ignore_eos=True))
    b = eng.add_request(prompts_of_lengths([20], seed=9)[0], _greedy(10, ignore_eos=True))
    for _ in range(3):
        eng.step()
    used = eng.scheduler.alloc.num_used
    assert eng.abort(a.rid) and not eng.abort(a.rid)
    assert eng.scheduler.alloc.num_used < used
    assert [o.rid for o in eng.take_aborted()] == [a.rid]
    while eng.has_work:
        eng.step()
    assert a.finish_reason.value == "abort" and len(b.output_ids) == 10


def test_seeded_sampling_is_reproducible(make_engine):
    eng = make_engine(spec_policy="ar")
    p = prompts_of_lengths([8], seed=5)[0]
    sp = SamplingParams(max_new_tokens=16, temperature=0.8, top_p=0.9, top_k=50, seed=1234, ignore_eos=True)
    a = eng.generate([p, p], [sp, sp])
    assert a[0]["output_ids"] == a[1]["output_ids"]
    other = SamplingParams(max_new_tokens=16, temperature=0.8, seed=99, ignore_eos=True)
    assert eng.generate([p], other)[0]["output_ids"] != a[0]["output_ids"]


def test_processed_probs_top_k_top_p():
    from sloserve.runtime.sampler import processed_probs

    logits = torch.log(torch.tensor([[0.5, 0.25, 0.15, 0.1]]))
    p = processed_probs(logits, [SamplingParams(temperature=1.0, top_k=2)])
    assert torch.allclose(p, torch.tensor([[2 / 3, 1 / 3, 0, 0]]))
    p = processed_probs(logits, [SamplingParams(temperature=1.0, top_p=0.7)])
    assert torch.allclose(p, torch.tensor([[0.5 / 0.75, 0.25 / 0.75, 0, 0]]))
    p = processed_probs(logits, [SamplingParams(temperature=1.0, top_p=0.5)])
    assert torch.allclose(p, torch.tensor([[1.0, 0, 0, 0]]))


def test_streamed_text_never_leaks_a_stop_string_prefix(make_engine):
    """Text deltas hold back a tail that could start a stop string, so the concatenated
    deltas equal the final (trimmed) text and never contain the stop string's start."""
    from sloserve.runtime.detokenizer import partial_stop_len

    assert partial_stop_len("abc<en", ("<end>",)) == 3
    assert partial_stop_len("abc", ("<end>",)) == 0
    eng = make_engine(spec_policy="fixed:4")
    p = prompts_of_lengths([11], seed=6)[0]
    text = eng.generate([p], _greedy(30, ignore_eos=True))[0]["text"]
    stop = text[12:16]
    req = eng.add_request(p, _greedy(30, ignore_eos=True, stop=(stop,)))
    streamed = ""
    while eng.has_work:
        for out in eng.step():
            if out.rid == req.rid:
                streamed += out.new_text
                assert stop not in streamed
    assert streamed == req.output_text == text[: text.index(stop)]
