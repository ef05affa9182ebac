"""Torch implementations of the sgl-kernel CPU ops SGLang 0.5.23's CPU engine and its
EAGLE/STANDALONE speculative worker call. Plain torch, importable without SGLang; the
`sgl_kernel` stand-in in ../cpu_shim registers them as `torch.ops.sgl_kernel.*`."""

from sloserve.sglang_cpu.cpu_ops.attention import decode_attention, extend_attention
from sloserve.sglang_cpu.cpu_ops.kv_move import copy_all_layer_kv_cache
from sloserve.sglang_cpu.cpu_ops.spec import (
    assign_draft_cache_locs_contiguous,
    assign_extend_cache_locs,
    assign_req_to_token_pool,
    build_draft_decode_metadata,
    build_tree_kernel_efficient,
    fill_accept_out_cache_loc,
    fill_bonus_tokens,
    rotate_input_ids,
    verify_tree_greedy,
)

__all__ = [
    "assign_draft_cache_locs_contiguous", "assign_extend_cache_locs", "assign_req_to_token_pool",
    "build_draft_decode_metadata", "build_tree_kernel_efficient", "copy_all_layer_kv_cache",
    "decode_attention", "extend_attention", "fill_accept_out_cache_loc", "fill_bonus_tokens",
    "rotate_input_ids", "verify_tree_greedy",
]
