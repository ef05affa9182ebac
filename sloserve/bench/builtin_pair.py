"""Measures the built-in model pair: forward costs (target vs draft) and how well the draft
agrees with the target and how well its confidence predicts acceptance.

    python -m sloserve.bench.builtin_pair [--prompts 32] [--new-tokens 64]

- cost: median time of one decode forward (batch 1 and 32, 1 query token) of each model
  through the engine's model runners, and their ratio;
- greedy acceptance: `fixed:1` over ordinary prompts, so every draft token is checked against
  the target's greedy choice in its own context (conditional acceptance at position 1), and
  `fixed:4` for acceptance per draft position;
- calibration: acceptance rate per draft-confidence bin, from every verified position up to
  the first rejection.
Prints tables and writes JSON (default out/bench_builtin_pair.json).
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time

import numpy as np
import torch

from sloserve.bench.common import machine_info, print_table, write_json
from sloserve.policies.registry import make_policy
from sloserve.replay.specbench import ordinary_prompts
from sloserve.runtime.batch import Segment
from sloserve.runtime.config import EngineConfig
from sloserve.runtime.engine import Engine
from sloserve.runtime.request import SamplingParams
from sloserve.speculation import SpecPlan, SpecPolicy, StepInfo, VerifyOutcome

BINS = [0.0, 0.2, 0.4, 0.6, 0.8, 1.0001]


class Recorder(SpecPolicy):
    """Wraps a policy and records (confidence, accepted) for each verified draft position."""

    def __init__(self, inner: SpecPolicy) -> None:
        self.inner = inner
        self.name = inner.name
        self.pairs: list[tuple[float, bool]] = []

    def plan(self, step: StepInfo) -> SpecPlan:
        return self.inner.plan(step)

    def release(self, request_id: str) -> None:
        self.inner.release(request_id)

    @property
    def speculates(self) -> bool:
        return self.inner.speculates

    def observe(self, plan: SpecPlan, outcome: VerifyOutcome) -> None:
        for r in range(len(outcome.verified)):
            k, a = int(outcome.verified[r]), int(outcome.accepted[r])
            for j in range(min(k, a + 1)):  # positions up to and including the first rejection
                self.pairs.append((float(outcome.confidences[r, j]), j < a))
        self.inner.observe(plan, outcome)


def forward_ms(runner, batch: int, ctx: int = 128, reps: int = 20) -> float:
    bs = runner.block_size
    nblk = (ctx + 1 + bs - 1) // bs
    segs = [Segment(list(range(i * nblk, (i + 1) * nblk)), ctx, [5]) for i in range(batch)]
    times = []
    for _ in range(reps + 3):
        t = time.perf_counter()
        runner.forward(segs)
        times.append(time.perf_counter() - t)
    return 1000 * statistics.median(times[3:])


def acceptance(base: Engine, policy: str, prompts, new_tokens: int) -> tuple[Engine, Recorder]:
    rec = Recorder(make_policy(policy, base.parts.cost, k_max=8))
    eng = Engine(dataclasses.replace(base.cfg, spec_policy=policy), parts=dataclasses.replace(base.parts, policy=rec))
    eng.generate(prompts, SamplingParams(max_new_tokens=new_tokens, temperature=0.0, ignore_eos=True))
    return eng, rec


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
        allow_abbrev=False)
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--out", default="out/bench_builtin_pair.json")
    args = ap.parse_args(argv)
    base = Engine(EngineConfig(spec_policy="fixed:1", kv_cache_tokens=65536))
    t, d = base.parts.target, base.parts.draft
    assert d is not None  # the built-in pair has its draft
    cost = {f"{name}_b{b}_ms": forward_ms(r, b) for name, r in (("target", t), ("draft", d)) for b in (1, 32)}
    cost["ratio_b1"] = cost["target_b1_ms"] / cost["draft_b1_ms"]
    cost["ratio_b32"] = cost["target_b32_ms"] / cost["draft_b32_ms"]
    n_params = {n: sum(p.numel() for p in r.model.parameters()) for n, r in (("target", t), ("draft", d))}
    prompts = ordinary_prompts(args.prompts)
    e1, _ = acceptance(base, "fixed:1", prompts, args.new_tokens)
    e4, rec = acceptance(base, "fixed:4", prompts, args.new_tokens)
    greedy_acc = e1.stats.accepted_at[0] / e1.stats.verified_at[0]
    acc, ver = e4.stats.accepted_at[:4], e4.stats.verified_at[:4]
    # conditional acceptance at position j given positions < j were accepted
    per_pos = [acc[0] / ver[0]] + [acc[j] / acc[j - 1] if acc[j - 1] else None for j in range(1, 4)]
    conf = np.array([c for c, _ in rec.pairs])
    ok = np.array([a for _, a in rec.pairs])
    calib = []
    for lo, hi in zip(BINS[:-1], BINS[1:]):
        m = (conf >= lo) & (conf < hi)
        calib.append({"bin": f"[{lo:.1f},{min(hi, 1):.1f})", "n": int(m.sum()),
                      "acceptance": float(ok[m].mean()) if m.any() else None,
                      "mean_confidence": float(conf[m].mean()) if m.any() else None})
    print_table(["model", "params", "decode fwd b=1 ms", "decode fwd b=32 ms"],
                [[n, f"{n_params[n] / 1e6:.1f}M", f"{cost[n + '_b1_ms']:.2f}", f"{cost[n + '_b32_ms']:.2f}"]
                 for n in ("target", "draft")])
    print(f"target/draft forward cost ratio: {cost['ratio_b1']:.1f}x at batch 1, {cost['ratio_b32']:.1f}x at batch 32")
    print(f"greedy acceptance (fixed:1, conditional at position 1): {greedy_acc:.3f}")
    print("acceptance per draft position (fixed:4, given the previous accepted): "
          + ", ".join(f"{p:.2f}" for p in per_pos if p is not None))
    print_table(["draft confidence", "verified", "accepted share", "mean confidence"],
                [[c["bin"], c["n"], "-" if c["acceptance"] is None else f"{c['acceptance']:.2f}",
                  "-" if c["mean_confidence"] is None else f"{c['mean_confidence']:.2f}"] for c in calib])
    result = {"benchmark": "builtin_pair", "args": vars(args), "machine": machine_info(),
              "params": n_params, "cost": cost, "greedy_acceptance": greedy_acc,
              "acceptance_per_position": per_pos, "calibration": calib,
              "torch_threads": torch.get_num_threads()}
    write_json(args.out, result)
    return result


if __name__ == "__main__":
    main()
