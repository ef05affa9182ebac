"""Per-request policy state kept in numpy columns, keyed by request id.

Policies gather a whole batch's state with one fancy index (`values[slots]`) and write it
back with one scatter, instead of looping over requests in the hot path.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


class RequestTable:
    """One float64 value per live request; slots are recycled on `release`."""

    def __init__(self, capacity: int = 256) -> None:
        self.values = np.zeros(capacity)  # [capacity]
        # [capacity] True from a slot's allocation until its owner clears it (what "fresh"
        # means is the owner's: SpecServe, no draft token of the request's own seen yet)
        self.fresh = np.zeros(capacity, dtype=bool)
        # [capacity] a second float64 value per request, 0 from the slot's allocation (its
        # meaning is the owner's too: SpecServe, the catch-up credit in seconds)
        self.credit = np.zeros(capacity)
        # [capacity] a third, likewise 0 from allocation (SpecServe: the request's own draft
        # tokens its value has absorbed)
        self.seen = np.zeros(capacity)
        # [capacity] a fourth, set to `fill` at allocation like `values` (SpecServe: the
        # prediction a first draft round is planned at)
        self.first = np.zeros(capacity)
        self._index: dict[str, int] = {}
        self._free: list[int] = []
        self._next = 0
        self._last: tuple[list[str], np.ndarray] | None = None  # the previous batch's slots

    def __len__(self) -> int:
        return len(self._index)

    def slots(self, request_ids: Sequence[str], fill: float) -> np.ndarray:
        """[B] int64 slots of the requests; unknown ids get a new slot set to `fill`.
        The returned array must not be modified (it is reused while the batch is unchanged)."""
        if not isinstance(request_ids, list):  # a tuple or an array of ids
            request_ids = list(request_ids)
        last = self._last
        if last is not None and last[0] == request_ids:  # steady decoding: same batch
            return last[1]
        get = self._index.get
        found = [get(rid, -1) for rid in request_ids]
        if -1 in found:
            for i, rid in enumerate(request_ids):
                if found[i] == -1:
                    found[i] = self._allocate(rid, fill)
        slots = np.array(found, dtype=np.int64)
        self._last = (list(request_ids), slots)
        return slots

    def release(self, request_id: str) -> None:
        slot = self._index.pop(request_id, None)
        if slot is not None:
            self._free.append(slot)
            self._last = None

    def _allocate(self, request_id: str, fill: float) -> int:
        if request_id in self._index:  # a duplicate id within one batch
            return self._index[request_id]
        if self._free:
            slot = self._free.pop()
        else:
            slot = self._next
            self._next += 1
            if slot >= self.values.size:
                self.values = np.concatenate([self.values, np.zeros(self.values.size)])
                self.fresh = np.concatenate([self.fresh, np.zeros(self.fresh.size, bool)])
                self.credit = np.concatenate([self.credit, np.zeros(self.credit.size)])
                self.seen = np.concatenate([self.seen, np.zeros(self.seen.size)])
                self.first = np.concatenate([self.first, np.zeros(self.first.size)])
        self.values[slot] = fill
        self.first[slot] = fill
        self.credit[slot] = 0.0
        self.seen[slot] = 0.0
        self.fresh[slot] = True
        self._index[request_id] = slot
        return slot
