"""sloserve's SGLang plugin, loaded by SGLang in each of its processes through the entry point
group `sglang.srt.plugins` (pyproject: `sloserve = "sloserve.sglang_ext:register"`).

register() must be cheap and safe on any machine: it does nothing unless SGLang runs its CPU
engine without CUDA; then it applies the CPU fixes below. SGLang logs and ignores a plugin
that raises, so a failure here would only surface later as a confusing fallback; register()
therefore raises nothing for unsupported environments and lets real errors propagate.
"""

from __future__ import annotations

import logging
import os

logger = logging.getLogger(__name__)

# diagnostics: a file that gets one line per decode batch of SGLang's scheduler, any server
# (sglang_internals.install_step_clock; sloserve.bench.step_clock reads it)
STEP_CLOCK_ENV = "SLOSERVE_STEP_CLOCK"


def running_sglang_cpu_engine() -> bool:
    """SGLang's CPU engine is on (SGLANG_USE_CPU_ENGINE=1, which makes its is_cpu() true) and
    no CUDA device is usable."""
    if os.environ.get("SGLANG_USE_CPU_ENGINE", "0") != "1":
        return False
    import torch

    return not torch.cuda.is_available()


def _worker_class() -> type:
    from sloserve.sglang_ext.worker import SpecServeWorker

    return SpecServeWorker


def _streamer_class() -> type:
    from sloserve.sglang_ext.worker import SpecServeOutputStreamer

    return SpecServeOutputStreamer


def register() -> None:
    # every SGLang internal sloserve touches, behind a version check (sglang_internals.py)
    from sloserve.sglang_ext import sglang_internals as sgl

    if running_sglang_cpu_engine():
        from sloserve.sglang_ext.cpu_weights import (
            layout_from_env,
            pack_linear_weights,
            relayout_linear_weights,
        )

        sgl.keep_intel_amx_backend()
        layout = layout_from_env()
        if layout == "column":
            sgl.install_weight_relayout(relayout_linear_weights)
        elif layout == "packed":
            sgl.install_weight_relayout(pack_linear_weights)
        logger.info("sloserve plugin: SGLang CPU engine fixes applied (intel_amx kept, "
                    "float32 linear weights %s)", layout)
    sgl.register_specserve(_worker_class, _streamer_class)
    if os.environ.get(STEP_CLOCK_ENV):
        sgl.install_step_clock(os.environ[STEP_CLOCK_ENV])
