"""Grammar-constrained random walks: sampling from random logits under the processed masks (with
penalties on) until the grammar's stop token always yields text the constraint accepts."""

from __future__ import annotations

import json
import re

import pytest
import torch

from sloserve.runtime.constraints import GrammarState, RequestConstraints, grammar_spec
from sloserve.runtime.penalties import PenaltyParams
from sloserve.runtime.request import SamplingParams

from .helpers import random_walk

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "ok": {"type": "boolean"},
        "color": {"enum": ["red", "green", "blue"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 3}, "maxItems": 3},
        "score": {"type": "number"},
    },
    "required": ["name", "age", "ok"],
}
PENALTIES = PenaltyParams(frequency_penalty=0.4, presence_penalty=0.3, repetition_penalty=1.3,
                          min_new_tokens=4)


def _check_by_hand(doc) -> None:
    """SCHEMA's rules, checked without a validator library."""
    assert isinstance(doc, dict) and set(doc) <= set(SCHEMA["properties"])
    assert {"name", "age", "ok"} <= set(doc)
    assert isinstance(doc["name"], str) and len(doc["name"]) <= 8
    assert type(doc["age"]) is int and 0 <= doc["age"] <= 150
    assert type(doc["ok"]) is bool
    assert doc.get("color", "red") in ("red", "green", "blue")
    tags = doc.get("tags", [])
    assert isinstance(tags, list) and len(tags) <= 3
    assert all(isinstance(t, str) and len(t) <= 3 for t in tags)
    assert isinstance(doc.get("score", 0.0), (int, float)) and not isinstance(doc.get("score"), bool)


def _walk(compiled, tokenizer, vocab, seed, penalties=PENALTIES, temperature=1.0):
    eos = tokenizer.eos_token_id
    rc = RequestConstraints(
        SamplingParams(temperature=temperature), vocab, tokenizer.encode("Q: json?"),
        penalties=penalties, grammar=GrammarState(compiled), stop_ids=[eos],
    )
    out = random_walk(rc, vocab, torch.Generator().manual_seed(seed), eos)
    assert out[-1] == eos and rc.grammar.terminated, "the walk did not finish"
    assert max(out[:-1]) < len(tokenizer), "a padding id was sampled"
    assert not set(out[:-1]) & set(tokenizer.all_special_ids)
    return tokenizer.decode(out[:-1])


@pytest.mark.parametrize("compact", [True, False])
def test_json_schema_walks_parse_and_validate(request, tokenizer, vocab, compact):
    compiler = request.getfixturevalue("compiler_compact" if compact else "compiler")
    g = compiler.compile(grammar_spec(json_schema=json.dumps(SCHEMA)))
    try:
        import jsonschema
    except ImportError:  # not a project dependency: the hand check below still runs
        jsonschema = None
    for seed in range(12):
        text = _walk(g, tokenizer, vocab, seed)
        doc = json.loads(text)
        _check_by_hand(doc)
        if jsonschema is not None:
            jsonschema.validate(doc, SCHEMA)


def test_response_format_json_schema_walk(compiler_compact, tokenizer, vocab):
    rf = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}}
    g = compiler_compact.compile(grammar_spec(response_format=rf))
    for seed in range(4):
        _check_by_hand(json.loads(_walk(g, tokenizer, vocab, 100 + seed)))


@pytest.mark.parametrize("pattern", [
    r"[a-z]{2,6}@(foo|bar)\.(com|org)",
    r"\d{3}-\d{4}",
    r"(yes|no|maybe)( please)?",
])
def test_regex_walks_match_fully(compiler, tokenizer, vocab, pattern):
    g = compiler.compile(grammar_spec(regex=pattern))
    for seed in range(8):
        text = _walk(g, tokenizer, vocab, seed, penalties=PenaltyParams())
        assert re.fullmatch(pattern, text), text


def test_ebnf_walks_match(compiler, tokenizer, vocab):
    ebnf = 'root ::= "(" item ("," item)* ")"\nitem ::= [0-9] | "x"'
    g = compiler.compile(grammar_spec(ebnf=ebnf))
    for seed in range(8):
        text = _walk(g, tokenizer, vocab, seed, penalties=PENALTIES, temperature=0.7)
        assert re.fullmatch(r"\((?:[0-9]|x)(?:,(?:[0-9]|x))*\)", text), text
