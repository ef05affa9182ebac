"""Model configuration parsed from a Hugging Face `config.json` (Llama, Mistral, Qwen2 style)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")


class ModelLoadError(ValueError):
    """A checkpoint cannot be served: unsupported architecture, missing file, bad shapes."""


@dataclass(frozen=True)
class RopeConfig:
    theta: float = 10000.0
    kind: str = "default"  # default | linear | llama3
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position: int = 8192


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    qkv_bias: bool
    tie_word_embeddings: bool
    rope: RopeConfig = field(default_factory=RopeConfig)
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    name: str = "model"

    @property
    def kv_bytes_per_token(self) -> int:
        """float32 bytes of K and V over all layers for one token."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * 4


def _rope_from_hf(raw: dict[str, Any]) -> RopeConfig:
    # transformers < 5 writes rope_theta + rope_scaling; >= 5 writes rope_parameters.
    params = dict(raw.get("rope_parameters") or {})
    scaling = dict(raw.get("rope_scaling") or {})
    params = {**scaling, **params}
    theta = float(params.get("rope_theta", raw.get("rope_theta", 10000.0)))
    kind = params.get("rope_type", params.get("type", "default")) or "default"
    if kind not in ("default", "linear", "llama3"):
        raise ModelLoadError(
            f"unsupported rope scaling type {kind!r} (supported: default, linear, llama3)"
        )
    return RopeConfig(
        theta=theta,
        kind=kind,
        factor=float(params.get("factor", 1.0)),
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        original_max_position=int(params.get("original_max_position_embeddings", 8192)),
    )


def parse_config(raw: dict[str, Any], name: str = "model") -> ModelConfig:
    """Validate a Hugging Face config dict and return the runtime's frozen config."""
    archs = raw.get("architectures") or []
    arch = archs[0] if archs else None
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ModelLoadError(
            f"unsupported architecture {arch!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    try:
        hidden = int(raw["hidden_size"])
        heads = int(raw["num_attention_heads"])
        kv_heads = int(raw.get("num_key_value_heads") or heads)
        head_dim = int(raw.get("head_dim") or hidden // heads)
        max_pos = int(raw.get("max_position_embeddings", 4096))
        sliding = raw.get("sliding_window") if raw.get("use_sliding_window", True) else None
        if sliding:  # serve within the window so attention stays exact
            max_pos = min(max_pos, int(sliding))
        eos = raw.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
        return ModelConfig(
            architecture=arch,
            vocab_size=int(raw["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(raw["intermediate_size"]),
            num_layers=int(raw["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=max_pos,
            qkv_bias=bool(raw.get("attention_bias", arch == "Qwen2ForCausalLM")),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            rope=_rope_from_hf(raw),
            bos_token_id=raw.get("bos_token_id"),
            eos_token_ids=tuple(int(e) for e in eos_ids),
            name=name,
        )
    except KeyError as e:
        raise ModelLoadError(f"config.json is missing required field {e.args[0]!r}") from None
    except (TypeError, ValueError) as e:
        if isinstance(e, ModelLoadError):
            raise
        raise ModelLoadError(f"config.json has a malformed field: {e}") from None


def load_config(model_dir: str | Path) -> ModelConfig:
    path = Path(model_dir)
    if not path.is_dir():
        raise ModelLoadError(f"model path {str(path)!r} is not a directory")
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise ModelLoadError(f"no config.json in {str(path)!r}")
    try:
        raw = json.loads(cfg_file.read_text())
    except json.JSONDecodeError as e:
        raise ModelLoadError(f"{cfg_file} is not valid JSON: {e}") from None
    return parse_config(raw, name=path.name)


# config.json key of a draft directory whose LM head may be cut to a hot vocabulary: the
# name of a JSON file in that directory holding the token ids ({"tokens": [...]}); the
# token ids a draft proposes from, its most frequent answer tokens (FR-Spec's idea)
HOT_VOCAB_KEY = "sloserve_hot_vocab"


def hot_vocab(model_dir: str | Path) -> list[int] | None:
    """The draft directory's hot vocabulary (sorted token ids), None when it has none.
    ModelLoadError for a named file that is missing or not a list of token ids within the
    vocabulary."""
    d = Path(model_dir)
    raw = json.loads((d / "config.json").read_text())
    name = raw.get(HOT_VOCAB_KEY)
    if not name:
        return None
    path = d / str(name)
    try:
        tokens = json.loads(path.read_text())["tokens"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ModelLoadError(f"{d}: {HOT_VOCAB_KEY} names {name!r}, unreadable: {e}") from None
    vocab = int(raw["vocab_size"])
    if not tokens or not all(isinstance(t, int) and 0 <= t < vocab for t in tokens):
        raise ModelLoadError(f"{path}: not a list of token ids in [0, {vocab})")
    return sorted(set(tokens))
