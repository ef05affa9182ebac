"""Paged attention over SGLang's KV pool in plain torch: what sgl-kernel's CPU
`decode_attention_cpu` and `extend_attention_cpu` compute (sgl-kernel/csrc/cpu/decode.cpp,
extend.cpp), with the argument lists SGLang 0.5.23's `intel_amx` backend passes
(`sglang/srt/layers/attention/intel_amx_backend.py`).

Layout (page size 1, SGLang's CPU layout):
  k_buffer: [pool_tokens, num_kv_heads, head_dim]    one layer's keys, row = KV slot
  v_buffer: [pool_tokens, num_kv_heads, head_dim_v]
  req_to_token: [max_reqs, max_context_len] int32/int64; row r lists request r's KV slots
  seq_lens[b]: the request's total length; its keys are req_to_token[req_pool_indices[b], :seq_lens[b]]

Scores are computed in float32 (`s = (q . k) * sm_scale`, then `cap * tanh(s / cap)` when
logit_cap > 0), softmax in float32, output cast to the output tensor's dtype. GQA: query head
h reads KV head h // (num_heads // num_kv_heads).

Speed: without a logit cap, decode and short extends (at most SHORT_EXTEND tokens a request:
speculative verify, draft extends) run as one padded, masked `scaled_dot_product_attention`
over the batch (GQA without copying KV heads), long extends (prefill) one per request; with a
cap, one request at a time by explicit scores. A verify of k + 1 tokens then reads each
request's context once, as a decode step does (a request-by-request loop cost twice a
decode's time per context token, which made every verified token look dear on this CPU).
Requests of a short extend that have one row run apart from the longer ones, as decode
rows: padded to the batch's longest (k_max + 1 where one request verifies a full chain),
they made a ragged verify's attention up to ~1.8x a decode's at batch 15 (the real kernel
loops over requests and pads nothing).

Not implemented (SGLang passes them only for models this project does not serve; each raises
NotImplementedError naming the op): cross attention, sliding windows, attention sinks, encoder
lengths, FP8 / int8 KV caches.
"""

from __future__ import annotations

import torch

_FLOAT_KV = (torch.float32, torch.bfloat16, torch.float16)


def _unsupported(op: str, what: str) -> NotImplementedError:
    return NotImplementedError(f"sgl_kernel.{op}: {what} is not implemented by sloserve's CPU shim")


def _check_common(
    op: str, k_buffer: torch.Tensor, is_cross_attn: bool, sliding_window_size: int,
    encoder_lens: torch.Tensor | None, sinks: torch.Tensor | None,
) -> None:
    if k_buffer.dtype not in _FLOAT_KV:
        raise _unsupported(op, f"a {k_buffer.dtype} KV cache")
    if is_cross_attn:
        raise _unsupported(op, "cross attention")
    # SGLang passes layer.sliding_window_size + 1, i.e. 0 for "no window".
    if sliding_window_size > 0:
        raise _unsupported(op, "sliding-window attention")
    if encoder_lens is not None:
        raise _unsupported(op, "encoder lengths")
    if sinks is not None:
        raise _unsupported(op, "attention sinks")


def _attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visible: torch.Tensor | None,
    sm_scale: float, logit_cap: float,
) -> torch.Tensor:
    """q [Q, H, D], k [K, Hkv, D], v [K, Hkv, Dv], visible [Q, K] bool or None (all visible)
    -> [Q, H, Dv] float32."""
    num_heads, num_kv = q.shape[1], k.shape[1]
    group = num_heads // num_kv
    kf = k.float().repeat_interleave(group, dim=1)  # [K, H, D]
    vf = v.float().repeat_interleave(group, dim=1)  # [K, H, Dv]
    s = torch.einsum("qhd,khd->hqk", q.float(), kf) * sm_scale  # [H, Q, K]
    if logit_cap > 0:
        s = logit_cap * torch.tanh(s / logit_cap)
    if visible is not None:
        s = s.masked_fill(~visible.unsqueeze(0), float("-inf"))
    p = torch.softmax(s, dim=-1)  # [H, Q, K]
    return torch.einsum("hqk,khd->qhd", p, vf)


SHORT_EXTEND = 32  # extends of at most this many tokens a request run batched


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visible: torch.Tensor,
          sm_scale: float) -> torch.Tensor:
    """q [B, H, Q, D], k [B, Hkv, K, D], v [B, Hkv, K, Dv], visible [B, 1, Q, K] bool ->
    [B, H, Q, Dv] float32 (every query row must see at least one key). GQA as one group of
    G = H / Hkv query heads per KV head: q viewed as [B, Hkv, G Q, D] (head h = j G + g)."""
    B, H, Q, D = q.shape
    Hkv = k.shape[1]
    G = H // Hkv
    qg = q.float().contiguous().view(B, Hkv, G * Q, D)
    vis = visible.repeat(1, 1, G, 1) if G > 1 and Q > 1 else visible  # row g Q + i: row i
    out = torch.nn.functional.scaled_dot_product_attention(
        qg, k.float(), v.float(), attn_mask=vis, scale=sm_scale)  # [B, Hkv, G Q, Dv]
    return out.view(B, H, Q, -1)


def _one_query(query: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lens: torch.Tensor,
               sm_scale: float) -> torch.Tensor:
    """One query row per request over its gathered keys (decode steps, one-row extends):
    query [n, H, D], k [n, L, Hkv, D], v [n, L, Hkv, Dv] (positions >= lens[b] hidden),
    lens [n] int64 -> [n, H, Dv] float32."""
    visible = (torch.arange(k.shape[1]) < lens[:, None])[:, None, None, :]  # [n, 1, 1, L]
    return _sdpa(query.unsqueeze(2), k.transpose(1, 2), v.transpose(1, 2), visible,
                 sm_scale)[:, :, 0]


def _gather(buf: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """buf [pool, Hkv, D], slots [B, L] -> [B, L, Hkv, D] (a copy; index_select is several
    times faster than advanced indexing here)."""
    B, L = slots.shape
    return buf.index_select(0, slots.reshape(-1)).view(B, L, *buf.shape[1:])


def decode_attention(
    query: torch.Tensor,  # [bs, H, D]
    k_buffer: torch.Tensor,  # [pool, Hkv, D]   written at loc
    v_buffer: torch.Tensor,  # [pool, Hkv, Dv]  written at loc
    k_scale: float,
    v_scale: float,
    output: torch.Tensor,  # [bs, H, Dv] out
    key: torch.Tensor | None,  # [bs, Hkv, D] this step's keys, or None (already in the cache)
    value: torch.Tensor | None,  # [bs, Hkv, Dv]
    loc: torch.Tensor,  # [bs] int64 KV slot of this step's token
    attn_logits: torch.Tensor,  # scratch of the real kernel; unused here
    req_to_token: torch.Tensor,  # [max_reqs, max_context_len]
    req_pool_indices: torch.Tensor,  # [bs]
    seq_lens: torch.Tensor,  # [bs] int64, this step's token included
    sm_scale: float,
    logit_cap: float,
    is_cross_attn: bool = False,
    sliding_window_size: int = 0,
    encoder_lens: torch.Tensor | None = None,
    sinks: torch.Tensor | None = None,
) -> None:
    """One query token per sequence: store (key, value) at `loc`, then attend to the
    sequence's first seq_lens[b] slots of req_to_token."""
    op = "decode_attention_cpu"
    _check_common(op, k_buffer, is_cross_attn, sliding_window_size, encoder_lens, sinks)
    if key is not None and value is not None:
        k_buffer[loc] = key.to(k_buffer.dtype)
        v_buffer[loc] = value.to(v_buffer.dtype)
    rows = req_to_token[req_pool_indices.long()]  # [bs, max_context_len]
    if logit_cap <= 0 and query.shape[0]:
        lens = seq_lens.long()  # [bs]
        L = int(lens.max())
        slots = rows[:, :L].long()  # [bs, L]; slots past a request's length are masked
        out = _one_query(query, _gather(k_buffer, slots), _gather(v_buffer, slots), lens,
                         sm_scale)
        output.copy_(out.to(output.dtype))
        return
    for b in range(query.shape[0]):
        slots = rows[b, : int(seq_lens[b])].long()  # [L]
        out = _attend(query[b : b + 1], k_buffer[slots], v_buffer[slots], None, sm_scale,
                      logit_cap)
        output[b] = out[0].to(output.dtype)


def extend_attention(
    q_extend: torch.Tensor,  # [T, H, D] new tokens of all sequences, packed
    k_extend: torch.Tensor | None,  # [T, Hkv, D], or None: read them from the cache
    v_extend: torch.Tensor | None,  # [T, Hkv, Dv]
    o_extend: torch.Tensor,  # [T, H, Dv] out
    k_buffer: torch.Tensor,  # [pool, Hkv, D]   holds the prefixes
    v_buffer: torch.Tensor,  # [pool, Hkv, Dv]
    k_scale: float,
    v_scale: float,
    req_to_token: torch.Tensor,  # [max_reqs, max_context_len]
    req_pool_indices: torch.Tensor,  # [bs]
    seq_lens: torch.Tensor,  # [bs] prefix + extend
    extend_seq_lens: torch.Tensor,  # [bs]
    extend_start_loc: torch.Tensor,  # [bs] first row of each sequence in q/k/v/o_extend
    max_len_extend: int,
    sm_scale: float,
    logit_cap: float,
    is_cross_attn: bool = False,
    sliding_window_size: int = 0,
    encoder_lens: torch.Tensor | None = None,
    sinks: torch.Tensor | None = None,
    tree_mask: torch.Tensor | None = None,  # [bs * E * E] bool, QLEN_ONLY layout
    is_causal: bool = True,
) -> None:
    """Sequence b's extend tokens (rows extend_start_loc[b] + [0, extend_seq_lens[b])) attend
    to its whole prefix, the first seq_lens[b] - extend_seq_lens[b] slots of req_to_token, and
    to its own extend tokens: causally (query i sees extend keys 0..i), all of them when
    is_causal is False, or as tree_mask says (QLEN_ONLY: request b's [E, E] block, row = query,
    column = key, E = its extend length; the prefix stays fully visible)."""
    op = "extend_attention_cpu"
    _check_common(op, k_buffer, is_cross_attn, sliding_window_size, encoder_lens, sinks)
    rows = req_to_token[req_pool_indices.long()]  # [bs, max_context_len]
    ext_lens, lens = extend_seq_lens.long(), seq_lens.long()
    if bool((lens < ext_lens).any()):
        raise ValueError(f"sgl_kernel.{op}: prefix length < 0 for a sequence")
    if (logit_cap <= 0 and tree_mask is None and lens.numel()
            and int(ext_lens.max()) <= SHORT_EXTEND):
        _short_extend(q_extend, k_extend, v_extend, o_extend, k_buffer, v_buffer, rows,
                      lens, ext_lens, extend_start_loc.long(), sm_scale, is_causal)
        return
    mask_off = 0
    for b in range(seq_lens.shape[0]):
        n_ext, start = int(extend_seq_lens[b]), int(extend_start_loc[b])
        n_pre = int(seq_lens[b]) - n_ext
        if n_pre < 0:
            raise ValueError(f"sgl_kernel.{op}: prefix length < 0 for sequence {b}")
        if n_ext == 0:
            continue
        pre = rows[b, :n_pre].long()
        if k_extend is None or v_extend is None:  # the layer already stored them
            ext_slots = rows[b, n_pre : n_pre + n_ext].long()
            k_ext, v_ext = k_buffer[ext_slots], v_buffer[ext_slots]
        else:
            k_ext = k_extend[start : start + n_ext]
            v_ext = v_extend[start : start + n_ext]
        k = torch.cat([k_buffer[pre].to(k_ext.dtype), k_ext])  # [n_pre + n_ext, Hkv, D]
        v = torch.cat([v_buffer[pre].to(v_ext.dtype), v_ext])
        if tree_mask is not None:
            ext_vis = tree_mask[mask_off : mask_off + n_ext * n_ext].view(n_ext, n_ext).bool()
            mask_off += n_ext * n_ext
        elif is_causal:
            ext_vis = torch.ones(n_ext, n_ext, dtype=torch.bool).tril()
        else:
            ext_vis = torch.ones(n_ext, n_ext, dtype=torch.bool)
        visible = torch.cat([torch.ones(n_ext, n_pre, dtype=torch.bool), ext_vis], dim=1)
        qb = q_extend[start : start + n_ext]
        if logit_cap <= 0:
            out = _sdpa(qb.transpose(0, 1)[None], k.transpose(0, 1)[None],
                        v.transpose(0, 1)[None], visible[None, None], sm_scale)[0]
            out = out.transpose(0, 1)  # [n_ext, H, Dv]
        else:
            out = _attend(qb, k, v, visible, sm_scale, logit_cap)
        o_extend[start : start + n_ext] = out.to(o_extend.dtype)


def _short_extend(q_extend: torch.Tensor, k_extend: torch.Tensor | None,
                  v_extend: torch.Tensor | None, o_extend: torch.Tensor,
                  k_buffer: torch.Tensor, v_buffer: torch.Tensor, rows: torch.Tensor,
                  lens: torch.Tensor, ext_lens: torch.Tensor, starts: torch.Tensor,
                  sm_scale: float, is_causal: bool) -> None:
    """extend_attention for short extends. A speculative verify with per-request lengths
    mixes requests that verify nothing (one row: the decode step's work) with a few that
    verify up to k_max + 1 rows; padded to one E they would make every request's attention
    E times a decode's. So requests of one row run decode-like (`_one_row`), the others
    padded to their own longest (`_padded`); each group reads its requests' KV once.
    rows [bs, max_context_len]; lens, ext_lens, starts [bs] int64."""
    one = ext_lens == 1  # [bs]
    n_one = int(one.sum())
    if n_one == len(lens):
        _one_row(q_extend, k_extend, v_extend, o_extend, k_buffer, v_buffer, rows, lens,
                 starts, sm_scale)
        return
    if n_one == 0:
        _padded(q_extend, k_extend, v_extend, o_extend, k_buffer, v_buffer, rows, lens,
                ext_lens, starts, sm_scale, is_causal)
        return
    a, b = one.nonzero().view(-1), (~one).nonzero().view(-1)
    _one_row(q_extend, k_extend, v_extend, o_extend, k_buffer, v_buffer, rows.index_select(0, a),
             lens[a], starts[a], sm_scale)
    _padded(q_extend, k_extend, v_extend, o_extend, k_buffer, v_buffer, rows.index_select(0, b),
            lens[b], ext_lens[b], starts[b], sm_scale, is_causal)


def _one_row(q_extend: torch.Tensor, k_extend: torch.Tensor | None,
             v_extend: torch.Tensor | None, o_extend: torch.Tensor, k_buffer: torch.Tensor,
             v_buffer: torch.Tensor, rows: torch.Tensor, lens: torch.Tensor,
             starts: torch.Tensor, sm_scale: float) -> None:
    """Requests that extend by one token (row starts[b] of q/k/v/o_extend), decode_attention's
    work: the token sees its request's first lens[b] slots, itself last (causal or not is
    the same for one row). rows [n, max_context_len]; lens, starts [n] int64."""
    n, L = len(lens), int(lens.max())
    slots = rows[:, :L].long()  # [n, L]
    k, v = _gather(k_buffer, slots), _gather(v_buffer, slots)  # [n, L, Hkv, D] copies
    if k_extend is not None and v_extend is not None:  # the new key as passed, at lens - 1
        at = torch.arange(n) * L + lens - 1  # [n] rows of k.view(n * L, ...)
        k.view(-1, *k.shape[2:]).index_copy_(0, at, k_extend.index_select(0, starts).to(k.dtype))
        v.view(-1, *v.shape[2:]).index_copy_(0, at, v_extend.index_select(0, starts).to(v.dtype))
    out = _one_query(q_extend.index_select(0, starts), k, v, lens, sm_scale)
    o_extend.index_copy_(0, starts, out.to(o_extend.dtype))


def _padded(q_extend: torch.Tensor, k_extend: torch.Tensor | None,
            v_extend: torch.Tensor | None, o_extend: torch.Tensor, k_buffer: torch.Tensor,
            v_buffer: torch.Tensor, rows: torch.Tensor, lens: torch.Tensor,
            ext_lens: torch.Tensor, starts: torch.Tensor, sm_scale: float,
            is_causal: bool) -> None:
    """Short extends, the batch at once: request b's queries padded to E = max ext_lens, its
    keys the first lens[b] slots of its req_to_token row (the extend keys from k_extend where
    given), masked per request (prefix visible, the extend causal or not, padding hidden).
    rows [bs, max_context_len]; lens, ext_lens, starts [bs] int64."""
    E, L = int(ext_lens.max()), int(lens.max())
    pre = lens - ext_lens  # [bs]
    i = torch.arange(E)
    valid = i[None, :] < ext_lens[:, None]  # [bs, E] real query rows
    b_idx, e_idx = valid.nonzero(as_tuple=True)  # [T] each
    src = starts[b_idx] + e_idx  # [T] rows of q/k/v/o_extend
    slots = rows[:, :L].long()  # [bs, L]
    k, v = _gather(k_buffer, slots), _gather(v_buffer, slots)  # [bs, L, Hkv, D] copies
    if k_extend is not None and v_extend is not None:  # the new keys as passed
        at = b_idx * L + pre[b_idx] + e_idx  # [T] rows of k.view(bs * L, ...)
        k.view(-1, *k.shape[2:]).index_copy_(0, at, k_extend.index_select(0, src).to(k.dtype))
        v.view(-1, *v.shape[2:]).index_copy_(0, at, v_extend.index_select(0, src).to(v.dtype))
    rows_q = b_idx * E + e_idx  # [T] rows of q.view(bs * E, ...)
    q = q_extend.new_zeros((len(lens), E, *q_extend.shape[1:]))  # [bs, E, H, D]
    q.view(-1, *q.shape[2:]).index_copy_(0, rows_q, q_extend.index_select(0, src))
    j = torch.arange(L)[None, None, :]  # key positions
    visible = j < lens[:, None, None]  # [bs, 1 -> E, L]
    if is_causal:
        visible = visible & ((j < pre[:, None, None]) | (j - pre[:, None, None] <= i[None, :, None]))
    visible = visible | ~valid[:, :, None]  # padded rows see everything (and are dropped)
    out = _sdpa(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), visible[:, None],
                sm_scale)  # [bs, H, E, Dv]
    flat = out.transpose(1, 2).reshape(len(lens) * E, *out.shape[1:2], out.shape[3])
    o_extend.index_copy_(0, src, flat.index_select(0, rows_q).to(o_extend.dtype))
