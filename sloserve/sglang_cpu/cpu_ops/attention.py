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
loops over requests and pads nothing). The index tensors and masks of a decode or short
extend depend on the batch's metadata alone, the same for every layer of a forward: they are
built once a forward (`_PlanMemo`), which took a ragged verify's attention at batch 4 (16
rows) from 22 to 15 ms a 30-layer forward and at batch 16 (42 rows) from 77 to 58 ms
(the 2-core Xeon, 2026-11-29; decode unchanged at 9 and 43 ms).

The project's C++ paged attention (`sloserve.runtime.cpu_kernels`, the built-in engine's
kernel) serves decode steps and short causal extends whenever it loaded, the logit cap is off,
no tree mask is given and the cache already holds the extend's keys (SGLang's backend writes
them before the call): it reads each request's keys in place through its req_to_token row (a
block table of block size 1), pads and gathers nothing, and computes each query row alike
whatever the batch, so a verify row gets a decode row's bits. On the 2-core AVX-512 EPYC a
30-layer SmolLM2 forward's attention at batch 4 went from ~11 ms (decode) and ~16 ms (a
ragged verify of 10 rows) to ~2 and ~5 ms (2026-12-05, BENCHMARKS.md). SLOSERVE_CPU_KERNELS=0
or a failed build keeps the torch code below.

Not implemented (SGLang passes them only for models this project does not serve; each raises
NotImplementedError naming the op): cross attention, sliding windows, attention sinks, encoder
lengths, FP8 / int8 KV caches.
"""

from __future__ import annotations

import functools

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


def _group_mask(visible: torch.Tensor, G: int) -> torch.Tensor:
    """visible [B, 1, Q, K] bool -> the mask of `_sdpa`'s grouped query rows, [B, 1, G Q, K]
    (row g Q + i is row i), or visible itself when Q = 1 or G = 1 (it broadcasts)."""
    return visible.repeat(1, 1, G, 1) if G > 1 and visible.shape[2] > 1 else visible


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, vis: torch.Tensor,
          sm_scale: float) -> torch.Tensor:
    """q [B, H, Q, D], k [B, Hkv, K, D], v [B, Hkv, K, Dv], vis `_group_mask`'s [B, 1, G Q, K]
    bool -> [B, H, Q, Dv] float32 (every query row must see at least one key). GQA as one
    group of G = H / Hkv query heads per KV head: q viewed as [B, Hkv, G Q, D] (head
    h = j G + g)."""
    B, H, Q, D = q.shape
    Hkv = k.shape[1]
    qg = q.float().contiguous().view(B, Hkv, (H // Hkv) * Q, D)
    out = torch.nn.functional.scaled_dot_product_attention(
        qg, k.float(), v.float(), attn_mask=vis, scale=sm_scale)  # [B, Hkv, G Q, Dv]
    return out.view(B, H, Q, -1)


def _gather(buf: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """buf [pool, Hkv, D], slots [B, L] -> [B, L, Hkv, D] (a copy; index_select is several
    times faster than advanced indexing here)."""
    B, L = slots.shape
    return buf.index_select(0, slots.reshape(-1)).view(B, L, *buf.shape[1:])


@functools.cache
def _paged_kernel():
    """torch.ops.sloserve_cpu.paged_attention_small, or None (no compiler, the build failed,
    SLOSERVE_CPU_KERNELS=0). Loaded at the first attention call: a build (first start on a
    machine whose kernels were not built at install) logs and takes 15-30 s."""
    from sloserve.runtime.cpu_kernels import paged_attention_op

    return paged_attention_op()


class _Segments:
    """The C++ kernel's arguments for a decode or a short causal extend: segment b is request
    b's q_lens[b] query rows from row rows[b] of q, at positions first[b] .. lens[b] - 1 of
    its context, whose keys sit at table[b, :lens[b]] (req_to_token's row, block size 1)."""

    def __init__(self, req_to_token: torch.Tensor, pool_idx: torch.Tensor, lens: torch.Tensor,
                 q_lens: torch.Tensor, rows: torch.Tensor) -> None:
        L = int(lens.max())
        self.table = req_to_token[:, :L].index_select(0, pool_idx).long()  # [bs, L]
        self.rows = rows.contiguous()  # [bs] int64
        self.q_lens = q_lens.contiguous()  # [bs] int64
        self.first = (lens - q_lens).contiguous()  # [bs] int64
        # [T] the extend tokens' KV slots, in q's row order (where the cache must hold the
        # keys passed as k_extend), and those rows of q
        E = int(q_lens.max())
        i = torch.arange(E)
        b_idx, e_idx = (i[None, :] < q_lens[:, None]).nonzero(as_tuple=True)
        self.src = rows[b_idx] + e_idx
        self.slots = self.table[b_idx, self.first[b_idx] + e_idx]
        # the cache held the extend's keys at the plan's first call (extend_attention)
        self.holds = False


def _run_kernel(kernel, plan: _Segments, q: torch.Tensor, k_buffer: torch.Tensor,
                v_buffer: torch.Tensor, out: torch.Tensor, sm_scale: float) -> None:
    """q [T, H, D] (any dtype), out [T, H, Dv]: the kernel's float32 rows of every segment."""
    qf = q if q.dtype == torch.float32 and q.stride(2) == 1 and q.stride(1) == q.shape[2] \
        else q.float().contiguous()
    direct = out.dtype == torch.float32 and out.is_contiguous()
    o = out if direct else torch.empty(out.shape, dtype=torch.float32)
    kernel(qf, k_buffer, v_buffer, plan.rows, plan.q_lens, plan.first, plan.table, 1,
           sm_scale, o)
    if not direct:
        out.copy_(o.to(out.dtype))


def _kernel_fits(kernel, q: torch.Tensor, k_buffer: torch.Tensor, v_buffer: torch.Tensor,
                 logit_cap: float) -> bool:
    """What the C++ kernel computes exactly as the torch path does: no logit cap, a float
    cache of one dtype (float32 or bf16), contiguous, head_dim a multiple of 16, equal K/V
    head dims."""
    return (kernel is not None and logit_cap <= 0 and q.shape[0] > 0
            and k_buffer.dtype in (torch.float32, torch.bfloat16)
            and v_buffer.dtype == k_buffer.dtype and k_buffer.is_contiguous()
            and v_buffer.is_contiguous() and k_buffer.shape == v_buffer.shape
            and q.shape[2] == k_buffer.shape[2] and q.shape[2] % 16 == 0)


class _Rows:
    """Requests attended as decode rows (one query each, the last of its request's lens[b]
    keys): decode steps and the one-row requests of a short extend."""

    def __init__(self, req_to_token: torch.Tensor, pool_idx: torch.Tensor, lens: torch.Tensor,
                 starts: torch.Tensor) -> None:
        n, L = len(lens), int(lens.max())
        self.lens, self.starts = lens, starts  # [n] int64; starts: rows of q/k/v/o_extend
        # [n, L] KV slots (the table's first L columns only: its rows are context-long)
        self.slots = req_to_token[:, :L].index_select(0, pool_idx).long()
        self.vis = (torch.arange(L) < lens[:, None])[:, None, None, :]  # [n, 1, 1, L]
        self.at = torch.arange(n) * L + lens - 1  # [n] the new key's row of k.view(n L, ...)


class _Padded:
    """Short extends padded to E = max ext_lens a request (`_padded`): index tensors and the
    grouped mask (prefix visible, the extend causal or not, padding hidden)."""

    def __init__(self, req_to_token: torch.Tensor, pool_idx: torch.Tensor, lens: torch.Tensor,
                 ext_lens: torch.Tensor, starts: torch.Tensor, is_causal: bool, G: int) -> None:
        bs = len(lens)
        self.bs = bs
        self.E = E = int(ext_lens.max())
        self.L = L = int(lens.max())
        pre = lens - ext_lens  # [bs]
        i = torch.arange(E)
        valid = i[None, :] < ext_lens[:, None]  # [bs, E] real query rows
        b_idx, e_idx = valid.nonzero(as_tuple=True)  # [T] each
        self.src = starts[b_idx] + e_idx  # [T] rows of q/k/v/o_extend
        self.slots = req_to_token[:, :L].index_select(0, pool_idx).long()  # [bs, L]
        self.at = b_idx * L + pre[b_idx] + e_idx  # [T] rows of k.view(bs * L, ...)
        self.rows_q = b_idx * E + e_idx  # [T] rows of q.view(bs * E, ...)
        j = torch.arange(L)[None, None, :]  # key positions
        visible = j < lens[:, None, None]  # [bs, 1 -> E, L]
        if is_causal:
            visible = visible & ((j < pre[:, None, None])
                                 | (j - pre[:, None, None] <= i[None, :, None]))
        visible = visible | ~valid[:, :, None]  # padded rows see everything (and are dropped)
        self.vis = _group_mask(visible[:, None], G)  # [bs, 1, G E, L]


class _Short:
    """A short extend's split: one-row requests as decode rows, the others padded."""

    def __init__(self, req_to_token: torch.Tensor, pool_idx: torch.Tensor, lens: torch.Tensor,
                 ext_lens: torch.Tensor, starts: torch.Tensor, is_causal: bool, G: int) -> None:
        one = ext_lens == 1  # [bs]
        a, b = one.nonzero().view(-1), (~one).nonzero().view(-1)
        self.rows = _Rows(req_to_token, pool_idx[a], lens[a], starts[a]) if len(a) else None
        self.padded = (_Padded(req_to_token, pool_idx[b], lens[b], ext_lens[b], starts[b],
                               is_causal, G) if len(b) else None)


class _PlanMemo:
    """The last attention plan (`_Rows`, `_Short`) and what it was built from. Every layer
    of a forward passes the same batch metadata, so its index tensors and masks (a third of
    a short extend's attention time at batch 4 on the 2-core Xeon) are built once a forward.
    A plan is reused only for a call whose key is equal by value: the plan's kind, the
    req_to_token tensor, the heads' grouping and the values of req_pool_indices, seq_lens,
    extend lengths and starts and each request's last KV slot (a pool row reused by a new
    request has other slots). A reused plan therefore equals a rebuilt one, whatever forward
    (target or draft, this step or the next) the call belongs to. Inference mode tracks no
    tensor versions, so identity alone could not tell a metadata tensor changed in place."""

    def __init__(self) -> None:
        self.meta: tuple | None = None
        self.values: torch.Tensor | None = None
        self.plan: object | None = None
        self.table: torch.Tensor | None = None  # held, compared by identity

    def get(self, meta: tuple, req_to_token: torch.Tensor, pool_idx: torch.Tensor,
            parts: list[torch.Tensor], build) -> object:
        """meta: hashable key parts; parts: [bs] int64 tensors; build() makes the plan."""
        lens = parts[0]
        last = req_to_token[pool_idx, (lens - 1).clamp(min=0)].long()  # [bs]
        values = torch.cat([pool_idx, *parts, last])
        if (meta == self.meta and self.values is not None
                and self.values.shape == values.shape and torch.equal(self.values, values)
                and self.table is req_to_token):
            return self.plan
        plan = build()
        self.meta, self.values, self.plan, self.table = meta, values, plan, req_to_token
        return plan


_MEMO = _PlanMemo()


def _attend_rows(plan: _Rows, q: torch.Tensor, k_buffer: torch.Tensor,
                 v_buffer: torch.Tensor, k_new: torch.Tensor | None,
                 v_new: torch.Tensor | None, sm_scale: float) -> torch.Tensor:
    """One query row per request over its gathered keys: q [n, H, D]; k_new, v_new [n, Hkv, D]
    this step's keys (written over the gathered copy at lens - 1) or None (the cache holds
    them) -> [n, H, Dv] float32."""
    k, v = _gather(k_buffer, plan.slots), _gather(v_buffer, plan.slots)  # [n, L, Hkv, D]
    if k_new is not None and v_new is not None:
        k.view(-1, *k.shape[2:]).index_copy_(0, plan.at, k_new.to(k.dtype))
        v.view(-1, *v.shape[2:]).index_copy_(0, plan.at, v_new.to(v.dtype))
    return _sdpa(q.unsqueeze(2), k.transpose(1, 2), v.transpose(1, 2), plan.vis,
                 sm_scale)[:, :, 0]


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
    kernel = _paged_kernel()
    if _kernel_fits(kernel, query, k_buffer, v_buffer, logit_cap):
        pool_idx, lens = req_pool_indices.long(), seq_lens.long()  # [bs]
        bs = query.shape[0]
        seg = _MEMO.get(("segments",), req_to_token, pool_idx, [lens],
                        lambda: _Segments(req_to_token, pool_idx, lens,
                                          torch.ones(bs, dtype=torch.long), torch.arange(bs)))
        assert isinstance(seg, _Segments)
        _run_kernel(kernel, seg, query, k_buffer, v_buffer, output, sm_scale)
        return
    if logit_cap <= 0 and query.shape[0]:
        pool_idx, lens = req_pool_indices.long(), seq_lens.long()  # [bs]
        plan = _MEMO.get(("rows",), req_to_token, pool_idx, [lens],
                         lambda: _Rows(req_to_token, pool_idx, lens, lens))
        assert isinstance(plan, _Rows)
        output.copy_(_attend_rows(plan, query, k_buffer, v_buffer, None, None,
                                  sm_scale).to(output.dtype))
        return
    rows = req_to_token[req_pool_indices.long()]  # [bs, max_context_len]
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
    ext_lens, lens = extend_seq_lens.long(), seq_lens.long()
    kernel = _paged_kernel()
    if (lens.numel() and tree_mask is None and is_causal
            and _kernel_fits(kernel, q_extend, k_buffer, v_buffer, logit_cap)):
        pool_idx, starts = req_pool_indices.long(), extend_start_loc.long()
        # the plan, or None for an extend the kernel does not take (a long or an empty
        # segment), is built and its lengths checked once a forward: every layer passes the
        # same metadata (a speculative verify calls this once a layer, and the checks and
        # the cache check below cost ~60 us a call, 2 ms a verify of SmolLM2's 30 layers)
        seg = _MEMO.get(("segments-ext",), req_to_token, pool_idx, [lens, ext_lens, starts],
                        lambda: _short_segments(op, req_to_token, pool_idx, lens, ext_lens,
                                                starts))
        if seg is not None:
            assert isinstance(seg, _Segments)
            # the kernel reads the extend's keys from the cache: SGLang's backend stored them
            # before the call; a caller that did not (the schema lets k_buffer be read only)
            # gets the torch path, which takes them from k_extend. Checked at the plan's
            # first call: the layers of a forward are one caller's calls
            if k_extend is None or v_extend is None or seg.holds:
                _run_kernel(kernel, seg, q_extend, k_buffer, v_buffer, o_extend, sm_scale)
                return
            if _cache_holds(seg, k_extend, v_extend, k_buffer, v_buffer):
                seg.holds = True
                _run_kernel(kernel, seg, q_extend, k_buffer, v_buffer, o_extend, sm_scale)
                return
    if bool((lens < ext_lens).any()):
        raise ValueError(f"sgl_kernel.{op}: prefix length < 0 for a sequence")
    short = bool(lens.numel()) and int(ext_lens.max()) <= SHORT_EXTEND
    if logit_cap <= 0 and tree_mask is None and short:
        pool_idx, starts = req_pool_indices.long(), extend_start_loc.long()
        G = q_extend.shape[1] // k_buffer.shape[1]
        plan = _MEMO.get(("short", is_causal, G), req_to_token, pool_idx,
                         [lens, ext_lens, starts],
                         lambda: _Short(req_to_token, pool_idx, lens, ext_lens, starts,
                                        is_causal, G))
        assert isinstance(plan, _Short)
        if plan.rows is not None:
            _one_row(plan.rows, q_extend, k_extend, v_extend, o_extend, k_buffer, v_buffer,
                     sm_scale)
        if plan.padded is not None:
            _padded(plan.padded, q_extend, k_extend, v_extend, o_extend, k_buffer, v_buffer,
                    sm_scale)
        return
    rows = req_to_token[req_pool_indices.long()]  # [bs, max_context_len]
    G = q_extend.shape[1] // k_buffer.shape[1]
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
                        v.transpose(0, 1)[None], _group_mask(visible[None, None], G),
                        sm_scale)[0]
            out = out.transpose(0, 1)  # [n_ext, H, Dv]
        else:
            out = _attend(qb, k, v, visible, sm_scale, logit_cap)
        o_extend[start : start + n_ext] = out.to(o_extend.dtype)


def _short_segments(op: str, req_to_token: torch.Tensor, pool_idx: torch.Tensor,
                    lens: torch.Tensor, ext_lens: torch.Tensor,
                    starts: torch.Tensor) -> _Segments | None:
    """The kernel's plan of a short causal extend ([bs] int64 lengths), None when a segment
    is empty or longer than SHORT_EXTEND; ValueError for a prefix shorter than zero."""
    if bool((lens < ext_lens).any()):
        raise ValueError(f"sgl_kernel.{op}: prefix length < 0 for a sequence")
    if int(ext_lens.max()) > SHORT_EXTEND or not bool((ext_lens > 0).all()):
        return None
    return _Segments(req_to_token, pool_idx, lens, ext_lens, starts)


def _cache_holds(seg: _Segments, k_extend: torch.Tensor, v_extend: torch.Tensor,
                 k_buffer: torch.Tensor, v_buffer: torch.Tensor) -> bool:
    """Whether the cache's extend slots hold k_extend / v_extend's rows (as stored: in the
    cache's dtype)."""
    k = k_extend.index_select(0, seg.src).to(k_buffer.dtype)
    v = v_extend.index_select(0, seg.src).to(v_buffer.dtype)
    return (torch.equal(k_buffer.index_select(0, seg.slots), k)
            and torch.equal(v_buffer.index_select(0, seg.slots), v))


# A speculative verify with per-request lengths mixes requests that verify nothing (one row:
# the decode step's work) with a few that verify up to k_max + 1 rows; padded to one E they
# would make every request's attention E times a decode's. So a short extend's requests of
# one row run decode-like (`_one_row`), the others padded to their own longest (`_padded`);
# each group reads its requests' KV once (`_Short`).


def _one_row(plan: _Rows, q_extend: torch.Tensor, k_extend: torch.Tensor | None,
             v_extend: torch.Tensor | None, o_extend: torch.Tensor, k_buffer: torch.Tensor,
             v_buffer: torch.Tensor, sm_scale: float) -> None:
    """Requests that extend by one token (row plan.starts[b] of q/k/v/o_extend),
    decode_attention's work: the token sees its request's first lens[b] slots, itself last
    (causal or not is the same for one row)."""
    s = plan.starts
    given = k_extend is not None and v_extend is not None
    out = _attend_rows(plan, q_extend.index_select(0, s), k_buffer, v_buffer,
                       k_extend.index_select(0, s) if given else None,  # type: ignore[union-attr]
                       v_extend.index_select(0, s) if given else None,  # type: ignore[union-attr]
                       sm_scale)
    o_extend.index_copy_(0, s, out.to(o_extend.dtype))


def _padded(plan: _Padded, q_extend: torch.Tensor, k_extend: torch.Tensor | None,
            v_extend: torch.Tensor | None, o_extend: torch.Tensor, k_buffer: torch.Tensor,
            v_buffer: torch.Tensor, sm_scale: float) -> None:
    """Short extends, the group at once: request b's queries padded to E, its keys the first
    lens[b] slots of its req_to_token row (the extend keys from k_extend where given),
    masked as the plan says."""
    k, v = _gather(k_buffer, plan.slots), _gather(v_buffer, plan.slots)  # [bs, L, Hkv, D]
    if k_extend is not None and v_extend is not None:  # the new keys as passed
        k.view(-1, *k.shape[2:]).index_copy_(0, plan.at,
                                             k_extend.index_select(0, plan.src).to(k.dtype))
        v.view(-1, *v.shape[2:]).index_copy_(0, plan.at,
                                             v_extend.index_select(0, plan.src).to(v.dtype))
    q = q_extend.new_zeros((plan.bs, plan.E, *q_extend.shape[1:]))  # [bs, E, H, D]
    q.view(-1, *q.shape[2:]).index_copy_(0, plan.rows_q, q_extend.index_select(0, plan.src))
    out = _sdpa(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), plan.vis,
                sm_scale)  # [bs, H, E, Dv]
    flat = out.transpose(1, 2).reshape(plan.bs * plan.E, *out.shape[1:2], out.shape[3])
    o_extend.index_copy_(0, plan.src, flat.index_select(0, plan.rows_q).to(o_extend.dtype))
