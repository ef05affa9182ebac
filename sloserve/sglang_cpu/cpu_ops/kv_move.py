"""KV slot moves across all layers by raw buffer address: what sgl-kernel's CPU
`copy_all_layer_kv_cache_cpu` does (sgl-kernel/csrc/cpu/kvcache.cpp). SGLang's KV pool hands
over the base address and the row stride in bytes of every K/V buffer
(`MHATokenToKVPool._init_data_ptrs_and_strides`), not the tensors, so the rows are reached
through ctypes views of that memory.
"""

from __future__ import annotations

import ctypes

import torch


def copy_all_layer_kv_cache(
    data_ptrs: torch.Tensor,  # [num_buffers] uint64 base address of each K/V buffer
    strides: torch.Tensor,  # [num_buffers] int64 bytes per slot row
    tgt_loc: torch.Tensor,  # [num_locs] slot indices written
    src_loc: torch.Tensor,  # [num_locs] slot indices read
) -> None:
    """For every buffer: rows[tgt_loc[i]] = rows[src_loc[i]] for all i, every source row read
    before any target row is written (overlapping src/tgt sets are safe)."""
    if data_ptrs.numel() != strides.numel() or tgt_loc.numel() != src_loc.numel():
        raise ValueError("copy_all_layer_kv_cache_cpu: mismatched argument lengths")
    if tgt_loc.numel() == 0:
        return
    tgt, src = tgt_loc.reshape(-1).long(), src_loc.reshape(-1).long()
    if int(torch.minimum(tgt.min(), src.min())) < 0:
        raise ValueError("copy_all_layer_kv_cache_cpu: negative slot index")
    num_rows = int(torch.maximum(tgt.max(), src.max())) + 1
    for ptr, stride in zip(data_ptrs.tolist(), strides.tolist()):
        # A byte view of rows [0, num_rows) of this buffer: [num_rows, stride] uint8.
        raw = (ctypes.c_uint8 * (num_rows * stride)).from_address(int(ptr))
        rows = torch.frombuffer(raw, dtype=torch.uint8).view(num_rows, stride)
        rows[tgt] = rows[src].clone()
