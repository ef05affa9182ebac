"""Replays a SPECSERVE server's timings lines (`--spec-timings`, the SGLang bench's
`--timings`) through the online cost correction (estimator/online_cost.py) and reports what
it priced against what the steps measured: per batch size, the fitted theta_verify and
verify path v, the price of verifying one and two tokens a request over the decode forward
against the measured medians of those steps, and the fit's step-ahead error.

    python -m sloserve.bench.price_replay --profile PROFILE.json \
        out/RUN_logs/sloserve.timings.jsonl [--clip 1.1] [--forget 0.99] [--out out/x.json]

The fit gets each step's features as the SpecServe policy builds them (both through
`CostModel.fit_features`: the target forward's profiled seconds at the step's context and
batch, the verified tokens past the target's knee at the profile's price a token at that
batch),
so with the defaults it reproduces the server's own scales (each line's "theta" and
"verify_fixed", reported as the largest difference). Seconds, not a benchmark: it runs in
a second and reads only the files it is given."""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import numpy as np

from sloserve.bench.common import print_table, write_json
from sloserve.estimator.cost_model import CostModel
from sloserve.estimator.online_cost import BatchCorrections, StepCostCorrection
from sloserve.estimator.profile_file import read_profile

MIN_STEPS = 5  # steps of one (batch, verified) shape before its median is reported


def features(cost: CostModel, line: dict) -> tuple[float, float, bool]:
    """(profiled target forward seconds less its verified tokens, the verified tokens'
    profiled seconds, whether the step verified any) of one timings line."""
    batch, verified = int(line["batch"]), int(line["verified"])
    plain, tokens = cost.fit_features(float(line["context"]), float(batch), batch, verified)
    return plain, tokens, verified > 0


def replay(cost: CostModel, lines: list[dict], *, clip: float = 2.0,
           forget: float = 0.98, anchor: float = 0.0) -> dict:
    """The correction fed the decode steps of `lines` in order (cold ones left out, as the
    policy leaves them out: a shape's first run), one fit per band of batch sizes as the
    policy keeps them (BatchCorrections), and per batch size what it priced and what was
    measured."""
    bands = BatchCorrections(lambda: StepCostCorrection(
        verify_fixed=cost.verify_fixed, clip=clip, forget=forget, anchor=anchor))
    errors: list[float] = []
    # the largest |scale - the server's logged scale| (v in milliseconds)
    off_server = 0.0
    per_batch: dict[int, dict[str, list]] = {}
    for line in lines:
        if line.get("verify", 0.0) <= 0.0 or line.get("step", 0.0) <= 0.0 or line.get("cold"):
            continue
        batch, verified = int(line["batch"]), int(line["verified"])
        corr = bands.for_batch(batch)  # the policy's fit of the step's batch band
        plain, tokens, verifies = features(cost, line)
        predicted = (corr.theta_target * plain
                     + (corr.theta_verify * tokens + corr.verify_fixed if verifies else 0.0))
        errors.append(line["verify"] / predicted - 1.0)
        corr.observe(plain + tokens, 0.0, float(line["step"]), None,
                     measured_target=float(line["verify"]), overhead=cost.overhead,
                     verify_part=tokens if verifies else None)
        if "theta" in line:
            off_server = max(off_server, abs(corr.theta_verify - line["theta"][1]),
                             abs(corr.theta_target - line["theta"][0]))
        if "verify_fixed" in line:  # (the worker logs it in seconds, rounded to 1 us)
            off_server = max(off_server, abs(corr.verify_fixed - line["verify_fixed"]) / 1e-3)
        b = per_batch.setdefault(batch, {"theta_verify": [], "v": [], "price1": [],
                                         "price2": [], "measured": []})
        b["theta_verify"].append(corr.theta_verify)
        b["v"].append(corr.verify_fixed)
        b["measured"].append((verified, float(line["verify"])))
        for n, key in ((1, "price1"), (2, "price2")):  # n tokens a request
            paid = max(0.0, n * batch - max(0.0, cost.target.q0 - batch))
            b[key].append(corr.theta_verify * cost.token_time(batch) * paid + corr.verify_fixed)
    out: dict = {"steps": len(errors), "clip": clip, "forget": forget, "anchor": anchor,
                 "error_median": _q(np.abs(errors), 50), "error_mean": float(np.mean(
                     np.abs(errors))) if errors else None,
                 "off_server": off_server, "batches": {}}
    for batch, b in sorted(per_batch.items()):
        by_count: dict[int, list[float]] = {}
        for verified, seconds in b["measured"]:
            by_count.setdefault(verified, []).append(seconds)
        base = by_count.get(0, [])
        row = {"steps": len(b["measured"]),
               "theta_verify": _pcts(b["theta_verify"]), "v": _pcts(b["v"]),
               "price1": _pcts(b["price1"]), "price2": _pcts(b["price2"])}
        for n, key in ((1, "measured1"), (2, "measured2")):
            same = by_count.get(n * batch, [])
            row[key] = (statistics.median(same) - statistics.median(base)
                        if len(same) >= MIN_STEPS and len(base) >= MIN_STEPS else None)
        out["batches"][batch] = row
    return out


def _q(x: np.ndarray, q: float) -> float | None:
    return float(np.percentile(x, q)) if len(x) else None


def _pcts(x: list[float]) -> list[float]:
    """p10, p50, p90."""
    return [float(v) for v in np.percentile(x, [10, 50, 90])] if x else []


def _ms(p: list[float]) -> str:
    return " / ".join(f"{1e3 * v:.1f}" for v in p) if p else "-"


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m sloserve.bench.price_replay",
                                description=__doc__.split("\n\n")[0], allow_abbrev=False)
    p.add_argument("timings", nargs="+", help="timings files (JSON lines, one per step)")
    p.add_argument("--profile", required=True, help="the cost profile the server priced with")
    p.add_argument("--clip", type=float, default=2.0, help="the correction's sample clip")
    p.add_argument("--forget", type=float, default=0.98,
                   help="the correction's forgetting factor")
    p.add_argument("--anchor", type=float, default=0.0,
                   help="the slow fit's forgetting factor the windowed fit's priors follow "
                        "(0: off, the profile's priors)")
    p.add_argument("--out", default=None, help="write the results as JSON here")
    args = p.parse_args(argv)
    if not args.clip > 1.0:
        p.error(f"argument --clip: must be > 1, got {args.clip}")
    if not 0.0 < args.forget <= 1.0:
        p.error(f"argument --forget: must be in (0, 1], got {args.forget}")
    if not (args.anchor == 0.0 or args.forget <= args.anchor <= 1.0):
        p.error(f"argument --anchor: must be 0 or in [--forget, 1], got {args.anchor}")
    try:
        cost = read_profile(args.profile).cost_model()
    except (OSError, ValueError, KeyError) as e:
        p.error(f"argument --profile: cannot read {args.profile}: {e}")
    results = {}
    rows = []
    for path in args.timings:
        try:
            lines = [json.loads(t) for t in Path(path).read_text().splitlines() if t.strip()]
        except (OSError, ValueError) as e:
            p.error(f"cannot read timings file {path}: {e}")
        r = results[path] = replay(cost, lines, clip=args.clip, forget=args.forget,
                                   anchor=args.anchor)
        for batch, b in r["batches"].items():
            if b["steps"] < 20:
                continue
            rows.append([Path(path).name, batch, b["steps"],
                         " / ".join(f"{v:.2f}" for v in b["theta_verify"]), _ms(b["v"]),
                         _ms(b["price1"]), _ms([b["measured1"]]) if b["measured1"] else "-",
                         _ms(b["price2"]), _ms([b["measured2"]]) if b["measured2"] else "-",
                         f"{100 * r['error_median']:.1f}%", f"{r['off_server']:.3f}"])
    print(f"the online correction (clip {args.clip}, forget {args.forget}, anchor "
          f"{args.anchor}) replayed; "
          "p10 / p50 / p90 over each batch size's steps, ms; measured: the median verify "
          "forward of the steps verifying that many tokens less the median decode forward")
    print_table(["file", "batch", "steps", "theta_verify", "v ms", "price 1 a request",
                 "measured", "price 2 a request", "measured", "step-ahead |error| median",
                 "max |scale - server's| (v in ms)"], rows)
    if args.out:
        write_json(args.out, {"profile": args.profile, "results": results})


if __name__ == "__main__":
    main()
