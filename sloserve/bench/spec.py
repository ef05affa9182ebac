"""Closed-loop speculative decoding benchmark on the built-in pair (or --model: a directory
or a preset such as smollm2, with Spec-Bench questions in its chat template, answers ending
at its stop token): every policy side by side, at several batch sizes, in one process
(models loaded once, policies swapped).

    python -m sloserve.bench.spec --policies ar,fixed:1,fixed:3,fixed:5 --batches 1,4,16,32
    python -m sloserve.bench.spec --policies ar,fixed:3,specserve --batches 8 --tpot-slo 45ms
    python -m sloserve.bench.spec --model smollm2 --policies ar,fixed:3,specserve-slo

Batch b = b requests in flight, closed loop: n = max(b * --requests-per-slot, --min-requests)
ordinary prompts (cut to --prompt-tokens, greedy, ignore_eos) taken in a cycle, the next one
submitted when a request finishes. Output lengths are spread evenly over --new-tokens
(1 +- --length-spread), so requests finish at different steps and the load settles into a
steady mix of prefills and decodes. Every policy has its own engine (shared weights, its own
KV pool); the engines take one step each in turn until every one has finished n requests,
so all policies are measured over the same stretch of time (--sequential: one after
another). Each engine's clock counts only its own steps. tok/s = tokens generated / that
clock; TPOT = (finish - first token) / (n - 1) of each finished request, on that clock.
Repeated `--repeats` times (the order rotates every repeat), medians reported; "vs ar" is
the median over repeats of tok/s divided by ar's tok/s in the same repeat.
Prints a table and writes JSON (default out/bench_spec.json).
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time
from collections.abc import Sequence

import numpy as np

from sloserve.bench.common import bench_prompts, machine_info, print_table, write_json
from sloserve.policies.registry import make_policy
from sloserve.replay.specbench import ordinary_prompts
from sloserve.runtime.config import EngineConfig
from sloserve.runtime.engine import Engine
from sloserve.runtime.kv_cache import BlockAllocator, KVStorage
from sloserve.runtime.model_runner import ModelRunner
from sloserve.runtime.models.presets import resolve_dir
from sloserve.runtime.request import SamplingParams
from sloserve.runtime.scheduler import SchedulerConfig
from sloserve.runtime.stats import EngineStats
from sloserve.units import duration


class ClosedLoop:
    """One engine's closed loop, advanced a step at a time so several policies can be stepped
    in turn (`run_loops`): `concurrency` requests in flight, the next prompt submitted as soon
    as one finishes, the prompts taken in a cycle so the load never drains.

    Its clock counts only this engine's own time (each step plus its submissions), so a
    policy's numbers never include the steps of the policies run between its own.
    Per-request first-token and finish times are read on that clock at the end of the step
    that produced them."""

    def __init__(self, eng: Engine, prompts: list[list[int]], new_tokens: int | list[int],
                 concurrency: int | None = None, ignore_eos: bool = True) -> None:
        """new_tokens: output length of every request, or of each prompt's requests (the
        most, where ignore_eos is False and a request ends at its stop token)."""
        eng.stats = eng.runner.stats = EngineStats(k_max=eng.cfg.k_max)
        self.eng = eng
        self.prompts = prompts
        lengths = [new_tokens] * len(prompts) if isinstance(new_tokens, int) else new_tokens
        self.params = [SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=ignore_eos)
                       for n in lengths]
        self.slo = eng.cfg.tpot_slo or float("inf")
        self.concurrency = concurrency or len(prompts)
        self.clock = 0.0  # seconds of this engine's own time
        self.live: list = []  # requests in flight
        self.finished: list = []
        self.first: dict[str, float] = {}  # rid -> first token, on self.clock
        self.finish: dict[str, float] = {}
        t0 = time.perf_counter()
        self._submit()
        self.clock += time.perf_counter() - t0

    def _submit(self) -> None:
        while len(self.live) < self.concurrency:
            i = (len(self.live) + len(self.finished)) % len(self.prompts)
            self.live.append(self.eng.add_request(self.prompts[i], self.params[i]))

    def step(self) -> None:
        t0 = time.perf_counter()
        self.eng.step()
        self.clock += time.perf_counter() - t0
        done = False
        for r in self.live:
            if r.first_token_time is not None and r.rid not in self.first:
                self.first[r.rid] = self.clock
            if r.finish_time is not None:
                self.finish[r.rid] = self.clock
                self.finished.append(r)
                done = True
        if done:
            self.live = [r for r in self.live if r.finish_time is None]
            t0 = time.perf_counter()
            self._submit()
            self.clock += time.perf_counter() - t0

    def stop(self) -> None:
        """Abort the requests still in flight (their KV blocks go back to the pool); the
        tokens they produced so far stay counted."""
        for r in self.live:
            self.eng.abort(r.rid)
        self.live = []

    def result(self) -> dict:
        """Throughput over the whole loop (every generated token, finished requests or not),
        per-token latency of the finished requests."""
        s = self.eng.stats
        tpots = [(self.finish[r.rid] - self.first[r.rid]) / (len(r.output_ids) - 1)
                 for r in self.finished]
        decode_steps = [h for h in s.history if h.decodes > 0]
        ks = np.array(s.chosen_k, dtype=float)
        return {
            "wall_s": self.clock,
            "requests": len(self.finished),
            "tokens": s.generated_tokens,
            "tok_s": s.generated_tokens / self.clock,
            "mean_tpot_ms": 1000 * statistics.mean(tpots) if tpots else float("nan"),
            "tpots": tpots,
            "acceptance_rate": s.acceptance_rate,
            "verified_acceptance_rate": s.verified_acceptance_rate,
            "accept_at_1": s.accepted_at[0] / s.verified_at[0] if s.verified_at[0] else None,
            "mean_accepted_length": s.mean_accepted_length,
            "mean_k": float((ks * np.arange(len(ks))).sum() / max(ks.sum(), 1)),
            "max_step_ms": 1000 * max((h.step_s for h in decode_steps), default=0.0),
            "steps": s.steps,
            "slo_step_misses": s.slo_step_misses,
            # decode-only steps over the SLO: the ones plain decoding fits in (a step that
            # carries a whole prompt's prefill can be over it whatever the policy does)
            "slo_decode_step_misses": sum(h.step_s > self.slo for h in decode_steps
                                          if h.batch == h.decodes),
            # ... of which speculative (drafted): the misses speculation can be blamed for;
            # a plain step over the SLO is the machine's (ar has those too)
            "slo_spec_step_misses": sum(h.step_s > self.slo for h in decode_steps
                                        if h.batch == h.decodes and h.mean_proposed > 0),
            "policy_time_per_step_us": 1e6 * s.policy_time_total / max(s.steps, 1),
            "step_time_mean_ms": 1000 * s.step_time_total / max(s.steps, 1),
        }


def run_loops(loops: Sequence[ClosedLoop], requests: int, interleave: bool = True) -> list[dict]:
    """Run the loops until each has finished `requests` requests, then stop them.

    interleave: one step of each loop in turn, all of them until the slowest is done, so
    every policy is measured over the same stretch of time (this machine's speed drifts by
    up to 1.5x within minutes; stepping in turn cancels that). Otherwise one loop after the
    other, each until its own `requests` are done."""
    if interleave:
        while min(len(lp.finished) for lp in loops) < requests:
            for lp in loops:
                lp.step()
    else:
        for lp in loops:
            while len(lp.finished) < requests:
                lp.step()
    for lp in loops:
        lp.stop()
    return [lp.result() for lp in loops]


def run_once(eng: Engine, prompts: list[list[int]], new_tokens: int,
             concurrency: int | None = None) -> dict:
    """Closed loop until every prompt has been served once."""
    return run_loops([ClosedLoop(eng, prompts, new_tokens, concurrency)], len(prompts))[0]


def policy_engine(base: Engine, name: str, k_max: int, drafter: str, kv_tokens: int) -> Engine:
    """An engine running policy `name` on base's models (shared weights) with its own KV pool
    and KV storage, so engines stepped in turn never share blocks."""
    parts = base.parts
    blocks = max(1, kv_tokens // base.cfg.block_size)

    def runner(r: ModelRunner | None) -> ModelRunner | None:
        if r is None:
            return None
        kv = KVStorage(r.cfg, blocks, base.cfg.block_size, r.kv.k.dtype, r.device)
        return ModelRunner(r.model, kv, r.backend, base.cfg.block_size)

    parts = dataclasses.replace(
        parts, target=runner(parts.target),  # type: ignore[arg-type]  # a runner in, one out
        draft=runner(parts.draft),
        allocator=BlockAllocator(blocks, base.cfg.block_size),
        policy=make_policy(name, parts.cost, k_max=k_max, drafter=drafter,
                           calibration=parts.calibration),
    )
    cfg = dataclasses.replace(base.cfg, spec_policy=name, kv_cache_tokens=blocks * base.cfg.block_size)
    return Engine(cfg, parts=parts)


def _median_run(runs: list[dict]) -> dict:
    best = sorted(runs, key=lambda r: r["wall_s"])[len(runs) // 2]
    return {**best, "tok_s_all": [r["tok_s"] for r in runs],
            "slo_decode_step_misses_all": [r["slo_decode_step_misses"] for r in runs],
            "slo_spec_step_misses_all": [r["slo_spec_step_misses"] for r in runs]}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
        allow_abbrev=False)
    ap.add_argument("--policies", default="ar,fixed:1,fixed:3,fixed:5")
    ap.add_argument("--batches", default="1,4,16,32")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--k-max", type=int, default=8)
    ap.add_argument("--tpot-slo", type=duration, default=None, help="e.g. 45ms or 0.045s")
    ap.add_argument("--drafter", default="model", choices=["model", "ngram"])
    ap.add_argument("--prompt-tokens", type=int, default=64,
                    help="truncate each prompt to this many tokens (0: whole prompts)")
    ap.add_argument("--min-requests", type=int, default=8,
                    help="requests per run at least: a small batch runs several prompts in "
                         "turn (one 64-token request at batch 1 is ~20 steps, too few to rank "
                         "policies within a few percent)")
    ap.add_argument("--length-spread", type=float, default=0.5,
                    help="output lengths spread evenly over new_tokens * (1 +- this)")
    ap.add_argument("--requests-per-slot", type=float, default=2.0,
                    help="run until every policy has finished this many requests per batch "
                         "slot (at least --min-requests)")
    ap.add_argument("--sequential", action="store_true",
                    help="run the policies one after another in each repeat instead of one "
                         "engine step each in turn")
    ap.add_argument("--kv-tokens", type=int, default=16384,
                    help="KV capacity of each policy's engine, in tokens")
    ap.add_argument("--model", default=None,
                    help="target: a directory or a preset (default: the built-in pair; "
                         "smollm2: the real model and its distilled draft)")
    ap.add_argument("--chat", choices=("auto", "on", "off"), default="auto",
                    help="with --model: prompts in the target's chat template, answers end at "
                         "its stop token (auto: when the target has a template)")
    ap.add_argument("--out", default="out/bench_spec.json")
    args = ap.parse_args(argv)
    policies = args.policies.split(",")
    batches = [int(b) for b in args.batches.split(",")]
    base = Engine(EngineConfig(
        model_path=args.model, spec_policy="fixed:1", k_max=args.k_max, tpot_slo=args.tpot_slo, drafter=args.drafter,
        kv_cache_tokens=args.kv_tokens,
        scheduler=SchedulerConfig(max_running_requests=max(batches), max_step_tokens=8192),
    ))
    # same models, a fresh policy, KV pool and KV storage each
    engines = {name: policy_engine(base, name, args.k_max, args.drafter, args.kv_tokens)
               for name in policies}
    rows = []
    for b in batches:
        n = max(round(b * args.requests_per_slot), args.min_requests)
        chat = False
        if args.model is not None:  # Spec-Bench questions, in the chat template if any
            prompts, chat = bench_prompts(str(resolve_dir(args.model)),
                                          args.prompt_tokens or 10**9, args.chat, n)
        else:
            prompts = [base.encode(p) for p in ordinary_prompts(n)]
            if args.prompt_tokens:
                prompts = [p[: args.prompt_tokens] for p in prompts]
        # output lengths spread around --new-tokens, so requests finish at different steps
        # and the closed loop settles into a steady mix of prefills and decodes instead of
        # waves of b prefills at once
        spread = args.new_tokens * args.length_spread
        lengths = np.random.default_rng(0).permutation(np.linspace(
            args.new_tokens - spread, args.new_tokens + spread, n).round().astype(int)).tolist()
        for eng in engines.values():  # warm-up
            run_once(eng, prompts[:1], 4)
        runs: dict[str, list[dict]] = {p: [] for p in policies}
        for rep in range(args.repeats):
            order = policies[rep % len(policies):] + policies[: rep % len(policies)]
            loops = [ClosedLoop(engines[name], prompts, lengths, b, ignore_eos=not chat)
                     for name in order]
            for name, res in zip(order, run_loops(loops, n, interleave=not args.sequential)):
                runs[name].append(res)
        for name in policies:
            paired = ([r["tok_s"] / a["tok_s"] for r, a in zip(runs[name], runs["ar"])]
                      if "ar" in runs else [float("nan")])
            drafter = getattr(engines[name].parts.policy, "drafter", None)
            theta = getattr(drafter, "theta", None)  # the online cost correction (specserve)
            rows.append({"batch": b, "policy": name, **_median_run(runs[name]), "cost_theta": theta,
                         "speedup_vs_ar": statistics.median(paired), "speedup_vs_ar_all": paired})
    table = []
    for r in rows:
        rel = r["speedup_vs_ar"]
        acc = "-" if r["policy"] == "ar" else f"{r['verified_acceptance_rate']:.2f}"
        r["controller_share"] = r["policy_time_per_step_us"] / 1000 / max(r["step_time_mean_ms"], 1e-9)
        table.append([r["batch"], r["policy"], f"{r['mean_tpot_ms']:.1f}", f"{r['tok_s']:.1f}",
                      f"{rel:.2f}x", f"{r['mean_k']:.2f}", acc, f"{r['max_step_ms']:.1f}",
                      f"{r['slo_step_misses']} ({r['slo_decode_step_misses']}, "
                      f"{r['slo_spec_step_misses']})" if args.tpot_slo else "-",
                      f"{r['policy_time_per_step_us']:.0f}", f"{100 * r['controller_share']:.2f}%"])
    print_table(["batch", "policy", "TPOT ms", "tok/s", "vs ar", "mean k", "accept", "max step ms",
                 "SLO-miss steps (decode-only, speculative)", "ctrl us/step", "ctrl share"], table)
    result = {"benchmark": "spec", "args": vars(args), "machine": machine_info(),
              "cost_model": dataclasses.asdict(base.parts.cost), "rows": rows}
    write_json(args.out, result)
    return result


if __name__ == "__main__":
    main()
