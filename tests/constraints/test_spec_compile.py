"""Reading constraints from request fields, compiling them, the cache and the error messages."""

from __future__ import annotations

import json

import pytest
import torch

from sloserve.runtime.constraints import GrammarSpec, GrammarState, grammar_spec
from sloserve.runtime.constraints.spec import JSON_OBJECT_SCHEMA
from sloserve.runtime.request import InvalidRequest


def test_fields_map_to_specs():
    assert grammar_spec() is None
    assert grammar_spec(regex="[0-9]+") == GrammarSpec("regex", "[0-9]+")
    assert grammar_spec(ebnf='root ::= "a"').kind == "ebnf"
    schema = {"type": "object", "properties": {"b": {"type": "integer"}, "a": {"type": "string"}}}
    s = grammar_spec(json_schema=json.dumps(schema))
    assert s.kind == "json_schema" and json.loads(s.text) == schema
    # a dict keeps its property order: it is the order the grammar generates them in
    assert list(json.loads(grammar_spec(json_schema=schema).text)["properties"]) == ["b", "a"]
    assert grammar_spec(response_format={"type": "text"}) is None
    obj = grammar_spec(response_format={"type": "json_object"})
    assert obj == GrammarSpec("json_schema", JSON_OBJECT_SCHEMA) and obj.source == "response_format"
    rf = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema, "strict": True}}
    assert json.loads(grammar_spec(response_format=rf).text) == schema


@pytest.mark.parametrize("kw, field", [
    (dict(regex="a", json_schema="{}"), "json_schema"),
    (dict(ebnf="", ), "ebnf"),
    (dict(regex=5), "regex"),
    (dict(json_schema="{not json"), "json_schema"),
    (dict(json_schema="[1, 2]"), "json_schema"),
    (dict(response_format={"type": "xml"}), "response_format"),
    (dict(response_format={"type": "json_schema"}), "response_format"),
    (dict(response_format={"type": "json_schema", "json_schema": {"name": "x"}}), "response_format"),
    (dict(response_format="json"), "response_format"),
])
def test_malformed_fields_name_the_field(kw, field):
    with pytest.raises(InvalidRequest) as e:
        grammar_spec(**kw)
    assert e.value.field == field


@pytest.mark.parametrize("kw, field", [
    (dict(regex="(ab"), "regex"),
    (dict(json_schema='{"type": "frobnicate"}'), "json_schema"),
    (dict(ebnf="root ::= undefined_rule"), "ebnf"),
    (dict(response_format={"type": "json_schema",
                           "json_schema": {"schema": {"type": "frobnicate"}}}), "response_format"),
])
def test_invalid_grammars_raise_invalid_request(compiler, kw, field):
    with pytest.raises(InvalidRequest) as e:
        compiler.compile(grammar_spec(**kw))
    assert e.value.field == field
    msg = str(e.value)
    assert "/project/" not in msg and "Check failed" not in msg, msg  # xgrammar's log prefix cut


def test_cache_is_keyed_by_kind_and_text(compiler):
    a = compiler.compile(grammar_spec(regex="[a-c]{3}"))
    assert compiler.compile(grammar_spec(regex="[a-c]{3}")) is a
    # same text, another kind: another grammar
    ebnf = compiler.compile(GrammarSpec("ebnf", 'root ::= "x"'))
    assert compiler.compile(GrammarSpec("regex", 'root ::= "x"')) is not ebnf
    # the field a spec came from is not part of the key
    obj = compiler.compile(grammar_spec(response_format={"type": "json_object"}))
    assert compiler.compile(grammar_spec(json_schema=JSON_OBJECT_SCHEMA)) is obj


def test_cache_is_bounded(tokenizer, vocab):
    from sloserve.runtime.constraints import GrammarCompiler

    c = GrammarCompiler.from_hf(tokenizer, vocab, [tokenizer.eos_token_id], cache_size=3)
    first = c.compile(grammar_spec(regex="a0"))
    for i in range(1, 5):
        c.compile(grammar_spec(regex=f"a{i}"))
    assert c.cache_len() == 3
    assert c.compile(grammar_spec(regex="a0")) is not first  # evicted, compiled again


def _accepts(compiled, tokenizer, text: str) -> bool:
    st = GrammarState(compiled)
    ids = tokenizer.encode(text, add_special_tokens=False)
    ok = all(st.push(t) for t in ids)
    return ok and st.completed


def test_each_kind_accepts_and_rejects(compiler, tokenizer):
    regex = compiler.compile(grammar_spec(regex=r"\d{3}-[a-z]+"))
    assert _accepts(regex, tokenizer, "123-abc") and not _accepts(regex, tokenizer, "12-abc")
    ebnf = compiler.compile(grammar_spec(ebnf='root ::= ("yes" | "no") "!"'))
    assert _accepts(ebnf, tokenizer, "no!") and not _accepts(ebnf, tokenizer, "maybe!")
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    js = compiler.compile(grammar_spec(json_schema=json.dumps(schema)))
    assert _accepts(js, tokenizer, '{"n": 12}') and not _accepts(js, tokenizer, '{"n": "x"}')
    obj = compiler.compile(grammar_spec(response_format={"type": "json_object"}))
    assert _accepts(obj, tokenizer, '{"a": [1, {"b": null}], "c": "d"}')
    assert not _accepts(obj, tokenizer, "[1, 2]")  # json_object: an object, as SGLang maps it


def test_masks_cover_the_model_vocabulary(compiler, tokenizer, vocab):
    """The model's ids past the tokenizer's and the special tokens are never allowed; EOS only
    once the grammar is complete."""
    st = GrammarState(compiler.compile(grammar_spec(regex="[a-z]{1,3}")))
    eos = tokenizer.eos_token_id
    allowed = st.allowed()
    assert allowed.shape == (vocab,)
    assert not allowed[len(tokenizer):].any()
    assert not allowed[tokenizer.all_special_ids].any()
    st.commit(tokenizer.encode("ab", add_special_tokens=False))
    allowed = st.allowed()
    assert allowed[eos] and not allowed[len(tokenizer):].any()


def test_bitmask_packing_round_trips():
    from sloserve.runtime.constraints.bitmask import from_bool, to_bool

    g = torch.Generator().manual_seed(0)
    for V in (1, 31, 32, 33, 100, 2088):
        allowed = torch.rand(3, V, generator=g) < 0.5
        allowed[0, -1] = True  # the sign bit of the last word in use
        assert torch.equal(to_bool(from_bool(allowed), V), allowed)


def test_json_schemas_never_allow_raw_control_bytes(compiler, tokenizer):
    """xgrammar 0.2.7 lets a maxLength string take raw control characters (xgrammar issue #800);
    the byte guard removes them, so the output always parses."""
    import xgrammar as xgr

    from sloserve.runtime.constraints.bitmask import allocate, to_bool

    schema = {"type": "object", "properties": {"s": {"type": "string", "maxLength": 5}}}
    g = compiler.compile(grammar_spec(json_schema=json.dumps(schema)))
    prefix = tokenizer.encode('{"s": "a', add_special_tokens=False)
    tab = tokenizer.convert_tokens_to_ids("\u0109")  # byte-level BPE spelling of b"\t"
    assert compiler.info.decoded_vocab[tab] == b"\t"
    m = xgr.GrammarMatcher(g.compiled)  # bare xgrammar: the tab is allowed inside the string
    assert all(m.accept_token(t) for t in prefix)
    bm = allocate(1, g.vocab_size)
    m.fill_next_token_bitmask(bm)
    assert to_bool(bm, g.vocab_size)[0, tab]
    st = GrammarState(g)
    st.commit(prefix)
    allowed = st.allowed()
    assert not allowed[tab] and allowed[tokenizer.convert_tokens_to_ids('"')]
    controls = [i for i, b in enumerate(compiler.info.decoded_vocab)
                if any(c < 0x20 and c not in (0x0A, 0x0D) for c in b)]
    assert controls and not allowed[controls].any()
    # outside JSON a tab is text like any other: a regex asking for one gets it
    st = GrammarState(compiler.compile(grammar_spec(regex="a\tb")))
    st.commit(tokenizer.encode("a", add_special_tokens=False))
    assert st.allowed()[tab]
