"""Load a Hugging Face-format checkpoint directory (config.json + safetensors, sharded or not)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from safetensors import safe_open

from sloserve.runtime.models.config import ModelConfig, ModelLoadError, load_config
from sloserve.runtime.models.llama import LlamaModel

_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
# HF per-layer name -> (our parameter, which slice of a fused matrix)
_LAYER_MAP = {
    "input_layernorm.weight": ("input_norm", None),
    "post_attention_layernorm.weight": ("post_norm", None),
    "self_attn.q_proj.weight": ("qkv.weight", 0),
    "self_attn.k_proj.weight": ("qkv.weight", 1),
    "self_attn.v_proj.weight": ("qkv.weight", 2),
    "self_attn.q_proj.bias": ("qkv.bias", 0),
    "self_attn.k_proj.bias": ("qkv.bias", 1),
    "self_attn.v_proj.bias": ("qkv.bias", 2),
    "self_attn.o_proj.weight": ("o_proj.weight", None),
    "mlp.gate_proj.weight": ("gate_up.weight", 0),
    "mlp.up_proj.weight": ("gate_up.weight", 1),
    "mlp.down_proj.weight": ("down.weight", None),
}
_TOP_MAP = {
    "model.embed_tokens.weight": "embed.weight",
    "model.norm.weight": "norm",
    "lm_head.weight": "lm_head.weight",
}
_IGNORED = re.compile(r"rotary_emb\.inv_freq$")


def _shard_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map", {})
        files = sorted({path / f for f in weight_map.values()})
        missing = [str(f) for f in files if not f.is_file()]
        if missing:
            raise ModelLoadError(f"checkpoint shard(s) missing: {', '.join(missing)}")
        return files
    single = path / "model.safetensors"
    if single.is_file():
        return [single]
    found = sorted(path.glob("*.safetensors"))
    if found:
        return found
    raise ModelLoadError(f"no safetensors weights in {str(path)!r} (.bin checkpoints unsupported)")


def _fused_slices(cfg: ModelConfig, target: str) -> list[tuple[int, int]]:
    if target.startswith("qkv"):
        nq, nkv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        return [(0, nq), (nq, nq + nkv), (nq + nkv, nq + 2 * nkv)]
    i = cfg.intermediate_size
    return [(0, i), (i, 2 * i)]


def load_weights(model: LlamaModel, path: Path) -> None:
    cfg = model.cfg
    params = dict(model.named_parameters())
    filled: dict[str, int] = {}  # parameter -> number of pieces written
    with torch.no_grad():
        for file in _shard_files(path):
            with safe_open(str(file), framework="pt") as f:
                for name in f.keys():
                    if _IGNORED.search(name):
                        continue
                    _copy_tensor(model, cfg, params, filled, name, f.get_tensor(name))
    expected = {n: (3 if n.endswith("qkv.weight") or n.endswith("qkv.bias") else
                    2 if n.endswith("gate_up.weight") else 1) for n in params}
    if cfg.tie_word_embeddings:
        expected.pop("lm_head.weight", None)
        filled.pop("lm_head.weight", None)
    missing = [n for n, k in expected.items() if filled.get(n, 0) < k]
    if missing:
        raise ModelLoadError(f"checkpoint {str(path)!r} lacks weights for: {', '.join(missing[:8])}")


def _copy_tensor(model, cfg, params, filled, name: str, tensor: torch.Tensor) -> None:
    m = _LAYER.match(name)
    if m:
        layer, rest = int(m.group(1)), m.group(2)
        if rest not in _LAYER_MAP or layer >= cfg.num_layers:
            raise ModelLoadError(f"unexpected weight {name!r} in checkpoint")
        target, piece = _LAYER_MAP[rest]
        pname = f"layers.{layer}.{target}"
    elif name in _TOP_MAP:
        pname, piece = _TOP_MAP[name], None
        if pname == "lm_head.weight" and cfg.tie_word_embeddings:
            return
    else:
        raise ModelLoadError(f"unexpected weight {name!r} in checkpoint")
    if pname not in params:
        raise ModelLoadError(f"weight {name!r} has no place in this config (bias disabled?)")
    dest = params[pname]
    if piece is not None:
        lo, hi = _fused_slices(cfg, target)[piece]
        dest = dest[lo:hi]
    if tuple(dest.shape) != tuple(tensor.shape):
        raise ModelLoadError(
            f"shape mismatch for {name!r}: checkpoint {tuple(tensor.shape)}, "
            f"config expects {tuple(dest.shape)}"
        )
    dest.copy_(tensor.to(dest.dtype))
    filled[pname] = filled.get(pname, 0) + 1


def load_model(
    model_dir: str | Path, dtype: torch.dtype = torch.float32, device: str = "cpu"
) -> LlamaModel:
    path = Path(model_dir)
    cfg = load_config(path)
    with torch.device("meta"):
        model = LlamaModel(cfg)
    model = model.to_empty(device=device).to(dtype)
    model.rotary = type(model.rotary)(cfg).to(device)  # buffers are not in the checkpoint
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.embed.weight
    load_weights(model, path)
    return model.eval().requires_grad_(False)
