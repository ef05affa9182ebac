"""Per-step decision cost of the speculation controller (no engine, no model).

    python -m sloserve.bench.controller [--batches 1,8,32,64] [--k-max 8]
        [--policies specserve,...] [--cost cpu,gpu] [--steps 1000] [--repeat 3]
        [--clock wall|cpu] [--flush MB] [--verify-time]
        [--out out/controller_bench.json]

For each batch size, a fixed batch of requests runs `--steps` decode steps through the
policy in engine call order (start, one extend per draft forward with synthetic Beta
confidences, verify_lengths, observe); only the time inside the policy calls is counted.
The `gpu` cost model (7B target / 68M draft on an H100-class GPU) makes speculation cheap,
so SpecServe drafts long and calls extend up to k_max times: the controller's worst case.
`--cost` also takes a cost profile file (a measured profile's cost model, e.g. one in
~/.cache/sloserve/profiles). `--flush MB` writes over a buffer of that size before each step
(not timed), so that the policy's calls start from cold caches, as in a server, where the
models' forwards run between them. `--verify-time` also reports each step's target forward
seconds apart (the cost model's), as the engines do: the online correction then runs its
three-feature fit where the cost model has a verify path (SGLang's profiles).
Prints a table (median / p90 microseconds per step, and the median of each call kind summed
over the step) and writes JSON. Each configuration runs `--repeat` times and keeps the run
with the lowest median, since a shared machine only ever adds time.
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from dataclasses import asdict
from pathlib import Path

import numpy as np

from sloserve import __version__
from sloserve.bench.synthetic import SyntheticWorkload, cpu_cost_model, make_step
from sloserve.estimator.cost_model import CostModel, ForwardCost
from sloserve.estimator.profile_file import read_profile
from sloserve.estimator.step_time import StepTimer
from sloserve.policies.registry import make_policy
from sloserve.speculation import SpecPolicy, StepInfo, VerifyOutcome


def gpu_cost_model() -> CostModel:
    """A 7B target / 68M draft on one H100-class GPU (fp16): cheap verify tokens."""
    return CostModel(
        target=ForwardCost(a=1.7e-7, b=2.0e-5, c=7e-3),
        draft=ForwardCost(a=3e-9, b=1e-6, c=0.8e-3),
        overhead=0.5e-3,
    )


COST_MODELS = {"cpu": cpu_cost_model, "gpu": gpu_cost_model}
PARTS = ("start", "extend", "verify", "observe")
# wall: perf_counter; cpu: this thread's CPU time, which leaves out the time the thread
# waits for a core while other processes run (a shared 2-core machine)
CLOCKS = {"wall": time.perf_counter, "cpu": time.thread_time}


def clock_pair_cost(clock) -> float:
    """Median seconds one (t0 = clock(); clock() - t0) pair adds to a measurement."""
    pairs = []
    for _ in range(5000):
        t0 = clock()
        pairs.append(clock() - t0)
    return float(np.median(pairs))


def timed_step(
    policy: SpecPolicy, step: StepInfo, conf_all: np.ndarray, work, clock=time.perf_counter,
    cost: CostModel | None = None, verify_time: bool = False,
) -> tuple:
    """One step in engine order. Returns ([plan, extend, verify, observe] policy seconds,
    extend calls, drafted, verified, accepted). The step "measures" the cost model's time of
    the plan (cost; 0 without), so policies that learn from step times do that work too."""
    B, k_max = conf_all.shape
    conf = np.full((B, k_max), np.nan)
    drafted = np.zeros(B, dtype=np.int64)
    spent = [0.0, 0.0, 0.0, 0.0]
    t0 = clock()
    plan = policy.plan(step)
    drafting = plan.drafting
    spent[0] = clock() - t0
    j = 0
    while drafting.any() and j < k_max:
        conf[drafting, j] = conf_all[drafting, j]  # the draft forward (not timed)
        drafted += drafting
        j += 1
        t0 = clock()
        drafting = plan.extend(conf[:, :j], drafting)
        spent[1] += clock() - t0
    s = max(1, j)
    t0 = clock()
    verified = plan.verify_lengths(conf[:, :s], drafted)
    spent[2] = clock() - t0
    accepted = work.accept(conf[:, :s], verified)
    timer = StepTimer(cost, step) if cost is not None else None
    step_time = timer.plan(drafted, verified) if timer is not None else 0.0
    # the target forward's seconds: the step's without its drafting
    target = timer.plan(np.zeros_like(drafted), verified) if timer and verify_time else None
    outcome = VerifyOutcome(drafted, verified, accepted, conf[:, :s], step_time, 0.0,
                            verify_time=target)
    t0 = clock()
    policy.observe(plan, outcome)
    spent[3] = clock() - t0
    return spent, j, int(drafted.sum()), int(verified.sum()), int(accepted.sum())


def bench_one(
    spec: str, cost: CostModel, batch: int, k_max: int, steps: int, seed: int, clock: str = "wall",
    flush_mb: int = 0, verify_time: bool = False,
) -> dict:
    rng = np.random.default_rng(seed)
    # [flush_mb MiB] written over before each step: the caches cold, as after a forward
    flush = np.zeros(flush_mb << 17) if flush_mb > 0 else None
    tick = CLOCKS[clock]
    pair = clock_pair_cost(tick)
    work = SyntheticWorkload(rng)
    policy = make_policy(spec, cost, k_max=k_max)
    mean = rng.uniform(0.3, 0.95, batch)  # per-request predictability
    context = rng.integers(128, 2048, batch)
    warmup = max(50, steps // 5)
    parts, calls, drafted, verified, accepted = [], [], 0, 0, 0
    for i in range(warmup + steps):
        step = make_step(batch, context=context, k_max=k_max, lag=np.zeros(batch, np.int64))
        conf_all = work.confidences(np.repeat(mean[:, None], k_max, axis=1))  # [B, k_max]
        if flush is not None:
            np.add(flush, 1.0, out=flush)
        spent, n_ext, d, v, a = timed_step(policy, step, conf_all, work, tick, cost, verify_time)
        spent[0] -= pair
        spent[1] -= pair * n_ext
        spent[2] -= pair
        spent[3] -= pair
        context = context + 1
        if i >= warmup:
            parts.append(spent)
            calls.append(n_ext)
            drafted, verified, accepted = drafted + d, verified + v, accepted + a
    parts_us = np.array(parts) * 1e6  # [steps, 4]
    us = parts_us.sum(axis=1)
    n = steps * batch
    return {
        "policy": spec,
        "clock": clock,
        "clock_pair_us": pair * 1e6,
        "batch": batch,
        "k_max": k_max,
        "steps": steps,
        "flush_mb": flush_mb,
        "verify_time": verify_time,
        "median_us": float(np.median(us)),
        "p90_us": float(np.percentile(us, 90)),
        "mean_us": float(us.mean()),
        "extend_calls": float(np.mean(calls)),
        "median_parts_us": dict(zip(PARTS, np.median(parts_us, axis=0).round(2).tolist())),
        "drafted_per_req": drafted / n,
        "verified_per_req": verified / n,
        "accepted_per_req": accepted / n,
    }


def _short(cost: str) -> str:
    """A cost model's name for the table: a profile file's first 24 characters."""
    return cost if cost in COST_MODELS else Path(cost).name[:24]


def print_table(rows: list[dict]) -> None:
    head = (
        f"{'policy':18s} {'clock':5s} {'cost':4s} {'B':>4s} {'median us':>10s} {'p90 us':>8s} "
        f"{'extends':>8s} {'drafted':>8s} {'verified':>8s} {'accepted':>8s}   "
        "median us: start / extend (all calls) / verify / observe"
    )
    print(head)
    print("-" * len(head))
    for r in rows:
        print(
            f"{r['policy']:18s} {r['clock']:5s} {_short(r['cost']):4s} {r['batch']:4d} "
            f"{r['median_us']:10.1f} "
            f"{r['p90_us']:8.1f} {r['extend_calls']:8.2f} {r['drafted_per_req']:8.2f} "
            f"{r['verified_per_req']:8.2f} {r['accepted_per_req']:8.2f}   "
            + " / ".join(f"{v:.1f}" for v in r["median_parts_us"].values())
        )


def _cost_model(name: str) -> CostModel | None:
    """A named cost model, or a profile file's; None when it is neither."""
    if name in COST_MODELS:
        return COST_MODELS[name]()
    if Path(name).is_file():
        return read_profile(name).cost_model()
    return None


def _loadavg() -> list[float] | None:
    try:
        return [float(x) for x in Path("/proc/loadavg").read_text().split()[:3]]
    except OSError:
        return None


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n")[0])
    ap.add_argument("--batches", default="1,8,32,64")
    ap.add_argument("--k-max", type=int, default=8)
    ap.add_argument("--policies", default="specserve")
    ap.add_argument("--cost", default="cpu,gpu",
                    help="comma list of: " + ", ".join(COST_MODELS) + ", or cost profile files")
    ap.add_argument("--steps", type=int, default=1000)
    ap.add_argument(
        "--clock",
        default="wall",
        choices=list(CLOCKS),
        help="wall: perf_counter; cpu: thread CPU time (robust to other processes); the cost "
        "of reading the clock is measured and subtracted",
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--flush", type=int, default=0, metavar="MB",
                    help="write over a buffer of MB MiB before each step (not timed): cold "
                    "caches, as in a server (0: off)")
    ap.add_argument("--verify-time", action="store_true",
                    help="report each step's target forward seconds apart, as the engines do")
    ap.add_argument(
        "--repeat",
        type=int,
        default=3,
        help="runs per configuration; the one with the lowest median is kept (the machine "
        "may be shared: other processes only ever add time)",
    )
    ap.add_argument("--out", default="out/controller_bench.json")
    args = ap.parse_args(argv)
    if args.flush < 0:
        ap.error("--flush must be >= 0")
    rows = []
    costs: dict[str, dict] = {}
    load_at_start = _loadavg()
    for cost_name in args.cost.split(","):
        cost = _cost_model(cost_name)
        if cost is None:
            ap.error(f"--cost {cost_name!r}: valid: {', '.join(COST_MODELS)} or a profile file")
        costs[cost_name] = asdict(cost)
        for spec in args.policies.split(","):
            for batch in (int(b) for b in args.batches.split(",")):
                runs = [
                    bench_one(spec, cost, batch, args.k_max, args.steps, args.seed, args.clock,
                              args.flush, args.verify_time)
                    for _ in range(max(1, args.repeat))
                ]
                best = min(runs, key=lambda r: r["median_us"])
                rows.append({"cost": cost_name, **best, "repeats": len(runs)})
    print_table(rows)
    print(f"load average (1, 5, 15 min) at start {load_at_start}, at end {_loadavg()}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = {
        "sloserve_version": __version__,
        "steps": args.steps,
        "repeat": args.repeat,
        "loadavg_at_start": load_at_start,
        "loadavg_at_end": _loadavg(),
        "python": platform.python_version(),
        "numpy": np.__version__,
        "machine": platform.machine(),
        "processor": platform.processor(),
        "flush_mb": args.flush,
        "cost_models": costs,
    }
    out.write_text(json.dumps({"meta": meta, "results": rows}, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
