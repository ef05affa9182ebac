"""Which committed positions the SPECSERVE draft has KV for, so that the draft reads
nothing it need not (no SGLang imports; draft_chain.py runs the forwards).

SGLang's flow has the draft read every prompt at prefill and every verified window
[b, d_1..d_k] after verify, k = 0 included (a draft forward each: 8 of 66 ms a step on
the real pair at concurrency 1). SPECSERVE's draft reads neither then: its rounds already
wrote KV for b, d_1..d_{k-1} (the tokens verified), a step without drafting leaves b unread,
and a request the policy never drafts for never needs its prompt read. This book records
what is missing; the first round of the next step that drafts reads every missing position
of its requests together with their bonus tokens in one ragged extend (the catch-up), so
prompts, skipped steps and the last accepted draft cost rows of a forward the step runs
anyway, not forwards of their own.

State, all indexed by SGLang's own identities (the draft shares the target's
req_to_token rows and KV slot numbers, with its own KV buffers):
- `stale_from[row]`: the first position of the request in req_to_token row `row` whose
  draft KV is missing (no entry: every committed position has it);
- `tokens[row, pos]`: the token at each position of each row, written by every prefill and
  every decode step, and the bonus token's before a catch-up (the catch-up reads committed
  ones: the last write to a position is the step that committed it, later steps write only
  past their own seq_len);
- `slot_ok[slot]`: whether the draft's KV at KV slot `slot` holds the token the target
  committed there. Slots outlive requests through SGLang's radix cache: a new request's
  cached prefix may hold a finished request's skipped positions, found here at its prefill.
Invariant: for every row in a decode batch, positions < stale_from[row] (all of them
without an entry) have draft KV; each has slot_ok True. (slot_ok False may be stale the
other way, a slot whose KV the draft did write: it only makes a later reader read more.)
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

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

    def verified(self, rows: Sequence[int], seq_lens: Sequence[int],
                 window: torch.Tensor) -> None:
        """A decode step verified window [bs, n] (b, d_1..d_{n-1}) at positions seq_lens[i]..
        + n - 1 of row rows[i]; the draft's rounds wrote KV for all but the last (none when
        n = 1: the step drafted nothing), which stays missing until the next catch-up (if
        it was rejected, the next step's positions start before it and nothing is read)."""
        dev = self.tokens.device
        r = torch.as_tensor(rows, dtype=torch.long, device=dev)
        p = torch.as_tensor(seq_lens, dtype=torch.long, device=dev)
        n = window.shape[1]
        self.decoded(r, p, window)
        self.slot_ok[self.req_to_token[r, p + n - 1].long()] = False
        stale = self.stale_from
        for row, pos in zip(rows, seq_lens):
            # a mark at or past this window's start is superseded: the step's rounds (or
            # its round 1 decode) wrote L..L + n - 2, and a mark past the sequence (drafts
            # rejected last step) would otherwise hide L + n - 1 after a step without
            # drafting, leaving a rejected draft's KV in the context for good
            if stale.get(row, pos) >= pos:
                stale[row] = pos + n - 1

    def unread(self, slots: torch.Tensor) -> None:
        """The target wrote these slots (a prefill chunk) and the draft did not read them."""
        self.slot_ok[slots.long()] = False

    def prefilled(self, rows: Sequence[int], fill_ids: Sequence[Sequence[int]]) -> None:
        """The target read each request's prompt (fill_ids: all of it so far, a cached prefix
        included); the draft reads it when it first drafts, from the first position whose
        slot has no draft KV: the new chunk (`unread`), or earlier where SGLang's radix
        cache handed the request a prefix with positions nobody read into the draft."""
        dev = self.tokens.device
        for row, ids in zip(rows, fill_ids):
            self.stale_from.pop(row, None)
            self.tokens[row, :len(ids)] = torch.as_tensor(list(ids), dtype=torch.int64,
                                                          device=dev)
            slots = self.req_to_token[row, :len(ids)].long()
            holes = (~self.slot_ok[slots]).nonzero()
            if holes.numel():
                self.stale_from[row] = int(holes[0, 0])

    def bonus(self, rows: Sequence[int], seq_lens: Sequence[int], tokens: torch.Tensor) -> None:
        """The step's bonus tokens [bs] at positions seq_lens (the target committed them; the
        first round reads them with the catch-up)."""
        r = torch.as_tensor(rows, dtype=torch.long, device=self.tokens.device)
        p = torch.as_tensor(seq_lens, dtype=torch.long, device=self.tokens.device)
        self.tokens[r, p] = tokens.to(torch.int64).reshape(-1)

    def catch_up(self, rows: Sequence[int], seq_lens: Sequence[int]) -> list[int] | None:
        """Where each request's catch-up starts before a step that drafts (it reads through
        the bonus token's position seq_lens[i], which the first round reads anyway), or None
        when nobody misses anything. A request that misses nothing starts at its bonus."""
        if not any(row in self.stale_from for row in rows):
            return None
        return [min(self.stale_from.get(row, n), n) for row, n in zip(rows, seq_lens)]

    def drafters_catch_up(self, rows: Sequence[int], seq_lens: Sequence[int],
                          drafting: Iterable[bool] | None
                          ) -> tuple[list[int] | None, list[int]]:
        """catch_up for the requests that draft the step (drafting [bs], None: all of them):
        (starts, kept). A request that does not draft starts at its bonus and keeps what it
        misses: kept lists the batch indices of those that miss something (the caller marks
        the slots their rounds write unread and leaves them stale). starts is None when no
        drafting request misses anything."""
        starts = self.catch_up(rows, seq_lens)
        if starts is None:
            return None, []
        kept = [] if drafting is None else [
            i for i, (d, s, n) in enumerate(zip(drafting, starts, seq_lens)) if not d and s < n]
        for i in kept:
            starts[i] = seq_lens[i]
        if all(s >= n for s, n in zip(starts, seq_lens)):
            return None, kept
        return starts, kept

    def lags(self, rows: Sequence[int], seq_lens: Sequence[int]) -> list[int]:
        """[bs] positions before each request's bonus (at seq_lens[i]) a catch-up would read
        now: 0 for a request that misses nothing."""
        stale = self.stale_from
        return [n - min(stale.get(row, n), n) for row, n in zip(rows, seq_lens)]

    def window(self, rows: Sequence[int], starts: Sequence[int],
               ends: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """The tokens and KV slots of positions starts[i]..ends[i] - 1 of each row, request
        after request ([sum(end - start)] each)."""
        dev = self.tokens.device
        r = torch.as_tensor([row for row, s, n in zip(rows, starts, ends)
                             for _ in range(n - s)], dtype=torch.long, device=dev)
        p = torch.as_tensor([q for s, n in zip(starts, ends) for q in range(s, n)],
                            dtype=torch.long, device=dev)
        return self.tokens[r, p], self.req_to_token[r, p].long()

    def caught_up(self, rows: Sequence[int]) -> None:
        for row in rows:
            self.stale_from.pop(row, None)
