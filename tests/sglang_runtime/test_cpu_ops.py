"""The sgl_kernel CPU stand-in's ops against independent references: dense attention with an
explicit visibility matrix in float64, and plain-Python loops over the index arithmetic. Plain
torch; SGLang is not needed. Shapes follow what SGLang 0.5.23 passes: page size 1, GQA,
ragged prefix and extend lengths, req_to_token rows out of order."""

from __future__ import annotations

import importlib
import math
import sys

import pytest
import torch

from sloserve.sglang_cpu import cpu_ops
from sloserve.sglang_cpu.cpu_ops import attention as attention_mod
from sloserve.sglang_cpu.cpu_server import SHIM_DIR

H, HKV, D, DV = 4, 2, 16, 16  # GQA: 2 query heads per KV head
POOL, MAX_REQS, CTX = 64, 5, 40


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _pool(dtype=torch.float32, seed=0):
    """K/V buffers [POOL, HKV, D] and a req_to_token whose rows hold distinct shuffled slots."""
    g = _gen(seed)
    k = torch.randn(POOL, HKV, D, generator=g).to(dtype)
    v = torch.randn(POOL, HKV, DV, generator=g).to(dtype)
    slots = torch.randperm(POOL, generator=g)
    req_to_token = torch.zeros(MAX_REQS, CTX, dtype=torch.int32)
    for r in range(MAX_REQS):  # rows draw from a shuffled pool, wrapping around
        req_to_token[r] = slots[torch.arange(r * 11, r * 11 + CTX) % POOL].int()
    return k, v, req_to_token


def _ref_attention(q, keys, vals, visible, scale, cap=0.0):
    """q [Q, H, D], keys [K, HKV, D], vals [K, HKV, DV], visible [Q][K] of bools ->
    [Q, H, DV] float64, by explicit loops over heads and queries."""
    q, keys, vals = q.double(), keys.double(), vals.double()
    out = torch.zeros(q.shape[0], H, DV, dtype=torch.float64)
    for i in range(q.shape[0]):
        for h in range(H):
            kvh = h // (H // HKV)
            s = []
            for j in range(keys.shape[0]):
                if not visible[i][j]:
                    continue
                x = float(q[i, h] @ keys[j, kvh]) * scale
                if cap > 0:
                    x = cap * math.tanh(x / cap)
                s.append((x, j))
            m = max(x for x, _ in s)
            z = sum(math.exp(x - m) for x, _ in s)
            for x, j in s:
                out[i, h] += math.exp(x - m) / z * vals[j, kvh]
    return out


# ----------------------------------------------------------------------------- decode attention


@pytest.mark.parametrize("dtype,cap", [(torch.float32, 0.0), (torch.float32, 5.0),
                                       (torch.bfloat16, 0.0)])
def test_decode_attention_writes_new_kv_and_attends_to_each_sequence(dtype, cap):
    k_buf, v_buf, r2t = _pool(dtype)
    g = _gen(1)
    rpi = torch.tensor([3, 0, 4])
    seq_lens = torch.tensor([1, 7, 23])  # ragged; the new token is the last of each
    q = torch.randn(3, H, D, generator=g).to(dtype)
    key = torch.randn(3, HKV, D, generator=g).to(dtype)
    val = torch.randn(3, HKV, DV, generator=g).to(dtype)
    loc = torch.stack([r2t[r, n - 1] for r, n in zip(rpi, seq_lens)]).long()
    out = torch.empty(3, H, DV, dtype=dtype)
    k0, v0 = k_buf.clone(), v_buf.clone()
    cpu_ops.decode_attention(
        q, k_buf, v_buf, 1.0, 1.0, out, key, val, loc, torch.empty(0), r2t, rpi, seq_lens,
        0.3, cap,
    )
    k0[loc], v0[loc] = key, val
    assert torch.equal(k_buf, k0) and torch.equal(v_buf, v0), "new K/V not stored at loc"
    for b in range(3):
        slots = r2t[rpi[b], : seq_lens[b]].long()
        ref = _ref_attention(q[b : b + 1], k0[slots], v0[slots],
                             [[True] * len(slots)], 0.3, cap)
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(out[b].double(), ref[0], atol=tol, rtol=tol)


def test_decode_attention_without_new_kv_reads_the_cache_only():
    k_buf, v_buf, r2t = _pool()
    q = torch.randn(1, H, D, generator=_gen(2))
    out = torch.empty(1, H, DV)
    k0 = k_buf.clone()
    cpu_ops.decode_attention(
        q, k_buf, v_buf, 1.0, 1.0, out, None, None, torch.tensor([5]), torch.empty(0), r2t,
        torch.tensor([2]), torch.tensor([9]), 0.25, 0.0,
    )
    assert torch.equal(k_buf, k0)
    slots = r2t[2, :9].long()
    ref = _ref_attention(q, k_buf[slots], v_buf[slots], [[True] * 9], 0.25)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)


# ----------------------------------------------------------------------------- extend attention


def _extend_case(prefix_lens, ext_lens, seed=3, dtype=torch.float32):
    k_buf, v_buf, r2t = _pool(dtype, seed)
    g = _gen(seed + 10)
    n = sum(ext_lens)
    q = torch.randn(n, H, D, generator=g).to(dtype)
    k_ext = torch.randn(n, HKV, D, generator=g).to(dtype)
    v_ext = torch.randn(n, HKV, DV, generator=g).to(dtype)
    rpi = torch.tensor([4, 1, 2, 0, 3][: len(ext_lens)])
    starts = torch.tensor([0] + list(torch.tensor(ext_lens).cumsum(0)[:-1]), dtype=torch.int32)
    seq_lens = torch.tensor(prefix_lens) + torch.tensor(ext_lens)
    return k_buf, v_buf, r2t, q, k_ext, v_ext, rpi, starts, seq_lens


def _ref_extend(k_buf, v_buf, r2t, q, k_ext, v_ext, rpi, starts, prefix_lens, ext_lens,
                visible_ext, scale, cap=0.0):
    outs = []
    for b, (p, e) in enumerate(zip(prefix_lens, ext_lens)):
        s = int(starts[b])
        slots = r2t[rpi[b], :p].long()
        keys = torch.cat([k_buf[slots], k_ext[s : s + e]])
        vals = torch.cat([v_buf[slots], v_ext[s : s + e]])
        vis = [[True] * p + [visible_ext(b, i, j) for j in range(e)] for i in range(e)]
        outs.append(_ref_attention(q[s : s + e], keys, vals, vis, scale, cap))
    return torch.cat(outs)


@pytest.mark.parametrize("cap", [0.0, 4.0])
def test_extend_attention_ragged_prefixes_causal(cap):
    prefix_lens, ext_lens = [0, 3, 9], [5, 1, 4]  # fresh prefill, decode-like, extend+prefix
    k_buf, v_buf, r2t, q, k_ext, v_ext, rpi, starts, seq_lens = _extend_case(prefix_lens,
                                                                              ext_lens)
    out = torch.empty(q.shape[0], H, DV)
    cpu_ops.extend_attention(
        q, k_ext, v_ext, out, k_buf, v_buf, 1.0, 1.0, r2t, rpi, seq_lens,
        torch.tensor(ext_lens, dtype=torch.int32), starts, max(ext_lens), 0.2, cap,
    )
    ref = _ref_extend(k_buf, v_buf, r2t, q, k_ext, v_ext, rpi, starts, prefix_lens, ext_lens,
                      lambda b, i, j: j <= i, 0.2, cap)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)


def test_extend_attention_non_causal_and_kv_read_from_cache():
    prefix_lens, ext_lens = [2, 6], [3, 4]
    k_buf, v_buf, r2t, q, k_ext, v_ext, rpi, starts, seq_lens = _extend_case(prefix_lens,
                                                                              ext_lens, seed=5)
    ext = torch.tensor(ext_lens)
    out_nc = torch.empty(q.shape[0], H, DV)
    cpu_ops.extend_attention(
        q, k_ext, v_ext, out_nc, k_buf, v_buf, 1.0, 1.0, r2t, rpi, seq_lens, ext, starts,
        4, 0.2, 0.0, is_causal=False,
    )
    ref = _ref_extend(k_buf, v_buf, r2t, q, k_ext, v_ext, rpi, starts, prefix_lens, ext_lens,
                      lambda b, i, j: True, 0.2)
    torch.testing.assert_close(out_nc.double(), ref, atol=1e-5, rtol=1e-5)

    # k/v None (a KV-shared layer): the extend keys are read from the cache at their slots.
    for b, (p, e) in enumerate(zip(prefix_lens, ext_lens)):
        slots = r2t[rpi[b], p : p + e].long()
        k_buf[slots] = k_ext[starts[b] : starts[b] + e]
        v_buf[slots] = v_ext[starts[b] : starts[b] + e]
    out_cache = torch.empty(q.shape[0], H, DV)
    cpu_ops.extend_attention(
        q, None, None, out_cache, k_buf, v_buf, 1.0, 1.0, r2t, rpi, seq_lens, ext, starts,
        4, 0.2, 0.0,
    )
    ref = _ref_extend(k_buf, v_buf, r2t, q, k_ext, v_ext, rpi, starts, prefix_lens, ext_lens,
                      lambda b, i, j: j <= i, 0.2)
    torch.testing.assert_close(out_cache.double(), ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("kv_passed", [True, False])
def test_extend_attention_one_row_requests_beside_longer_ones(causal, kv_passed):
    """A verify with per-request lengths: requests of one row (verifying nothing drafted) run
    apart from the longer ones; each row must still see exactly its own request's keys."""
    prefix_lens, ext_lens = [6, 0, 11, 3, 8], [1, 4, 1, 3, 1]
    k_buf, v_buf, r2t, q, k_ext, v_ext, rpi, starts, seq_lens = _extend_case(prefix_lens,
                                                                              ext_lens, seed=7)
    if not kv_passed:  # the layer stored the extend keys at their slots already
        for b, (p, e) in enumerate(zip(prefix_lens, ext_lens)):
            slots = r2t[rpi[b], p : p + e].long()
            k_buf[slots] = k_ext[starts[b] : starts[b] + e]
            v_buf[slots] = v_ext[starts[b] : starts[b] + e]
    out = torch.full((q.shape[0], H, DV), float("nan"))
    cpu_ops.extend_attention(
        q, k_ext if kv_passed else None, v_ext if kv_passed else None, out, k_buf, v_buf,
        1.0, 1.0, r2t, rpi, seq_lens, torch.tensor(ext_lens), starts, max(ext_lens), 0.3, 0.0,
        is_causal=causal,
    )
    ref = _ref_extend(k_buf, v_buf, r2t, q, k_ext, v_ext, rpi, starts, prefix_lens, ext_lens,
                      (lambda b, i, j: j <= i) if causal else (lambda b, i, j: True), 0.3)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)


def test_attention_plans_built_once_a_forward_never_go_stale():
    """The index tensors and masks of a short extend or a decode are built once for the
    layers of a forward (attention._PlanMemo): a later call must still see its own
    metadata when the same tensor objects were changed in place (inference mode tracks no
    versions), when a pool row now holds another request's slots, and when decode and
    extend calls alternate."""
    prefix_lens, ext_lens = [6, 0, 11, 3, 8], [1, 4, 1, 3, 1]
    k_buf, v_buf, r2t, q, k_ext, v_ext, rpi, starts, seq_lens = _extend_case(prefix_lens,
                                                                              ext_lens, seed=9)
    ext, starts = torch.tensor(ext_lens), starts.long()  # int64: .long() keeps the objects

    def extend_matches() -> None:
        out = torch.full((q.shape[0], H, DV), float("nan"))
        with torch.inference_mode():
            cpu_ops.extend_attention(q, k_ext, v_ext, out, k_buf, v_buf, 1.0, 1.0, r2t, rpi,
                                     seq_lens, ext, starts, int(ext.max()), 0.3, 0.0)
        pre = (seq_lens - ext).tolist()
        ref = _ref_extend(k_buf, v_buf, r2t, q, k_ext, v_ext, rpi, starts, pre, ext_lens,
                          lambda b, i, j: j <= i, 0.3)
        torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)

    def decode_matches(lens: torch.Tensor) -> None:
        qd = q[: len(lens)]
        out = torch.empty(len(lens), H, DV)
        with torch.inference_mode():
            cpu_ops.decode_attention(qd, k_buf, v_buf, 1.0, 1.0, out, None, None,
                                     torch.zeros(len(lens), dtype=torch.long), torch.empty(0),
                                     r2t, rpi[: len(lens)], lens, 0.3, 0.0)
        for b, n in enumerate(lens.tolist()):
            slots = r2t[rpi[b], :n].long()
            ref = _ref_attention(qd[b : b + 1], k_buf[slots], v_buf[slots], [[True] * n], 0.3)
            torch.testing.assert_close(out[b].double(), ref[0], atol=1e-5, rtol=1e-5)

    extend_matches()
    extend_matches()  # the same metadata: the plan is reused
    seq_lens += 1  # the same tensor, the prefixes one longer
    extend_matches()
    r2t[rpi[2]] = torch.roll(r2t[rpi[2]], 5)  # another request in pool row rpi[2]
    extend_matches()
    lens = seq_lens[:3].clone()
    decode_matches(lens)
    lens[1] -= 2  # in place, between two decode calls
    decode_matches(lens)
    extend_matches()


def test_extend_attention_tree_mask_qlen_only():
    """Target verify of a draft tree: each of the E draft tokens sees the whole prefix and the
    tree nodes the QLEN_ONLY mask [bs * E * E] allows."""
    e = 4
    prefix_lens, ext_lens = [5, 8], [e, e]
    k_buf, v_buf, r2t, q, k_ext, v_ext, rpi, starts, seq_lens = _extend_case(prefix_lens,
                                                                              ext_lens, seed=7)
    # Request 0: root with children 1 and 2, node 3 under 1. Request 1: a chain.
    parents = [[-1, 0, 0, 1], [-1, 0, 1, 2]]

    def sees(b, i, j):
        while i != -1:
            if i == j:
                return True
            i = parents[b][i]
        return False

    mask = torch.tensor([[sees(b, i, j) for i in range(e) for j in range(e)] for b in range(2)])
    out = torch.empty(q.shape[0], H, DV)
    cpu_ops.extend_attention(
        q, k_ext, v_ext, out, k_buf, v_buf, 1.0, 1.0, r2t, rpi, seq_lens,
        torch.tensor(ext_lens), starts, e, 0.2, 0.0, tree_mask=mask.flatten(),
    )
    ref = _ref_extend(k_buf, v_buf, r2t, q, k_ext, v_ext, rpi, starts, prefix_lens, ext_lens,
                      sees, 0.2)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)


# ------------------------------------------------ the C++ kernel path against the torch path


@pytest.fixture
def kernel_calls(monkeypatch):
    """Counts the C++ paged attention's calls (skips where the kernels did not build)."""
    kernel = attention_mod._paged_kernel()
    if kernel is None:
        pytest.skip("the C++ CPU kernels are unavailable here")
    calls = []

    def counted(*args):
        calls.append(args[0].shape[0])
        return kernel(*args)

    monkeypatch.setattr(attention_mod, "_paged_kernel", lambda: counted)
    return calls


def _store_extend(k_buf, v_buf, r2t, rpi, starts, prefix_lens, ext_lens, k_ext, v_ext):
    """What SGLang's backend does before extend_attention_cpu: the extend's K/V at its slots."""
    for b, (p, e) in enumerate(zip(prefix_lens, ext_lens)):
        slots = r2t[rpi[b], p : p + e].long()
        k_buf[slots] = k_ext[starts[b] : starts[b] + e]
        v_buf[slots] = v_ext[starts[b] : starts[b] + e]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_serves_decode_and_a_ragged_verify_and_matches_the_torch_path(
        kernel_calls, monkeypatch, dtype):
    """A decode step and a verify whose requests verify 0-3 drafts (1-4 rows, prefixes from 0)
    run in the C++ kernel; the result is the reference's and the torch path's (forced by a
    missing kernel) up to float rounding. bf16: the draft's cache and queries."""
    prefix_lens, ext_lens = [6, 0, 11, 3, 8], [1, 4, 1, 3, 2]
    k_buf, v_buf, r2t, q, k_ext, v_ext, rpi, starts, seq_lens = _extend_case(
        prefix_lens, ext_lens, seed=11, dtype=dtype)
    _store_extend(k_buf, v_buf, r2t, rpi, starts, prefix_lens, ext_lens, k_ext, v_ext)
    ext = torch.tensor(ext_lens)
    tol = 1e-5 if dtype == torch.float32 else 2e-2

    def run_extend() -> torch.Tensor:
        out = torch.full((q.shape[0], H, DV), float("nan"), dtype=dtype)
        cpu_ops.extend_attention(q, k_ext, v_ext, out, k_buf, v_buf, 1.0, 1.0, r2t, rpi,
                                 seq_lens, ext, starts, 4, 0.3, 0.0)
        return out

    def run_decode() -> torch.Tensor:
        out = torch.full((3, H, DV), float("nan"), dtype=dtype)
        cpu_ops.decode_attention(q[:3], k_buf, v_buf, 1.0, 1.0, out, None, None,
                                 torch.zeros(3, dtype=torch.long), torch.empty(0), r2t,
                                 rpi[:3], seq_lens[:3], 0.3, 0.0)
        return out

    ext_kernel, dec_kernel = run_extend(), run_decode()
    assert kernel_calls == [q.shape[0], 3], "the kernel did not serve both calls"
    ref = _ref_extend(k_buf, v_buf, r2t, q, k_ext, v_ext, rpi, starts, prefix_lens, ext_lens,
                      lambda b, i, j: j <= i, 0.3)
    torch.testing.assert_close(ext_kernel.double(), ref, atol=tol, rtol=tol)
    for b in range(3):
        slots = r2t[rpi[b], : seq_lens[b]].long()
        r = _ref_attention(q[b : b + 1], k_buf[slots], v_buf[slots], [[True] * len(slots)], 0.3)
        torch.testing.assert_close(dec_kernel[b].double(), r[0], atol=tol, rtol=tol)
    monkeypatch.setattr(attention_mod, "_paged_kernel", lambda: None)
    torch.testing.assert_close(run_extend(), ext_kernel, atol=tol, rtol=tol)
    torch.testing.assert_close(run_decode(), dec_kernel, atol=tol, rtol=tol)


def test_kernel_gives_a_verify_row_the_bits_of_a_decode_row(kernel_calls):
    """Each query row is computed alike whatever its segment: the last row of a verify equals,
    bit for bit, a decode of the same token over the same keys (greedy speculation's output
    equals plain greedy's only if the target's logits do not depend on the verify length)."""
    prefix_lens, ext_lens = [9, 4], [3, 1]
    k_buf, v_buf, r2t, q, k_ext, v_ext, rpi, starts, seq_lens = _extend_case(
        prefix_lens, ext_lens, seed=13)
    _store_extend(k_buf, v_buf, r2t, rpi, starts, prefix_lens, ext_lens, k_ext, v_ext)
    out = torch.empty(q.shape[0], H, DV)
    cpu_ops.extend_attention(q, k_ext, v_ext, out, k_buf, v_buf, 1.0, 1.0, r2t, rpi, seq_lens,
                             torch.tensor(ext_lens), starts, 3, 0.3, 0.0)
    last = [int(starts[b]) + e - 1 for b, e in enumerate(ext_lens)]
    dec = torch.empty(2, H, DV)
    cpu_ops.decode_attention(q[last], k_buf, v_buf, 1.0, 1.0, dec, None, None,
                             torch.zeros(2, dtype=torch.long), torch.empty(0), r2t, rpi,
                             seq_lens, 0.3, 0.0)
    assert len(kernel_calls) == 2
    assert torch.equal(out[last], dec)


def test_extend_keys_not_in_the_cache_take_the_torch_path(kernel_calls):
    """The kernel reads the extend's keys from the cache; a caller that passed them without
    storing them (the schema lets k_buffer be read only) gets the torch path, which reads
    k_extend, and the cache stays untouched."""
    prefix_lens, ext_lens = [5, 2], [2, 3]
    k_buf, v_buf, r2t, q, k_ext, v_ext, rpi, starts, seq_lens = _extend_case(
        prefix_lens, ext_lens, seed=17)
    k0, v0 = k_buf.clone(), v_buf.clone()
    out = torch.empty(q.shape[0], H, DV)
    cpu_ops.extend_attention(q, k_ext, v_ext, out, k_buf, v_buf, 1.0, 1.0, r2t, rpi, seq_lens,
                             torch.tensor(ext_lens), starts, 3, 0.3, 0.0)
    assert kernel_calls == []
    assert torch.equal(k_buf, k0) and torch.equal(v_buf, v0)
    ref = _ref_extend(k_buf, v_buf, r2t, q, k_ext, v_ext, rpi, starts, prefix_lens, ext_lens,
                      lambda b, i, j: j <= i, 0.3)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)


def test_a_forwards_layers_check_the_cache_once(kernel_calls, monkeypatch):
    """Every layer of a forward passes the same metadata: the lengths and the cache holding
    the extend's keys are checked at the plan's first call, and each layer's own keys are
    still attended (three layers' caches, each stored by its caller as SGLang's backend
    does)."""
    checks = []
    holds = attention_mod._cache_holds

    def counted(*args):
        checks.append(1)
        return holds(*args)

    monkeypatch.setattr(attention_mod, "_cache_holds", counted)
    prefix_lens, ext_lens = [6, 3, 8], [2, 1, 3]
    layers = [_extend_case(prefix_lens, ext_lens, seed=30 + i) for i in range(3)]
    r2t, rpi, starts, seq_lens = layers[0][2], layers[0][6], layers[0][7], layers[0][8]
    for k_buf, v_buf, _, q, k_ext, v_ext, *_ in layers:
        _store_extend(k_buf, v_buf, r2t, rpi, starts, prefix_lens, ext_lens, k_ext, v_ext)
        out = torch.empty(q.shape[0], H, DV)
        cpu_ops.extend_attention(q, k_ext, v_ext, out, k_buf, v_buf, 1.0, 1.0, r2t, rpi,
                                 seq_lens, torch.tensor(ext_lens), starts, 3, 0.3, 0.0)
        ref = _ref_extend(k_buf, v_buf, r2t, q, k_ext, v_ext, rpi, starts, prefix_lens,
                          ext_lens, lambda b, i, j: j <= i, 0.3)
        torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)
    assert len(kernel_calls) == 3 and len(checks) == 1, (kernel_calls, checks)


@pytest.mark.parametrize("kwargs,what", [
    (dict(sliding_window_size=8), "sliding-window"),
    (dict(sinks=torch.zeros(H)), "sinks"),
    (dict(is_cross_attn=True), "cross attention"),
])
def test_attention_options_it_lacks_raise_not_implemented(kwargs, what):
    k_buf, v_buf, r2t = _pool()
    with pytest.raises(NotImplementedError, match="decode_attention_cpu"):
        cpu_ops.decode_attention(
            torch.zeros(1, H, D), k_buf, v_buf, 1.0, 1.0, torch.empty(1, H, DV), None, None,
            torch.tensor([0]), torch.empty(0), r2t, torch.tensor([0]), torch.tensor([3]),
            0.2, 0.0, **kwargs,
        )


# ------------------------------------------------------------------------- KV pool bookkeeping


@pytest.mark.parametrize("off_dtype", [torch.int32, torch.int64])
def test_assign_req_to_token_pool_and_extend_cache_locs_round_trip(off_dtype):
    r2t = torch.full((MAX_REQS, CTX), -1, dtype=torch.int32)
    rpi = torch.tensor([2, 0, 4])
    start = torch.tensor([0, 5, 3], dtype=off_dtype)
    end = torch.tensor([4, 5, 9], dtype=off_dtype)  # one empty segment
    locs = torch.arange(100, 110, dtype=torch.int64)
    cpu_ops.assign_req_to_token_pool(rpi, r2t, start, end, locs, CTX)
    expect = torch.full((MAX_REQS, CTX), -1, dtype=torch.int32)
    i = 0
    for r, s, e in zip(rpi.tolist(), start.tolist(), end.tolist()):
        for pos in range(s, e):
            expect[r, pos] = 100 + i
            i += 1
    assert torch.equal(r2t, expect)

    back = torch.empty(10, dtype=torch.int64)
    cpu_ops.assign_extend_cache_locs(rpi, r2t, start, end, back, CTX)
    assert back.tolist() == list(range(100, 110))


def test_assign_draft_cache_locs_contiguous_reads_after_the_prefix():
    _, _, r2t = _pool()
    rpi, seq_lens = torch.tensor([1, 3]), torch.tensor([6, 2])
    topk, steps = 2, 3
    out = torch.empty(2 * topk * steps, dtype=torch.int64)
    cpu_ops.assign_draft_cache_locs_contiguous(rpi, r2t, seq_lens, out, CTX, topk, steps)
    expect = []
    for r, sl in zip(rpi.tolist(), seq_lens.tolist()):
        expect += [int(r2t[r, sl + j]) for j in range(topk * steps)]
    assert out.tolist() == expect


@pytest.mark.parametrize("topk", [1, 2])
def test_build_draft_decode_metadata(topk):
    _, _, r2t = _pool()
    rpi, seq_lens, steps = torch.tensor([3, 0]), torch.tensor([4, 9]), 3
    got = cpu_ops.build_draft_decode_metadata(r2t, rpi, seq_lens, topk, steps, CTX)
    assert got.shape == (2 * topk, CTX) and got.dtype == torch.int32
    for b, (r, sl) in enumerate(zip(rpi.tolist(), seq_lens.tolist())):
        for t in range(topk):
            row = got[b * topk + t].tolist()
            assert row[:sl] == r2t[r, :sl].tolist()
            assert row[sl : sl + steps] == r2t[r, sl + t * steps : sl + (t + 1) * steps].tolist()


def test_copy_all_layer_kv_cache_moves_rows_of_every_buffer_overlap_safe():
    g = _gen(4)
    bufs = [torch.randn(12, 2, 8, generator=g), torch.randn(12, 3, generator=g).bfloat16()]
    before = [b.clone() for b in bufs]
    ptrs = torch.tensor([b.data_ptr() for b in bufs], dtype=torch.uint64)
    strides = torch.tensor([b.stride(0) * b.element_size() for b in bufs])
    tgt, src = torch.tensor([1, 2, 7]), torch.tensor([2, 1, 11])  # 1 and 2 swap
    cpu_ops.copy_all_layer_kv_cache(ptrs, strides, tgt, src)
    for b, old in zip(bufs, before):
        expect = old.clone()
        for t, s in zip(tgt.tolist(), src.tolist()):
            expect[t] = old[s]
        assert torch.equal(b, expect)


# ----------------------------------------------------------------------- speculative decoding


def test_fill_bonus_tokens_and_accept_out_cache_loc():
    accept_tokens = torch.tensor([[5, 6, 7, 8], [9, 10, 11, 12], [13, 14, 15, 16]],
                                 dtype=torch.int32)
    accept_lens = torch.tensor([1, 4, 2], dtype=torch.int32)
    bonus = torch.zeros(3, dtype=torch.int32)
    cpu_ops.fill_bonus_tokens(accept_tokens, accept_lens, bonus, 4)
    assert bonus.tolist() == [5, 12, 14]

    accept_index = torch.tensor([[0, -1, -1], [4, 5, 6], [8, 9, -1]], dtype=torch.int32)
    out_cache_loc = torch.arange(200, 212, dtype=torch.int64)
    dst = torch.full((6,), -7, dtype=torch.int64)
    cpu_ops.fill_accept_out_cache_loc(accept_index, out_cache_loc, dst)
    assert dst.tolist() == [200, 204, 205, 206, 208, 209]


def _tree_links(parents: list[int]) -> tuple[list[int], list[int]]:
    """first child / next sibling lists of a tree given by parent indices (children in index
    order), the layout build_tree_kernel_efficient produces."""
    n = len(parents)
    first, sib = [-1] * n, [-1] * n
    for p in range(n):
        kids = [c for c in range(1, n) if parents[c] == p]
        if kids:
            first[p] = kids[0]
            for a, b in zip(kids, kids[1:]):
                sib[a] = b
    return first, sib


def _ref_verify(parents, cand, target, steps):
    """Accepted node path by walking the tree: from the root, go to the child whose token is
    the target's prediction at the current node."""
    path, cur = [0], 0
    for _ in range(steps - 1):
        nxt = [c for c in range(1, len(parents)) if parents[c] == cur and cand[c] == target[cur]]
        if not nxt:
            break
        cur = nxt[0]
        path.append(cur)
    return path


@pytest.mark.parametrize("idx_dtype", [torch.int32, torch.int64])
def test_verify_tree_greedy_chains_and_trees(idx_dtype):
    n, steps = 4, 4
    trees = [
        ([-1, 0, 1, 2], [0, 11, 12, 13], [11, 12, 13, 14]),  # chain, all accepted
        ([-1, 0, 1, 2], [0, 11, 12, 13], [11, 99, 13, 14]),  # chain, first accepted
        ([-1, 0, 1, 2], [0, 11, 12, 13], [50, 12, 13, 14]),  # chain, none accepted
        ([-1, 0, 0, 2], [0, 21, 22, 23], [22, 0, 23, 30]),  # tree: second child, then deeper
    ]
    bs = len(trees)
    cand = torch.tensor([c for _, c, _ in trees], dtype=idx_dtype)
    target = torch.tensor([t for _, _, t in trees], dtype=idx_dtype)
    ri = torch.arange(bs * n, dtype=idx_dtype).view(bs, n)
    links = [_tree_links(p) for p, _, _ in trees]
    rnt = torch.tensor([f for f, _ in links], dtype=idx_dtype)
    rns = torch.tensor([s for _, s in links], dtype=idx_dtype)
    predicts = torch.full((bs * n,), -5, dtype=torch.int32)
    accept_index = torch.full((bs, steps), -1, dtype=torch.int32)
    accept_num = torch.zeros(bs, dtype=torch.int32)
    cpu_ops.verify_tree_greedy(predicts, accept_index, accept_num, cand, ri, rnt, rns, target)
    for b, (parents, c, t) in enumerate(trees):
        path = _ref_verify(parents, c, t, steps)
        assert accept_num[b] == len(path) - 1
        assert accept_index[b].tolist() == [b * n + p for p in path] + [-1] * (steps - len(path))
        for p in path:  # every accepted node and the bonus carry the target's token
            assert predicts[b * n + p] == t[p]


def _ref_tree(parent_list, sel, topk, n):
    """Node parents from the EAGLE indices, derived by their definition."""
    parents = [-1]
    for i in range(1, n):
        group = sel[i - 1] // topk
        if group == 0:
            parents.append(0)
        else:
            cand = parent_list[group]
            parents.append(1 + sel.index(cand))
    return parents


@pytest.mark.parametrize("mode", [1, 0])  # QLEN_ONLY, FULL_MASK
def test_build_tree_kernel_efficient(mode):
    topk, depth, n = 2, 3, 5
    # EAGLE's top-k search layout: candidates 0,1 hang from the root (group 0); group g >= 1
    # holds candidates topk*g .. topk*g + 1, children of candidate parent_list[b, g].
    parent_list = torch.tensor([[-1, 0, 1, 2, 4], [-1, 0, 1, 2, 4]])
    # Request 0: two root children each with one child; request 1: a depth-3 path + a leaf.
    sel = torch.tensor([[0, 1, 2, 4], [0, 2, 6, 1]])
    seq = torch.tensor([7, 3])
    bs = 2
    size = bs * n * n if mode == 1 else int(seq.sum()) * n + bs * n * n
    mask = torch.ones(size, dtype=torch.bool)  # prefix columns pre-filled True by the caller
    pos = torch.zeros(bs * n, dtype=torch.int64)
    ri = torch.zeros(bs, n, dtype=torch.int64)
    rnt = torch.full((bs, n), -1, dtype=torch.int64)
    rns = torch.full((bs, n), -1, dtype=torch.int64)
    cpu_ops.build_tree_kernel_efficient(parent_list, sel, seq, mask, pos, ri, rnt, rns, topk,
                                        depth, n, mode)
    base = 0
    for b in range(bs):
        parents = _ref_tree(parent_list[b].tolist(), sel[b].tolist(), topk, n)
        first, sib = _tree_links(parents)
        assert rnt[b].tolist() == first and rns[b].tolist() == sib
        assert ri[b].tolist() == list(range(b * n, (b + 1) * n))
        row_len = n if mode == 1 else int(seq[b]) + n
        for t in range(n):
            anc, d, x = {0, t}, 0, t
            while x != 0:
                x = parents[x]
                anc.add(x)
                d += 1
            assert pos[b * n + t] == seq[b] + d
            row = mask[base + t * row_len : base + (t + 1) * row_len].tolist()
            assert row[row_len - n :] == [j in anc for j in range(n)]
            assert all(row[: row_len - n])  # prefix columns untouched
        base += n * row_len


def test_build_tree_chain_like_sglang_topk1():
    """topk = 1: SGLang's chain layout (parents [-1, 0, 1, ...], selected [0, 1, 2, ...])
    gives a chain: node i under node i-1, causal mask, positions seq_len + i."""
    steps, n = 3, 4
    parent_list = torch.tensor([[-1, 0, 1]])
    sel = torch.tensor([[0, 1, 2]])
    mask = torch.zeros(n * n, dtype=torch.bool)
    pos = torch.zeros(n, dtype=torch.int64)
    ri = torch.zeros(1, n, dtype=torch.int64)
    rnt = torch.full((1, n), -1, dtype=torch.int64)
    rns = torch.full((1, n), -1, dtype=torch.int64)
    cpu_ops.build_tree_kernel_efficient(parent_list, sel, torch.tensor([10]), mask, pos, ri, rnt,
                                        rns, 1, steps, n, 1)
    assert rnt.tolist() == [[1, 2, 3, -1]] and rns.tolist() == [[-1] * n]
    assert pos.tolist() == [10, 11, 12, 13]
    assert torch.equal(mask.view(n, n), torch.ones(n, n, dtype=torch.bool).tril())


def test_rotate_input_ids():
    ids = torch.tensor([1, 2, 3, 4, 5, 6, 7, 8])
    starts, lens = torch.tensor([0, 3, 4], dtype=torch.int32), torch.tensor([3, 1, 4])
    cpu_ops.rotate_input_ids(ids, starts, lens, torch.tensor([[30], [40], [50]]))
    assert ids.tolist() == [2, 3, 30, 40, 6, 7, 8, 50]
    ids = torch.tensor([1, 2, 3, 4])
    cpu_ops.rotate_input_ids(ids, torch.tensor([0, 2]), torch.tensor([2, 2]),
                             torch.tensor([9, 8]), torch.tensor([0, 2]))
    assert ids.tolist() == [9, 2, 8, 4]


# ------------------------------------------------------------------------- the sgl_kernel shim


@pytest.fixture(scope="module")
def shim():
    """The stand-in imported as `sgl_kernel` (this environment has no real one)."""
    if importlib.util.find_spec("sgl_kernel") is not None and "sgl_kernel" not in sys.modules:
        pytest.skip("a real sgl_kernel is installed here; the shim only runs where it is not")
    sys.path.insert(0, str(SHIM_DIR))
    try:
        mod = importlib.import_module("sgl_kernel")
    finally:
        sys.path.remove(str(SHIM_DIR))
    assert mod.__file__.startswith(str(SHIM_DIR))
    return mod


def test_shim_registers_torch_ops_with_sglang_argument_lists(shim):
    k_buf, v_buf, r2t = _pool()
    q = torch.randn(2, H, D, generator=_gen(8))
    key, val = torch.randn(2, HKV, D), torch.randn(2, HKV, DV)
    rpi, seq_lens = torch.tensor([1, 2]), torch.tensor([4, 6])
    loc = torch.stack([r2t[1, 3], r2t[2, 5]]).long()
    outs = []
    for fn in (torch.ops.sgl_kernel.decode_attention_cpu, cpu_ops.decode_attention):
        kb, vb, o = k_buf.clone(), v_buf.clone(), torch.empty(2, H, DV)
        # The positional argument list of sglang's intel_amx_backend.forward_decode.
        fn(q, kb, vb, 1.0, 1.0, o, key, val, loc, torch.zeros(2, H, 8, DV + 1), r2t, rpi,
           seq_lens, 0.25, 0.0, False, 0, None, None)
        outs.append(o)
    assert torch.equal(outs[0], outs[1])

    from_python = shim.build_draft_decode_metadata_cpu(r2t, rpi, seq_lens, 1, 3, CTX)
    assert torch.equal(from_python, cpu_ops.build_draft_decode_metadata(r2t, rpi, seq_lens, 1, 3,
                                                                        CTX))
    assert "extend_attention_cpu" in shim.IMPLEMENTED_OPS


def test_shim_names_an_op_it_lacks(shim):
    from sgl_kernel import fused_sigmoid_mul_cpu  # noqa: F401  (importable, fails when called)

    with pytest.raises(NotImplementedError, match="sgl_kernel.fused_sigmoid_mul_cpu"):
        fused_sigmoid_mul_cpu(torch.zeros(1))
