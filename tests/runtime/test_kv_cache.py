from __future__ import annotations

import pytest

from sloserve.runtime.kv_cache import BlockAllocator, OutOfBlocks


def test_allocate_free_roundtrip_and_integrity():
    a = BlockAllocator(10, 4)
    x, y = a.allocate(3), a.allocate(5)
    a.check_integrity([x, y])
    assert a.num_free == 2
    with pytest.raises(OutOfBlocks):
        a.allocate(3)
    a.free(x)
    a.check_integrity([y])
    a.free(y)
    a.check_integrity([])
    assert a.num_free == 10


def test_integrity_detects_leaks_double_ownership_and_double_free():
    a = BlockAllocator(8, 2)
    x = a.allocate(4)
    with pytest.raises(AssertionError, match="owned"):
        a.check_integrity([x[:2]])  # two blocks used but owned by nobody: a leak
    with pytest.raises(AssertionError, match="two requests"):
        a.check_integrity([x, x[:1]])
    a.free(x[:1])
    with pytest.raises(RuntimeError, match="double free"):
        a.free(x[:1])


def test_blocks_for():
    a = BlockAllocator(4, 16)
    assert [a.blocks_for(n) for n in (0, 1, 16, 17)] == [0, 1, 1, 2]
