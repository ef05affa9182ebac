"""Closed-loop speculative decoding benchmark on the built-in pair: every policy side by side,
at several batch sizes, in one process (models loaded once, policies swapped).

    python -m sloserve.bench.spec --policies ar,fixed:1,fixed:3,fixed:5 --batches 1,4,16,32
    python -m sloserve.bench.spec --policies ar,fixed:3,specserve --batches 8 --tpot-slo 45ms

Batch b = b requests in flight, closed loop: max(b, --min-requests) ordinary prompts (cut to
--prompt-tokens, greedy, ignore_eos, the same output length), the next one submitted when a
request finishes, run to completion; repeated `--repeats` times with the
policies alternating (the order rotates every repeat), medians reported. "vs ar" is the median
over repeats of tok/s divided by ar's tok/s in the same repeat: pairing runs seconds apart
cancels most of this machine's slow drifts. Per-token latency is each request's
TPOT = (finish - first token) / (n - 1).
Prints a table and writes JSON (default out/bench_spec.json).
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time

import numpy as np

from sloserve.bench.common import machine_info, ordinary_prompts, print_table, write_json
from sloserve.drafter.registry import make_policy
from sloserve.runtime.config import EngineConfig
from sloserve.runtime.engine import Engine
from sloserve.runtime.request import SamplingParams
from sloserve.runtime.scheduler import SchedulerConfig
from sloserve.runtime.stats import EngineStats


def parse_ms(text: str) -> float:
    """'30ms', '0.03s' or '30' (milliseconds) -> seconds."""
    t = text.strip().lower()
    if t.endswith("ms"):
        return float(t[:-2]) / 1000
    if t.endswith("s"):
        return float(t[:-1])
    return float(t) / 1000


def run_once(eng: Engine, prompts: list[list[int]], new_tokens: int,
             concurrency: int | None = None) -> dict:
    """Closed loop: `concurrency` requests in flight (default: all prompts at once), the next
    prompt submitted as soon as one finishes, until every prompt is done."""
    eng.stats = eng.runner.stats = EngineStats(k_max=eng.cfg.k_max)
    sp = SamplingParams(max_new_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    concurrency = concurrency or len(prompts)
    t0 = time.perf_counter()
    reqs = [eng.add_request(p, sp) for p in prompts[:concurrency]]
    pending = list(prompts[concurrency:])
    while eng.has_work:
        eng.step()
        done = sum(r.finish_time is not None for r in reqs)
        while pending and len(reqs) - done < concurrency:
            reqs.append(eng.add_request(pending.pop(0), sp))
    wall = time.perf_counter() - t0
    s = eng.stats
    tpots = [(r.finish_time - r.first_token_time) / (len(r.output_ids) - 1) for r in reqs]
    decode_steps = [h for h in s.history if h.decodes > 0]
    ks = np.array(s.chosen_k, dtype=float)
    return {
        "wall_s": wall,
        "tok_s": len(reqs) * new_tokens / wall,
        "mean_tpot_ms": 1000 * statistics.mean(tpots),
        "tpots": tpots,
        "acceptance_rate": s.acceptance_rate,
        "verified_acceptance_rate": s.verified_acceptance_rate,
        "accept_at_1": s.accepted_at[0] / s.verified_at[0] if s.verified_at[0] else None,
        "mean_accepted_length": s.mean_accepted_length,
        "mean_k": float((ks * np.arange(len(ks))).sum() / max(ks.sum(), 1)),
        "max_step_ms": 1000 * max((h.step_s for h in decode_steps), default=0.0),
        "steps": s.steps,
        "slo_step_misses": s.slo_step_misses,
        "policy_time_per_step_us": 1e6 * s.policy_time_total / max(s.steps, 1),
        "step_time_mean_ms": 1000 * s.step_time_total / max(s.steps, 1),
    }


def _median_run(runs: list[dict]) -> dict:
    best = sorted(runs, key=lambda r: r["wall_s"])[len(runs) // 2]
    return {**best, "tok_s_all": [r["tok_s"] for r in runs]}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--policies", default="ar,fixed:1,fixed:3,fixed:5")
    ap.add_argument("--batches", default="1,4,16,32")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--k-max", type=int, default=8)
    ap.add_argument("--tpot-slo", type=parse_ms, default=None, help="e.g. 45ms")
    ap.add_argument("--drafter", default="model", choices=["model", "ngram"])
    ap.add_argument("--prompt-tokens", type=int, default=64,
                    help="truncate each prompt to this many tokens (0: whole prompts)")
    ap.add_argument("--min-requests", type=int, default=8,
                    help="requests per run at least: a small batch runs several prompts in "
                         "turn (one 64-token request at batch 1 is ~20 steps, too few to rank "
                         "policies within a few percent)")
    ap.add_argument("--out", default="out/bench_spec.json")
    args = ap.parse_args(argv)
    policies = args.policies.split(",")
    batches = [int(b) for b in args.batches.split(",")]
    base = Engine(EngineConfig(
        spec_policy="fixed:1", k_max=args.k_max, tpot_slo=args.tpot_slo, drafter=args.drafter,
        scheduler=SchedulerConfig(max_running_requests=max(batches), max_step_tokens=8192),
    ))
    engines = {}
    for name in policies:  # same models and KV pool, a fresh policy each
        parts = dataclasses.replace(base.parts, policy=make_policy(
            name, base.parts.cost, k_max=args.k_max, drafter=args.drafter,
            calibration=base.parts.calibration))
        engines[name] = Engine(dataclasses.replace(base.cfg, spec_policy=name), parts=parts)
    rows = []
    for b in batches:
        n = max(b, args.min_requests)
        prompts = [base.encode(p) for p in ordinary_prompts(n)]
        if args.prompt_tokens:
            prompts = [p[: args.prompt_tokens] for p in prompts]
        for eng in engines.values():  # warm-up
            run_once(eng, prompts[:1], 4)
        runs: dict[str, list[dict]] = {p: [] for p in policies}
        for rep in range(args.repeats):
            order = policies[rep % len(policies):] + policies[: rep % len(policies)]
            for name in order:
                runs[name].append(run_once(engines[name], prompts, args.new_tokens, b))
        for name in policies:
            paired = ([r["tok_s"] / a["tok_s"] for r, a in zip(runs[name], runs["ar"])]
                      if "ar" in runs else [float("nan")])
            rows.append({"batch": b, "policy": name, **_median_run(runs[name]),
                         "speedup_vs_ar": statistics.median(paired), "speedup_vs_ar_all": paired})
    table = []
    for r in rows:
        rel = r["speedup_vs_ar"]
        acc = "-" if r["policy"] == "ar" else f"{r['verified_acceptance_rate']:.2f}"
        r["controller_share"] = r["policy_time_per_step_us"] / 1000 / max(r["step_time_mean_ms"], 1e-9)
        table.append([r["batch"], r["policy"], f"{r['mean_tpot_ms']:.1f}", f"{r['tok_s']:.1f}",
                      f"{rel:.2f}x", f"{r['mean_k']:.2f}", acc, f"{r['max_step_ms']:.1f}",
                      r["slo_step_misses"] if args.tpot_slo else "-",
                      f"{r['policy_time_per_step_us']:.0f}", f"{100 * r['controller_share']:.2f}%"])
    print_table(["batch", "policy", "TPOT ms", "tok/s", "vs ar", "mean k", "accept", "max step ms",
                 "SLO-miss steps", "ctrl us/step", "ctrl share"], table)
    result = {"benchmark": "spec", "args": vars(args), "machine": machine_info(),
              "cost_model": dataclasses.asdict(base.parts.cost), "rows": rows}
    write_json(args.out, result)
    return result


if __name__ == "__main__":
    main()
