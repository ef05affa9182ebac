"""SGLang's POST /generate: one prompt or a batch, streamed (server-sent events, cumulative
`text` per chunk, ending `data: [DONE]`) or not, with SGLang's `meta_info`."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import AsyncGenerator
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from sloserve.runtime.async_engine import EngineFailure
from sloserve.runtime.request import SamplingParams, expand_samples
from sloserve.server.errors import APIError, parse_body
from sloserve.server.logprobs import triples
from sloserve.server.protocol import (
    GenerateRequest,
    Item,
    finish_reason_json,
    normalize,
    stream_interval,
    to_engine_params,
)
from sloserve.server.serving import (
    Progress,
    ServingState,
    last_of,
    merge,
    until_disconnect,
)


@dataclass
class Job:
    """One validated prompt of a /generate request."""

    item: Item
    ids: list[int]
    params: SamplingParams | None  # None: max_new_tokens == 0 (prefill only, no engine request)


async def prepare(state: ServingState, item: Item, batched: bool) -> Job:
    where = f"[{item.index}]" if batched else ""
    field = ("text" if isinstance(item.prompt, str) else "input_ids") + where
    ids = await state.prompt_ids(item.prompt, field)
    sp = item.sp
    max_new = sp.max_new_tokens if sp.max_new_tokens is not None else state.default_max_tokens(
        len(ids))
    if max_new < 0:
        raise APIError.bad("sampling_params.max_new_tokens", f"must be >= 0, got {max_new}")
    if sp.max_new_tokens is not None and max_new > 0:
        state.check_context(len(ids), max_new, "sampling_params.max_new_tokens")
    state.check_fits(len(ids), max(max_new, 1), field, "sampling_params.max_new_tokens")
    if item.token_ids_logprob and not item.return_logprob:
        raise APIError.bad("token_ids_logprob", "needs return_logprob: true")
    stream_interval(sp.stream_interval, "sampling_params.stream_interval")
    params = to_engine_params(sp, max_new_tokens=max(max_new, 1),
                              logprobs=item.top_logprobs_num if item.return_logprob else None,
                              logprob_token_ids=item.token_ids_logprob)
    if item.return_logprob and item.logprob_start_len > len(ids):
        raise APIError.bad("logprob_start_len", f"{item.logprob_start_len} is beyond the "
                           f"prompt's {len(ids)} tokens")
    return Job(item, ids, params if max_new > 0 else None)


def expand(jobs: list[Job], batched: bool) -> tuple[list[Job], bool]:
    """The independent samples of jobs with sampling_params.n > 1, prompt-major as SGLang
    orders them (prompt 0's n samples, then prompt 1's); with any such job the answer is a
    list, as SGLang's. A sample's rid is the prompt's rid + "_" + its number."""
    if all(j.item.sp.n == 1 for j in jobs):
        return jobs, batched
    out: list[Job] = []
    for job in jobs:
        n = job.item.sp.n
        samples = expand_samples(job.params) if job.params is not None else [None] * n
        for i, params in enumerate(samples):
            rid = f"{job.item.rid}_{i}" if n > 1 else job.item.rid
            out.append(Job(dataclasses.replace(job.item, index=len(out), rid=rid), job.ids,
                           params))
    return out, True


def meta_info(job: Job, prog: Progress | None, final: bool) -> dict:
    """SGLang's meta_info, plus the speculation counters of the request."""
    last = prog.last if prog is not None else None
    completion = last.completion_tokens if last else 0
    meta: dict[str, Any] = {
        "id": prog.rid if prog is not None else job.item.rid,
        "finish_reason": None,
        "prompt_tokens": len(job.ids),
        "completion_tokens": completion,
        "cached_tokens": 0,
    }
    if last is not None:
        verify_ct, accepted, proposed = last.spec_verify_ct, last.spec_accepted, last.spec_proposed
        meta["finish_reason"] = finish_reason_json(last.finish_reason, last.matched_stop,
                                                   completion)
    else:
        verify_ct = accepted = proposed = 0
        if final:
            meta["finish_reason"] = finish_reason_json("length", None, 0)
    meta.update(
        spec_verify_ct=verify_ct,
        spec_accept_rate=accepted / proposed if proposed else 0.0,
        spec_accept_length=1.0 + accepted / verify_ct if verify_ct else 1.0,
        spec_accept_token_num=accepted,
        spec_draft_token_num=proposed,
    )
    if final:
        meta["e2e_latency"] = prog.e2e_latency if prog is not None else 0.0
    return meta


def _text(prog: Progress | None) -> str:
    return "" if prog is None else prog.text


async def _add_logprobs(state: ServingState, job: Job, prog: Progress | None, meta: dict) -> None:
    """Prompt tokens' values scored by the target model (logprobs.py); output tokens' values
    recorded by the engine from the distributions they were sampled from (runtime/logprobs.py:
    penalties and grammar mask applied, temperature-scaled), as SGLang reports them."""
    it = job.item
    if prog is not None and prog.last is not None and prog.last.finish_reason == "abort":
        return
    start = len(job.ids) if it.logprob_start_len == -1 else it.logprob_start_len
    in_lp: list[float | None] = []
    in_ids: list[int] = []
    in_top: list[list[tuple[float, int]]] = []
    if start < len(job.ids):
        sc = await state.score(job.ids, start, it.top_logprobs_num)
        in_lp, in_ids, in_top = sc.logprobs, sc.token_ids, sc.top
    out_ids = prog.output_ids if prog is not None else []
    lp = prog.logprobs if prog is not None else None
    out_lp: list[float | None] = list(lp.logprobs) if lp is not None else []
    out_top = [[(v, t) for t, v in row] for row in lp.top] if lp is not None else []
    tok, with_text = state.tokenizer, it.return_text
    meta["input_token_logprobs"] = triples(in_lp, in_ids, tok, with_text)
    meta["output_token_logprobs"] = triples(out_lp, out_ids, tok, with_text)
    if it.top_logprobs_num > 0:
        def tops(rows):
            return [triples([v for v, _ in r], [i for _, i in r], tok, with_text) if r else None
                    for r in rows]
        meta["input_top_logprobs"] = tops(in_top)
        meta["output_top_logprobs"] = tops(out_top)
    if it.token_ids_logprob:  # the asked tokens' values at every output position (SGLang's
        # output_token_ids_logprobs; prompt positions are not scored for them: null)
        ids = list(it.token_ids_logprob)
        rows = lp.id_logprobs if lp is not None else []
        meta["input_token_ids_logprobs"] = None
        meta["output_token_ids_logprobs"] = [triples(r, ids, tok, with_text) for r in rows]


async def run_job(state: ServingState, job: Job) -> dict:
    """A non-streamed answer: {"text", "output_ids", "meta_info"}."""
    prog = None
    if job.params is not None:
        async with aclosing(state.run(job.ids, job.params, job.item.rid,
                                  stream_interval(job.item.sp.stream_interval, ''))) as stream:
            prog = await last_of(stream)
    meta = meta_info(job, prog, final=True)
    if job.item.return_logprob:
        await _add_logprobs(state, job, prog, meta)
    return {"text": _text(prog), "output_ids": prog.output_ids if prog else [],
            "meta_info": meta}


async def stream_job(state: ServingState, job: Job,
                     batched: bool) -> AsyncGenerator[dict, None]:
    """Chunks of one streamed prompt: cumulative text and output_ids, meta_info so far."""
    index = {"index": job.item.index} if batched else {}
    if job.params is None:
        yield {**await run_job(state, job), **index}
        return
    async with aclosing(state.run(job.ids, job.params, job.item.rid,
                                  stream_interval(job.item.sp.stream_interval, ''))) as stream:
        async for prog in stream:
            if not prog.last.new_token_ids and not prog.finished:  # type: ignore[union-attr]
                continue
            meta = meta_info(job, prog, final=prog.finished)
            if prog.finished and job.item.return_logprob:
                await _add_logprobs(state, job, prog, meta)
            yield {"text": _text(prog), "output_ids": list(prog.output_ids),
                   "meta_info": meta, **index}


def sse(obj) -> bytes:
    return b"data: " + json.dumps(obj, ensure_ascii=False).encode() + b"\n\n"


async def _events(first: dict | None,
                  chunks: AsyncGenerator[dict, None]) -> AsyncGenerator[bytes, None]:
    async with aclosing(chunks):
        try:
            if first is not None:
                yield sse(first)
            async for chunk in chunks:
                yield sse(chunk)
        except (APIError, EngineFailure) as e:
            yield sse({"error": {"message": str(e)}})
    yield b"data: [DONE]\n\n"


async def _items_stream(state: ServingState, jobs: list[Job]) -> AsyncGenerator[dict, None]:
    async with aclosing(merge([stream_job(state, j, True) for j in jobs])) as merged:
        async for _, chunk in merged:
            yield chunk


async def generate(request: Request, state: ServingState):
    req = await parse_body(request, GenerateRequest)
    items, batched = normalize(req)
    prompt_field = "text" if req.text is not None else "input_ids"
    for it in items:
        where = f"sampling_params[{it.index}].n" if isinstance(req.sampling_params, list) else \
            "sampling_params.n"
        state.check_samples(len(items), it.sp.n, prompt_field, where)
        state.check_top_logprobs(it.top_logprobs_num, "top_logprobs_num")
    for it in items:  # every text measured before any is tokenized
        if isinstance(it.prompt, str):
            state.check_text_size(len(it.prompt), f"text[{it.index}]" if batched else "text")
    jobs = [await prepare(state, it, batched) for it in items]
    for job in jobs:
        if job.params is not None:
            await state.check_grammar(job.params, "sampling_params.")
    jobs, batched = expand(jobs, batched)
    if req.stream:
        if batched:
            return StreamingResponse(_events(None, _items_stream(state, jobs)),
                                     media_type="text/event-stream")
        chunks = stream_job(state, jobs[0], False)
        # the first chunk is awaited here so that a request the engine rejects is a 4xx
        try:
            first = await until_disconnect(request, chunks.__anext__())
        except StopAsyncIteration:
            first = None
        except BaseException:
            await chunks.aclose()
            raise
        return StreamingResponse(_events(first, chunks), media_type="text/event-stream")
    if batched:
        return JSONResponse(await until_disconnect(request, _run_batch(state, jobs)))
    return JSONResponse(await until_disconnect(request, run_job(state, jobs[0])))


async def _run_batch(state: ServingState, jobs: list[Job]) -> list[dict]:
    """All jobs concurrently; the first error cancels (and so aborts) the others."""

    async def one(job: Job) -> AsyncGenerator[dict, None]:
        yield await run_job(state, job)

    results: list = [None] * len(jobs)
    async with aclosing(merge([one(j) for j in jobs])) as merged:
        async for i, res in merged:
            results[i] = res
    return results
