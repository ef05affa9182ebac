"""The replay target "sim": `python -m sloserve.replay --target sim --profile FILE`.

Returns the same records as the in-process target, with simulated times (seconds since the
run start): send = arrival, one chunk at the end of every step that gave the request tokens.
The engine-side counters (SpecStats) come from the simulator's EngineStats; the time series
is averaged into at most `max_samples` time bins so a trace of hours stays plottable.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np

from sloserve.estimator.cost_model import CostModel
from sloserve.replay.prompts import Prompt
from sloserve.replay.records import ReplayRequest, RequestRecord, SpecStats, StepSample
from sloserve.replay.trace import TraceRequest
from sloserve.runtime.config import EngineConfig
from sloserve.runtime.stats import EngineStats
from sloserve.sim.acceptance import AcceptanceModel, load_acceptance
from sloserve.sim.engine import SimOutcome, SimRequest, Simulator

CHARS_PER_TOKEN = 4.0  # prompt length of a text request without a known token count


def sim_request(r: ReplayRequest) -> SimRequest:
    if r.input_ids is not None:
        n = len(r.input_ids)
    elif r.prompt_tokens is not None:
        n = r.prompt_tokens
    else:  # no tokenizer in the simulator: a rough length
        n = max(1, round(len(r.text or "") / CHARS_PER_TOKEN))
    return SimRequest(r.request_id, r.arrival_s, n, r.max_new_tokens, r.category,
                      r.tpot_slo_s, r.ttft_slo_s)


class LengthOnlySource:
    """Prompt source for the simulator, which needs prompt lengths only: an empty text with
    the trace's input length as its token count (no ids are generated or stored)."""

    def prompt_for(self, request: TraceRequest, rng: np.random.Generator) -> Prompt:
        return Prompt(text="", num_tokens=request.input_tokens)


def workload_key(requests: Sequence[ReplayRequest]) -> int:
    """Identifies a request list across copies (prerun results are looked up by it)."""
    return hash(tuple((r.request_id, r.arrival_s, r.max_new_tokens) for r in requests))


class SimTarget:
    """Replays requests through `Simulator` (one fresh simulator per run). Results computed
    ahead (`store`, by sloserve.sim.pool in worker processes) are returned instead."""

    def __init__(self, cfg: EngineConfig, cost: CostModel, acceptance: AcceptanceModel | None = None,
                 *, seed: int = 0, max_context: int | None = None, max_samples: int = 2000):
        self.cfg = cfg
        self.cost = cost
        self.acceptance = acceptance
        self.seed = seed
        self.max_context = max_context
        self.max_samples = max_samples
        self._stats: SpecStats | None = None
        self.last: Simulator | None = None
        self._stored: dict[int, tuple[list[RequestRecord], SpecStats | None]] = {}

    def store(self, requests: Sequence[ReplayRequest], records: list[RequestRecord],
              stats: SpecStats | None) -> None:
        """Keep the result of a run made elsewhere; the next `run` of `requests` returns it."""
        self._stored[workload_key(requests)] = (records, stats)

    async def run(self, requests: list[ReplayRequest], progress=None) -> list[RequestRecord]:
        stored = self._stored.pop(workload_key(requests), None)
        if stored is None:
            return self.run_sync(requests, progress)
        records, self._stats = stored
        if progress is not None:
            for rec in records:
                progress(rec)
        return records

    def run_sync(self, requests: Sequence[ReplayRequest], progress=None) -> list[RequestRecord]:
        sim = Simulator(self.cfg, self.cost, self.acceptance, seed=self.seed,
                        max_context=self.max_context)
        sreqs = [sim_request(r) for r in requests]
        by_id = {r.request_id: r for r in requests}
        prompt_len = {s.rid: s.prompt_tokens for s in sreqs}
        records: dict[str, RequestRecord] = {}

        def done(out: SimOutcome) -> None:
            rec = to_record(out, by_id[out.rid], prompt_len[out.rid])
            records[out.rid] = rec
            if progress is not None:
                progress(rec)

        outcomes = sim.run(sreqs, on_finish=done)
        self.last = sim
        self._stats = spec_stats(sim.stats, self.max_samples)
        return [records.get(o.rid) or to_record(o, by_id[o.rid], prompt_len[o.rid])
                for o in outcomes]

    def spec_stats(self) -> SpecStats | None:
        return self._stats


def to_record(out: SimOutcome, req: ReplayRequest, prompt_tokens: int) -> RequestRecord:
    n = out.output_tokens
    return RequestRecord(
        request_id=req.request_id, scheduled_s=req.arrival_s, send_s=req.arrival_s,
        end_s=out.end_s, chunk_s=tuple(out.chunk_s), chunk_tokens=tuple(out.chunk_tokens),
        prompt_tokens=prompt_tokens if out.error is None else 0, output_tokens=n,
        success=out.error is None and n > 0, error=out.error, category=req.category,
        ttft_slo_s=req.ttft_slo_s, tpot_slo_s=req.tpot_slo_s,
    )


def spec_stats(s: EngineStats, max_samples: int = 2000) -> SpecStats:
    """SpecStats like the in-process target's, the step history binned by time."""
    return SpecStats(steps=s.steps, verify_steps=s.verify_steps, proposed=s.proposed,
                     verified=s.verified, accepted=s.accepted,
                     controller_time_s=s.policy_time_total,
                     timeseries=binned_series(s.history, max_samples))


def binned_series(history, max_samples: int) -> tuple[StepSample, ...]:
    """Mean batch size / draft / verify length of the steps ending in each of at most
    max_samples equal time bins (empty bins left out); one sample per step if fewer."""
    if not history:
        return ()
    h = np.array([(x.t, x.decodes, x.mean_proposed, x.mean_verified) for x in history])
    if len(h) > max_samples:
        edges = np.linspace(h[0, 0], h[-1, 0], max_samples + 1)
        b = np.clip(np.searchsorted(edges, h[:, 0], side="right") - 1, 0, max_samples - 1)
        counts = np.bincount(b, minlength=max_samples)
        keep = counts > 0
        cols = [np.bincount(b, weights=h[:, c], minlength=max_samples)[keep] / counts[keep]
                for c in range(4)]
        h = np.stack(cols, axis=1)
    return tuple(StepSample(t_s=float(t), batch_size=round(float(bs)), mean_draft_len=float(d),
                            mean_verify_len=float(v)) for t, bs, d, v in h)


def make_sim_target(cfg: EngineConfig, profile: str | Path, acceptance: str | Path | None = None,
                    *, seed: int = 0, max_context: int | None = None) -> SimTarget:
    """The sim target for `cfg` (its policy, k_max, KV size, scheduler) with the cost model of
    the profile file and the acceptance process of `acceptance` (default: the built-in
    pair's calibration)."""
    from sloserve.estimator.profile_file import read_profile

    cost = read_profile(profile).cost_model()
    model = load_acceptance(acceptance) if acceptance else None
    return SimTarget(cfg, cost, model, seed=seed, max_context=max_context)
