"""The speculation configuration both engines share: one frozen value, parsed once.

The built-in engine's EngineConfig takes its defaults from here, and `python -m
sloserve.launch --engine sglang` hands the same value to SGLang's processes serialised as
one JSON string (sglang_ext/settings.py), so a policy, its k_max, its default SLOs and
its options mean the same in both engines.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from typing import Any

K_MAX_LIMIT = 32


@dataclass(frozen=True)
class SpeculationConfig:
    policy: str = "specserve-slo"  # a spec of sloserve.policies.registry (or "ar")
    k_max: int = 8  # most draft tokens per request per step
    tpot_slo: float | None = None  # seconds; default TPOT SLO of requests without their own
    ttft_slo: float | None = None  # seconds; default TTFT SLO, likewise
    # the policy's options as (name, value) text pairs, e.g. (("uniform_margin", "0"),):
    # fields of SpecServeOptions (policies/specserve/options.py) for the SpecServe family
    options: tuple[tuple[str, str], ...] = ()

    def __post_init__(self) -> None:
        if not 0 <= self.k_max <= K_MAX_LIMIT:
            raise ValueError(f"k_max must be in [0, {K_MAX_LIMIT}], got {self.k_max}")
        for name in ("tpot_slo", "ttft_slo"):
            v = getattr(self, name)
            if v is not None and not 0.0 < v < math.inf:
                raise ValueError(f"{name} must be a positive number of seconds, got {v!r}")

    @staticmethod
    def parse_options(text: str) -> tuple[tuple[str, str], ...]:
        """'name=value,name=value' as option pairs (typed and checked by the policy)."""
        out = []
        for item in filter(None, (x.strip() for x in text.split(","))):
            name, sep, value = (x.strip() for x in item.partition("="))
            if not sep or not name:
                raise ValueError(f"policy options: expected name=value, got {item!r}")
            out.append((name, value))
        return tuple(out)

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), sort_keys=True)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> SpeculationConfig:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = set(d) - known
        if unknown:
            raise ValueError(f"unknown speculation settings: {', '.join(sorted(unknown))}")
        d = dict(d)
        d["options"] = tuple((str(n), str(v)) for n, v in d.get("options", ()))
        return cls(**d)


DEFAULTS = SpeculationConfig()
