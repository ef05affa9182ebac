"""Per-request state table."""

from __future__ import annotations

import numpy as np

from sloserve.policies.request_table import RequestTable


def test_slots_are_stable_recycled_and_initialised():
    t = RequestTable(capacity=2)
    a = t.slots(["a", "b"], fill=0.5)
    t.values[a] = [1.0, 2.0]
    again = t.slots(["b", "a"], fill=0.5)  # another order: not the cached batch
    np.testing.assert_array_equal(again, a[::-1])
    grown = t.slots(["a", "b", "c"], fill=0.25)  # grows past the capacity
    np.testing.assert_array_equal(t.values[grown], [1.0, 2.0, 0.25])
    t.release("a")
    assert len(t) == 2
    d = t.slots(["d"], fill=0.75)  # reuses a's slot, freshly initialised
    assert d[0] == a[0] and t.values[d[0]] == 0.75
    np.testing.assert_array_equal(t.values[t.slots(["b", "c"], fill=0.0)], [2.0, 0.25])


def test_cached_batch_is_invalidated_by_release():
    t = RequestTable()
    ids = ["x", "y"]
    first = t.slots(ids, fill=1.0)
    assert t.slots(list(ids), fill=1.0) is first  # same batch: cached
    t.release("x")
    t.values[:] = 0.0
    fresh = t.slots(ids, fill=3.0)
    assert t.values[fresh[0]] == 3.0  # x is a new request again


def test_ids_may_be_tuples_or_arrays():
    t = RequestTable()
    a = t.slots(("p", "q"), fill=1.0)
    np.testing.assert_array_equal(t.slots(np.array(["p", "q"]), fill=1.0), a)
