"""A fixed-seed simulator replay whose every number is kept in `golden/replay.json`.

The golden file was written by the code as it stood before the speculation path was
restructured (issue #15); `test_golden_replay.py` replays the same requests and asserts the
same report, float for float, so a refactor that changes any decision or any book (tokens,
KV, step times, counters) of any policy fails. Regenerate only for a deliberate behaviour
change: `python tests/sim/golden_replay.py --write`, and say why in the commit.

The replay covers every policy of the registry with the draft-model drafter, the n-gram
drafter for three of them, a server TPOT SLO plus per-request SLOs, chunked prefill and a
small KV pool that forces preemption.
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

import numpy as np

from sloserve.estimator.cost_model import CostModel, ForwardCost
from sloserve.runtime.config import EngineConfig
from sloserve.runtime.scheduler import SchedulerConfig
from sloserve.sim.engine import SimRequest, Simulator

GOLDEN = Path(__file__).parent / "golden" / "replay.json"
COST = CostModel(ForwardCost(2.0e-6, 4.4e-4, 12.6e-3, 6.5), ForwardCost(1.5e-7, 2.9e-5, 2.1e-3, 5.0),
                 1.2e-3)
POLICIES = ["ar", "fixed:1", "fixed:3", "fixed:5", "hf-heuristic", "hf-threshold", "goodput",
            "lut", "sglang-adaptive", "specserve-drafter", "specserve"]
NGRAM_POLICIES = ["fixed:3", "goodput", "specserve"]


def requests(n: int = 60, seed: int = 11) -> list[SimRequest]:
    """Bursty arrivals; a third of the requests carry their own (tight or loose) TPOT SLO."""
    rng = np.random.default_rng(seed)
    gaps = rng.gamma(0.25, 1.0 / (0.25 * 5.0), n)  # 5 req/s, CV 2
    arrivals = np.cumsum(gaps) - gaps[0]
    out = []
    for i in range(n):
        own = rng.random() < 0.33
        out.append(SimRequest(
            f"g{i}", float(arrivals[i]), int(rng.integers(8, 300)), int(rng.integers(2, 90)),
            tpot_slo_s=float(rng.choice([0.03, 0.06, 0.2])) if own else None))
    return out


def config(policy: str, drafter: str) -> EngineConfig:
    return EngineConfig(spec_policy=policy, drafter=drafter, k_max=6, tpot_slo=0.08,
                        kv_cache_tokens=3072, block_size=16, dtype="float32",
                        scheduler=SchedulerConfig(max_running_requests=24, max_step_tokens=512))


def digest(value) -> str:
    """sha256 of the value's JSON (floats written with repr: exact)."""
    return hashlib.sha256(json.dumps(value).encode()).hexdigest()[:16]


def run_one(policy: str, drafter: str) -> dict:
    sim = Simulator(config(policy, drafter), COST, seed=5, max_context=2048)
    outs = sim.run(requests())
    stats = sim.stats.snapshot()
    stats.pop("policy_time_total")  # host seconds: differ run to run
    return {
        "stats": stats,
        # digests of the long lists (the stats above say what differs when one does)
        "history": digest([list(r) for r in sim.stats.history]),
        "requests": [[o.rid, digest([o.chunk_s, o.chunk_tokens]), o.num_preemptions, o.error]
                     for o in outs],
        "end": sim.now,
    }


def replay_report() -> dict:
    report = {f"{p}/model": run_one(p, "model") for p in POLICIES}
    report.update({f"{p}/ngram": run_one(p, "ngram") for p in NGRAM_POLICIES})
    # through JSON, as the golden file holds it (floats round-trip exactly)
    return json.loads(json.dumps(report))


if __name__ == "__main__":
    if sys.argv[1:] != ["--write"]:
        sys.exit("usage: python tests/sim/golden_replay.py --write")
    GOLDEN.parent.mkdir(exist_ok=True)
    GOLDEN.write_text(json.dumps(replay_report(), separators=(",", ":")) + "\n")
    print(f"wrote {GOLDEN} ({GOLDEN.stat().st_size} bytes)")
