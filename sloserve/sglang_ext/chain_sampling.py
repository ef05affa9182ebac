"""Lossless sampling for SPECSERVE's topk-1 chains with per-request verify lengths (torch only,
no SGLang imports).

SGLang 0.5.23's EAGLE verify commits the target's argmax on CPUs whatever the request's
temperature (eagle_utils.py `_verify_uses_greedy(is_cpu=...)`), and its draft treats a topk-1
proposal as certain (draft probability 1). SPECSERVE therefore samples both sides itself for
batches that are not all greedy (docs/design.md sec. 7, the built-in engine's rule):

    draft     a greedy request (SGLang: top_k == 1) proposes the draft's argmax, its
              confidence the draft's softmax probability of it (temperature 1); a sampled
              request draws x ~ q from the draft's processed distribution (temperature,
              top-k, top-p), its confidence q(x)
    verify    position j of request r (j = 1..k_r): accept x_j with probability
              min(1, p_{j-1}(x_j) / q_j(x_j)), p the target's processed distribution at the
              row before (q one-hot on x for a greedy proposal); on rejection draw from
              normalize(max(0, p - q)) and stop; after k_r acceptances draw the bonus from
              p_{k_r}
so every emitted token follows the target's processed distribution p (greedy rows: its
argmax) whatever k_r is.
"""

from __future__ import annotations

import torch

from sloserve.runtime.sampler import processed_distribution
from sloserve.verifier.acceptance import draw, speculative_accept


def processed_probs(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
                    top_p: torch.Tensor) -> torch.Tensor:
    """[n, V] float32 distributions after temperature, top-k and top-p: the built-in
    engine's rule (runtime/sampler.py processed_distribution) on SGLang's per-row sampling
    tensors; rows with top_k == 1 (SGLang's greedy) are one-hot on the argmax."""
    return processed_distribution(logits.float(), temperature, top_k, top_p)


def draft_pick(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
               top_p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One draft round: (tokens [n], confidences [n], q [n, V]); q is the distribution the
    token was drawn from (one-hot on the argmax for greedy rows)."""
    greedy = top_k <= 1
    conf_g, tok_g = torch.softmax(logits.float(), dim=-1).max(dim=-1)
    q = processed_probs(logits, temperature, top_k, top_p)
    tok_s = torch.multinomial(q, 1).squeeze(1)
    tokens = torch.where(greedy, tok_g, tok_s)
    conf = torch.where(greedy, conf_g, q.gather(1, tok_s[:, None]).squeeze(1))
    q = torch.where(greedy[:, None], torch.nn.functional.one_hot(tok_g, q.shape[1]).float(), q)
    return tokens, conf, q


def verify_chains(p: torch.Tensor, drafts: torch.Tensor, q: torch.Tensor, k: list[int],
                  accept_all: bool = False) -> tuple[list[int], list[int]]:
    """The acceptance rule per request: verifier/acceptance.py `speculative_accept`, the
    built-in engine's, on each chain's first k_r drafts. p: [B, n, V] target distributions
    (row j predicts the token after the chain's j-th token; n = s + 1); drafts: [B, s] the
    proposals; q: [B, s, V] the distributions they were drawn from; k: [B] verify lengths
    (<= s). Returns (accepted drafts m_r, the token emitted after them). accept_all: TEST
    ONLY, a deliberately wrong rule that accepts every verified draft (tests show it
    changes the output distribution)."""
    accepted, final = [], []
    for r, kr in enumerate(k):
        if accept_all:
            emitted = drafts[r, :kr].tolist() + [draw(p[r, kr], None)]
        else:
            emitted = speculative_accept(drafts[r, :kr].tolist(), q[r, :kr], p[r, :kr + 1], None)
        accepted.append(len(emitted) - 1)
        final.append(int(emitted[-1]))
    return accepted, final
