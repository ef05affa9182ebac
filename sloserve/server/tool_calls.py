"""Tool calls in a chat answer: the text formats of `--tool-call-parser` (SGLang's names), how
a call is written into a prompt, and how calls are read back from an answer, whole or as it
streams.

Formats (the call object is {"name": ..., "arguments": {...}}; llama3's key is "parameters"):
  qwen25 / qwen   <tool_call>\\n{call}\\n</tool_call>, one block per call
  hermes          <tool_call>{call}</tool_call>
  llama3          <|python_tag|>{call} or a bare {call} opening the answer; calls joined by ";"
With tool_choice "required" or a named function the answer is instead the JSON array of calls
[{"name": ..., "parameters": {...}}] that the grammar (tool_plan.py) holds it to, as SGLang.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from sloserve.server.http_options import TOOL_CALL_PARSERS


@dataclass(frozen=True)
class Call:
    """One parsed call: the function's name and its arguments as JSON text."""

    name: str
    arguments: str


@dataclass(frozen=True)
class CallFormat:
    """A model family's tool-call text. `close` is empty where a call ends with its JSON."""

    name: str
    open: str
    close: str
    args_key: str = "arguments"
    separator: str = "\n"

    def write(self, name: str, arguments: Any) -> str:
        """A call as the model writes it (assistant turns of the history)."""
        obj = json.dumps({"name": name, self.args_key: arguments}, ensure_ascii=False)
        return f"{self.open}{obj}{self.close}"

    def instructions(self) -> str:
        """How to call, for the system prompt of templates without tool support."""
        shape = f'{{"name": <function name>, "{self.args_key}": <arguments as a JSON object>}}'
        return (f"To call a function, reply with {shape} between {self.open.strip()} and "
                f"{self.close.strip() or 'the end of your reply'}:\n"
                f"{self.open}{shape}{self.close}")


FORMATS = {
    "qwen25": CallFormat("qwen25", "<tool_call>\n", "\n</tool_call>"),
    "hermes": CallFormat("hermes", "<tool_call>", "</tool_call>"),
    "llama3": CallFormat("llama3", "<|python_tag|>", "", "parameters", ";"),
}
FORMATS["qwen"] = FORMATS["qwen25"]
assert set(FORMATS) == set(TOOL_CALL_PARSERS)
# the format a prompt describes when the server has no --tool-call-parser (required and named
# choices are grammar-held JSON arrays, whatever the format)
DEFAULT_FORMAT = FORMATS["hermes"]
PYTHON_TAG = FORMATS["llama3"].open


def call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


def _call_of(obj: Any, names: frozenset[str], keys: tuple[str, ...]) -> Call | None:
    """A call from a decoded JSON object; None unless it names one of the offered functions
    and its arguments are an object (or JSON text of one)."""
    if not isinstance(obj, dict) or obj.get("name") not in names:
        return None
    args: Any = next((obj[k] for k in keys if k in obj), {})
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return Call(obj["name"], json.dumps(args, ensure_ascii=False))


_KEYS = ("arguments", "parameters")
_TAGGED = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)


def parse_calls(fmt: CallFormat, text: str, names: frozenset[str]) -> tuple[str | None, list[Call]]:
    """(the text before the calls, or None when empty; the calls) of a whole answer in `fmt`.
    An answer without a well-formed call to an offered function is all content."""
    if fmt.name == "llama3":
        head, calls = _parse_llama3(text, names)
    else:
        start = text.find("<tool_call>")
        if start < 0:
            return text, []
        head = text[:start]
        calls = []
        for body in _TAGGED.findall(text, start):
            try:
                obj = json.loads(body)
            except ValueError:
                continue
            call = _call_of(obj, names, _KEYS)
            if call is not None:
                calls.append(call)
    if not calls:
        return text, []
    head = head.strip()
    return head or None, calls


def _parse_llama3(text: str, names: frozenset[str]) -> tuple[str, list[Call]]:
    if PYTHON_TAG in text:
        head, rest = text.split(PYTHON_TAG, 1)
    elif text.lstrip().startswith("{"):
        head, rest = "", text
    else:
        return text, []
    dec, calls, i = json.JSONDecoder(), [], 0
    while True:
        while i < len(rest) and rest[i] in " \n\t;":
            i += 1
        if rest.startswith(PYTHON_TAG, i):  # each call may carry its own tag
            i += len(PYTHON_TAG)
            continue
        if i >= len(rest):
            break
        try:
            obj, i = dec.raw_decode(rest, i)
        except ValueError:
            break
        call = _call_of(obj, names, _KEYS)
        if call is not None:
            calls.append(call)
    return head, calls


def parse_call_array(text: str, names: frozenset[str]) -> list[Call]:
    """The calls of a required / named answer (a JSON array of {"name", "parameters"})."""
    try:
        arr = json.loads(text)
    except ValueError:
        return []
    if isinstance(arr, dict):
        arr = [arr]
    if not isinstance(arr, list):
        return []
    calls = [_call_of(o, names, ("parameters", "arguments")) for o in arr]
    return [c for c in calls if c is not None] if all(calls) else []


@dataclass
class StreamedCalls:
    """Splits a streamed answer into content deltas and finished calls. Content is passed on
    as it comes, but for a tail that may be the start of a call marker (held back until it is
    not); a call is passed on whole once its text is complete (as two deltas: the id and name,
    then the arguments, the shape the openai client accumulates)."""

    fmt: CallFormat | None  # None: a required / named answer (a JSON array)
    names: frozenset[str]
    text: str = ""
    sent_content: int = 0  # characters of `text` passed on as content
    calls: list[Call] = field(default_factory=list)
    in_calls: bool = False  # the answer reached its first call marker

    def feed(self, delta: str, finished: bool) -> tuple[str, list[dict]]:
        """(content delta, tool_calls deltas) after `delta`; finished: the answer is whole."""
        self.text += delta
        if self.fmt is None:
            deltas = self._new(self._array_calls())
            return (self.text if finished and not self.calls else ""), deltas
        content = ""
        if not self.in_calls:
            marker = self._marker_at()
            if marker < 0:
                upto = len(self.text) if finished else len(self.text) - self._held_tail()
                content = self.text[self.sent_content:upto]
                self.sent_content = max(self.sent_content, upto)
                return content, []
            self.in_calls = True
            content = self.text[self.sent_content:marker]
            self.sent_content = marker
        deltas = self._new(self._complete_calls(finished))
        if finished and not self.calls:  # no well-formed call after all: it is content
            return content + self.text[self.sent_content:], deltas
        return (content if content.strip() else ""), deltas

    def _marker_at(self) -> int:
        assert self.fmt is not None
        if self.fmt.name == "llama3":
            i = self.text.find(PYTHON_TAG)
            if i < 0 and self.text.lstrip().startswith("{"):
                return 0
            return i
        return self.text.find("<tool_call>")

    def _held_tail(self) -> int:
        """Characters at the end that could begin a call marker."""
        assert self.fmt is not None
        marker = PYTHON_TAG if self.fmt.name == "llama3" else "<tool_call>"
        if self.fmt.name == "llama3" and not self.text.strip():
            return len(self.text)  # a bare call may still open the answer
        for n in range(min(len(marker) - 1, len(self.text)), 0, -1):
            if self.text.endswith(marker[:n]):
                return n
        return 0

    def _complete_calls(self, finished: bool) -> list[Call]:
        assert self.fmt is not None
        rest = self.text[self.sent_content:]
        if self.fmt.name == "llama3":
            if not finished:  # a call is known whole only once the next starts or it ends
                cut = max(rest.rfind(";"), 0)
                rest = rest[:cut]
            return _parse_llama3(rest, self.names)[1]
        return parse_calls(self.fmt, rest, self.names)[1]

    def _array_calls(self) -> list[Call]:
        """Whole objects of the JSON array so far (each is complete once decoded)."""
        dec, out = json.JSONDecoder(), []
        i = self.text.find("[") + 1
        while i > 0:
            while i < len(self.text) and self.text[i] in " \n\t\r,":
                i += 1
            try:
                obj, i = dec.raw_decode(self.text, i)
            except ValueError:
                break
            call = _call_of(obj, self.names, ("parameters", "arguments"))
            if call is not None:
                out.append(call)
        return out

    def _new(self, calls: list[Call]) -> list[dict]:
        deltas: list[dict] = []
        for call in calls[len(self.calls):]:
            index = len(self.calls)
            self.calls.append(call)
            deltas.append({"index": index, "id": call_id(), "type": "function",
                           "function": {"name": call.name, "arguments": ""}})
            deltas.append({"index": index, "function": {"arguments": call.arguments}})
        return deltas
