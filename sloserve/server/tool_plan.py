"""What a chat request's `tools` and `tool_choice` ask for, checked (a bad spec is a 400
naming the field) and resolved into a ToolPlan: which functions the prompt offers, how the
answer is read, and for "required" or a named function the grammar the answer is held to.

As SGLang serves them: tool_choice defaults to "auto" when tools are given, else "none";
"none" offers no tools and reads no calls; a named function offers only that one. "required"
and named choices hold the answer to the JSON array of calls [{"name": ..., "parameters":
{...}}] (name: the enum of the offered names; parameters: the function's own schema; one item
at most with parallel_tool_calls false) through the same constraint path as response_format
json_schema, so every call's arguments parse against its schema, under speculation too.
"auto" reads calls in the --tool-call-parser format when the model writes them.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict

from sloserve.runtime.constraints.spec import GrammarSpec, grammar_spec
from sloserve.runtime.errors import InvalidRequest
from sloserve.server.errors import APIError
from sloserve.server.http_options import TOOL_CALL_PARSERS
from sloserve.server.tool_calls import DEFAULT_FORMAT, FORMATS, CallFormat

STRICT = ConfigDict(extra="allow", strict=True)
_NAME = re.compile(r"[A-Za-z0-9_.:-]{1,64}")  # OpenAI's rule for function names, plus . and :


class FunctionSpec(BaseModel):
    model_config = STRICT

    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema object
    strict: bool | None = None


class ToolSpec(BaseModel):
    model_config = STRICT

    type: Literal["function"] = "function"
    function: FunctionSpec


class ChosenFunction(BaseModel):
    model_config = STRICT

    name: str


class NamedToolChoice(BaseModel):
    model_config = STRICT

    type: Literal["function"] = "function"
    function: ChosenFunction


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


@dataclass(frozen=True)
class ToolPlan:
    """offered: the functions the prompt describes (OpenAI's tool objects); fmt: how calls are
    written in the prompt; reads: "none", "text" (calls in fmt) or "array" (the grammar's JSON
    array); grammar: the constraint of required / named choices."""

    offered: list[dict[str, Any]]
    fmt: CallFormat
    reads: Literal["none", "text", "array"]
    grammar: GrammarSpec | None = None

    @property
    def names(self) -> frozenset[str]:
        return frozenset(t["function"]["name"] for t in self.offered)


def plan_tools(tools: list[ToolSpec] | None, choice: ToolChoice | None, parallel: bool | None,
               parser: str | None) -> ToolPlan:
    """The request's ToolPlan; 400 naming the field for a bad spec or choice."""
    tools = tools or []
    _check_specs(tools)
    if choice is None:
        choice = "auto" if tools else "none"
    fmt = FORMATS[parser] if parser is not None else DEFAULT_FORMAT
    if choice == "none" or (choice == "auto" and not tools):
        return ToolPlan([], fmt, "none")
    if not tools:
        raise APIError.bad("tool_choice", f"{_show(choice)} needs tools")
    if choice == "auto":
        if parser is None:
            raise APIError.bad("tool_choice", '"auto" needs the server started with '
                               f"--tool-call-parser ({', '.join(TOOL_CALL_PARSERS)}); "
                               '"required", a named function and "none" work without it')
        return ToolPlan([_dump(t) for t in tools], fmt, "text")
    if isinstance(choice, NamedToolChoice):
        chosen = [t for t in tools if t.function.name == choice.function.name]
        if not chosen:
            raise APIError.bad("tool_choice.function.name", f"{choice.function.name!r} is not "
                               "among the tools")
    else:
        chosen = tools
    schema = _calls_schema(chosen, parallel is not False)
    try:
        spec = grammar_spec(json_schema=schema)
    except InvalidRequest as e:
        raise APIError.bad("tools", str(e).split(": ", 1)[-1]) from None
    assert spec is not None
    return ToolPlan([_dump(t) for t in chosen], fmt, "array",
                    GrammarSpec(spec.kind, spec.text, "tools"))


def _check_specs(tools: list[ToolSpec]) -> None:
    seen: set[str] = set()
    for i, t in enumerate(tools):
        name = t.function.name
        if not _NAME.fullmatch(name):
            raise APIError.bad(f"tools[{i}].function.name", f"{name!r:.80} must be 1 to 64 "
                               "letters, digits, _ . : or -")
        if name in seen:
            raise APIError.bad(f"tools[{i}].function.name", f"{name!r} is given twice")
        seen.add(name)
        params = t.function.parameters
        if params is not None:
            if params.get("type", "object") != "object":
                raise APIError.bad(f"tools[{i}].function.parameters", "must be a JSON schema "
                                   f"of an object (got type {params.get('type')!r:.40})")
            try:
                grammar_spec(json_schema=params)
            except InvalidRequest as e:
                raise APIError.bad(f"tools[{i}].function.parameters",
                                   str(e).split(": ", 1)[-1]) from None


def _calls_schema(tools: list[ToolSpec], parallel: bool) -> dict[str, Any]:
    """The JSON schema of a required / named answer; each function's $defs are hoisted to
    the root, where its "#/$defs/..." references point."""
    items: list[dict[str, Any]] = []
    defs: dict[str, Any] = {}
    for i, t in enumerate(tools):
        params = dict(t.function.parameters or {"type": "object", "properties": {}})
        for k, v in params.pop("$defs", {}).items():
            if defs.get(k, v) != v:
                raise APIError.bad(f"tools[{i}].function.parameters", f"$defs.{k} differs "
                                   "from another tool's definition of the same name")
            defs[k] = v
        items.append({"type": "object", "properties": {
            "name": {"type": "string", "enum": [t.function.name]}, "parameters": params},
            "required": ["name", "parameters"]})
    schema: dict[str, Any] = {"type": "array", "minItems": 1,
                              "items": items[0] if len(items) == 1 else {"anyOf": items}}
    if not parallel:
        schema["maxItems"] = 1
    if defs:
        schema["$defs"] = defs
    return schema


def _dump(t: ToolSpec) -> dict[str, Any]:
    return t.model_dump(exclude_none=True, exclude_unset=False)


def _show(choice: Any) -> str:
    return json.dumps(choice) if isinstance(choice, str) else "a named function"
