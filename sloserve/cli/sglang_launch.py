"""`python -m sloserve.launch --engine sglang [options] [SGLang's own options]`: SGLang's own
server (`sglang.launch_server`) with sloserve's SPECSERVE speculative algorithm.

sloserve's options are taken here and turned into SGLang's: the model pair (the built-in pair
when none is given), `--drafter` (the draft model, or prompt lookup: the built-in engine's
default, per preset), `--tpot-slo` (the default SLO), `--spec-policy` (any policy of
sloserve.policies.registry, or ar: SGLang without speculation, the reference), `--k-max`
(the most draft steps per batch), `--spec-options`, `--host`, `--port`, with the built-in
engine's defaults (sloserve/spec_config.py), and the request limits `--max-n`,
`--max-batch-prompts`, `--max-top-logprobs-num`; the worker's settings travel to SGLang's
processes as one serialised WorkerConfig (settings.py). Every other
option (`--chat-template`, `--tokenizer-path`, `--api-key`, ...) goes to SGLang unchanged;
none is abbreviated, and a busy port is an error before anything loads. On a machine without CUDA the CPU engine's flags and the
sgl_kernel stand-in are added (cpu_server.py). Must run in a python with SGLang's runtime
installed (scripts/sglang_runtime_env.sh prints one).

SGLang's server runs as a child on a loopback port behind a thin front (front.py) on --host /
--port that checks request bodies first (request_guard.py: values that stop SGLang's server,
and the limits); `--no-request-guard` replaces this process by SGLang's server instead.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import logging
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from sloserve.listen import ListenError, check_free, reserve_loopback_port
from sloserve.policies.registry import (
    SPEC_GRAMMAR,
    SpeculationSettingError,
    check_speculation,
)
from sloserve.sglang_cpu.cpu_server import (
    CPUServerConfig,
    SpecConfig,
    cuda_available,
    server_command,
    server_env,
)
from sloserve.sglang_ext import settings
from sloserve.sglang_ext.cpu_weights import draft_dtype_from_env, layout_from_env
from sloserve.sglang_ext.guard_limits import GuardLimits
from sloserve.spec_config import DEFAULTS, SpeculationConfig
from sloserve.units import duration

# the version sglang_internals.py supports (not imported from there: it imports SGLang)
SUPPORTED_SGLANG = "0.5.23"

SGLANG_VERSION = SUPPORTED_SGLANG


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(",") if x.strip())


def sglang_runtime_available() -> bool:
    """SGLang's server runtime is installed here (not only its frontend language)."""
    try:
        return importlib.metadata.version("sglang") == SGLANG_VERSION and bool(
            importlib.metadata.version("sglang-kernel"))
    except importlib.metadata.PackageNotFoundError:
        return False


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m sloserve.launch --engine sglang", allow_abbrev=False,
        description="SGLang's server with sloserve's SPECSERVE speculation; options not "
                    "listed here go to SGLang's launch_server unchanged")
    p.add_argument("--model-path", "--model", default=None,
                   help="target model: a directory or a preset (builtin, smollm2; default: "
                   "builtin)")
    p.add_argument("--draft-model-path", default=None,
                   help="draft model: a directory or a preset (default: the preset's own)")
    p.add_argument("--drafter", choices=settings.DRAFTERS, default=None,
                   help="model: the draft model; ngram: prompt lookup over each request's "
                        "own tokens (SGLang's draft worker still loads a model, the draft's "
                        "or else the target, and never runs it). Default: the built-in "
                        "engine's (the preset's choice; model with --draft-model-path)")
    p.add_argument("--tpot-slo", type=duration, default=DEFAULTS.tpot_slo,
                   help="default TPOT SLO, e.g. 30ms (a request's own: tpot_slo in its "
                        "sampling params, or custom_params.tpot_slo)")
    p.add_argument("--spec-policy", default=DEFAULTS.policy,
                   help=f"{SPEC_GRAMMAR}; ar: SGLang without speculation")
    p.add_argument("--k-max", type=int, default=DEFAULTS.k_max,
                   help="most draft steps per batch")
    p.add_argument("--spec-options", default="",
                   help="the policy's options, name=value,... (SpecServeOptions fields)")
    p.add_argument("--spec-lengths", choices=settings.LENGTHS, default=None,
                   help="uniform: one draft length per batch; per-request: the plan stops "
                        "drafting round by round and each request verifies its own length; "
                        "trim: one draft length per batch, each request's verify trimmed "
                        "from the draft's confidences. With --drafter ngram per-request and "
                        "trim look the whole chain up first and verify each request's own "
                        "length. Default: per-request")
    p.add_argument("--spec-profile", default=None,
                   help="a profile of SGLang's forwards to use instead of the lookup; none: "
                        "no profile (the estimate from the models' shapes, corrected online)")
    p.add_argument("--spec-step-log", default=None,
                   help="a file that gets one JSON line per per-request step")
    # profiling (python -m sloserve.profiler --engine sglang) and tests only
    p.add_argument("--spec-sweep", type=_ints, default=(), help=argparse.SUPPRESS)
    p.add_argument("--spec-timings", default=None, help=argparse.SUPPRESS)
    p.add_argument("--spec-test-verify-lens", type=_ints, default=(), help=argparse.SUPPRESS)
    p.add_argument("--spec-test-accept-all", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--max-total-tokens", type=int, default=None,
                   help="KV cache tokens (CPU default 8192)")
    g = GuardLimits()
    p.add_argument("--max-n", type=int, default=g.max_n,
                   help="most samples per prompt a request may ask for (n); more: 400")
    p.add_argument("--max-batch-prompts", type=int, default=g.max_batch_prompts,
                   help="most prompts of one batch request, and samples in all; more: 400")
    p.add_argument("--max-top-logprobs-num", type=int, default=g.max_top_logprobs_num,
                   help="most top log-probabilities per token a request may ask for")
    p.add_argument("--no-request-guard", action="store_true",
                   help="serve SGLang's server directly, without the front that checks "
                   "request bodies (front.py): some values then stop SGLang's server")
    return p


def sglang_args(argv: Sequence[str], bind: tuple[str, int] | None = None
                ) -> tuple[list[str], dict[str, str]]:
    """(SGLang's launch_server command, its environment) for sloserve's and SGLang's options.
    bind: the (host, port) SGLang's server listens on, when not --host / --port (behind the
    front)."""
    parser = build_parser()
    args, passthrough = parser.parse_known_args(list(argv))
    if args.k_max < 1:
        parser.error(f"argument --k-max: must be >= 1, got {args.k_max}")
    for name in ("max_n", "max_batch_prompts"):
        if getattr(args, name) < 1:
            parser.error(f"argument --{name.replace('_', '-')}: must be >= 1")
    if args.max_top_logprobs_num < 0:
        parser.error("argument --max-top-logprobs-num: must be >= 0")
    try:  # read again by the plugin in each SGLang process, which could only log it
        layout_from_env()
        draft_dtype_from_env()
    except ValueError as e:
        parser.error(str(e))
    if bind is not None:
        args.host, args.port = bind
    try:
        options = SpeculationConfig.parse_options(args.spec_options)
    except ValueError as e:
        parser.error(f"argument --spec-options: {e}")
    spec_config = SpeculationConfig(policy=args.spec_policy, k_max=args.k_max,
                                    tpot_slo=args.tpot_slo, options=options)
    try:  # the same check as the built-in engine's
        check_speculation(spec_config)
    except SpeculationSettingError as e:
        parser.error(f"argument --spec-{e.setting}: {e}")
    from sloserve.runtime.models.presets import default_drafter, preset_has_draft, resolve_pair

    drafter = args.drafter or ("model" if args.draft_model_path
                               else default_drafter(args.model_path))
    try:
        worker = settings.WorkerConfig(
            spec_config, lengths=args.spec_lengths or settings.default_lengths(drafter),
            drafter=drafter, profile=args.spec_profile,
            sweep=args.spec_sweep, timings=args.spec_timings, step_log=args.spec_step_log,
            test_verify_lens=args.spec_test_verify_lens,
            test_accept_all=args.spec_test_accept_all)
    except ValueError as e:  # the hidden profiling and test switches
        parser.error(f"argument --spec-sweep/--spec-test-verify-lens: {e}")
    # presets (builtin, smollm2) are built or fetched here on first use, before SGLang starts
    wants_draft = args.spec_policy != "ar" and (args.draft_model_path is not None
                                                or preset_has_draft(args.model_path))
    try:
        target, draft = resolve_pair(args.model_path, args.draft_model_path,
                                     "model" if wants_draft else "none")
    except ValueError as e:
        parser.error(f"argument --model-path: {e}")
    spec = None
    if args.spec_policy != "ar":
        if draft is None and drafter == "ngram":
            draft = target  # SGLang's draft worker loads it; the n-gram chains never run it
        if draft is None:
            parser.error("SPECSERVE needs a draft model: --draft-model-path "
                         "(or --drafter ngram, or --spec-policy ar for SGLang without "
                         "speculation)")
        spec = SpecConfig(draft, algorithm="SPECSERVE", num_steps=args.k_max, eagle_topk=1,
                          num_draft_tokens=args.k_max + 1)
    extra = list(passthrough) + (["--disable-overlap-schedule"] if spec else [])
    env = dict(os.environ)
    if spec is not None:  # one serialised value for SGLang's processes
        env[settings.ENV_CONFIG] = worker.to_json()
    python = sys.executable
    if cuda_available():
        cmd = [python, "-m", "sglang.launch_server", "--model-path", target,
               "--host", args.host, "--port", str(args.port)]
        if args.max_total_tokens is not None:
            extra += ["--max-total-tokens", str(args.max_total_tokens)]
        return cmd + (spec.args() if spec else []) + extra, env
    cfg = CPUServerConfig(model_path=target, port=args.port, host=args.host, spec=spec,
                          max_total_tokens=args.max_total_tokens or 8192,
                          extra_args=tuple(extra))
    return server_command(cfg, python), server_env(env)


def main(argv: Sequence[str]) -> int:
    args, _ = build_parser().parse_known_args(list(argv))
    try:  # SGLang binds its own socket, after loading the models: check the port first
        check_free(args.host, args.port)
    except ListenError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if not sglang_runtime_available():
        print("error: --engine sglang needs SGLang's runtime (sglang==0.5.23) in this "
              "python; create its environment with `bash scripts/sglang_runtime_env.sh` and "
              "run with the python it prints last", file=sys.stderr)
        return 2
    # the first start builds the built-in pair: let its log lines (and their times) show
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: "
                        "%(message)s")
    if args.no_request_guard:
        cmd, env = sglang_args(argv)
        print("sloserve: starting SGLang:", " ".join(cmd[1:]), flush=True)
        os.execve(cmd[0], cmd, env)
        return 0  # not reached
    return _serve_guarded(args, argv)


def _serve_guarded(args: argparse.Namespace, argv: Sequence[str]) -> int:
    """SGLang's server on a free loopback port as a child, the front (front.py) on --host /
    --port in this process."""
    import asyncio
    import subprocess

    # held until the front stops: SGLang binds it beside the reservation (listen.py)
    reservation = reserve_loopback_port(avoid=frozenset({args.port}))
    inner = ("127.0.0.1", reservation.getsockname()[1])
    cmd, env = sglang_args(argv, bind=inner)
    limits = GuardLimits(max_n=args.max_n, max_batch_prompts=args.max_batch_prompts,
                         max_top_logprobs_num=args.max_top_logprobs_num,
                         vocab_size=_vocab_size(cmd))
    print(f"sloserve: starting SGLang behind the request guard on {args.host}:{args.port}:",
          " ".join(cmd[1:]), flush=True)
    child = subprocess.Popen(cmd, env=env)
    try:
        # imported while SGLang starts (the guard's grammar checks import xgrammar: seconds)
        from sloserve.sglang_ext.front import serve, upstream_keep_alive

        return asyncio.run(serve(args.host, args.port, f"http://{inner[0]}:{inner[1]}", limits,
                                 child, upstream_keep_alive(env)))
    finally:
        reservation.close()
        if child.poll() is None:
            child.terminate()
            child.wait(30)


def _vocab_size(cmd: list[str]) -> int | None:
    """The target model's vocabulary size, from its config.json (None: unknown)."""
    import json

    try:
        path = Path(cmd[cmd.index("--model-path") + 1]) / "config.json"
        cfg = json.loads(path.read_text())
        return int(cfg.get("vocab_size") or cfg["text_config"]["vocab_size"])
    except (ValueError, IndexError, KeyError, OSError, TypeError):
        return None
