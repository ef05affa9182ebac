"""The one table of request options of both HTTP APIs: SGLang's /generate (`sampling_params`
and a few request fields) and the OpenAI endpoints. Each option is served by an API, or is a
400 naming it when set off its neutral value there; both APIs check unserved options and build
the engine's SamplingParams through the functions below, so they cannot drift apart (a test
walks the table through both, and README's option list is checked against `markdown()`).

Unknown keys follow SGLang 0.5.23 in both: unknown `sampling_params` keys of /generate are a
400 (SGLang's API contract rejects them: "unknown field"), unknown top-level keys of /generate
and of the OpenAI bodies are ignored (logged at debug level).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

from sloserve.runtime.errors import InvalidRequest
from sloserve.runtime.sampling_params import SamplingParams
from sloserve.server.errors import APIError
from sloserve.slo import request_slos

API = Literal["generate", "openai"]
BOTH: tuple[API, ...] = ("generate", "openai")


@dataclass(frozen=True)
class Option:
    """name: SGLang's name on /generate; openai: the OpenAI endpoints' name ("" the same, None
    not there); generate: where /generate takes it (None: not there); served: the APIs that
    serve it, elsewhere only `neutral` values pass; engine: its SamplingParams field ("" the
    same, None none); example: a value off the default (tests, docs)."""

    name: str
    example: Any
    served: tuple[API, ...] = BOTH
    neutral: tuple = (None,)
    why: str = "is not supported by this server"
    openai: str | None = ""
    generate: Literal["sampling_params", "request"] | None = "sampling_params"
    engine: str | None = ""
    chat_only: bool = False
    completions_only: bool = False

    @property
    def openai_name(self) -> str | None:
        return self.name if self.openai == "" else self.openai

    def where(self, api: API) -> str | None:
        """The option's name in `api` (a /generate sampling key with its prefix), or None."""
        if api == "openai":
            return self.openai_name
        if self.generate is None:
            return None
        return ("sampling_params." if self.generate == "sampling_params" else "") + self.name


_SLO_ONLY = "custom_params is not supported (but for its tpot_slo, ttft_slo)"
OPTIONS: tuple[Option, ...] = (
    Option("max_new_tokens", 3, openai="max_tokens"),
    Option("min_new_tokens", 2, openai="min_tokens"),
    Option("n", 2),
    Option("stop", ["zz"]),
    Option("stop_token_ids", [7]),
    Option("temperature", 0.5),
    Option("top_p", 0.9),
    Option("top_k", 5),
    Option("min_p", 0.05),
    Option("frequency_penalty", 0.5),
    Option("presence_penalty", 0.5),
    Option("repetition_penalty", 1.1),
    Option("ignore_eos", True),
    Option("skip_special_tokens", False),
    Option("spaces_between_special_tokens", False),
    Option("no_stop_trim", True),
    Option("regex", "[a-z ]+"),
    Option("json_schema", '{"type": "object"}'),
    Option("ebnf", 'root ::= "a" | "b"'),
    Option("logit_bias", {"7": 2.0}),
    Option("sampling_seed", 5, openai="seed", engine="seed"),
    Option("seed", 5, openai=None, engine=None),  # /generate's alias of sampling_seed
    Option("stream_interval", 2, engine=None),
    Option("tpot_slo", 0.5),
    Option("ttft_slo", 2.0),
    Option("token_ids_logprob", [5], served=("generate",), neutral=(None, []),
           why="is served on /generate only (as SGLang)", generate="request",
           engine="logprob_token_ids"),
    Option("custom_params", {"x": 1}, served=(), neutral=(None, {}), why=_SLO_ONLY,
           engine=None),
    Option("stop_regex", "x+", served=(), neutral=(None, "", []),
           why="is not supported; use stop strings", engine=None),
    Option("structural_tag", '{"type": "structural_tag"}', served=(),
           why="is not supported; use regex, json_schema, ebnf or response_format",
           engine=None),
    Option("watermark", {"enabled": True}, served=(), engine=None),
    Option("beam_width", 2, served=(), neutral=(None, 1), why="beam search is not supported",
           openai=None, engine=None),
    Option("choice", ["a", "b"], served=(), neutral=(None, []), openai=None, engine=None,
           why="is not supported; use regex"),
    Option("lora_path", "adapter", served=(), why="LoRA adapters are not supported",
           generate="request", engine=None),
    Option("custom_logit_processor", "x", served=(), generate="request", engine=None),
    Option("return_hidden_states", True, served=(), neutral=(None, False), generate="request",
           engine=None),
    Option("best_of", 2, served=(), neutral=(None, 1), why="only best_of=1 is supported",
           generate=None, engine=None, completions_only=True),
    Option("suffix", "x", served=(), neutral=(None, ""), generate=None, engine=None,
           completions_only=True),
    Option("continue_final_message", True, served=(), neutral=(False,), generate=None,
           engine=None, chat_only=True),
)
BY_NAME = {o.name: o for o in OPTIONS}
_BY_ENGINE = {(o.name if o.engine == "" else o.engine): o for o in OPTIONS if o.engine is not None}


def check_unserved(api: API, get: Callable[[Option], Any]) -> None:
    """400 naming the first option `api` does not serve that is set off its neutral value;
    get(option) is the request's value (custom_params without its SLO keys)."""
    for opt in OPTIONS:
        where = opt.where(api)
        if where is None or api in opt.served:
            continue
        value = get(opt)
        if opt.name == "custom_params":
            value = request_slos({"custom_params": value})["custom_params"]
        if value not in opt.neutral:
            raise APIError.bad(where, f"{opt.why} (got {value!r:.80})")


def engine_params(api: API, values: Mapping[str, Any], *, max_new_tokens: int,
                  logprobs: int | None = None) -> SamplingParams:
    """The engine's SamplingParams from the served options' values (keyed by the table's
    names; absent ones keep the engine's defaults); a bad value is a 400 naming the option as
    `api` calls it."""
    kw: dict[str, Any] = {}
    for opt in OPTIONS:
        if opt.engine is None or api not in opt.served or opt.name not in values:
            continue
        value = values[opt.name]
        if value is None:  # the engine's default
            continue
        if isinstance(value, list):
            value = tuple(value)
        kw[opt.name if opt.engine == "" else opt.engine] = value
    if isinstance(kw.get("stop"), str):
        kw["stop"] = (kw["stop"],)
    kw["max_new_tokens"] = max_new_tokens
    try:
        return SamplingParams(**kw, logprobs=logprobs)
    except InvalidRequest as e:
        known = _BY_ENGINE.get(e.field) or BY_NAME.get(e.field)
        name = (known.where(api) if known is not None else None) or e.field
        raise APIError.bad(name, str(e).split(": ", 1)[1] if ": " in str(e) else str(e)) \
            from None


def markdown() -> str:
    """README's option table (README is checked against it)."""
    rows = ["| option (/generate) | OpenAI name | /generate | OpenAI |", "|---|---|---|---|"]
    for o in OPTIONS:
        gen = "-" if o.generate is None else ("served" if "generate" in o.served else "400")
        oai = "-" if o.openai_name is None else ("served" if "openai" in o.served else "400")
        place = "" if o.generate != "request" else " (top level)"
        name = "-" if o.generate is None else f"`{o.name}`{place}"
        rows.append(f"| {name} | {'-' if o.openai_name is None else f'`{o.openai_name}`'} "
                    f"| {gen} | {oai} |")
    return "\n".join(rows)
