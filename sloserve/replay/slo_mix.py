"""Multi-SLO workloads: every request draws an SLO class, carried as its own TTFT and TPOT SLO.

A mix is a list of classes, each a name, a TPOT and a TTFT multiplier of the base SLOs and a
weight, written "name:tpot_x:ttft_x[:weight],...", e.g. the default

    tight:0.5:0.5,base:1:1,loose:2:2

(a coding assistant next to a chat and a batch job, drawn with equal weight). The class of a
request travels as its per-request SLOs (TraceRequest.ttft_slo_s / tpot_slo_s, then the
`tpot_slo` / `ttft_slo` sampling parameters of the API); reports group requests by class
through `classes_by_request`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np

from sloserve.replay.trace import TraceRequest

DEFAULT_MIX = "tight:0.5:0.5,base:1:1,loose:2:2"


@dataclass(frozen=True)
class SloClass:
    name: str
    tpot_x: float  # multiplier of the base TPOT SLO
    ttft_x: float  # multiplier of the base TTFT SLO
    weight: float = 1.0

    def __post_init__(self) -> None:
        if not self.name or self.tpot_x <= 0 or self.ttft_x <= 0 or self.weight <= 0:
            raise ValueError(f"bad SLO class {self}: name, multipliers and weight must be set "
                             "and > 0")


def parse_mix(spec: str) -> tuple[SloClass, ...]:
    """Parse "name:tpot_x:ttft_x[:weight],..." (see the module docstring)."""
    classes = []
    for part in spec.split(","):
        fields = part.strip().split(":")
        try:
            if len(fields) not in (3, 4):
                raise ValueError
            weight = float(fields[3]) if len(fields) == 4 else 1.0
            classes.append(SloClass(fields[0], float(fields[1]), float(fields[2]), weight))
        except ValueError as e:
            raise ValueError(f"bad SLO mix {spec!r} at {part!r}: expected "
                             f"name:tpot_x:ttft_x[:weight] ({e})") from None
    if len({c.name for c in classes}) != len(classes):
        raise ValueError(f"bad SLO mix {spec!r}: class names repeat")
    return tuple(classes)


def assign_classes(trace: Sequence[TraceRequest], mix: Sequence[SloClass], tpot_s: float,
                   ttft_s: float, rng: np.random.Generator) -> tuple[list[TraceRequest],
                                                                     list[str]]:
    """Every request draws a class (by weight); returns the trace with each request's own
    SLOs (base x the class's multipliers) and the class names in trace order."""
    w = np.array([c.weight for c in mix], dtype=np.float64)
    draws = rng.choice(len(mix), size=len(trace), p=w / w.sum())
    out, names = [], []
    for req, i in zip(trace, draws.tolist()):
        c = mix[i]
        out.append(replace(req, tpot_slo_s=tpot_s * c.tpot_x, ttft_slo_s=ttft_s * c.ttft_x))
        names.append(c.name)
    return out, names
