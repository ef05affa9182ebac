"""Load sweep with multi-SLO requests: goodput per policy from low load to overload.

    # the simulator at GPU scale (H100 7B/160M profile), 1-8x the Azure conversation rate
    python -m sloserve.replay.sweep --target sim \
        --profile configs/profiles/gpu/llama-2-7b-hf__llama-160m__cuda-h100-sxm-80gb__bfloat16.json \
        --trace ../shared/data/traces/azure_llm_2023_conv.csv --loads 1,2,4,8 --rate-unit trace \
        --tpot-slo-ms 15 --ttft-slo-ms 1000 --out runs/sweep_sim

    # SGLang's own servers (the real pair, prompt lookup), 0.3-1.5x what plain SGLang
    # sustains; one server at a time (six at ~3.7 GB each do not fit in 24 GB; --servers
    # all keeps every one up and replays each cell on all in turn)
    python -m sloserve.replay.sweep --target sglang --model smollm2 \
        --policies plain,standalone:1,sloserve-ngram:specserve,sloserve-ngram,sloserve-ngram:lut,sloserve-ngram:fixed=3 \
        --default-policy sloserve-ngram \
        --trace ../shared/data/traces/azure_llm_2023_conv.csv --loads 0.3,0.6,1,1.5 \
        --rate-unit ar --seeds 0,1,2 --requests 24 --output-scale 0.25 --output-max 64 \
        --tpot-slo-ms 150 --ttft-slo-ms 4000 --servers one --out runs/sweep_sglang

    # the in-process engine on this CPU (built-in pair), 0.3-1.5x what `ar` sustains
    python -m sloserve.replay.sweep --target inprocess \
        --trace ../shared/data/traces/azure_llm_2023_conv.csv --loads 0.3,0.6,1,1.5 \
        --rate-unit ar --seeds 0,1,2 --requests 200 --input-scale 0.1 --input-max 256 --output-scale 0.25 --output-max 64 \
        --tpot-slo-ms 60 --ttft-slo-ms 2000 --out runs/sweep_cpu

Every (load, seed) cell is `--requests` consecutive trace requests from a seed-chosen start
(sweep_cells.py), lengths scaled, arrivals the trace's own or `--arrivals gamma --cv CV`,
each request with an SLO class drawn from `--mix` (slo_mix.py); every policy replays the
same cells, one run after another. `--rate-unit ar` first measures what `ar` sustains (its
request throughput when the first seed's requests all arrive at once) and sets the loads as
multiples of it; `trace` uses the whole trace's mean rate (ar's capacity is measured and
reported either way). With `--target sglang` the policies are the systems of `python -m
sloserve.bench.sglang_specserve` (plain, standalone:N, sloserve[-ngram][:POLICY[:MODE[:OPTIONS]]]),
each its own SGLang server started by `python -m sloserve.launch --engine sglang`, "plain"
plays ar's part, prompts are Spec-Bench questions in the target's chat template (its
categories round-robin, cut to --prompt-tokens; the trace gives arrivals and output lengths)
and each request's SLOs travel in SGLang's custom_params. Writes sweep.json, sweep.md and plots (sweep_report.py) to --out. It
prints the number of runs first and one line per run with the elapsed time.

A sweep is a long job (the SGLang one ~1 hour on 2 cores): every finished run is appended to
--out/runs.jsonl and the progress written to --out/STATUS as it goes; `--resume` reruns the
same command and skips the runs already there (the command's settings must match those the
checkpoint was started with, --out and --resume aside, and a measured sweep's machine too).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shlex
import sys
import time
from pathlib import Path
from typing import Any

from sloserve.cli.targets import make_target
from sloserve.replay.formats import load_trace
from sloserve.replay.http_target import SGLangHTTPTarget
from sloserve.replay.metrics import SloConfig
from sloserve.replay.prompts import Prompt, PromptSource, SyntheticIdsSource
from sloserve.replay.records import PolicyRun, ReplayRequest
from sloserve.replay.shaping import Scaling
from sloserve.replay.slo_mix import DEFAULT_MIX, parse_mix
from sloserve.replay.sweep_cells import SweepCell, burst, make_cell
from sloserve.replay.sweep_report import SCHEMA, write_sweep
from sloserve.replay.sweep_stats import aggregate, run_stats
from sloserve.replay.trace import describe

DEFAULT_POLICIES = "ar,fixed:1,fixed:3,goodput,lut,adaserve,specserve,specserve-slo"
SGLANG_POLICIES = ("plain,standalone:1,sloserve-ngram:specserve,sloserve-ngram,"
                   "sloserve-ngram:lut,sloserve-ngram:fixed=3")
MAX_SERIES = 400  # time-series points kept per run for the mean-k plot


def floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x.strip()]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(allow_abbrev=False, prog="python -m sloserve.replay.sweep",
                                description=__doc__.split("\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--target", choices=("sim", "inprocess", "sglang"), required=True)
    p.add_argument("--trace", type=Path, required=True)
    p.add_argument("--loads", type=floats, default=[1, 2, 4, 8])
    p.add_argument("--rate-unit", choices=("trace", "ar"), default="trace")
    p.add_argument("--arrivals", choices=("trace", "gamma"), default="trace")
    p.add_argument("--cv", type=float, default=3.0, help="Gamma inter-arrival CV")
    p.add_argument("--seeds", type=lambda s: [int(x) for x in s.split(",")], default=[0, 1, 2])
    p.add_argument("--requests", type=int, default=400, help="requests per cell")
    p.add_argument("--probe-requests", type=int, default=None,
                   help="requests of the capacity probe, all at once (default: --requests); "
                        "the capacity grows with the batch the probe reaches (SGLang plain "
                        "on the real pair: 1.4 req/s with 24, 3.8 with 200), so sweeps of "
                        "different --requests keep one rate unit with the same probe")
    p.add_argument("--mix", default=DEFAULT_MIX, help="SLO classes name:tpot_x:ttft_x[:w],...")
    p.add_argument("--tpot-slo-ms", type=float, default=15.0, help="base TPOT SLO")
    p.add_argument("--ttft-slo-ms", type=float, default=1000.0, help="base TTFT SLO")
    p.add_argument("--policies", default=None,
                   help=f"default: {DEFAULT_POLICIES} (sglang: {SGLANG_POLICIES})")
    p.add_argument("--default-policy", default=None,
                   help="default: specserve-slo (sglang: sloserve-ngram)")
    g = p.add_argument_group("token lengths (recorded in the report)")
    g.add_argument("--input-scale", type=float, default=1.0)
    g.add_argument("--input-max", type=int, default=None)
    g.add_argument("--output-scale", type=float, default=1.0)
    g.add_argument("--output-max", type=int, default=None)
    g = p.add_argument_group("engine / simulator")
    g.add_argument("--profile", default=None, help="cost profile (sim)")
    g.add_argument("--acceptance", default=None, help="acceptance file (sim)")
    g.add_argument("--k-max", type=int, default=8)
    g.add_argument("--dtype", choices=("auto", "float32", "bfloat16"), default="auto",
                   help="weights, activations and KV dtype (auto: bfloat16 where the CPU has "
                   "AVX512-BF16/AMX; the committed CPU profiles are float32)")
    g.add_argument("--max-running-requests", type=int, default=64)
    g.add_argument("--kv-cache-tokens", type=int, default=None,
                   help="default: 65536 in-process, 1048576 simulated")
    g.add_argument("--vocab-size", type=int, default=2048, help="in-process prompt ids")
    g = p.add_argument_group("SGLang servers (--target sglang)")
    g.add_argument("--model", default="smollm2", help="target: a directory or a preset")
    g.add_argument("--draft-model-path", default=None, help="default: the preset's draft")
    g.add_argument("--port", type=int, default=32877, help="the first system's port")
    g.add_argument("--prompt-tokens", type=int, default=256, help="prompts cut to this")
    g.add_argument("--servers", choices=("all", "one"), default="all",
                   help="all: every system's server up at once, each cell replayed on all in "
                        "turn; one: one server at a time, every cell of a system before the "
                        "next (on 24 GB, six or seven SGLang servers fit at once with ~10 GB of swap: "
                        "each run is preceded by four unmeasured requests that page its "
                        "server back in)")
    g.add_argument("--no-warmup", dest="warmup", action="store_false",
                   help="measure each server from its start (default: warmed first by closed "
                        "loops of 2x16 requests at 16 in flight and 2 at 1, as the SGLang "
                        "bench warms: a new batch shape's first steps run long, and "
                        "speculation runs more shapes than plain decoding)")
    g.add_argument("--timings", action="store_true",
                   help="SPECSERVE's servers write a JSON line of times and lengths per decode "
                        "step to --out/server_logs/SYSTEM.timings.jsonl (the launcher's "
                        "--spec-timings)")
    g.add_argument("--step-clock", action="store_true",
                   help="every server's scheduler step clock (any system: "
                        "--out/server_logs/SYSTEM.clock.txt); each run's record and log "
                        "line say where its time between decode steps went (prefills, "
                        "result processing, next-batch preparation)")
    p.add_argument("--out", type=Path, default=Path("runs/sweep"))
    p.add_argument("--no-plots", action="store_true")
    p.add_argument("--resume", action="store_true",
                   help="skip the runs --out/runs.jsonl already holds (same settings)")
    return p


class Sweep:
    """Runs the cells against every policy and collects the per-run numbers."""

    def __init__(self, args: argparse.Namespace) -> None:
        from sloserve.runtime.config import EngineConfig
        from sloserve.runtime.scheduler import SchedulerConfig

        self.args = args
        sglang = args.target == "sglang"
        policies = args.policies or (SGLANG_POLICIES if sglang else DEFAULT_POLICIES)
        self.policies = [x.strip() for x in policies.split(",") if x.strip()]
        self.default = args.default_policy or ("sloserve-ngram" if sglang else "specserve-slo")
        if self.default not in self.policies:
            raise SystemExit(f"--default-policy {self.default} is not in --policies")
        self.reference = "plain" if sglang else "ar"  # whose capacity sets the loads
        if sglang and self.reference not in self.policies:
            raise SystemExit("--target sglang: --policies needs plain (SGLang without "
                             "speculation: the loads are multiples of what it sustains)")
        self.servers = (SGLangServers(args, self.policies, args.servers == "one")
                        if sglang else None)
        kv = args.kv_cache_tokens or (1 << 20 if args.target == "sim" else 65536)
        self.cfg = EngineConfig(
            k_max=args.k_max, kv_cache_tokens=kv, tpot_slo=None, dtype=args.dtype,
            scheduler=SchedulerConfig(max_running_requests=args.max_running_requests))
        self.slo = SloConfig(args.ttft_slo_ms / 1000.0, args.tpot_slo_ms / 1000.0, (1.0,))
        self.t0 = time.time()
        self.window = (0.0, 0.0)  # the last replay's perf_counter start and end

    def source(self) -> PromptSource:
        if self.servers is not None:
            return self.servers.prompts
        if self.args.target == "sim":
            from sloserve.sim.target import LengthOnlySource

            return LengthOnlySource()
        return SyntheticIdsSource(self.args.vocab_size, 10, 64, 0)

    def replay(self, policy: str, seed: int, requests: tuple[ReplayRequest, ...]) -> PolicyRun:
        a = self.args
        target: Any
        if self.servers is not None:
            self.servers.touch(policy)
            self.servers.flush(policy)
            target = SGLangHTTPTarget(self.servers.url(policy), send_slos=True)
        else:
            target = make_target(a.target, policy, engine_config=self.cfg, profile=a.profile,
                                 acceptance=a.acceptance, sim_seed=seed)
        t0 = time.perf_counter()
        records = asyncio.run(target.run(list(requests), None))
        self.window = (t0, time.perf_counter())
        return PolicyRun(policy, tuple(records), target.spec_stats())

    def clock_gaps(self, policy: str) -> dict[str, Any] | None:
        """--step-clock: where the last replay's time between decode steps went on
        `policy`'s server (step_clock.window_gaps), else None."""
        path = self.servers.clocks.get(policy) if self.servers is not None else None
        if path is None:
            return None
        from sloserve.bench.step_clock import read_clock, window_gaps

        return window_gaps(read_clock(path), *self.window)

    def log(self, text: str) -> None:
        print(f"[{time.time() - self.t0:7.1f} s] {text}", flush=True)


class ChatPrompts:
    """A PromptSource of fixed prompts (token ids), one drawn per request."""

    def __init__(self, prompts: list[list[int]]) -> None:
        self.prompts = prompts

    def prompt_for(self, request: Any, rng: Any) -> Prompt:
        ids = self.prompts[int(rng.integers(0, len(self.prompts)))]
        return Prompt(input_ids=tuple(ids), num_tokens=len(ids))


class SGLangServers:
    """One SGLang server per system (bench/sglang_specserve.py's), all started at once (each
    sleeps while idle, so the cells replayed on them in turn meet a quiet machine), or with
    `one_at_a_time` started when first asked for, the one before it stopped."""

    def __init__(self, args: argparse.Namespace, systems: list[str],
                 one_at_a_time: bool = False) -> None:
        from sloserve.bench.sglang_specserve import (
            Server,
            bench_prompts,
            closed_loop,
            file_stem,
            ours,
            sglang_python,
            system_args,
            system_env,
            warm_up,
        )
        from sloserve.runtime.models.presets import resolve_pair
        from sloserve.sglang_ext import STEP_CLOCK_ENV

        target, draft = resolve_pair(args.model, args.draft_model_path, "model")
        assert draft is not None
        ids, _ = bench_prompts(target, args.prompt_tokens, "auto")
        self.prompts = ChatPrompts(ids)
        # before each run, with every server up: four short requests at once, unmeasured.
        # Six or seven servers hold more than this machine's memory and the idle ones are
        # swapped out; without it a run's first prefills paged its server back in
        # (STANDALONE's 0.3x run took 16 s of prefills against plain's 5, 2026-12-07)
        self._touch = (None if one_at_a_time
                       else lambda server: closed_loop(server, ids, 4, 4, 16))
        logs = args.out / "server_logs"
        logs.mkdir(parents=True, exist_ok=True)
        python = sglang_python()
        self.servers: dict[str, Any] = {}
        self.one_at_a_time = one_at_a_time
        self.clocks: dict[str, Path] = {}  # --step-clock: each system's clock file

        def start(i: int, system: str) -> None:
            server_args = system_args(system, target, draft, args.k_max)
            if getattr(args, "timings", False) and ours(system):
                timings = logs / f"{file_stem(system)}.timings.jsonl"
                timings.unlink(missing_ok=True)
                server_args += ["--spec-timings", str(timings.resolve())]
            env = system_env(system)
            if getattr(args, "step_clock", False):
                clock = self.clocks[system] = logs / f"{file_stem(system)}.clock.txt"
                clock.unlink(missing_ok=True)
                env = {**env, STEP_CLOCK_ENV: str(clock.resolve())}
            server = self.servers[system] = Server(python, server_args, args.port + i,
                                                   logs / f"{file_stem(system)}.log", env)
            server.wait()
            if getattr(args, "warmup", True):  # not measured: the bench's warm-up
                warm_up(server, ids, 16, args.output_max or 64)
            print(f"[{system}] server up at {server.url}", flush=True)

        self._start = lambda system: start(systems.index(system), system)
        if one_at_a_time:
            return
        try:
            # one after another: SGLang sizes its KV pool on a CPU from the memory its
            # weights leave free, which servers loading beside it would take
            for i, s in enumerate(systems):
                start(i, s)
        except BaseException:
            self.stop()
            raise

    def url(self, system: str) -> str:
        if system not in self.servers:  # one at a time: the one before goes first
            self.stop()
            self._start(system)
        return str(self.servers[system].url)

    def touch(self, system: str) -> None:
        """With every server up: page the system's server back in before its run (`_touch`)."""
        if self._touch is not None:
            self._touch(self.servers[system])

    def flush(self, system: str) -> None:
        """Empty the system's prefix cache (SGLang's /flush_cache), so that every run
        starts from the same cache whatever ran on the server before it: its KV pool (8,192
        tokens on a CPU) holds ~30 of the pool's prompts, and which depended on the runs
        before (plain's capacity probe, on plain's server alone, left the first cells'
        prompts cached there and nowhere else). SGLang flushes only an idle server: the
        last run's requests may still be leaving it."""
        import urllib.error
        import urllib.request

        url = self.url(system) + "/flush_cache"
        for _ in range(40):
            try:
                with urllib.request.urlopen(urllib.request.Request(url, method="POST"),
                                            timeout=30):
                    return
            except urllib.error.HTTPError as e:
                if e.code != 400:
                    raise
            time.sleep(0.25)
        raise RuntimeError(f"{url}: the server stayed busy for 10 s after a run")

    def stop(self) -> None:
        for server in self.servers.values():
            server.stop()
        self.servers.clear()


def series(run: PolicyRun) -> list[list[float]]:
    ts = run.spec_stats.timeseries if run.spec_stats is not None else ()
    step = max(1, len(ts) // MAX_SERIES)
    return [[s.t_s, s.batch_size, s.mean_verify_len] for s in ts[::step]]


class Checkpoint:
    """Finished runs of a sweep in --out/runs.jsonl (one JSON line each, keyed by load, seed
    and policy; the capacity probe by "probe"), the settings they belong to in
    --out/checkpoint.json, and a one-line STATUS."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.out: Path = args.out
        self.out.mkdir(parents=True, exist_ok=True)
        self.runs_path = self.out / "runs.jsonl"
        # (the servers' timings lines change nothing a run replays)
        settings = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()
                    if k not in ("out", "resume", "no_plots", "timings", "step_clock")}
        if args.target != "sim":  # measured runs of one sweep come from one machine
            from sloserve.bench.common import cpu_model

            settings["machine"] = cpu_model()
        meta = self.out / "checkpoint.json"
        self.done: dict[str, dict[str, Any]] = {}
        if args.resume and meta.exists():
            if json.loads(meta.read_text()) != settings:
                raise SystemExit(f"--resume: {meta} holds another sweep's settings")
            if self.runs_path.exists():
                for line in self.runs_path.read_text().splitlines():
                    if line.strip():
                        rec = json.loads(line)
                        self.done[rec["key"]] = rec
        else:
            self.runs_path.write_text("")
        meta.write_text(json.dumps(settings, sort_keys=True))

    @staticmethod
    def key(load: float | None, seed: int | None, policy: str) -> str:
        return "probe" if load is None else f"{load:g}|{seed}|{policy}"

    def get(self, key: str) -> dict[str, Any] | None:
        return self.done.get(key)

    def put(self, key: str, rec: dict[str, Any]) -> None:
        rec = {"key": key, **rec}
        self.done[key] = rec
        with self.runs_path.open("a") as f:
            f.write(json.dumps(rec) + "\n")

    def status(self, text: str) -> None:
        (self.out / "STATUS").write_text(f"{time.strftime('%Y-%m-%d %H:%M:%S')} {text}\n")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.target == "sim" and not args.profile:
        raise SystemExit("--target sim needs --profile")
    if args.probe_requests is not None and args.probe_requests < 1:
        raise SystemExit(f"--probe-requests must be >= 1, got {args.probe_requests}")
    sweep = Sweep(args)
    try:
        return _run(args, sweep, argv)
    finally:
        if sweep.servers is not None:
            sweep.servers.stop()


def _run(args: argparse.Namespace, sweep: Sweep, argv: list[str] | None) -> int:
    mix = parse_mix(args.mix)
    trace = load_trace(args.trace)
    lengths = Scaling(input_scale=args.input_scale, input_max=args.input_max,
                      output_scale=args.output_scale, output_max=args.output_max)
    source = sweep.source()

    def cell(load: float, seed: int, unit: float, n: int | None = None) -> SweepCell:
        return make_cell(trace, n=n or args.requests, seed=seed, load=load, rate_unit=unit,
                         lengths=lengths, arrivals_cv=args.cv if args.arrivals == "gamma"
                         else None, mix=mix, tpot_s=sweep.slo.tpot_s, ttft_s=sweep.slo.ttft_s,
                         source=source)

    n_runs = 1 + len(args.loads) * len(args.seeds) * len(sweep.policies)
    ref = sweep.reference
    sweep.log(f"{n_runs} runs of {args.requests} requests ({args.target}); "
              f"the first measures {ref}'s capacity")
    ck = Checkpoint(args)
    if ck.done:
        sweep.log(f"resuming: {len(ck.done)} of {n_runs} runs in {ck.runs_path}")
    probed = ck.get("probe")
    if probed is None:
        probe = sweep.replay(ref, args.seeds[0],
                             burst(cell(1.0, args.seeds[0], 1.0, args.probe_requests)))
        probed = {"capacity": run_stats(probe, {}, sweep.slo)["throughput_rps"]}
        ck.put("probe", probed)
    capacity = float(probed["capacity"])

    def record(policy: str, c: SweepCell) -> dict[str, Any]:
        """The run of `policy` on cell c: checkpointed, replayed first if not there yet."""
        key = ck.key(c.load, c.seed, policy)
        rec = ck.get(key)
        if rec is None:
            run = sweep.replay(policy, c.seed, c.requests)
            rec = {"stats": run_stats(run, c.classes, sweep.slo),
                   "series": series(run) if c.seed == args.seeds[0] else None}
            gaps = sweep.clock_gaps(policy)
            if gaps is not None:
                rec["step_clock"] = gaps
                sweep.log(f"{policy} load {c.load:g}x seed {c.seed}: "
                          f"{gaps['decode_steps']} decode steps, {gaps['decode_s']:.1f} s; "
                          f"between them {gaps['gap_s']:.1f} s (prefills "
                          f"{gaps['prefill_s']:.1f}, process {gaps['process_s']:.1f}, next "
                          f"{gaps['next_s']:.1f}, longest {gaps['max_gap_s']:.2f})")
            ck.put(key, rec)
        return rec

    one_at_a_time = sweep.servers is not None and sweep.servers.one_at_a_time
    trace_rate = describe(trace)["rate_rps"] or 0.0
    unit = capacity if args.rate_unit == "ar" else trace_rate
    unit_text = (f"{ref}'s capacity, {capacity:.3g} req/s (all "
                 f"{args.probe_requests or args.requests} requests of "
                 f"seed {args.seeds[0]} at once)" if args.rate_unit == "ar" else
                 f"the trace's mean rate, {trace_rate:.3g} req/s")
    sweep.log(f"{ref} sustains {capacity:.3g} req/s; rate unit: {unit_text}")
    if one_at_a_time:  # every cell of a system before the next (its server started once)
        done = 1
        for policy in sweep.policies:
            for load in args.loads:
                for s in args.seeds:
                    record(policy, cell(load, s, unit))
                    done += 1
                    ck.status(f"[{done}/{n_runs}] load {load:g}x seed {s} {policy}")
                    sweep.log(f"[{done}/{n_runs}] load {load:g}x seed {s} {policy} done")
    loads_out = []
    done = 1
    for load in args.loads:
        runs: list[dict[str, Any]] = []
        ts: dict[str, list] = {}
        cells = [cell(load, s, unit) for s in args.seeds]
        for c in cells:
            for policy in sweep.policies:
                rec = record(policy, c)
                stats = rec["stats"]
                runs.append({"policy": policy, "seed": c.seed, "stats": stats})
                if rec["series"] is not None:
                    ts[policy] = rec["series"]
                done += 1
                line = (f"[{done}/{n_runs}] load {load:g}x seed {c.seed} {policy}: goodput "
                        f"{stats['goodput_rps']:.3f} req/s, attainment "
                        f"{100 * stats['attainment']:.1f}%")
                sweep.log(line)
                ck.status(line)
        agg = aggregate(runs, sweep.default)
        paired = {}
        for p in sweep.policies:
            if p != sweep.default:  # the default's paired gain over p, per seed
                inv = aggregate(runs, p)[sweep.default]["vs_reference"]
                paired[p] = inv
        loads_out.append({"load": load, "rate_rps": load * unit,
                          "x_ar_capacity": load * unit / capacity if capacity else None,
                          "cell_summaries": [c.summary for c in cells],
                          "policies": agg, "paired": paired, "runs": runs, "timeseries": ts})
    cmd = "python -m sloserve.replay.sweep " + " ".join(
        shlex.quote(x) for x in (sys.argv[1:] if argv is None else argv))
    arrivals = "the trace's own" if args.arrivals == "trace" else f"Gamma CV {args.cv:g}"
    report = {
        "schema": SCHEMA,
        "meta": {"command": cmd, "created_unix": time.time(), "target": args.target,
                 "profile": args.profile, "default_policy": sweep.default,
                 "workload": f"{args.trace.name}, {args.requests} consecutive requests per "
                             f"cell from a seed-chosen start; lengths: {lengths.describe()}; "
                             f"arrivals: {arrivals}",
                 "mix": args.mix, "tpot_slo_ms": args.tpot_slo_ms,
                 "ttft_slo_ms": args.ttft_slo_ms, "rate_unit_text": unit_text,
                 "ar_capacity_rps": capacity, "seeds": len(args.seeds),
                 "first_seed": args.seeds[0], "requests_per_cell": args.requests,
                 "wall_s": time.time() - sweep.t0},
        "policies": sweep.policies,
        "classes": [c.name for c in mix],
        "loads": loads_out,
    }
    paths = write_sweep(args.out, report, plots=not args.no_plots)
    ck.status(f"finished: {n_runs} runs; report in {args.out / 'sweep.md'}")
    sweep.log("wrote " + ", ".join(str(p) for p in paths))
    print((args.out / "sweep.md").read_text())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
