"""The C++ CPU attention kernel against a float64 reference and the torch backend: decodes,
verify-like segments (several query tokens, causal among themselves) and prefill chunks in one
ragged batch, GQA groups 1-4, head sizes 16-128, scattered and reused-looking block tables."""

from __future__ import annotations

import shutil

import pytest
import torch

from sloserve.runtime.attention import make_backend
from sloserve.runtime.attention.cpu_kernels import paged_attention_op
from sloserve.runtime.batch import Segment, build_forward_batch, slots_for

HAS_COMPILER = shutil.which("c++") is not None or shutil.which("g++") is not None


def test_kernel_builds_where_a_compiler_exists():
    if not HAS_COMPILER:
        pytest.skip("no C++ compiler: the cpu backend runs its torch fallback")
    assert paged_attention_op() is not None


def _reference(q, k_cache, v_cache, segments, block_size, scale):
    """Per segment, per head: explicit causal softmax attention in float64."""
    T, H, D = q.shape
    G = H // k_cache.shape[1]
    out = torch.zeros(T, H, D, dtype=torch.float64)
    row = 0
    for s in segments:
        slots = torch.tensor(slots_for(s.block_ids, 0, s.kv_len, block_size))
        k = k_cache[slots].double().repeat_interleave(G, dim=1)  # [kv_len, H, D]
        v = v_cache[slots].double().repeat_interleave(G, dim=1)
        qs = q[row : row + s.q_len].double()  # [q_len, H, D]
        scores = torch.einsum("qhd,khd->hqk", qs, k) * scale
        q_pos = torch.arange(s.start, s.kv_len)
        scores = scores.masked_fill(torch.arange(s.kv_len)[None, :] > q_pos[:, None], float("-inf"))
        out[row : row + s.q_len] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)
        row += s.q_len
    return out


def _case(heads, kv_heads, head_dim, block_size, lens, seed):
    """Random q and caches, and segments (start, q_len) over scattered blocks."""
    g = torch.Generator().manual_seed(seed)
    num_blocks = sum(-(-(start + q_len) // block_size) for start, q_len in lens) + 8
    k_cache = torch.randn(num_blocks * block_size, kv_heads, head_dim, generator=g)
    v_cache = torch.randn(num_blocks * block_size, kv_heads, head_dim, generator=g)
    free = torch.randperm(num_blocks, generator=g).tolist()  # blocks out of order
    segments = []
    for start, q_len in lens:
        n = -(-(start + q_len) // block_size)
        blocks, free = free[:n], free[n:]
        segments.append(Segment(blocks, start, [1] * q_len, all_logits=True))
    T = sum(q for _, q in lens)
    q = torch.randn(T, heads + kv_heads, head_dim, generator=g)[:, :heads]  # strided, as in the model
    return q, k_cache, v_cache, segments


LENS = [(0, 1), (37, 1), (5, 4), (120, 9), (16, 16), (3, 40), (64, 1), (90, 17)]


@pytest.mark.parametrize(
    "heads,kv_heads,head_dim,block_size",
    [(6, 2, 64, 16), (4, 4, 32, 16), (8, 2, 128, 4), (4, 1, 16, 1), (6, 2, 48, 7)],
)
def test_cpu_backend_matches_reference(heads, kv_heads, head_dim, block_size):
    if not HAS_COMPILER:
        pytest.skip("no C++ compiler")
    q, k_cache, v_cache, segments = _case(heads, kv_heads, head_dim, block_size, LENS, seed=heads)
    batch = build_forward_batch(segments, block_size)
    scale = head_dim**-0.5
    want = _reference(q, k_cache, v_cache, segments, block_size, scale)
    for name in ("cpu", "torch"):
        be = make_backend(name)
        got = be.forward(q, k_cache, v_cache, be.plan(batch), scale)
        assert got.shape == q.shape
        assert (got.double() - want).abs().max().item() < 2e-5, name


def test_cpu_backend_falls_back_to_torch_path():
    """Where the kernel does not apply (here: head_dim 8, or bfloat16) the torch path runs."""
    q, k_cache, v_cache, segments = _case(4, 2, 8, 4, LENS[:4], seed=1)
    batch = build_forward_batch(segments, 4)
    be = make_backend("cpu")
    got = be.forward(q, k_cache, v_cache, be.plan(batch), 0.3)
    want = _reference(q, k_cache, v_cache, segments, 4, 0.3)
    assert (got.double() - want).abs().max().item() < 2e-5
    got16 = be.forward(q.bfloat16(), k_cache.bfloat16(), v_cache.bfloat16(), be.plan(batch), 0.3)
    assert got16.dtype == torch.bfloat16
    assert (got16.double() - want).abs().max().item() < 0.1


def test_kernel_rejects_bad_input():
    op = paged_attention_op()
    if op is None:
        pytest.skip("kernel not built")
    q, k_cache, v_cache, segments = _case(4, 2, 16, 4, [(4, 2)], seed=2)
    out = torch.empty(q.shape)
    rows, lens, starts = torch.tensor([0]), torch.tensor([2]), torch.tensor([4])
    table = torch.tensor([segments[0].block_ids])
    op(q.contiguous(), k_cache, v_cache, rows, lens, starts, table, 4, 0.25, out)  # fine
    with pytest.raises(RuntimeError, match="out of range"):  # position 41 is past the table
        op(q.contiguous(), k_cache, v_cache, rows, lens, torch.tensor([40]), table, 4, 0.25, out)
    with pytest.raises(RuntimeError, match="outside the cache"):
        op(q.contiguous(), k_cache, v_cache, rows, lens, starts, table + 1000, 4, 0.25, out)
    with pytest.raises(RuntimeError, match="float32"):
        op(q.double().contiguous(), k_cache, v_cache, rows, lens, starts, table, 4, 0.25, out)
