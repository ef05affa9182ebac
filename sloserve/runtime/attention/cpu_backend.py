"""CPU attention backend: short segments (decode, verify, draft steps) run through the C++
paged-attention kernel, which reads K/V straight from the paged cache; prefill chunks run
through SDPA as in the torch backend.

Against the torch backend's padded batch this skips the per-layer gather of every request's
K/V into a padded tensor and SDPA's per-head overhead on 1-16 query rows (batch 32, context
96: 3.6x less time per layer in isolation, ~3x in the engine; see BENCHMARKS.md). Where the
kernel is unavailable (no compiler, see sloserve/runtime/cpu_kernels.py) or does not apply
(not fp32, head_dim not a multiple of 16), the torch backend's padded path runs instead,
planned on first need.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sloserve.runtime.attention.base import register_backend
from sloserve.runtime.attention.torch_backend import (
    TorchAttentionBackend,
    TorchAttnMeta,
    plan_prefills,
    plan_small_padded,
    run_prefills,
    run_small_padded,
    small_segments,
)
from sloserve.runtime.batch import ForwardBatch
from sloserve.runtime.cpu_kernels import paged_attention_op


@dataclass
class CpuAttnMeta(TorchAttnMeta):
    batch: ForwardBatch | None = None
    small: list[int] | None = None  # indices of the short segments
    # per short segment, for the kernel: first row in q, query tokens, first position, blocks
    k_rows: torch.Tensor | None = None  # [Bs] int64
    k_q_lens: torch.Tensor | None = None  # [Bs] int64
    k_starts: torch.Tensor | None = None  # [Bs] int64
    k_block_table: torch.Tensor | None = None  # [Bs, max_blocks] int64, contiguous
    block_size: int = 0
    padded_planned: bool = False


class CpuAttentionBackend(TorchAttentionBackend):
    name = "cpu"

    def __init__(self):
        self.op = paged_attention_op()

    def plan(self, batch: ForwardBatch) -> CpuAttnMeta:
        meta = CpuAttnMeta(num_tokens=batch.num_tokens, batch=batch, block_size=batch.block_size)
        small = small_segments(batch)
        if small:
            meta.small = small
            if len(small) == len(batch.segments):
                rows = None
                meta.k_q_lens, meta.k_starts = batch.q_lens, batch.starts
                meta.k_block_table = batch.block_table.contiguous()
            else:
                rows = torch.tensor(small, dtype=torch.long)
                meta.k_q_lens, meta.k_starts = batch.q_lens[rows], batch.starts[rows]
                meta.k_block_table = batch.block_table.index_select(0, rows)
            qo = torch.tensor(batch.qo_indptr[:-1], dtype=torch.long)
            meta.k_rows = qo if rows is None else qo[rows]
        plan_prefills(meta, batch)
        return meta

    def forward(self, q, k_cache, v_cache, meta: TorchAttnMeta, scale: float) -> torch.Tensor:
        assert isinstance(meta, CpuAttnMeta)  # from self.plan
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        if meta.small is not None:
            if self._kernel_applies(q, k_cache):
                # the kernel computes in float32 (bf16 caches widened exactly on load); bf16
                # queries are widened and the rows rounded back once, after the kernel
                q32 = q.float() if q.dtype != torch.float32 else q
                if q32.stride(2) != 1 or q32.stride(1) != q32.shape[2]:
                    q32 = q32.contiguous()
                o32 = out if out.dtype == torch.float32 else torch.empty(q.shape)
                self.op(q32, k_cache, v_cache, meta.k_rows, meta.k_q_lens, meta.k_starts,
                        meta.k_block_table, meta.block_size, scale, o32)
                if o32 is not out:  # prefill rows, garbage here, are written below
                    out.copy_(o32)
            else:
                if not meta.padded_planned:
                    assert meta.batch is not None  # plan() keeps it when there are small ones
                    plan_small_padded(meta, meta.batch, meta.small)
                    meta.padded_planned = True
                run_small_padded(q, k_cache, v_cache, meta, scale, out)
        run_prefills(q, k_cache, v_cache, meta, scale, out)
        return out

    def _kernel_applies(self, q: torch.Tensor, k_cache: torch.Tensor) -> bool:
        return (self.op is not None and q.device.type == "cpu"
                and q.dtype in (torch.float32, torch.bfloat16)
                and k_cache.dtype in (torch.float32, torch.bfloat16)
                and q.shape[2] % 16 == 0 and k_cache.is_contiguous())


register_backend("cpu", CpuAttentionBackend)
