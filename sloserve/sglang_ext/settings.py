"""What the SPECSERVE worker takes from its environment: one serialised WorkerConfig (the
speculation config both engines share, sloserve/spec_config.py, plus the worker's own
settings) in SLOSERVE_SGLANG_CONFIG, set by `python -m sloserve.launch --engine sglang`
from its options; and the cost profile of SGLang's forwards for the model pair on this
device.

A request's own SLO: `tpot_slo` in its sampling params, directly or in custom_params
(sloserve/slo.py). Profiles of SGLang's forwards are keyed like the built-in engine's, with
the device key prefixed by "sglang-" (`python -m sloserve.profiler --engine sglang` writes
one); without one the worker starts from a rough estimate from the models' shapes and
corrects it online from measured steps (docs/design.md sec. 6).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from dataclasses import dataclass, replace
from typing import Any

from sloserve.estimator.cost_model import CostModel, rough_cost
from sloserve.estimator.profile_file import Profile, model_key, read_profile
from sloserve.estimator.profile_lookup import device_key, device_keys, find_first, fingerprint
from sloserve.policies.registry import make_policy, takes_options
from sloserve.sglang_ext.controller import StepController
from sloserve.sglang_ext.cpu_weights import draft_dtype_from_env, layout_from_env
from sloserve.spec_config import SpeculationConfig

log = logging.getLogger(__name__)

ENV_CONFIG = "SLOSERVE_SGLANG_CONFIG"
LENGTHS = ("uniform", "per-request", "trim")
# "0": steps that draft nothing keep SGLang's verify of the bonus token instead of running as
# plain decode steps (worker.SpecServeWorker._decode_step; for comparisons)
DECODE_STEP_ENV = "SLOSERVE_DECODE_STEP"


def decode_steps_from_env() -> bool:
    """Whether steps that draft nothing run as plain decode steps (the default)."""
    return os.environ.get(DECODE_STEP_ENV, "1") != "0"


# the verify path's fixed cost over a decode forward's fixed cost, where no profile measured
# it: the real pair on the 2-core CPU, 14-16 ms over a 55-66 ms decode forward at batch 1
ROUGH_VERIFY_PATH = 0.25


def default_lengths(drafter: str) -> str:
    """--spec-lengths by default: per-request with either drafter. Prompt lookup: its chain
    is looked up whole before the step and each request verifies its own length (issue
    #32's closed loop, BENCHMARKS.md). A draft model: the plan stops drafting round by
    round on the draft's confidences; with the distilled SmolLM2 draft (its head cut to
    the hot vocabulary) per-request steps beat the uniform mode by 8% at concurrency 1 and
    SGLang's STANDALONE 1 by 8%, and were level with the uniform mode at 4 and 16
    (BENCHMARKS.md, 2026-12-01; the uniform mode won with the draft's whole head before)."""
    return "per-request"
DRAFTERS = ("model", "ngram")


@dataclass(frozen=True)
class WorkerConfig:
    """Everything the SPECSERVE worker is told, serialised into one environment variable."""

    spec: SpeculationConfig = SpeculationConfig()
    # uniform: one length per batch before drafting (the plan's batch_rounds); per-request:
    # the plan stops drafting round by round and each request verifies its own k_r (a
    # ragged verify; 10-15% slower on a CPU, docs/design.md sec. 13); trim: one length
    # drafted per batch, each request's verify trimmed by the plan's verifier from the
    # chain's confidences (one ragged verify, no plan call between draft rounds)
    lengths: str = "uniform"
    # model: the draft model SGLang loads (its KV aligned, draft_chain.AlignedDraft); ngram:
    # prompt lookup over each request's tokens (draft_chain.NgramDraft; SGLang still loads
    # a draft model for its worker but never runs it)
    drafter: str = "model"
    # a profile file to use instead of the lookup; "none": no profile (the shape-based
    # estimate corrected online, as on a pair's first start)
    profile: str | None = None
    sweep: tuple[int, ...] = ()  # profiling: draft lengths to cycle through (uniform steps)
    timings: str | None = None  # profiling: a file that gets one JSON line a step
    step_log: str | None = None  # a file that gets one JSON line per per-request step
    # TEST ONLY: k per batch row (cyclic); every request drafts k_max, row i verifies k[i]
    test_verify_lens: tuple[int, ...] = ()
    # TEST ONLY: a deliberately wrong acceptance rule for sampled batches (all accepted)
    test_accept_all: bool = False

    def __post_init__(self) -> None:
        if self.lengths not in LENGTHS:
            raise ValueError(f"lengths must be one of {', '.join(LENGTHS)}, got "
                             f"{self.lengths!r}")
        if self.drafter not in DRAFTERS:
            raise ValueError(f"drafter must be one of {', '.join(DRAFTERS)}, got "
                             f"{self.drafter!r}")
        if any(x < 0 for x in (*self.sweep, *self.test_verify_lens)):
            raise ValueError("sweep and test_verify_lens must be non-negative integers")

    @property
    def per_request(self) -> bool:
        return self.lengths == "per-request" and not self.sweep

    @property
    def trim(self) -> bool:
        return self.lengths == "trim" and not self.sweep

    def to_json(self) -> str:
        d = dataclasses.asdict(self)
        d["spec"] = json.loads(self.spec.to_json())
        return json.dumps(d, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> WorkerConfig:
        d = json.loads(text)
        known = {f.name for f in dataclasses.fields(cls)}
        if not isinstance(d, dict) or set(d) - known:
            raise ValueError(f"{ENV_CONFIG}: not a WorkerConfig: {text[:200]!r}")
        d["spec"] = SpeculationConfig.from_dict(d.get("spec", {}))
        for name in ("sweep", "test_verify_lens"):
            d[name] = tuple(int(x) for x in d.get(name, ()))
        return cls(**d)


def worker_config() -> WorkerConfig:
    """The worker's config from SLOSERVE_SGLANG_CONFIG (the shared defaults when unset)."""
    raw = os.environ.get(ENV_CONFIG)
    return WorkerConfig.from_json(raw) if raw else WorkerConfig()


def sglang_device_key(device: str, draft_model: bool = True, isa: bool = True,
                      kernel: bool | None = None) -> str:
    """The device part of an SGLang profile's key. On a CPU the plugin stores float32 linear
    weights column-major or prepacked for oneDNN (cpu_weights.py), which changes every
    forward's cost: "-wcol" or "-wpak" then; a profile measured with SGLang's row-major
    weights keeps the plain key.
    A draft model whose matmuls run in bf16 there (draft_model: the pair has one;
    SLOSERVE_CPU_DRAFT_DTYPE, cpu_weights.py) drafts at another price: "-dbf16" after it.
    Attention through the project's C++ paged kernel (the CPU shim's decode and short
    extends; kernel None: whether it is on and built here, runtime/cpu_kernels.py) made
    SGLang's CPU forwards 4-17% faster than its torch path and the verify rows cheaper
    (2026-12-05, BENCHMARKS.md): "-kpa" last.
    isa=False: without the CPU's instruction set tier (profile_lookup.device_key)."""
    key = f"sglang-{device_key(device, isa)}"
    if device.startswith("cpu"):
        key += {"column": "-wcol", "packed": "-wpak"}.get(layout_from_env(), "")
        if draft_model and draft_dtype_from_env() == "bfloat16":
            key += "-dbf16"
        if kernel is None:
            from sloserve.runtime.cpu_kernels import kernels_ready

            kernel = kernels_ready()
        if kernel:
            key += "-kpa"
    return key


def sglang_device_keys(device: str, draft_model: bool = True) -> list[str]:
    """The keys an SGLang profile of this device is looked up by, best first: with this
    attention path, then (where that is the C++ kernel) the keys of profiles measured on the
    torch path before the kernel existed, which the online correction then scales
    (profile_lookup.device_keys orders each set by instruction set)."""
    def keys(kernel: bool | None) -> list[str]:
        return device_keys(device, lambda dev, isa: sglang_device_key(dev, draft_model, isa,
                                                                      kernel))
    own = keys(None)
    return own + [k for k in keys(False) if k not in own]


def find_sglang_profile(target_path: str, draft_path: str | None, device: str,
                        dtype: str, explicit: str | None = None) -> Profile | None:
    """The profile of SGLang's forwards for the pair (draft_path None: the n-gram drafter,
    key "ngram", as the built-in engine's)."""
    if explicit:
        return read_profile(explicit)
    draft = draft_path is not None
    devices = sglang_device_keys(device, draft)
    path = find_first(model_key(target_path, fingerprint(target_path)),
                      model_key(draft_path, fingerprint(draft_path)) if draft_path else "ngram",
                      devices, dtype)
    if path is None:
        return None
    log.info("SPECSERVE cost profile: %s", path)
    return read_profile(path)


def load_cost(target_path: str, draft_path: str, device: str, dtype: str,
              explicit: str | None = None, drafter: str = "model") -> tuple[CostModel, Any]:
    """The cost model of SGLang's forwards and the pair's calibration counts (or None).
    The n-gram drafter: its own profile, else the draft model's profile with the draft
    free (the target's forwards are the same whichever drafter proposes; the draft model's
    calibration is not the n-gram's), else the rough estimate of the target alone.
    explicit "none": the rough estimate whatever profiles exist."""
    profile: Profile | None = None
    if explicit == "none":
        pass
    elif drafter == "ngram":
        profile = (find_sglang_profile(target_path, None, device, dtype, explicit)
                   or find_sglang_profile(target_path, draft_path, device, dtype))
        if profile is not None and profile.draft.key != "ngram":
            cost = profile.cost_model()
            return cost.without_draft(), None
    else:
        profile = find_sglang_profile(target_path, draft_path, device, dtype, explicit)
    if profile is not None:
        return profile.cost_model(), profile.calibration
    from sloserve.runtime.models.config import hot_vocab, load_config

    log.warning("SPECSERVE: no cost profile of SGLang's forwards for this pair and device; "
                "starting from a rough estimate (python -m sloserve.profiler --engine sglang "
                "measures one)")
    draft_cfg = load_config(draft_path) if drafter == "model" else None
    hot = hot_vocab(draft_path) if draft_cfg is not None else None
    if draft_cfg is not None and hot is not None:  # its head cut to the hot vocabulary
        draft_cfg = replace(draft_cfg, vocab_size=len(hot))
    rough = rough_cost(load_config(target_path), draft_cfg)
    # SGLang's verify path costs more than its decode path (docs/design.md sec. 2); a prior
    # the online correction fits from the first verify steps on (estimator/online_cost.py)
    return replace(rough, verify_fixed=ROUGH_VERIFY_PATH * rough.target.c), None


# SpecServe's uniform_margin inside SGLang's per-request steps (the user's
# --spec-options uniform_margin=... wins). The built-in engine's 6% was measured on the
# random-weight pair, whose requests all accept alike; on the real pair inside SGLang
# (2-core EPYC, 2026-12-06) it kept the plan from every ragged choice at batch 4 (48 of 895
# steps drafted ragged, 9 draft tokens of 5,781 trimmed) and the per-request mode ran 4-6%
# more ms a token than with 0 (in-server medians of two starts at C = 4 and 1), which also
# ran at or above the uniform mode's (BENCHMARKS.md). Measured with the draft model only:
# the n-gram drafter's looked-up chains keep the 6% until measured
SGLANG_UNIFORM_MARGIN = "0"


def policy_options(cfg: WorkerConfig) -> tuple[tuple[str, str], ...]:
    """The policy's options in the worker: the config's, with SGLANG_UNIFORM_MARGIN for a
    SpecServe policy's per-request steps with the draft model unless the config sets
    uniform_margin."""
    options = tuple(cfg.spec.options)
    if (cfg.per_request and cfg.drafter == "model" and takes_options(cfg.spec.policy)
            and all(name != "uniform_margin" for name, _ in options)):
        options = (("uniform_margin", SGLANG_UNIFORM_MARGIN), *options)
    return options


def make_controller(cfg: WorkerConfig, target_path: str, draft_path: str, k_max: int,
                    device: str, dtype: str = "auto") -> StepController:
    """The worker's controller: the config's policy built by the registry (any policy;
    k_max: SGLang's largest runtime state) on the cost model of SGLang's forwards."""
    cost, calibration = load_cost(target_path, draft_path, device, dtype, cfg.profile,
                                  cfg.drafter)
    spec = cfg.spec
    policy = make_policy(spec.policy, cost, k_max=k_max, drafter=cfg.drafter,
                         calibration=calibration, options=policy_options(cfg))
    return StepController(policy, k_max, spec.tpot_slo, draft_cost=cost.draft,
                          per_request=cfg.per_request,
                          trim=cfg.trim,
                          sweep=cfg.sweep, timings_path=cfg.timings,
                          forced_lengths=cfg.test_verify_lens, step_log_path=cfg.step_log)
