"""The engine: one step = schedule, draft (if the policy wants), one ragged target forward over
prefill chunks and decode/verify segments, accept, commit, free.

Policy lives elsewhere: the scheduler picks requests, the speculation policy picks draft and
verify lengths; the engine executes and keeps the books.
"""

from __future__ import annotations

import itertools
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from sloserve.runtime.config import EngineConfig, resolve
from sloserve.runtime.constraints.factory import ConstraintFactory
from sloserve.runtime.cpu_tuning import tune_malloc
from sloserve.runtime.engine_setup import EngineParts, build_parts
from sloserve.runtime.logprobs import TokenLogprobs
from sloserve.runtime.request import (
    FinishReason,
    InvalidRequest,
    Request,
    SamplingParams,
    Status,
    expand_samples,
    validate_prompt,
)
from sloserve.runtime.stats import EngineStats
from sloserve.runtime.step import StepRunner


class QueueFull(RuntimeError):
    """More requests wait than SchedulerConfig.max_queued_requests allows: come back later."""


@dataclass
class RequestOutput:
    """What one step produced for one request (deltas), and its totals."""

    rid: str
    new_token_ids: list[int]
    new_text: str
    finished: bool
    finish_reason: str | None
    matched_stop: str | int | None
    prompt_tokens: int
    completion_tokens: int
    spec_verify_ct: int
    spec_accepted: int
    spec_proposed: int
    # the new tokens' log-probabilities (params.logprobs set), aligned with new_token_ids
    new_logprobs: TokenLogprobs | None = None
    # set when the engine ended this request alone because its step's work raised (its
    # sampling rows, its grammar): the request failed, the rest of its batch went on
    error: str | None = None


class Engine:
    """In-process LLM engine with continuous batching and speculative decoding."""

    def __init__(self, cfg: EngineConfig | None = None, parts: EngineParts | None = None):
        self.cfg = resolve(cfg or EngineConfig())
        if self.cfg.num_threads:
            torch.set_num_threads(self.cfg.num_threads)
        if self.cfg.device == "cpu":
            tune_malloc()  # before the models and the KV cache are allocated
        self.parts = parts or build_parts(self.cfg)
        self.tokenizer = self.parts.tokenizer
        self.stats = EngineStats(k_max=self.cfg.k_max)
        self.runner = StepRunner(self.cfg, self.parts, self.stats)
        self.scheduler = self.runner.scheduler
        # penalties, grammars, min_new_tokens: each request's RequestConstraints
        self.constraints = ConstraintFactory(self.tokenizer, self.parts.target.cfg.vocab_size,
                                             self.runner.eos, self.cfg.k_max,
                                             any_whitespace=not
                                             self.cfg.constrained_json_disable_any_whitespace)
        self.requests: dict[str, Request] = {}
        self._ids = itertools.count()

    # ----- requests
    @property
    def max_context(self) -> int:
        """Tokens a request may hold, prompt and output (--context-length, else the model's)."""
        return self.runner.max_context

    def encode(self, prompt: str) -> list[int]:
        return self.tokenizer.encode(prompt, add_special_tokens=False)

    def add_request(
        self,
        prompt: str | Sequence[int],
        params: SamplingParams | None = None,
        rid: str | None = None,
    ) -> Request:
        """Validate and queue a request (one sample: params.n == 1; see expand_samples).
        Raises InvalidRequest naming the bad field, e.g. a grammar that does not compile."""
        params = params or SamplingParams()
        if params.n != 1:
            raise InvalidRequest("n", "a request is one sample; expand_samples(params) gives "
                                 "the n samples' parameters (Engine.generate does)")
        if isinstance(prompt, str):
            if prompt == "":
                raise InvalidRequest("prompt", "is empty")
            try:
                prompt.encode("utf-8")
            except UnicodeEncodeError:
                raise InvalidRequest("prompt", "is not valid Unicode text (a lone "
                                     "surrogate)") from None
            ids = self.encode(prompt)
        else:
            ids = [int(t) for t in prompt]
        validate_prompt(ids, self.parts.target.cfg.vocab_size, self.max_context)
        bad = [t for t in params.logprob_token_ids if t >= self.parts.target.cfg.vocab_size]
        if bad:
            raise InvalidRequest("token_ids_logprob", f"token id {bad[0]} outside the "
                                 f"vocabulary [0, {self.parts.target.cfg.vocab_size})")
        self.check_fits(len(ids), params.max_new_tokens)
        self._check_queue()
        rid = rid or f"req-{next(self._ids)}-{uuid.uuid4().hex[:8]}"
        if rid in self.requests:
            raise InvalidRequest("rid", f"request id {rid!r} is already in use")
        req = Request(rid=rid, prompt_ids=ids, params=params, arrival=time.perf_counter())
        if params.constrained:
            req.constraints = self.constraints.build(params, ids)
        if params.logprobs is not None:
            req.logprobs = TokenLogprobs(params.logprobs, token_ids=params.logprob_token_ids)
        self.requests[rid] = req
        self.runner.add(req)
        return req

    def _check_queue(self) -> None:
        """Raise QueueFull when max_queued_requests requests already wait beyond the running
        slots free at the next step."""
        sched = self.scheduler
        limit = sched.cfg.max_queued_requests
        if limit is None:
            return
        free_slots = max(0, sched.cfg.max_running_requests - len(sched.running))
        queued = len(sched.waiting) - free_slots
        if queued >= limit:
            raise QueueFull(f"the request queue is full ({queued} waiting, "
                            f"--max-queued-requests {limit}); retry later")

    @property
    def kv_capacity(self) -> int:
        """Tokens one request may grow to: the KV pool less the draft lookahead a decode
        step reserves (the pool is shared, so this is what a request alone can use)."""
        alloc = self.scheduler.alloc
        return alloc.num_blocks * alloc.block_size - self.cfg.k_max

    def max_new_tokens_that_fit(self, prompt_len: int) -> int:
        """Most new tokens a prompt of prompt_len may ask for: the context window's and the
        KV pool's room."""
        return min(self.max_context, self.kv_capacity) - prompt_len

    def check_fits(self, prompt_len: int, max_new_tokens: int) -> None:
        """Raise InvalidRequest unless the request fits the KV pool alone, to its last
        token: one that cannot would be preempted and recomputed for ever."""
        if prompt_len + 1 > self.kv_capacity:
            raise InvalidRequest("prompt", f"{prompt_len} tokens do not fit the KV cache "
                                 f"({self.cfg.kv_cache_tokens} tokens)")
        # the context window cuts generation anyway: only that part needs KV
        grows_to = prompt_len + min(max_new_tokens, self.max_context - prompt_len)
        if grows_to > self.kv_capacity:
            raise InvalidRequest(
                "max_new_tokens", f"{max_new_tokens} new tokens after a prompt of {prompt_len} "
                f"do not fit the KV cache ({self.cfg.kv_cache_tokens} tokens, {self.cfg.k_max} "
                f"of them reserved for drafts): at most "
                f"{self.max_new_tokens_that_fit(prompt_len)}")

    def abort(self, rid: str) -> bool:
        """Stop a request now and free its KV blocks. False if it is unknown or finished."""
        req = self.requests.get(rid)
        if req is None or req.finished:
            return False
        self.runner.finish(req, FinishReason.ABORT)
        return True

    def drop_failed_step(self) -> list[str]:
        """After step() raised: finish every running request as aborted (the failed batch,
        whose lengths and KV may be half-updated) and free its blocks; waiting requests hold
        no KV and stay queued. Returns the dropped ids. Raises (AssertionError, RuntimeError)
        when the KV pool is inconsistent afterwards: then the engine cannot go on."""
        failed = list(self.scheduler.running)
        for req in failed:
            self.runner.finish(req, FinishReason.ABORT)
        self.check_idle_integrity()
        return [r.rid for r in failed]

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work

    # ----- stepping
    def step(self) -> list[RequestOutput]:
        """Run one engine step; return outputs for every request that advanced or finished."""
        touched = self.runner.step()
        outs = []
        for req, new_ids, new_text in touched:
            outs.append(self._output(req, new_ids, new_text))
            if req.finished:
                self.requests.pop(req.rid, None)
        return outs + self.take_aborted()  # requests the step failed alone (output.error)

    def take_aborted(self) -> list[RequestOutput]:
        """Outputs for requests finished outside step() (aborts), once each."""
        outs = [self._output(r, [], "") for r in self.runner.take_finished_outside_step()]
        for o in outs:
            self.requests.pop(o.rid, None)
        return outs

    def _output(self, req: Request, new_ids: list[int], new_text: str) -> RequestOutput:
        lp = None
        if req.logprobs is not None:  # this step's entries: the last len(new_ids)
            lp = req.logprobs.tail(len(new_ids))
        return RequestOutput(
            rid=req.rid,
            new_token_ids=new_ids,
            new_text=new_text,
            finished=req.finished,
            finish_reason=req.finish_reason.value if req.finish_reason else None,
            matched_stop=req.matched_stop,
            prompt_tokens=len(req.prompt_ids),
            completion_tokens=len(req.output_ids),
            spec_verify_ct=req.spec.verify_steps,
            spec_accepted=req.spec.accepted,
            spec_proposed=req.spec.proposed,
            new_logprobs=lp,
            error=req.error,
        )

    def generate(
        self,
        prompts: Sequence[str | Sequence[int]],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[dict]:
        """Run prompts to completion. Returns one dict per prompt and sample (in order; with
        params.n > 1 a prompt's n samples follow each other) with text, output_ids and meta.
        Invalid prompts raise before anything is queued."""
        if isinstance(params, SamplingParams) or params is None:
            params = [params or SamplingParams()] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError("params must be one SamplingParams or one per prompt")
        jobs = [(p, s) for p, sp in zip(prompts, params) for s in expand_samples(sp)]
        reqs = [self.add_request(p, sp) for p, sp in jobs]
        while any(r.status is not Status.FINISHED for r in reqs):
            self.step()
        return [self.result(r) for r in reqs]

    @staticmethod
    def result(req: Request) -> dict:
        return {
            "rid": req.rid,
            "text": req.output_text,
            "output_ids": list(req.output_ids),
            "finish_reason": req.finish_reason.value if req.finish_reason else None,
            "prompt_tokens": len(req.prompt_ids),
            "completion_tokens": len(req.output_ids),
            "num_preemptions": req.num_preemptions,
            "spec": vars(req.spec).copy(),
            "logprobs": req.logprobs,
            "error": req.error,  # why the engine ended it alone (finish_reason "abort")
        }

    def check_idle_integrity(self) -> None:
        """Raise unless the KV pool is consistent with the live requests (all free if idle)."""
        alloc = self.scheduler.alloc
        live = list(self.scheduler.running) + list(self.scheduler.waiting)
        alloc.check_integrity([r.blocks for r in live])
