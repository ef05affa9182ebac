"""Which committed positions the SPECSERVE draft has KV for, so a step that drafts nothing
can skip the draft's read of its verified window (no SGLang imports; draft_chain.py runs
the forwards).

A decode step with k = 0 for everyone verifies only the bonus token b at position L; the
draft would read b to keep its KV aligned (one draft forward over the batch: 8 of 66 ms a
step on the real pair at concurrency 1). It is skipped instead, and this book records what
is missing; the first step that drafts again reads every missing position of its requests
in one ragged extend before its first round (the catch-up), which costs one forward for
many skipped steps.

State, all indexed by SGLang's own identities (the draft shares the target's
req_to_token rows and KV slot numbers, with its own KV buffers):
- `stale_from[row]`: the first position of the request in req_to_token row `row` whose
  draft KV is missing (no entry: every committed position has it);
- `tokens[row, pos]`: the token at each position of each row, written by every prefill and
  every decode step (the catch-up reads committed ones: the last write to a position is
  the step that committed it, later steps write only past their own seq_len);
- `slot_ok[slot]`: whether the draft's KV at KV slot `slot` holds the token the target
  committed there. Slots outlive requests through SGLang's radix cache: a new request's
  cached prefix may hold a finished request's skipped positions, found here at its prefill.
Invariant: for every row in a decode batch, positions < stale_from[row] (all of them
without an entry) have draft KV; each has slot_ok True.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


class DraftKVBook:
    def __init__(self, req_to_token: torch.Tensor, num_slots: int) -> None:
        """req_to_token: SGLang's [rows, max_context] slot table (shared, read only);
        num_slots: the size of the KV buffers (slot numbers are < num_slots)."""
        self.req_to_token = req_to_token
        dev = req_to_token.device
        self.tokens = torch.zeros(req_to_token.shape, dtype=torch.int64, device=dev)
        self.slot_ok = torch.ones(num_slots, dtype=torch.bool, device=dev)
        self.stale_from: dict[int, int] = {}

    def written(self, slots: torch.Tensor) -> None:
        """The draft wrote its KV at these slots (any forward that reads committed tokens)."""
        self.slot_ok[slots.long()] = True

    def decoded(self, rows: torch.Tensor, seq_lens: torch.Tensor, window: torch.Tensor) -> None:
        """A decode step verified window [bs, n] (b, d_1..d_k) at positions seq_lens[i]..
        + n - 1 of row rows[i] (device tensors [bs]; no host sync)."""
        n = window.shape[1]
        pos = seq_lens.long()[:, None] + torch.arange(n, device=window.device)[None, :]
        self.tokens[rows.long()[:, None].expand(-1, n), pos] = window.to(torch.int64)

    def skipped(self, rows: Sequence[int], positions: Sequence[int],
                tokens: torch.Tensor) -> None:
        """A step without drafting committed tokens[i] ([bs]) at positions[i] of row rows[i]
        and the draft did not read them."""
        r = torch.as_tensor(rows, dtype=torch.long, device=self.tokens.device)
        p = torch.as_tensor(positions, dtype=torch.long, device=self.tokens.device)
        self.decoded(r, p, tokens.reshape(-1, 1))
        self.slot_ok[self.req_to_token[r, p].long()] = False
        for row, pos in zip(rows, positions):
            self.stale_from.setdefault(row, pos)

    def prefilled(self, rows: Sequence[int], prefix_lens: Sequence[int],
                  fill_ids: Sequence[Sequence[int]]) -> None:
        """The draft read each request's new prompt chunk (positions prefix_len..); its cached
        prefix (SGLang's radix cache) may miss draft KV where an earlier request skipped."""
        dev = self.tokens.device
        for row, prefix, ids in zip(rows, prefix_lens, fill_ids):
            self.stale_from.pop(row, None)
            self.tokens[row, :len(ids)] = torch.as_tensor(list(ids), dtype=torch.int64,
                                                          device=dev)
            if prefix <= 0:
                continue
            slots = self.req_to_token[row, :prefix].long()
            holes = (~self.slot_ok[slots]).nonzero()
            if holes.numel():
                self.stale_from[row] = int(holes[0, 0])

    def catch_up(self, rows: Sequence[int], seq_lens: Sequence[int]) -> list[int] | None:
        """Where each request's catch-up starts before a step that drafts (its positions up
        to seq_lens, the bonus token's, exclusive), or None when nobody misses anything. A
        request that misses nothing re-reads its last position (an extend has >= 1 token
        per request; the KV it rewrites is the same)."""
        if not any(row in self.stale_from for row in rows):
            return None
        return [min(self.stale_from.get(row, n - 1), n - 1) for row, n in zip(rows, seq_lens)]

    def window(self, rows: Sequence[int], starts: Sequence[int],
               seq_lens: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """The catch-up's tokens and KV slots, request after request ([sum(L - start)] each)."""
        dev = self.tokens.device
        r = torch.as_tensor([row for row, s, n in zip(rows, starts, seq_lens)
                             for _ in range(n - s)], dtype=torch.long, device=dev)
        p = torch.as_tensor([q for s, n in zip(starts, seq_lens) for q in range(s, n)],
                            dtype=torch.long, device=dev)
        return self.tokens[r, p], self.req_to_token[r, p].long()

    def caught_up(self, rows: Sequence[int]) -> None:
        for row in rows:
            self.stale_from.pop(row, None)
