"""Token bitmasks: xgrammar's packed form ([R, ceil(V / 32)] int32, bit t % 32 of word t // 32
set = token t allowed) and the few operations on it the engine needs, none with a Python loop
over the vocabulary."""

from __future__ import annotations

import torch
import xgrammar as xgr

ALL_ALLOWED = -1  # an int32 word with all 32 bits set
_SHIFTS = torch.arange(32, dtype=torch.int32)


def words(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


def allocate(rows: int, vocab_size: int) -> torch.Tensor:
    """[rows, words(V)] int32, every token allowed."""
    return torch.full((rows, words(vocab_size)), ALL_ALLOWED, dtype=torch.int32)


def to_bool(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[R, W] int32 -> [R, V] bool (True = allowed)."""
    bits = (bitmask[..., :, None] >> _SHIFTS) & 1  # [R, W, 32]
    return bits.reshape(*bitmask.shape[:-1], -1)[..., :vocab_size].bool()


def apply_(logits: torch.Tensor, bitmask: torch.Tensor,
           indices: list[int] | None = None) -> torch.Tensor:
    """Set forbidden tokens' logits to -inf in place. logits [R, V] float32 on CPU, bitmask
    [R, W] int32 with W * 32 >= V (the tail bits past V are ignored); indices: only these
    rows (None: all)."""
    xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=logits.shape[-1],
                                    indices=indices)
    return logits


def from_bool(allowed: torch.Tensor) -> torch.Tensor:
    """[..., V] bool -> [..., words(V)] int32 (the inverse of to_bool)."""
    V = allowed.shape[-1]
    pad = words(V) * 32 - V
    bits = torch.nn.functional.pad(allowed.long(), (0, pad)).reshape(*allowed.shape[:-1], -1, 32)
    w = (bits << _SHIFTS.long()).sum(dim=-1)  # [..., W] in [0, 2**32)
    return torch.where(w >= 2**31, w - 2**32, w).to(torch.int32)  # two's complement
