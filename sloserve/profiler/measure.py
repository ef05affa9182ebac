"""Profiling runs: time forwards of the engine's own model runners over a grid, fit the cost
model per model, and measure the per-step overhead outside the forwards.

Samples are (N_ctx, N_q, seconds) with N_ctx = KV tokens attended over the batch (context +
query of every request) and N_q = query tokens in the pass, as in docs/design.md sec. 2.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, replace

import numpy as np
import torch

from sloserve.estimator.cost_model import ForwardCost
from sloserve.estimator.profile_file import ModelProfile, Profile
from sloserve.estimator.profile_lookup import device_key, fingerprint
from sloserve.profiler.fit import fit_forward_cost
from sloserve.runtime.batch import Segment
from sloserve.runtime.kv_cache import BlockAllocator
from sloserve.runtime.model_runner import ModelRunner


@dataclass(frozen=True)
class Grid:
    batch_sizes: tuple[int, ...]
    context_lens: tuple[int, ...]
    query_lens: tuple[int, ...]
    reps: int

    def as_dict(self) -> dict:
        return {"batch_sizes": list(self.batch_sizes), "context_lens": list(self.context_lens),
                "query_lens": list(self.query_lens), "reps": [self.reps]}


QUICK = Grid((1, 2, 4, 8, 16, 32), (64, 512), (1, 2, 5, 9), reps=5)
FULL = Grid((1, 2, 4, 8, 16, 32, 64), (32, 256, 1024), tuple(range(1, 10)), reps=7)


def time_forward(runner: ModelRunner, alloc: BlockAllocator, batch: int, ctx: int, q: int) -> float:
    """Seconds of one forward: `batch` requests, each `q` query tokens after `ctx` cached
    tokens. Uses blocks borrowed from the allocator, returned afterwards."""
    need = alloc.blocks_for(ctx + q)
    blocks = [alloc.allocate(need) for _ in range(batch)]
    try:
        segs = [Segment(b, ctx, [7] * q) for b in blocks]
        t = time.perf_counter()
        runner.forward(segs)
        if runner.device.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - t
    finally:
        for b in blocks:
            alloc.free(b)


def grid_points(grid: Grid, alloc: BlockAllocator) -> list[tuple[int, int, int]]:
    """The (batch, context, query) points of the grid that fit the KV pool."""
    return [(b, c, q)
            for b in grid.batch_sizes for c in grid.context_lens for q in grid.query_lens
            if alloc.blocks_for(c + max(grid.query_lens)) * b <= alloc.num_free]


def profile_model(runner: ModelRunner, alloc: BlockAllocator, grid: Grid, log=print,
                  before=None):
    """Time every grid point once per sweep, `grid.reps` sweeps (after one unrecorded), and
    fit the medians. Sweeping instead of repeating one point: a machine whose speed drifts
    over minutes slows every point of a sweep alike instead of bending the fit, and each
    forward follows one of another shape, as engine steps do (caches not warmed by a twin).
    before: called (untimed) before each timed forward; for the draft, a target forward,
    which in the engine runs between draft rounds and evicts the draft's weights from cache."""
    points = grid_points(grid, alloc)
    times: dict[tuple[int, int, int], list[float]] = {p: [] for p in points}
    for sweep in range(grid.reps + 1):
        for p in points:
            if before is not None:
                before()
            t = time_forward(runner, alloc, *p)
            if sweep:
                times[p].append(t)
        if sweep:
            log(f"  {runner.cfg.name}: sweep {sweep}/{grid.reps} done ({len(points)} points)")
    samples = [(b * (c + q), b * q, statistics.median(times[(b, c, q)])) for b, c, q in points]
    return fit_forward_cost(samples), samples


def measure_overhead(engine, cost_target: ForwardCost, batches=(1, 2, 4, 8),
                     steps: int = 16) -> float:
    """Median (engine step time - predicted target forward) over plain decode steps."""
    from sloserve.runtime.request import SamplingParams

    resid = []
    for b in batches:
        for i in range(b):
            engine.add_request([11 + i] * 64, SamplingParams(max_new_tokens=steps + 2, temperature=0.0, ignore_eos=True))
        engine.step()  # prefill
        while engine.has_work:
            live = list(engine.scheduler.running)
            n_ctx = sum(r.num_tokens for r in live)
            t = time.perf_counter()
            engine.step()
            resid.append(time.perf_counter() - t - cost_target.time(n_ctx, len(live)))
    return max(0.0, statistics.median(resid))


def measure_drafting(engine, draft_cost: ForwardCost, k: int = 4, prompts: int = 16,
                     tokens: int = 64) -> tuple[np.ndarray, float]:
    """Greedy decoding of ordinary prompts drafting and verifying k tokens a step, at batch 1,
    prompts / 4 and prompts.
    Returns the [2, n_bins] confidence -> conditional acceptance outcomes of the drafter (each
    verified position up to the first rejection one sample, ConfidenceCalibrator.update),
    which the SpecServe policy starts its online map from, and the median seconds a draft
    round costs in the engine beyond the fitted forward (building segments, picking tokens
    and confidences), which belong in the draft's per-forward cost c."""
    from sloserve.estimator.acceptance import ConfidenceCalibrator
    from sloserve.estimator.step_time import draft_lag, draft_time
    from sloserve.policies.fixed import FixedPolicy
    from sloserve.replay.specbench import ordinary_prompts
    from sloserve.runtime.engine import Engine
    from sloserve.runtime.request import SamplingParams

    calibrator = ConfidenceCalibrator(prior_weight=0.0)
    residuals: list[float] = []

    class Recorder(FixedPolicy):
        def observe(self, plan, outcome) -> None:
            step = plan.step
            calibrator.update(outcome.confidences, outcome.verified, outcome.accepted)
            rounds = int(outcome.drafted.max(initial=0))
            if rounds:
                n = np.asarray(step.context_lens, dtype=np.float64)
                predicted = draft_time(draft_cost, n, draft_lag(step), outcome.drafted)
                residuals.append((outcome.draft_time - predicted) / rounds)

    k = max(1, min(k, engine.cfg.k_max))
    parts = replace(engine.parts, policy=Recorder(k, engine.cfg.k_max))
    eng = Engine(replace(engine.cfg, spec_policy=f"fixed:{k}"), parts=parts)
    texts = [eng.encode(p)[:256] for p in ordinary_prompts(prompts)]
    params = SamplingParams(max_new_tokens=tokens, temperature=0.0, ignore_eos=True)
    for b in sorted({1, max(1, prompts // 4), prompts}):  # small and large draft batches
        eng.generate(texts[:b], params)
    overhead = max(0.0, statistics.median(residuals)) if residuals else 0.0
    return calibrator.counts.copy(), overhead


def build_profile(engine, grid: Grid, mode: str, log=print) -> tuple[Profile, dict]:
    """Profile the engine's target (and draft) runners; returns the profile and raw samples."""
    parts = engine.parts
    alloc = parts.allocator
    if alloc.num_used:
        raise RuntimeError("profile an idle engine")
    log(f"profiling target {parts.target_path} on {device_key(engine.cfg.device)}")
    t_fit, t_samples = profile_model(parts.target, alloc, grid, log)
    if parts.draft is not None:
        d_fit, d_samples = profile_model(parts.draft, alloc, grid, log,
                                         before=lambda: time_forward(parts.target, alloc, 1, 64, 1))
        draft = ModelProfile(parts.draft_path, fingerprint(parts.draft_path), d_fit.cost, d_fit.stats)
    else:
        d_samples = []
        draft = ModelProfile("ngram", "", ForwardCost.free(), None)
    overhead = measure_overhead(engine, t_fit.cost)
    calibration = None
    if engine.runner.drafter is not None and engine.cfg.k_max > 0:
        counts, round_cost = measure_drafting(engine, draft.cost)
        calibration = tuple(tuple(round(float(x), 3) for x in row) for row in counts)
        log(f"  calibration: {int(counts.sum())} verified draft positions; a draft round "
            f"costs {round_cost * 1e3:.3f} ms beyond its forward (added to the draft's c)")
        if parts.draft is not None:
            c = draft.cost
            draft = replace(draft, cost=ForwardCost(c.a, c.b, c.c + round_cost, c.q0))
    profile = Profile(
        target=ModelProfile(parts.target_path, fingerprint(parts.target_path), t_fit.cost, t_fit.stats),
        draft=draft, device=device_key(engine.cfg.device), dtype=engine.cfg.dtype,
        overhead=overhead, grid=grid.as_dict(), mode=mode, calibration=calibration,
    )
    return profile, {"target": t_samples, "draft": d_samples}
