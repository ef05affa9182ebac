"""Index bookkeeping ops of SGLang's KV pool and EAGLE-style speculative decoding in plain
torch: what sgl-kernel's CPU build computes (sgl-kernel/csrc/cpu/spec.cpp), called the way
SGLang 0.5.23 calls them (`sglang/kernels/ops/speculative/*.py`, `srt/mem_cache/allocation.py`).

Terms: `req_to_token` [max_reqs, pool_len] int32 maps (request row, token position) -> KV slot;
a request's row is `req_pool_indices[b]`. Outputs are written in place, like the kernels do.
These run once per step on small tensors, so plain loops are fine where they are clearest.
"""

from __future__ import annotations

import torch


def _segments(start: torch.Tensor, end: torch.Tensor) -> list[tuple[int, int]]:
    return list(zip(start.tolist(), end.tolist()))


def assign_req_to_token_pool(
    req_pool_indices: torch.Tensor,  # [bs]
    req_to_token: torch.Tensor,  # [max_reqs, pool_len] int32, out
    start_offset: torch.Tensor,  # [bs]
    end_offset: torch.Tensor,  # [bs]
    out_cache_loc: torch.Tensor,  # [sum(end - start)] int64, packed in batch order
    pool_len: int,
) -> None:
    """req_to_token[rpi[b], start[b]:end[b]] = the next end[b] - start[b] slots of
    out_cache_loc (request b's segment follows request b-1's)."""
    flat = req_to_token.view(-1)
    off = 0
    for b, (s, e) in enumerate(_segments(start_offset, end_offset)):
        base = int(req_pool_indices[b]) * pool_len
        flat[base + s : base + e] = out_cache_loc[off : off + e - s].to(flat.dtype)
        off += e - s


def assign_extend_cache_locs(
    req_pool_indices: torch.Tensor,  # [bs]
    req_to_token: torch.Tensor,  # [rows, pool_len]
    start_offset: torch.Tensor,  # [bs]
    end_offset: torch.Tensor,  # [bs]
    out_cache_loc: torch.Tensor,  # [sum(end - start)] int64, out
    pool_len: int,
) -> None:
    """The inverse gather: out_cache_loc packs req_to_token[rpi[b], start[b]:end[b]] for every b
    in batch order (verify / draft-extend KV slots)."""
    flat = req_to_token.reshape(-1)
    off = 0
    for b, (s, e) in enumerate(_segments(start_offset, end_offset)):
        base = int(req_pool_indices[b]) * pool_len
        out_cache_loc[off : off + e - s] = flat[base + s : base + e].to(out_cache_loc.dtype)
        off += e - s


def assign_draft_cache_locs_contiguous(
    req_pool_indices: torch.Tensor,  # [bs]
    req_to_token: torch.Tensor,  # [max_reqs, pool_len]
    seq_lens: torch.Tensor,  # [bs]
    out_cache_loc: torch.Tensor,  # [bs * topk * num_steps] int64, out
    pool_len: int,
    topk: int,
    num_steps: int,
) -> None:
    """Request b's topk * num_steps draft slots, reserved right after its committed prefix:
    out_cache_loc[b*n : (b+1)*n] = req_to_token[rpi[b], seq_lens[b] : seq_lens[b] + n]."""
    n = topk * num_steps
    if out_cache_loc.numel() != req_pool_indices.numel() * n:
        raise ValueError("assign_draft_cache_locs_contiguous_cpu: out_cache_loc has the wrong size")
    for b, sl in enumerate(seq_lens.tolist()):
        row = req_to_token[int(req_pool_indices[b])]
        out_cache_loc[b * n : (b + 1) * n] = row[sl : sl + n].to(out_cache_loc.dtype)


def build_draft_decode_metadata(
    req_to_token: torch.Tensor,  # [max_reqs, pool_len] int32
    req_pool_indices: torch.Tensor,  # [num_seqs]
    seq_lens: torch.Tensor,  # [num_seqs]
    topk: int,
    num_steps: int,
    pool_len: int,
) -> torch.Tensor:
    """A private req_to_token for the multi-step draft decode: row b*topk + t holds request b's
    committed prefix (seq_lens[b] slots) followed by branch t's num_steps draft slots, which
    assign_draft_cache_locs_contiguous laid out at seq_lens[b] + t*num_steps. Returns
    [num_seqs * topk, pool_len] int32; entries past seq_lens[b] + num_steps are undefined
    (zero here)."""
    num_seqs = req_pool_indices.numel()
    out = torch.zeros(num_seqs * topk, pool_len, dtype=req_to_token.dtype)
    for b, sl in enumerate(seq_lens.tolist()):
        src = req_to_token[int(req_pool_indices[b])]
        for t in range(topk):
            dst = out[b * topk + t]
            dst[:sl] = src[:sl]
            dst[sl : sl + num_steps] = src[sl + t * num_steps : sl + (t + 1) * num_steps]
    return out


def fill_bonus_tokens(
    accept_tokens: torch.Tensor,  # [bs, accept_stride] int32
    accept_lens: torch.Tensor,  # [bs] int32, accepted tokens incl. the bonus
    bonus_tokens: torch.Tensor,  # [bs] int32, out
    accept_stride: int,
) -> None:
    """bonus_tokens[b] = the last accepted token: accept_tokens[b, accept_lens[b] - 1]."""
    flat = accept_tokens.reshape(-1)
    for b, n in enumerate(accept_lens.tolist()):
        bonus_tokens[b] = flat[b * accept_stride + n - 1]


def fill_accept_out_cache_loc(
    accept_index: torch.Tensor,  # [bs * num_spec_step] (any shape, read flat), -1 = rejected
    out_cache_loc: torch.Tensor,  # [bs * num_draft_tokens] int64
    accept_out_cache_loc: torch.Tensor,  # [num_accepted] int64, out
) -> None:
    """Compact the accepted tokens' KV slots in order: out_cache_loc[i] for each accept_index
    entry i >= 0."""
    idx = accept_index.reshape(-1).long()
    kept = out_cache_loc[idx[idx >= 0]]
    accept_out_cache_loc[: kept.numel()] = kept


def verify_tree_greedy(
    predicts: torch.Tensor,  # [bs * num_draft_tokens] int32, out: verified token per slot
    accept_index: torch.Tensor,  # [bs, num_spec_step] int32, out: flat indices, -1 padded
    accept_token_num: torch.Tensor,  # [bs] int32, out: accepted drafts (bonus excluded)
    candidates: torch.Tensor,  # [bs, num_draft_tokens] draft tokens, slot 0 = root
    retrive_index: torch.Tensor,  # [bs, num_draft_tokens] flat index of each tree node
    retrive_next_token: torch.Tensor,  # [bs, num_draft_tokens] first child, -1 = none
    retrive_next_sibling: torch.Tensor,  # [bs, num_draft_tokens] next sibling, -1 = none
    target_predict: torch.Tensor,  # [bs, num_draft_tokens] target argmax at each slot
) -> None:
    """Greedy tree verification: from the root, repeatedly step to the first child whose draft
    token equals the target's argmax at the current node; record each accepted node's flat
    index; predicts[node] = target token at every accepted node and at the last one (the
    bonus). accept_index entries past the accepted path are left as they were (callers
    pre-fill -1)."""
    num_spec_step = accept_index.shape[1]
    cand, ri = candidates.tolist(), retrive_index.tolist()
    nxt, sib = retrive_next_token.tolist(), retrive_next_sibling.tolist()
    tp = target_predict.reshape(-1).tolist()
    for b in range(candidates.shape[0]):
        last = ri[b][0]
        accept_index[b, 0] = last
        n_ok, cur = 0, 0
        for _ in range(1, num_spec_step):
            cur = nxt[b][cur]
            while cur != -1 and cand[b][cur] != tp[last]:
                cur = sib[b][cur]
            if cur == -1:
                break
            predicts[last] = tp[last]
            n_ok += 1
            accept_index[b, n_ok] = ri[b][cur]
            last = ri[b][cur]
        accept_token_num[b] = n_ok
        predicts[last] = tp[last]


def build_tree_kernel_efficient(
    parent_list: torch.Tensor,  # [bs, topk * (depth - 1) + 1]
    selected_index: torch.Tensor,  # [bs, draft_token_num - 1]
    verified_seq_len: torch.Tensor,  # [bs] committed prefix length
    tree_mask: torch.Tensor,  # bool, out; QLEN_ONLY: [bs * n * n]; FULL_MASK: see below
    positions: torch.Tensor,  # [bs * n] out
    retrive_index: torch.Tensor,  # [bs, n] out
    retrive_next_token: torch.Tensor,  # [bs, n] out, pre-filled -1
    retrive_next_sibling: torch.Tensor,  # [bs, n] out, pre-filled -1
    topk: int,
    depth: int,
    draft_token_num: int,
    tree_mask_mode: int,  # 0 FULL_MASK, 1 QLEN_ONLY
) -> None:
    """The draft tree of each request from EAGLE's top-k search. Node 0 is the root (the bonus
    token); node i >= 1 is the draft token chosen by selected_index[b, i-1] (an index into the
    flattened per-step top-k candidates, whose parent is candidate parent_list[b, sel // topk]).
    Fills: the children lists (first child in retrive_next_token, the rest chained through
    retrive_next_sibling, the latest-added child first), positions = seq_len + depth in the
    tree, retrive_index = flat node index b*n + i, and the ancestor mask (node i sees the root,
    itself and its ancestors). FULL_MASK rows also carry the seq_len prefix columns, which are
    left to the caller (they are pre-filled True); request b's block starts at
    sum_{c<b} (seq_len_c * n + n * n)."""
    if tree_mask_mode not in (0, 1):
        raise NotImplementedError(
            "sgl_kernel.build_tree_kernel_efficient_cpu: tree mask mode "
            f"{tree_mask_mode} (QLEN_ONLY_BITPACKING) is not implemented by sloserve's CPU shim")
    n = draft_token_num
    pstride = topk * (depth - 1) + 1
    par = parent_list.reshape(-1).tolist()
    sel = selected_index.reshape(-1).tolist()
    seq = verified_seq_len.tolist()
    sstride = n - 1

    def parent_node(b: int, i: int) -> int:
        """Node index (0 = root) of node i's parent, or n if it is not in the tree."""
        ptb = sel[b * sstride + i - 1] // topk
        if ptb == 0:
            return 0
        tok = par[b * pstride + ptb]
        for j in range(n - 1):
            if sel[b * sstride + j] == tok:
                return j + 1
        return n

    # built on Python lists and written to the tensors at once: an element-wise tensor write
    # costs microseconds, and a batch of 16 chains of 9 made thousands (3.4 ms a step)
    bs = len(seq)
    pos = [0] * (bs * n)
    rnt = retrive_next_token.reshape(-1).tolist()  # pre-filled -1
    rns = retrive_next_sibling.reshape(-1).tolist()
    cols: list[int] = []  # flat tree_mask indices written, and their values
    vals: list[bool] = []
    mask_base = 0
    for b in range(bs):
        off = b * n
        pos[off] = seq[b]
        parents = [0] + [parent_node(b, i) for i in range(1, n)]
        for i in range(n - 1, 0, -1):
            p = parents[i]
            if p == n:
                continue
            first = rnt[off + p]
            rnt[off + p] = i
            if first != -1:
                rns[off + i] = first
        row_len = n if tree_mask_mode == 1 else seq[b] + n
        col0 = 0 if tree_mask_mode == 1 else seq[b]
        for t in range(n):
            row = mask_base + t * row_len + col0
            seen = [False] * n
            seen[0] = True
            node, d = t, 0
            while node != 0:
                d += 1
                seen[node] = True
                node = parents[node]
                if node == n:
                    break
            if t:
                pos[off + t] = seq[b] + d
            cols.extend(range(row, row + n))
            vals.extend(seen)
        mask_base += n * row_len
    dev = positions.device
    positions.copy_(torch.tensor(pos, dtype=positions.dtype, device=dev))
    retrive_index.copy_(torch.arange(bs * n, dtype=retrive_index.dtype,
                                     device=dev).reshape(retrive_index.shape))
    retrive_next_token.copy_(torch.tensor(rnt, dtype=retrive_next_token.dtype,
                                          device=dev).reshape(retrive_next_token.shape))
    retrive_next_sibling.copy_(torch.tensor(rns, dtype=retrive_next_sibling.dtype,
                                            device=dev).reshape(retrive_next_sibling.shape))
    if cols:
        tree_mask[torch.tensor(cols, dtype=torch.int64, device=dev)] = torch.tensor(
            vals, dtype=tree_mask.dtype, device=dev)


def rotate_input_ids(
    input_ids: torch.Tensor,  # [num_extend_tokens] int64, in/out
    extend_start_loc: torch.Tensor,  # [bs]
    extend_seq_lens: torch.Tensor,  # [bs]
    topk_index: torch.Tensor,  # [bs] int64, the new token per request
    select_index: torch.Tensor | None = None,  # [bs] int64 global slot for the new token
) -> None:
    """Shift each request's segment left by one and write its new token at the segment's end
    (or at select_index[b] when given)."""
    for b, (s, n) in enumerate(zip(extend_start_loc.tolist(), extend_seq_lens.tolist())):
        if n > 1:
            input_ids[s : s + n - 1] = input_ids[s + 1 : s + n].clone()
        if n > 0:
            dst = int(select_index[b]) if select_index is not None else s + n - 1
            input_ids[dst] = topk_index.reshape(-1)[b]
