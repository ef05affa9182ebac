"""OpenAI-compatible request bodies (/v1/completions, /v1/chat/completions).

Served: `tools`, `tool_choice`, `parallel_tool_calls` (tool_plan.py), `response_format`
(`json_object`, `json_schema`), completions' `logprobs` and `echo`, chat's `logprobs` /
`top_logprobs`, `stream_options.continuous_usage_stats`, and the sampling options of the table
in options.py, shared with /generate (SGLang's extensions among them, e.g. `top_k`, `min_p`,
`regex`, `tpot_slo`: send them with the official client's `extra_body`). Options the table
marks unserved are accepted only at their neutral value (else a 400 naming them); unknown
fields are accepted and ignored (logged at debug level), as SGLang's and vLLM's OpenAI servers
do.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr

from sloserve.runtime.constraints.spec import GrammarSpec, grammar_spec
from sloserve.runtime.request import InvalidRequest, SamplingParams
from sloserve.server.errors import APIError
from sloserve.server.options import OPTIONS, check_unserved, engine_params
from sloserve.server.protocol import stream_interval
from sloserve.server.tool_plan import ToolChoice, ToolPlan, ToolSpec, plan_tools
from sloserve.slo import request_slos

# unknown keys are kept aside (model_extra), logged and ignored
STRICT = ConfigDict(extra="allow", strict=True)


class StreamOptions(BaseModel):
    model_config = STRICT

    include_usage: bool = False
    continuous_usage_stats: bool = False  # usage so far in every chunk (vLLM, SGLang)


class _Sampling(BaseModel):
    """Fields shared by both endpoints."""

    model_config = STRICT

    model: str
    temperature: float | None = None
    top_p: float | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None  # an end-user id; recorded nowhere
    response_format: dict[str, Any] | None = None
    # extensions
    top_k: int = -1
    min_tokens: int = 0
    repetition_penalty: float | None = None
    regex: str | None = None
    json_schema: str | dict[str, Any] | None = None
    ebnf: str | None = None
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    no_stop_trim: bool = False
    tpot_slo: float | None = None
    ttft_slo: float | None = None
    custom_params: dict[str, Any] | None = None  # SGLang's spelling: only the SLO keys
    min_p: float = 0.0
    spaces_between_special_tokens: bool = True
    stream_interval: int | None = None  # a chunk every this many tokens (None: 1)
    # SGLang's extensions that sglang-router sends at their defaults
    skip_special_tokens: bool = True
    return_hidden_states: bool = False
    # SGLang's extensions that change the output and are not served here: known, so that a
    # value off the default is a 400 rather than silently dropped as an unknown key
    stop_regex: str | list[str] | None = None
    structural_tag: Any = None
    lora_path: Any = None
    custom_logit_processor: Any = None
    token_ids_logprob: Any = None
    watermark: Any = None
    # no reasoning parser runs here: there is no reasoning text to separate, either way
    separate_reasoning: bool = True
    stream_reasoning: bool = True

    def _check_neutral(self) -> None:
        """400 naming an option these endpoints do not serve that is set (options.py)."""
        check_unserved("openai", lambda o: getattr(self, o.openai_name or "", o.neutral[0]))
        stream_interval(self.stream_interval, "stream_interval")

    def grammar(self) -> GrammarSpec | None:
        """The output constraint (regex, json_schema, ebnf or response_format); 400 naming
        the field when malformed or more than one is given."""
        try:
            return grammar_spec(regex=self.regex, json_schema=self.json_schema, ebnf=self.ebnf,
                                response_format=self.response_format)
        except InvalidRequest as e:
            raise APIError.bad(e.field, str(e).split(": ", 1)[1]) from None

    def _skip_special(self) -> bool:
        return self.skip_special_tokens

    def engine_params(self, max_new_tokens: int, logprobs: int | None = None) -> SamplingParams:
        """logprobs: None, or how many top log-probabilities per output token to record."""
        values = {o.name: getattr(self, o.openai_name) for o in OPTIONS
                  if "openai" in o.served and o.openai_name in type(self).model_fields}
        spec = self.grammar()
        values.update(regex=None, json_schema=None, ebnf=None, **_slos(self),
                      skip_special_tokens=self._skip_special())
        if spec is not None:
            values[spec.kind] = spec.text
        return engine_params("openai", values, max_new_tokens=max_new_tokens, logprobs=logprobs)


def _slos(req: Any) -> dict[str, Any]:
    """tpot_slo / ttft_slo, top-level (extra_body) or in custom_params (sloserve.slo)."""
    slos = request_slos(req)
    return {"tpot_slo": slos["tpot_slo"], "ttft_slo": slos["ttft_slo"]}


MAX_TOP_LOGPROBS = 20


class CompletionRequest(_Sampling):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None

    def check(self) -> None:
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_TOP_LOGPROBS:
            raise APIError.bad("logprobs", f"must be in [0, {MAX_TOP_LOGPROBS}], got "
                               f"{self.logprobs}")
        self._check_neutral()

    @property
    def logprobs_k(self) -> int | None:
        """Top log-probabilities per output token to record (None: no logprobs)."""
        return self.logprobs

    def prompts(self) -> list[str | list[int]]:
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if not p:
            raise APIError.bad("prompt", "is empty")
        if isinstance(p[0], int):
            return [p]
        return list(p)


class TextPart(BaseModel):
    model_config = STRICT

    type: Literal["text"]
    text: str


class CalledFunction(BaseModel):
    model_config = STRICT

    name: str
    arguments: str | dict[str, Any] = "{}"  # JSON text (OpenAI); an object is taken too


class MessageToolCall(BaseModel):
    model_config = STRICT

    id: str | None = None
    type: Literal["function"] = "function"
    function: CalledFunction


class ChatMessage(BaseModel):
    model_config = STRICT

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[MessageToolCall] | None = None  # an assistant turn's calls
    tool_call_id: str | None = None  # a tool result: the call it answers

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(p.text for p in self.content)
        return self.content or ""

    def as_dict(self) -> dict[str, Any]:
        """The message as a chat template takes it (tool call arguments as JSON text)."""
        m: dict[str, Any] = {"role": self.role, "content": self.text()}
        if self.name is not None:
            m["name"] = self.name
        if self.tool_calls:
            m["tool_calls"] = [{"id": c.id, "type": "function", "function": {
                "name": c.function.name, "arguments": c.function.arguments
                if isinstance(c.function.arguments, str)
                else json.dumps(c.function.arguments, ensure_ascii=False)}}
                for c in self.tool_calls]
        if self.tool_call_id is not None:
            m["tool_call_id"] = self.tool_call_id
        return m


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    tools: list[ToolSpec] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = None
    continue_final_message: bool = False
    _plan: ToolPlan | None = PrivateAttr(default=None)

    def check(self) -> None:
        for i, m in enumerate(self.messages):
            if m.tool_calls and m.role != "assistant":
                raise APIError.bad(f"messages[{i}].tool_calls", "only assistant messages "
                                   "hold tool calls")
        if self.top_logprobs is not None:
            if not self.logprobs:
                raise APIError.bad("top_logprobs", "needs logprobs: true")
            if not 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS:
                raise APIError.bad("top_logprobs", f"must be in [0, {MAX_TOP_LOGPROBS}], got "
                                   f"{self.top_logprobs}")
        self._check_neutral()

    @property
    def logprobs_k(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def plan_tools(self, parser: str | None) -> ToolPlan:
        """The request's ToolPlan (tool_plan.py), kept for grammar() and engine_params()."""
        self._plan = plan_tools(self.tools, self.tool_choice, self.parallel_tool_calls, parser)
        if self._plan.grammar is not None and super().grammar() is not None:
            raise APIError.bad("tool_choice", "\"required\" or a named function cannot be "
                               "combined with response_format, regex, json_schema or ebnf")
        return self._plan

    def grammar(self) -> GrammarSpec | None:
        if self._plan is not None and self._plan.grammar is not None:
            return self._plan.grammar
        return super().grammar()

    def _skip_special(self) -> bool:
        # as SGLang: special tokens stay in the text the tool-call parser reads (a format's
        # marker may be one, e.g. llama3's <|python_tag|>)
        reads = self._plan is not None and self._plan.reads == "text"
        return self.skip_special_tokens and not reads

    @property
    def max_new(self) -> int | None:
        """max_completion_tokens, else the deprecated max_tokens (both given: the former, as
        vLLM and SGLang take it)."""
        return self.max_tokens if self.max_completion_tokens is None else \
            self.max_completion_tokens
