"""Token log-probabilities under the target model, for `return_logprob` (what `sgl.select`
uses to score choices).

The engine has no logprob path, so scoring is a one-off: on the engine thread, between steps
(AsyncEngine.call), the whole sequence runs through the target ModelRunner in chunks over
fresh KV blocks taken from the engine's allocator and freed before returning; the target's
logits give log-softmax rows. These are the raw model probabilities (no temperature, top-p or
top-k), as SGLang returns them.

Positions follow SGLang's `input_token_logprobs`: entry j is prompt token `start + j` with its
log-probability given the tokens before it. Position 0 has no context, so its value is None;
unlike SGLang, which also blanks the first entry when start > 0, the real value is given
there (`sgl.select`'s token-healing correction subtracts it).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from sloserve.runtime.batch import Segment
from sloserve.runtime.engine import Engine


class PoolBusy(RuntimeError):
    """Not enough free KV blocks right now for a scoring pass; retry later."""


@dataclass
class Scores:
    """Per position p in [start, len(ids)): log P(ids[p] | ids[:p]) (None at p == 0), and the
    top-k (logprob, token id) pairs of the distribution at p (empty when k == 0)."""

    start: int
    token_ids: list[int]
    logprobs: list[float | None]
    top: list[list[tuple[float, int]]]


def score_tokens(engine: Engine, ids: Sequence[int], start: int, top_k: int = 0) -> Scores:
    """Run on the engine thread. Scores ids[start:] (see Scores). Raises PoolBusy when the KV
    pool cannot hold the sequence now."""
    n = len(ids)
    start = max(0, min(start, n))
    alloc = engine.scheduler.alloc
    runner = engine.parts.target
    need = alloc.blocks_for(n)
    if need > alloc.num_free:
        raise PoolBusy(f"scoring needs {need} KV blocks, {alloc.num_free} free")
    blocks = alloc.allocate(need)
    logprobs: list[float | None] = [None] if start == 0 and n else []
    top: list[list[tuple[float, int]]] = [[]] if start == 0 and n else []
    try:
        chunk = max(1, engine.cfg.scheduler.max_step_tokens)
        ids_t = torch.tensor(list(ids), dtype=torch.long)
        for lo in range(0, n, chunk):
            hi = min(n, lo + chunk)
            # logits at position q predict token q + 1; we need q in [start - 1, n - 2]
            q_lo, q_hi = max(lo, start - 1), min(hi, n - 1)
            wanted = q_lo < q_hi
            seg = Segment(blocks, lo, list(ids[lo:hi]), all_logits=wanted)
            logits, _ = runner.forward([seg])  # [hi - lo, vocab] or [1, vocab]
            if not wanted:
                continue
            lp = torch.log_softmax(logits[q_lo - lo : q_hi - lo].float(), dim=-1)  # [m, vocab]
            nxt = ids_t[q_lo + 1 : q_hi + 1].to(lp.device)
            logprobs.extend(lp.gather(1, nxt[:, None])[:, 0].tolist())
            if top_k > 0:
                vals, idx = lp.topk(min(top_k, lp.shape[-1]), dim=-1)
                top.extend([list(zip(v, i)) for v, i in zip(vals.tolist(), idx.tolist())])
            else:
                top.extend([] for _ in range(q_hi - q_lo))
    finally:
        alloc.free(blocks)
    return Scores(start, list(ids[start:]), logprobs, top)


def triples(values: Sequence[float | None], token_ids: Sequence[int], tokenizer, with_text: bool
            ) -> list[tuple[float | None, int, str | None]]:
    """SGLang's (logprob, token_id, text-or-None) entries."""
    texts = [tokenizer.decode([t]) for t in token_ids] if with_text else [None] * len(token_ids)
    return list(zip(values, token_ids, texts))
