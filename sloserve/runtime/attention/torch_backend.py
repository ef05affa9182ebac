"""Portable attention backend in plain PyTorch (CPU or CUDA), for ragged batches over paged KV.

Segments with few query tokens (decode, verify, draft steps) run as one padded batch: their
KV slots are gathered into [B, max_kv] and one SDPA call covers them, with the GQA group
folded into the query rows so K/V are never repeated per head. Long segments (prefill
chunks) run one SDPA call each.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from sloserve.runtime.attention.base import AttentionBackend, register_backend
from sloserve.runtime.batch import ForwardBatch

SMALL_Q = 16  # segments with at most this many query tokens join the padded batch


@dataclass
class _Prefill:
    t0: int  # first row of this segment in the flat token axis
    t1: int
    kv_slots: torch.Tensor  # [kv_len] int64
    mask: torch.Tensor | None  # [q_len, kv_len] bool (True = attend), None = plain causal


@dataclass
class TorchAttnMeta:
    num_tokens: int
    # padded batch of small segments (absent when there are none)
    q_rows: torch.Tensor | None = None  # [Bs, max_q] rows of q (pad rows point at row T, zeros)
    kv_slots: torch.Tensor | None = None  # [Bs * max_kv] gathered KV slots (pad -> slot 0)
    mask: torch.Tensor | None = None  # [Bs, 1, max_q, max_kv] bool
    out_pad_rows: torch.Tensor | None = None  # [Ts] rows of the flattened padded output ...
    out_rows: torch.Tensor | None = None  # [Ts] ... that land at these flat token rows
    shape: tuple[int, int, int] = (0, 0, 0)  # Bs, max_q, max_kv
    prefills: list[_Prefill] = field(default_factory=list)
    _folded: dict[int, torch.Tensor] = field(default_factory=dict)  # GQA group -> mask

    def folded_mask(self, group: int) -> torch.Tensor:
        """[Bs, 1, G * max_q, max_kv]: the mask repeated for each query head of a KV head."""
        if group not in self._folded:
            assert self.mask is not None  # planned: there are small segments
            bs, mq, mkv = self.shape
            m = self.mask.expand(bs, group, mq, mkv).reshape(bs, 1, group * mq, mkv)
            self._folded[group] = m
        return self._folded[group]


def plan_small_padded(meta: TorchAttnMeta, batch: ForwardBatch, small: list[int]) -> None:
    rows = torch.tensor(small, dtype=torch.long)
    q_len, start = batch.q_lens[rows], batch.starts[rows]
    kv_len = start + q_len
    bs, max_q, max_kv = len(small), int(q_len.max()), int(kv_len.max())
    qo = torch.tensor(batch.qo_indptr[:-1], dtype=torch.long)[rows]
    ar_q = torch.arange(max_q)
    valid_q = ar_q[None, :] < q_len[:, None]  # [Bs, max_q]
    q_rows = torch.where(valid_q, qo[:, None] + ar_q[None, :], batch.num_tokens)  # pad -> zero row
    key_pos = torch.arange(max_kv)
    q_pos = start[:, None] + ar_q[None, :]  # [Bs, max_q]
    mask = (key_pos[None, None, :] <= q_pos[:, :, None]) & (key_pos[None, None, :] < kv_len[:, None, None])
    mask = torch.where(valid_q[:, :, None], mask, key_pos[None, None, :] == 0)  # pad rows: key 0
    meta.q_rows = q_rows
    meta.kv_slots = batch.kv_slots(rows, max_kv).reshape(-1)
    meta.mask = mask[:, None]
    meta.out_pad_rows = torch.nonzero(valid_q.reshape(-1)).squeeze(1)
    meta.out_rows = q_rows.reshape(-1)[meta.out_pad_rows]
    meta.shape = (bs, max_q, max_kv)


def small_segments(batch: ForwardBatch) -> list[int]:
    """Indices of the segments that run batched (few query tokens); the rest run one by one."""
    return [i for i, s in enumerate(batch.segments) if s.q_len <= SMALL_Q]


def plan_prefills(meta: TorchAttnMeta, batch: ForwardBatch) -> None:
    for i, s in enumerate(batch.segments):
        if s.q_len <= SMALL_Q:
            continue
        slots = batch.kv_slots(torch.tensor([i]), s.kv_len)[0]
        mask = None
        if s.start > 0:
            key_pos = torch.arange(s.kv_len)
            q_pos = torch.arange(s.start, s.kv_len)
            mask = key_pos[None, :] <= q_pos[:, None]
        t0 = batch.qo_indptr[i]
        meta.prefills.append(_Prefill(t0, t0 + s.q_len, slots, mask))


def run_prefills(q, k_cache, v_cache, meta: TorchAttnMeta, scale: float, out: torch.Tensor) -> None:
    """One SDPA call per long segment, written into its rows of out."""
    for p in meta.prefills:
        qs = q[p.t0 : p.t1].transpose(0, 1).unsqueeze(0)  # [1, H, q_len, D]
        k = k_cache.index_select(0, p.kv_slots).transpose(0, 1).unsqueeze(0)
        v = v_cache.index_select(0, p.kv_slots).transpose(0, 1).unsqueeze(0)
        o = F.scaled_dot_product_attention(
            qs, k, v, attn_mask=p.mask, is_causal=p.mask is None, scale=scale, enable_gqa=True
        )
        out[p.t0 : p.t1] = o[0].transpose(0, 1)


def run_small_padded(q, k_cache, v_cache, meta: TorchAttnMeta, scale: float,
                     out: torch.Tensor) -> None:
    """The short segments as one padded SDPA call, written into their rows of out."""
    if meta.q_rows is None:
        return
    T, H, D = q.shape
    KVH = k_cache.shape[1]
    G = H // KVH
    bs, mq, mkv = meta.shape
    q_ext = torch.cat([q, q.new_zeros(1, H, D)])
    qp = q_ext[meta.q_rows]  # [Bs, max_q, H, D]
    qp = qp.view(bs, mq, KVH, G, D).permute(0, 2, 3, 1, 4).reshape(bs, KVH, G * mq, D)
    k = k_cache.index_select(0, meta.kv_slots).view(bs, mkv, KVH, D).transpose(1, 2)
    v = v_cache.index_select(0, meta.kv_slots).view(bs, mkv, KVH, D).transpose(1, 2)
    o = F.scaled_dot_product_attention(
        qp, k, v, attn_mask=meta.folded_mask(G), scale=scale
    )  # [Bs, KVH, G * max_q, D]
    o = o.view(bs, KVH, G, mq, D).permute(0, 3, 1, 2, 4).reshape(bs * mq, H, D)
    out[meta.out_rows] = o[meta.out_pad_rows]


class TorchAttentionBackend(AttentionBackend):
    name = "torch"

    def plan(self, batch: ForwardBatch) -> TorchAttnMeta:
        meta = TorchAttnMeta(num_tokens=batch.num_tokens)
        small = small_segments(batch)
        if small:
            plan_small_padded(meta, batch, small)
        plan_prefills(meta, batch)
        return meta

    def forward(self, q, k_cache, v_cache, meta: TorchAttnMeta, scale: float) -> torch.Tensor:
        out = torch.empty_like(q)
        run_small_padded(q, k_cache, v_cache, meta, scale, out)
        run_prefills(q, k_cache, v_cache, meta, scale, out)
        return out


register_backend("torch", TorchAttentionBackend)
