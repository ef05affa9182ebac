"""Lossless acceptance of draft tokens (docs/design.md sec. 7): pure math on one request.

Greedy: accept while the draft token equals the target argmax; the bonus token is the target
argmax at the first mismatch (or after the last draft).
Sampling: accept draft token x with probability min(1, p(x) / q(x)); on rejection sample from
normalize(max(0, p - q)); after all accepted, a bonus token from p. p and q are the processed
(temperature / top-k / top-p) target and draft distributions, so the output follows p exactly.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def draw(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    """One token from probs [V] using the request's generator (or the global one): the
    draw of acceptance and of the sampler (runtime/sampler.py), one stream per request."""
    return int(torch.multinomial(probs, 1, generator=generator).item())


def uniform(generator: torch.Generator | None) -> float:
    return float(torch.rand((), generator=generator).item())


def greedy_accept(draft: Sequence[int], target_argmax: Sequence[int]) -> list[int]:
    """draft: k tokens; target_argmax: k + 1 argmaxes (row j follows draft[:j]).
    Returns the emitted tokens: the accepted drafts then one target token."""
    n = 0
    while n < len(draft) and draft[n] == target_argmax[n]:
        n += 1
    return list(draft[:n]) + [int(target_argmax[n])]


def speculative_accept(
    draft: Sequence[int],
    q: torch.Tensor,  # [k, V] processed draft distributions the drafts were sampled from
    p: torch.Tensor,  # [k + 1, V] processed target distributions
    generator: torch.Generator | None,
) -> list[int]:
    """Speculative sampling (Leviathan et al. / Chen et al.); returns the emitted tokens."""
    out: list[int] = []
    for j, x in enumerate(draft):
        px, qx = float(p[j, x]), float(q[j, x])
        if qx > 0 and uniform(generator) * qx < px:  # u < p/q, written without division
            out.append(int(x))
            continue
        residual = (p[j] - q[j]).clamp_min_(0)
        total = float(residual.sum())
        # total == 0 only when p == q on the support, where rejection has probability 0;
        # fall back to p to stay safe against rounding
        out.append(draw(residual / total if total > 0 else p[j], generator))
        return out
    out.append(draw(p[len(draft)], generator))
    return out
