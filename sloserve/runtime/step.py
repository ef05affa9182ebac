"""One engine step, executed: schedule -> draft -> one ragged target forward -> accept -> commit.

Invariant after every step, for every running request that is decoding:
    kv_len == num_tokens - 1  and  draft_kv_len <= num_tokens - 1,
and its blocks cover exactly the positions it may still need (rejected tail blocks freed).
"""

from __future__ import annotations

import math
import time

import numpy as np
import torch

from sloserve.drafter.policy import VerifyOutcome
from sloserve.runtime.batch import Segment
from sloserve.runtime.config import EngineConfig
from sloserve.runtime.detokenizer import Detokenizer, DetokState, find_stop, partial_stop_len
from sloserve.runtime.engine_setup import EngineParts
from sloserve.runtime.request import FinishReason, Request, Status
from sloserve.runtime.sampler import draw, processed_probs
from sloserve.runtime.scheduler import Scheduler
from sloserve.runtime.speculative import Drafter, DraftResult, run_drafting, step_info
from sloserve.runtime.stats import EngineStats, StepRecord
from sloserve.verifier.acceptance import greedy_accept, speculative_accept

Touched = tuple[Request, list[int], str]  # request, new token ids, new text


class StepRunner:
    def __init__(self, cfg: EngineConfig, parts: EngineParts, stats: EngineStats):
        self.cfg = cfg
        self.parts = parts
        self.stats = stats
        self.scheduler = Scheduler(cfg.scheduler, parts.allocator)
        self.detok = Detokenizer(parts.tokenizer)
        self.policy = parts.policy
        self.drafter: Drafter | None = None
        if cfg.drafter == "model" and parts.draft is not None:
            self.drafter = Drafter(parts.draft)
        elif cfg.drafter == "ngram":
            self.drafter = Drafter(None)
        eos = set(parts.target.cfg.eos_token_ids)
        if getattr(parts.tokenizer, "eos_token_id", None) is not None:
            eos.add(parts.tokenizer.eos_token_id)
        self.eos = frozenset(eos)
        self._detok: dict[str, DetokState] = {}
        self._finished_outside: list[Request] = []
        self._verify_time = 0.0  # seconds of the current step's target forward

    @property
    def speculative(self) -> bool:
        return self.drafter is not None and self.policy.speculates and self.cfg.k_max > 0

    # ----- request lifecycle
    def add(self, req: Request) -> None:
        self._detok[req.rid] = DetokState()
        self.stats.prompt_tokens += len(req.prompt_ids)
        self.scheduler.add(req)

    def finish(self, req: Request, reason: FinishReason) -> None:
        if req.finished:
            return
        req.status = Status.FINISHED
        req.finish_reason = reason
        req.finish_time = time.perf_counter()
        self.scheduler.remove(req)
        self.policy.release(req.rid)
        if self.drafter is not None:
            self.drafter.release(req.rid)
        self._detok.pop(req.rid, None)
        self.stats.requests_finished += 1
        if reason is FinishReason.ABORT:
            self.stats.requests_aborted += 1
            self._finished_outside.append(req)

    def take_finished_outside_step(self) -> list[Request]:
        out, self._finished_outside = self._finished_outside, []
        return out

    # ----- the step
    def step(self) -> list[Touched]:
        t0 = time.perf_counter()
        sched = self.scheduler.schedule(self.cfg.k_max if self.speculative else 0)
        self.stats.preemptions += len(sched.preempted)
        if sched.empty:
            return []
        segs = [Segment(r.blocks, r.kv_len, r.all_ids[r.kv_len : r.kv_len + n]) for r, n in sched.prefills]
        decodes = sched.decodes
        draft = self._draft(decodes, sched) if decodes and self.speculative else None
        for i, r in enumerate(decodes):
            k = int(draft.k[i]) if draft is not None else 0
            extra = draft.tokens[i, :k].tolist() if k else []
            segs.append(Segment(r.blocks, r.kv_len, [r.all_ids[-1], *extra], all_logits=k > 0))
        t_fwd = time.perf_counter()
        logits, batch = self.parts.target.forward(segs)
        argmax = logits.argmax(dim=-1).tolist()  # (waits for the device)
        self._verify_time = time.perf_counter() - t_fwd
        if sched.prefills and self.speculative and self.drafter.kind == "model":
            self._prefill_draft(sched.prefills)
        touched: list[Touched] = []
        for i, (r, n) in enumerate(sched.prefills):
            r.kv_len += n
            if r.kv_len == r.num_tokens:  # prompt (or recompute) done: first new token
                row = batch.logits_indptr[i]
                touched.append(self._commit(r, [self._sample(r, logits[row], argmax[row])]))
        accepted = np.zeros(len(decodes), dtype=np.int64)
        base = len(sched.prefills)
        for i, r in enumerate(decodes):
            lo, hi = batch.logits_indptr[base + i], batch.logits_indptr[base + i + 1]
            emitted = self._accept(r, i, draft, logits[lo:hi], argmax[lo:hi])
            accepted[i] = len(emitted) - 1
            touched.append(self._commit(r, emitted))
        self._account(decodes, draft, accepted, time.perf_counter() - t0, len(sched.prefills))
        return touched

    def _prefill_draft(self, prefills) -> None:
        """The draft model reads each prefill chunk in the same step as the target, so a
        request starts decoding with its draft cache caught up (draft lag 0): otherwise its
        first draft forward would carry the whole prompt and the policy would price
        speculation for it out of reach."""
        segs, reqs = [], []
        for r, n in prefills:
            end = r.kv_len + n  # kv_len is still the chunk's start here
            if r.draft_kv_len < end:
                segs.append(Segment(r.blocks, r.draft_kv_len, r.all_ids[r.draft_kv_len : end]))
                reqs.append((r, end))
        if segs:
            self.drafter.runner.forward(segs)
            for r, end in reqs:
                r.draft_kv_len = end

    def _draft(self, decodes: list[Request], sched) -> DraftResult:
        info = step_info(
            decodes, self.cfg.k_max, self.cfg.tpot_slo,
            prefill_tokens=sum(n for _, n in sched.prefills),
            prefill_context=sum(r.kv_len + n for r, n in sched.prefills),
        )
        res = run_drafting(self.drafter, self.policy, decodes, info)
        self.stats.policy_time_total += res.policy_time
        self.stats.draft_forwards += res.forwards if self.drafter.kind == "model" else 0
        self._step_info = info
        return res

    def _sample(self, r: Request, row: torch.Tensor, argmax: int) -> int:
        if r.params.greedy:
            return argmax
        return draw(processed_probs(row[None], [r.params])[0], r.generator)

    def _accept(self, r: Request, i: int, draft: DraftResult | None, logits, argmax) -> list[int]:
        k = int(draft.k[i]) if draft is not None else 0
        if k == 0:
            return [self._sample(r, logits[-1], argmax[-1])]
        drafts = draft.tokens[i, :k].tolist()
        if r.params.greedy:
            return greedy_accept(drafts, argmax)
        p = processed_probs(logits, [r.params] * (k + 1))
        if draft.q is not None and draft.q[i]:
            q = torch.stack(draft.q[i][:k])
        else:  # n-gram proposals are deterministic: q is one-hot on the proposed token
            q = torch.zeros(k, p.shape[-1]).scatter_(1, torch.tensor(drafts)[:, None], 1.0)
        return speculative_accept(drafts, q, p, r.generator)

    # ----- commit: append tokens, stop checks, KV rollback
    def _commit(self, r: Request, tokens: list[int]) -> Touched:
        st = self._detok[r.rid]
        new_ids: list[int] = []
        reason = None
        for t in tokens:
            r.output_ids.append(t)
            new_ids.append(t)
            if r.first_token_time is None:
                r.first_token_time = time.perf_counter()
            piece = self.detok.push(st, t)
            r.output_text = st.text
            reason = self._stop_reason(r, t, len(piece))
            if reason is not None:
                break
        self.stats.generated_tokens += len(new_ids)
        if reason is None and r.status is Status.RUNNING:
            r.kv_len = r.num_tokens - 1
            r.draft_kv_len = min(r.draft_kv_len, r.num_tokens - 1)
            self.scheduler.trim(r, r.num_tokens)
        if reason is not None:
            if not isinstance(r.matched_stop, str):  # no stop string cut the text: flush
                self.detok.flush(st)
                r.output_text = st.text
            self.finish(r, reason)
            safe = len(r.output_text)
        else:  # hold back a tail that may be the start of a stop string
            safe = len(r.output_text) - partial_stop_len(r.output_text, r.params.stop)
        new_text = r.output_text[r.text_sent : safe]
        r.text_sent = max(r.text_sent, safe)
        return r, new_ids, new_text

    def _stop_reason(self, r: Request, t: int, new_chars: int) -> FinishReason | None:
        p = r.params
        if not p.ignore_eos and t in self.eos:
            r.matched_stop = t
            return FinishReason.STOP
        if t in p.stop_token_ids:
            r.matched_stop = t
            return FinishReason.STOP
        hit = find_stop(r.output_text, new_chars, p.stop)
        if hit is not None:
            r.output_text = r.output_text[: hit[0]]
            r.matched_stop = hit[1]
            return FinishReason.STOP
        if len(r.output_ids) >= p.max_new_tokens:
            return FinishReason.LENGTH
        if r.num_tokens >= self.parts.target.cfg.max_position_embeddings:
            return FinishReason.LENGTH
        return None

    def _account(self, decodes, draft: DraftResult | None, accepted, step_time, n_prefill) -> None:
        s = self.stats
        s.steps += 1
        s.step_time_total += step_time
        ks = draft.k if draft is not None else np.zeros(len(decodes), dtype=np.int64)
        for i, r in enumerate(decodes):
            k, a = int(ks[i]), int(accepted[i])
            s.record_verify(k, a)
            if draft is not None:
                proposed = int(draft.drafted[i])
                s.proposed += proposed
                r.spec.proposed += proposed
            if k:
                r.spec.verify_steps += 1
                r.spec.verified += k
                r.spec.accepted += a
        if draft is not None and ks.any():
            s.spec_steps += 1
        slo = min((r.params.tpot_slo or self.cfg.tpot_slo or math.inf) for r in decodes) if decodes else math.inf
        if step_time > slo:
            s.slo_step_misses += 1
        drafted = draft.drafted if draft else np.zeros(0, dtype=np.int64)
        s.history.append(StepRecord(
            time.time(), len(decodes) + n_prefill, len(decodes),
            float(drafted.mean()) if len(drafted) else 0.0, float(ks.mean()) if len(ks) else 0.0,
            step_time,
        ))
        if draft is not None:
            t = time.perf_counter()
            self.policy.observe(self._step_info, VerifyOutcome(
                drafted=drafted.copy(), verified=ks.copy(), accepted=accepted,
                confidences=draft.confidences, step_time=step_time, draft_time=draft.draft_time,
                verify_time=self._verify_time,
            ))
            s.policy_time_total += time.perf_counter() - t
