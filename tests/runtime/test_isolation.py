"""Issue 34: a request whose work inside a step raises fails alone; the requests it shares
the step with get exactly the tokens they get alone, and the KV pool ends all free."""

from __future__ import annotations

from sloserve.runtime.request import SamplingParams

PROMPTS = [[11 + i, 57, 300 + 7 * i, 42, 9] for i in range(4)]
GREEDY = SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True)
# constrained neighbours too: their rows go through the batched processing with the culprit's
PENALISED = SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True,
                           repetition_penalty=1.3)


def _alone(eng) -> list[list[int]]:
    return [eng.generate([p], sp)[0]["output_ids"]
            for p in PROMPTS for sp in (GREEDY, PENALISED)]


def _run(eng, culprit) -> tuple[list[list[int]], dict]:
    """The neighbours and the culprit in one batch (the culprit added once they decode)."""
    reqs = [eng.add_request(p, sp) for p in PROMPTS for sp in (GREEDY, PENALISED)]
    eng.step()
    bad = culprit(eng)
    outs = {}
    while eng.has_work:
        for o in eng.step():
            if o.rid == bad.rid:
                outs[o.rid] = o
    return [list(r.output_ids) for r in reqs], outs[bad.rid]


def _nan_temperature(eng):
    sp = SamplingParams(max_new_tokens=12, ignore_eos=True, seed=1)
    object.__setattr__(sp, "temperature", float("nan"))  # corrupted after validation
    return eng.add_request(PROMPTS[0], sp)


def _broken_constraints(eng):
    """Its constraints raise inside the batched processing of every constrained row."""
    req = eng.add_request(PROMPTS[1], PENALISED)
    req.constraints.counts = object()
    return req


def test_a_failing_request_fails_alone(make_engine):
    eng = make_engine(spec_policy="fixed:3")
    alone = _alone(eng)
    for culprit in (_nan_temperature, _broken_constraints):
        got, bad = _run(eng, culprit)
        assert got == alone, culprit.__name__
        assert bad.finished and bad.finish_reason == "abort" and bad.error, bad
    assert eng.stats.requests_failed == 2


def test_a_grammar_dead_end_fails_only_its_request(make_engine):
    """A row whose every token is masked (here forced) has nothing to sample: its request
    ends with an error instead of sampling NaN or emitting a masked token."""
    eng = make_engine(spec_policy="fixed:3")
    alone = _alone(eng)

    def dead_end(e):
        req = e.add_request(PROMPTS[2], SamplingParams(max_new_tokens=12, regex="[a-z]+"))
        state = req.constraints.grammar
        fill = state._fill

        def masked(j):
            fill(j)
            state._np[j][:] = 0  # no token allowed

        state._fill = masked
        return req

    got, bad = _run(eng, dead_end)
    assert got == alone
    assert bad.error and "no token can be sampled" in bad.error
