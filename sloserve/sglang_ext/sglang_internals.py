"""Every SGLang internal that sloserve patches or imports, in one place, for SGLang 0.5.23 only.

sloserve's SPECSERVE worker lives inside SGLang's scheduler and reaches below SGLang's public
API: it subclasses the STANDALONE worker, replaces three methods of its draft worker, swaps
SGLang's verify sampler and the target's forward for one call, teaches the CPU attention
backend ragged verify lengths, takes the verify outcome where SGLang's result processor
resolves it, and lets SGLang's request parsing accept sloserve's SLO fields. Those names and
signatures change between SGLang releases, so this module imports them all, checks the
installed version first (`require_supported_sglang`) and says what is wrong on another one;
the worker (worker.py) and the draft side (draft_chain.py) take SGLang's names only from
here. Every patch is idempotent and names what it replaces.

Patches, in the order they are applied (each independent of the others' order):

    keep_intel_amx_backend        the platform reports AMX (launcher process)
    install_weight_relayout       after ModelRunner.load_model, a function of the model (the
                                  CPU engine's float32 weights stored column-major)
    register_specserve            the SPECSERVE algorithm, its output streamer, its metrics
    install_ragged_extend_metadata IntelAMXAttnBackend._build_extend_metadata reads a ragged
                                  verify layout
    install_request_slo_fields    TokenizerManager and the HTTP server's contract gate:
                                  sampling_params.tpot_slo / ttft_slo count as
                                  custom_params (sloserve/slo.py reads both)
    install_result_hook           SchedulerBatchResultProcessor._resolve_spec_v2_tokens hands
                                  each resolved result to the worker's `sloserve_verified`
    install_step_clock            (diagnostics, any server) Scheduler.run_batch timed: one
                                  line per decode batch to a file
    replace_methods               a draft worker's prefill / draft / decode-extend methods
    swapped_eagle_sample          (a context) eagle_worker_common.eagle_sample
    swapped_target_forward        (a context) the target worker's forward_batch_generation
"""

from __future__ import annotations

import functools
import importlib.metadata
import inspect
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

SUPPORTED_SGLANG = "0.5.23"


class UnsupportedSGLang(RuntimeError):
    """The installed SGLang is not the version sloserve's SGLang plugin was written for."""


def installed_sglang() -> str | None:
    try:
        return importlib.metadata.version("sglang")
    except importlib.metadata.PackageNotFoundError:
        return None


def require_supported_sglang() -> None:
    """Raise UnsupportedSGLang naming the installed and the supported version unless they
    are the same (the plugin patches SGLang's internals, which change between releases)."""
    found = installed_sglang()
    if found != SUPPORTED_SGLANG:
        raise UnsupportedSGLang(
            f"sloserve's SPECSERVE worker patches SGLang internals and supports sglang=="
            f"{SUPPORTED_SGLANG} only; this python has "
            f"{'no sglang' if found is None else 'sglang==' + found}. Install "
            f"sglang=={SUPPORTED_SGLANG} (bash scripts/sglang_runtime_env.sh) or run "
            f"--spec-policy ar (SGLang without sloserve's speculation)")


require_supported_sglang()

# ----- SGLang's names that the worker and the draft side use (0.5.23 paths)
from sglang.srt.layers.attention.intel_amx_backend import IntelAMXAttnBackend  # noqa: E402
from sglang.srt.managers.scheduler_components.output_streamer import (  # noqa: E402
    SchedulerOutputStreamer,
)
from sglang.srt.managers.utils import GenerationBatchResult  # noqa: E402
from sglang.srt.model_executor.forward_batch_info import (  # noqa: E402
    CaptureHiddenMode,
    ForwardBatch,
    ForwardMode,
)
from sglang.srt.model_executor.forward_context import (  # noqa: E402
    ForwardContext,
    forward_context,
)
from sglang.srt.speculative import eagle_worker_common  # noqa: E402
from sglang.srt.speculative.adaptive_runtime_state import AdaptiveController  # noqa: E402
from sglang.srt.speculative.draft_utils import DraftBackendFactory  # noqa: E402
from sglang.srt.speculative.eagle_info import (  # noqa: E402
    EagleDraftExtendInput,
    EagleDraftInput,
)
from sglang.srt.speculative.eagle_utils import per_step_draft_out_cache_loc  # noqa: E402
from sglang.srt.speculative.eagle_worker_common import (  # noqa: E402
    build_eagle_verify_input,
    prepare_for_draft,
)
from sglang.srt.speculative.ragged_verify import RaggedVerifyLayout  # noqa: E402
from sglang.srt.speculative.standalone_worker_v2 import StandaloneWorkerV2  # noqa: E402

__all__ = [
    "AdaptiveController", "CaptureHiddenMode", "DraftBackendFactory", "EagleDraftExtendInput",
    "EagleDraftInput", "ForwardBatch", "ForwardContext", "ForwardMode",
    "GenerationBatchResult", "RaggedVerifyLayout",
    "SchedulerOutputStreamer", "StandaloneWorkerV2", "activate_rounds",
    "build_eagle_verify_input", "forward_context", "install_ragged_extend_metadata",
    "install_request_slo_fields", "install_result_hook", "install_step_clock",
    "per_step_draft_out_cache_loc",
    "prepare_for_draft", "replace_methods",
    "swapped_eagle_sample", "swapped_target_forward",
]


def _mark(fn: Callable, tag: str) -> Callable:
    setattr(fn, tag, True)
    return fn


def _require(owner: Any, name: str) -> Any:
    """owner.name, or UnsupportedSGLang saying which internal is missing."""
    try:
        return getattr(owner, name)
    except AttributeError:
        raise UnsupportedSGLang(
            f"SGLang internal {getattr(owner, '__name__', type(owner).__name__)}.{name} is "
            f"missing (sloserve supports sglang=={SUPPORTED_SGLANG})") from None


# ----- the launcher and every process: platform facts, the algorithm, its hooks
def keep_intel_amx_backend() -> None:
    """SGLang replaces `--attention-backend intel_amx` with torch_native on CPUs without AMX
    (arg_groups/overrides.py `_attention_backend_platform_fallbacks`), and torch_native
    cannot run speculative decoding. The intel_amx backend only needs the sgl_kernel
    attention ops, which sloserve's CPU shim provides in torch, so report AMX to SGLang's
    platform facts. The layers' own AMX fast paths ask `cpu_has_amx_support()` directly
    and keep using their portable torch code."""
    from sglang.srt.runtime_context import override_platform

    override_platform(has_amx=True).install()


def install_weight_relayout(relayout: Callable[[Any], int]) -> None:
    """After every ModelRunner.load_model (the target's, a draft worker's), relayout(the
    runner's model); logs how many weights it changed."""
    import logging

    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    def _after_load(result: Any, runner: Any, *a: Any, **kw: Any) -> Any:
        changed = relayout(getattr(runner, "model", None))
        logging.getLogger(__name__).info("sloserve plugin: %d weights relaid out by %s",
                                         changed, getattr(relayout, "__name__", relayout))
        return result

    HookRegistry.register("sglang.srt.model_executor.model_runner.ModelRunner.load_model",
                          _after_load, HookType.AFTER)


def register_specserve(worker_class: Callable[[], type],
                       streamer_class: Callable[[], type]) -> None:
    """The SPECSERVE speculative algorithm: STANDALONE's answers to SGLang's predicates, its
    worker (worker_class(), imported lazily in the scheduler process), its output streamer,
    and the per-request recount of SGLang's spec metrics."""
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm
    from sglang.srt.speculative.spec_registry import CustomSpecAlgo, get_spec

    if get_spec("SPECSERVE") is not None:  # loaded twice in one process
        return

    class SpecServeAlgo(CustomSpecAlgo):  # type: ignore[misc]  # SGLang is untyped
        """Answers every predicate SGLang asks of an algorithm (is_*, supports_*, has_*,
        carries_*) as STANDALONE does: a draft model with its own embeddings and LM head,
        no hidden-state capture. (0.5.23's CustomSpecAlgo lacks some the enum has, e.g.
        carries_draft_hidden_states.)"""

    standalone = SpeculativeAlgorithm.STANDALONE
    for attr, value in list(vars(SpeculativeAlgorithm).items()):
        if attr.startswith("_") or not inspect.isfunction(value):
            continue  # members, class- and static methods, dunders
        if attr.startswith(("is_", "supports_", "has_", "carries_")):
            # a predicate: STANDALONE's answer (the enum's compares the member itself)
            setattr(SpecServeAlgo, attr,
                    lambda self, _attr=attr, *a, **kw: getattr(standalone, _attr)(*a, **kw))
        elif not hasattr(CustomSpecAlgo, attr):
            setattr(SpecServeAlgo, attr, value)  # e.g. create_future_map: asks self.is_*()
    # the worker builds a RaggedVerifyLayout per step (per-request verify lengths); SGLang
    # reads this only for its compact ragged CUDA graphs (SGLANG_RAGGED_VERIFY_MODE=compact)
    SpecServeAlgo.supports_ragged_verify = lambda self: True

    @SpeculativeAlgorithm.register("SPECSERVE", supports_overlap=False, spec_class=SpecServeAlgo)
    def _factory(server_args: Any) -> type:
        return worker_class()

    def _output_streamer_class(self: Any) -> type:
        if self.spec_algorithm.is_some() and getattr(self.spec_algorithm, "name", "") == \
                "SPECSERVE":
            return streamer_class()
        return SchedulerOutputStreamer

    HookRegistry.register(
        "sglang.srt.managers.scheduler.Scheduler.get_output_streamer_class",
        _output_streamer_class, HookType.REPLACE)

    def _per_request_spec_metrics(result: Any, manager: Any, meta_info: dict, *a: Any,
                                  **kw: Any) -> Any:
        """SGLang counts verify_ct * (num_draft_tokens - 1) proposed drafts per request (its
        static k); SPECSERVE's requests verify their own k_r per step, listed in
        meta_info["sloserve_draft_steps"], so the rate is recounted from those."""
        steps = meta_info.get("sloserve_draft_steps")
        if steps is None or "spec_verify_ct" not in meta_info:
            return result
        proposed = int(sum(steps))
        meta_info["spec_num_proposed_drafts"] = proposed
        meta_info["spec_accept_rate"] = (
            meta_info.get("spec_num_correct_drafts", 0) / proposed if proposed else 0.0)
        return result

    HookRegistry.register(
        "sglang.srt.managers.tokenizer_manager.TokenizerManager._calculate_spec_decoding_metrics",
        _per_request_spec_metrics, HookType.AFTER)
    install_request_slo_fields()


def install_request_slo_fields() -> None:
    """SGLang's SamplingParams takes no `tpot_slo` / `ttft_slo`, and two places refuse them:
    the HTTP server's contract gate (`http_server.generate_contract_error`, which checks a
    /generate body against SGLang's API schema before anything else reads it: a 400
    "unknown field `tpot_slo`") and the tokenizer manager's SamplingParams(**kwargs). After
    TokenizerManager.__init__ (in the process that parses requests) both are wrapped so
    those keys count as custom_params, where the worker reads them (sloserve.slo); both
    spellings work. (Wrapping only the SamplingParams class, as first done, left the gate,
    which runs earlier, answering 400.)"""
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    def _accept_slo_fields(result: Any, manager: Any, *a: Any, **kw: Any) -> Any:
        _wrap_sampling_params_class(manager)
        _wrap_generate_contract_gate()
        return result

    HookRegistry.register("sglang.srt.managers.tokenizer_manager.TokenizerManager.__init__",
                          _accept_slo_fields, HookType.AFTER)


def _wrap_sampling_params_class(manager: Any) -> None:
    """manager.sampling_params_class(**kwargs) with the SLO keys moved into custom_params."""
    from sloserve.slo import slos_into_custom_params

    cls = _require(manager, "sampling_params_class")
    if getattr(cls, "sloserve_slo_fields", False):
        return

    def make(**kwargs: Any) -> Any:
        return cls(**slos_into_custom_params(kwargs))

    manager.sampling_params_class = _mark(make, "sloserve_slo_fields")


def _wrap_generate_contract_gate() -> None:
    """http_server.generate_contract_error(body) checks the body with each sampling_params'
    SLO keys moved into custom_params (the body itself is not changed: the request object
    was parsed from it already, and the tokenizer manager moves them). Only where SGLang's
    HTTP server is loaded (its module is imported before it makes the tokenizer manager);
    an offline Engine has no gate."""
    import sys

    from sloserve.slo import slos_into_custom_params

    http_server: Any = sys.modules.get("sglang.srt.entrypoints.http_server")
    if http_server is None:
        return
    original = _require(http_server, "generate_contract_error")
    if getattr(original, "sloserve_slo_fields", False):
        return

    def moved(params: Any) -> Any:
        return slos_into_custom_params(params) if isinstance(params, dict) else params

    @functools.wraps(original)
    def gate(body: Any) -> Any:
        if isinstance(body, dict) and "sampling_params" in body:
            params = body["sampling_params"]
            params = [moved(p) for p in params] if isinstance(params, list) else moved(params)
            body = {**body, "sampling_params": params}
        return original(body)

    http_server.generate_contract_error = _mark(gate, "sloserve_slo_fields")


# ----- the scheduler process: the worker's patches
def install_ragged_extend_metadata() -> None:
    """IntelAMXAttnBackend._build_extend_metadata reads a TARGET_VERIFY batch's extend
    lengths from its spec input's RaggedVerifyLayout when it has one (SGLang's CPU backend
    assumes draft_token_num tokens per request)."""
    import torch

    original = _require(IntelAMXAttnBackend, "_build_extend_metadata")
    if getattr(original, "sloserve_ragged", False):
        return

    @functools.wraps(original)
    def build(self: Any, forward_batch: Any) -> Any:
        spec = forward_batch.spec_info
        layout = getattr(spec, "ragged_verify_layout", None)
        if layout is None or not forward_batch.forward_mode.is_target_verify():
            return original(self, forward_batch)
        lens = layout.verify_lens.to(torch.int32)
        tree_mask = None  # topk-1 chains: the kernel's causal mask
        return (forward_batch.seq_lens + lens, lens, layout.extend_start_loc.to(torch.int32),
                tree_mask)

    IntelAMXAttnBackend._build_extend_metadata = _mark(build, "sloserve_ragged")


def install_result_hook() -> None:
    """After SGLang's result processor resolves a spec-v2 decode result (accept lengths on
    the CPU, `result.num_correct_drafts_per_req_cpu` set), hand the result to the model
    worker's `sloserve_verified(result)` when it has one: the step's state travels on the
    result the worker returned, not in a slot of the worker."""
    from sglang.srt.managers.scheduler_components.batch_result_processor import (
        SchedulerBatchResultProcessor,
    )

    original = _require(SchedulerBatchResultProcessor, "_resolve_spec_v2_tokens")
    if getattr(original, "sloserve_result", False):
        return

    @functools.wraps(original)
    def resolve(self: Any, result: Any, batch: Any, *a: Any, **kw: Any) -> Any:
        out = original(self, result, batch, *a, **kw)
        verified = getattr(self.model_worker, "sloserve_verified", None)
        if verified is not None:
            verified(result)
        return out

    SchedulerBatchResultProcessor._resolve_spec_v2_tokens = _mark(resolve, "sloserve_result")


def install_step_clock(path: str) -> None:
    """Time SGLang's scheduler around every decode batch, with or without speculation:
    lines appended to `path` as each call ends (line-buffered: a write per call, a few
    microseconds, on every server alike), times by time.perf_counter (the system-wide
    monotonic clock on Linux), seconds after them:

        R start seconds bs   run_batch of a decode batch of bs requests (the forward, and a
                             speculative worker's drafting and verify)
        E start seconds bs tokens
                             run_batch of any other batch (a prefill of bs requests and
                             tokens new tokens, with a speculative worker's draft prefill)
        P start seconds      process_batch_result of a decode batch (resolving its tokens,
                             streaming them; SPECSERVE's policy learning from the step)
        N start seconds      get_next_batch_to_run (the next batch's preparation: its KV
                             slots reserved, a speculative server's draft-token windows)

    A step's period (one R's start to the next) less its run is the scheduler's own work
    between forwards, and the P and N inside it split that work: what tells a SPECSERVE step
    that drafts nothing from a plain server's decode step (sloserve.bench.step_clock reads
    the file)."""
    from sglang.srt.managers.scheduler import Scheduler

    original = _require(Scheduler, "run_batch")
    if getattr(original, "sloserve_clock", False):
        return
    process = _require(Scheduler, "process_batch_result")
    next_batch = _require(Scheduler, "get_next_batch_to_run")
    out = open(path, "a", buffering=1)  # noqa: SIM115 - open for the process's life

    @functools.wraps(original)
    def run_batch(self: Any, batch: Any, *a: Any, **kw: Any) -> Any:
        t0 = time.perf_counter()
        result = original(self, batch, *a, **kw)
        seconds = time.perf_counter() - t0
        if batch.forward_mode.is_decode():
            out.write(f"R {t0:.6f} {seconds:.6f} {len(batch.reqs)}\n")
        else:
            tokens = getattr(batch, "extend_num_tokens", None) or 0
            out.write(f"E {t0:.6f} {seconds:.6f} {len(batch.reqs)} {tokens}\n")
        return result

    @functools.wraps(process)
    def process_batch_result(self: Any, batch: Any, *a: Any, **kw: Any) -> Any:
        t0 = time.perf_counter()
        result = process(self, batch, *a, **kw)
        if batch.forward_mode.is_decode():
            out.write(f"P {t0:.6f} {time.perf_counter() - t0:.6f}\n")
        return result

    @functools.wraps(next_batch)
    def get_next_batch_to_run(self: Any, *a: Any, **kw: Any) -> Any:
        t0 = time.perf_counter()
        result = next_batch(self, *a, **kw)
        out.write(f"N {t0:.6f} {time.perf_counter() - t0:.6f}\n")
        return result

    Scheduler.process_batch_result = process_batch_result
    Scheduler.get_next_batch_to_run = get_next_batch_to_run
    Scheduler.run_batch = _mark(run_batch, "sloserve_clock")


def replace_methods(obj: Any, **methods: Callable) -> None:
    """obj.name = fn for each (SGLang's methods of one draft worker instance), each name
    checked to exist first."""
    for name, fn in methods.items():
        _require(obj, name)
        setattr(obj, name, fn)


def activate_rounds(controller: Any, rounds: int) -> None:
    """Switch SGLang's AdaptiveController to the pre-built runtime state of `rounds` draft
    steps (its private _activate: the public path asks the policy by batch size)."""
    _require(controller, "_activate")(rounds)


@contextmanager
def swapped_eagle_sample(sample: Callable) -> Iterator[None]:
    """eagle_worker_common.eagle_sample (SGLang's verify acceptance) replaced by `sample`
    for the duration (same signature and return value)."""
    original = _require(eagle_worker_common, "eagle_sample")
    eagle_worker_common.eagle_sample = sample
    try:
        yield
    finally:
        eagle_worker_common.eagle_sample = original


@contextmanager
def swapped_target_forward(target_worker: Any, forward: Callable) -> Iterator[None]:
    """target_worker.forward_batch_generation replaced by `forward` (which may call the
    original, bound) for the duration."""
    _require(target_worker, "forward_batch_generation")
    target_worker.forward_batch_generation = forward
    try:
        yield
    finally:
        del target_worker.forward_batch_generation
