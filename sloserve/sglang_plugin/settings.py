"""What the SPECSERVE worker takes from its environment: the server's default TPOT SLO and
policy (set by `python -m sloserve.launch --engine sglang`, or by hand when starting
`python -m sglang.launch_server --speculative-algorithm SPECSERVE`), each request's own SLO,
and the cost profile of SGLang's forwards for the model pair on this device.

    SLOSERVE_TPOT_SLO      default TPOT SLO in seconds (unset: none)
    SLOSERVE_SPEC_POLICY   specserve (default) | specserve-drafter
    SLOSERVE_PROFILE       a profile file to use instead of the lookup below
    SLOSERVE_SPEC_OPTIONS  comma-separated name=value of the policy's SpecServeOptions
                           (policies/specserve/options.py), e.g. uniform_margin=0
    SLOSERVE_SGLANG_SWEEP  profiling only: comma-separated draft lengths to cycle through
    SLOSERVE_SGLANG_TIMINGS profiling only: a file that gets one JSON line of timings a step
    SLOSERVE_SGLANG_LENGTHS uniform (default: one k per batch chosen before drafting) |
                           per-request (opt-in: the plan stops drafting round by round and
                           each request verifies its own k_r, a ragged verify)
    SLOSERVE_SGLANG_STEP_LOG a file that gets one JSON line per per-request step (verify
                           lengths, the plan's chain probabilities, the calibration map)
    SLOSERVE_SGLANG_TEST_VERIFY_LENS  TEST ONLY: comma-separated k per batch row (cyclic);
                           every request drafts k_max and row i verifies min(k[i], k_max),
                           so tests can force 0 and 4+ verified drafts in one batch
    SLOSERVE_SGLANG_TEST_ACCEPT_ALL   TEST ONLY: 1 = a deliberately wrong acceptance rule
                           for sampled batches (every draft accepted); the sampling test
                           shows it changes the output distribution

A request's own SLO: SGLang sampling params `custom_params: {"tpot_slo": seconds}`.
Profiles of SGLang's forwards are keyed like the built-in engine's, with the device key
prefixed by "sglang-" (`python -m sloserve.profiler --engine sglang` writes one); without
one the worker starts from a rough estimate from the models' shapes and corrects it online
from measured steps (docs/design.md sec. 6).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
from typing import Any

from sloserve.estimator.cost_model import CostModel, rough_cost
from sloserve.estimator.profile_file import Profile, find_profile, model_key, read_profile
from sloserve.estimator.profile_lookup import default_dirs, device_key, fingerprint
from sloserve.policies.specserve import SpecServePolicy
from sloserve.policies.specserve.options import SpecServeOptions
from sloserve.sglang_plugin.controller import StepController

log = logging.getLogger(__name__)

ENV_TPOT_SLO = "SLOSERVE_TPOT_SLO"
ENV_POLICY = "SLOSERVE_SPEC_POLICY"
ENV_PROFILE = "SLOSERVE_PROFILE"
ENV_OPTIONS = "SLOSERVE_SPEC_OPTIONS"
ENV_SWEEP = "SLOSERVE_SGLANG_SWEEP"
ENV_TIMINGS = "SLOSERVE_SGLANG_TIMINGS"
ENV_LENGTHS = "SLOSERVE_SGLANG_LENGTHS"
ENV_STEP_LOG = "SLOSERVE_SGLANG_STEP_LOG"
ENV_TEST_VERIFY_LENS = "SLOSERVE_SGLANG_TEST_VERIFY_LENS"
ENV_TEST_ACCEPT_ALL = "SLOSERVE_SGLANG_TEST_ACCEPT_ALL"


def test_accept_all() -> bool:
    """TEST ONLY: the deliberately wrong acceptance rule (see the module docstring)."""
    return os.environ.get(ENV_TEST_ACCEPT_ALL, "") == "1"
POLICIES = ("specserve", "specserve-drafter")


def request_tpot_slo(sampling_params: Any) -> float | None:
    """A request's own TPOT SLO in seconds (custom_params.tpot_slo), None if it has none or
    it is not a positive number (SGLang has already accepted the request)."""
    custom = getattr(sampling_params, "custom_params", None) or {}
    value = custom.get("tpot_slo") if isinstance(custom, dict) else None
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value) if 0.0 < value < math.inf else None


def default_tpot_slo() -> float | None:
    raw = os.environ.get(ENV_TPOT_SLO)
    if not raw:
        return None
    value = float(raw)
    if not 0.0 < value < math.inf:
        raise ValueError(f"{ENV_TPOT_SLO} must be a positive number of seconds, got {raw!r}")
    return value


def sglang_device_key(device: str) -> str:
    return f"sglang-{device_key(device)}"


def find_sglang_profile(target_path: str, draft_path: str, device: str,
                        dtype: str) -> Profile | None:
    explicit = os.environ.get(ENV_PROFILE)
    if explicit:
        return read_profile(explicit)
    keys = (model_key(target_path, fingerprint(target_path)),
            model_key(draft_path, fingerprint(draft_path)), sglang_device_key(device), dtype)
    for d in default_dirs():
        path = find_profile(d, *keys)
        if path is not None:
            log.info("SPECSERVE cost profile: %s", path)
            return read_profile(path)
    return None


def load_cost(target_path: str, draft_path: str, device: str,
              dtype: str) -> tuple[CostModel, Any]:
    """The cost model of SGLang's forwards and the pair's calibration counts (or None)."""
    profile = find_sglang_profile(target_path, draft_path, device, dtype)
    if profile is not None:
        return profile.cost_model(), profile.calibration
    from sloserve.runtime.models.config import load_config

    log.warning("SPECSERVE: no cost profile of SGLang's forwards for this pair and device; "
                "starting from a rough estimate (python -m sloserve.profiler --engine sglang "
                "measures one)")
    return rough_cost(load_config(target_path), load_config(draft_path)), None


def make_controller(target_path: str, draft_path: str, k_max: int, device: str,
                    dtype: str = "auto") -> StepController:
    name = os.environ.get(ENV_POLICY, "specserve")
    if name not in POLICIES:
        raise ValueError(f"{ENV_POLICY} must be one of {', '.join(POLICIES)}, got {name!r}")
    cost, calibration = load_cost(target_path, draft_path, device, dtype)
    options = SpecServeOptions(**spec_options(os.environ.get(ENV_OPTIONS, "")))
    policy = SpecServePolicy(cost, k_max, verifier=name == "specserve", options=options)
    if calibration is not None:
        policy.seed_calibration(calibration)
    sweep = tuple(int(x) for x in os.environ.get(ENV_SWEEP, "").split(",") if x.strip())
    forced = tuple(int(x) for x in os.environ.get(ENV_TEST_VERIFY_LENS, "").split(",")
                   if x.strip())
    if any(x < 0 for x in forced):
        raise ValueError(f"{ENV_TEST_VERIFY_LENS} must be non-negative integers")
    return StepController(policy, k_max, default_tpot_slo(), sweep=sweep,
                          timings_path=os.environ.get(ENV_TIMINGS) or None,
                          forced_lengths=forced,
                          step_log_path=os.environ.get(ENV_STEP_LOG) or None)


def spec_options(raw: str) -> dict[str, Any]:
    """SLOSERVE_SPEC_OPTIONS parsed into SpecServeOptions fields (values typed like the
    fields' defaults, `none` where a field may be None); ValueError naming the variable and
    the field on anything else."""
    fields = {f.name: f for f in dataclasses.fields(SpecServeOptions)}
    out: dict[str, Any] = {}
    for item in filter(None, (x.strip() for x in raw.split(","))):
        name, sep, value = (x.strip() for x in item.partition("="))
        if not sep or name not in fields:
            raise ValueError(f"{ENV_OPTIONS}: expected name=value with a name among "
                             f"{', '.join(fields)}, got {item!r}")
        default: Any = fields[name].default  # every option has a default
        v = value.lower()
        try:
            if v == "none" and "None" in str(fields[name].type):
                out[name] = None
            elif isinstance(default, bool):
                out[name] = {"true": True, "1": True, "false": False, "0": False}[v]
            else:
                out[name] = type(default)(value)  # int or float
        except (KeyError, ValueError):
            raise ValueError(f"{ENV_OPTIONS}: bad value for {name}: {value!r}") from None
    try:
        SpecServeOptions(**out)  # its own range checks
    except ValueError as err:
        raise ValueError(f"{ENV_OPTIONS}: {err}") from None
    return out


def per_request_lengths() -> bool:
    """Whether the worker runs per-request steps (opt-in, SLOSERVE_SGLANG_LENGTHS=per-request:
    10-15% slower than one k per batch on a CPU, docs/design.md sec. 13) or one k per batch
    (the default)."""
    mode = os.environ.get(ENV_LENGTHS, "uniform")
    if mode not in ("per-request", "uniform"):
        raise ValueError(f"{ENV_LENGTHS} must be per-request or uniform, got {mode!r}")
    return mode == "per-request" and not os.environ.get(ENV_SWEEP)
