"""Workload shaping: every transformation between a trace file and what is replayed.

Real traces are too long, too fast and too long-context for a CPU-sized model, so a replay
usually takes a window, stretches time and scales token lengths. All of it is explicit in a
`Scaling` record that travels with the results and is printed in every report.

Order of operations in `apply_scaling` (each step sees the previous step's output):
1. window: keep requests with start_s <= arrival < start_s + duration_s, then shift arrivals
   by -start_s (the gap between the window start and its first request is kept);
2. cap: keep the first max_requests of the window;
3. time: multiply arrival times by time_scale (2.0 = half the request rate);
4. tokens: round(tokens * scale) then clamp to [min, max], for input and output separately.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any

from sloserve.replay.trace import TraceRequest


@dataclass(frozen=True)
class Scaling:
    """The workload transformation applied to a trace (defaults: identity, lengths >= 1)."""

    start_s: float = 0.0  # window start, seconds into the source trace
    duration_s: float | None = None  # window length in source seconds (None: to the end)
    time_scale: float = 1.0  # arrival times multiplied by this (> 1 stretches, lowers rate)
    input_scale: float = 1.0  # prompt lengths multiplied by this, then rounded
    output_scale: float = 1.0  # output lengths multiplied by this, then rounded
    input_min: int = 1
    input_max: int | None = None
    output_min: int = 1  # >= 1: also turns failed (0-token) trace rows into 1-token requests
    output_max: int | None = None
    max_requests: int | None = None  # keep the first N requests of the window
    seed: int = 0  # seeds everything random downstream (prompt choice, synthetic prompts)

    def __post_init__(self) -> None:
        if self.start_s < 0 or (self.duration_s is not None and self.duration_s <= 0):
            raise ValueError("start_s must be >= 0 and duration_s > 0")
        if self.time_scale <= 0 or self.input_scale <= 0 or self.output_scale <= 0:
            raise ValueError("time_scale, input_scale and output_scale must be > 0")
        if self.input_min < 1 or self.output_min < 1:
            raise ValueError("input_min and output_min must be >= 1")
        for low, high, name in ((self.input_min, self.input_max, "input"),
                                (self.output_min, self.output_max, "output")):
            if high is not None and high < low:
                raise ValueError(f"{name}_max must be >= {name}_min")
        if self.max_requests is not None and self.max_requests < 1:
            raise ValueError("max_requests must be >= 1")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def describe(self) -> str:
        """One line for reports, e.g. "window 0s+600s, time x4, input x0.1 [1, 512], ..."."""
        window = f"{self.start_s:g}s+{self.duration_s:g}s" if self.duration_s else (
            f"{self.start_s:g}s+all")
        cap = f"first {self.max_requests}" if self.max_requests is not None else "all"
        return (
            f"window {window}, {cap} requests, time x{self.time_scale:g}, "
            f"input x{self.input_scale:g} {_bounds(self.input_min, self.input_max)}, "
            f"output x{self.output_scale:g} {_bounds(self.output_min, self.output_max)}, "
            f"seed {self.seed}"
        )


def apply_scaling(requests: Sequence[TraceRequest], scaling: Scaling) -> list[TraceRequest]:
    """Apply window, cap, time and token scaling (in that order) to arrival-sorted requests."""
    out = select_window(requests, scaling)
    return [
        replace(
            r,
            arrival_s=r.arrival_s * scaling.time_scale,
            input_tokens=_scale_len(r.input_tokens, scaling.input_scale,
                                    scaling.input_min, scaling.input_max),
            output_tokens=_scale_len(r.output_tokens, scaling.output_scale,
                                     scaling.output_min, scaling.output_max),
        )
        for r in out
    ]


def select_window(requests: Sequence[TraceRequest], scaling: Scaling) -> list[TraceRequest]:
    """Steps 1-2: the window shifted to start at 0, capped to max_requests."""
    end = math.inf if scaling.duration_s is None else scaling.start_s + scaling.duration_s
    out = [
        replace(r, arrival_s=r.arrival_s - scaling.start_s)
        for r in requests
        if scaling.start_s <= r.arrival_s < end
    ]
    return out[: scaling.max_requests] if scaling.max_requests is not None else out


def time_scale_for_rate(requests: Sequence[TraceRequest], scaling: Scaling, rate: float) -> float:
    """The time_scale that makes the windowed, capped trace average `rate` requests/s."""
    window = select_window(requests, scaling)
    if len(window) < 2:
        raise ValueError("need at least two requests in the window to set a rate")
    span = window[-1].arrival_s - window[0].arrival_s
    if span <= 0 or rate <= 0:
        raise ValueError("the window spans no time (or rate <= 0); cannot set a rate")
    return ((len(window) - 1) / span) / rate


def _scale_len(n: int, factor: float, low: int, high: int | None) -> int:
    scaled = math.floor(n * factor + 0.5)  # round half up (Python's round() is half-even)
    scaled = max(low, scaled)
    return min(high, scaled) if high is not None else scaled


def _bounds(low: int, high: int | None) -> str:
    return f"[{low}, {high if high is not None else 'inf'}]"
