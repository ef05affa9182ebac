"""GrammarState against xgrammar's matcher stepped token by token: masks, rollback, the draft
and verify chains, commit, termination."""

from __future__ import annotations

import json

import pytest
import torch

from sloserve.runtime.constraints import GrammarState, GrammarViolation, grammar_spec
from sloserve.runtime.constraints.bitmask import to_bool

from .helpers import reference_masks

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 10},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "tags": {"type": "array", "items": {"enum": ["red", "green"]}, "maxItems": 3},
    },
    "required": ["name", "age"],
}
TEXT = '{"name": "kato", "age": 42, "tags": ["red", "green"]}'


@pytest.fixture(scope="module")
def grammar(compiler):
    return compiler.compile(grammar_spec(json_schema=json.dumps(SCHEMA)))


@pytest.fixture(scope="module")
def ids(tokenizer):
    return tokenizer.encode(TEXT, add_special_tokens=False)


def _mask(st: GrammarState) -> torch.Tensor:
    return st.allowed().clone()


def test_masks_follow_the_reference_matcher(grammar, ids, tokenizer):
    ref = reference_masks(grammar, ids + [tokenizer.eos_token_id])
    st = GrammarState(grammar)
    for j, t in enumerate(ids + [tokenizer.eos_token_id]):
        assert torch.equal(_mask(st), ref[j]), f"position {j}"
        st.accept(t)
    assert st.terminated and st.num_committed == len(ids) + 1
    assert _mask(st).all()  # after the stop token: unconstrained, as SGLang


def test_rollback_restores_the_state(grammar, ids):
    st = GrammarState(grammar)
    masks = []
    for t in ids:
        masks.append(_mask(st))
        st.accept(t)
    for n in (1, 3, 7):
        st.rollback(n)
        assert torch.equal(_mask(st), masks[len(ids) - n])
        for t in ids[len(ids) - n:]:
            st.accept(t)
    st.rollback(len(ids))
    assert torch.equal(_mask(st), masks[0]) and st.num_committed == 0
    with pytest.raises(ValueError):
        st.rollback(1)


@pytest.mark.parametrize("start", [0, 5, 17])
@pytest.mark.parametrize("k", [1, 4, 8])
def test_verify_chain_equals_step_by_step(grammar, ids, start, k):
    ref = reference_masks(grammar, ids)
    st = GrammarState(grammar)
    st.commit(ids[:start])
    drafts = ids[start : start + k]
    bm, n_valid = st.verify_bitmask(drafts)
    assert n_valid == len(drafts) and bm.shape[0] == len(drafts) + 1
    assert torch.equal(to_bool(bm, grammar.vocab_size), ref[start : start + len(drafts) + 1])


def test_drafting_masks_then_verify_reuses_them(grammar, ids):
    """Draft 6 tokens one by one (mask, push), verify 4 of them: the verify rows are the draft
    masks, the extra tentative tokens are rolled back, commit keeps the accepted ones."""
    ref = reference_masks(grammar, ids)
    st = GrammarState(grammar)
    st.commit(ids[:3])
    drafted = ids[3:9]
    for j, t in enumerate(drafted):
        assert torch.equal(_mask(st), ref[3 + j])
        assert st.push(t)
    assert st.num_tentative == 6
    bm, n_valid = st.verify_bitmask(drafted[:4])
    assert n_valid == 4 and st.num_tentative == 4
    assert torch.equal(to_bool(bm, grammar.vocab_size), ref[3:8])
    # two drafts accepted, then the target's own token (here the text's next one)
    st.commit(drafted[:2] + [ids[5]])
    assert st.num_committed == 6 and st.num_tentative == 0
    assert torch.equal(_mask(st), ref[6])


def test_verify_after_pushes_without_masks(grammar, ids):
    """Drafts pushed without reading their masks (how the n-gram drafter proposes): the verify
    rows are still the masks of their positions."""
    ref = reference_masks(grammar, ids)
    st = GrammarState(grammar)
    st.commit(ids[:3])
    for t in ids[3:8]:
        assert st.push(t)
    bm, n_valid = st.verify_bitmask(ids[3:7])
    assert n_valid == 4 and st.num_tentative == 4
    assert torch.equal(to_bool(bm, grammar.vocab_size), ref[3:8])
    st.commit(ids[3:5] + [ids[5]])
    assert torch.equal(_mask(st), ref[6])


def test_drop_drafts_returns_to_the_committed_state(grammar, ids):
    st = GrammarState(grammar)
    st.commit(ids[:4])
    before = _mask(st)
    for t in ids[4:10]:
        st.bitmask()
        st.push(t)
    st.drop_drafts()
    assert st.num_tentative == 0 and torch.equal(_mask(st), before)
    # drafting, then verifying nothing (k = 0): the row is the committed position's mask
    st.push(ids[4])
    bm, n = st.verify_bitmask([])
    assert n == 0 and torch.equal(to_bool(bm, grammar.vocab_size)[0], before)


def test_chain_stops_at_the_first_forbidden_draft(grammar, ids, tokenizer):
    ref = reference_masks(grammar, ids)
    st = GrammarState(grammar)
    st.commit(ids[:2])
    bad = int((~ref[4]).nonzero()[0])  # forbidden at position 4
    drafts = [ids[2], ids[3], bad, ids[5]]
    bm, n_valid = st.verify_bitmask(drafts)
    assert n_valid == 2
    rows = to_bool(bm, grammar.vocab_size)
    assert torch.equal(rows[:3], ref[2:5]) and not rows[2, bad]
    assert rows[3:].all()  # past the forbidden draft: never consulted
    assert not st.push(bad)  # the state is still after ids[:4]
    assert not st.push(grammar.vocab_size) and not st.push(-1)
    st.commit([ids[2], ids[3], ids[4]])
    assert torch.equal(_mask(st), ref[5])
    with pytest.raises(GrammarViolation):
        st.commit([bad])


def test_stop_token_in_the_chain(compiler, tokenizer):
    """A draft chain through EOS: the grammar terminates there; later rows allow everything."""
    g = compiler.compile(grammar_spec(regex="(ab|cd)"))
    st = GrammarState(g)
    eos = tokenizer.eos_token_id
    chain = tokenizer.encode("ab", add_special_tokens=False) + [eos, 5]
    bm, n_valid = st.verify_bitmask(chain)
    rows = to_bool(bm, g.vocab_size)
    ref = reference_masks(g, chain[:-1])
    assert n_valid == len(chain) and torch.equal(rows[: len(chain)], ref)
    assert rows[-1].all() and st.terminated
    st.commit(chain[:-2] + [eos])
    assert st.terminated and st.completed
    st.rollback(1)
    assert not st.terminated and st.completed
    assert torch.equal(_mask(st), ref[-2])


def test_long_chains_grow_the_cache(grammar, ids):
    st = GrammarState(grammar, max_draft=2)
    bm, n_valid = st.verify_bitmask(ids[:12])
    assert n_valid == 12
    assert torch.equal(to_bool(bm, grammar.vocab_size), reference_masks(grammar, ids[:12]))


def test_verify_after_drafting_another_chain(grammar, ids, tokenizer):
    """Drafting went down one path (its masks cached), verification checks another that leaves
    it after a shared prefix: rows past the fork are the new path's masks, not stale ones."""
    other = tokenizer.encode('{"name": "kato", "age": 7, "tags": []}', add_special_tokens=False)
    fork = next(i for i, (a, b) in enumerate(zip(ids, other)) if a != b)
    st = GrammarState(grammar)
    st.commit(ids[: fork - 2])
    for t in ids[fork - 2 : fork + 4]:
        st.bitmask()
        assert st.push(t)
    chain = other[fork - 2 : fork + 4]
    bm, n_valid = st.verify_bitmask(chain)
    assert n_valid == len(chain)
    ref = reference_masks(grammar, other[: fork + 4])
    assert torch.equal(to_bool(bm, grammar.vocab_size), ref[fork - 2 :])
    # and back: drop, draft the first path again
    st.drop_drafts()
    bm, _ = st.verify_bitmask(ids[fork - 2 : fork + 4])
    ref = reference_masks(grammar, ids[: fork + 4])
    assert torch.equal(to_bool(bm, grammar.vocab_size), ref[fork - 2 :])
