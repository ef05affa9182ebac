"""Output token log-probabilities, as SGLang reports them (`return_logprob`, OpenAI `logprobs`).

A token's value is the log-softmax of the distribution it was sampled from before top-k and
top-p: the processed logits (penalties, grammar mask, min_new_tokens) divided by the temperature
(1 for greedy requests). That is SGLang's sampler (`log(softmax(logits / T))` after
`apply_logits_bias`; greedy requests run at temperature 1); prompt-token values are the raw
model's (server/logprobs.py). Under speculation each emitted token's row is the target's
processed row at its position (the verify row that accepted it or the one the last token came
from), so the values are those of plain decoding whatever was drafted.

A masked token's -inf is clamped to float32's lowest value, as SGLang does (JSON has no -inf).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from sloserve.runtime.sampler import F32_MAX, MAX_TEMPERATURE
from sloserve.runtime.sampling_params import GREEDY_TEMPERATURE

_LOWEST = torch.finfo(torch.float32).min


@dataclass
class TokenLogprobs:
    """Per output token: its log-probability, and (k > 0) the k most likely tokens."""

    k: int
    logprobs: list[float] = field(default_factory=list)  # [n]
    top: list[list[tuple[int, float]]] = field(default_factory=list)  # [n][k] (token, logprob)
    # token_ids_logprob: these tokens' log-probabilities at every output position
    token_ids: tuple[int, ...] = ()
    id_logprobs: list[list[float]] = field(default_factory=list)  # [n][len(token_ids)]

    def head(self, n: int) -> TokenLogprobs:
        """The first n tokens' entries."""
        return TokenLogprobs(self.k, self.logprobs[:n], self.top[:n], self.token_ids,
                             self.id_logprobs[:n])

    def tail(self, n: int) -> TokenLogprobs:
        """The last n tokens' entries."""
        lo = len(self.logprobs) - n
        return TokenLogprobs(self.k, self.logprobs[lo:], self.top[lo:] if self.k else [],
                             self.token_ids, self.id_logprobs[lo:] if self.token_ids else [])

    def extend(self, other: TokenLogprobs) -> None:
        self.logprobs.extend(other.logprobs)
        self.top.extend(other.top)
        self.id_logprobs.extend(other.id_logprobs)


def token_logprobs(
    logits: torch.Tensor,  # [n, V] processed logits (before temperature); row j chose tokens[j]
    tokens: Sequence[int],  # [n] the emitted tokens
    temperature: float,
    k: int,
    token_ids: Sequence[int] = (),
) -> TokenLogprobs:
    """The log-probabilities of the emitted tokens and the top k of each row."""
    x = logits[: len(tokens)].float()
    # greedy requests (below GREEDY_TEMPERATURE: 1e-300 would make every logit inf) are
    # reported at temperature 1, as SGLang's sampler does; a small one saturates like the
    # sampler's (sampler.processed_probs)
    if temperature >= GREEDY_TEMPERATURE and temperature != 1.0:
        x = (x / min(temperature, MAX_TEMPERATURE)).clamp_(max=F32_MAX)
    lp = torch.log_softmax(x, dim=-1).nan_to_num_(nan=_LOWEST).clamp_(min=_LOWEST)  # [n, V]
    out = TokenLogprobs(k, token_ids=tuple(token_ids))
    out.logprobs = lp.gather(1, torch.tensor(list(tokens))[:, None])[:, 0].tolist()
    if k > 0:
        vals, idx = lp.topk(min(k, lp.shape[-1]), dim=-1)
        out.top = [list(zip(i, v)) for i, v in zip(idx.tolist(), vals.tolist())]
    if token_ids:
        out.id_logprobs = lp[:, list(token_ids)].tolist()
    return out
