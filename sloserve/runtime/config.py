"""Engine configuration: one frozen tree, built once (from the CLI or code), never mutated.

"auto" values are resolved by `resolve()`, a pure function returning a new config.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from sloserve.runtime.scheduler import SchedulerConfig
from sloserve.spec_config import DEFAULTS as SPEC_DEFAULTS
from sloserve.spec_config import SpeculationConfig


@dataclass(frozen=True)
class EngineConfig:
    model_path: str | None = None  # None = the built-in target
    draft_model_path: str | None = None  # None = the built-in draft (with drafter "model")
    drafter: str = "model"  # model | ngram | none
    # the speculation defaults both engines share (sloserve/spec_config.py)
    spec_policy: str = SPEC_DEFAULTS.policy  # see sloserve.policies.registry
    k_max: int = SPEC_DEFAULTS.k_max  # most draft tokens per request per step
    tpot_slo: float | None = None  # seconds; default TPOT SLO of requests without their own
    ttft_slo: float | None = None
    # the policy's options, (name, value) pairs (--spec-options; SpeculationConfig.options)
    spec_options: tuple[tuple[str, str], ...] = SPEC_DEFAULTS.options
    kv_cache_tokens: int = 65536  # KV capacity shared by all requests, in tokens
    block_size: int = 16
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    attention_backend: str = "auto"  # auto | cpu | torch (auto: cpu on the CPU, torch on CUDA)
    device: str = "auto"  # auto | cpu | cuda
    # auto: bfloat16 on cuda and on CPUs with bf16 matmul hardware (AVX512-BF16 / AMX),
    # float32 elsewhere (decided at start and logged)
    dtype: str = "auto"  # auto | float32 | bfloat16 | float16
    profile_path: str | None = None  # cost profile; None = look up configs/profiles, else default
    seed: int = 0
    num_threads: int | None = None  # torch CPU threads (None = torch default)
    cpu_packed_linear: bool = True  # oneDNN prepacked fp32 linears on CPU (see cpu_linear.py)
    # JSON schemas allow only the compact layout (no free whitespace between elements), as
    # SGLang's --constrained-json-disable-any-whitespace; by default any whitespace, as SGLang
    constrained_json_disable_any_whitespace: bool = False
    tokenizer_path: str | None = None  # None = the target model's directory
    chat_template: str | None = None  # Jinja text replacing the tokenizer's chat template
    # cap on prompt + output tokens per request (None: the target's max_position_embeddings);
    # SGLang's --context-length. May not exceed the model's window.
    context_length: int | None = None

    @property
    def num_blocks(self) -> int:
        return max(1, self.kv_cache_tokens // self.block_size)

    @property
    def speculation(self) -> SpeculationConfig:
        """The speculation settings as the shared SpeculationConfig (the value SGLang's
        worker gets too); raises ValueError on an invalid k_max or SLO."""
        return SpeculationConfig(policy=self.spec_policy, k_max=self.k_max,
                                 tpot_slo=self.tpot_slo, ttft_slo=self.ttft_slo,
                                 options=self.spec_options)

    @property
    def speculative(self) -> bool:
        return self.drafter != "none" and self.spec_policy != "ar"


def auto_cpu_dtype() -> str:
    """bfloat16 where the CPU has bf16 matmul hardware, else float32."""
    from sloserve.runtime.cpu_tuning import cpu_has_bf16_matmul

    return "bfloat16" if cpu_has_bf16_matmul() else "float32"


def resolve(cfg: EngineConfig) -> EngineConfig:
    """Resolve "auto" values (device, dtype, draft pairing) into a new config."""
    import torch

    device = cfg.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = cfg.dtype
    if dtype == "auto":
        dtype = "bfloat16" if device == "cuda" else auto_cpu_dtype()
    if cfg.drafter not in ("model", "ngram", "none"):
        raise ValueError(f"drafter must be one of model, ngram, none; got {cfg.drafter!r}")
    _ = cfg.speculation  # SpeculationConfig raises ValueError on k_max or an SLO out of range
    if cfg.context_length is not None and cfg.context_length < 2:
        raise ValueError(f"context_length must be >= 2, got {cfg.context_length}")
    return dataclasses.replace(cfg, device=device, dtype=dtype)
