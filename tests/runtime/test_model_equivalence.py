"""Acceptance (runtime 2): logits equal transformers' on the same random weights, float32,
for a ragged batch mixing prefill chunks and decodes."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from sloserve.runtime.attention import make_backend
from sloserve.runtime.batch import Segment
from sloserve.runtime.cpu_kernels import cpu_ops
from sloserve.runtime.kv_cache import BlockAllocator, KVStorage
from sloserve.runtime.model_runner import ModelRunner
from sloserve.runtime.models.cpu_linear import pack_linears, packed_linear_available
from sloserve.runtime.models.loader import load_model


def _llama():
    cfg = LlamaConfig(
        hidden_size=64, num_hidden_layers=2, intermediate_size=96, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=128, max_position_embeddings=512,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
        rope_theta=500000.0, tie_word_embeddings=False,
    )
    return LlamaForCausalLM(cfg)


def _qwen2():
    cfg = Qwen2Config(
        hidden_size=64, num_hidden_layers=2, intermediate_size=96, num_attention_heads=4,
        num_key_value_heads=1, vocab_size=128, max_position_embeddings=512,
        tie_word_embeddings=True,
    )
    m = Qwen2ForCausalLM(cfg)
    with torch.no_grad():  # non-zero biases so a missed bias shows
        for layer in m.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                proj.bias.normal_(0, 0.5)
    return m


@pytest.mark.parametrize("kernels", ["torch", "cpu"], ids=["torch-ops", "cpu-kernels"])
@pytest.mark.parametrize("packed", [False, True], ids=["F.linear", "onednn-packed"])
@pytest.mark.parametrize("make", [_llama, _qwen2], ids=["llama3-rope-gqa", "qwen2-bias-tied"])
def test_ragged_logits_match_transformers(make, packed, kernels, tmp_path):
    torch.manual_seed(0)
    ref = make().eval()
    ref.save_pretrained(tmp_path)
    ours = load_model(tmp_path)
    if packed:
        if not packed_linear_available():
            pytest.skip("oneDNN packed linear not available in this torch build")
        assert pack_linears(ours) > 0
    bs = 4
    alloc = BlockAllocator(128, bs)
    runner = ModelRunner(ours, KVStorage(ours.cfg, 128, bs, torch.float32, "cpu"),
                         make_backend(kernels), bs)
    if kernels == "cpu" and cpu_ops() is not None:  # the C++ attention, norm, RoPE and SiLU
        assert ours.use_cpu_ops(cpu_ops())
    seqs = [torch.randint(0, 128, (n,)).tolist() for n in (9, 40, 23, 5, 2)]
    blocks = [alloc.allocate(alloc.blocks_for(len(s))) for s in seqs]
    # step 1: prefill prefixes (one long chunk, several short); step 2: the rest mixed —
    # a long continuation chunk, multi-token "verify"-like segments and single decodes
    cuts = [8, 30, 3, 4, 1]
    with torch.inference_mode():
        expect = [ref(torch.tensor([s])).logits[0] for s in seqs]
    for lo_hi in ([(0, c) for c in cuts], [(c, len(s)) for c, s in zip(cuts, seqs)]):
        segs = [Segment(b, lo, s[lo:hi], all_logits=True) for s, b, (lo, hi) in zip(seqs, blocks, lo_hi)]
        logits, batch = runner.forward(segs)
        for i, (lo, hi) in enumerate(lo_hi):
            got = logits[batch.logits_indptr[i] : batch.logits_indptr[i + 1]]
            assert (got - expect[i][lo:hi]).abs().max().item() <= 1e-4
