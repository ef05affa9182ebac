"""The built-in model pair: a deterministic target and draft built from a seed, no download.

Both are written once as ordinary Hugging Face directories (config.json, model.safetensors,
tokenizer files) under the cache, so transformers and sloserve load them alike.

How the pair is built (its text is NOT meaningful; it exists to have a realistic cost shape
and a realistic draft/target agreement):
- target: a random Llama (hidden 384, 16 layers, GQA 6/2 heads, SwiGLU 1024, ~27M params).
  Layer 0 writes into the residual stream at full scale; layers 1..15 write at scale ALPHA.
  The untied LM head has scale BETA, which sets how peaked the next-token distributions are.
- draft: the target's embedding, layer 0, final norm and LM head (an early-exit model, ~2.4M
  params, 1 layer), so it is ~10x cheaper per forward. It agrees with the target when the
  deeper layers' small contributions do not flip the argmax, which is likelier when the
  draft is confident: the draft's confidence predicts acceptance.
ALPHA and BETA were chosen by measurement so greedy acceptance is ~0.7 on ordinary prompts;
`python -m sloserve.bench.builtin_pair` measures acceptance, calibration and costs.
"""

from __future__ import annotations

import json
import logging
import math
import os
import shutil
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

log = logging.getLogger(__name__)

BUILTIN_VERSION = "v2"  # bump whenever the construction changes: caches are keyed by it
SEED = 20261121
ALPHA = 0.075  # residual write scale of target layers 1..15
BETA = 4.0  # LM head scale
TARGET_SHAPE = dict(
    hidden_size=384, intermediate_size=1024, num_hidden_layers=16,
    num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=4096,
)
DRAFT_LAYERS = 1
VOCAB_TARGET = 2048
SPECIAL_TOKENS = ["<|bos|>", "<|eos|>", "<|pad|>", "<|system|>", "<|user|>", "<|assistant|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}<|eos|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def cache_root() -> Path:
    return Path(os.environ.get("SLOSERVE_CACHE", Path.home() / ".cache" / "sloserve"))


def builtin_paths() -> tuple[Path, Path]:
    root = cache_root() / f"builtin-{BUILTIN_VERSION}"
    return root / "target", root / "draft"


def _corpus(n_words: int = 60000) -> list[str]:
    """Deterministic pseudo-text for the tokenizer: common English and code words mixed with
    made-up words from syllables, so BPE learns ~2k merges (own LCG, no RNG library)."""
    words = (
        "the of and to in is that for it as with was on be by this are from at or an not "
        "have which one you all were can there their will more when would if so about what "
        "def return import class self None True False while else elif print value list dict"
    ).split()
    syll = (
        "ka ri to ne sa mu lo pe di va ze cho tra ble ing tion er ed an on st re ma li "
        "go ru fi hen por qua ser vin dal mer tor gun bel ast ish ent ple con pro ver"
    ).split()
    x, out, line = 12345, [], []

    def rnd(n: int) -> int:
        nonlocal x
        x = (1103515245 * x + 12345) % 2**31
        return (x >> 8) % n

    for _ in range(n_words):
        if rnd(3) == 0:
            line.append(words[rnd(len(words))])
        else:
            line.append("".join(syll[rnd(len(syll))] for _ in range(1 + rnd(3))))
        if rnd(11) == 0:
            out.append(" ".join(line) + (". " if rnd(2) else ",\n"))
            line = []
    return out


def build_tokenizer(out: Path) -> int:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_TARGET, special_tokens=SPECIAL_TOKENS, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(_corpus(), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<|bos|>", eos_token="<|eos|>", pad_token="<|pad|>",
        additional_special_tokens=SPECIAL_TOKENS[3:], model_max_length=4096,
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(out))
    return len(fast)


def _hf_config(shape: dict, vocab: int, layers: int, tok_dir: Path) -> dict:
    from transformers import AutoTokenizer

    t = AutoTokenizer.from_pretrained(str(tok_dir))
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", **shape,
        "num_hidden_layers": layers, "vocab_size": vocab, "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0, "tie_word_embeddings": False, "attention_bias": False,
        "hidden_act": "silu", "torch_dtype": "float32",
        "bos_token_id": t.bos_token_id, "eos_token_id": t.eos_token_id,
        "pad_token_id": t.pad_token_id,
    }


def _target_weights(shape: dict, vocab: int, seed: int, alpha: float) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    h, inter = shape["hidden_size"], shape["intermediate_size"]
    hd = h // shape["num_attention_heads"]
    kv = shape["num_key_value_heads"] * hd

    def normal(shape, std):
        return torch.randn(shape, generator=g) * std

    w = {"model.embed_tokens.weight": normal((vocab, h), 1.0)}
    for i in range(shape["num_hidden_layers"]):
        p, s = f"model.layers.{i}.", (1.0 if i == 0 else alpha)
        w[p + "self_attn.q_proj.weight"] = normal((h, h), 1 / math.sqrt(h))
        w[p + "self_attn.k_proj.weight"] = normal((kv, h), 1 / math.sqrt(h))
        w[p + "self_attn.v_proj.weight"] = normal((kv, h), 1 / math.sqrt(h))
        w[p + "self_attn.o_proj.weight"] = normal((h, h), s / math.sqrt(h))
        w[p + "mlp.gate_proj.weight"] = normal((inter, h), 1 / math.sqrt(h))
        w[p + "mlp.up_proj.weight"] = normal((inter, h), 1 / math.sqrt(h))
        w[p + "mlp.down_proj.weight"] = normal((h, inter), s / math.sqrt(inter))
        w[p + "input_layernorm.weight"] = torch.ones(h)
        w[p + "post_attention_layernorm.weight"] = torch.ones(h)
    w["model.norm.weight"] = torch.ones(h)
    w["lm_head.weight"] = normal((vocab, h), BETA / math.sqrt(h))
    return w


def _write_model(out: Path, cfg: dict, weights: dict, tok_dir: Path) -> None:
    out.mkdir(parents=True)
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    save_file({k: v.contiguous() for k, v in weights.items()}, str(out / "model.safetensors"))
    for f in tok_dir.iterdir():
        shutil.copy(f, out / f.name)
    (out / "README.md").write_text(
        "sloserve built-in model (random weights from a seed; its text is not meaningful).\n"
    )


def build_pair(
    root: Path, shape: dict | None = None, seed: int = SEED, alpha: float = ALPHA
) -> None:
    """Write target/ and draft/ under root (which must not exist yet). Tests pass a tiny
    `shape` (same keys as TARGET_SHAPE) to get a fast pair built the same way."""
    shape = dict(shape or TARGET_SHAPE)
    with tempfile.TemporaryDirectory() as tmp:
        tok_dir = Path(tmp) / "tok"
        vocab = build_tokenizer(tok_dir)
        weights = _target_weights(shape, vocab, seed, alpha)
        layers = shape["num_hidden_layers"]
        _write_model(root / "target", _hf_config(shape, vocab, layers, tok_dir), weights, tok_dir)
        keep = {k: v for k, v in weights.items() if not k.startswith("model.layers.")
                or int(k.split(".")[2]) < DRAFT_LAYERS}
        _write_model(root / "draft", _hf_config(shape, vocab, DRAFT_LAYERS, tok_dir), keep, tok_dir)


def ensure_builtin_pair() -> tuple[Path, Path]:
    """Paths of the built-in (target, draft), building them on first use."""
    return ensure_pair(builtin_paths()[0].parent)


def ensure_pair(root: Path, **build_kwargs) -> tuple[Path, Path]:
    """(root/target, root/draft), built by build_pair(root, **build_kwargs) on first use
    (atomic rename, so concurrent processes never see a half-written pair)."""
    target, draft = root / "target", root / "draft"
    if (target / "model.safetensors").is_file() and (draft / "model.safetensors").is_file():
        return target, draft
    root.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".building-", dir=root.parent))
    log.info("building the model pair in %s (first start only; a few seconds)", root)
    t0 = time.perf_counter()
    try:
        build_pair(staging / "pair", **build_kwargs)
        log.info("built the model pair in %.1f s", time.perf_counter() - t0)
        try:
            os.rename(staging / "pair", root)
        except OSError:
            if not (target / "model.safetensors").is_file():  # lost a race to a broken dir
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target, draft
