"""Reading constraints from request fields, compiling them, the cache and the error messages."""

from __future__ import annotations

import json

import pytest

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
