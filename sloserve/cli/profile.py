"""python -m sloserve.profiler: profile draft and target forwards on this device, fit the cost
model T = a*N_ctx + b*max(0, N_q - q0) + c per model, print R^2 and MAPE, record the pair's
confidence -> acceptance outcomes and draft-round cost, write the profile file: next to the
one the engine loads (as <name>.new.json) when there is one, unless --replace (which refuses a
fit with a lower R^2 and exits 1). Prints up front how long the run will take.

    python -m sloserve.profiler --quick            # built-in pair, CPU quick mode (< 2 min)
    python -m sloserve.profiler --model-path M --draft-model-path D --out-dir configs
    python -m sloserve.profiler --engine sglang    # SGLang's own forwards, for SPECSERVE
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from sloserve.estimator.profile_file import profile_path, write_profile
from sloserve.profiler.estimate import estimate, probe
from sloserve.profiler.measure import FULL, QUICK, build_profile, grid_points
from sloserve.profiler.placement import place
from sloserve.runtime.models.presets import default_drafter


def main(argv=None) -> Path:
    ap = argparse.ArgumentParser(
        prog="python -m sloserve.profiler", description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False)
    ap.add_argument("--model-path", "--model", default=None, help="target model: a directory "
                   "or a preset (builtin, smollm2; default: builtin)")
    ap.add_argument("--draft-model-path", default=None, help="draft model directory "
                   "(default: the preset's own)")
    ap.add_argument("--drafter", default=None, choices=["model", "ngram"],
                   help="default: the engine's own for the model (the built-in pair: its "
                        "draft; smollm2: prompt lookup, profiled under the key ngram)")
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--quick", action="store_true", help="small grid (default on CPU)")
    mode.add_argument("--full", action="store_true", help="full grid (batch up to 64, q 1..9)")
    ap.add_argument("--k-max", type=int, default=8)
    ap.add_argument("--dtype", choices=("auto", "float32", "bfloat16"), default="auto",
                   help="weights, activations and KV dtype (auto: bfloat16 where the CPU has "
                   "AVX512-BF16/AMX; the committed CPU profiles are float32)")
    ap.add_argument("--out-dir", default=str(Path(__file__).resolve().parents[2] / "configs"),
                    help="profiles are written to OUT_DIR/profiles/ (default: the repo's configs/)")
    ap.add_argument("--samples-out", default=None, help="also write the raw samples as JSON here")
    ap.add_argument("--replace", action="store_true",
                    help="replace the profile the engine loads (only by a fit whose R^2 is not "
                    "worse); default: write the new one next to it as <name>.new.json")
    args = ap.parse_args(argv)

    from sloserve.runtime.config import EngineConfig
    from sloserve.runtime.engine import Engine
    from sloserve.runtime.scheduler import SchedulerConfig

    eng = Engine(EngineConfig(
        model_path=args.model_path, draft_model_path=args.draft_model_path, drafter=args.drafter or default_drafter(args.model_path),
        dtype=args.dtype, spec_policy="ar", kv_cache_tokens=131072, k_max=args.k_max,
        scheduler=SchedulerConfig(max_running_requests=64, max_step_tokens=8192),
    ))
    full = args.full or (not args.quick and eng.cfg.device != "cpu")
    grid = FULL if full else QUICK
    parts = eng.parts
    points = grid_points(grid, parts.allocator)
    t_probe = probe(parts.target, parts.allocator, points)
    d_probe = probe(parts.draft, parts.allocator, points) if parts.draft is not None else None
    print(f"profiling ({'full' if full else 'quick'} mode): "
          f"{estimate(grid, points, t_probe, d_probe).line()}", flush=True)
    t0 = time.perf_counter()
    profile, samples = build_profile(eng, grid, "full" if full else "quick")
    for name, m in (("target", profile.target), ("draft", profile.draft)):
        if m.fit is None:
            print(f"{name}: {m.name} (no forward pass)")
            continue
        c = m.cost
        print(f"{name}: a={c.a * 1e9:.2f} ns/ctx-token  b={c.b * 1e6:.2f} us/query-token  "
              f"c={c.c * 1e3:.3f} ms  q0={c.q0:g} query tokens   "
              f"R^2={m.fit.r2:.4f}  MAPE={100 * m.fit.mape:.1f}%  "
              f"(n={m.fit.n_samples})")
    print(f"step overhead outside forwards: {profile.overhead * 1e3:.3f} ms")
    where = place(profile, profile_path(args.out_dir, profile), args.replace)
    print(where.message)
    out = write_profile(profile, where.path)
    if args.samples_out:
        Path(args.samples_out).write_text(json.dumps(samples))
    print(f"wrote {out}  ({time.perf_counter() - t0:.0f} s)")
    if where.refused:
        raise SystemExit(1)
    return out


if __name__ == "__main__":
    import sys

    if "--engine" in sys.argv[1:3] and "sglang" in sys.argv[1:3]:  # a separate tool
        from sloserve.cli.sglang_profile import main as sglang_profile

        rest = [a for a in sys.argv[1:] if a not in ("--engine", "sglang")]
        sys.exit(sglang_profile(rest))
    main()
