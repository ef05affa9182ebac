"""The in-process target: replays requests against the sloserve engine in this process.

Open loop like the HTTP target: each request is submitted at its arrival time whatever is
still running; outputs are timed when the streaming interface hands them over (the client's
side). The model pair is loaded once and shared by every policy's engine (policies run one
after another, so they never share the machine).
"""

from __future__ import annotations

import asyncio
import dataclasses
import time

from sloserve.replay.records import ReplayRequest, RequestRecord, SpecStats, StepSample
from sloserve.runtime.async_engine import AsyncEngine
from sloserve.runtime.config import EngineConfig
from sloserve.runtime.engine import Engine
from sloserve.runtime.engine_setup import EngineParts, build_parts
from sloserve.runtime.request import SamplingParams
from sloserve.runtime.stats import EngineStats

_PARTS: dict[EngineConfig, EngineParts] = {}


def shared_parts(cfg: EngineConfig) -> EngineParts:
    """Models loaded once per (config without policy); each policy gets a fresh policy object."""
    from sloserve.policies.registry import make_policy
    from sloserve.runtime.config import resolve

    key = resolve(dataclasses.replace(cfg, spec_policy="ar"))
    if key not in _PARTS:
        _PARTS[key] = build_parts(dataclasses.replace(key, spec_policy="fixed:1"))
    parts = _PARTS[key]
    drafter = "ngram" if cfg.drafter == "ngram" else "model"
    policy = make_policy(cfg.spec_policy if cfg.drafter != "none" else "ar", parts.cost,
                         k_max=cfg.k_max, drafter=drafter, calibration=parts.calibration)
    return dataclasses.replace(parts, policy=policy)


class InProcessTarget:
    def __init__(self, cfg: EngineConfig, temperature: float = 0.0, timeout_s: float | None = None):
        self.cfg = cfg
        self.temperature = temperature
        self.timeout_s = timeout_s
        self._stats: SpecStats | None = None

    async def run(self, requests: list[ReplayRequest], progress=None) -> list[RequestRecord]:
        engine = Engine(self.cfg, parts=shared_parts(self.cfg))
        engine.stats = engine.runner.stats = EngineStats(k_max=engine.cfg.k_max)
        aeng = AsyncEngine(engine)
        t0, wall0 = time.perf_counter(), time.time()
        try:
            tasks = [asyncio.create_task(self._one(aeng, r, t0, progress)) for r in requests]
            records = await asyncio.gather(*tasks)
        finally:
            aeng.shutdown()
        self._stats = _spec_stats(engine.stats, wall0)
        return list(records)

    async def _one(self, aeng: AsyncEngine, req: ReplayRequest, t0: float, progress) -> RequestRecord:
        await asyncio.sleep(max(0.0, req.arrival_s - (time.perf_counter() - t0)))
        params = SamplingParams(
            max_new_tokens=req.max_new_tokens, temperature=self.temperature,
            ignore_eos=req.ignore_eos, tpot_slo=req.tpot_slo_s, ttft_slo=req.ttft_slo_s,
        )
        send = time.perf_counter() - t0
        chunk_s: list[float] = []
        chunk_tokens: list[int] = []
        prompt_tokens = 0

        async def consume() -> None:
            nonlocal prompt_tokens
            prompt = req.text if req.text is not None else list(req.input_ids or ())
            async for out in aeng.generate(prompt, params):
                prompt_tokens = out.prompt_tokens
                if out.new_token_ids:
                    chunk_s.append(time.perf_counter() - t0)
                    chunk_tokens.append((chunk_tokens[-1] if chunk_tokens else 0) + len(out.new_token_ids))

        error = None
        try:
            await asyncio.wait_for(consume(), self.timeout_s)
        except Exception as e:  # a failed request is recorded, never raised
            error = f"{type(e).__name__}: {e}"
        n = chunk_tokens[-1] if chunk_tokens else 0
        rec = RequestRecord(
            request_id=req.request_id, scheduled_s=req.arrival_s, send_s=send,
            end_s=time.perf_counter() - t0, chunk_s=tuple(chunk_s), chunk_tokens=tuple(chunk_tokens),
            prompt_tokens=prompt_tokens, output_tokens=n, success=error is None and n > 0,
            error=error, category=req.category, ttft_slo_s=req.ttft_slo_s, tpot_slo_s=req.tpot_slo_s,
        )
        if progress is not None:
            progress(rec)
        return rec

    def spec_stats(self) -> SpecStats | None:
        return self._stats


def _spec_stats(s: EngineStats, wall0: float) -> SpecStats:
    series = tuple(
        StepSample(t_s=h.t - wall0, batch_size=h.decodes, mean_draft_len=h.mean_proposed,
                   mean_verify_len=h.mean_verified)
        for h in s.history
    )
    return SpecStats(steps=s.steps, verify_steps=s.verify_steps, proposed=s.proposed,
                     verified=s.verified, accepted=s.accepted,
                     controller_time_s=s.policy_time_total, timeseries=series)
