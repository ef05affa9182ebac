"""A chat request's prompt: its messages (tool calls and tool results among them) and the
offered tools through the model's chat template.

A template that reads `tools` (Qwen2.5, Llama 3.1, Hermes ...) gets them as Hugging Face
passes them: `tools=[...]`, assistant messages with `tool_calls` (arguments as objects) and
`role: "tool"` messages. A template without tool support (SmolLM2's, the built-in pair's) gets
plain messages, in the Hermes / Qwen2.5 style:
  - the tool list goes at the end of the system message (one is added when there is none):
      # Tools
      You may call the functions below. Their signatures, one JSON object per line:
      <tools>
      {"type": "function", "function": {...}}
      </tools>
      To call a function, reply with {"name": ..., "arguments": ...} between <tool_call> and
      </tool_call>: ...      (in the --tool-call-parser format)
  - an assistant turn's calls are written after its text in the same format;
  - tool results become a user turn of <tool_response>\\n...\\n</tool_response> blocks (one
    per result; consecutive results share the turn).
"""

from __future__ import annotations

import json
from functools import lru_cache
from typing import Any

from sloserve.server.tool_calls import CallFormat


def template_reads_tools(template: Any) -> bool:
    """Whether the Jinja chat template uses a `tools` variable."""
    return isinstance(template, str) and _reads_tools(template)


@lru_cache(maxsize=8)
def _reads_tools(template: str) -> bool:
    import jinja2
    from jinja2 import meta

    try:
        ast = jinja2.Environment().parse(template)
    except jinja2.TemplateError:
        return False
    return "tools" in meta.find_undeclared_variables(ast)


def _args(text: str) -> Any:
    """A call's arguments for a template: the object when the text is JSON, else the text."""
    try:
        return json.loads(text)
    except ValueError:
        return text


def native_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Messages as Hugging Face templates take them (tool call arguments as objects)."""
    out = []
    for m in messages:
        m = dict(m)
        if m.get("tool_calls"):
            m["tool_calls"] = [{**c, "function": {**c["function"], "arguments": _args(
                c["function"]["arguments"])}} for c in m["tool_calls"]]
        out.append(m)
    return out


def plain_messages(messages: list[dict[str, Any]], tools: list[dict[str, Any]],
                   fmt: CallFormat) -> list[dict[str, Any]]:
    """Messages with only system / user / assistant text, tools and calls written out."""
    out: list[dict[str, Any]] = []
    for m in messages:
        role, content = m["role"], m.get("content") or ""
        if role == "tool":
            block = f"<tool_response>\n{content}\n</tool_response>"
            if out and out[-1].get("_tool"):
                out[-1]["content"] += "\n" + block
            else:
                out.append({"role": "user", "content": block, "_tool": True})
            continue
        if m.get("tool_calls"):
            calls = [fmt.write(c["function"]["name"], _args(c["function"]["arguments"]))
                     for c in m["tool_calls"]]
            content = "\n".join(([content] if content else []) + calls)
        out.append({"role": role, "content": content})
    for m in out:
        m.pop("_tool", None)
    if tools:
        text = tools_prompt(tools, fmt)
        if out and out[0]["role"] in ("system", "developer"):
            out[0]["content"] = f"{out[0]['content']}\n\n{text}" if out[0]["content"] else text
        else:
            out.insert(0, {"role": "system", "content": text})
    return out


def tools_prompt(tools: list[dict[str, Any]], fmt: CallFormat) -> str:
    lines = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    return ("# Tools\n\nYou may call the functions below. Their signatures, one JSON object "
            f"per line:\n<tools>\n{lines}\n</tools>\n\n{fmt.instructions()}")


def render(tokenizer, messages: list[dict[str, Any]], tools: list[dict[str, Any]],
           fmt: CallFormat) -> str:
    """The prompt text, with the generation prompt. Raises what the template raises."""
    if template_reads_tools(getattr(tokenizer, "chat_template", None)):
        return tokenizer.apply_chat_template(native_messages(messages), tools=tools or None,
                                             tokenize=False, add_generation_prompt=True)
    return tokenizer.apply_chat_template(plain_messages(messages, tools, fmt), tokenize=False,
                                         add_generation_prompt=True)
