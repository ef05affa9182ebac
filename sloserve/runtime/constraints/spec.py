"""A request's output constraint, read from SGLang's sampling_params (`regex`, `json_schema`,
`ebnf`) or OpenAI's `response_format`, before anything is compiled.

OpenAI's response_format maps as SGLang maps it: {"type": "text"} is no constraint,
{"type": "json_object"} is the JSON schema {"type": "object"} (any JSON object), and
{"type": "json_schema", "json_schema": {"name": ..., "schema": {...}}} is that schema.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Literal

from sloserve.runtime.errors import InvalidRequest

GrammarKind = Literal["regex", "json_schema", "ebnf"]
JSON_OBJECT_SCHEMA = '{"type": "object"}'
# deeper schemas are refused: xgrammar's compiler recurses on the nesting (no real schema
# nests this deep; JSON values of the output are not limited by this)
MAX_SCHEMA_DEPTH = 128
_FIELDS = ("regex", "json_schema", "ebnf", "response_format")


@dataclass(frozen=True)
class GrammarSpec:
    kind: GrammarKind
    text: str  # the regex, the schema as JSON text, or the EBNF grammar source
    # the request field it came from; compile errors name it. Not part of the cache key.
    source: str = field(default="", compare=False)

    @property
    def key(self) -> tuple[str, str]:
        return (self.kind, self.text)


def grammar_spec(
    regex: Any = None, json_schema: Any = None, ebnf: Any = None, response_format: Any = None
) -> GrammarSpec | None:
    """The constraint of one request, or None. Raises InvalidRequest naming the field when a value
    is malformed or more than one of the four is given."""
    given = [n for n, v in zip(_FIELDS, (regex, json_schema, ebnf, response_format)) if v is not None]
    if len(given) > 1:
        raise InvalidRequest(given[1], f"only one of {', '.join(_FIELDS)} may be set (got {given})")
    if regex is not None:
        return GrammarSpec("regex", _nonempty_str("regex", regex), "regex")
    if ebnf is not None:
        return GrammarSpec("ebnf", _nonempty_str("ebnf", ebnf), "ebnf")
    if json_schema is not None:
        return GrammarSpec("json_schema", _schema_text("json_schema", json_schema), "json_schema")
    if response_format is not None:
        return _response_format(response_format)
    return None


def _nonempty_str(name: str, v: Any) -> str:
    if not isinstance(v, str) or not v:
        raise InvalidRequest(name, f"must be a non-empty string, got {v!r}")
    return v


def _schema_text(name: str, schema: Any) -> str:
    """The schema as JSON text; a dict is dumped with its key order kept (property order is the
    order the grammar generates them in)."""
    if isinstance(schema, str):
        try:
            parsed = json.loads(schema)
        except RecursionError:
            raise InvalidRequest(name, "is nested too deeply") from None
        except ValueError as e:  # malformed, or a number literal of over 4300 digits
            raise InvalidRequest(name, f"is not valid JSON: {str(e)[:200]}") from None
    else:
        parsed = schema
    if not isinstance(parsed, (dict, bool)):
        raise InvalidRequest(name, f"must be a JSON schema object, got {type(parsed).__name__}")
    depth = _depth(parsed)
    if depth > MAX_SCHEMA_DEPTH:
        raise InvalidRequest(name, f"is nested {depth} levels deep; at most {MAX_SCHEMA_DEPTH}")
    try:
        return schema if isinstance(schema, str) else json.dumps(schema)
    except (RecursionError, ValueError) as e:
        raise InvalidRequest(name, f"cannot be written as JSON: {type(e).__name__}") from None


def _depth(x: Any) -> int:
    """How deeply lists and objects nest in x (without recursion)."""
    deepest, stack = 0, [(x, 1)]
    while stack:
        x, d = stack.pop()
        if isinstance(x, dict):
            x = list(x.values())
        if isinstance(x, list):
            deepest = max(deepest, d)
            if deepest > MAX_SCHEMA_DEPTH:
                return deepest
            stack.extend((v, d + 1) for v in x)
    return deepest


def _response_format(rf: Any) -> GrammarSpec | None:
    name = "response_format"
    if not isinstance(rf, dict) or not isinstance(rf.get("type"), str):
        raise InvalidRequest(name, 'must be an object with a "type"')
    kind = rf["type"]
    if kind == "text":
        return None
    if kind == "json_object":
        return GrammarSpec("json_schema", JSON_OBJECT_SCHEMA, name)
    if kind == "json_schema":
        js = rf.get("json_schema")
        if not isinstance(js, dict):
            raise InvalidRequest(name, 'type "json_schema" needs a "json_schema" object')
        schema = js.get("schema", js.get("schema_"))
        if schema is None:
            raise InvalidRequest(name, 'json_schema.schema is required for type "json_schema"')
        return GrammarSpec("json_schema", _schema_text(name, schema), name)
    raise InvalidRequest(name, f'unsupported type {kind!r} (text, json_object, json_schema)')
