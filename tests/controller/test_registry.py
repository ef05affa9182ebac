"""Policy registry: every documented spec builds, everything else is a clear ValueError."""

from __future__ import annotations

import pytest

from sloserve.bench.synthetic import cpu_cost_model
from sloserve.policies.lut import LookupTablePolicy
from sloserve.policies.registry import POLICY_NAMES, make_policy

COST = cpu_cost_model()


@pytest.mark.parametrize("spec", POLICY_NAMES)
def test_every_listed_spec_builds(spec):
    policy = make_policy(spec, COST, k_max=8)
    assert policy.name == spec
    assert policy.speculates == (spec != "ar")


@pytest.mark.parametrize(
    "spec", ["fixed:2", "hf-heuristic:3", "hf-threshold:0.6", "lut:1=4,8=2,32=0", " specserve "]
)
def test_specs_with_arguments(spec):
    make_policy(spec, COST, k_max=8)


def test_lut_table_argument_is_used():
    policy = make_policy("lut:1=4,8=2,32=0", COST, k_max=8)
    assert isinstance(policy, LookupTablePolicy)
    assert [policy.k_for(b) for b in (1, 2, 8, 9, 40)] == [4, 2, 2, 0, 0]


@pytest.mark.parametrize(
    "spec",
    [
        "",
        "spec-serve",
        "fixed",
        "fixed:",
        "fixed:x",
        "fixed:0",
        "fixed:9",
        "ar:1",
        "goodput:3",
        "lut:1",
        "lut:a=2",
        "lut:1=-1",
        "hf-threshold:2",
        "specserve:1",
    ],
)
def test_bad_specs_name_the_valid_choices(spec):
    with pytest.raises(ValueError, match="valid: ar, fixed:K"):
        make_policy(spec, COST, k_max=8)


def test_bad_drafter_and_k_max():
    with pytest.raises(ValueError, match="model, ngram"):
        make_policy("specserve", COST, k_max=8, drafter="eagle")
    with pytest.raises(ValueError, match="k_max"):
        make_policy("specserve", COST, k_max=-1)
