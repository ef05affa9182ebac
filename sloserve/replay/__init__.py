"""Trace replay: trace formats, workload shaping, prompts, load generation, metrics, reports.

Pipeline: load_trace / synthetic_trace -> apply_scaling (Scaling) -> build_requests
(PromptSource) -> Target.run (open loop) -> PolicyRun -> summarize_run -> write_report.
CLI: python -m sloserve.replay --help (sloserve/cli/replay.py; its target factory:
cli/targets.py).
"""

from sloserve.replay.formats import FORMATS, detect_format, load_trace, write_native
from sloserve.replay.metrics import (
    RunSummary,
    SloConfig,
    request_metrics,
    summarize_run,
    with_speedups,
)
from sloserve.replay.prompts import (
    Prompt,
    PromptSource,
    SyntheticIdsSource,
    SyntheticTextSource,
    build_requests,
)
from sloserve.replay.records import (
    PolicyRun,
    ReplayRequest,
    RequestRecord,
    SpecStats,
    StepSample,
)
from sloserve.replay.report import Cell, build_report, render_markdown, write_report
from sloserve.replay.shaping import Scaling, apply_scaling, time_scale_for_rate
from sloserve.replay.specbench import SpecBenchSource, load_spec_bench
from sloserve.replay.synthetic import gamma_arrivals, parse_length_dist, poisson_arrivals
from sloserve.replay.targets import Target
from sloserve.replay.trace import TraceFormatError, TraceRequest, describe

__all__ = [
    "FORMATS",
    "Cell",
    "PolicyRun",
    "Prompt",
    "PromptSource",
    "ReplayRequest",
    "RequestRecord",
    "RunSummary",
    "Scaling",
    "SloConfig",
    "SpecBenchSource",
    "SpecStats",
    "StepSample",
    "SyntheticIdsSource",
    "SyntheticTextSource",
    "Target",
    "TraceFormatError",
    "TraceRequest",
    "apply_scaling",
    "build_report",
    "build_requests",
    "describe",
    "detect_format",
    "gamma_arrivals",
    "load_spec_bench",
    "load_trace",
    "parse_length_dist",
    "poisson_arrivals",
    "render_markdown",
    "request_metrics",
    "summarize_run",
    "time_scale_for_rate",
    "with_speedups",
    "write_native",
    "write_report",
]
