"""One ragged forward batch: every request contributes any number of query tokens.

A segment is one request's slice of the batch: `q_len` new tokens at positions
`start .. start + q_len - 1`, attending to KV positions `0 .. start + q_len - 1` stored in the
request's blocks. Prefill chunks, decodes (q_len 1), draft catch-ups and verifies (q_len k+1)
are all segments; the batch is flat over tokens with `qo_indptr` offsets.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass(frozen=True)
class Segment:
    block_ids: Sequence[int]  # the request's KV blocks, in position order
    start: int  # position of the first query token (= KV tokens already cached)
    token_ids: Sequence[int]  # the query tokens, len >= 1
    all_logits: bool = False  # logits for every query token (verify) or only the last

    @property
    def q_len(self) -> int:
        return len(self.token_ids)

    @property
    def kv_len(self) -> int:
        return self.start + len(self.token_ids)


@dataclass
class ForwardBatch:
    segments: list[Segment]
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    slot_mapping: torch.Tensor  # [T] int64: flat KV slot each query token's K/V goes to
    qo_indptr: list[int]  # [B + 1] query offsets into the flat token axis
    logits_indices: torch.Tensor  # [L] int64: token rows whose logits are computed
    logits_indptr: list[int]  # [B + 1] offsets of each segment's rows in the logits
    block_size: int
    block_table: torch.Tensor  # [B, max_blocks] int64, rows padded with block 0
    starts: torch.Tensor  # [B] int64: first query position of each segment
    q_lens: torch.Tensor  # [B] int64
    attn: Any = field(default=None)  # backend metadata, built once per step by plan()

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def kv_lens(self) -> torch.Tensor:  # [B]
        return self.starts + self.q_lens

    def kv_slots(self, rows: torch.Tensor, max_kv: int) -> torch.Tensor:
        """[len(rows), max_kv] flat KV slots of positions 0..max_kv-1 of the given segments
        (positions past a segment's kv_len map into its padding: mask them)."""
        pos = torch.arange(max_kv)
        bt = self.block_table.index_select(0, rows)
        blk = bt.gather(1, (pos // self.block_size).clamp_max(bt.shape[1] - 1).expand(len(rows), -1))
        return blk * self.block_size + pos % self.block_size


def slots_for(block_ids: Sequence[int], start: int, end: int, block_size: int) -> list[int]:
    """Flat KV slot of every position in [start, end)."""
    return [block_ids[p // block_size] * block_size + p % block_size for p in range(start, end)]


def build_forward_batch(segments: list[Segment], block_size: int) -> ForwardBatch:
    ids: list[int] = []
    qo = [0]
    logit_rows: list[int] = []
    lo = [0]
    max_blocks = 1
    for seg in segments:
        if seg.q_len < 1:
            raise ValueError("a segment needs at least one query token")
        if (seg.kv_len + block_size - 1) // block_size > len(seg.block_ids):
            raise ValueError(f"segment needs {seg.kv_len} KV slots, has {len(seg.block_ids)} blocks")
        ids.extend(seg.token_ids)
        base = qo[-1]
        qo.append(base + seg.q_len)
        if seg.all_logits:
            logit_rows.extend(range(base, base + seg.q_len))
        else:
            logit_rows.append(base + seg.q_len - 1)
        lo.append(len(logit_rows))
        max_blocks = max(max_blocks, len(seg.block_ids))
    table = torch.tensor([list(s.block_ids) + [0] * (max_blocks - len(s.block_ids)) for s in segments],
                         dtype=torch.long).view(len(segments), max_blocks)
    starts = torch.tensor([s.start for s in segments], dtype=torch.long)
    q_lens = torch.tensor([s.q_len for s in segments], dtype=torch.long)
    T = qo[-1]
    seg_of = torch.repeat_interleave(torch.arange(len(segments)), q_lens)  # [T]
    offset = torch.arange(T) - torch.tensor(qo[:-1], dtype=torch.long)[seg_of]
    positions = starts[seg_of] + offset
    slots = table[seg_of, positions // block_size] * block_size + positions % block_size
    return ForwardBatch(
        segments=segments,
        input_ids=torch.tensor(ids, dtype=torch.long),
        positions=positions,
        slot_mapping=slots,
        qo_indptr=qo,
        logits_indices=torch.tensor(logit_rows, dtype=torch.long),
        logits_indptr=lo,
        block_size=block_size,
        block_table=table,
        starts=starts,
        q_lens=q_lens,
    )
