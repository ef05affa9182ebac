"""The SPECSERVE speculative worker inside SGLang's scheduler (imports SGLang: loaded only by
the algorithm's factory, in SGLang's scheduler process).

Trimmed steps (--spec-lengths trim): the uniform mode's one draft length per batch, the
chain's confidences handed to the plan once drafted, and each request's verify length k_r
from the plan's confidence-prior elimination, verified on the ragged layout below.

Per-request steps (--spec-lengths per-request):
the controller plans the batch
(`begin`); if anyone drafts position 1 the worker prepares k_max rounds and the plan decides
after every round whether the batch drafts on (`after_round`, with the draft's real
probability of each proposed token); the worker then switches to the runtime state of the
rounds really drafted, asks the plan's confidence-prior elimination for each request's
verify length k_r (`verify_lengths`, 0 <= k_r <= s_r) and runs SGLang's verify with
SGLang's RaggedVerifyLayout on the verify input: the target forward reads only the
sum(k_r + 1) verified tokens (intel_amx's extend metadata taken from the layout), its
logits go back into SGLang's [bs, s + 1] verify rows, and each request's chain is cut after
its k_r-th draft (retrieve_next_token = -1) so SGLang's acceptance stops there and takes the
bonus token from the target at that position. KV slots of trimmed and rejected drafts stay
in the request's reserved window, released as SGLang does for rejected drafts.

It is SGLang's STANDALONE worker (the user's draft model, EAGLE-v2 schema, topk 1 chains)
with the draft's KV aligned to the sequence (draft_chain.py) and SGLang's AdaptiveController switching pre-built runtime states (one per step count
0..k_max; 0 = plain decoding) to the draft length sloserve's controller chose for each decode
batch (controller.py). The worker times its draft phases and the verify forward so the
policy's cost model is corrected from SGLang's own forwards, and publishes each request's
draft steps in meta_info (`sloserve_draft_steps`, one entry per decode step).
"""

from __future__ import annotations

import contextlib
import copy
import functools
import logging
import os
import time
from collections.abc import Callable
from typing import Any, ClassVar

import numpy as np
import torch

from sloserve.runtime.models.config import hot_vocab
from sloserve.sglang_ext import settings
from sloserve.sglang_ext.chain_sampling import (
    bonus_tokens,
    greedy_chains,
    processed_probs,
    verify_chains,
)
from sloserve.sglang_ext.controller import SGLangStep, SGLangStepsPolicy, StepController
from sloserve.sglang_ext.cpu_weights import (
    DRAFT_DTYPE_ENV,
    bf16_draft_linears,
    draft_dtype_from_env,
)
from sloserve.sglang_ext.draft_chain import (
    AlignedDraft,
    NgramDraft,
    compact_acceptance,
    sampled_batch,
)
from sloserve.sglang_ext.sglang_internals import (
    AdaptiveController,
    CaptureHiddenMode,
    EagleDraftInput,
    ForwardBatch,
    ForwardMode,
    GenerationBatchResult,
    RaggedVerifyLayout,
    SchedulerOutputStreamer,
    StandaloneWorkerV2,
    activate_rounds,
    install_ragged_extend_metadata,
    install_result_hook,
    swapped_eagle_sample,
    swapped_target_forward,
)
from sloserve.sglang_ext.spec_metrics import SpecCounters
from sloserve.slo import stated_slo, valid_slo

logger = logging.getLogger(__name__)

# the controller of the worker in this scheduler process (the output streamer reads it)
ACTIVE: list[StepController] = []


def _step_of(batch: Any) -> SGLangStep | None:
    """The speculation step a decode batch carries (set by forward_batch_generation)."""
    return getattr(batch, "sloserve_step", None)


def _timed(fn: Callable, record: Callable[[SGLangStep, float], None],
           device: torch.device) -> Callable:
    """fn(batch, ...), reporting its wall seconds to the batch's step (the device
    synchronised first and after on CUDA)."""
    cuda = device.type == "cuda"

    @functools.wraps(fn)
    def run(batch: Any, *args: Any, **kwargs: Any) -> Any:
        if cuda:
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        try:
            return fn(batch, *args, **kwargs)
        finally:
            if cuda:
                torch.cuda.synchronize(device)
            step = _step_of(batch)
            if step is not None:
                record(step, time.perf_counter() - t0)

    return run


def _plain_decode(batch: Any) -> bool:
    """Whether a decode batch whose step drafts nothing runs as a plain decode step
    (SpecServeWorker._decode_step): all greedy, reading the logits for nothing but the
    argmax (compact_acceptance: no grammar, penalties, bias, logprobs or watermark), with
    each request's bonus token at hand and none of the state SGLang's verify keeps for
    other models (sparse KV, mamba layers)."""
    bonus = getattr(batch.spec_info, "bonus_tokens", None)
    return (bonus is not None and bonus.numel() == len(batch.reqs) > 0
            and not batch.spec_info.is_verify_input()
            and getattr(batch, "hisparse_coordinator", None) is None
            and getattr(batch, "mamba_track_indices", None) is None
            and compact_acceptance(batch))


def _argmax_acceptance(verify_input: Any, batch: Any, logits_output: Any, *args: Any,
                       **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """eagle_sample's triple for a verify of the bonus token alone (n = 1) in an all-greedy
    batch: each request's next token is the argmax of its one row of logits [bs, V]."""
    logits = logits_output.next_token_logits  # [bs, V]
    return bonus_tokens(logits.argmax(dim=-1), int(verify_input.max_tree_depth))


install_ragged_extend_metadata()
install_result_hook()


class SpecServeWorker(StandaloneWorkerV2):  # type: ignore[misc]  # SGLang is untyped
    def __init__(self, server_args, gpu_id, nccl_port, target_worker) -> None:
        super().__init__(server_args, gpu_id, nccl_port, target_worker)
        target_path = target_worker.model_runner.model_config.model_path
        draft_path = self._draft_worker.draft_runner.model_config.model_path
        dtype = str(target_worker.model_runner.model_config.dtype).removeprefix("torch.")
        cfg = settings.worker_config()
        self.controller = settings.make_controller(
            cfg, target_path, draft_path, self.speculative_num_steps, str(self.device), dtype)
        ACTIVE[:] = [self.controller]
        if getattr(server_args, "enable_metrics", False):  # SGLang's /metrics shows them
            self.controller.on_outcome = SpecCounters(self.speculative_num_steps).record
        # init_cuda_graphs (EAGLEWorkerV2) builds one runtime state per candidate step count
        self.adaptive_controller = AdaptiveController(
            self, SGLangStepsPolicy(self.speculative_num_steps,
                                    lambda: self.speculative_num_steps))
        ctl, dev = self.controller, torch.device(self.device)
        dw = self._draft_worker
        self.per_request = ctl.per_request
        # the draft's KV aligned with the sequence (draft_chain.py), then timed;
        # trimmed steps hand the chain's confidences to the plan's verifier; the profiler's
        # sweep records them, fitting the pair's calibration from them (they cost a pass
        # over the draft's logits per round: a timed run without either skips them)
        # prompt lookup costs no forward: the whole chain is looked up before the step
        # (trimmed and per-request steps alike) and the plan's verifier picks k_r at once
        self.lookup_first = (cfg.drafter == "ngram" and (self.per_request or ctl.trim)
                             and not ctl.sweep and not ctl.forced_lengths)
        wants_chain = ((bool(ctl.sweep) or ctl.trim) and not self.per_request
                       and not self.lookup_first)
        chain = NgramDraft if cfg.drafter == "ngram" else AlignedDraft
        self.aligned = chain(dw, self.speculative_num_steps,
                             on_chain=self._chain_drafted if wants_chain else None,
                             on_round=(self._after_round
                                       if self.per_request and not self.lookup_first else None),
                             on_stop=self._rounds_done, on_catch_up=self._caught_up,
                             drafters=self._drafters if self.per_request else None)
        self.aligned.install()
        # the draft's matmuls in bf16 where the CPU multiplies bf16 in hardware (its KV,
        # norms and attention stay float32; the target's forwards are untouched)
        head_dtype = torch.float32
        if (cfg.drafter == "model" and dev.type == "cpu" and dtype == "float32"
                and draft_dtype_from_env() == "bfloat16"):
            n = bf16_draft_linears(dw.draft_runner.model)
            head_dtype = torch.bfloat16
            logger.info("SPECSERVE: the draft's %d linear layers multiply in bf16 (%s=%s)", n,
                        DRAFT_DTYPE_ENV, os.environ.get(DRAFT_DTYPE_ENV, "auto"))
        hot = hot_vocab(draft_path) if cfg.drafter == "model" else None
        if hot is not None:
            if self.aligned.use_hot_vocab(torch.as_tensor(hot), head_dtype):
                logger.info("SPECSERVE: the draft's LM head cut to its %d hot tokens (%s)",
                            len(hot), draft_path)
            else:
                logger.warning("SPECSERVE: the draft's LM head is packed for AMX kernels: "
                               "its hot vocabulary is not used")
        self.test_accept_all = cfg.test_accept_all
        self.decode_steps = settings.decode_steps_from_env()  # _decode_step
        dw.draft = _timed(dw.draft, lambda st, t: st.add_times(draft=t), dev)
        dw._draft_extend_for_decode = _timed(dw._draft_extend_for_decode,
                                             lambda st, t: st.add_times(extend=t), dev)
        self.verify = _timed(  # type: ignore[method-assign]  # an instance's timed verify
            self.verify, lambda st, t: st.add_times(verify=t), dev)
        logger.info("SPECSERVE: sloserve %s, %s drafter, draft steps 0..%d, default TPOT "
                    "SLO %s, %s steps", ctl.policy.name, cfg.drafter, ctl.k_max,
                    ctl.default_tpot_slo,
                    "per-request" if self.per_request else "trimmed" if ctl.trim
                    else "uniform")

    def forward_batch_generation(self, batch, *args: Any, **kwargs: Any):
        step = None
        if not (batch.forward_mode.is_extend() or batch.is_extend_in_batch
                or batch.forward_mode.is_idle()):
            reqs = batch.reqs
            seq_lens = (batch.seq_lens_cpu if getattr(batch, "seq_lens_cpu", None) is not None
                        else batch.seq_lens).tolist()
            slos = [valid_slo(stated_slo(r.sampling_params, "tpot_slo")) for r in reqs]
            step = self.controller.begin([r.rid for r in reqs], seq_lens, slos,
                                         self.aligned.lags(batch))
            if self.lookup_first:
                assert isinstance(self.aligned, NgramDraft)
                conf = self.aligned.lookup(batch, self.controller.k_max)
                if conf is not None:
                    self.controller.looked_up(step, conf)
                else:
                    step.prepared = step.session.fix_rounds(0)
            # the runtime state of the rounds SGLang prepares; SGLang's own switch by batch
            # size (activate_step_by_batch) then keeps it (SGLangStepsPolicy)
            assert self.adaptive_controller is not None
            activate_rounds(self.adaptive_controller, step.prepared)
        batch.sloserve_step = step  # the step travels with SGLang's batch ...
        # a step nobody drafts in, driven synchronously (no overlap publish, no pipeline
        # stages: SPECSERVE runs neither), as a plain decode step where the batch allows
        plain = (step is not None and step.prepared == 0 and self.decode_steps and not args
                 and kwargs.get("on_publish") is None
                 and kwargs.get("pp_proxy_tensors") is None and _plain_decode(batch))
        if plain:
            assert step is not None
            result = self._decode_step(batch, step)
        else:
            result = super().forward_batch_generation(batch, *args, **kwargs)
        result.sloserve_step = step  # ... and with its result, to sloserve_verified
        return result

    def _decode_step(self, batch: Any, step: SGLangStep) -> Any:
        """A step in which nobody drafts, run as SGLang runs a decode step without
        speculation: the target's decode forward over each request's bonus token at its
        position L, its argmax the next bonus token, and the result SGLang's speculative
        scheduler resolves (one token a request, no draft). SGLang's own path for it (a
        one-node verify input, then run_eagle_verify's prepare, acceptance and bookkeeping
        around the forward) cost ~1.1% of a step at concurrency 1 over plain decoding's
        (py-spy, 2026-12-06, BENCHMARKS.md). Only batches `_plain_decode` admits come here;
        the others keep SGLang's verify of the bonus token (_plain_verify)."""
        tw = self.target_worker
        bs = len(batch.reqs)
        t0 = time.perf_counter()
        bonus = batch.spec_info.bonus_tokens.reshape(bs)  # [bs] each request's next input
        seq = batch.seq_lens  # [bs] L: committed tokens, the bonus token's position
        # [bs] the slot SGLang reserved for position L (the verify's first slot)
        locs = self.req_to_token_pool.req_to_token[batch.req_pool_indices.long(), seq.long()]
        cb = copy.copy(batch)  # SGLang's batch stays as it is; the decode forward's view
        cb.forward_mode = ForwardMode.DECODE
        cb.input_ids, cb.out_cache_loc, cb.spec_info = bonus, locs.long(), None
        cb.seq_lens = seq + 1  # a decode forward sees the KV length after its token's write
        if cb.seq_lens_cpu is not None:
            cb.seq_lens_cpu = batch.seq_lens_cpu + 1
        if cb.seq_lens_sum is not None:
            cb.seq_lens_sum = batch.seq_lens_sum + bs
        if getattr(cb, "orig_seq_lens", None) is not None:
            cb.orig_seq_lens = batch.orig_seq_lens + 1
        fb = ForwardBatch.init_new(cb, tw.model_runner,
                                   capture_hidden_mode=CaptureHiddenMode.NULL,
                                   return_hidden_states_before_norm=False)
        out = tw.forward_batch_generation(batch=None, forward_batch=fb, is_verify=True)
        predict = out.logits_output.next_token_logits.argmax(dim=-1).to(torch.int32)  # [bs]
        ones = torch.ones(bs, dtype=torch.int32, device=predict.device)
        result = GenerationBatchResult(
            logits_output=out.logits_output, next_token_ids=predict,
            can_run_cuda_graph=False, speculative_num_draft_tokens=1,
            next_draft_input=EagleDraftInput(bonus_tokens=predict), accept_lens=ones,
            accept_index=torch.arange(bs, dtype=torch.int32,
                                      device=predict.device).unsqueeze(1),
            new_seq_lens=seq + 1, extra_keep_alive_refs=[fb])
        t1 = time.perf_counter()
        self.aligned.committed(batch, bonus.to(torch.int64).unsqueeze(1), result)
        step.add_times(verify=t1 - t0, extend=time.perf_counter() - t1)
        step.decoded = True
        return result

    def sloserve_verified(self, result: Any) -> None:
        """SGLang resolved a result's accepted drafts (sglang_internals.install_result_hook):
        the step's session ends and the policy learns from it."""
        step = getattr(result, "sloserve_step", None)
        counts = getattr(result, "num_correct_drafts_per_req_cpu", None)
        if step is not None and counts is not None:
            self.controller.finish(step, counts)

    # ----- per-request steps (the session on the batch decides after each round)
    def _after_round(self, batch: Any, conf: torch.Tensor) -> bool:
        step = _step_of(batch)
        assert step is not None
        return self.controller.after_round(step, conf.float().cpu().numpy())

    def _chain_drafted(self, batch: Any, tokens: torch.Tensor, conf: torch.Tensor) -> None:
        step = _step_of(batch)
        if step is not None:  # the timings row's and, trimmed steps, the verifier's
            self.controller.chain_drafted(step, conf.float().cpu().numpy())

    def _caught_up(self, batch: Any, rows: int) -> None:
        step = _step_of(batch)
        if step is not None:  # read inside the timed draft; the controller prices them
            step.catch_up_rows += rows

    def _drafters(self, batch: Any) -> np.ndarray | None:
        """[bs] who drafts the first round of a per-request step (the plan's choice)."""
        step = _step_of(batch)
        return step.session.drafting if step is not None and step.per_request else None

    def _rounds_done(self, rounds: int) -> None:
        assert self.adaptive_controller is not None
        activate_rounds(self.adaptive_controller, rounds)

    def verify(self, batch, *args: Any, **kwargs: Any):
        if batch.forward_mode.is_idle() or not sampled_batch(batch):
            return self._verify_lengths(batch, *args, **kwargs)
        # SGLang's verify commits the argmax on CPUs: SPECSERVE samples (chain_sampling.py,
        # in both modes: AlignedDraft keeps each proposal's distribution q)
        with swapped_eagle_sample(functools.partial(self._sample, _step_of(batch))):
            return self._verify_lengths(batch, *args, **kwargs)

    def _sample(self, step: SGLangStep | None, verify_input: Any, batch: Any,
                logits_output: Any, *args: Any,
                **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """eagle_sample's contract (predict [bs * n], accept_lens [bs] with the bonus,
        accept_index [bs, depth] flat rows, -1 padded) from chain_sampling's rule."""
        bs, n = len(batch.seq_lens), int(verify_input.draft_token_num)
        si = batch.sampling_info
        logits = logits_output.next_token_logits  # [bs * n, V]
        V = logits.shape[-1]
        p = processed_probs(logits, si.temperatures.reshape(-1).repeat_interleave(n),
                            si.top_ks.repeat_interleave(n), si.top_ps.repeat_interleave(n))
        cand = verify_input.draft_token.reshape(bs, n).to(torch.int64)
        q = self.aligned.last_q
        if n > 1 and self.aligned.deterministic:  # n-gram proposals: q one-hot on them
            q = torch.nn.functional.one_hot(cand[:, 1:], V).float()  # [bs, n - 1, V]
        elif n == 1 or q is None:
            q = logits.new_zeros((bs, 0, V))
        verified = step.session.verified if step is not None else None
        k = (verified.tolist() if verified is not None and len(verified) == bs
             else [n - 1] * bs)
        accepted, final = verify_chains(p.reshape(bs, n, V), cand[:, 1:], q.float(), k,
                                        accept_all=self.test_accept_all)
        dev = logits.device
        predict = torch.zeros(bs * n, dtype=torch.int32, device=dev)
        accept_index = torch.full((bs, verify_input.max_tree_depth), -1, dtype=torch.int32,
                                  device=dev)
        for r, (m, t) in enumerate(zip(accepted, final)):
            rows = torch.arange(r * n, r * n + m + 1, dtype=torch.int32, device=dev)
            accept_index[r, : m + 1] = rows
            predict[r * n: r * n + m] = cand[r, 1: m + 1].to(torch.int32)
            predict[r * n + m] = t
        accept_lens = torch.tensor(accepted, dtype=torch.int32, device=dev) + 1
        return predict, accept_lens, accept_index

    def _verify_lengths(self, batch, *args: Any, **kwargs: Any):
        step = _step_of(batch)
        vi = batch.spec_info
        if step is None or batch.forward_mode.is_idle() \
                or step.session.step.batch_size != len(batch.reqs):
            return super().verify(batch, *args, **kwargs)
        n = int(vi.draft_token_num)  # s + 1
        if n == 1:
            return self._plain_verify(batch, *args, **kwargs)
        k = self.controller.verify_lengths(step)  # [B] k_r <= s_r
        if not step.ragged or n <= 1 or int(k.min()) >= n - 1:
            return super().verify(batch, *args, **kwargs)  # everything drafted is verified
        return self._ragged_verify(batch, k, n, *args, **kwargs)

    def _plain_verify(self, batch, *args: Any, **kwargs: Any):
        """A step that drafted nothing in a batch `_decode_step` does not take (sampled,
        a grammar, logprobs, ...): SGLang's verify of the bonus token alone, its target
        forward run as the decode forward it is (one token a request at position L: the
        attention backend's decode path, not the verify path's extend over a mask)."""
        tw = self.target_worker
        forward = tw.forward_batch_generation

        def decode_forward(*fargs: Any, forward_batch: Any = None, **fkw: Any) -> Any:
            fb = forward_batch
            fb.forward_mode = ForwardMode.DECODE
            # decode sees the KV length after this token's write; verify the one before
            fb.seq_lens = fb.seq_lens + 1
            if fb.seq_lens_cpu is not None:
                fb.seq_lens_cpu = fb.seq_lens_cpu + 1
            if fb.seq_lens_sum is not None:
                fb.seq_lens_sum = fb.seq_lens_sum + len(fb.seq_lens)
            return forward(*fargs, forward_batch=fb, **fkw)

        # an all-greedy batch's token is the argmax of its one row (greedy_chains with no
        # drafts): SGLang's acceptance would walk each request's one-node tree in Python
        # (the CPU's verify_tree_greedy) for the same answer, ~0.8% of a k = 0 step at
        # C = 4 in py-spy (2026-12-04)
        sample = (swapped_eagle_sample(_argmax_acceptance) if compact_acceptance(batch)
                  else contextlib.nullcontext())
        with swapped_target_forward(tw, decode_forward), sample:
            return super().verify(batch, *args, **kwargs)

    def _ragged_verify(self, batch, k: np.ndarray, n: int, *args: Any, **kwargs: Any):
        vi = batch.spec_info
        bs = len(k)
        dev = torch.device(self.device)
        lens = (k + 1).tolist()
        # SGLang's acceptance walks retrieve_next_token: cut each chain after its k_r-th draft
        cut = torch.as_tensor(k, dtype=torch.long, device=dev)
        vi.retrieve_next_token[torch.arange(bs, device=dev), cut] = -1
        layout = RaggedVerifyLayout.from_verify_lens(verify_lens_cpu=lens, device=dev,
                                                     grid=[bs * n])
        keep = (torch.arange(n, device=dev)[None, :] < (cut + 1)[:, None]).reshape(-1)
        idx = keep.nonzero().squeeze(1)  # [sum(k_r + 1)] rows of the [bs * n] verify block
        tw = self.target_worker
        forward = tw.forward_batch_generation
        # an all-greedy batch's acceptance reads only the verified rows (greedy_chains):
        # the [bs * n, V] logits block (28 MB at bs 16, n 9, SmolLM2's vocabulary), its fill
        # and SGLang's argmax over it are skipped; 11 ms -> 2.4 ms at bs 16, n 9 on the
        # 2-core Xeon (BENCHMARKS.md, 2026-11-29). Anything that reads the whole block keeps it.
        compact = compact_acceptance(batch)

        def ragged_forward(*fargs: Any, forward_batch: Any = None, **fkw: Any) -> Any:
            fb = forward_batch
            fb.input_ids = fb.input_ids[idx]
            fb.positions = fb.positions[idx]
            fb.out_cache_loc = fb.out_cache_loc[idx]
            fb.global_num_token_non_padded_cpu = int(idx.numel())
            if fb.global_num_token_non_padded is not None:
                fb.global_num_token_non_padded = torch.tensor(
                    int(idx.numel()), dtype=torch.int32, device=dev)
            out = forward(*fargs, forward_batch=fb, **fkw)
            if compact:  # [sum(k_r + 1), V]: greedy_chains reads these rows alone
                return out
            lo = out.logits_output
            logits = lo.next_token_logits
            full = logits.new_zeros((bs * n, logits.shape[-1]))
            full[idx] = logits  # trimmed rows are never read: their chains were cut
            lo.next_token_logits = full
            return out

        def greedy(verify_input: Any, batch: Any, logits_output: Any, *a: Any,
                   **kw: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
            cand = verify_input.draft_token.reshape(bs, n)
            return greedy_chains(logits_output.next_token_logits.argmax(dim=-1), idx, cand,
                                 cut, int(verify_input.max_tree_depth))

        vi.ragged_verify_layout = layout
        try:
            with swapped_target_forward(tw, ragged_forward), \
                    (swapped_eagle_sample(greedy) if compact else contextlib.nullcontext()):
                return super().verify(batch, *args, **kwargs)
        finally:
            vi.ragged_verify_layout = None

    def note_request_finished(self, *, rid: str, natural_stop: bool) -> None:
        super().note_request_finished(rid=rid, natural_stop=natural_stop)
        self.controller.release_policy(rid)
        self.aligned.release(rid)


class SpecServeOutputStreamer(SchedulerOutputStreamer):  # type: ignore[misc]
    """Adds `sloserve_draft_steps` to each request's meta_info: the draft steps of every
    decode step since its last output (SGLang accumulates them into the full list)."""

    has_additional_customized_info: ClassVar[bool] = True

    def should_build_additional_customized_info(self) -> bool:
        return bool(ACTIVE)

    def build_additional_customized_info(self, reqs) -> dict[str, list]:
        ctl = ACTIVE[0]
        drafted = [ctl.take_drafted(r.rid) for r in reqs]
        return {"sloserve_drafted": drafted,
                "sloserve_draft_steps": [ctl.take_steps(r.rid, r.finished()) for r in reqs]}
