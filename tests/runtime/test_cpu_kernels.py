"""The C++ CPU kernels against PyTorch: the paged attention kernel against a float64 reference
and the torch backend (decodes, verify-like segments with several causal query tokens and
prefill chunks in one ragged batch; GQA groups 1-4, head sizes 16-128, scattered block
tables), and each fused layer op against the chain of ops it replaces."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

from sloserve.runtime.attention import make_backend
from sloserve.runtime.batch import Segment, build_forward_batch, slots_for
from sloserve.runtime.cpu_kernels import cpu_ops, paged_attention_op
from sloserve.runtime.models.llama import Rotary
from sloserve.runtime.request import SamplingParams

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


def test_kernel_reads_a_bf16_cache_and_rows_do_not_depend_on_the_segment():
    """bf16 queries and caches: the kernel widens them, matches the float64 reference on the
    same (rounded) values, and a row of a 5-token verify segment gets exactly the bits the
    same row gets as a 1-token decode segment (what makes bf16 speculation lossless)."""
    if not HAS_COMPILER:
        pytest.skip("no C++ compiler")
    q, k_cache, v_cache, segments = _case(9, 3, 64, 16, LENS, seed=3)
    q, k_cache, v_cache = q.bfloat16(), k_cache.bfloat16(), v_cache.bfloat16()
    be = make_backend("cpu")
    assert be._kernel_applies(q, k_cache)
    batch = build_forward_batch(segments, 16)
    got = be.forward(q, k_cache, v_cache, be.plan(batch), 0.125)
    assert got.dtype == torch.bfloat16
    want = _reference(q.float(), k_cache.float(), v_cache.float(), segments, 16, 0.125)
    assert (got.double() - want).abs().max().item() < 2e-2  # bf16 output rounding
    # segment 2 is (start 5, 4 tokens): its last row alone, as a decode at position 8
    last = Segment(segments[2].block_ids, 8, [1], all_logits=True)
    row = sum(s.q_len for s in segments[:2]) + 3
    one = be.forward(q[row:row + 1], k_cache, v_cache,
                     be.plan(build_forward_batch([last], 16)), 0.125)
    assert torch.equal(one[0], got[row])


def test_cpu_backend_falls_back_to_torch_path():
    """Where the kernel does not apply (here: head_dim 8) the torch path runs."""
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
    with pytest.raises(RuntimeError, match="of one dtype"):
        op(q.contiguous(), k_cache, v_cache.bfloat16(), rows, lens, starts, table, 4, 0.25, out)


@pytest.fixture
def ops():
    o = cpu_ops()
    if o is None:
        pytest.skip("kernels not built")
    return o


@pytest.mark.parametrize("rows", [1, 5, 40])  # 40 rows: split across threads
def test_fused_norms_and_silu_match_torch(ops, rows):
    g = torch.Generator().manual_seed(rows)
    h, a = torch.randn(rows, 96, generator=g), torch.randn(rows, 96, generator=g)
    w = torch.rand(96, generator=g) + 0.5
    want = torch.nn.functional.rms_norm(h, (96,), w, 1e-6)
    assert torch.allclose(ops.rms_norm(h, w, 1e-6), want, atol=1e-5)
    h2 = h.clone()
    y = ops.add_rms_norm(h2, a, w, 1e-6)
    assert torch.equal(h2, h + a)  # the residual stream is updated in place
    assert torch.allclose(y, torch.nn.functional.rms_norm(h + a, (96,), w, 1e-6), atol=1e-5)
    gu = torch.randn(rows, 2 * 72, generator=g) * 6  # wide range: both sigmoid branches
    gate, up = gu.chunk(2, dim=-1)
    assert torch.allclose(ops.silu_mul(gu), torch.nn.functional.silu(gate) * up, atol=1e-5)


def test_rope_store_matches_rotary_and_writes_cache(ops):
    heads, kv_heads, D, T, S = 4, 2, 32, 6, 20
    g = torch.Generator().manual_seed(3)
    qkv = torch.randn(T, (heads + 2 * kv_heads) * D, generator=g)
    pos = torch.tensor([0, 5, 9, 100, 3, 4])
    inv = 1.0 / (10000 ** (torch.arange(0, D, 2).float() / D))
    cos, sin = torch.outer(pos.float(), inv).cos(), torch.outer(pos.float(), inv).sin()
    slots = torch.tensor([7, 0, 19, 3, 12, 8])
    k_cache, v_cache = torch.zeros(S, kv_heads, D), torch.zeros(S, kv_heads, D)
    want_qk = Rotary.apply(qkv[:, : (heads + kv_heads) * D].view(T, -1, D), cos[:, None], sin[:, None])
    want_v = qkv[:, (heads + kv_heads) * D :].view(T, kv_heads, D).clone()
    out = qkv.clone()
    ops.rope_store(out, cos, sin, slots, k_cache, v_cache, heads, kv_heads)
    assert torch.allclose(out[:, : (heads + kv_heads) * D].view(T, -1, D), want_qk, atol=1e-6)
    assert torch.allclose(k_cache[slots], want_qk[:, heads:], atol=1e-6)
    assert torch.equal(v_cache[slots], want_v)
    untouched = torch.ones(S, dtype=torch.bool)
    untouched[slots] = False
    assert not k_cache[untouched].any() and not v_cache[untouched].any()
    with pytest.raises(RuntimeError, match="outside the cache"):
        ops.rope_store(qkv.clone(), cos, sin, slots + S, k_cache, v_cache, heads, kv_heads)


def test_engine_without_kernels_gives_the_same_greedy_tokens(make_engine, tiny_pair):
    """SLOSERVE_CPU_KERNELS=0 (what a machine without a compiler gets): the engine runs the
    PyTorch path and generates the same greedy tokens as with the kernels."""
    prompts = [[5, 9, 33, 2, 17], [100, 3, 3, 8]]
    script = (
        "import json, sys\n"
        "from sloserve.runtime.config import EngineConfig\n"
        "from sloserve.runtime.engine import Engine\n"
        "from sloserve.runtime.request import SamplingParams\n"
        "eng = Engine(EngineConfig(model_path=sys.argv[1], draft_model_path=sys.argv[2],"
        " spec_policy='fixed:2', dtype='float32'))\n"
        "assert eng.parts.target.backend.op is None and eng.parts.target.model.cpu_ops is None\n"
        "p = SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True)\n"
        f"res = eng.generate({prompts!r}, [p, p])\n"
        "print(json.dumps([r['output_ids'] for r in res]))\n"
    )
    env = {**os.environ, "SLOSERVE_CPU_KERNELS": "0"}
    out = subprocess.run([sys.executable, "-c", script, *tiny_pair], env=env, check=True,
                         capture_output=True, text=True, timeout=240)
    without = json.loads(out.stdout.strip().splitlines()[-1])
    eng = make_engine(spec_policy="fixed:2")
    p = SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True)
    assert [r["output_ids"] for r in eng.generate(prompts, [p, p])] == without
