"""Serving metrics (docs/design.md sec. 11), matching `vllm bench serve` / SGLang bench_serving.

Per request (successful requests only; times from the client's send time):
- TTFT = first token chunk - send.
- E2E = last token chunk - send (vLLM's "latency").
- TPOT = (E2E - TTFT) / (output_tokens - 1); undefined for 1-token outputs, which are left
  out of the TPOT distribution and count as meeting any TPOT SLO (vLLM's goodput rule).
- ITL = gaps between consecutive token chunks, one value per chunk as vLLM does. A chunk may
  carry several tokens (speculative decoding emits accepted + 1 tokens per step, servers may
  batch stream output), so ITL is per chunk, not per token: with speculation, mean ITL
  grows while TPOT falls. mean_tokens_per_chunk is reported alongside to read it.

Per run: mean / median / p90 / p99 of each (np.percentile, linear interpolation), in ms.
SLO attainment at scale s = share of all sent requests (failures count as misses) with
TTFT <= s * TTFT_SLO and TPOT <= s * TPOT_SLO (per-request SLOs override the defaults).
Goodput = requests meeting both SLOs (at scale 1) / benchmark duration, where the duration
runs from the run start (t = 0, when arrival 0 is due) to the last response end.
Speedup = mean E2E of the "ar" policy / mean E2E of the policy (same trace and load).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np

from sloserve.replay.records import PolicyRun, RequestRecord, SpecStats

DEFAULT_SLO_SCALES = (0.8, 0.9, 1.0, 1.1, 1.2, 1.3, 1.4)


@dataclass(frozen=True)
class SloConfig:
    """Default per-request SLOs (seconds) and the scales attainment is reported at."""

    ttft_s: float = 0.200
    tpot_s: float = 0.030
    scales: tuple[float, ...] = DEFAULT_SLO_SCALES


@dataclass(frozen=True)
class RequestMetrics:
    """Latencies of one request in seconds (None where undefined)."""

    request_id: str
    success: bool
    ttft_s: float | None
    tpot_s: float | None  # None when failed or output_tokens <= 1
    e2e_s: float | None
    itls_s: tuple[float, ...]
    prompt_tokens: int
    output_tokens: int
    num_chunks: int
    ttft_slo_s: float  # the SLOs that apply (per-request, else the run default)
    tpot_slo_s: float

    def meets(self, scale: float = 1.0) -> tuple[bool, bool]:
        """(TTFT met, TPOT met) with both SLOs multiplied by `scale`."""
        if not self.success or self.ttft_s is None:
            return False, False
        ttft_ok = self.ttft_s <= scale * self.ttft_slo_s
        tpot_ok = self.tpot_s is None or self.tpot_s <= scale * self.tpot_slo_s
        return ttft_ok, tpot_ok


def request_metrics(record: RequestRecord, slo: SloConfig, itls: bool = True) -> RequestMetrics:
    """Derive the per-request metrics of one record (itls=False leaves itls_s empty: the
    inter-chunk gaps are most of the work for long outputs)."""
    ttft = tpot = e2e = None
    gaps: tuple[float, ...] = ()
    if record.success:
        ttft = record.chunk_s[0] - record.send_s
        e2e = record.chunk_s[-1] - record.send_s
        if record.output_tokens > 1:
            tpot = (e2e - ttft) / (record.output_tokens - 1)
        if itls:
            gaps = tuple(b - a for a, b in zip(record.chunk_s, record.chunk_s[1:]))
    return RequestMetrics(
        request_id=record.request_id, success=record.success, ttft_s=ttft, tpot_s=tpot,
        e2e_s=e2e, itls_s=gaps, prompt_tokens=record.prompt_tokens,
        output_tokens=record.output_tokens if record.success else 0,
        num_chunks=len(record.chunk_s),
        ttft_slo_s=record.ttft_slo_s if record.ttft_slo_s is not None else slo.ttft_s,
        tpot_slo_s=record.tpot_slo_s if record.tpot_slo_s is not None else slo.tpot_s,
    )


@dataclass(frozen=True)
class Distribution:
    """Summary of a latency sample, in milliseconds (None when the sample is empty)."""

    count: int
    mean: float | None
    median: float | None
    p90: float | None
    p99: float | None

    @staticmethod
    def of(values_s: Sequence[float] | np.ndarray) -> Distribution:
        if len(values_s) == 0:
            return Distribution(0, None, None, None, None)
        ms = np.asarray(values_s, dtype=np.float64) * 1000.0
        p50, p90, p99 = np.percentile(ms, [50, 90, 99])
        return Distribution(len(ms), float(ms.mean()), float(p50), float(p90), float(p99))


@dataclass(frozen=True)
class SloPoint:
    """SLO attainment (fractions of all requests) and goodput at one SLO scale."""

    scale: float
    ttft: float
    tpot: float
    both: float
    goodput_rps: float


@dataclass(frozen=True)
class SpecSummary:
    """Engine-side speculation statistics (None where a denominator is 0)."""

    acceptance_rate: float | None  # accepted / proposed
    mean_accepted_len: float | None  # 1 + accepted / verify_steps
    mean_proposed_k: float | None  # proposed / verify_steps
    mean_verified_k: float | None  # verified / verify_steps
    controller_ms_per_step: float | None
    steps: int
    verify_steps: int


@dataclass(frozen=True)
class RunSummary:
    """Everything the report shows for one (trace, load, policy) run."""

    policy: str
    num_requests: int
    completed: int
    failed: int
    duration_s: float
    request_throughput_rps: float
    output_throughput_tps: float
    total_input_tokens: int
    total_output_tokens: int
    mean_tokens_per_chunk: float | None
    max_send_lag_ms: float  # worst lateness of a send vs its arrival (client overload check)
    ttft_ms: Distribution
    tpot_ms: Distribution
    itl_ms: Distribution
    e2e_ms: Distribution
    slo_attainment: float  # both SLOs at scale 1
    goodput_rps: float  # both SLOs at scale 1
    slo_curve: tuple[SloPoint, ...]
    spec: SpecSummary | None = None
    speedup: float | None = None  # filled by `with_speedups`


def summarize_run(run: PolicyRun, slo: SloConfig,
                  per_req: Sequence[RequestMetrics] | None = None) -> RunSummary:
    """Aggregate the records (and engine stats) of one run. per_req: the records'
    request_metrics when the caller already has them (itls_s is not used)."""
    if per_req is None:
        per_req = [request_metrics(r, slo, itls=False) for r in run.records]
    ok = [m for m in per_req if m.success]
    # inter-chunk gaps of every successful request, without a Python float per gap
    gaps = [np.diff(r.chunk_s) for r in run.records if r.success and len(r.chunk_s) > 1]
    itl_s = np.concatenate(gaps) if gaps else np.zeros(0)
    duration = max((r.end_s for r in run.records), default=0.0)

    def rate(n: float) -> float:
        return n / duration if duration > 0 else 0.0

    chunks = sum(m.num_chunks for m in ok)
    out_tokens = sum(m.output_tokens for m in ok)
    return RunSummary(
        policy=run.policy,
        num_requests=len(per_req),
        completed=len(ok),
        failed=len(per_req) - len(ok),
        duration_s=duration,
        request_throughput_rps=rate(len(ok)),
        output_throughput_tps=rate(out_tokens),
        total_input_tokens=sum(m.prompt_tokens for m in ok),
        total_output_tokens=out_tokens,
        mean_tokens_per_chunk=out_tokens / chunks if chunks else None,
        max_send_lag_ms=1000.0 * max((r.send_s - r.scheduled_s for r in run.records),
                                     default=0.0),
        ttft_ms=Distribution.of([m.ttft_s for m in ok if m.ttft_s is not None]),
        tpot_ms=Distribution.of([m.tpot_s for m in ok if m.tpot_s is not None]),
        itl_ms=Distribution.of(itl_s),
        e2e_ms=Distribution.of([m.e2e_s for m in ok if m.e2e_s is not None]),
        slo_attainment=slo_point(per_req, 1.0, duration).both,
        goodput_rps=slo_point(per_req, 1.0, duration).goodput_rps,
        slo_curve=tuple(slo_point(per_req, s, duration) for s in slo.scales),
        spec=spec_summary(run.spec_stats) if run.spec_stats is not None else None,
    )


def slo_point(per_req: Sequence[RequestMetrics], scale: float, duration_s: float) -> SloPoint:
    """Attainment of the TTFT SLO, the TPOT SLO and both, and goodput, at one SLO scale."""
    n = len(per_req)
    met = [m.meets(scale) for m in per_req]
    both = sum(1 for t, p in met if t and p)
    return SloPoint(
        scale=scale,
        ttft=sum(t for t, _ in met) / n if n else 0.0,
        tpot=sum(p for _, p in met) / n if n else 0.0,
        both=both / n if n else 0.0,
        goodput_rps=both / duration_s if duration_s > 0 else 0.0,
    )


def spec_summary(stats: SpecStats) -> SpecSummary:
    """Acceptance rate, mean accepted length, mean proposed / verified k, controller time."""

    def ratio(a: float, b: float) -> float | None:
        return a / b if b else None

    return SpecSummary(
        acceptance_rate=ratio(stats.accepted, stats.proposed),
        mean_accepted_len=(1.0 + stats.accepted / stats.verify_steps
                           if stats.verify_steps else None),
        mean_proposed_k=ratio(stats.proposed, stats.verify_steps),
        mean_verified_k=ratio(stats.verified, stats.verify_steps),
        controller_ms_per_step=ratio(1000.0 * stats.controller_time_s, stats.steps),
        steps=stats.steps,
        verify_steps=stats.verify_steps,
    )


def with_speedups(summaries: Sequence[RunSummary], baseline: str = "ar") -> list[RunSummary]:
    """Fill `speedup` = baseline mean E2E / policy mean E2E (None without the baseline)."""
    base = next((s for s in summaries if s.policy == baseline), None)
    base_e2e = base.e2e_ms.mean if base is not None else None
    return [
        replace(s, speedup=(base_e2e / s.e2e_ms.mean
                            if base_e2e is not None and s.e2e_ms.mean else None))
        for s in summaries
    ]
