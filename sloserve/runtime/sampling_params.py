"""A request's sampling parameters: one frozen value, validated once (SGLang's
sampling_params). Kept apart from the request (request.py) so the sampler and the constraint
processing read them without importing the request, which refers to its constraints."""

from __future__ import annotations

import dataclasses
import json
import math
import numbers
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from sloserve.runtime.errors import InvalidRequest
from sloserve.runtime.penalties import PenaltyParams

# Below this temperature sampling is argmax, as in SGLang (its _SAMPLING_EPS): logits / T
# would overflow float32 (1e-40 is a float32 zero, 1e-300 too) and give NaN probabilities.
GREEDY_TEMPERATURE = 1e-6
SEED_RANGE = (-(2**63), 2**64 - 1)  # what torch.Generator.manual_seed accepts


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 or 0 = off
    min_p: float = 0.0  # drop tokens below min_p x the top token's probability (0 = off)
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    no_stop_trim: bool = False  # keep the matched stop string / stop token's text in the text
    tpot_slo: float | None = None  # seconds per output token this request asks for
    ttft_slo: float | None = None  # seconds to first token
    # penalties and min_new_tokens (runtime/penalties.py has the definitions)
    min_new_tokens: int = 0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    # the output constraint: at most one (compiled by the engine with xgrammar)
    regex: str | None = None
    json_schema: str | None = None  # a JSON schema as text (a dict is dumped to text)
    ebnf: str | None = None
    # None: no log-probabilities; k >= 0: each output token's log-probability under the
    # distribution it was sampled from (before top-k / top-p), and the k most likely tokens
    logprobs: int | None = None
    n: int = 1  # independent samples of the prompt; a Request is one (expand_samples)
    # added to the logits after the penalties: ((token id, bias), ...) sorted by token; a
    # dict {token: bias} (keys may be decimal strings, as JSON sends them) is normalised
    logit_bias: tuple[tuple[int, float], ...] | Mapping[Any, float] | None = ()
    # with logprobs: these tokens' log-probabilities at every output position too
    logprob_token_ids: tuple[int, ...] = ()
    # detokenization: drop special tokens from the text; spaces between special tokens
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True

    def __post_init__(self):
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        if not isinstance(self.stop, (list, tuple)):
            raise InvalidRequest("stop", f"must be a string or a list of strings, got "
                                 f"{self.stop!r:.40}")
        object.__setattr__(self, "stop", tuple(self.stop))
        ids = self.stop_token_ids
        if not isinstance(ids, (list, tuple)) or not all(_is_int(t) for t in ids):
            raise InvalidRequest("stop_token_ids", f"must be a list of integers, got {ids!r:.40}")
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in ids))
        object.__setattr__(self, "logit_bias", _logit_bias(self.logit_bias))
        ids = self.logprob_token_ids
        if not isinstance(ids, (list, tuple)) or not all(_is_int(t) and t >= 0 for t in ids):
            raise InvalidRequest("token_ids_logprob", f"must be a list of token ids, got "
                                 f"{ids!r:.40}")
        object.__setattr__(self, "logprob_token_ids", tuple(int(t) for t in ids))
        if isinstance(self.json_schema, (dict, bool)):
            object.__setattr__(self, "json_schema", json.dumps(self.json_schema))
        self.validate()

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE

    @property
    def penalties(self) -> PenaltyParams:
        return PenaltyParams(self.frequency_penalty, self.presence_penalty,
                             self.repetition_penalty, self.min_new_tokens)

    @property
    def constrained(self) -> bool:
        """Whether decoding needs a RequestConstraints (a grammar, a penalty or
        min_new_tokens): processing beyond temperature / top-k / top-p."""
        return (self.regex is not None or self.json_schema is not None or self.ebnf is not None
                or self.min_new_tokens > 0 or self.penalties.penalizes or bool(self.logit_bias))

    def validate(self) -> None:
        def bad(name, msg):
            raise InvalidRequest(name, msg)

        # types first: the in-process API gets whatever a caller passes
        for name in ("temperature", "top_p", "min_p", "tpot_slo", "ttft_slo"):
            v = getattr(self, name)
            if not (_is_real(v) or (v is None and name.endswith("_slo"))):
                bad(name, f"must be a number, got {v!r:.40}")
        for name in ("ignore_eos", "skip_special_tokens", "spaces_between_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                bad(name, f"must be true or false, got {getattr(self, name)!r:.40}")
        if self.logprob_token_ids and self.logprobs is None:
            bad("token_ids_logprob", "needs logprobs (return_logprob)")
        if not isinstance(self.ignore_eos, bool):
            bad("ignore_eos", f"must be true or false, got {self.ignore_eos!r:.40}")
        if not _is_int(self.max_new_tokens):
            bad("max_new_tokens", f"must be an integer, got {self.max_new_tokens!r:.40}")
        if self.max_new_tokens <= 0:
            bad("max_new_tokens", f"must be > 0, got {self.max_new_tokens}")
        if not math.isfinite(self.temperature) or self.temperature < 0:
            bad("temperature", f"must be >= 0, got {self.temperature}")
        if not (0.0 < self.top_p <= 1.0):
            bad("top_p", f"must be in (0, 1], got {self.top_p}")
        if not 0.0 <= self.min_p <= 1.0:
            bad("min_p", f"must be in [0, 1], got {self.min_p}")
        if not _is_int(self.top_k) or self.top_k < -1:
            bad("top_k", f"must be -1 (off) or a positive integer, got {self.top_k!r}")
        if self.seed is not None and not (
                _is_int(self.seed) and SEED_RANGE[0] <= self.seed <= SEED_RANGE[1]):
            bad("seed", f"must be an integer in [-2**63, 2**64 - 1], got {self.seed!r:.40}")
        if any(not isinstance(s, str) or s == "" for s in self.stop):
            bad("stop", "stop strings must be non-empty strings")
        for name in ("tpot_slo", "ttft_slo"):
            v = getattr(self, name)
            if v is not None and not (v > 0 and math.isfinite(v)):
                bad(name, f"must be a positive number of seconds, got {v}")
        if any(not _is_int(t) or t < 0 for t in self.stop_token_ids):
            bad("stop_token_ids", "must be non-negative token ids")
        self.penalties.validate(self.max_new_tokens)
        for name in ("regex", "json_schema", "ebnf"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, str) or not v):
                bad(name, f"must be a non-empty string, got {v!r:.60}")
        if self.logprobs is not None and (not _is_int(self.logprobs) or self.logprobs < 0):
            bad("logprobs", f"must be None or an integer >= 0, got {self.logprobs!r}")
        if not _is_int(self.n) or self.n < 1:
            bad("n", f"must be an integer >= 1, got {self.n!r}")


MAX_LOGIT_BIAS = 100.0  # OpenAI's range for a bias: [-100, 100]


def _logit_bias(bias) -> tuple[tuple[int, float], ...]:
    """logit_bias as ((token id, bias), ...) sorted by token id; InvalidRequest naming
    logit_bias when a key is no token id or a value no number in [-100, 100]. The vocabulary
    bound is the engine's check (RequestConstraints)."""
    if bias is None:
        return ()
    items = bias.items() if isinstance(bias, dict) else bias
    out: dict[int, float] = {}
    try:
        for tok, val in items:
            t = int(tok) if isinstance(tok, str) and tok.strip().isdigit() else tok
            if not _is_int(t) or t < 0:
                raise InvalidRequest("logit_bias", f"keys must be token ids, got {tok!r:.40}")
            if not (_is_real(val) and math.isfinite(val) and abs(val) <= MAX_LOGIT_BIAS):
                raise InvalidRequest("logit_bias", f"values must be numbers in [-100, 100], "
                                     f"got {val!r:.40}")
            out[int(t)] = float(val)
    except (TypeError, ValueError):
        raise InvalidRequest("logit_bias", f"must map token ids to numbers, got "
                             f"{bias!r:.60}") from None
    return tuple(sorted(out.items()))


def expand_samples(params: SamplingParams) -> list[SamplingParams]:
    """The n independent samples a request with params.n asks for, each with n = 1. A seeded
    request's sample i gets seed + i, as vLLM seeds its parallel samples (SGLang copies the
    seed, which makes seeded samples identical); unseeded ones draw from the global RNG."""
    if params.n == 1:
        return [params]
    return [dataclasses.replace(params, n=1, seed=None if params.seed is None else params.seed + i)
            for i in range(params.n)]


def _is_int(x) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def _is_real(x) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, bool)
