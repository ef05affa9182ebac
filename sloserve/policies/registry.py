"""Build a speculation policy from its spec string (`--spec-policy` and the bench harness).

Specs (a name, optionally ':' and an argument):

    ar                  no speculation
    fixed:K             draft and verify K tokens per request (1 <= K <= k_max)
    hf-heuristic[:K0]   HF num_assistant_tokens_schedule="heuristic", start K0 (default 5)
    hf-threshold[:T]    HF assistant_confidence_threshold, T default 0.4
    goodput             SmartSpec / TurboSpec goodput argmax
    lut[:B=K,...]       batch-size lookup table; without a table, derived from the cost model
    sglang-adaptive     SGLang EMA of accepted length with hysteresis, per batch-size range
    specserve-drafter   SpecServe adaptive drafter only (verifies all drafted)
    specserve           SpecServe adaptive drafter + confidence-prior verifier
    specserve-slo       SpecServe held to per-request TPOT budgets (SLO + slack), not the
                        batch's tightest SLO (policies/specserve/slo_policy.py)
    adaserve[:D]        AdaServe's SLO-customized selection over chains of at most D tokens
                        (default 4), as deep as the verify budget per request reaches

`drafter` is the draft source: "model" (a draft LLM) or "ngram" (prompt lookup; pass a
cost model whose draft forward is ~free, e.g. ForwardCost.free()). It changes the goodput
baseline to TurboSpec's n-gram mode (propose k_max, choose the verification length).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextvars import ContextVar

from sloserve.estimator.cost_model import CostModel
from sloserve.policies.adaserve import AdaServePolicy
from sloserve.policies.ar import ARPolicy
from sloserve.policies.fixed import FixedPolicy
from sloserve.policies.goodput import GoodputPolicy
from sloserve.policies.hf import HFHeuristicPolicy, HFThresholdPolicy
from sloserve.policies.lut import LookupTablePolicy, default_table, parse_table
from sloserve.policies.sglang_adaptive import SGLangAdaptivePolicy
from sloserve.policies.specserve import SpecServePolicy
from sloserve.policies.specserve.options import parse_options
from sloserve.policies.specserve.slo_policy import SloSpecServePolicy
from sloserve.spec_config import SpeculationConfig
from sloserve.speculation import SpecPolicy

# the baseline set of docs/design.md sec. 10; every entry is a valid spec
POLICY_NAMES: list[str] = [
    "ar",
    "fixed:1",
    "fixed:3",
    "fixed:5",
    "hf-heuristic",
    "hf-threshold",
    "goodput",
    "lut",
    "sglang-adaptive",
    "specserve-drafter",
    "specserve",
    "specserve-slo",
    "adaserve",
]
SPEC_GRAMMAR = (
    "ar, fixed:K, hf-heuristic[:K0], hf-threshold[:T], goodput, lut[:B=K,...], "
    "sglang-adaptive, specserve-drafter, specserve, specserve-slo, adaserve[:D]"
)
DRAFTERS = ("model", "ngram")

Builder = Callable[[str | None, CostModel, int, str], SpecPolicy]


def _no_arg(name: str, arg: str | None) -> None:
    if arg is not None:
        raise ValueError(f"policy {name!r} takes no argument, got {name}:{arg}")


def _ar(arg: str | None, cost: CostModel, k_max: int, drafter: str) -> SpecPolicy:
    _no_arg("ar", arg)
    return ARPolicy()


def _fixed(arg: str | None, cost: CostModel, k_max: int, drafter: str) -> SpecPolicy:
    if arg is None:
        raise ValueError("policy 'fixed' needs a length: fixed:K")
    return FixedPolicy(int(arg), k_max)


def _hf_heuristic(arg: str | None, cost: CostModel, k_max: int, drafter: str) -> SpecPolicy:
    return HFHeuristicPolicy(k_max) if arg is None else HFHeuristicPolicy(k_max, int(arg))


def _hf_threshold(arg: str | None, cost: CostModel, k_max: int, drafter: str) -> SpecPolicy:
    return HFThresholdPolicy(k_max) if arg is None else HFThresholdPolicy(k_max, float(arg))


def _goodput(arg: str | None, cost: CostModel, k_max: int, drafter: str) -> SpecPolicy:
    _no_arg("goodput", arg)
    return GoodputPolicy(cost, k_max, drafter=drafter)


def _lut(arg: str | None, cost: CostModel, k_max: int, drafter: str) -> SpecPolicy:
    table = default_table(cost, k_max) if arg is None else parse_table(arg)
    return LookupTablePolicy(table, k_max)


def _sglang(arg: str | None, cost: CostModel, k_max: int, drafter: str) -> SpecPolicy:
    _no_arg("sglang-adaptive", arg)
    return SGLangAdaptivePolicy(k_max)


def _specserve(verifier: bool) -> Builder:
    def build(arg: str | None, cost: CostModel, k_max: int, drafter: str) -> SpecPolicy:
        _no_arg("specserve" if verifier else "specserve-drafter", arg)
        return SpecServePolicy(cost, k_max, verifier=verifier,
                               options=parse_options(_OPTIONS.get()))

    return build


def _specserve_slo(arg: str | None, cost: CostModel, k_max: int, drafter: str) -> SpecPolicy:
    _no_arg("specserve-slo", arg)
    return SloSpecServePolicy(cost, k_max, options=parse_options(_OPTIONS.get()))


# the options of the policy being built (make_policy's `options`; only the SpecServe family
# takes any)
_OPTIONS: ContextVar[tuple[tuple[str, str], ...]] = ContextVar("policy_options", default=())
_TAKES_OPTIONS = ("specserve", "specserve-drafter", "specserve-slo")


def takes_options(spec: str) -> bool:
    """Whether the policy `spec` names takes options (the SpecServe family)."""
    return spec.strip().partition(":")[0] in _TAKES_OPTIONS


def _adaserve(arg: str | None, cost: CostModel, k_max: int, drafter: str) -> SpecPolicy:
    return AdaServePolicy(cost, k_max) if arg is None else AdaServePolicy(cost, k_max,
                                                                          depth=int(arg))


_BUILDERS: dict[str, Builder] = {
    "ar": _ar,
    "fixed": _fixed,
    "hf-heuristic": _hf_heuristic,
    "hf-threshold": _hf_threshold,
    "goodput": _goodput,
    "lut": _lut,
    "sglang-adaptive": _sglang,
    "specserve-drafter": _specserve(False),
    "specserve": _specserve(True),
    "specserve-slo": _specserve_slo,
    "adaserve": _adaserve,
}


def make_policy(spec: str, cost: CostModel, *, k_max: int, drafter: str = "model",
                calibration=None, options: Sequence[tuple[str, str]] = ()) -> SpecPolicy:
    """The policy named by `spec` (see the module docstring). Raises ValueError naming the
    valid choices on an unknown or malformed spec, k_max < 0 or an unknown drafter.
    calibration: the pair's offline confidence -> acceptance counts ([2, n_bins], from the
    profile); policies that learn a calibration map start from it. options: (name, value)
    pairs of the policy's options (SpecServeOptions fields for the SpecServe family)."""
    if drafter not in DRAFTERS:
        raise ValueError(f"unknown drafter {drafter!r}; valid: {', '.join(DRAFTERS)}")
    if k_max < 0:
        raise ValueError(f"k_max must be >= 0, got {k_max}")
    name, sep, arg = spec.strip().partition(":")
    builder = _BUILDERS.get(name)
    if builder is None or (sep and not arg):
        raise ValueError(f"unknown speculation policy {spec!r}; valid: {SPEC_GRAMMAR}")
    if options and not takes_options(name):
        raise ValueError(f"policy {name!r} takes no options (only {', '.join(_TAKES_OPTIONS)})")
    token = _OPTIONS.set(tuple(options))
    try:
        policy = builder(arg if sep else None, cost, k_max, drafter)
    except ValueError as err:
        raise ValueError(f"bad speculation policy {spec!r}: {err}; valid: {SPEC_GRAMMAR}") from err
    finally:
        _OPTIONS.reset(token)
    if calibration is not None and isinstance(policy, SpecServePolicy | AdaServePolicy):
        policy.seed_calibration(calibration)
    return policy


class SpeculationSettingError(ValueError):
    """A SpeculationConfig the registry cannot build; `setting` is the field at fault
    ("policy" or "options"), so a command line names its own option."""

    def __init__(self, setting: str, message: str):
        super().__init__(message)
        self.setting = setting


def check_speculation(spec: SpeculationConfig, drafter: str = "model") -> None:
    """Raise SpeculationSettingError unless `spec` builds a policy (both command lines call
    this before any model loads): first the policy and k_max alone, then with its options."""
    if spec.policy == "ar":
        if spec.options:
            raise SpeculationSettingError("options", "policy 'ar' takes no options")
        return
    from sloserve.estimator.cost_model import ForwardCost

    free = ForwardCost.free()
    try:
        make_policy(spec.policy, CostModel(free, free), k_max=spec.k_max, drafter=drafter)
    except ValueError as e:
        raise SpeculationSettingError("policy", str(e)) from e
    try:
        make_policy(spec.policy, CostModel(free, free), k_max=spec.k_max, drafter=drafter,
                    options=spec.options)
    except ValueError as e:
        raise SpeculationSettingError("options", str(e)) from e
