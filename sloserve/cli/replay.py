"""Trace replay CLI: shape a trace, replay it per policy against a target, write a report.

    python -m sloserve.replay --trace ../shared/data/traces/azure_llm_2023_conv.csv \
        --duration-s 300 --target-rate 0.5,1,2 --input-scale 0.1 --input-max 1024 \
        --output-max 256 --prompts synthetic-ids --vocab-size 32000 \
        --policies ar,specserve --target http --url ar=http://127.0.0.1:30000 \
        --url specserve=http://127.0.0.1:30001 --out runs/replay
    python -m sloserve.replay --synthetic gamma --arrival-rate 2 --cv 2 --num-requests 200 \
        --dry-run

Every shaping option is recorded in the report; --dry-run prints the shaped workloads only.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from sloserve.cli.targets import TARGET_KINDS, make_target
from sloserve.replay.formats import FORMATS, load_trace
from sloserve.replay.metrics import SloConfig
from sloserve.replay.prompts import PromptSource, SyntheticIdsSource, SyntheticTextSource
from sloserve.replay.report import Cell, write_report
from sloserve.replay.runner import run_policies
from sloserve.replay.shaping import Scaling
from sloserve.replay.specbench import SpecBenchSource, load_spec_bench
from sloserve.replay.synthetic import gamma_arrivals, parse_length_dist, synthetic_trace
from sloserve.replay.targets import Target
from sloserve.replay.trace import TraceRequest
from sloserve.replay.workload import Workload, load_levels, make_workload
from sloserve.runtime.models.presets import default_drafter


def floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x.strip()]


def names(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        allow_abbrev=False, prog="python -m sloserve.replay", description=__doc__.split(
        "\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    g = p.add_argument_group("trace (a file, or a synthetic one)")
    src = g.add_mutually_exclusive_group(required=True)
    src.add_argument("--trace", type=Path, action="append",
                     help="trace file; repeat for several traces (each gets every load level)")
    src.add_argument("--synthetic", choices=("poisson", "gamma"), help="generate arrivals")
    g.add_argument("--trace-format", default="auto", choices=("auto", *FORMATS))
    g.add_argument("--trace-name", action="append",
                   help="label in reports, one per --trace in order; the file stem if unset")
    g.add_argument("--arrival-rate", type=float, default=2.0, help="synthetic req/s")
    g.add_argument("--cv", type=float, default=2.0, help="gamma inter-arrival CV")
    g.add_argument("--num-requests", type=int, default=200, help="synthetic request count")
    g.add_argument("--input-len", default="lognormal:128:0.6:16:1024", type=parse_length_dist,
                   help="synthetic input lengths: fixed:N | uniform:LO:HI | "
                        "lognormal:MEDIAN:SIGMA[:LO:HI]")
    g.add_argument("--output-len", default="lognormal:64:0.6:8:512", type=parse_length_dist)
    g.add_argument("--synthetic-categories", type=names, default=None,
                   help="comma list of categories drawn uniformly for synthetic requests")

    g = p.add_argument_group("shaping (recorded in every report)")
    g.add_argument("--start-s", type=float, default=0.0, help="window start in trace seconds")
    g.add_argument("--duration-s", type=float, default=None, help="window length (s)")
    load = g.add_mutually_exclusive_group()
    load.add_argument("--time-scale", type=floats, default=[],
                      help="comma list: arrival time multipliers, one load level each")
    load.add_argument("--target-rate", type=floats, default=[],
                      help="comma list: req/s, one load level each (sets the time scale)")
    g.add_argument("--input-scale", type=float, default=1.0)
    g.add_argument("--output-scale", type=float, default=1.0)
    g.add_argument("--input-min", type=int, default=1)
    g.add_argument("--input-max", type=int, default=None)
    g.add_argument("--output-min", type=int, default=1)
    g.add_argument("--output-max", type=int, default=None)
    g.add_argument("--max-requests", type=int, default=None)
    g.add_argument("--seed", type=int, default=0)

    g = p.add_argument_group("prompts")
    g.add_argument("--prompts", default="synthetic-ids",
                   choices=("synthetic-ids", "synthetic-text", "spec-bench"))
    g.add_argument("--vocab-size", type=int, default=32000, help="synthetic-ids id range end")
    g.add_argument("--id-low", type=int, default=0, help="synthetic-ids id range start")
    g.add_argument("--prefix-block-tokens", type=int, default=None,
                   help="synthetic-ids: tokens per Mooncake hash block (default: "
                        "512 x input scale)")
    g.add_argument("--spec-bench", type=Path, help="Spec-Bench question.jsonl")
    g.add_argument("--prompt-categories", type=names, default=None,
                   help="comma list of Spec-Bench categories / tasks allowed")
    g.add_argument("--tokenizer", type=Path, help="local HF tokenizer dir (synthetic-text, "
                                                  "spec-bench lengths)")
    g.add_argument("--match-length", action="store_true",
                   help="spec-bench: repeat/truncate prompts to the trace input length")

    g = p.add_argument_group("SLOs and policies")
    g.add_argument("--ttft-slo-ms", type=float, default=200.0)
    g.add_argument("--tpot-slo-ms", type=float, default=30.0)
    g.add_argument("--slo-scales", type=floats, default=[0.8, 0.9, 1.0, 1.1, 1.2, 1.3, 1.4])
    g.add_argument("--policies", type=names, default=["ar"], help="comma list, run in order")
    g.add_argument("--baseline", default="ar", help="policy the speedup is relative to")

    g = p.add_argument_group("target")
    g.add_argument("--target", default="http", choices=TARGET_KINDS)
    g.add_argument("--url", action="append", default=[],
                   help="server base URL, or POLICY=URL per policy (repeatable)")
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--timeout-s", type=float, default=None, help="per-request timeout")
    g.add_argument("--max-concurrency", type=int, default=None)

    g = p.add_argument_group("in-process engine (--target inprocess)")
    g.add_argument("--model-path", "--model", default=None, help="target model: a directory "
                   "or a preset (builtin, smollm2; default: builtin)")
    g.add_argument("--draft-model-path", default=None, help="draft model directory "
                   "(default: the preset's own)")
    g.add_argument("--drafter", default=None, choices=["model", "ngram"],
                   help="default: model where the target has a draft, else ngram")
    g.add_argument("--k-max", type=int, default=8)
    g.add_argument("--dtype", choices=("auto", "float32", "bfloat16"), default="auto",
                   help="weights, activations and KV dtype (auto: bfloat16 where the CPU has "
                   "AVX512-BF16/AMX; the committed CPU profiles are float32)")
    g.add_argument("--max-running-requests", type=int, default=64)
    g.add_argument("--kv-cache-tokens", type=int, default=65536)
    g.add_argument("--engine-slo", choices=["on", "off"], default="on",
                   help="give the engine the base TPOT SLO (--tpot-slo-ms) as its default")

    g = p.add_argument_group("simulator (--target sim; also uses the in-process engine options)")
    g.add_argument("--profile", default=None, help="cost profile file (e.g. configs/profiles/"
                                                   "gpu/*.json or one the profiler wrote)")
    g.add_argument("--acceptance", default=None,
                   help="acceptance file: calibration bins (out/bench_builtin_pair.json), a "
                        "sloserve.sim.acceptance file or logged pairs (default: the built-in "
                        "pair's calibration)")
    g.add_argument("--max-context", type=int, default=None,
                   help="simulated context window: longer prompts fail, outputs stop there")
    g.add_argument("--sim-workers", type=int, default=1,
                   help="simulate the policies in this many processes (results identical)")

    g = p.add_argument_group("output")
    g.add_argument("--out", type=Path, default=Path("runs/replay"), help="report directory")
    g.add_argument("--no-plots", action="store_true")
    g.add_argument("--no-records", action="store_true", help="skip raw records.jsonl")
    g.add_argument("--no-progress", action="store_true")
    g.add_argument("--write-trace", type=Path, help="also write each shaped trace as native "
                                                    "JSONL into this directory")
    g.add_argument("--dry-run", action="store_true", help="print the workloads and exit")
    return p


def base_traces(args: argparse.Namespace) -> list[tuple[str, list[TraceRequest]]]:
    """Every --trace (or the synthetic one), with its report label."""
    if args.trace:
        names = list(args.trace_name or [])
        if len(names) > len(args.trace):
            raise SystemExit("more --trace-name than --trace")
        names += [t.stem for t in args.trace[len(names):]]
        return [(n, load_trace(t, args.trace_format)) for n, t in zip(names, args.trace)]
    return [base_trace(args)]


def base_trace(args: argparse.Namespace) -> tuple[str, list[TraceRequest]]:
    rng = np.random.default_rng(args.seed)
    cv = 1.0 if args.synthetic == "poisson" else args.cv
    arrivals = gamma_arrivals(args.arrival_rate, cv, args.num_requests, rng)
    trace = synthetic_trace(arrivals, args.input_len, args.output_len, rng,
                            args.synthetic_categories)
    default = f"{args.synthetic}_cv{cv:g}_r{args.arrival_rate:g}_n{args.num_requests}"
    return (args.trace_name or [default])[0], trace


def prompt_source(args: argparse.Namespace) -> PromptSource:
    if args.prompts == "synthetic-ids" and args.target == "sim":  # the sim needs lengths only
        from sloserve.sim.target import LengthOnlySource

        return LengthOnlySource()
    if args.prompts == "synthetic-ids":
        block = args.prefix_block_tokens or max(1, round(512 * args.input_scale))
        return SyntheticIdsSource(args.vocab_size, args.id_low, block, args.seed)
    tokenizer = _load_tokenizer(args.tokenizer) if args.tokenizer else None
    if args.prompts == "synthetic-text":
        if tokenizer is None:
            raise SystemExit("--prompts synthetic-text needs --tokenizer")
        return SyntheticTextSource(lambda text: len(tokenizer.encode(text)))
    if args.spec_bench is None:
        raise SystemExit("--prompts spec-bench needs --spec-bench PATH")
    return SpecBenchSource(load_spec_bench(args.spec_bench), args.prompt_categories,
                           tokenizer.encode if tokenizer else None, args.match_length)


def _load_tokenizer(path: Path) -> Any:  # a transformers tokenizer, imported lazily
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path), local_files_only=True)


def policy_urls(urls: list[str], policies: list[str]) -> dict[str, str | None]:
    """--url values -> {policy: url}: a bare URL serves every policy without its own."""
    by_policy = dict(u.split("=", 1) for u in urls if "=" in u.split("://", 1)[0])
    bare = [u for u in urls if "=" not in u.split("://", 1)[0]]
    if len(bare) > 1:
        raise SystemExit("give at most one bare --url; use POLICY=URL for several")
    unknown = sorted(set(by_policy) - set(policies))
    if unknown:
        raise SystemExit(f"--url for unknown policies {unknown}")
    return {p: by_policy.get(p, bare[0] if bare else None) for p in policies}


def workloads(args: argparse.Namespace) -> list[Workload]:
    return [w for name, trace in base_traces(args) for w in trace_workloads(args, name, trace)]


def trace_workloads(args: argparse.Namespace, name: str, trace: list[TraceRequest]) -> list[Workload]:
    base = Scaling(
        start_s=args.start_s, duration_s=args.duration_s, input_scale=args.input_scale,
        output_scale=args.output_scale, input_min=args.input_min, input_max=args.input_max,
        output_min=args.output_min, output_max=args.output_max,
        max_requests=args.max_requests, seed=args.seed,
    )
    levels = load_levels(trace, base, time_scales=args.time_scale,
                         target_rates=args.target_rate)
    source = prompt_source(args)
    return [make_workload(name, trace, label, scaling, source) for label, scaling in levels]


def engine_config(args: argparse.Namespace):
    """The in-process engine's config (policy set per target)."""
    from sloserve.runtime.config import EngineConfig
    from sloserve.runtime.scheduler import SchedulerConfig

    return EngineConfig(
        model_path=args.model_path, draft_model_path=args.draft_model_path,
        drafter=args.drafter or default_drafter(args.model_path), k_max=args.k_max, kv_cache_tokens=args.kv_cache_tokens, dtype=args.dtype,
        tpot_slo=args.tpot_slo_ms / 1000.0 if args.engine_slo == "on" else None,
        scheduler=SchedulerConfig(max_running_requests=args.max_running_requests),
    )


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    cells_in = workloads(args)
    for w in cells_in:
        print(f"[{w.trace_name} / {w.load}] {w.scaling.describe()}")
        print(f"    replayed trace: {json.dumps(w.summary())}")
        if args.write_trace:
            from sloserve.replay.formats import write_native

            args.write_trace.mkdir(parents=True, exist_ok=True)
            slug = w.load.replace("/", "").replace(" ", "_").replace("=", "")
            write_native(args.write_trace / f"{w.trace_name}_{slug}.jsonl", w.trace)
    if args.dry_run:
        return 0
    slo = SloConfig(args.ttft_slo_ms / 1000.0, args.tpot_slo_ms / 1000.0,
                    tuple(args.slo_scales))
    urls = policy_urls(args.url, args.policies)
    try:
        targets: dict[str, Target] = {
            p: make_target(args.target, p, url=urls[p], temperature=args.temperature,
                           timeout_s=args.timeout_s, max_concurrency=args.max_concurrency,
                           engine_config=engine_config(args), profile=args.profile,
                           acceptance=args.acceptance, sim_seed=args.seed,
                           max_context=args.max_context)
            for p in args.policies
        }
    except (NotImplementedError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.target == "sim" and args.sim_workers > 1:
        from sloserve.sim.pool import prerun
        from sloserve.sim.target import SimTarget

        sims = {p: t for p, t in targets.items() if isinstance(t, SimTarget)}  # all of them
        prerun(sims, [w.requests for w in cells_in], args.sim_workers)
    cells = []
    for w in cells_in:
        runs = run_policies(w.requests, targets, show_progress=not args.no_progress)
        cells.append(Cell(w.trace_name, w.load, tuple(runs), w.scaling, w.summary()))
    meta = {"argv": sys.argv if argv is None else argv, "created_unix": time.time(),
            "target": args.target}
    if args.target == "sim":
        meta["sim"] = {"profile": args.profile, "acceptance": args.acceptance or "builtin-pair",
                       "seed": args.seed, "max_context": args.max_context}
    files = write_report(args.out, cells, slo, meta=meta, plots=not args.no_plots,
                         raw_records=not args.no_records)
    print(files.markdown.read_text())
    print(f"report: {files.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
