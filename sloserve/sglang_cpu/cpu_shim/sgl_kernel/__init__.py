"""sloserve's stand-in for the CPU build of `sgl_kernel`, for SGLang 0.5.23 on CPUs.

PyPI ships only the CUDA build of sgl-kernel, which cannot even be imported without a CUDA
driver; SGLang's CPU engine (SGLANG_USE_CPU_ENGINE=1) imports `*_cpu` ops from it. A launcher
puts the directory holding this package (`sloserve/sglang_cpu/cpu_shim`) first on the
SGLang process's PYTHONPATH, and only on machines without CUDA
(`sloserve.sglang_cpu.cpu_server`); it is never installed as `sgl_kernel`.

It registers torch implementations (`sloserve.sglang_cpu.cpu_ops`) as
`torch.ops.sgl_kernel.<name>` with the schemas SGLang 0.5.23 calls, and exports the same
names as Python functions, like the real package. Any other name imported from here is a
function that raises NotImplementedError naming the op when called.
"""

from __future__ import annotations

import os

import torch

from sloserve.sglang_cpu.cpu_ops import attention, kv_move, spec

__version__ = "0.0.0+sloserve.cpu.shim"

# (schema, implementation). Mutated arguments are marked (x!) as in sgl-kernel's own schemas.
_OPS = {
    "decode_attention_cpu": (
        "(Tensor query, Tensor(a!) k_buffer, Tensor(b!) v_buffer, float k_scale, float v_scale,"
        " Tensor(c!) output, Tensor? key, Tensor? value, Tensor loc, Tensor attn_logits,"
        " Tensor req_to_token, Tensor req_pool_indices, Tensor seq_lens, float sm_scale,"
        " float logit_cap, bool is_cross_attn, int sliding_window_size, Tensor? encoder_lens,"
        " Tensor? sinks) -> ()",
        attention.decode_attention,
    ),
    "extend_attention_cpu": (
        "(Tensor q_extend, Tensor? k_extend, Tensor? v_extend, Tensor(a!) o_extend,"
        " Tensor k_buffer, Tensor v_buffer, float k_scale, float v_scale, Tensor req_to_token,"
        " Tensor req_pool_indices, Tensor seq_lens, Tensor extend_seq_lens,"
        " Tensor extend_start_loc, int max_len_extend, float sm_scale, float logit_cap,"
        " bool is_cross_attn, int sliding_window_size, Tensor? encoder_lens, Tensor? sinks,"
        " Tensor? tree_mask, bool is_causal) -> ()",
        attention.extend_attention,
    ),
    "copy_all_layer_kv_cache_cpu": (
        "(Tensor data_ptrs, Tensor strides, Tensor tgt_loc, Tensor src_loc) -> ()",
        kv_move.copy_all_layer_kv_cache,
    ),
    "assign_req_to_token_pool_cpu": (
        "(Tensor req_pool_indices, Tensor(a!) req_to_token, Tensor start_offset,"
        " Tensor end_offset, Tensor out_cache_loc, int pool_len) -> ()",
        spec.assign_req_to_token_pool,
    ),
    "assign_extend_cache_locs_cpu": (
        "(Tensor req_pool_indices, Tensor req_to_token, Tensor start_offset, Tensor end_offset,"
        " Tensor(a!) out_cache_loc, int pool_len) -> ()",
        spec.assign_extend_cache_locs,
    ),
    "assign_draft_cache_locs_contiguous_cpu": (
        "(Tensor req_pool_indices, Tensor req_to_token, Tensor seq_lens,"
        " Tensor(a!) out_cache_loc, int pool_len, int topk, int num_steps) -> ()",
        spec.assign_draft_cache_locs_contiguous,
    ),
    "build_draft_decode_metadata_cpu": (
        "(Tensor req_to_token, Tensor req_pool_indices, Tensor seq_lens, int topk,"
        " int num_steps, int pool_len) -> Tensor",
        spec.build_draft_decode_metadata,
    ),
    "fill_bonus_tokens_cpu": (
        "(Tensor accept_tokens, Tensor accept_lens, Tensor(a!) bonus_tokens,"
        " int accept_stride) -> ()",
        spec.fill_bonus_tokens,
    ),
    "fill_accept_out_cache_loc_cpu": (
        "(Tensor accept_index, Tensor out_cache_loc, Tensor(a!) accept_out_cache_loc) -> ()",
        spec.fill_accept_out_cache_loc,
    ),
    "verify_tree_greedy_cpu": (
        "(Tensor(a!) predicts, Tensor(b!) accept_index, Tensor(c!) accept_token_num,"
        " Tensor candidates, Tensor retrive_index, Tensor retrive_next_token,"
        " Tensor retrive_next_sibling, Tensor target_predict) -> ()",
        spec.verify_tree_greedy,
    ),
    "build_tree_kernel_efficient_cpu": (
        "(Tensor parent_list, Tensor selected_index, Tensor verified_seq_len,"
        " Tensor(a!) tree_mask, Tensor(b!) positions, Tensor(c!) retrive_index,"
        " Tensor(d!) retrive_next_token, Tensor(e!) retrive_next_sibling, int topk, int depth,"
        " int draft_token_num, int tree_mask_mode) -> ()",
        spec.build_tree_kernel_efficient,
    ),
    "rotate_input_ids_cpu": (
        "(Tensor(a!) input_ids, Tensor extend_start_loc, Tensor extend_seq_lens,"
        " Tensor topk_index, Tensor? select_index) -> ()",
        spec.rotate_input_ids,
    ),
}

_TRACE = os.environ.get("SLOSERVE_SGL_KERNEL_TRACE")  # file: each op's name at its first call


def _traced(name: str, impl):
    if not _TRACE:
        return impl
    seen = False

    def call(*args, **kwargs):
        nonlocal seen
        if not seen:
            seen = True
            with open(_TRACE, "a") as f:
                f.write(f"{os.getpid()} {name}\n")
        return impl(*args, **kwargs)

    return call


# Kept alive for the process: the registrations live as long as this object.
_LIB = torch.library.Library("sgl_kernel", "FRAGMENT")
for _name, (_schema, _impl) in _OPS.items():
    _LIB.define(_name + _schema)
    _LIB.impl(_name, _traced(_name, _impl), "CPU")


def _python_entry(name: str):
    op = getattr(torch.ops.sgl_kernel, name)

    def call(*args, **kwargs):
        return op(*args, **kwargs)

    call.__name__ = call.__qualname__ = name
    call.__doc__ = f"torch.ops.sgl_kernel.{name} (sloserve CPU shim)"
    return call


# `from sgl_kernel import assign_req_to_token_pool_cpu` etc., like the real package.
globals().update({_name: _python_entry(_name) for _name in _OPS})
IMPLEMENTED_OPS = tuple(sorted(_OPS))


def __getattr__(name: str):
    """Any other public name: a function that raises NotImplementedError when called, so an
    import of an op this shim lacks fails loudly at its first use, naming it."""
    if name.startswith("_"):
        raise AttributeError(name)

    def missing(*args, **kwargs):
        raise NotImplementedError(
            f"sgl_kernel.{name} is not implemented by sloserve's CPU shim "
            f"(sloserve/sglang_cpu/cpu_shim); implemented: {', '.join(IMPLEMENTED_OPS)}"
        )

    missing.__name__ = name
    return missing
