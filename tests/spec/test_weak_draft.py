"""sloserve.bench.weak_draft: the silenced layers become the identity (the weak draft computes
what the draft cut to its first `keep` layers computes), the kept ones are untouched, and a
bad --keep is a CLI error naming the option."""

from __future__ import annotations

import pytest
import torch


def _tiny_llama(path, layers: int = 3):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                      num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                      tie_word_embeddings=True)
    model = LlamaForCausalLM(cfg).eval()
    model.save_pretrained(path)
    return model


def test_silenced_layers_are_the_identity(tmp_path):
    from transformers import LlamaForCausalLM

    from sloserve.bench.weak_draft import main

    full = _tiny_llama(tmp_path / "draft")
    assert main(["--draft", str(tmp_path / "draft"), "--out", str(tmp_path / "weak"),
                 "--keep", "1"]) == 0
    weak = LlamaForCausalLM.from_pretrained(tmp_path / "weak").eval()
    # the reference: the same weights with only the first layer
    cut = LlamaForCausalLM.from_pretrained(tmp_path / "draft", num_hidden_layers=1).eval()
    ids = torch.tensor([[3, 17, 5, 42, 9, 1]])
    with torch.inference_mode():
        got, want, orig = weak(ids).logits, cut(ids).logits, full(ids).logits
    torch.testing.assert_close(got, want)
    assert not torch.allclose(got, orig)  # it is weaker: it computes something else
    for name, w in weak.state_dict().items():
        if ".layers.0." in name:
            torch.testing.assert_close(w, full.state_dict()[name])


def test_keep_out_of_range_is_an_error_naming_the_option(tmp_path, capsys):
    from sloserve.bench.weak_draft import main

    _tiny_llama(tmp_path / "draft", layers=2)
    with pytest.raises(SystemExit) as e:
        main(["--draft", str(tmp_path / "draft"), "--out", str(tmp_path / "w"), "--keep", "2"])
    assert e.value.code == 2
    assert "--keep" in capsys.readouterr().err
