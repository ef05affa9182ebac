"""Paged KV cache: one block allocator shared by the target and the draft model, and one
storage tensor per model.

Draft and target own separate KV storage but share the slot bookkeeping: a request's block
table indexes both, since both caches hold the same token positions. Rollback is truncating a
length and freeing tail blocks.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol

import torch


class OutOfBlocks(RuntimeError):
    pass


class BlockAllocator:
    """Free-list allocator of fixed-size KV blocks. Block ids are 0..num_blocks-1."""

    def __init__(self, num_blocks: int, block_size: int):
        if num_blocks < 1 or block_size < 1:
            raise ValueError("num_blocks and block_size must be >= 1")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))  # pop() -> lowest id
        self._used: set[int] = set()

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return len(self._used)

    def blocks_for(self, num_tokens: int) -> int:
        return (num_tokens + self.block_size - 1) // self.block_size

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise OutOfBlocks(f"need {n} KV blocks, {len(self._free)} free")
        out = [self._free.pop() for _ in range(n)]
        self._used.update(out)
        return out

    def free(self, blocks: Iterable[int]) -> None:
        for b in blocks:
            if b not in self._used:
                raise RuntimeError(f"double free of KV block {b}")
            self._used.remove(b)
            self._free.append(b)

    def check_integrity(self, owned: Iterable[Iterable[int]] = ()) -> None:
        """Raise if the free list and the used set disagree, or if `owned` (the block lists of
        all live requests) differs from the used set or shares a block between requests."""
        free = set(self._free)
        if len(free) != len(self._free):
            raise AssertionError("KV free list holds a block twice")
        if free & self._used:
            raise AssertionError("KV block both free and used")
        if len(free) + len(self._used) != self.num_blocks:
            raise AssertionError("KV blocks lost: free + used != total")
        seen: set[int] = set()
        for blocks in owned:
            for b in blocks:
                if b in seen:
                    raise AssertionError(f"KV block {b} owned by two requests")
                seen.add(b)
        if seen != self._used:
            raise AssertionError(
                f"KV used blocks {len(self._used)} != blocks owned by live requests {len(seen)}"
            )


class KVShape(Protocol):
    """What KV storage needs of a model's config (models/config.py ModelConfig has it)."""

    @property
    def num_layers(self) -> int: ...
    @property
    def num_kv_heads(self) -> int: ...
    @property
    def head_dim(self) -> int: ...


class KVStorage:
    """K and V tensors of one model: [num_layers, num_slots, kv_heads, head_dim] each."""

    def __init__(
        self, cfg: KVShape, num_blocks: int, block_size: int, dtype: torch.dtype, device
    ):
        slots = num_blocks * block_size
        shape = (cfg.num_layers, slots, cfg.num_kv_heads, cfg.head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        # slots: [T]; k, v: [T, kv_heads, head_dim]
        self.k[layer].index_copy_(0, slots, k)
        self.v[layer].index_copy_(0, slots, v)


def kv_bytes_per_block(cfgs: Iterable[KVShape], block_size: int, elem_bytes: int = 4) -> int:
    return sum(2 * c.num_layers * c.num_kv_heads * c.head_dim * elem_bytes for c in cfgs) * (
        block_size
    )
