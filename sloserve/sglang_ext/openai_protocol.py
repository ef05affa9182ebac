"""OpenAI-compatible request bodies (/v1/completions, /v1/chat/completions).

Standard fields the server cannot honour are accepted only at their neutral value; unknown
fields are a 400 naming them. Extensions (send them with the official client's `extra_body`):
`top_k`, `ignore_eos`, `stop_token_ids`, and the per-request SLOs `tpot_slo` / `ttft_slo` in
seconds.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from sloserve.runtime.request import InvalidRequest, SamplingParams
from sloserve.sglang_ext.errors import APIError

STRICT = ConfigDict(extra="forbid", strict=True)


class StreamOptions(BaseModel):
    model_config = STRICT

    include_usage: bool = False


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
    # extensions
    top_k: int = -1
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    tpot_slo: float | None = None
    ttft_slo: float | None = None

    def _check_neutral(self, extra: dict[str, tuple[Any, tuple, str]]) -> None:
        checks = {
            "n": (self.n, (1,), "only n=1 is supported"),
            "presence_penalty": (self.presence_penalty, (None, 0.0), "penalties are not supported"),
            "frequency_penalty": (self.frequency_penalty, (None, 0.0),
                                  "penalties are not supported"),
            "logit_bias": (self.logit_bias, (None, {}), "logit_bias is not supported"),
            **extra,
        }
        for name, (value, ok, why) in checks.items():
            if value not in ok:
                raise APIError.bad(name, f"{why} (got {value!r})")

    def engine_params(self, max_new_tokens: int) -> SamplingParams:
        try:
            return SamplingParams(
                max_new_tokens=max_new_tokens,
                temperature=1.0 if self.temperature is None else self.temperature,
                top_p=1.0 if self.top_p is None else self.top_p, top_k=self.top_k,
                seed=self.seed, stop=tuple([self.stop] if isinstance(self.stop, str)
                                           else self.stop or ()),
                stop_token_ids=tuple(self.stop_token_ids or ()), ignore_eos=self.ignore_eos,
                tpot_slo=self.tpot_slo, ttft_slo=self.ttft_slo,
            )
        except InvalidRequest as e:
            name = "max_tokens" if e.field == "max_new_tokens" else e.field
            raise APIError.bad(name, str(e).split(": ", 1)[1]) from None


class CompletionRequest(_Sampling):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None

    def check(self) -> None:
        self._check_neutral({
            "logprobs": (self.logprobs, (None,), "logprobs are not supported here; use "
                         "/generate with return_logprob"),
            "echo": (self.echo, (False,), "echo is not supported"),
            "best_of": (self.best_of, (None, 1), "only best_of=1 is supported"),
            "suffix": (self.suffix, (None, ""), "suffix is not supported"),
        })

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


class ChatMessage(BaseModel):
    model_config = STRICT

    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart] | None = None
    name: str | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(p.text for p in self.content)
        return self.content or ""


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    response_format: dict[str, Any] | None = None
    tools: list[Any] | None = None
    tool_choice: str | None = None
    parallel_tool_calls: bool | None = None

    def check(self) -> None:
        self._check_neutral({
            "logprobs": (self.logprobs, (None, False), "logprobs are not supported here; use "
                         "/generate with return_logprob"),
            "top_logprobs": (self.top_logprobs, (None, 0), "logprobs are not supported"),
            "response_format": (self.response_format, (None, {"type": "text"}),
                                "structured output is not supported"),
            "tools": (self.tools, (None, []), "tool calling is not supported"),
            "tool_choice": (self.tool_choice, (None, "none", "auto"),
                            "tool calling is not supported"),
        })
        if self.max_tokens is not None and self.max_completion_tokens is not None:
            raise APIError.bad("max_completion_tokens", "give max_tokens or "
                               "max_completion_tokens, not both")

    @property
    def max_new(self) -> int | None:
        return self.max_completion_tokens if self.max_tokens is None else self.max_tokens
