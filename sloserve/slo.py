"""A request's SLOs: where a request states them, and the one rule that falls back to the
server's default. Both servers (the built-in one and SGLang's with the SPECSERVE worker) and
every step builder read them through here.

A request may state `tpot_slo` / `ttft_slo` (seconds) in either spelling:

    sampling_params.tpot_slo                   sloserve's own
    sampling_params.custom_params.tpot_slo     SGLang's (custom_params carries it through
                                               SGLang's processes)

and in the OpenAI APIs either as a top-level field (what `extra_body={"tpot_slo": ...}`
sends) or in a top-level `custom_params` object. The direct field wins when both are given.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

SLO_KEYS = ("tpot_slo", "ttft_slo")


def _get(obj: Any, key: str) -> Any:
    if isinstance(obj, Mapping):
        return obj.get(key)
    return getattr(obj, key, None)


def stated_slo(params: Any, key: str) -> Any:
    """The value a request states for `key` (tpot_slo or ttft_slo) in `params` (a dict,
    a pydantic model or SGLang's SamplingParams): the direct field, else custom_params[key];
    None when it states none. Not validated (each server checks it its own way)."""
    value = _get(params, key)
    if value is None:
        custom = _get(params, "custom_params")
        if isinstance(custom, Mapping):
            value = custom.get(key)
    return value


def valid_slo(value: Any) -> float | None:
    """value as seconds if it is a positive finite number, else None."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value) if 0.0 < value < math.inf else None


def effective_slo(own: float | None, default: float | None) -> float:
    """The SLO a request is held to: its own, else the server's default, else none (inf)."""
    if own:
        return own
    return default or math.inf


def slo_array(own: Sequence[float | None], default: float | None) -> np.ndarray:
    """[B] float64 effective_slo of each request."""
    return np.array([effective_slo(s, default) for s in own], dtype=np.float64)


def slos_into_custom_params(params: Mapping[str, Any]) -> dict[str, Any]:
    """A copy of sampling params (a dict) with the SLO keys stated directly moved into
    custom_params (a server that checks sampling params against SGLang's own fields, such as
    SGLang's, then sees only its own spelling); None values are dropped, custom_params'
    own SLO keys give way to the direct ones."""
    out = {k: v for k, v in params.items() if k not in SLO_KEYS}
    own = {k: params[k] for k in SLO_KEYS if params.get(k) is not None}
    if own:
        custom = params.get("custom_params")
        out["custom_params"] = {**(custom if isinstance(custom, Mapping) else {}), **own}
    return out


def request_slos(params: Any) -> dict[str, Any]:
    """What a request's parameters state about its SLOs, for a server that parses them:
    {"tpot_slo": ..., "ttft_slo": ... (stated_slo each, unvalidated), "custom_params": the
    request's custom_params without the SLO keys (None when nothing else is left)}."""
    out: dict[str, Any] = {key: stated_slo(params, key) for key in SLO_KEYS}
    custom = _get(params, "custom_params")
    rest = ({k: v for k, v in custom.items() if k not in SLO_KEYS}
            if isinstance(custom, Mapping) else custom)
    out["custom_params"] = rest or None
    return out
