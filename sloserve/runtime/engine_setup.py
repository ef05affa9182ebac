"""Build the engine's parts from a resolved config: tokenizer, models, KV pool, runners, policy."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from sloserve.estimator.cost_model import CostModel, rough_cost
from sloserve.runtime.attention import make_backend
from sloserve.runtime.config import EngineConfig
from sloserve.runtime.cpu_kernels import cpu_ops
from sloserve.runtime.kv_cache import BlockAllocator, KVStorage
from sloserve.runtime.model_runner import ModelRunner
from sloserve.runtime.models.config import ModelLoadError
from sloserve.runtime.models.cpu_linear import (
    block_bf16_linears,
    pack_linears,
    packed_linear_available,
)
from sloserve.runtime.models.loader import load_model
from sloserve.runtime.models.presets import resolve_pair
from sloserve.speculation import SpecPolicy

log = logging.getLogger(__name__)


@dataclass
class EngineParts:
    tokenizer: Any  # a Hugging Face tokenizer (AutoTokenizer)
    target: ModelRunner
    draft: ModelRunner | None  # None with the n-gram drafter or without speculation
    allocator: BlockAllocator
    policy: SpecPolicy
    cost: CostModel
    target_path: str
    draft_path: str | None
    calibration: tuple | None = None  # the profile's confidence -> acceptance counts
    tokenizer_path: str | None = None  # where the tokenizer came from (None: target_path)


def _dtype(name: str) -> torch.dtype:
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]


def load_tokenizer(path: str, chat_template: str | None = None):
    """The tokenizer in `path`, with `chat_template` (Jinja text) replacing its own."""
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
    except Exception as e:  # transformers raises many kinds here
        raise ModelLoadError(f"cannot load a tokenizer from {path!r}: {e}") from None
    if chat_template is not None:
        tokenizer.chat_template = chat_template
    return tokenizer


def _load_cost(cfg: EngineConfig, target: ModelRunner, draft: ModelRunner | None,
               target_path: str, draft_path: str | None) -> tuple[CostModel, tuple | None]:
    """The cost model and the pair's calibration counts (None without a profile)."""
    from sloserve.estimator.profile_lookup import load_profile

    profile = load_profile(cfg, target_path, draft_path)
    cost = profile.cost_model() if profile is not None else None
    calibration = profile.calibration if profile is not None else None
    if cost is None:
        log.warning("no cost profile found for this model pair/device; using a rough estimate "
                    "(run `python -m sloserve.profiler` for an accurate one)")
        cost = rough_cost(target.cfg, draft.cfg if draft else None)
    if draft is None:
        cost = cost.without_draft()
    return cost, calibration


def _log_cpu_path(dtype: str, kernels_built: bool, fused: bool) -> None:
    """Say at start which dtype the CPU engine runs and which code path that takes."""
    from sloserve.runtime.cpu_tuning import cpu_has_bf16_matmul

    hw = "has" if cpu_has_bf16_matmul() else "lacks"
    log.info("dtype %s on the CPU (this CPU %s bf16 matmul hardware: AVX512-BF16/AMX)", dtype, hw)
    if fused:
        log.info("CPU path: sloserve's C++ kernels (paged attention, fused RMSNorm/RoPE/SiLU)")
    elif kernels_built and dtype != "float32":
        log.info("CPU path: PyTorch ops in %s (sloserve's C++ kernels are float32-only; matmuls "
                 "run through oneDNN, attention through SDPA over gathered KV)", dtype)
    else:
        log.info("CPU path: PyTorch ops in %s (sloserve's C++ kernels are not available)", dtype)


def build_parts(cfg: EngineConfig) -> EngineParts:
    try:  # presets (builtin, smollm2) are built or fetched here on first use
        target_path, draft_path = resolve_pair(cfg.model_path, cfg.draft_model_path, cfg.drafter)
    except ValueError as e:
        raise ModelLoadError(str(e)) from None
    dtype, device = _dtype(cfg.dtype), cfg.device
    tokenizer_path = cfg.tokenizer_path or target_path
    tokenizer = load_tokenizer(tokenizer_path, cfg.chat_template)
    target_model = load_model(target_path, dtype, device)
    if cfg.tokenizer_path and len(tokenizer) > target_model.cfg.vocab_size:
        raise ModelLoadError(f"the tokenizer in {tokenizer_path!r} has {len(tokenizer)} tokens, "
                             f"more than the model's vocabulary ({target_model.cfg.vocab_size})")
    draft_model = load_model(draft_path, dtype, device) if draft_path else None
    if cfg.cpu_packed_linear and device == "cpu" and packed_linear_available():
        for m in (target_model, draft_model):
            if m is not None:
                pack_linears(m)  # float32 linears only
    if device == "cpu":
        for m in (target_model, draft_model):
            if m is not None:
                block_bf16_linears(m)  # bf16 linears only: row-invariant (cpu_linear.py)
    if device == "cpu":
        ops = cpu_ops()
        fused = [m.use_cpu_ops(ops) for m in (target_model, draft_model) if m is not None]
        _log_cpu_path(cfg.dtype, ops is not None, all(fused))
    if draft_model is not None and draft_model.cfg.vocab_size != target_model.cfg.vocab_size:
        raise ModelLoadError(
            f"draft vocab {draft_model.cfg.vocab_size} != target vocab {target_model.cfg.vocab_size}"
        )
    alloc = BlockAllocator(cfg.num_blocks, cfg.block_size)
    t_kv = KVStorage(target_model.cfg, cfg.num_blocks, cfg.block_size, dtype, device)
    target = ModelRunner(target_model, t_kv, make_backend(cfg.attention_backend, device), cfg.block_size)
    draft = None
    if draft_model is not None:
        d_kv = KVStorage(draft_model.cfg, cfg.num_blocks, cfg.block_size, dtype, device)
        draft = ModelRunner(draft_model, d_kv, make_backend(cfg.attention_backend, device), cfg.block_size)
    cost, calibration = _load_cost(cfg, target, draft, target_path, draft_path)
    from sloserve.policies.registry import make_policy

    spec = cfg.speculation
    speculative = cfg.drafter != "none" and spec.policy != "ar"
    policy = make_policy(
        spec.policy if speculative else "ar", cost, k_max=spec.k_max,
        drafter="ngram" if cfg.drafter == "ngram" else "model", calibration=calibration,
        options=spec.options if speculative else (),
    )
    return EngineParts(tokenizer, target, draft, alloc, policy, cost, target_path, draft_path,
                       calibration, tokenizer_path)


def model_name(path: str) -> str:
    return Path(path).name
