"""SPECSERVE's n-gram chains inside SGLang (sglang_ext/ngram_chain.py, SGLang-free): the
built-in engine's prompt lookup on each request's committed tokens, misses as NaN, and the
session reading a miss as the end of the request's chain."""

from __future__ import annotations

import numpy as np

from sloserve.estimator.cost_model import CostModel, ForwardCost
from sloserve.policies.registry import make_policy
from sloserve.runtime.drafter.ngram import NgramIndex
from sloserve.sglang_ext.controller import StepController
from sloserve.sglang_ext.ngram_chain import NgramChains


def _lookup(ids: list[int], k: int) -> list[tuple[int, float] | None]:
    """k rounds of plain prompt lookup over ids (the reference)."""
    idx = NgramIndex(3)
    idx.extend(ids)
    tail, out = list(ids), []
    for _ in range(k):
        p = idx.propose(tail[-3:]) if (not out or out[-1] is not None) else None
        out.append(p)
        tail.append(p[0] if p else tail[-1])
    return out


def test_chains_follow_prompt_lookup_and_mark_misses():
    a = [5, 6, 7, 8, 5, 6, 7, 8, 5, 6]  # repeats: proposes 7, 8, 5, 6
    b = [1, 2, 3, 4]  # nothing repeats: no proposal
    ch = NgramChains(3)
    ch.start(["a", "b"], [a[:-1], b], [a[-1], b[-1]])  # a's bonus not yet committed
    rounds = [ch.round() for _ in range(4)]
    toks = np.stack([t for t, _ in rounds], axis=1)
    conf = np.stack([c for _, c in rounds], axis=1)
    ref = _lookup(a, 4)
    assert toks[0].tolist() == [p[0] for p in ref] == [7, 8, 5, 6]
    assert np.allclose(conf[0], [p[1] for p in ref])
    assert np.isnan(conf[1]).all()


def test_a_chain_that_misses_stays_ended():
    ids = [9, 1, 2, 9, 1, 3]  # "1 3" never seen: "3" has no follower
    ch = NgramChains(3)
    ch.start(["r"], [ids], [ids[-1]])
    t1, c1 = ch.round()
    assert np.isnan(c1[0])
    t2, c2 = ch.round()  # the filler "3" again would match nothing either; still ended
    assert np.isnan(c2[0])


def test_indexes_grow_with_the_request_and_are_released():
    ch = NgramChains(3, keep=2)
    ch.start(["r"], [[4, 5]], [4])
    ch.start(["r"], [[4, 5, 4]], [5])  # the next step: the committed tokens grew
    t, c = ch.round()
    assert t[0] == 4 and np.isfinite(c[0])  # "5" was followed by "4"
    ch.start(["x", "y", "z"], [[1], [2], [3]], [1, 2, 3])
    ch.start(["y"], [[2]], [2])  # more than keep: indexes of requests not in the batch go
    assert len(ch.book) == 1
    ch.release("y")
    assert len(ch.book) == 0


def _controller(per_request: bool, trim: bool = False) -> StepController:
    cost = CostModel(ForwardCost(0.0, 1e-3, 0.05), ForwardCost.free(), 1e-3)
    return StepController(make_policy("specserve", cost, k_max=4, drafter="ngram"), 4,
                          per_request=per_request, trim=trim)


def test_a_miss_ends_the_request_chain_in_a_per_request_step():
    ctl = _controller(per_request=True)
    step = ctl.begin(["a", "b"], [100, 100], [None, None])
    step.session.drafting[:] = True
    ctl.after_round(step, [0.99, np.nan])
    assert step.session.drafted.tolist() == [1, 0]
    assert not step.session.drafting[1]


def test_a_trimmed_chain_counts_the_proposals_before_the_first_miss():
    ctl = _controller(per_request=False, trim=True)
    step = ctl.begin(["a", "b"], [100, 100], [None, None])
    step.session.fix_rounds(3)
    ctl.chain_drafted(step, np.array([[0.9, np.nan, 0.9], [0.9, 0.9, 0.9]]))
    assert step.session.drafted.tolist() == [1, 3]
    k = ctl.verify_lengths(step)
    assert k[0] <= 1


def test_the_ngram_drafter_prices_drafting_free_from_a_model_profile(tmp_path):
    """A profile of the draft model's SGLang forwards serves the n-gram drafter with the
    draft free and without the draft's calibration (its confidences mean something else)."""
    from sloserve.estimator.profile_file import read_profile
    from sloserve.sglang_ext.settings import load_cost
    from tests.sglang_runtime.launched import TINY_PROFILE

    model = read_profile(TINY_PROFILE)
    assert model.draft.key != "ngram" and model.cost_model().draft.c > 0
    cost, calibration = load_cost("unused", "unused", "cpu", "float32", str(TINY_PROFILE),
                                  drafter="ngram")
    assert cost.draft == ForwardCost.free() and calibration is None
    assert cost.target == model.cost_model().target
    cost, calibration = load_cost("unused", "unused", "cpu", "float32", str(TINY_PROFILE))
    assert cost == model.cost_model()


def test_spec_profile_none_starts_from_the_estimate_whatever_profiles_exist():
    """--spec-profile none: the first start of a pair (issue #32, acceptance 3), even where a
    profile of it exists: the shapes' estimate, with a prior for SGLang's verify path that
    the online correction then fits."""
    import dataclasses

    from sloserve.estimator.cost_model import rough_cost
    from sloserve.runtime.models.config import load_config
    from sloserve.sglang_cpu.tiny_pair import ensure_tiny_pair
    from sloserve.sglang_ext.settings import ROUGH_VERIFY_PATH, load_cost

    target, draft = (str(p) for p in ensure_tiny_pair())
    cost, calibration = load_cost(target, draft, "cpu", "float32", "none")
    assert calibration is None
    rough = rough_cost(load_config(target), load_config(draft))
    assert cost == dataclasses.replace(rough, verify_fixed=ROUGH_VERIFY_PATH * rough.target.c)
    assert cost.verify_fixed > 0
    cost, _ = load_cost(target, draft, "cpu", "float32", "none", drafter="ngram")
    assert cost.target == rough_cost(load_config(target), None).target
    assert cost.draft.c == 0 and cost.verify_fixed > 0
