"""The step's processing for all constrained requests at once: the engine calls these once per
draft round and once per verify, with every constrained request of the batch."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from sloserve.runtime.constraints.processing import Processed, RequestConstraints

# (request constraints, logits, drafts): target rows [k + 1, V] with the k verified drafts, or
# one draft row [V] with the drafts before it
Item = tuple[RequestConstraints, torch.Tensor, Sequence[int]]


def process_targets(items: Sequence[Item]) -> list[Processed]:
    """Each item's processed verify rows (RequestConstraints.target)."""
    return [rc.target(logits, drafts) for rc, logits, drafts in items]


def process_drafts(items: Sequence[Item]) -> list[Processed]:
    """Each item's processed draft row (RequestConstraints.draft)."""
    return [rc.draft(logits, drafts) for rc, logits, drafts in items]
