"""The step's processing for all constrained requests at once: the engine calls these once per
draft round and once per verify, with every constrained request of the batch.

Same order and arithmetic as RequestConstraints.target / .draft (processing.py), per request:
penalties and logit_bias on its rows, its grammar masks, min_new_tokens; but the rows of all requests share one
float32 block, one mask application, one argmax and one temperature / top-k / top-p pass, so a
step pays a handful of tensor ops for its constrained requests rather than a handful each (small
multi-row ops cost tens of microseconds apiece on a busy CPU).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from sloserve.runtime.constraints.bitmask import ALL_ALLOWED, apply_, words
from sloserve.runtime.constraints.processing import Processed, RequestConstraints, mask_stop_tokens
from sloserve.runtime.penalties import apply_penalties, min_tokens_rows
from sloserve.runtime.sampler import processed_probs

# (request constraints, logits, drafts): target rows [k + 1, V] with the k verified drafts, or
# one draft row [V] with the drafts before it
Item = tuple[RequestConstraints, torch.Tensor, Sequence[int]]


def process_targets(items: Sequence[Item]) -> list[Processed]:
    """Each item's processed verify rows (as RequestConstraints.target)."""
    masks: list[torch.Tensor | None] = []
    n_valid: list[int] = []
    for rc, logits, drafts in items:
        if logits.shape[0] != len(drafts) + 1:
            raise ValueError(f"{logits.shape[0]} rows for {len(drafts)} drafts")
        if rc.grammar is not None:
            bm, n = rc.grammar.verify_bitmask(drafts)
        else:
            bm, n = None, len(drafts)
        masks.append(bm)
        n_valid.append(n)
    return _process(items, [0] * len(items), masks, n_valid)


def process_drafts(items: Sequence[Item]) -> list[Processed]:
    """Each item's processed draft row (as RequestConstraints.draft); logits [V] or [1, V]."""
    masks: list[torch.Tensor | None] = []
    for rc, _, drafts in items:
        if rc.grammar is None:
            masks.append(None)
            continue
        if rc.grammar.num_tentative != len(drafts):
            raise ValueError("push_draft each draft token before drafting the next")
        masks.append(rc.grammar.bitmask()[None])
    items = [(rc, logits.reshape(1, -1), drafts) for rc, logits, drafts in items]
    firsts = [len(drafts) for _, _, drafts in items]
    return _process(items, firsts, masks, firsts)


def _process(items: Sequence[Item], firsts: list[int], masks: list[torch.Tensor | None],
             n_valid: list[int]) -> list[Processed]:
    """Steps 1-4 of processing.py over the items' rows stacked; firsts[i]: the step position of
    item i's first row; masks[i]: its rows' bitmasks [R_i, W] or None."""
    if not items:
        return []
    sizes = [logits.shape[0] for _, logits, _ in items]
    bounds = [0]
    for n in sizes:
        bounds.append(bounds[-1] + n)
    out = torch.cat([logits for _, logits, _ in items]).float()  # [R, V], a new tensor
    for (rc, _, drafts), first, lo, hi in zip(items, firsts, bounds, bounds[1:]):
        if rc.counts is not None and rc.penalties.penalizes:  # 1. penalties
            out[lo:hi] = apply_penalties(out[lo:hi], rc.penalties, rc.counts, drafts, first)
        if rc.bias is not None:  # 1b. logit_bias
            rc.bias.add_(out[lo:hi])
    _apply_masks(out, masks, bounds)  # 2. grammar masks
    for (rc, _, _), first, lo, hi in zip(items, firsts, bounds, bounds[1:]):  # 3.
        n_out = rc.counts.num_output if rc.counts is not None else 0
        mask_stop_tokens(out[lo:hi], min_tokens_rows(rc.penalties, n_out, hi - lo, first),
                         rc.stop_ids)
    return _finish(items, out, bounds, n_valid)


def _apply_masks(out: torch.Tensor, masks: list[torch.Tensor | None], bounds: list[int]) -> None:
    rows = [r for m, lo, hi in zip(masks, bounds, bounds[1:]) if m is not None
            for r in range(lo, hi)]
    if not rows:
        return
    full = torch.full((out.shape[0], words(out.shape[1])), ALL_ALLOWED, dtype=torch.int32)
    for m, lo, hi in zip(masks, bounds, bounds[1:]):
        if m is not None:
            full[lo:hi] = m[:, : full.shape[1]]
    if len(rows) == out.shape[0]:
        apply_(out, full)
    else:
        apply_(out, full, indices=rows)


def _finish(items: Sequence[Item], out: torch.Tensor, bounds: list[int],
            n_valid: list[int]) -> list[Processed]:
    """4. temperature, top-k, top-p for the sampling requests' rows, the argmax of every row."""
    argmax = out.argmax(dim=-1).tolist()
    sampled = [i for i, (rc, _, _) in enumerate(items) if not rc.params.greedy]
    probs: dict[int, torch.Tensor] = {}
    if sampled:
        rows = [r for i in sampled for r in range(bounds[i], bounds[i + 1])]
        params = [items[i][0].params for i in sampled for _ in range(bounds[i], bounds[i + 1])]
        p = processed_probs(out if len(rows) == out.shape[0] else out[rows], params)
        lo = 0
        for i in sampled:
            n = bounds[i + 1] - bounds[i]
            probs[i] = p[lo : lo + n]
            lo += n
    return [Processed(out[lo:hi], probs.get(i), argmax[lo:hi], n_valid[i])
            for i, (lo, hi) in enumerate(zip(bounds, bounds[1:]))]
