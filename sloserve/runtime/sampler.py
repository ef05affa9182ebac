"""Token sampling: greedy, temperature, top-k, top-p, with per-request seeded generators.

`processed_probs` is the distribution a request samples from; speculative sampling applies
the same processing to target and draft logits, so acceptance keeps the target's distribution.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from sloserve.runtime.sampling_params import SamplingParams
from sloserve.verifier.acceptance import draw

F32_MAX = torch.finfo(torch.float32).max
MAX_TEMPERATURE = 1e6  # softmax(logits / 1e6) is uniform to float32 precision


def processed_probs(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """logits: [N, V] float32, one row per entry of params (all with temperature > 0).
    Returns probs [N, V]: softmax(logits / T), then top-k, top-p, min-p, renormalised."""
    vocab = logits.shape[-1]
    min_p = [p.min_p for p in params]
    return processed_distribution(
        logits, torch.tensor([min(p.temperature, MAX_TEMPERATURE) for p in params],
                             dtype=torch.float64),
        torch.tensor([p.top_k if 0 < p.top_k < vocab else 0 for p in params]),
        torch.tensor([p.top_p for p in params], dtype=torch.float64),
        torch.tensor(min_p, dtype=torch.float64) if any(min_p) else None)


def processed_distribution(logits: torch.Tensor, temperature: torch.Tensor,
                           top_k: torch.Tensor, top_p: torch.Tensor,
                           min_p: torch.Tensor | None = None) -> torch.Tensor:
    """The one processed-distribution rule of both engines (the built-in sampler and the
    SPECSERVE worker inside SGLang): logits [N, V]; temperature [N] > 0, top_k [N] (<= 0 or
    >= V: no top-k; 1: the argmax only), top_p [N], min_p [N] in [0, 1] or None (off).
    Returns [N, V] in logits' dtype: softmax(logits / T), then top-k, then top-p, then min-p
    (SGLang's order: tokens below min_p x the top token's probability dropped), renormalised."""
    probs = _top_k_top_p(logits, temperature, top_k, top_p)
    if min_p is None or not bool((min_p > 0).any()):
        return probs
    # top-k / top-p only zero tokens and renormalise: the ratio to the top token is that of
    # the softmax, and the top token always stays
    floor = min_p.to(probs.dtype).to(probs.device)[:, None] * probs.amax(-1, keepdim=True)
    out = torch.where(probs < floor, 0.0, probs)
    return out / out.sum(-1, keepdim=True)


def _top_k_top_p(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
                 top_p: torch.Tensor) -> torch.Tensor:
    vocab = logits.shape[-1]
    # every value is brought into the range its tensor holds before it becomes one: a
    # temperature above MAX_TEMPERATURE is uniform sampling already (and inf would turn a
    # masked -inf logit into NaN); top_k beyond the vocabulary is no top-k (and 10**30
    # overflows int64); top_p below float32's smallest value is "the top token only"
    dev = logits.device
    temps = temperature.to(torch.float64).clamp(1e-6, MAX_TEMPERATURE).to(logits.dtype).to(dev)
    # a finite logit over a small temperature may exceed float32 (inf - inf is NaN in the
    # softmax): saturate at the largest finite value, -inf (masked) stays
    probs = torch.softmax((logits / temps[:, None]).clamp_(max=F32_MAX), dim=-1)
    top_k = top_k.to(torch.int64).to(dev)
    top_k = torch.where((top_k > 0) & (top_k < vocab), top_k, torch.zeros_like(top_k))
    top_p = top_p.to(logits.dtype).to(dev)
    if not ((top_k > 0).any() or (top_p < 1).any()):
        return probs
    if bool((top_k > 0).all()):  # only the k largest can stay: rank those, not the vocabulary
        sorted_p, idx = probs.topk(int(top_k.max()), dim=-1)  # [N, K], descending
    else:
        sorted_p, idx = probs.sort(dim=-1, descending=True)  # [N, V]
    rank = torch.arange(sorted_p.shape[-1], device=dev)
    sorted_p = torch.where((top_k[:, None] > 0) & (rank[None, :] >= top_k[:, None]), 0.0, sorted_p)
    sorted_p = sorted_p / sorted_p.sum(-1, keepdim=True)
    before = sorted_p.cumsum(-1) - sorted_p  # mass of the strictly more likely tokens
    # the top token stays even when top_p rounds to 0 in float32
    sorted_p = torch.where((rank[None, :] > 0) & (before >= top_p[:, None]), 0.0, sorted_p)
    out = torch.zeros_like(probs).scatter_(-1, idx, sorted_p)
    return out / out.sum(-1, keepdim=True)


def sample_rows(
    logits: torch.Tensor, params: Sequence[SamplingParams], generators: Sequence
) -> tuple[list[int], torch.Tensor | None]:
    """Sample one token per row of logits [N, V]. Greedy rows take the argmax.
    Returns (tokens, probs) with probs [N, V] for rows that sampled (None if all greedy)."""
    tokens = logits.argmax(dim=-1).tolist()
    rows = [i for i, p in enumerate(params) if not p.greedy]
    if not rows:
        return tokens, None
    probs = torch.zeros_like(logits)
    probs[rows] = processed_probs(logits[rows], [params[i] for i in rows])
    for i in rows:
        tokens[i] = draw(probs[i], generators[i])
    return tokens, probs
