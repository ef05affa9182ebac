"""Prometheus metrics, one CollectorRegistry per server (never the global one).

Latency histograms (TTFT, TPOT, E2E) and request-level SLO misses are observed by the server
per request. Engine counters (tokens, speculation per draft position, chosen verify length,
KV blocks, queue sizes) are read from one engine snapshot taken on the engine thread at
scrape time, so they are mutually consistent.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from sloserve.runtime.engine import Engine

PREFIX = "sloserve"
_LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0,
                    1.5, 2.0, 3.0, 5.0, 10.0, 20.0, 60.0)


@dataclass
class EngineSnapshot:
    """Engine state copied on the engine thread (see `take_snapshot`)."""

    stats: dict = field(default_factory=dict)
    running: int = 0
    waiting: int = 0
    kv_used: int = 0
    kv_free: int = 0
    kv_total: int = 0
    block_size: int = 0


def take_snapshot(engine: Engine) -> EngineSnapshot:
    """Run on the engine thread (AsyncEngine.call)."""
    alloc, sched = engine.scheduler.alloc, engine.scheduler
    return EngineSnapshot(
        stats=engine.stats.snapshot(), running=len(sched.running), waiting=len(sched.waiting),
        kv_used=alloc.num_used, kv_free=alloc.num_free, kv_total=alloc.num_blocks,
        block_size=alloc.block_size,
    )


# (metric suffix, EngineStats key, help)
_COUNTERS = [
    ("prompt_tokens", "prompt_tokens", "Prompt tokens of admitted requests"),
    ("generation_tokens", "generated_tokens", "Generated (output) tokens"),
    ("requests_finished", "requests_finished", "Requests finished (any reason, aborts too)"),
    ("requests_aborted", "requests_aborted", "Requests aborted (client gone or abort_request)"),
    ("engine_steps", "steps", "Engine steps"),
    ("preemptions", "preemptions", "Requests preempted (recompute) for lack of KV blocks"),
    ("spec_proposed_tokens", "proposed", "Draft tokens proposed"),
    ("spec_verified_tokens", "verified", "Draft tokens verified by the target"),
    ("spec_accepted_tokens", "accepted", "Draft tokens accepted"),
    ("spec_verify_steps", "verify_steps", "Request-steps that verified at least one draft token"),
    ("draft_forwards", "draft_forwards", "Draft model forward passes"),
    ("slo_step_misses", "slo_step_misses",
     "Decode steps slower than the tightest TPOT SLO in their batch"),
]


class _EngineCollector(Collector):
    def __init__(self) -> None:
        self.snap = EngineSnapshot()

    def describe(self):
        return list(self._families(EngineSnapshot(stats={})))

    def collect(self):
        return list(self._families(self.snap))

    def _families(self, s: EngineSnapshot):
        for name, key, doc in _COUNTERS:
            c = CounterMetricFamily(f"{PREFIX}_{name}", doc)
            c.add_metric([], float(s.stats.get(key, 0)))
            yield c
        for name, key, doc in [
            ("spec_verified_at_position", "verified_at", "Draft tokens verified, by position"),
            ("spec_accepted_at_position", "accepted_at", "Draft tokens accepted, by position"),
        ]:
            c = CounterMetricFamily(f"{PREFIX}_{name}", doc + " (1 = first draft token)",
                                    labels=["position"])
            for j, v in enumerate(s.stats.get(key, [])):
                c.add_metric([str(j + 1)], float(v))
            yield c
        c = CounterMetricFamily(f"{PREFIX}_spec_draft_length",
                                "Request-steps by chosen verify length k (0 = no speculation)",
                                labels=["k"])
        for k, v in enumerate(s.stats.get("chosen_k", [])):
            c.add_metric([str(k)], float(v))
        yield c
        for name, value, doc in [
            ("num_requests_running", s.running, "Requests running (admitted, holding KV)"),
            ("num_requests_waiting", s.waiting, "Requests waiting for admission"),
            ("kv_blocks_used", s.kv_used, "KV cache blocks in use"),
            ("kv_blocks_free", s.kv_free, "KV cache blocks free"),
            ("kv_blocks_total", s.kv_total, "KV cache blocks in the pool"),
            ("spec_acceptance_rate", s.stats.get("acceptance_rate", 0.0),
             "Accepted / proposed draft tokens since start"),
            ("spec_mean_accepted_length", s.stats.get("mean_accepted_length", 1.0),
             "Tokens per verify step (accepted + 1) since start"),
        ]:
            g = GaugeMetricFamily(f"{PREFIX}_{name}", doc)
            g.add_metric([], float(value))
            yield g


class ServerMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.ttft = Histogram(f"{PREFIX}_time_to_first_token_seconds", "Time to first token",
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.tpot = Histogram(f"{PREFIX}_time_per_output_token_seconds",
                              "Mean time per output token after the first, per request",
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram(f"{PREFIX}_e2e_request_latency_seconds", "End-to-end latency",
                             buckets=_LATENCY_BUCKETS, registry=r)
        self.slo_misses = Counter(f"{PREFIX}_request_slo_misses",
                                  "Finished requests that missed their TTFT or TPOT SLO",
                                  labelnames=["slo"], registry=r)
        for slo in ("ttft", "tpot"):
            self.slo_misses.labels(slo=slo)
        self.rejected_queue_full = Counter(
            f"{PREFIX}_requests_rejected_queue_full",
            "Requests answered 503 because --max-queued-requests requests were waiting",
            registry=r)
        self._engine = _EngineCollector()
        r.register(self._engine)

    def render(self, snap: EngineSnapshot) -> bytes:
        # no await between setting the snapshot and rendering: scrapes cannot interleave
        self._engine.snap = snap
        return generate_latest(self.registry)

    def observe_finished(self, *, ttft: float | None, e2e: float, completion_tokens: int,
                         ttft_slo: float | None, tpot_slo: float | None) -> None:
        self.e2e.observe(e2e)
        if ttft is None:
            return
        if ttft_slo is not None and ttft > ttft_slo:
            self.slo_misses.labels(slo="ttft").inc()
        if completion_tokens > 1:
            tpot = (e2e - ttft) / (completion_tokens - 1)
            self.tpot.observe(tpot)
            if tpot_slo is not None and tpot > tpot_slo:
                self.slo_misses.labels(slo="tpot").inc()
