"""Acceptance (runtime 6): bad input raises a clear error naming the field, and the engine keeps
serving the other requests."""

from __future__ import annotations

import pytest

from sloserve.runtime.request import InvalidRequest, SamplingParams

BAD_PARAMS = [
    ("max_new_tokens", dict(max_new_tokens=0)),
    ("max_new_tokens", dict(max_new_tokens=-3)),
    ("temperature", dict(temperature=-0.1)),
    ("top_p", dict(top_p=0.0)),
    ("top_p", dict(top_p=1.5)),
    ("top_k", dict(top_k=-2)),
    ("stop", dict(stop=("",))),
    ("tpot_slo", dict(tpot_slo=-1.0)),
]


@pytest.mark.parametrize("field,kw", BAD_PARAMS, ids=[f"{f}-{i}" for i, (f, _) in enumerate(BAD_PARAMS)])
def test_bad_sampling_params_name_the_field(field, kw):
    with pytest.raises(InvalidRequest) as e:
        SamplingParams(**kw)
    assert e.value.field == field
    assert field in str(e.value)


def test_bad_prompts_rejected_while_others_are_served(make_engine):
    eng = make_engine(spec_policy="fixed:2")
    ok = eng.add_request("serve me please", SamplingParams(max_new_tokens=6, temperature=0.0, ignore_eos=True))
    eng.step()
    too_long = [5] * eng.max_context
    for prompt, field in (("", "prompt"), ([], "prompt"), (too_long, "prompt"), ([10**7], "input_ids")):
        with pytest.raises(InvalidRequest) as e:
            eng.add_request(prompt)
        assert e.value.field == field
    while eng.has_work:
        eng.step()
    assert len(ok.output_ids) == 6 and ok.finish_reason.value == "length"
