"""From a trace to the workloads of a replay: one per load level, each fully explicit."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from sloserve.replay.prompts import PromptSource, build_requests
from sloserve.replay.records import ReplayRequest
from sloserve.replay.shaping import Scaling, apply_scaling, time_scale_for_rate
from sloserve.replay.trace import TraceRequest, describe


@dataclass(frozen=True)
class Workload:
    """One (trace, load) cell's input: the shaped trace and the requests to send."""

    trace_name: str
    load: str  # label, e.g. "rate=2/s" or "time x4"
    scaling: Scaling
    trace: tuple[TraceRequest, ...]
    requests: tuple[ReplayRequest, ...]

    def summary(self) -> dict[str, float | int | None]:
        return describe(self.trace)


def load_levels(
    trace: Sequence[TraceRequest],
    base: Scaling,
    *,
    time_scales: Sequence[float] = (),
    target_rates: Sequence[float] = (),
) -> list[tuple[str, Scaling]]:
    """(label, Scaling) per load level: explicit time scales, or the time scale that gives
    each target rate (computed on the windowed, capped trace). Neither: the base scaling."""
    if time_scales and target_rates:
        raise ValueError("give time scales or target rates, not both")
    if target_rates:
        return [(f"rate={r:g}/s", replace(base, time_scale=time_scale_for_rate(trace, base, r)))
                for r in target_rates]
    if time_scales:
        return [(f"time x{t:g}", replace(base, time_scale=t)) for t in time_scales]
    return [(f"time x{base.time_scale:g}", base)]


def make_workload(
    trace_name: str,
    trace: Sequence[TraceRequest],
    load: str,
    scaling: Scaling,
    source: PromptSource,
    ignore_eos: bool = True,
) -> Workload:
    """Shape the trace and give every request a prompt (seeded by scaling.seed)."""
    shaped = apply_scaling(trace, scaling)
    requests = build_requests(shaped, source, scaling.seed, ignore_eos=ignore_eos)
    return Workload(trace_name, load, scaling, tuple(shaped), tuple(requests))
