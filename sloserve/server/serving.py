"""What both HTTP APIs share: the engine behind its async interface, a server-side tokenizer,
prompt checks, per-request bookkeeping (latencies, SLO misses), stream fan-in and client
disconnect handling."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import (
    AsyncGenerator,
    AsyncIterator,
    Awaitable,
    Callable,
    MutableMapping,
)
from dataclasses import dataclass, field
from typing import Any, TypeVar

from fastapi import Request

from sloserve.runtime.async_engine import AsyncEngine
from sloserve.runtime.engine import Engine, QueueFull, RequestOutput
from sloserve.runtime.engine_setup import load_tokenizer
from sloserve.runtime.logprobs import TokenLogprobs
from sloserve.runtime.request import InvalidRequest, SamplingParams, validate_prompt
from sloserve.server.errors import APIError, from_invalid
from sloserve.server.http_options import HTTPOptions
from sloserve.server.logprobs import PoolBusy, Scores, score_tokens
from sloserve.server.metrics import EngineSnapshot, ServerMetrics, take_snapshot
from sloserve.slo import effective_slo

log = logging.getLogger(__name__)
T = TypeVar("T")
SCORE_WAIT_S = 30.0  # how long a scoring pass waits for free KV blocks before a 503
RETRY_AFTER_S = 1  # what a 503 for a full queue tells the client to wait


@dataclass
class Progress:
    """A request's cumulative output, built from the engine's per-step deltas."""

    rid: str
    prompt_tokens: int
    arrival: float = field(default_factory=time.perf_counter)
    text: str = ""
    output_ids: list[int] = field(default_factory=list)
    first_token: float | None = None
    last: RequestOutput | None = None
    keep_stop: bool = False  # no_stop_trim: the engine's text keeps a matched stop string
    # the output tokens' log-probabilities from the engine (the request asked for them)
    logprobs: TokenLogprobs | None = None

    @property
    def finished(self) -> bool:
        return self.last is not None and self.last.finished

    @property
    def e2e_latency(self) -> float:
        return time.perf_counter() - self.arrival

    def add(self, out: RequestOutput) -> None:
        self.text += out.new_text
        self.output_ids.extend(out.new_token_ids)
        if out.new_token_ids and self.first_token is None:
            self.first_token = time.perf_counter()
        self.last = out
        if out.new_logprobs is not None:
            if self.logprobs is None:
                self.logprobs = TokenLogprobs(out.new_logprobs.k,
                                              token_ids=out.new_logprobs.token_ids)
            self.logprobs.extend(out.new_logprobs)
        if (out.finished and out.finish_reason == "stop" and isinstance(out.matched_stop, str)
                and not self.keep_stop):
            self.text = _trim_stop(self.text, out.matched_stop)


def _trim_stop(text: str, stop: str) -> str:
    """The engine trims a matched stop string from its text, but a part of it that an earlier
    step already emitted stays in the deltas; cut it here (cumulative text is then exact)."""
    i = text.find(stop)
    if i >= 0:
        return text[:i]
    for n in range(min(len(stop) - 1, len(text)), 0, -1):
        if text.endswith(stop[:n]):
            return text[:-n]
    return text


def longest_token_chars(tokenizer) -> int:
    """An upper bound on the characters of text one token stands for: the longest token
    string of the vocabulary (byte-level BPE writes a byte as one character, sentencepiece
    a space as one '▁', a byte fallback as six), at least 16."""
    return max([16, *(len(t) for t in tokenizer.get_vocab())])


class ServingState:
    """One per server. Owns the AsyncEngine (its engine thread) and the metrics registry."""

    def __init__(self, engine: Engine, served_model_name: str | None = None,
                 options: HTTPOptions | None = None):
        self.engine = engine
        self.options = options or HTTPOptions()  # the per-request limits among them
        self.cfg = engine.cfg
        self.aengine = AsyncEngine(engine)
        # a tokenizer of our own: the engine thread detokenizes with the engine's
        self.tokenizer_path = engine.parts.tokenizer_path or engine.parts.target_path
        self.tokenizer = load_tokenizer(self.tokenizer_path, engine.cfg.chat_template)
        self.model_path = engine.parts.target_path
        # as SGLang: the model path unless --served-model-name is given (clients load the
        # tokenizer by this name)
        self.model_name = served_model_name or self.model_path
        self.vocab_size = engine.parts.target.cfg.vocab_size
        self.max_context = engine.max_context
        self.max_prompt_tokens = max(1, min(self.max_context, engine.kv_capacity) - 1)
        self.max_token_chars = longest_token_chars(self.tokenizer)
        self.max_prompt_chars = self.max_prompt_tokens * self.max_token_chars
        self.metrics = ServerMetrics()
        self.started = time.time()

    # ----- per-request limits (HTTPOptions: --max-n, --max-batch-prompts,
    # --max-top-logprobs-num): checked before any prompt is tokenized or anything queued
    def check_samples(self, prompts: int, n: int, prompt_field: str, n_field: str) -> None:
        """400 when a request asks for more samples per prompt, prompts, or samples in all
        than the server allows."""
        o = self.options
        if n > o.max_n:
            raise APIError.bad(n_field, f"{n} samples per prompt are over this server's limit "
                               f"of {o.max_n} (--max-n)")
        if prompts > o.max_batch_prompts:
            raise APIError.bad(prompt_field, f"a batch of {prompts} prompts is over this "
                               f"server's limit of {o.max_batch_prompts} (--max-batch-prompts)")
        if prompts * n > o.max_batch_prompts:
            raise APIError.bad(n_field, f"{prompts} prompts x n {n} = {prompts * n} samples are "
                               f"over this server's limit of {o.max_batch_prompts} per request "
                               "(--max-batch-prompts)")

    def check_top_logprobs(self, k: int, field_name: str) -> None:
        if k > self.options.max_top_logprobs_num:
            raise APIError.bad(field_name, f"{k} is over this server's limit of "
                               f"{self.options.max_top_logprobs_num} (--max-top-logprobs-num)")

    # ----- prompts
    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False)

    def check_text_size(self, text_len: int, field_name: str) -> None:
        """400 before tokenizing a text that cannot fit: more characters than the longest
        prompt that fits could hold (a 10 MB text took 10-23 s to tokenize)."""
        if text_len > self.max_prompt_chars:
            raise APIError.bad(field_name, f"has {text_len} characters; the at most "
                               f"{self.max_prompt_tokens} tokens a prompt may have cover at "
                               f"most {self.max_prompt_chars} (no token of this tokenizer "
                               f"spans more than {self.max_token_chars})")

    async def prompt_ids(self, prompt: str | list[int], field_name: str = "text") -> list[int]:
        """Token ids of a prompt; 400 when empty, out of vocabulary or too long. A text is
        measured first and tokenized on a worker thread (the event loop keeps serving)."""
        if isinstance(prompt, str):
            if prompt == "":
                raise APIError.bad(field_name, "is empty")
            self.check_text_size(len(prompt), field_name)
            ids = await asyncio.to_thread(self.encode, prompt)
        else:
            if len(prompt) > self.max_prompt_tokens:  # before looking at every id
                raise APIError.bad(field_name, f"has {len(prompt)} tokens; at most "
                                   f"{self.max_prompt_tokens} fit (context window "
                                   f"{self.max_context}, KV cache {self.cfg.kv_cache_tokens})")
            ids = list(prompt)
        try:
            validate_prompt(ids, self.vocab_size, self.max_context)
        except InvalidRequest as e:
            name = field_name if e.field == "prompt" else e.field
            raise APIError.bad(name, str(e).split(": ", 1)[1]) from None
        self.check_fits(len(ids), 1, field_name, "max_new_tokens")
        return ids

    def check_context(self, prompt_len: int, max_new: int, max_field: str) -> None:
        """400 when the prompt and the requested new tokens exceed the context length (as
        SGLang; it is not silently clamped)."""
        if prompt_len + max_new > self.max_context:
            raise APIError.bad(max_field, f"the prompt's {prompt_len} tokens plus {max_field} "
                               f"{max_new} = {prompt_len + max_new} tokens exceed the context "
                               f"length of {self.max_context} tokens; reduce the prompt or "
                               f"{max_field}")

    def check_fits(self, prompt_len: int, max_new: int, prompt_field: str, max_field: str
                   ) -> None:
        """400 unless the request fits the KV pool alone (the engine's own check, on
        immutable sizes, so it may run here): one that cannot would never finish."""
        try:
            self.engine.check_fits(prompt_len, max_new)
        except InvalidRequest as e:
            name = prompt_field if e.field == "prompt" else max_field
            raise APIError.bad(name, str(e).split(": ", 1)[1]) from None

    def default_max_tokens(self, prompt_len: int) -> int:
        """New tokens of a request that gives no limit: as many as the context window and
        the KV pool hold."""
        return max(1, self.engine.max_new_tokens_that_fit(prompt_len))

    # ----- engine access
    async def call(self, fn: Callable[[Engine], T]) -> T:
        """fn(engine) on the engine thread, between steps."""
        return await asyncio.wrap_future(self.aengine.call(fn))

    async def snapshot(self) -> EngineSnapshot:
        return await self.call(take_snapshot)

    async def score(self, ids: list[int], start: int, top_k: int) -> Scores:
        """Target-model logprobs of ids[start:] (see logprobs.py); waits for free KV blocks."""
        deadline = time.monotonic() + SCORE_WAIT_S
        while True:
            try:
                return await self.call(lambda e: score_tokens(e, ids, start, top_k))
            except PoolBusy as e:
                if time.monotonic() > deadline:
                    raise APIError(503, f"KV cache busy, cannot score the prompt now: {e}") from e
                await asyncio.sleep(0.05)

    async def check_grammar(self, params: SamplingParams, prefix: str = "",
                            field_name: str | None = None) -> None:
        """Compile the request's grammar (regex, json_schema, ebnf) off the engine thread, so
        that a bad one is a 400 naming the field (prefix + its name, or field_name) before
        anything is queued, and the engine thread finds it compiled (the compiler caches)."""
        if params.regex is None and params.json_schema is None and params.ebnf is None:
            return
        try:
            await asyncio.to_thread(self.engine.constraints.grammar, params)
        except InvalidRequest as e:
            err = from_invalid(e, prefix)
            if field_name is not None:
                err = APIError.bad(field_name, err.message.split(": ", 1)[-1])
            raise err from None

    async def run(self, ids: list[int], params: SamplingParams, rid: str | None,
                  stream_interval: int = 1) -> AsyncGenerator[Progress, None]:
        """Submit one request; yields its Progress after every engine step that touched it
        (stream_interval > 1: on the first token, then once at least that many more tokens
        came, and at the end; Progress is cumulative, so a skipped one loses nothing).
        Raises APIError (400) before the first yield when the engine rejects the request.
        Leaving early (client gone, cancellation) aborts it and frees its KV blocks."""
        prog = Progress(rid=rid or "", prompt_tokens=len(ids), keep_stop=params.no_stop_trim)
        gen = self.aengine.generate(ids, params, rid)
        shown = 0  # output tokens in the last Progress yielded
        try:
            async for out in gen:
                prog.rid = out.rid
                prog.add(out)
                if out.finished:
                    self._observe(prog, params)
                elif shown and len(prog.output_ids) - shown < stream_interval:
                    continue
                shown = len(prog.output_ids)
                yield prog
        except InvalidRequest as e:
            raise from_invalid(e) from None
        except QueueFull as e:
            self.metrics.rejected_queue_full.inc()
            raise APIError(503, str(e), None, {"Retry-After": str(RETRY_AFTER_S)}) from None
        finally:
            await gen.aclose()  # aborts the request if it has not finished

    def _observe(self, prog: Progress, params: SamplingParams) -> None:
        last = prog.last
        if last is None or last.finish_reason == "abort":
            return
        ttft = None if prog.first_token is None else prog.first_token - prog.arrival
        if ttft is not None:
            self.metrics.ttft.observe(ttft)
        self.metrics.observe_finished(
            ttft=ttft, e2e=prog.e2e_latency, completion_tokens=last.completion_tokens,
            ttft_slo=effective_slo(params.ttft_slo, self.cfg.ttft_slo),
            tpot_slo=effective_slo(params.tpot_slo, self.cfg.tpot_slo),
        )

    async def abort(self, rid: str) -> bool:
        """Abort a live request by id; False if none is live."""
        live = await self.call(lambda e: rid in e.requests)
        if live:
            self.aengine.abort(rid)
        return live

    async def abort_all(self) -> int:
        rids = await self.call(lambda e: list(e.requests))
        for rid in rids:
            self.aengine.abort(rid)
        return len(rids)

    def shutdown(self) -> None:
        self.aengine.shutdown()


async def last_of(agen: AsyncIterator[T]) -> T:
    """Drain an async iterator; its last item."""
    last = None
    async for x in agen:
        last = x
    if last is None:
        raise RuntimeError("stream ended without output")
    return last


async def merge(gens: list[AsyncGenerator[T, None]]) -> AsyncGenerator[tuple[int, T], None]:
    """Interleave several async iterators as (index, item), in arrival order. An exception in
    one is raised here; leaving early cancels (and so closes) all of them."""
    q: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(i: int, g: AsyncIterator[T]) -> None:
        try:
            async for x in g:
                await q.put((i, x))
        except Exception as e:  # forwarded to the consumer
            await q.put((i, e))
            return
        await q.put((i, done))

    tasks = [asyncio.create_task(pump(i, g)) for i, g in enumerate(gens)]
    remaining = len(tasks)
    try:
        while remaining:
            i, x = await q.get()
            if x is done:
                remaining -= 1
            elif isinstance(x, BaseException):
                raise x
            else:
                yield i, x
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def until_disconnect(request: Request, work: Awaitable[T]) -> T:
    """Await `work` unless the client disconnects first; then cancel it (which aborts its
    engine requests) and raise APIError(499). Used for non-streaming responses;
    streaming responses are cancelled by Starlette when the client goes away."""
    task = asyncio.ensure_future(work)
    watch = asyncio.create_task(_wait_disconnect(request))
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:  # the handler itself is cancelled (shutdown)
        task.cancel()
        raise
    finally:
        watch.cancel()
    if not task.done():
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        raise APIError(499, "client disconnected")  # nobody reads it
    return task.result()


async def _wait_disconnect(request: Request) -> None:
    while True:
        message: MutableMapping[str, Any] = await request.receive()
        if message["type"] == "http.disconnect":
            return
