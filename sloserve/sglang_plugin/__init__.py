"""sloserve's SGLang plugin, loaded by SGLang in each of its processes through the entry point
group `sglang.srt.plugins` (pyproject: `sloserve = "sloserve.sglang_plugin:register"`).

register() must be cheap and safe on any machine: it does nothing unless SGLang runs its CPU
engine without CUDA; then it applies the CPU fixes below. SGLang logs and ignores a plugin
that raises, so a failure here would only surface later as a confusing fallback; register()
therefore raises nothing for unsupported environments and lets real errors propagate.
"""

from __future__ import annotations

import inspect
import logging
import os

logger = logging.getLogger(__name__)


def running_sglang_cpu_engine() -> bool:
    """SGLang's CPU engine is on (SGLANG_USE_CPU_ENGINE=1, which makes its is_cpu() true) and
    no CUDA device is usable."""
    if os.environ.get("SGLANG_USE_CPU_ENGINE", "0") != "1":
        return False
    import torch

    return not torch.cuda.is_available()


def _keep_intel_amx_backend() -> None:
    """SGLang replaces `--attention-backend intel_amx` with torch_native on CPUs without AMX
    (sglang/srt/arg_groups/overrides.py `_attention_backend_platform_fallbacks`), and
    torch_native cannot run speculative decoding. The intel_amx backend only needs the
    sgl_kernel attention ops, which sloserve's CPU shim provides in torch, so report AMX to
    SGLang's platform facts. The layers' own AMX fast paths ask `cpu_has_amx_support()`
    directly and keep using their portable torch code."""
    from sglang.srt.runtime_context import override_platform

    override_platform(has_amx=True).install()


def _register_specserve() -> None:
    """The SPECSERVE speculative algorithm: SGLang's STANDALONE worker (the user's draft
    model) whose draft length sloserve's SpecServe controller picks for every decode batch
    (worker.py), and the output streamer that puts its decisions in meta_info."""
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm
    from sglang.srt.speculative.spec_registry import CustomSpecAlgo, get_spec

    if get_spec("SPECSERVE") is not None:  # loaded twice in one process
        return

    class SpecServeAlgo(CustomSpecAlgo):
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
    SpecServeAlgo.supports_ragged_verify = lambda self: True  # type: ignore[method-assign]

    @SpeculativeAlgorithm.register("SPECSERVE", supports_overlap=False, spec_class=SpecServeAlgo)
    def _factory(server_args):
        from sloserve.sglang_plugin.worker import SpecServeWorker

        return SpecServeWorker

    def _output_streamer_class(self):
        if self.spec_algorithm.is_some() and getattr(self.spec_algorithm, "name", "") == \
                "SPECSERVE":
            from sloserve.sglang_plugin.worker import SpecServeOutputStreamer

            return SpecServeOutputStreamer
        from sglang.srt.managers.scheduler_components.output_streamer import (
            SchedulerOutputStreamer,
        )

        return SchedulerOutputStreamer

    HookRegistry.register(
        "sglang.srt.managers.scheduler.Scheduler.get_output_streamer_class",
        _output_streamer_class, HookType.REPLACE)

    def _per_request_spec_metrics(result, manager, meta_info, recv_obj, i, *a, **kw):
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


def register() -> None:
    if running_sglang_cpu_engine():
        _keep_intel_amx_backend()
        logger.info("sloserve plugin: SGLang CPU engine fixes applied (intel_amx kept)")
    _register_specserve()
