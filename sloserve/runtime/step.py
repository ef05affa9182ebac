"""One engine step, top-down in `StepRunner.step`: schedule -> plan -> draft rounds ->
verify lengths -> one ragged target forward -> accept -> commit -> books and feedback.

The step's books (request lengths, KV rollback, counters) are step_books.py's, shared with
the simulator; the speculation decisions are the policy's plan (sloserve.speculation).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from sloserve.runtime.batch import Segment
from sloserve.runtime.config import EngineConfig
from sloserve.runtime.constraints import Processed
from sloserve.runtime.constraints.batch import process_targets
from sloserve.runtime.detokenizer import Detokenizer, DetokState, find_stop, partial_stop_len
from sloserve.runtime.drafter.draft_sources import ModelDrafter, NgramDrafter
from sloserve.runtime.drafter.rounds import (
    DraftResult,
    draft_rounds,
    step_info,
)
from sloserve.runtime.engine_setup import EngineParts
from sloserve.runtime.logprobs import TokenLogprobs, token_logprobs
from sloserve.runtime.request import FinishReason, Request, Status
from sloserve.runtime.sampler import processed_probs
from sloserve.runtime.scheduler import Scheduler
from sloserve.runtime.stats import EngineStats
from sloserve.runtime.step_books import (
    account_step,
    advance_prefills,
    binding_tpot,
    prefill_load,
    settle_kv,
    take_draft_prefill,
)
from sloserve.speculation import SpecSession
from sloserve.verifier.acceptance import draw, greedy_accept, speculative_accept

Touched = tuple[Request, list[int], str]  # request, new token ids, new text
log = logging.getLogger(__name__)


class RequestError(RuntimeError):
    """The step's work for one request raised: that request fails, its batch goes on."""


def _process_one(item) -> Processed | RequestError:
    try:
        return process_targets([item])[0]
    except Exception as e:  # noqa: BLE001 - handed to the step, which fails this request
        err = RequestError(f"{type(e).__name__}: {e}")
        err.__cause__ = e
        return err


def check_rows(logits: torch.Tensor) -> None:
    """Raise unless every row [R, V] leaves a token to sample: a row whose every entry is
    -inf (a grammar that masks every token) or NaN has no distribution."""
    top = logits.amax(dim=-1)
    if not bool(torch.isfinite(top).all()):
        raise RequestError("no token can be sampled: every token is masked (a grammar that "
                           "allows nothing here) or the processed logits are not numbers")


class StepRunner:
    def __init__(self, cfg: EngineConfig, parts: EngineParts, stats: EngineStats):
        self.cfg = cfg
        self.parts = parts
        self.stats = stats
        self.scheduler = Scheduler(cfg.scheduler, parts.allocator)
        window = parts.target.cfg.max_position_embeddings
        if cfg.context_length is not None and cfg.context_length > window:
            raise ValueError(f"context_length {cfg.context_length} is beyond the model's "
                             f"context window of {window} tokens (max_position_embeddings)")
        self.max_context = cfg.context_length or window  # prompt + output tokens per request
        self.detok = Detokenizer(parts.tokenizer)
        self.policy = parts.policy
        self.drafter: ModelDrafter | NgramDrafter | None = None
        if cfg.drafter == "model" and parts.draft is not None:
            self.drafter = ModelDrafter(parts.draft)
        elif cfg.drafter == "ngram":
            self.drafter = NgramDrafter()
        eos = set(parts.target.cfg.eos_token_ids)
        if getattr(parts.tokenizer, "eos_token_id", None) is not None:
            eos.add(parts.tokenizer.eos_token_id)
        self.eos = frozenset(eos)
        self._detok: dict[str, DetokState] = {}
        self._finished_outside: list[Request] = []
        self._constrained = 0  # live requests with constraints (their rows need processing)

    @property
    def speculative(self) -> bool:
        return self.drafter is not None and self.policy.speculates and self.cfg.k_max > 0

    # ----- request lifecycle
    def add(self, req: Request) -> None:
        self._detok[req.rid] = DetokState(
            skip_special_tokens=req.params.skip_special_tokens,
            spaces_between_special_tokens=req.params.spaces_between_special_tokens)
        self._constrained += req.constraints is not None
        self.stats.prompt_tokens += len(req.prompt_ids)
        self.scheduler.add(req)

    def finish(self, req: Request, reason: FinishReason) -> None:
        if req.finished:
            return
        req.status = Status.FINISHED
        req.finish_reason = reason
        req.finish_time = time.perf_counter()
        self._constrained -= req.constraints is not None
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
        # 1. schedule: prefill chunks and decodes; decodes get KV room for k_max drafts
        sched = self.scheduler.schedule(self.cfg.k_max if self.speculative else 0)
        self.stats.preemptions += len(sched.preempted)
        if sched.empty:
            return []
        prefills, decodes = sched.prefills, sched.decodes
        # 2-4. plan, draft rounds, verify lengths (decodes only, when speculating)
        draft: DraftResult | None = None
        if decodes and self.speculative:
            assert self.drafter is not None
            info = step_info(decodes, self.cfg.k_max, self.cfg.tpot_slo, *prefill_load(prefills))
            session = SpecSession(self.policy, info)
            # a request's drafts are verified at positions num_tokens .. num_tokens + k - 1:
            # they must lie inside the context window
            room = np.array([self.max_context - r.num_tokens for r in decodes], dtype=np.int64)
            draft = draft_rounds(self.drafter, session, decodes, room)
            draft.draft_time += session.plan_time  # the drafting loop as timed: planning included
        # 5. one ragged target forward: prefill chunks, then per decode its last token and
        # the k_r drafts it verifies (logits for every query token of a verify segment)
        chains = [draft.tokens[i, : int(draft.k[i])].tolist() if draft is not None else []
                  for i in range(len(decodes))]  # [B][k_r] the verified drafts
        segs = [Segment(r.blocks, r.kv_len, r.all_ids[r.kv_len : r.kv_len + n])
                for r, n in prefills]
        segs += [Segment(r.blocks, r.kv_len, [r.all_ids[-1], *c], all_logits=bool(c))
                 for r, c in zip(decodes, chains)]
        t_fwd = time.perf_counter()
        logits, batch = self.parts.target.forward(segs)
        argmax = logits.argmax(dim=-1).tolist()  # (waits for the device)
        verify_time = time.perf_counter() - t_fwd
        if prefills and self.speculative and isinstance(self.drafter, ModelDrafter):
            self.drafter.read_prefill([Segment(r.blocks, start, r.all_ids[start:end])
                                       for r, start, end in take_draft_prefill(prefills)])
        # 6. accept and commit: a completed prompt's first token; each decode's accepted
        # drafts and one token from the target. Rows of constrained requests (penalties, a
        # grammar, min_new_tokens) are processed first, all together.
        done = advance_prefills(prefills)
        reqs = [prefills[i][0] for i in done] + decodes
        chains = [[] for _ in done] + chains
        ptr = batch.logits_indptr  # rows of segment s: ptr[s]:ptr[s + 1]
        rows = [slice(ptr[s], ptr[s + 1]) for s in [*done, *range(len(prefills), len(segs))]]
        processed = self._process(reqs, chains, rows, logits)
        touched: list[Touched] = []
        accepted = [0] * len(decodes)
        for j, r in enumerate(reqs):
            d = j - len(done)  # index among the decodes (negative: a prefill)
            q = draft.q[d] if d >= 0 and draft is not None and draft.q is not None else None
            try:  # a request whose rows cannot be sampled fails alone (isolation)
                emitted, lp = self._emit(r, chains[j], q, logits[rows[j]], argmax[rows[j]],
                                         processed[j])
                touched.append(self._commit(r, emitted, lp))
            except Exception as e:  # noqa: BLE001 - attributed to this request only
                self.fail(r, e)
                continue
            if d >= 0:
                accepted[d] = len(emitted) - 1
        # 7. books and feedback
        step_time = time.perf_counter() - t0
        account_step(self.stats, decodes, draft, accepted, step_time, len(prefills),
                     binding_tpot(decodes, self.cfg.tpot_slo), time.time())
        if draft is not None:
            self._feedback(draft, accepted, step_time, verify_time)
        return touched

    def _feedback(self, draft: DraftResult, accepted: list[int], step_time: float,
                  verify_time: float) -> None:
        s = self.stats
        s.draft_forwards += draft.forwards if isinstance(self.drafter, ModelDrafter) else 0
        draft.session.finish(accepted, step_time, draft.draft_time, verify_time,
                             end_time=time.perf_counter())
        s.policy_time_total += draft.policy_time

    def _process(self, reqs: list[Request], chains: list[list[int]], rows: list[slice],
                 logits: torch.Tensor) -> list[Processed | RequestError | None]:
        """Processed target rows of the constrained requests (None for the others). When the
        batched pass raises, each request's rows are processed alone: the one that raises
        gets its error (RequestError) instead, the others their rows, the same values."""
        out: list[Processed | RequestError | None] = [None] * len(reqs)
        if not self._constrained:  # the common case: no request uses these options
            return out
        idx = [j for j, r in enumerate(reqs) if r.constraints is not None]
        items = [(c, logits[rows[j]], chains[j]) for j in idx
                 if (c := reqs[j].constraints) is not None]
        done: Sequence[Processed | RequestError]
        try:
            done = process_targets(items)
        except Exception:  # noqa: BLE001 - one request's rows: find it, process each alone
            done = [_process_one(item) for item in items]
        for j, pr in zip(idx, done):
            out[j] = pr
        return out

    def _emit(self, r: Request, chain: list[int], q: list[torch.Tensor] | None, logits,
              argmax, pr: Processed | RequestError | None
              ) -> tuple[list[int], TokenLogprobs | None]:
        """One request's emitted tokens and (if it asked) their log-probabilities, computed
        before anything of it is committed; raises when its rows cannot be sampled."""
        if isinstance(pr, RequestError):
            raise pr
        if pr is not None:
            check_rows(pr.logits)
        emitted = self._accept(r, chain, q, logits, argmax, pr)
        lp = None
        if r.logprobs is not None:  # the emitted tokens' rows, processed as sampled
            lp = token_logprobs(pr.logits if pr is not None else logits, emitted,
                                r.params.temperature, r.logprobs.k, r.logprobs.token_ids)
        return emitted, lp

    def fail(self, r: Request, error: BaseException) -> None:
        """End one request whose step work raised; the rest of the batch goes on."""
        log.warning("request %s failed in its step (%r); the others go on", r.rid, error)
        r.error = f"{type(error).__name__}: {error}"[:300]
        self.stats.requests_failed += 1
        if r.constraints is not None:
            r.constraints.drop_drafts()
        self.finish(r, FinishReason.ABORT)

    def _accept(self, r: Request, chain: list[int], q: list[torch.Tensor] | None, logits,
                argmax, pr: Processed | None) -> list[int]:
        """The tokens emitted from one request's target rows (logits [k + 1, V], one row per
        verified position; k = len(chain)): the accepted drafts and one token."""
        greedy = r.params.greedy
        probs: Any  # [k + 1, V]; None on the greedy path only
        if pr is not None:  # a constrained request: its processed rows decide
            argmax, probs = pr.argmax, pr.probs
        else:
            probs = None if greedy else processed_probs(logits, [r.params] * len(chain + [0]))
        if not chain:
            return [argmax[-1] if greedy else draw(probs[-1], r.generator)]
        if greedy:
            return greedy_accept(chain, argmax)
        if q:
            q_rows = torch.stack(q[: len(chain)])
        else:  # n-gram proposals are deterministic: q is one-hot on the proposed token
            q_rows = torch.zeros(len(chain), probs.shape[-1]).scatter_(
                1, torch.tensor(chain)[:, None], 1.0)
        return speculative_accept(chain, q_rows, probs, r.generator)

    # ----- commit: append tokens, stop checks, KV rollback
    def _commit(self, r: Request, tokens: list[int], lp: TokenLogprobs | None = None
                ) -> Touched:
        """Append the emitted tokens up to a stop (or the length limit) and their
        log-probabilities; stop checks, the constraints' commit, KV rollback."""
        st = self._detok[r.rid]
        new_ids: list[int] = []
        reason = None
        for t in tokens:
            r.output_ids.append(t)
            new_ids.append(t)
            if r.first_token_time is None:
                r.first_token_time = time.perf_counter()
            reason = self._token_stop(r, t)
            if reason is not None and not r.params.no_stop_trim:
                break  # as SGLang: a stop token's text is not part of the output
            piece = self.detok.push(st, t)
            r.output_text = st.text
            reason = reason or self._text_stop(r, len(piece))
            if reason is None and r.room(self.max_context) <= 0:
                reason = FinishReason.LENGTH
            if reason is not None:
                break
        self.stats.generated_tokens += len(new_ids)
        if reason is None:
            if r.constraints is not None:
                r.constraints.commit(new_ids)
            if r.status is Status.RUNNING:
                settle_kv(r, self.scheduler)
        if reason is not None:
            if r.params.no_stop_trim or not isinstance(r.matched_stop, str):
                self.detok.flush(st)  # no stop string cut the text: emit what is held back
                r.output_text = st.text
            self.finish(r, reason)
            safe = len(r.output_text)
        else:  # hold back a tail that may be the start of a stop string
            safe = len(r.output_text) - partial_stop_len(r.output_text, r.params.stop)
        new_text = r.output_text[r.text_sent : safe]
        r.text_sent = max(r.text_sent, safe)
        if lp is not None and r.logprobs is not None:
            r.logprobs.extend(lp.head(len(new_ids)))
        return r, new_ids, new_text

    def _token_stop(self, r: Request, t: int) -> FinishReason | None:
        """EOS (unless ignore_eos), a stop token id, or the end of the request's grammar (a
        stop token it accepted ends it even with ignore_eos, as in SGLang)."""
        p = r.params
        is_eos = t in self.eos
        if (is_eos and not p.ignore_eos) or t in p.stop_token_ids or (
                is_eos and r.constraints is not None and r.constraints.grammar is not None):
            r.matched_stop = t
            return FinishReason.STOP
        return None

    def _text_stop(self, r: Request, new_chars: int) -> FinishReason | None:
        """A stop string completed by the last token's text (cut from the text unless
        no_stop_trim)."""
        hit = find_stop(r.output_text, new_chars, r.params.stop)
        if hit is None:
            return None
        if not r.params.no_stop_trim:
            r.output_text = r.output_text[: hit[0]]
        r.matched_stop = hit[1]
        return FinishReason.STOP
