"""The trace request: what a workload trace says about one request, independent of its format.

Every loader (formats.py) and generator (synthetic.py) produces a list of `TraceRequest`
sorted by arrival time; shaping (shaping.py) transforms such lists; prompt sources
(prompts.py) turn them into `ReplayRequest`s a target can send.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path


class TraceFormatError(ValueError):
    """A trace file is malformed. The message names the file, the line and the problem."""

    def __init__(self, path: str | Path, line: int | None, problem: str):
        self.path = str(path)
        self.line = line
        self.problem = problem
        where = f"{self.path}:{line}" if line is not None else self.path
        super().__init__(f"{where}: {problem}")


@dataclass(frozen=True)
class TraceRequest:
    """One request of a workload trace.

    arrival_s: seconds since the start of the trace (>= 0).
    input_tokens / output_tokens: prompt length and generated length in the trace's tokens.
    category: a task label (Spec-Bench category, BurstGPT model) or None.
    prefix_hash_ids: Mooncake's 512-token prefix block ids (shared prefixes), or None.
    ttft_slo_s / tpot_slo_s: optional per-request SLOs in seconds (native format only).
    """

    arrival_s: float
    input_tokens: int
    output_tokens: int
    category: str | None = None
    prefix_hash_ids: tuple[int, ...] | None = None
    ttft_slo_s: float | None = None
    tpot_slo_s: float | None = None

    def __post_init__(self) -> None:
        if not math.isfinite(self.arrival_s) or self.arrival_s < 0:
            raise ValueError(f"arrival_s must be finite and >= 0, got {self.arrival_s}")
        if self.input_tokens < 0 or self.output_tokens < 0:
            raise ValueError(
                f"token counts must be >= 0, got input={self.input_tokens} "
                f"output={self.output_tokens}"
            )


def sort_by_arrival(requests: Sequence[TraceRequest]) -> list[TraceRequest]:
    """Stable sort by arrival time (ties keep file order)."""
    return sorted(requests, key=lambda r: r.arrival_s)


def describe(requests: Sequence[TraceRequest]) -> dict[str, float | int | None]:
    """Summary statistics of a trace (what the report prints before and after shaping)."""
    n = len(requests)
    if n == 0:
        return {"num_requests": 0}
    span = requests[-1].arrival_s - requests[0].arrival_s
    inputs = sorted(r.input_tokens for r in requests)
    outputs = sorted(r.output_tokens for r in requests)
    return {
        "num_requests": n,
        "span_s": span,
        "rate_rps": (n - 1) / span if span > 0 else None,
        "mean_input_tokens": sum(inputs) / n,
        "median_input_tokens": inputs[n // 2],
        "max_input_tokens": inputs[-1],
        "mean_output_tokens": sum(outputs) / n,
        "median_output_tokens": outputs[n // 2],
        "max_output_tokens": outputs[-1],
    }
