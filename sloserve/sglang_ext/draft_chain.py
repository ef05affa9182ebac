"""SPECSERVE's draft side inside SGLang: a standalone draft model with its KV aligned to the
sequence (imports SGLang; installed on the worker's draft worker by worker.py).

SGLang 0.5.23 runs STANDALONE drafts through EAGLE's layout, where the draft's KV slot of
position p holds token p + 1 (the input ids are rotated left by one, EAGLE's convention for
a draft that reads the target's hidden state of p with token p + 1). For an ordinary LM
draft this drops the sequence's first token from everything the draft sees: with draft =
target the built-in pair accepted 0.88 of its drafts, not ~1 (measured; the tiny test pair
0.67-1.0 per request; tests/sglang_runtime reproduce SGLang's algorithm exactly). Here the
draft's slot of position p holds token p, as in sloserve's own engine:

    prefill      nothing: the draft reads a request's prompt when it first drafts (a
                 request the policy never drafts for costs no draft forward at all)
    draft (k>0)  k forwards on the window SGLang reserved past seq_len L: the bonus token b
                 at L gives d_1, d_1 at L + 1 gives d_2, ..., d_{k-1} at L + k - 1 gives d_k;
                 each token's draft probability is its confidence
    after verify nothing: the rounds wrote KV for b, d_1..d_{k-1} at L..L + k - 1, the
                 tokens verified, so only d_k at L + k (committed when all k are accepted)
                 has none; SGLang's own flow re-reads the whole window [b, d_1..d_k] with
                 the draft, a forward an EAGLE head needs and this draft does not
    k = 0        a step that drafts nothing leaves b at L unread (draft_kv.py keeps what
                 is missing: prompts not read, skipped steps' tokens, the last drafted
                 position, slots shared later through the radix cache)
    catch-up     the first round of a step where anyone misses positions is one ragged
                 extend over each request's missing positions and its bonus token at L (the
                 last row's logits give d_1), so many skipped steps and a whole prompt cost
                 a few rows of a forward the step runs anyway, not a forward of their own

NgramDraft (`--drafter ngram`) replaces the draft model's rounds by prompt lookup over each
request's own tokens (ngram_chain.py): no draft forward, no draft KV.

The chain goes to SGLang's own verify as [b, d_1..d_k] (topk 1). The multi-step attention
backends are built here per k with k + 1 positions (SGLang's hold k - 1 draft forwards).
"""

from __future__ import annotations

import copy
import itertools
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from sloserve.sglang_ext.chain_sampling import draft_pick
from sloserve.sglang_ext.cpu_weights import (
    Bf16Linear,
    PackedF32Method,
    bf16_method,
    column_major,
    is_column_major,
)
from sloserve.sglang_ext.draft_kv import DraftKVBook
from sloserve.sglang_ext.lean_draft import LeanDraft
from sloserve.sglang_ext.ngram_chain import NgramChains
from sloserve.sglang_ext.sglang_internals import (
    CaptureHiddenMode,
    DraftBackendFactory,
    EagleDraftExtendInput,
    EagleDraftInput,
    ForwardBatch,
    ForwardContext,
    ForwardMode,
    build_eagle_verify_input,
    forward_context,
    per_step_draft_out_cache_loc,
    prepare_for_draft,
    replace_methods,
)

# (the batch, draft tokens [bs, k], confidences [bs, k]) of the chain just drafted
ChainSink = Callable[[Any, torch.Tensor, torch.Tensor], None]
# after each draft round: (the batch, the round's confidences [bs]) -> whether another
# round runs (the session on the batch decides: worker.py)
RoundHook = Callable[[Any, torch.Tensor], bool]
# drafting stopped after s < k rounds: switch the worker to s rounds before the verify
RoundsDone = Callable[[int], None]
# (the batch, rows) of a step's catch-up: the rows its first round read besides the bonus
# tokens (the controller prices them: controller.py)
CatchUpSink = Callable[[Any, int], None]
# the batch -> [bs] whether each request drafts the step's first round (None: all do); a
# catch-up reads the missing positions of those requests only
Drafters = Callable[[Any], "Sequence[bool] | np.ndarray | None"]


def _plain_logits(batch: Any, si: Any) -> bool:
    """No grammar mask, penalties or logit bias change the batch's logits before sampling."""
    return (not batch.has_grammar and si.acc_additive_penalties is None
            and si.acc_scaling_penalties is None and si.logit_bias is None)


def sampled_batch(batch: Any) -> bool:
    """Whether SPECSERVE samples this decode batch itself (chain_sampling.py): some request is
    not greedy, and none needs what that sampler does not apply (a grammar, penalties, a
    logit bias, min-p); those batches keep SGLang's verify (argmax on CPUs)."""
    si = batch.sampling_info
    if si is None or si.is_all_greedy:
        return False
    return _plain_logits(batch, si) and not si.need_min_p_sampling


def compact_acceptance(batch: Any) -> bool:
    """Whether a ragged verify's acceptance may read the verified rows' logits alone
    (chain_sampling.greedy_chains): an all-greedy batch whose verify reads the logits for
    nothing else (no grammar mask, penalties, logit bias, watermark or logprobs)."""
    si = batch.sampling_info
    return (si is not None and bool(si.is_all_greedy) and _plain_logits(batch, si)
            and not batch.return_logprob
            and not getattr(si, "has_watermark_candidates", False))


class AlignedDraft:
    """Replaces the EAGLE-layout methods of SGLang's standalone draft worker `dw`."""

    deterministic = False  # proposals drawn from q (NgramDraft: one-hot, no q kept)

    def __init__(self, dw: Any, k_max: int, on_chain: ChainSink | None = None,
                 on_round: RoundHook | None = None, on_stop: RoundsDone | None = None,
                 on_catch_up: CatchUpSink | None = None,
                 drafters: Drafters | None = None) -> None:
        self.dw = dw
        self.on_catch_up = on_catch_up
        self.drafters = drafters
        self.on_chain = on_chain
        self.on_round = on_round  # the plan's early stop (None: always k rounds)
        self.on_stop = on_stop
        self.k_max = k_max
        # the draft distributions of the chain just drafted ([bs, k, V]) when the batch is
        # sampled by SPECSERVE (sampled_batch), else None (greedy: SGLang's argmax verify)
        self.last_q: torch.Tensor | None = None
        self.backends: dict[int, Any] = {}  # k -> multi-step backend (built at first use:
        # the draft's memory pool does not exist yet when the worker is built)
        self._book: DraftKVBook | None = None  # (likewise)
        self.caught_up_tokens = 0  # positions read by catch-up extends (tests, logs)
        # chain_topology's rows for batches wider than SGLang's, per (parents, scores)
        # width: each draft length's runtime state has its own
        self._wide: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}
        # [N] int64 token ids of the draft head's rows when it is cut to a hot vocabulary
        # (use_hot_vocab); None: the full head, row i = token i
        self.hot: torch.Tensor | None = None
        self.vocab_size = 0  # the full vocabulary V (set with `hot`)
        # the draft's forward without SGLang's model runner (lean_draft.py), built at first
        # use (the KV pool does not exist yet); None: SGLang's forward
        self._lean: LeanDraft | None | bool = False  # False: not decided yet

    @property
    def book(self) -> DraftKVBook:
        if self._book is None:
            pool = self.dw.draft_runner.token_to_kv_pool
            self._book = DraftKVBook(self.dw.req_to_token_pool.req_to_token,
                                     pool.size + pool.page_size)
        return self._book

    def release(self, rid: str) -> None:
        """The request finished (the draft's KV goes with SGLang's slots)."""

    def lags(self, batch: Any) -> list[int]:
        """[bs] positions each request's catch-up would read besides its bonus token if it
        drafted this step (StepInfo.draft_lag: its prompt before it first drafts, a token a
        step without drafting, the last accepted draft)."""
        if self._book is None:
            return [0] * len(batch.reqs)
        return self.book.lags(_rows(batch), _seq_lens(batch))

    def backend(self, k: int) -> Any:
        """The multi-step draft attention backend for k forwards (SGLang's factory builds one
        for steps - 1 forwards, so it is asked for k + 1)."""
        b = self.backends.get(k)
        if b is None:
            b = DraftBackendFactory(self.dw.draft_runner, 1, k + 1).create_decode_backend()
            self.backends[k] = b
        return b

    @property
    def lean(self) -> LeanDraft | None:
        if self._lean is False:
            self._lean = LeanDraft.build(self.dw)
        assert not isinstance(self._lean, bool)
        return self._lean

    def install(self) -> None:
        replace_methods(self.dw, _draft_extend_for_prefill=self.prefill_extend,
                        draft=self.draft, _draft_extend_for_decode=self.decode_extend)

    def use_hot_vocab(self, hot: torch.Tensor, dtype: torch.dtype = torch.float32) -> bool:
        """Cut the draft's LM head to the rows of `hot` ([N] int64 token ids, the draft's
        most frequent answer tokens): each draft forward's head then reads N rows of the
        [V, H] matrix instead of V (SmolLM2: 49,152 x 576 in float32 is 113 MB, two thirds
        of its 4-layer draft's bytes at batch 1). The draft proposes only hot tokens; the
        target verifies as ever, so greedy output is unchanged and sampling keeps the
        target's distribution (q is the cut head's, zero off the hot set). Its input
        embedding stays whole. False (nothing changed) for a head SGLang packed for AMX
        kernels, whose rows are not the weight's rows. dtype: the cut head's (bf16 with the
        draft's bf16 linears, cpu_weights.bf16_draft_linears: the cut head multiplies
        through the same Bf16Linear and answers float32)."""
        model = self.dw.draft_runner.model
        head = model.lm_head
        if getattr(head, "use_intel_amx_backend", False) or not hasattr(head, "weight"):
            return False
        weight = head.weight.detach()
        self.vocab_size = int(weight.shape[0])
        hot = hot.to(device=weight.device, dtype=torch.int64)
        if hot.ndim != 1 or not len(hot) or int(hot.min()) < 0 \
                or int(hot.max()) >= self.vocab_size:
            raise ValueError(f"hot vocabulary: token ids outside [0, {self.vocab_size})")
        rows = weight.index_select(0, hot).contiguous()  # [N, H]
        method = getattr(head, "quant_method", None)
        packed = isinstance(method, PackedF32Method)
        if isinstance(method, PackedF32Method):  # the whole head's packed copy goes (a tied
            head.quant_method = method.inner     # embedding keeps its lookups)
        if dtype != weight.dtype:  # row-major: bf16 GEMMs run fastest on it
            rows = rows.to(dtype)
        elif is_column_major(weight):  # the whole head's memory order
            rows = column_major(rows)
        model.lm_head = _RowsHead(rows, packed=packed)
        self.hot = hot
        return True

    def _full_vocab(self, q: torch.Tensor) -> torch.Tensor:
        """q [bs, N] over the hot rows -> [bs, V] (zero off the hot set); as is when the
        head is whole."""
        if self.hot is None:
            return q
        full = q.new_zeros((q.shape[0], self.vocab_size))
        return full.index_copy_(1, self.hot, q)

    # ----- prefill: nothing is read now; the first round that drafts reads the prompt
    def prefill_extend(self, batch: Any, target_hidden_states: Any, next_token_ids: torch.Tensor,
                       mm_input_embeds: Any = None, kv_loc_plan: Any = None) -> EagleDraftInput:
        if not batch.forward_mode.is_idle():
            self.book.unread(batch.out_cache_loc)  # the chunk's slots: no draft KV yet
            self.book.prefilled(_rows(batch), [r.get_fill_ids() for r in batch.reqs])
        return self._next_input(len(batch.seq_lens), next_token_ids)

    # ----- the first round of a step that drafts, with what was not read before it
    def first_round(self, batch: Any, bonus: torch.Tensor, loc0: torch.Tensor,
                    locs: torch.Tensor) -> torch.Tensor | None:
        """When a request that drafts misses draft KV (prompts not read, steps that drafted
        nothing, holes in a cached prefix): one ragged extend over positions start_r..L_r of
        each request, the bonus token [bs] at L_r in its round-1 slot loc0 [bs], returning
        the logits of each request's last row ([bs, V]: round 1's); else None (round 1 runs
        as a draft decode forward). A request that does not draft (`drafters`) reads its
        bonus token only and keeps what it misses, which the policy did not pay for: its
        rounds run in SGLang's batch forward on the KV it has, their proposals unused, and
        the slots they write ([k + 1, bs] locs) stay marked unread. The rows read besides
        the bonus tokens go to `on_catch_up`."""
        rows, lens = _rows(batch), _seq_lens(batch)
        drafting = self.drafters(batch) if self.drafters is not None else None
        # kept: batch indices of requests that miss positions but do not draft
        starts, kept = self.book.drafters_catch_up(rows, lens, drafting)
        if starts is None:
            if kept:
                self.book.unread(locs[:, kept].reshape(-1))
            return None
        self.book.bonus(rows, lens, bonus)
        ends = [n + 1 for n in lens]  # through the bonus token's position L
        tokens, slots = self.book.window(rows, starts, ends)
        bs = len(lens)
        lean = self.lean
        if lean is not None and max(e - s for s, e in zip(starts, ends)) <= LEAN_EXTEND:
            logits = self._lean_extend(lean, batch, tokens, slots, starts, ends)
        else:
            logits = self._sglang_extend(batch, tokens, slots, starts, ends)
        self.book.written(slots)
        if kept:  # (after `written`: their bonus slot is one of the extend's)
            self.book.unread(locs[:, kept].reshape(-1))
            stale = set(kept)
            rows = [r for i, r in enumerate(rows) if i not in stale]
        self.book.caught_up(rows)
        missed = int(tokens.shape[0]) - bs
        self.caught_up_tokens += missed
        if self.on_catch_up is not None:
            self.on_catch_up(batch, missed)
        return logits

    def _lean_extend(self, lean: LeanDraft, batch: Any, tokens: torch.Tensor,
                     slots: torch.Tensor, starts: list[int], ends: list[int]) -> torch.Tensor:
        """The catch-up extend through LeanDraft: request b's positions starts[b] ..
        ends[b] - 1 (tokens, slots [T] in that order) -> [bs, N] its last row's logits."""
        q_lens = [e - s for s, e in zip(starts, ends)]
        offsets = [0, *itertools.accumulate(q_lens[:-1])]  # each segment's first row
        positions = torch.tensor([p for s, e in zip(starts, ends) for p in range(s, e)],
                                 dtype=torch.int64)
        table = _table(self.dw, batch, max(ends))
        return lean.forward(tokens.long().contiguous(), positions, slots.long().contiguous(),
                            table, torch.tensor(offsets, dtype=torch.int64),
                            torch.tensor(q_lens, dtype=torch.int64),
                            torch.tensor(starts, dtype=torch.int64))

    def _sglang_extend(self, batch: Any, tokens: torch.Tensor, slots: torch.Tensor,
                       starts: list[int], ends: list[int]) -> torch.Tensor:
        """The catch-up extend as an EXTEND forward of SGLang's draft runner."""
        dw = self.dw
        cb = copy.copy(batch)  # SGLang's batch stays as it is; this forward is the draft's
        cb.forward_mode = ForwardMode.EXTEND
        cb.input_ids, cb.out_cache_loc = tokens, slots
        cb.seq_lens = batch.seq_lens + 1
        if getattr(batch, "seq_lens_cpu", None) is not None:
            cb.seq_lens_cpu = batch.seq_lens_cpu + 1
        if getattr(batch, "orig_seq_lens", None) is not None:
            cb.orig_seq_lens = batch.orig_seq_lens + 1
        cb.seq_lens_sum = sum(ends)
        cb.prefix_lens = list(starts)
        cb.extend_lens = [n - s for s, n in zip(starts, ends)]
        cb.extend_num_tokens = sum(cb.extend_lens)
        cb.extend_logprob_start_lens = list(cb.extend_lens)
        cb.return_logprob, cb.extend_input_logprob_token_ids = False, None
        cb.decoding_reqs = None
        cb.spec_info = EagleDraftExtendInput(hidden_states=None, num_tokens_per_req=1,
                                             num_tokens_for_logprob_per_req=1)
        fb = ForwardBatch.init_new(cb, dw.draft_runner, capture_hidden_mode=CaptureHiddenMode.NULL,
                                   return_hidden_states_before_norm=False)
        fb.return_logprob = False
        return logits32(dw.draft_runner.forward(fb).logits_output.next_token_logits)  # [bs, V]

    def _stub_next(self, batch: Any, batch_result: Any) -> None:
        """The result's next draft input gets the shape-valid top-k stubs (_next_input)."""
        nxt = batch_result.next_draft_input
        stub = self._next_input(len(batch.seq_lens), nxt.bonus_tokens)
        nxt.topk_p, nxt.topk_index, nxt.hidden_states = stub.topk_p, stub.topk_index, None

    def _next_input(self, bs: int, bonus: torch.Tensor) -> EagleDraftInput:
        """The draft input SGLang carries to the next decode step: its bonus token (the
        top-k fields are shape-valid stubs; this draft starts from the bonus itself)."""
        dev = self.dw.device
        return EagleDraftInput(
            topk_p=torch.ones((bs, 1), dtype=torch.float32, device=dev),
            topk_index=torch.zeros((bs, 1), dtype=torch.int64, device=dev),
            hidden_states=None, bonus_tokens=bonus, capture_hidden_mode=CaptureHiddenMode.NULL,
            num_tokens_per_req=1, num_tokens_for_logprob_per_req=1)

    # ----- draft: k rounds from the bonus token, then SGLang's verify input
    def draft(self, batch: Any) -> Any:
        dw = self.dw
        k = dw.speculative_num_steps
        draft_input: EagleDraftInput = batch.spec_info
        bs = len(batch.seq_lens)
        drafts, confs, qs = self.rounds(batch, draft_input, k)
        if len(drafts) < k:
            # fewer rounds than prepared: the verify (and the draft extend after it) use the
            # runtime state of that many rounds; its KV slots are a prefix of the reserved ones
            k = len(drafts)
            assert self.on_stop is not None
            self.on_stop(k)
        draft_tokens = torch.stack(drafts, dim=1)  # [bs, k]
        self.last_q = torch.stack(qs, dim=1) if qs else None
        if self.on_chain is not None:  # want_conf: a confidence per round
            self.on_chain(batch, draft_tokens, torch.stack(confs, dim=1))
        parents, scores = self.chain_topology(bs)
        return build_eagle_verify_input(
            batch, draft_input, parents, scores, draft_tokens, None,
            target_worker=dw.target_worker, topk=1, num_steps=k, num_draft_tokens=k + 1,
            tree_mask_mode=dw.tree_mask_mode, device=dw.device)

    def chain_topology(self, bs: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The top-1 chain's tree for bs requests, as build_eagle_verify_input reads it: each
        node's parent [bs, P] and its score index [bs, S] (every row alike). SGLang
        preallocates rows for the largest decode batch it knows of at start (CUDA graphs'
        batch sizes, max_running_requests) and takes its own slow path past them; a CPU
        server batched 64 requests past them and its scheduler died in the tree kernel, so
        wider batches get row 0 repeated. The rows' widths follow the draft length of the
        runtime state in force (activate_rounds), so the wide rows are kept per width: kept
        for one only, a wide batch drafting more rounds than the first one read past its
        chain's rows and stopped the scheduler (2026-12-04)."""
        parents = self.dw._topk1_parents_prealloc
        scores = self.dw._topk1_score_indices_prealloc
        if parents.shape[0] < bs:
            key = (int(parents.shape[1]), int(scores.shape[1]))
            wide = self._wide.get(key)
            if wide is None or wide[0].shape[0] < bs:
                wide = (parents[:1].repeat(bs, 1), scores[:1].repeat(bs, 1))
                self._wide[key] = wide
            parents, scores = wide
        return parents[:bs], scores[:bs]

    def go_on(self, batch: Any, conf: torch.Tensor | None) -> bool:
        """Whether another draft round runs after one with these [bs] confidences."""
        return self.on_round is None or conf is None or self.on_round(batch, conf)

    def rounds(self, batch: Any, draft_input: EagleDraftInput, k: int
               ) -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]:
        """Up to k draft forwards (fewer when the plan stops): each round's tokens [bs],
        confidences [bs] (when anyone reads them) and, for a batch SPECSERVE samples, the
        distributions q [bs, V] the tokens were drawn from."""
        dw = self.dw
        # slots of positions L..L + k (SGLang reserves them per decode step) and positions L
        fb, _, _ = prepare_for_draft(draft_input, dw.req_to_token_pool, batch, None,
                                     dw.draft_runner, 1, k + 1)
        bs = len(batch.seq_lens)
        locs = per_step_draft_out_cache_loc(fb.out_cache_loc, bs, 1, k + 1)  # [k + 1, bs]
        tokens = draft_input.bonus_tokens.to(torch.int64).reshape(bs)
        # round 1 with the catch-up when anyone misses draft KV (before the multi-step
        # backend's metadata: that forward runs on the draft runner's own backend)
        first = self.first_round(batch, tokens, locs[0], locs)
        lean = self.lean if bs else None
        if lean is None:
            backend = self.backend(k)
            backend.init_forward_metadata(fb)
            fb.mark_forward_metadata_ready()
        else:  # every round's keys: positions 0 .. L + k - 1 (slots L .. L + k reserved)
            seq = batch.seq_lens.to(torch.int64)  # [bs] L
            table = _table(dw, batch, int(seq.max()) + k + 1)  # [bs, W]
            seg_rows = torch.arange(bs, dtype=torch.int64)
            seg_ones = torch.ones(bs, dtype=torch.int64)
        drafts: list[torch.Tensor] = []
        confs: list[torch.Tensor] = []
        qs: list[torch.Tensor] = []
        si = batch.sampling_info
        sampled = sampled_batch(batch)
        # greedy confidences only when someone reads them (the plan's early stop, a chain
        # sink): the uniform mode's greedy rounds are a bare argmax, as SGLang's own topk-1
        # draft off CUDA
        want_conf = self.on_round is not None or self.on_chain is not None
        for i in range(k):
            if i == 0 and first is not None:
                logits = first
            elif lean is not None:  # round i: one token a request at position L + i
                at = seq + i
                logits = lean.forward(tokens, at, locs[i].contiguous(), table, seg_rows,
                                      seg_ones, at)
            else:
                fb.input_ids = tokens
                fb.out_cache_loc = locs[i]
                with forward_context(ForwardContext(attn_backend=backend.attn_backends[i]),
                                     forward_batch=fb):
                    logits = logits32(dw.draft_runner.forward(fb).logits_output
                                      .next_token_logits)
            # logits [bs, V], or [bs, N] over the hot vocabulary (use_hot_vocab)
            conf: torch.Tensor | None
            if sampled:
                tokens, conf, q = draft_pick(logits, si.temperatures.reshape(-1), si.top_ks,
                                             si.top_ps)
                qs.append(self._full_vocab(q))
            elif want_conf:  # p(argmax) = exp(max - logsumexp): no [bs, V] softmax
                top, tokens = logits.max(dim=-1)  # [bs] each
                conf = torch.exp(top.float() - torch.logsumexp(logits.float(), dim=-1))
            else:
                tokens = logits.argmax(dim=-1)  # [bs]
                conf = None
            if self.hot is not None:  # the head's rows -> token ids
                tokens = self.hot[tokens]
            drafts.append(tokens)
            if conf is not None:
                confs.append(conf)
            fb.positions.add_(1)
            if not self.go_on(batch, conf):
                break  # the plan: one more round would lower the expected goodput
        return drafts, confs, qs

    # ----- after verify: nothing to read (the rounds wrote what was verified)
    def decode_extend(self, batch: Any, batch_result: Any, *, kv_loc_plan: Any = None) -> None:
        """SGLang's draft extend over the verified window [b, d_1..d_s] at L..L + s, which an
        EAGLE head needs (it reads the target's hidden states): this draft's rounds already
        wrote KV for b, d_1..d_{s-1} at L..L + s - 1, the tokens the verify saw, so every
        committed position has draft KV except L + s (d_s, committed only when all s drafts
        were accepted; b itself after a step that drafted nothing). The book marks it, and
        the next step that drafts reads it with its first round: no draft forward here."""
        verify_input = batch.spec_info
        n = verify_input.draft_token_num  # s + 1 (1 after a plain step)
        window = verify_input.draft_token.to(torch.int64).reshape(-1, n)  # [bs, n]: b, d_1..d_s
        self.committed(batch, window, batch_result)

    def committed(self, batch: Any, window: torch.Tensor, batch_result: Any) -> None:
        """The step verified window [bs, n] (b, d_1..d_s at L..L + s; n = 1: the bonus
        alone, a step that drafted nothing): the next step's draft input and the book."""
        self._stub_next(batch, batch_result)
        if not batch.forward_mode.is_idle():
            self.book.verified(_rows(batch), _seq_lens(batch), window)


class NgramDraft(AlignedDraft):
    """SPECSERVE's n-gram drafter (`--drafter ngram`): the chains come from prompt lookup
    over each request's own tokens (ngram_chain.py), no draft forward and no draft KV. SGLang
    still builds its STANDALONE draft worker (a draft model is loaded) but none of its
    forwards runs: prefill and the read of the verified window do nothing. The proposals
    are deterministic, so a sampled batch's acceptance takes q one-hot on them
    (worker._sample)."""

    deterministic = True

    def __init__(self, dw: Any, k_max: int, on_chain: ChainSink | None = None,
                 on_round: RoundHook | None = None, on_stop: RoundsDone | None = None,
                 on_catch_up: CatchUpSink | None = None, drafters: Drafters | None = None,
                 n_max: int = 3) -> None:
        super().__init__(dw, k_max, on_chain, on_round, on_stop, on_catch_up, drafters)
        self.chains = NgramChains(n_max)
        # the chain `lookup` found for the step about to draft: tokens [bs, k] on the device
        self._pending: torch.Tensor | None = None

    def lookup(self, batch: Any, k: int) -> np.ndarray | None:
        """Look the whole chain up before the step drafts (worker.py: the plan's verifier
        decides k_r on it, and SGLang then runs max k_r rounds, which `rounds` takes from
        here): [bs, k] confidences, NaN past each request's proposals; None when the batch
        carries no bonus tokens yet (nothing is drafted then)."""
        draft_input = batch.spec_info
        bonus = getattr(draft_input, "bonus_tokens", None)
        bs = len(batch.reqs)
        self._pending = None
        if bonus is None or bonus.numel() != bs or k <= 0:
            return None
        self._start(batch, bonus)
        tokens = np.zeros((bs, k), dtype=np.int64)
        conf = np.full((bs, k), np.nan)
        for j in range(k):
            tokens[:, j], conf[:, j] = self.chains.round()
            if not self.chains.live():  # every chain ended: the rest stays NaN
                tokens[:, j + 1:] = tokens[:, j:j + 1]
                break
        self._pending = torch.from_numpy(tokens).to(self.dw.device)
        return conf

    def _start(self, batch: Any, bonus: torch.Tensor) -> None:
        """Start the step's chains: each request's committed tokens and its bonus token."""
        self.chains.start([r.rid for r in batch.reqs],
                          [r.origin_input_ids + r.output_ids for r in batch.reqs],
                          bonus.reshape(len(batch.reqs)).tolist())

    def release(self, rid: str) -> None:
        self.chains.release(rid)

    def prefill_extend(self, batch: Any, target_hidden_states: Any, next_token_ids: torch.Tensor,
                       mm_input_embeds: Any = None, kv_loc_plan: Any = None) -> EagleDraftInput:
        return self._next_input(len(batch.seq_lens), next_token_ids)

    def rounds(self, batch: Any, draft_input: EagleDraftInput, k: int
               ) -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]:
        bs = len(batch.seq_lens)
        pending, self._pending = self._pending, None
        if pending is not None and pending.shape[0] == bs and pending.shape[1] >= k:
            # looked up already (`lookup`); the verifier chose k rounds of it
            ones = torch.ones(bs, dtype=torch.float32, device=pending.device)
            return [pending[:, j] for j in range(k)], [ones] * k, []
        self._start(batch, draft_input.bonus_tokens)
        dev = self.dw.device
        drafts: list[torch.Tensor] = []
        confs: list[torch.Tensor] = []
        for _ in range(k):
            tokens, conf = self.chains.round()
            drafts.append(torch.from_numpy(tokens).to(dev))
            confs.append(torch.from_numpy(conf).to(dev))
            if not self.go_on(batch, confs[-1]):
                break
        return drafts, confs, []

    def committed(self, batch: Any, window: torch.Tensor, batch_result: Any) -> None:
        self._stub_next(batch, batch_result)  # no draft KV to keep


def logits32(logits: torch.Tensor) -> torch.Tensor:
    """A draft forward's logits in float32 (a bf16 head's come out bf16)."""
    return logits if logits.dtype == torch.float32 else logits.float()


class _RowsHead(torch.nn.Module):
    """A draft LM head cut to some rows of the whole one: SGLang's logits processor reads
    its `weight` [N, H] as a plain linear layer's, or multiplies through its quant method:
    float32 rows with a copy packed for oneDNN (packed: as the whole head was,
    cpu_weights.py), bf16 rows as the draft's bf16 linears (Bf16Linear, packed where torch
    has oneDNN's packed linear), answering float32."""

    def __init__(self, weight: torch.Tensor, packed: bool = False) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(weight, requires_grad=False)
        self.quant_method: PackedF32Method | Bf16Linear | None = None
        if weight.dtype == torch.bfloat16:
            self.quant_method = bf16_method(None, weight)
        elif packed:
            self.quant_method = PackedF32Method(None, weight)


# catch-up extends of at most this many positions a request run through LeanDraft; longer
# ones (a prompt read at a request's first drafting step) through SGLang's EXTEND forward,
# whose attention is built for long segments (the paged kernel scores a segment's rows in
# one unit: fine for the few rows of a catch-up, not for a prompt)
LEAN_EXTEND = 32


def _table(dw: Any, batch: Any, width: int) -> torch.Tensor:
    """[bs, width] int64: each request's KV slots by position (its req_to_token row)."""
    req_to_token = dw.req_to_token_pool.req_to_token
    return req_to_token[:, :width].index_select(0, batch.req_pool_indices.long()).long()


def _rows(batch: Any) -> list[int]:
    """Each request's row of SGLang's req_to_token table (host values)."""
    return [r.kv.req_pool_idx for r in batch.reqs]


def _seq_lens(batch: Any) -> list[int]:
    """Each request's committed length L (its bonus token's position), host values."""
    cpu = getattr(batch, "seq_lens_cpu", None)
    return (cpu if cpu is not None else batch.seq_lens).tolist()
