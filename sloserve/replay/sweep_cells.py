"""The workloads of a load sweep: per (load, seed) one request list that every policy replays.

A cell takes `n` consecutive requests of the trace starting at a seed-chosen position (each
seed a different stretch of the trace), scales their token lengths (`Scaling`, recorded in
the report), sets the arrival rate to `load x rate unit` and draws every request's SLO class
(slo_mix.py). Arrivals are the trace's own, time-scaled to the rate, or a Gamma process of
that rate and a given CV (burstier than Poisson for CV > 1). Everything random is seeded by
the cell's seed, so every policy sees the identical request sequence.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np

from sloserve.replay.prompts import PromptSource, build_requests
from sloserve.replay.records import ReplayRequest
from sloserve.replay.shaping import Scaling, apply_scaling
from sloserve.replay.slo_mix import SloClass, assign_classes
from sloserve.replay.synthetic import gamma_arrivals
from sloserve.replay.trace import TraceRequest, describe


@dataclass(frozen=True)
class SweepCell:
    load: float  # multiple of the rate unit
    seed: int
    rate_rps: float
    requests: tuple[ReplayRequest, ...]
    classes: dict[str, str]  # request id -> SLO class name
    summary: dict


def trace_window(trace: Sequence[TraceRequest], n: int, seed: int) -> list[TraceRequest]:
    """n consecutive requests from a seed-chosen start, arrivals shifted to start at 0."""
    if len(trace) < n:
        raise ValueError(f"the trace has {len(trace)} requests; the sweep needs {n} per cell")
    start = int(np.random.default_rng(seed).integers(0, len(trace) - n + 1))
    window = list(trace[start:start + n])
    t0 = window[0].arrival_s
    return [replace(r, arrival_s=r.arrival_s - t0) for r in window]


def make_cell(trace: Sequence[TraceRequest], *, n: int, seed: int, load: float,
              rate_unit: float, lengths: Scaling, arrivals_cv: float | None,
              mix: Sequence[SloClass], tpot_s: float, ttft_s: float,
              source: PromptSource) -> SweepCell:
    """One cell's requests (see the module docstring). arrivals_cv None: the trace's own."""
    window = trace_window(trace, n, seed)
    rate = load * rate_unit
    own = describe(window).get("rate_rps")
    if arrivals_cv is None and not own:
        raise ValueError("the trace window spans no time: pass a Gamma CV for its arrivals")
    time_scale = (own / rate) if arrivals_cv is None and own else 1.0
    shaped = apply_scaling(window, replace(lengths, time_scale=time_scale, seed=seed))
    rng = np.random.default_rng([seed, 1])
    if arrivals_cv is not None:
        times = gamma_arrivals(rate, arrivals_cv, len(shaped), rng)
        shaped = [replace(r, arrival_s=float(t)) for r, t in zip(shaped, times)]
    shaped, names = assign_classes(shaped, mix, tpot_s, ttft_s, rng)
    requests = build_requests(shaped, source, seed)
    classes = {r.request_id: c for r, c in zip(requests, names)}
    return SweepCell(load, seed, rate, tuple(requests), classes, describe(shaped))


def burst(cell: SweepCell) -> tuple[ReplayRequest, ...]:
    """The cell's requests all arriving at once: what `ar`'s capacity is measured on."""
    return tuple(replace(r, arrival_s=0.0) for r in cell.requests)
