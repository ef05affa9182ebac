"""The SPECSERVE speculative worker inside SGLang's scheduler (imports SGLang: loaded only by
the algorithm's factory, in SGLang's scheduler process).

It is SGLang's STANDALONE worker (the user's draft model, EAGLE-v2 schema, topk 1 chains)
with the draft's KV aligned to the sequence (draft_chain.py) and SGLang's AdaptiveController switching pre-built runtime states (one per step count
0..k_max; 0 = plain decoding) to the draft length sloserve's controller chose for each decode
batch (controller.py). The worker times its draft phases and the verify forward so the
policy's cost model is corrected from SGLang's own forwards, and publishes each request's
draft steps in meta_info (`sloserve_draft_steps`, one entry per decode step).
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable
from typing import Any, ClassVar

import torch
from sglang.srt.managers.scheduler_components.output_streamer import SchedulerOutputStreamer
from sglang.srt.speculative.adaptive_runtime_state import AdaptiveController
from sglang.srt.speculative.standalone_worker_v2 import StandaloneWorkerV2

from sloserve.sglang_plugin import settings
from sloserve.sglang_plugin.controller import SGLangStepsPolicy, StepController
from sloserve.sglang_plugin.draft_chain import AlignedDraft

logger = logging.getLogger(__name__)

# the controller of the worker in this scheduler process (the output streamer reads it)
ACTIVE: list[StepController] = []


def _timed(fn: Callable, record: Callable[[float], None], device: torch.device) -> Callable:
    """fn, reporting its wall seconds (the device synchronised first and after on CUDA)."""
    cuda = device.type == "cuda"

    @functools.wraps(fn)
    def run(*args: Any, **kwargs: Any) -> Any:
        if cuda:
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            if cuda:
                torch.cuda.synchronize(device)
            record(time.perf_counter() - t0)

    return run


class SpecServeWorker(StandaloneWorkerV2):
    def __init__(self, server_args, gpu_id, nccl_port, target_worker) -> None:
        super().__init__(server_args, gpu_id, nccl_port, target_worker)
        target_path = target_worker.model_runner.model_config.model_path
        draft_path = self._draft_worker.draft_runner.model_config.model_path
        dtype = str(target_worker.model_runner.model_config.dtype).removeprefix("torch.")
        self.controller = settings.make_controller(
            target_path, draft_path, self.speculative_num_steps, str(self.device), dtype)
        ACTIVE[:] = [self.controller]
        # init_cuda_graphs (EAGLEWorkerV2) builds one runtime state per candidate step count
        self.adaptive_controller = AdaptiveController(self, SGLangStepsPolicy(self.controller))
        ctl, dev = self.controller, torch.device(self.device)
        dw = self._draft_worker
        # the draft's KV aligned with the sequence (draft_chain.py), then timed
        AlignedDraft(dw, self.speculative_num_steps).install()
        dw.draft = _timed(dw.draft, lambda s: ctl.add_times(draft=s), dev)
        dw._draft_extend_for_decode = _timed(dw._draft_extend_for_decode,
                                             lambda s: ctl.add_times(extend=s), dev)
        self.verify = _timed(self.verify, lambda s: ctl.add_times(verify=s), dev)
        logger.info("SPECSERVE: sloserve %s, draft steps 0..%d, default TPOT SLO %s",
                    ctl.policy.name, ctl.k_max, ctl.default_tpot_slo)

    def forward_batch_generation(self, batch, *args: Any, **kwargs: Any):
        if not (batch.forward_mode.is_extend() or batch.is_extend_in_batch
                or batch.forward_mode.is_idle()):
            reqs = batch.reqs
            seq_lens = (batch.seq_lens_cpu if getattr(batch, "seq_lens_cpu", None) is not None
                        else batch.seq_lens).tolist()
            self.controller.decide([r.rid for r in reqs], seq_lens,
                                   [settings.request_tpot_slo(r.sampling_params) for r in reqs])
        return super().forward_batch_generation(batch, *args, **kwargs)

    def on_verify_complete_cpu(self, num_correct_drafts_per_req: list[int],
                               batch_size: int = 0) -> None:
        self.controller.feedback(num_correct_drafts_per_req)
        super().on_verify_complete_cpu(num_correct_drafts_per_req, batch_size)

    def note_request_finished(self, *, rid: str, natural_stop: bool) -> None:
        super().note_request_finished(rid=rid, natural_stop=natural_stop)
        self.controller.release_policy(rid)


class SpecServeOutputStreamer(SchedulerOutputStreamer):
    """Adds `sloserve_draft_steps` to each request's meta_info: the draft steps of every
    decode step since its last output (SGLang accumulates them into the full list)."""

    has_additional_customized_info: ClassVar[bool] = True

    def should_build_additional_customized_info(self) -> bool:
        return bool(ACTIVE)

    def build_additional_customized_info(self, reqs) -> dict[str, list]:
        ctl = ACTIVE[0]
        return {"sloserve_draft_steps": [ctl.take_steps(r.rid, r.finished()) for r in reqs]}
