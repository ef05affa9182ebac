"""Fixtures of the speculation tests: a model pair small enough that exact output
distributions can be enumerated."""

from __future__ import annotations

import json

import pytest
import torch

V_SMALL = 16


@pytest.fixture(scope="session")
def small_vocab_pair(tmp_path_factory):
    """A 16-token Llama target and its 1-layer early-exit draft, with a word-level tokenizer."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    root = tmp_path_factory.mktemp("v16")
    vocab = {f"w{i}": i for i in range(V_SMALL)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="w15", unk_token="w0")
    torch.manual_seed(3)
    cfg = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                      num_attention_heads=2, num_key_value_heads=1, vocab_size=V_SMALL,
                      max_position_embeddings=64, eos_token_id=15, bos_token_id=0)
    target = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        target.lm_head.weight.mul_(8)  # top token ~0.35; top-p 0.9 keeps 7 of 16 tokens
    paths = []
    for name, layers in (("target", 3), ("draft", 1)):
        m = target if layers == 3 else LlamaForCausalLM(LlamaConfig(**{**cfg.to_dict(), "num_hidden_layers": 1}))
        if layers == 1:
            sd = {k: v for k, v in target.state_dict().items()
                  if not k.startswith("model.layers.") or k.startswith("model.layers.0.")}
            m.load_state_dict(sd)
        d = root / name
        m.save_pretrained(d)
        fast.save_pretrained(d)
        cfgj = json.loads((d / "config.json").read_text())
        assert cfgj["vocab_size"] == V_SMALL
        paths.append(str(d))
    return paths, target
