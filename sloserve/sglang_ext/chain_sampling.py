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

All-greedy batches keep SGLang's rule (commit the target's argmax while the draft matches
it); `greedy_chains` applies it to a ragged verify's rows only, so the [B (s + 1), V] logits
of the verify block need not exist (its trimmed rows were never computed).
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


def greedy_chains(target: torch.Tensor, rows: torch.Tensor, cand: torch.Tensor,
                  k: torch.Tensor, depth: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """SGLang's greedy acceptance of topk-1 chains (verify_tree_greedy on chains) from the
    verified rows alone. Shapes: B requests, n = s + 1 rows each in the verify block.

    target: [T] int the target's argmax at `rows`; rows: [T] int64 flat rows of the [B, n]
    block, request r's being r n .. r n + k_r (its bonus row and its k_r verified drafts' rows);
    cand: [B, n] the block's tokens (the bonus token, then the s drafts); k: [B] int64 verify
    lengths (<= s); depth: accept_index's width (SGLang's max_tree_depth).

    m_r = the leading drafts that equal the target's argmax at the row before them, at most
    k_r. Returns eagle_sample's triple: predict [B n] int32 (row r n + j for j <= m_r: the
    target's token there, so the m_r accepted drafts then the token after them; 0 elsewhere),
    accept_lens [B] int32 = m_r + 1, accept_index [B, depth] int32 (r n + j for j <= m_r, -1
    after)."""
    B, n = cand.shape
    dev = cand.device
    full = torch.full((B * n,), -1, dtype=torch.int64, device=dev)
    full[rows] = target.to(torch.int64)
    t = full.view(B, n)  # [B, n]; -1 at trimmed rows, which the cut below never reads
    j = torch.arange(n, device=dev)
    match = (cand[:, 1:].to(torch.int64) == t[:, :-1]) & (j[None, :-1] < k[:, None])  # [B, s]
    m = match.to(torch.int64).cumprod(dim=1).sum(dim=1)  # [B]
    emitted = j[None, :] <= m[:, None]  # [B, n]
    predict = torch.where(emitted, t, 0).to(torch.int32).reshape(-1)
    flat = torch.arange(B, device=dev)[:, None] * n + j[None, :]  # [B, n]
    index = torch.where(emitted, flat, -1).to(torch.int32)
    accept_index = torch.full((B, depth), -1, dtype=torch.int32, device=dev)
    w = min(depth, n)
    accept_index[:, :w] = index[:, :w]
    return predict, (m + 1).to(torch.int32), accept_index


def bonus_tokens(target: torch.Tensor,
                 depth: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """greedy_chains for a verify of the bonus token alone (n = 1, nothing drafted): the
    same triple in five tensor ops instead of ~25 (a no-draft step at C = 16 runs it every
    step). target: [B] int the target's argmax of each request's one row. Returns predict
    [B] int32 = target, accept_lens [B] int32 = 1, accept_index [B, depth] int32 (r in
    column 0, -1 after)."""
    B = target.shape[0]
    dev = target.device
    accept_index = torch.full((B, depth), -1, dtype=torch.int32, device=dev)
    accept_index[:, 0] = torch.arange(B, dtype=torch.int32, device=dev)
    return (target.to(torch.int32), torch.ones(B, dtype=torch.int32, device=dev),
            accept_index)
