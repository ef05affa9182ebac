"""SGLang's native `/generate` protocol (SGLang's `GenerateReqInput` and `SamplingParams`).

Every key SGLang's frontend (`sglang.RuntimeEndpoint`) and its benchmark client send is
accepted. Which options are served and which are accepted only at their neutral value (any
other value a 400 naming the key) is the table of options.py, shared with the OpenAI
endpoints. Unknown top-level keys are accepted and ignored (logged at debug level), as SGLang
does: routers such as sglang-router re-serialise requests with fields of newer SGLang
versions. Unknown keys inside `sampling_params` stay a 400 (SGLang 0.5.23's API contract
rejects them too). Per-request SLOs are the sampling parameters `tpot_slo` and `ttft_slo`, in
seconds.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict

from sloserve.runtime.constraints.spec import grammar_spec
from sloserve.runtime.request import InvalidRequest, SamplingParams
from sloserve.server.errors import APIError, from_invalid
from sloserve.server.options import BY_NAME, check_unserved, engine_params
from sloserve.slo import request_slos

STRICT = ConfigDict(extra="forbid", strict=True)
# a request body's top level: unknown keys are kept aside (model_extra), logged and ignored
LENIENT = ConfigDict(extra="allow", strict=True)


class SGLangSamplingParams(BaseModel):
    """`sampling_params` of /generate, SGLang's names and defaults."""

    model_config = STRICT

    max_new_tokens: int | None = 128  # 0: prefill only (prompt_tokens, logprobs), no output
    min_new_tokens: int = 0
    n: int = 1
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    stop_regex: str | list[str] | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    no_stop_trim: bool = False
    regex: str | None = None
    json_schema: str | None = None
    ebnf: str | None = None
    structural_tag: str | None = None
    logit_bias: dict[str, float] | None = None
    custom_params: dict[str, Any] | None = None
    watermark: dict[str, Any] | None = None  # SGLang's; not served (options.py)
    beam_width: int | None = None  # SGLang's; not served
    choice: list[str] | None = None  # SGLang's; not served
    sampling_seed: int | None = None
    seed: int | None = None  # alias of sampling_seed
    tpot_slo: float | None = None  # seconds per output token this request asks for
    ttft_slo: float | None = None  # seconds to the first token
    stream_interval: int | None = None  # stream a chunk every this many tokens (None: 1)


def to_engine_params(
    sp: SGLangSamplingParams, *, max_new_tokens: int, logprobs: int | None = None,
    logprob_token_ids: list[int] | None = None,
) -> SamplingParams:
    """Engine sampling parameters; 400 naming the key for unsupported or out-of-range values
    (options.py). `max_new_tokens` is the resolved (positive) token budget; `logprobs`: None,
    or the number of top log-probabilities per output token the engine records."""
    check_unserved("generate", lambda o: getattr(sp, o.name)
                   if o.generate == "sampling_params" else None)
    if sp.seed is not None and sp.sampling_seed is not None and sp.seed != sp.sampling_seed:
        raise APIError.bad("sampling_params.seed", "differs from sampling_seed (give one of them)")
    try:
        grammar_spec(regex=sp.regex, json_schema=sp.json_schema, ebnf=sp.ebnf)
    except InvalidRequest as e:
        raise from_invalid(e, "sampling_params.") from None
    slos = request_slos(sp)  # tpot_slo / ttft_slo directly or in custom_params (sloserve.slo)
    values = {**sp.model_dump(), "tpot_slo": slos["tpot_slo"], "ttft_slo": slos["ttft_slo"],
              "sampling_seed": sp.sampling_seed if sp.sampling_seed is not None else sp.seed,
              "token_ids_logprob": logprob_token_ids}
    try:
        return engine_params("generate", values, max_new_tokens=max_new_tokens,
                             logprobs=logprobs)
    except APIError as e:  # a bad seed is named by the key the client sent (alias or not)
        if e.param == "sampling_params.sampling_seed" and sp.sampling_seed is None:
            raise APIError.bad("sampling_params.seed", e.message.split(": ", 1)[-1]) from None
        raise


def stream_interval(value: int | None, name: str) -> int:
    """A request's stream_interval: None is the default (1); else an integer >= 1."""
    if value is None:
        return 1
    if value < 1:
        raise APIError.bad(name, f"must be an integer >= 1 or null, got {value}")
    return value


class GenerateRequest(BaseModel):
    """Body of POST /generate: one prompt, or a batch (lists) as SGLang allows."""

    model_config = LENIENT

    text: str | list[str] | None = None
    input_ids: list[int] | list[list[int]] | None = None
    sampling_params: SGLangSamplingParams | list[SGLangSamplingParams] | None = None
    rid: str | list[str] | None = None
    stream: bool = False
    return_logprob: bool | list[bool] | None = None
    logprob_start_len: int | list[int] | None = None
    top_logprobs_num: int | list[int] | None = None
    return_text_in_logprobs: bool = False
    log_metrics: bool = True
    no_logs: bool = False  # this server does not log prompts anyway
    model: str | None = None  # a router's hint (smg sends "unknown"); one model is served here
    # SGLang features this server lacks: accepted only at their neutral value (null, false, 0),
    # since SGLang's clients send some of them by default (e.g. bench_serving's lora_path)
    token_ids_logprob: list[int] | list[list[int]] | None = None
    image_data: Any = None
    video_data: Any = None
    audio_data: Any = None
    input_embeds: Any = None
    lora_path: Any = None
    lora_id: Any = None
    custom_logit_processor: Any = None
    session_params: Any = None
    modalities: Any = None
    return_hidden_states: Any = None
    return_routed_experts: Any = None
    routed_experts_start_len: Any = None
    return_entropy: Any = None
    require_reasoning: Any = None
    bootstrap_host: Any = None
    bootstrap_port: Any = None
    bootstrap_room: Any = None
    bootstrap_pair_key: Any = None
    decode_tp_size: Any = None
    routed_dp_rank: Any = None
    data_parallel_rank: Any = None
    disagg_prefill_dp_rank: Any = None
    priority: Any = None
    extra_key: Any = None
    routing_key: Any = None
    background: Any = None
    return_bytes: Any = None


# request fields of SGLang features that are not options (options.py has those): accepted only
# at their neutral value
_UNSUPPORTED_TOP = tuple(n for n, f in GenerateRequest.model_fields.items()
                         if f.annotation is Any and n not in BY_NAME)


@dataclass
class Item:
    """One prompt of a (possibly batched) /generate request, normalized."""

    index: int
    prompt: str | list[int]
    sp: SGLangSamplingParams
    rid: str
    return_logprob: bool
    logprob_start_len: int  # -1: no prompt logprobs
    top_logprobs_num: int
    return_text: bool  # token texts in the logprob entries
    token_ids_logprob: list[int] | None = None  # these tokens' logprobs at every position


def _per_item(value, n: int, default, name: str, batched: bool) -> list:
    if value is None:
        return [default] * n
    if isinstance(value, list):
        if not batched:
            raise APIError.bad(name, "must be a single value for a single prompt")
        if len(value) != n:
            raise APIError.bad(name, f"a list of {len(value)} values does not match the {n} "
                               "prompts")
        return [default if v is None else v for v in value]
    return [value] * n


def normalize(req: GenerateRequest) -> tuple[list[Item], bool]:
    """The request's prompts as Items, and whether it was a batch (the answer is a list)."""
    check_unserved("generate", lambda o: getattr(req, o.name) if o.generate == "request"
                   else None)
    for key in _UNSUPPORTED_TOP:
        value = getattr(req, key)
        if value is not None and value is not False and value not in (0, [], {}):
            raise APIError.bad(key, f"is not supported by this server (got {value!r:.60})")
    if (req.text is None) == (req.input_ids is None):
        raise APIError.bad("text", "give exactly one of text or input_ids")
    if req.text is not None:
        batched = isinstance(req.text, list)
        prompts: Any = req.text if batched else [req.text]
    else:
        ids: Any = req.input_ids  # not None: exactly one of text, input_ids
        batched = bool(ids) and isinstance(ids[0], list)
        prompts = ids if batched else [ids]
    n = len(prompts)
    if n == 0:
        raise APIError.bad("text" if req.text is not None else "input_ids", "is an empty batch")
    sps = _per_item(req.sampling_params, n, SGLangSamplingParams(), "sampling_params", batched)
    if isinstance(req.rid, list):
        rids = _per_item(req.rid, n, None, "rid", batched)
    elif req.rid is not None and batched:
        rids = [f"{req.rid}_{i}" for i in range(n)]
    else:
        rids = [req.rid] * n
    want = _per_item(req.return_logprob, n, False, "return_logprob", batched)
    start = _per_item(req.logprob_start_len, n, -1, "logprob_start_len", batched)
    top = _per_item(req.top_logprobs_num, n, 0, "top_logprobs_num", batched)
    rids = [r if r is not None else uuid.uuid4().hex for r in rids]
    ids_lp = req.token_ids_logprob
    per_prompt = ids_lp is not None and bool(ids_lp) and isinstance(ids_lp[0], list)
    if per_prompt and not batched:
        raise APIError.bad("token_ids_logprob", "must be a list of token ids for one prompt")
    ids_lp = _per_item(ids_lp if per_prompt else None, n, ids_lp or None, "token_ids_logprob",
                       batched)
    items = [Item(i, prompts[i], sps[i], rids[i], want[i], start[i], top[i],
                  req.return_text_in_logprobs, _ids_or_none(ids_lp[i])) for i in range(n)]
    for it in items:
        if it.logprob_start_len < -1:
            raise APIError.bad("logprob_start_len", f"must be >= -1, got {it.logprob_start_len}")
        if it.top_logprobs_num < 0:
            raise APIError.bad("top_logprobs_num", f"must be >= 0, got {it.top_logprobs_num}")
    if len(set(rids)) != len(rids):
        raise APIError.bad("rid", "request ids in a batch must be distinct")
    return items, batched


class AbortRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    rid: str = ""
    abort_all: bool = False


def finish_reason_json(reason: str | None, matched: str | int | None, completion_tokens: int,
                       message: str | None = None) -> dict | None:
    """SGLang's finish_reason object: {"type": "stop", "matched": ...}, {"type": "length",
    "length": n} or {"type": "abort", "message": ...}; None while running."""
    if reason is None:
        return None
    if reason == "stop":
        return {"type": "stop", "matched": matched}
    if reason == "length":
        return {"type": "length", "length": completion_tokens}
    return {"type": "abort", "message": message or "request aborted"}


def _ids_or_none(ids) -> list[int] | None:
    """One item's token_ids_logprob (a list of ids, checked by SamplingParams), or None."""
    return list(ids) if ids else None
