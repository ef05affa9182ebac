"""Numbers of a load sweep: per run (one policy on one cell) and over seeds.

Per run: goodput = requests meeting their own TTFT and TPOT SLOs per second of the run
(docs/design.md sec. 11; failures count as misses), SLO attainment overall and per SLO
class, and the mean verified draft length per decoding request-step (from the engine's
time series, weighted by batch size). Over seeds (every policy on the same cells): mean,
standard deviation, min and max, and each policy's paired difference to a reference policy
(the same requests, so the seed-to-seed spread of the workload cancels).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from sloserve.replay.metrics import SloConfig, request_metrics
from sloserve.replay.records import PolicyRun


def run_stats(run: PolicyRun, classes: Mapping[str, str], slo: SloConfig) -> dict[str, Any]:
    """Goodput, attainment (overall, per class) and mean k of one run."""
    per = [request_metrics(r, slo, itls=False) for r in run.records]
    met = {m.request_id: all(m.meets(1.0)) for m in per}
    duration = max((r.end_s for r in run.records), default=0.0)
    by_class: dict[str, list[bool]] = {}
    for rid, ok in met.items():
        by_class.setdefault(classes.get(rid, "all"), []).append(ok)
    n_met = sum(met.values())
    tpots = [m.tpot_s for m in per if m.tpot_s is not None]
    return {
        "goodput_rps": n_met / duration if duration > 0 else 0.0,
        "attainment": n_met / len(per) if per else 0.0,
        "class_attainment": {c: sum(v) / len(v) for c, v in sorted(by_class.items())},
        "class_goodput_rps": {c: sum(v) / duration if duration > 0 else 0.0
                              for c, v in sorted(by_class.items())},
        "failed": sum(not m.success for m in per),
        "duration_s": duration,
        "throughput_rps": sum(m.success for m in per) / duration if duration > 0 else 0.0,
        "tpot_p50_ms": 1000.0 * float(np.median(tpots)) if tpots else None,
        "mean_k": mean_k(run),
        # per request, in the run's order: [class, TTFT ms, TPOT ms (None: one token or
        # failed), met both SLOs], to see which requests a policy kept and by how much
        "requests": [[classes.get(m.request_id, "all"), _ms(m.ttft_s), _ms(m.tpot_s),
                      met[m.request_id]] for m in per],
    }


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(1000.0 * seconds, 1)


def mean_k(run: PolicyRun) -> float | None:
    stats = run.spec_stats
    if stats is None or not stats.timeseries:
        return None
    bs = np.array([s.batch_size for s in stats.timeseries], dtype=np.float64)
    k = np.array([s.mean_verify_len for s in stats.timeseries])
    return float((bs * k).sum() / bs.sum()) if bs.sum() else None


def spread(values: Sequence[float]) -> dict[str, float]:
    v = np.asarray(values, dtype=np.float64)
    return {"mean": float(v.mean()), "std": float(v.std(ddof=1)) if v.size > 1 else 0.0,
            "min": float(v.min()), "max": float(v.max()), "n": int(v.size)}


def aggregate(runs: Sequence[Mapping[str, Any]], reference: str) -> dict[str, Any]:
    """runs: {"policy", "seed", "stats"} of one load; per policy the spread of each number
    over seeds, and its paired goodput difference to `reference` (fraction of the
    reference's goodput, per seed)."""
    by_policy: dict[str, dict[int, Mapping[str, Any]]] = {}
    for r in runs:
        by_policy.setdefault(r["policy"], {})[r["seed"]] = r["stats"]
    ref = by_policy.get(reference, {})
    out: dict[str, Any] = {}
    for policy, seeds in by_policy.items():
        stats = list(seeds.values())
        classes = sorted(stats[0]["class_attainment"])
        d: dict[str, Any] = {
            "goodput_rps": spread([s["goodput_rps"] for s in stats]),
            "attainment": spread([s["attainment"] for s in stats]),
            "class_attainment": {c: spread([s["class_attainment"].get(c, 0.0) for s in stats])
                                 for c in classes},
            "mean_k": (spread([s["mean_k"] for s in stats])
                       if all(s["mean_k"] is not None for s in stats) else None),
        }
        paired = [(seeds[k]["goodput_rps"] - ref[k]["goodput_rps"]) / ref[k]["goodput_rps"]
                  for k in seeds if k in ref and ref[k]["goodput_rps"] > 0]
        d["vs_reference"] = spread(paired) if paired else None
        out[policy] = d
    return out
