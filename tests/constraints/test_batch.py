"""The engine's batched processing (constraints/batch.py) gives each request exactly what its
own RequestConstraints.target / .draft give: same processed logits and argmax bit for bit, same
distributions, for a mix of grammar, penalty, min_new_tokens, greedy and sampling requests."""

from __future__ import annotations

import json

import torch

from sloserve.runtime.constraints import GrammarState, RequestConstraints, grammar_spec
from sloserve.runtime.constraints.batch import process_drafts, process_targets
from sloserve.runtime.request import SamplingParams

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "string"}}}
DOC = '{"a": 12, "b": "xy"}'


def _requests(compiler, tokenizer, vocab):
    """(constraints, chain of drafts) pairs: each kind of request, some sharing a batch."""
    ids = tokenizer.encode(DOC, add_special_tokens=False)
    eos = [tokenizer.eos_token_id]
    grammar = compiler.compile(grammar_spec(json_schema=json.dumps(SCHEMA)))
    kinds = [
        SamplingParams(temperature=0.0, json_schema=json.dumps(SCHEMA)),
        SamplingParams(temperature=0.8, top_k=20, json_schema=json.dumps(SCHEMA),
                       frequency_penalty=0.5, min_new_tokens=30),
        SamplingParams(temperature=0.0, repetition_penalty=1.4, presence_penalty=0.3),
        SamplingParams(temperature=0.7, top_p=0.9, min_new_tokens=3),
    ]
    out = []
    for sp in kinds:
        state = GrammarState(grammar) if sp.json_schema else None
        rc = RequestConstraints(sp, vocab, ids[:3], penalties=sp.penalties, grammar=state,
                                stop_ids=eos)
        rc.commit(ids[:2])
        out.append((rc, ids[2:6]))
    return out


def _same(a, b):
    assert torch.equal(a.logits, b.logits) and a.argmax == b.argmax and a.n_valid == b.n_valid
    assert (a.probs is None) == (b.probs is None)
    if a.probs is not None:
        assert torch.equal(a.probs, b.probs)


def test_batched_targets_equal_per_request(compiler, tokenizer, vocab):
    g = torch.Generator().manual_seed(0)
    reqs = _requests(compiler, tokenizer, vocab)
    logits = [torch.randn(len(c) + 1, vocab, generator=g) * 3 for _, c in reqs]
    one = [rc.target(lg, c) for (rc, c), lg in zip(reqs, logits)]
    both = process_targets([(rc, lg, c) for (rc, c), lg in zip(reqs, logits)])
    for a, b in zip(one, both):
        _same(a, b)
    assert any(torch.isneginf(p.logits).any() for p in both)  # masks and min_new_tokens bit


def test_batched_drafts_equal_per_request(compiler, tokenizer, vocab):
    g = torch.Generator().manual_seed(1)
    reqs = _requests(compiler, tokenizer, vocab)
    for j in range(3):  # draft position j: each request pushed its first j drafts
        rows = torch.randn(len(reqs), vocab, generator=g) * 3
        one = [rc.draft(rows[i], c[:j]) for i, (rc, c) in enumerate(reqs)]
        both = process_drafts([(rc, rows[i], c[:j]) for i, (rc, c) in enumerate(reqs)])
        for a, b in zip(one, both):
            _same(a, b)
        for rc, c in reqs:
            assert rc.push_draft(c[j])
