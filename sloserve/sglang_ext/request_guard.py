"""What a request body must pass before SGLang's server sees it (`--engine sglang`).

SGLang 0.5.23's server process dies on some well-formed values (a `top_k` of 2**63, a
`top_logprobs_num` of 10**6, a `logprob_start_len` below -1, a prompt token id outside the
vocabulary) and hangs on a huge `n`; it has no limit on `n`, on the prompts of a batch or on
the top log-probabilities asked for. `check_body` refuses those values with a 400 naming the
field (or makes them safe: a `top_k` beyond any vocabulary is no top-k, which is what it
means), with the same limits as the built-in server (`--max-n`, `--max-batch-prompts`,
`--max-top-logprobs-num`). Pure functions over the parsed JSON, so that they are tested
without SGLang; `front.py` applies them in front of SGLang's server.
"""

from __future__ import annotations

from typing import Any

from sloserve.runtime.constraints.spec import grammar_spec
from sloserve.runtime.errors import InvalidRequest
from sloserve.sglang_ext.guard_limits import GuardLimits

# a top_k at or above this is beyond any vocabulary: no top-k (SGLang turns it into an int64
# tensor element, and 2**63 kills its scheduler)
NO_TOP_K_FROM = 2**31
GUARDED = ("/generate", "/v1/completions", "/v1/chat/completions")


class Refused(ValueError):
    """A body the front answers with a 400 naming `param`."""

    def __init__(self, param: str, message: str):
        super().__init__(f"{param}: {message}")
        self.param = param


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _per_item(value: Any) -> list:
    return value if isinstance(value, list) else [value]


def check_body(path: str, body: Any, limits: GuardLimits) -> bool:
    """Raise Refused for a body SGLang must not see; make safe (in place) what has a safe
    meaning. Returns whether the body was changed. Values of the wrong type are left to
    SGLang's own validation (a 400 there)."""
    if not isinstance(body, dict):
        return False
    if path == "/generate":
        return _check_generate(body, limits)
    if path in ("/v1/completions", "/v1/chat/completions"):
        return _check_openai(body, limits, chat=path.endswith("chat/completions"))
    return False


def _check_generate(body: dict, lim: GuardLimits) -> bool:
    prompts = 1
    if isinstance(body.get("text"), list):
        prompts = len(body["text"])
        _check_batch(prompts, "text", lim)
    ids = body.get("input_ids")
    if isinstance(ids, list):
        if ids and isinstance(ids[0], list):
            prompts = len(ids)
            _check_batch(prompts, "input_ids", lim)
            for i, one in enumerate(ids):
                _check_ids(one, f"input_ids[{i}]", lim)
        else:
            _check_ids(ids, "input_ids", lim)
    changed = False
    sps = body.get("sampling_params")
    for i, sp in enumerate(_per_item(sps)):
        if not isinstance(sp, dict):
            continue
        where = f"sampling_params[{i}]." if isinstance(sps, list) else "sampling_params."
        _check_n(sp.get("n"), prompts, where + "n", lim)
        changed |= _safe_top_k(sp, where + "top_k")
        _check_grammar(sp, where)
    for v in _per_item(body.get("top_logprobs_num")):
        _check_top(v, "top_logprobs_num", lim)
    for v in _per_item(body.get("logprob_start_len")):
        if _is_int(v) and v < -1:
            raise Refused("logprob_start_len", f"must be >= -1, got {v}")
    return changed


def _check_openai(body: dict, lim: GuardLimits, chat: bool) -> bool:
    prompts = 1
    if not chat:
        p = body.get("prompt")
        if isinstance(p, list) and p and all(_is_int(t) for t in p):
            _check_ids(p, "prompt", lim)
        elif isinstance(p, list):
            prompts = len(p)
            _check_batch(prompts, "prompt", lim)
            for i, one in enumerate(p):
                if isinstance(one, list):
                    _check_ids(one, f"prompt[{i}]", lim)
        _check_top(body.get("logprobs"), "logprobs", lim)
    else:
        _check_top(body.get("top_logprobs"), "top_logprobs", lim)
    _check_n(body.get("n"), prompts, "n", lim)
    changed = _safe_top_k(body, "top_k")
    _check_grammar(body, "")
    return changed


def _check_batch(prompts: int, field: str, lim: GuardLimits) -> None:
    if prompts > lim.max_batch_prompts:
        raise Refused(field, f"a batch of {prompts} prompts is over this server's limit of "
                      f"{lim.max_batch_prompts} (--max-batch-prompts)")


def _check_ids(ids: Any, field: str, lim: GuardLimits) -> None:
    if not isinstance(ids, list):
        return
    for t in ids:
        if _is_int(t) and (t < 0 or (lim.vocab_size is not None and t >= lim.vocab_size)):
            top = f", {lim.vocab_size})" if lim.vocab_size is not None else ", ...)"
            raise Refused(field, f"token id {t} outside the vocabulary [0{top}")


def _check_n(n: Any, prompts: int, field: str, lim: GuardLimits) -> None:
    if not _is_int(n):
        return
    if n < 1:
        raise Refused(field, f"must be >= 1, got {n}")
    if n > lim.max_n:
        raise Refused(field, f"{n} samples per prompt are over this server's limit of "
                      f"{lim.max_n} (--max-n)")
    if prompts * n > lim.max_batch_prompts:
        raise Refused(field, f"{prompts} prompts x n {n} = {prompts * n} samples are over "
                      f"this server's limit of {lim.max_batch_prompts} per request "
                      "(--max-batch-prompts)")


def _check_top(v: Any, field: str, lim: GuardLimits) -> None:
    if not _is_int(v):
        return
    if v < 0:
        raise Refused(field, f"must be >= 0, got {v}")
    if v > lim.max_top_logprobs_num:
        raise Refused(field, f"{v} is over this server's limit of {lim.max_top_logprobs_num} "
                      "(--max-top-logprobs-num)")
    if lim.vocab_size is not None and v > lim.vocab_size:  # SGLang's topk fails beyond it
        raise Refused(field, f"{v} is more than the vocabulary's {lim.vocab_size} tokens")


def _safe_top_k(params: dict, field: str) -> bool:
    k = params.get("top_k")
    if not _is_int(k):
        return False
    assert k is not None  # an integer (checked above)
    if k < -1:
        raise Refused(field, f"must be -1 (off) or a positive integer, got {k}")
    if k >= NO_TOP_K_FROM:
        params["top_k"] = -1  # beyond any vocabulary: no top-k
        return True
    return False


def _check_grammar(params: dict, prefix: str) -> None:
    """A JSON schema that cannot be parsed or nests too deeply is a 400 (SGLang's grammar
    backend recursed on a 10k-deep one); what compiles is SGLang's to judge."""
    schemas = [("json_schema", params.get("json_schema"))]
    rf = params.get("response_format")
    if isinstance(rf, dict) and rf.get("type") == "json_schema" and isinstance(
            rf.get("json_schema"), dict):
        schemas.append(("response_format", rf["json_schema"].get("schema")))
    for name, schema in schemas:
        if not isinstance(schema, (str, dict)):
            continue  # absent, or a type SGLang's own validation refuses
        try:
            grammar_spec(json_schema=schema)
        except InvalidRequest as e:
            raise Refused(prefix + name, str(e).split(": ", 1)[1]) from None
