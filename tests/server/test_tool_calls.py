"""#33 tool calling, without a server: each --tool-call-parser format reads back what it
writes, whole and streamed in any split; required / named answers read as JSON arrays; the
prompt of a template without tool support carries the tools, calls and results; a template
that reads `tools` gets them natively; bad specs are 400s naming the field."""

from __future__ import annotations

import json

import pytest
from transformers import AutoTokenizer

from sloserve.server.chat_prompt import plain_messages, render, template_reads_tools
from sloserve.server.errors import APIError
from sloserve.server.tool_calls import FORMATS, StreamedCalls, parse_call_array, parse_calls
from sloserve.server.tool_plan import NamedToolChoice, ToolSpec, plan_tools

NAMES = frozenset({"get_weather", "add"})
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "the weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}
ADD = {"type": "function", "function": {"name": "add", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}}}


def _answer(fmt_name: str) -> str:
    fmt = FORMATS[fmt_name]
    calls = fmt.separator.join([fmt.write("get_weather", {"city": "Paris ü"}),
                                fmt.write("add", {"a": 1, "b": 2})])
    return ("Let me look. " + calls) if fmt_name != "llama3" else ("Sure: " + calls)


def _streamed(reader: StreamedCalls, text: str, step: int) -> tuple[str, list[dict]]:
    content, deltas = "", []
    pieces = [text[i:i + step] for i in range(0, len(text), step)] or [""]
    for j, piece in enumerate(pieces):
        c, d = reader.feed(piece, j == len(pieces) - 1)
        content += c
        deltas += d
    return content, deltas


def _accumulate(deltas: list[dict]) -> list[tuple[str, dict]]:
    """Tool call deltas accumulated as the openai client does (by index)."""
    calls: dict[int, dict] = {}
    for d in deltas:
        c = calls.setdefault(d["index"], {"name": "", "arguments": ""})
        if "id" in d:
            assert d["id"].startswith("call_") and d["type"] == "function"
        c["name"] += d["function"].get("name", "")
        c["arguments"] += d["function"].get("arguments", "")
    return [(c["name"], json.loads(c["arguments"])) for _, c in sorted(calls.items())]


@pytest.mark.parametrize("fmt_name", ["qwen25", "hermes", "llama3"])
def test_formats_read_back_whole_and_streamed(fmt_name):
    text = _answer(fmt_name)
    content, calls = parse_calls(FORMATS[fmt_name], text, NAMES)
    want = [("get_weather", {"city": "Paris ü"}), ("add", {"a": 1, "b": 2})]
    assert [(c.name, json.loads(c.arguments)) for c in calls] == want
    assert content == text[:text.index(FORMATS[fmt_name].open)].strip()
    for step in (1, 3, 7, len(text)):
        got, deltas = _streamed(StreamedCalls(FORMATS[fmt_name], NAMES), text, step)
        assert got.strip() == content and _accumulate(deltas) == want


@pytest.mark.parametrize("fmt_name", ["qwen25", "hermes", "llama3"])
def test_text_without_a_valid_call_is_content(fmt_name):
    fmt = FORMATS[fmt_name]
    for text in ["just words, < and <tool", fmt.open + '{"name": "nope", "arguments": {}}'
                 + fmt.close, fmt.open + '{"name": "add", "argu']:
        assert parse_calls(fmt, text, NAMES) == (text, [])
        for step in (1, 4):
            got, deltas = _streamed(StreamedCalls(fmt, NAMES), text, step)
            assert got == text and deltas == []


def test_required_answer_is_a_json_array():
    text = '[{"name": "add", "parameters": {"a": 1, "b": 2}}, {"name": "get_weather", ' \
           '"parameters": {"city": "x"}}]'
    calls = parse_call_array(text, NAMES)
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("add", {"a": 1, "b": 2}), ("get_weather", {"city": "x"})]
    for step in (1, 5):
        got, deltas = _streamed(StreamedCalls(None, NAMES), text, step)
        assert got == "" and [n for n, _ in _accumulate(deltas)] == ["add", "get_weather"]
    assert parse_call_array('[{"name": "add", "parameters": {"a"', NAMES) == []


def test_plan_tools_choices_and_bad_specs():
    tools = [ToolSpec.model_validate(WEATHER), ToolSpec.model_validate(ADD)]
    assert plan_tools(None, None, None, None).reads == "none"
    assert plan_tools(tools, "none", None, None).offered == []
    auto = plan_tools(tools, None, None, "qwen25")
    assert auto.reads == "text" and auto.names == NAMES and auto.grammar is None
    req = plan_tools(tools, "required", False, None)
    schema = json.loads(req.grammar.text)
    assert req.reads == "array" and schema["maxItems"] == 1 and len(schema["items"]["anyOf"]) == 2
    named = plan_tools(tools, NamedToolChoice.model_validate(
        {"type": "function", "function": {"name": "add"}}), None, None)
    assert named.names == {"add"} and json.loads(named.grammar.text)["items"]["properties"][
        "name"] == {"type": "string", "enum": ["add"]}
    bad = [
        (tools, None, None, "tool_choice"),  # auto without a parser
        (None, "required", "qwen25", "tool_choice"),
        (tools, NamedToolChoice.model_validate({"function": {"name": "mul"}}), "qwen25",
         "tool_choice.function.name"),
        ([ToolSpec.model_validate({"function": {"name": "a b"}})], "required", None,
         "tools[0].function.name"),
        ([ToolSpec.model_validate({"function": {"name": "f", "parameters": {
            "type": "string"}}})], "required", None, "tools[0].function.parameters"),
        ([tools[0], tools[0]], "required", None, "tools[1].function.name"),
    ]
    for t, choice, parser, field in bad:
        with pytest.raises(APIError) as e:
            plan_tools(t, choice, None, parser)
        assert e.value.status == 400 and e.value.param == field, (field, e.value.message)


HISTORY = [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": "", "tool_calls": [{"id": "call_1", "type": "function",
                                                         "function": {"name": "get_weather",
                                                                      "arguments": '{"city": "Paris"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"},
    {"role": "tool", "tool_call_id": "call_2", "content": "windy"},
]


def test_plain_messages_write_tools_calls_and_results():
    msgs = plain_messages(HISTORY, [WEATHER], FORMATS["qwen25"])
    assert [m["role"] for m in msgs] == ["system", "user", "assistant", "user"]
    assert "<tools>\n" + json.dumps(WEATHER) + "\n</tools>" in msgs[0]["content"]
    assert msgs[2]["content"] == FORMATS["qwen25"].write("get_weather", {"city": "Paris"})
    assert msgs[3]["content"] == ("<tool_response>\nsunny, 21 C\n</tool_response>\n"
                                  "<tool_response>\nwindy\n</tool_response>")
    with_system = plain_messages([{"role": "system", "content": "Be brief."}, *HISTORY[:1]],
                                 [WEATHER], FORMATS["hermes"])
    assert with_system[0]["content"].startswith("Be brief.\n\n# Tools")
    assert plain_messages(HISTORY[:1], [], FORMATS["hermes"]) == HISTORY[:1]


NATIVE = ("{% if tools %}TOOLS:{{ tools | tojson }}\n{% endif %}{% for m in messages %}"
          "[{{ m.role }}]{% if m.tool_calls %}{% for c in m.tool_calls %}CALL {{ c.function.name }}"
          " {{ c.function.arguments.city }}{% endfor %}{% else %}{{ m.content }}{% endif %}\n"
          "{% endfor %}[assistant]")


def test_a_template_that_reads_tools_gets_them_natively(tiny_pair):
    tok = AutoTokenizer.from_pretrained(tiny_pair[0])
    assert not template_reads_tools(tok.chat_template)
    plain = render(tok, HISTORY, [WEATHER], FORMATS["qwen25"])
    assert "<tool_response>\nsunny, 21 C" in plain and "# Tools" in plain
    tok.chat_template = NATIVE
    assert template_reads_tools(NATIVE)
    out = render(tok, HISTORY, [WEATHER], FORMATS["qwen25"])
    assert out.startswith("TOOLS:[") and '"get_weather"' in out
    assert "[assistant]CALL get_weather Paris[tool]sunny, 21 C[tool]windy" in out
