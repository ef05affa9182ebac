"""Simulator fidelity: the real engine and the simulator replay the same workload.

    python -m sloserve.sim.fidelity [--requests 20] [--rate 0.5] [--output-len 48] \
        [--policies ar,fixed:3,specserve] [--profile FILE] [--acceptance FILE]

Runs the in-process engine on the built-in pair (open loop, real time) and then the
simulator with the cost profile measured for that pair on this machine, per policy, and
prints mean E2E latency and mean TPOT, real vs simulated, with the relative error
(SmartSpec sec. 7.2: within 10% below saturation). Writes JSON (default
out/sim_fidelity.json) with both summaries and the acceptance statistics of each side.

Profile: --profile FILE, or --profile fresh (the quick profiler, ~30 s, runs right before
each policy's real run, into out/fidelity_profiles/: on a shared machine whose speed drifts
by 1.5x within minutes, a profile measured minutes earlier misprices the replay), else the
one matching the built-in pair on this device under configs/ or the user cache; if there is
none the quick profiler runs first and writes it. Both sides of a policy use the same
profile: the engine's policies score plans with it, the simulator prices its steps with it.
Acceptance: --acceptance, else out/bench_builtin_pair.json if present, else the built-in
calibration.
Prompts: Spec-Bench questions (ordinary text, like the calibration), tokenized once.
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from pathlib import Path
from typing import Any

import numpy as np

from sloserve.bench.common import machine_info, print_table, write_json
from sloserve.cli.targets import make_target
from sloserve.estimator.profile_file import read_profile
from sloserve.replay.metrics import SloConfig, summarize_run
from sloserve.replay.records import ReplayRequest
from sloserve.replay.runner import run_policies
from sloserve.replay.specbench import ordinary_prompts
from sloserve.replay.synthetic import poisson_arrivals
from sloserve.runtime.config import EngineConfig
from sloserve.sim.acceptance import load_acceptance
from sloserve.sim.target import SimTarget

REPO = Path(__file__).resolve().parents[2]
DEFAULT_ACCEPTANCE = REPO / "out" / "bench_builtin_pair.json"


def find_or_measure_profile(cfg: EngineConfig) -> str:
    """The built-in pair's profile on this device; profiles first if there is none."""
    from sloserve.estimator.profile_lookup import find_matching
    from sloserve.runtime.config import resolve
    from sloserve.runtime.models.builtin import ensure_builtin_pair

    target, draft = ensure_builtin_pair()
    path = find_matching(resolve(cfg), str(target), str(draft))
    if path is not None:
        return str(path)
    print("no cost profile for the built-in pair on this device: running the quick profiler")
    from sloserve.cli.profile import main as profile_main

    return str(profile_main(["--quick"]))


def build_requests(n: int, rate: float, output_len: int, seed: int) -> list[ReplayRequest]:
    """n Spec-Bench prompts as token ids, Poisson arrivals, fixed output length."""
    from sloserve.runtime.engine_setup import load_tokenizer
    from sloserve.runtime.models.builtin import ensure_builtin_pair

    tok = load_tokenizer(str(ensure_builtin_pair()[0]))
    arrivals = poisson_arrivals(rate, n, np.random.default_rng(seed))
    return [
        ReplayRequest(request_id=f"f{i:04d}", arrival_s=float(arrivals[i]),
                      max_new_tokens=output_len, ignore_eos=True,
                      input_ids=tuple(tok.encode(p, add_special_tokens=False)[:512]))
        for i, p in enumerate(ordinary_prompts(n))
    ]


def warm_up(cfg: EngineConfig, requests: list[ReplayRequest]) -> None:
    """Load the models and run a few steps, so the first measured policy is not slower."""
    from sloserve.replay.inprocess_target import shared_parts
    from sloserve.runtime.engine import Engine
    from sloserve.runtime.request import SamplingParams

    eng = Engine(cfg, parts=shared_parts(cfg))
    eng.generate([list(requests[0].input_ids or ())], SamplingParams(max_new_tokens=8, temperature=0.0,
                                                               ignore_eos=True))


def serving_scale(cfg: EngineConfig, profile: str, batches=(1, 4), tokens: int = 24) -> float:
    """Measured / predicted plain-decode step time on the serving path (engine thread +
    asyncio client, what the in-process replay measures), on a calibration run separate
    from the workload: B identical requests decode in lockstep; the median gap between one
    request's chunks is the step time. The profiler times forwards on the main thread only;
    this ratio is what the serving path adds (the engine thread, GIL hand-offs to the
    client), plus whatever the machine's speed drifted since the profile was measured (on
    this CPU mostly the latter: a diagnostic, off by default)."""
    import asyncio
    import statistics

    from sloserve.replay.inprocess_target import shared_parts
    from sloserve.runtime.async_engine import AsyncEngine
    from sloserve.runtime.engine import Engine
    from sloserve.runtime.request import SamplingParams

    cost = read_profile(profile).cost_model()
    ar = dataclasses.replace(cfg, spec_policy="ar")
    aeng = AsyncEngine(Engine(ar, parts=shared_parts(ar)))
    prompt = [11 + i % 50 for i in range(64)]
    params = SamplingParams(max_new_tokens=tokens, temperature=0.0, ignore_eos=True)

    async def gaps(b: int) -> list[float]:
        times: list[float] = []

        async def one(i: int) -> None:
            async for _ in aeng.generate(prompt, params):
                if i == 0:
                    times.append(time.perf_counter())

        await asyncio.gather(*(one(i) for i in range(b)))
        return [y - x for x, y in zip(times[1:], times[2:])]  # decode steps only

    ratios = []
    try:
        for b in batches:
            measured = statistics.median(asyncio.run(gaps(b)))
            ctx = b * (len(prompt) + tokens // 2 + 1)
            ratios.append(measured / (cost.target.time(ctx, b) + cost.overhead))
    finally:
        aeng.shutdown()
    return float(np.mean(ratios))


def scaled(cost, s: float):
    from sloserve.estimator.cost_model import CostModel

    target, verify_token = cost.scaled_target(s)
    return CostModel(target, cost.draft.scaled(s), cost.overhead * s, cost.verify_fixed * s,
                     cost.token_scale, verify_token)


def rel_err(sim: float | None, real: float | None) -> float | None:
    return None if sim is None or not real else (sim - real) / real


def side(summary) -> dict:
    spec = dataclasses.asdict(summary.spec) if summary.spec else None
    return {"e2e_ms": summary.e2e_ms.mean, "tpot_ms": summary.tpot_ms.mean,
            "ttft_ms": summary.ttft_ms.mean, "completed": summary.completed, "spec": spec}


def mean_side(sides: list[dict]) -> dict:
    """Average of the simulator's summaries over its seeds (None stays None)."""
    def avg(values):
        values = [v for v in values if v is not None]
        return float(np.mean(values)) if values else None

    out = {k: avg([s[k] for s in sides]) for k in ("e2e_ms", "tpot_ms", "ttft_ms", "completed")}
    specs = [s["spec"] for s in sides if s["spec"]]
    out["spec"] = {k: avg([sp[k] for sp in specs]) for k in specs[0]} if specs else None
    return out


def compare(real_runs, sim_runs_by_seed, slo: SloConfig) -> list[dict]:
    """One row per policy: the real summary, the simulator's averaged over seeds, errors."""
    rows = []
    for i, real in enumerate(real_runs):
        r = side(summarize_run(real, slo))
        per_seed = [side(summarize_run(runs[i], slo)) for runs in sim_runs_by_seed]
        s = mean_side(per_seed)
        errs = [e for x in per_seed if (e := rel_err(x["e2e_ms"], r["e2e_ms"])) is not None]
        rows.append({
            "policy": real.policy, "real": r, "sim": s, "sim_per_seed": per_seed,
            "e2e_rel_err": rel_err(s["e2e_ms"], r["e2e_ms"]),
            "tpot_rel_err": rel_err(s["tpot_ms"], r["tpot_ms"]),
            "e2e_rel_err_seed_range": [min(errs), max(errs)] if len(errs) == len(per_seed) else None,
        })
    return rows


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:+.1f}%"


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x:.1f}"


def print_rows(rows: list[dict]) -> None:
    print_table(
        ["policy", "E2E real ms", "E2E sim ms", "E2E err", "TPOT real ms", "TPOT sim ms",
         "TPOT err", "acc. rate real/sim", "mean k real/sim"],
        [[r["policy"], _ms(r["real"]["e2e_ms"]), _ms(r["sim"]["e2e_ms"]), _pct(r["e2e_rel_err"]),
          _ms(r["real"]["tpot_ms"]), _ms(r["sim"]["tpot_ms"]), _pct(r["tpot_rel_err"]),
          f"{_spec(r['real'], 'acceptance_rate')}/{_spec(r['sim'], 'acceptance_rate')}",
          f"{_spec(r['real'], 'mean_verified_k')}/{_spec(r['sim'], 'mean_verified_k')}"]
         for r in rows])


def _spec(side: dict, key: str) -> str:
    v = (side["spec"] or {}).get(key)
    return "-" if v is None else f"{v:.2f}"


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(prog="python -m sloserve.sim.fidelity", allow_abbrev=False,
                                 description=__doc__.split("\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--requests", type=int, default=20)
    ap.add_argument("--rate", type=float, default=0.5, help="Poisson arrivals, req/s")
    ap.add_argument("--output-len", type=int, default=48, help="tokens per request")
    ap.add_argument("--policies", default="ar,fixed:3,specserve")
    ap.add_argument("--tpot-slo-ms", type=float, default=None, help="engine default TPOT SLO")
    ap.add_argument("--k-max", type=int, default=8)
    ap.add_argument("--profile", default=None,
                    help="cost profile of the built-in pair here, or 'fresh': run the quick "
                         "profiler right before each policy's real run "
                         "(out/fidelity_profiles/), so the profile and the replay see the "
                         "machine in the same state")
    ap.add_argument("--acceptance", default=None, help="acceptance file for the simulator")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--sim-seeds", type=int, default=5,
                    help="average the simulator over this many acceptance seeds (a small "
                         "workload draws few per-request acceptance levels)")
    ap.add_argument("--serving-calibration", choices=("on", "off"), default="off",
                    help="also simulate with each profile scaled to the serving path's "
                         "plain-decode step time measured right after the policy's real run "
                         "(serving_scale; a diagnostic: on this machine it mostly measures "
                         "the speed drift since the profile)")
    ap.add_argument("--out", default=str(REPO / "out" / "sim_fidelity.json"))
    args = ap.parse_args(argv)

    base = EngineConfig(k_max=args.k_max,
                        tpot_slo=args.tpot_slo_ms / 1000 if args.tpot_slo_ms else None)
    fresh = args.profile == "fresh"
    fixed_profile = None if fresh else (args.profile or find_or_measure_profile(base))
    acceptance = args.acceptance or (str(DEFAULT_ACCEPTANCE) if DEFAULT_ACCEPTANCE.is_file()
                                     else None)
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    requests = build_requests(args.requests, args.rate, args.output_len, args.seed)
    print(f"profile: {'measured afresh before each policy' if fresh else fixed_profile}\n"
          f"acceptance: {acceptance or 'built-in calibration'}\n"
          f"workload: {len(requests)} requests, Poisson {args.rate} req/s, "
          f"{args.output_len} output tokens, policies {policies}")
    # per policy: its profile, the real engine's run with it, the serving-path scale
    profiles, real, scales = [], [], []
    t_real = 0.0
    for i, p in enumerate(policies):
        if fresh:  # minutes-old profiles misprice this machine: measure right before the run
            from sloserve.cli.profile import main as profile_main

            out_dir = REPO / "out" / "fidelity_profiles" / str(i)  # a distinct path per policy
            profile = str(profile_main(["--quick", "--out-dir", str(out_dir)]))
        else:
            assert fixed_profile is not None  # set unless fresh
            profile = fixed_profile
        cfg = dataclasses.replace(base, profile_path=profile)
        warm_up(cfg, requests)
        t0 = time.perf_counter()
        real += run_policies(requests, {p: make_target("inprocess", p, engine_config=cfg)},
                             show_progress=False)
        t_real += time.perf_counter() - t0
        scales.append(serving_scale(cfg, profile) if args.serving_calibration == "on" else 1.0)
        profiles.append(profile)
    model = load_acceptance(acceptance) if acceptance else None
    costs = [read_profile(profile).cost_model() for profile in profiles]
    variants = {"profile": costs}
    if args.serving_calibration == "on":
        variants["serving-calibrated"] = [scaled(c, s) for c, s in zip(costs, scales)]
    result: dict[str, Any] = {"benchmark": "sim_fidelity", "args": vars(args), "profiles": profiles,
              "acceptance": acceptance, "machine": machine_info(), "real_wall_s": t_real,
              "serving_scales": scales, "variants": {}}
    for name, per_policy in variants.items():
        t0 = time.perf_counter()
        sims = [[run_policies(requests, {p: SimTarget(dataclasses.replace(
                    base, profile_path=prof, spec_policy=p), c, model, seed=seed)},
                    show_progress=False)[0]
                 for p, prof, c in zip(policies, profiles, per_policy)]
                for seed in range(args.seed, args.seed + args.sim_seeds)]
        rows = compare(real, sims, SloConfig())
        result["variants"][name] = {"rows": rows, "sim_wall_s": time.perf_counter() - t0}
        label = ("cost profile as measured" if name == "profile" else
                 "cost profile x the serving-path calibration ("
                 + ", ".join(f"{p} {s:.3f}" for p, s in zip(policies, scales)) + ")")
        print(f"\nsimulator with the {label}, mean over {args.sim_seeds} seeds:")
        print_rows(rows)
    print(f"real engine {t_real:.1f} s")
    write_json(args.out, result)
    return result


if __name__ == "__main__":
    main()
