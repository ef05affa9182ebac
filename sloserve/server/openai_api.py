"""OpenAI-compatible API: /v1/models, /v1/completions, /v1/chat/completions (streaming with
server-sent events ending `data: [DONE]`, `stream_options.include_usage`); `n` choices per
prompt, `logprobs` (streamed with the tokens they belong to), completions' `echo`; chat's
tool calls (tool_plan.py: what is offered and how the answer is read; chat_prompt.py: the
prompt; tool_calls.py: reading calls, whole and streamed)."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncGenerator
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse

from sloserve.runtime.async_engine import EngineDeadError, EngineFailure
from sloserve.runtime.request import SamplingParams, expand_samples
from sloserve.server.chat_prompt import render
from sloserve.server.errors import APIError, parse_body
from sloserve.server.openai_logprobs import Entries, chat_logprobs, completion_logprobs
from sloserve.server.openai_protocol import ChatCompletionRequest, CompletionRequest
from sloserve.server.protocol import stream_interval
from sloserve.server.serving import Progress, ServingState, merge, until_disconnect
from sloserve.server.tool_calls import (
    Call,
    StreamedCalls,
    call_id,
    parse_call_array,
    parse_calls,
)
from sloserve.server.tool_plan import ToolPlan

router = APIRouter(prefix="/v1")


def serving(request: Request) -> ServingState:
    return request.app.state.serving


def _card(st: ServingState) -> dict:
    return {"id": st.model_name, "object": "model", "created": int(st.started),
            "owned_by": "sloserve", "root": st.model_path, "max_model_len": st.max_context}


@router.get("/models")
async def models(request: Request):
    return {"object": "list", "data": [_card(serving(request))]}


@router.get("/models/{model:path}")
async def model_card(request: Request, model: str):
    """One model's card; 404 in OpenAI's shape for an id not served here (as SGLang)."""
    st = serving(request)
    if model != st.model_name:
        return JSONResponse({"error": {"message": f"The model '{model}' does not exist",
                                       "type": "invalid_request_error", "param": "model",
                                       "code": "model_not_found"}}, status_code=404)
    return _card(st)


@dataclass
class Job:
    """One choice: a prompt's sample (n > 1: its n samples are choices i * n ... i * n + n - 1)."""

    index: int
    ids: list[int]
    params: SamplingParams
    sample: int  # which of its prompt's n samples
    echo: str = ""  # the prompt's text, put before the choice's text (completions' echo)


async def _jobs(st: ServingState, body, prompts: list, max_new: int | None, field: str,
                max_field: str = "max_tokens", echo: bool = False) -> list[Job]:
    if max_new is not None and max_new < 1:
        raise APIError.bad("max_tokens", f"must be >= 1, got {max_new}")
    st.check_samples(len(prompts), body.n, field, "n")
    if body.logprobs_k is not None:
        st.check_top_logprobs(body.logprobs_k, "logprobs" if field == "prompt" else
                              "top_logprobs")
    names = [field if len(prompts) == 1 else f"{field}[{i}]" for i in range(len(prompts))]
    for p, name in zip(prompts, names):  # every text measured before any is tokenized
        if isinstance(p, str):
            st.check_text_size(len(p), name)
    jobs: list[Job] = []
    for p, name in zip(prompts, names):
        ids = await st.prompt_ids(p, name)
        if max_new is not None:
            st.check_context(len(ids), max_new, max_field)
        n = max_new if max_new is not None else st.default_max_tokens(len(ids))
        st.check_fits(len(ids), n, name, max_field)
        text = (p if isinstance(p, str) else st.tokenizer.decode(ids)) if echo else ""
        for j, sp in enumerate(expand_samples(body.engine_params(n, body.logprobs_k))):
            jobs.append(Job(len(jobs), ids, sp, j, text))
    return jobs


async def _check_grammar(st: ServingState, body, jobs: list[Job]) -> None:
    spec = body.grammar()
    if spec is not None:  # one constraint for all prompts: compile it once
        await st.check_grammar(jobs[0].params, field_name=spec.source)


@router.post("/completions")
async def completions(request: Request):
    st = serving(request)
    body = await parse_body(request, CompletionRequest)
    body.check()
    jobs = await _jobs(st, body, body.prompts(), body.max_tokens, "prompt", echo=body.echo)
    await _check_grammar(st, body, jobs)
    return await _respond(request, st, body, jobs, chat=False)


@router.post("/chat/completions")
async def chat_completions(request: Request):
    st = serving(request)
    body = await parse_body(request, ChatCompletionRequest)
    body.check()
    plan = body.plan_tools(st.options.tool_call_parser)
    if not getattr(st.tokenizer, "chat_template", None):
        raise APIError.bad("messages", "this model's tokenizer has no chat template; use "
                           "/v1/completions")
    msgs = [m.as_dict() for m in body.messages]
    st.check_text_size(sum(len(json.dumps(m, ensure_ascii=False)) for m in msgs)
                       + len(json.dumps(plan.offered, ensure_ascii=False)), "messages")
    try:
        text = await asyncio.to_thread(render, st.tokenizer, msgs, plan.offered, plan.fmt)
    except Exception as e:  # jinja raises for conversations a template forbids
        raise APIError.bad("messages", f"the chat template rejected them: {e}") from None
    max_field = "max_tokens" if body.max_completion_tokens is None else "max_completion_tokens"
    jobs = await _jobs(st, body, [text], body.max_new, "messages", max_field)
    await _check_grammar(st, body, jobs)
    return await _respond(request, st, body, jobs, chat=True, plan=plan)


def _finish(prog: Progress | None) -> str | None:
    return prog.last.finish_reason if prog and prog.last is not None and prog.finished else None


def _usage(jobs: list[Job], progs: list[Progress | None]) -> dict:
    p = sum(len(j.ids) for j in jobs if j.sample == 0)  # a prompt counts once, whatever n
    c = sum(x.last.completion_tokens for x in progs if x and x.last)
    return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}


async def _prompt_entries(st: ServingState, job: Job, k: int) -> Entries:
    """The echoed prompt's tokens with the target model's log-probabilities."""
    sc = await st.score(job.ids, 0, k)
    e = Entries()
    e.add(sc.token_ids, sc.logprobs, [[(t, v) for v, t in row] if row else None
                                      for row in sc.top])
    return e


def _output_entries(prog: Progress | None, lo: int = 0) -> Entries:
    """The output tokens from the lo-th on, with the engine's log-probabilities."""
    e = Entries()
    lp = prog.logprobs if prog is not None else None
    if prog is None or lp is None:
        return e
    tops = lp.top[lo:] if lp.k else [None] * (len(lp.logprobs) - lo)
    e.add(prog.output_ids[lo:], lp.logprobs[lo:], tops)
    return e


async def _respond(request: Request, st: ServingState, body, jobs: list[Job], chat: bool,
                   plan: ToolPlan | None = None):
    rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
    head = {"id": rid, "object": "chat.completion" if chat else "text_completion",
            "created": int(time.time()), "model": st.model_name}
    k = body.logprobs_k
    echoed = {}
    if k is not None and any(j.echo for j in jobs):
        echoed = {j.index: await _prompt_entries(st, j, k) for j in jobs if j.echo}
    if body.stream:
        opts = body.stream_options
        usage = ("every" if opts and opts.continuous_usage_stats
                 else "last" if opts and opts.include_usage else None)
        events = _stream(st, jobs, head, chat, usage, k, echoed,
                         stream_interval(body.stream_interval, "stream_interval"), plan)
        return StreamingResponse(events, media_type="text/event-stream")
    progs: list[Progress | None] = [None] * len(jobs)

    async def collect():
        runs = [st.run(j.ids, j.params, None) for j in jobs]
        async with aclosing(merge(runs)) as merged:
            async for i, prog in merged:
                progs[i] = prog
        return progs

    await until_disconnect(request, collect())
    choices = []
    for job, prog in zip(jobs, progs):
        text = prog.text if prog is not None else ""
        c: dict = {"index": job.index, "logprobs": None, "finish_reason": _finish(prog)}
        if chat:
            c["message"], tool_finish = _message(text, plan)
            if tool_finish and c["finish_reason"] == "stop":
                c["finish_reason"] = "tool_calls"
            if k is not None:
                c["logprobs"] = chat_logprobs(st.tokenizer, _output_entries(prog), k)
        else:
            c["text"] = job.echo + text
            if k is not None:
                e = echoed.get(job.index, Entries())
                out = _output_entries(prog)
                e.add(out.ids, out.logprobs, out.tops)
                c["logprobs"] = completion_logprobs(st.tokenizer, e, k)
        choices.append(c)
    return JSONResponse({**head, "choices": choices, "usage": _usage(jobs, progs)})


def _message(text: str, plan: ToolPlan | None) -> tuple[dict, bool]:
    """The assistant message of a whole answer, and whether it holds tool calls."""
    calls: list[Call] = []
    content: str | None = text
    if plan is not None and plan.reads == "array":
        calls = parse_call_array(text, plan.names)
        content = None if calls else text
    elif plan is not None and plan.reads == "text":
        content, calls = parse_calls(plan.fmt, text, plan.names)
    msg: dict = {"role": "assistant", "content": content}
    if calls:
        msg["tool_calls"] = [{"id": call_id(), "type": "function", "function": {
            "name": c.name, "arguments": c.arguments}} for c in calls]
    return msg, bool(calls)


def _sse(obj) -> bytes:
    return b"data: " + json.dumps(obj, ensure_ascii=False).encode() + b"\n\n"


async def _stream(st: ServingState, jobs: list[Job], head: dict, chat: bool,
                  usage: str | None, k: int | None, echoed: dict[int, Entries],
                  interval: int = 1, plan: ToolPlan | None = None
                  ) -> AsyncGenerator[bytes, None]:
    """usage: None; "last" (include_usage: a final chunk with the usage); "every"
    (continuous_usage_stats: the usage so far in every chunk too, as vLLM and SGLang)."""
    head = {**head, "object": "chat.completion.chunk" if chat else "text_completion"}
    progs: list[Progress | None] = [None] * len(jobs)
    sent = [0] * len(jobs)  # characters of each choice's text already sent
    sent_tokens = [0] * len(jobs)  # output tokens whose logprobs were sent
    offset = [0] * len(jobs)  # text_offset of the next token (completions' logprobs)

    def logprobs(i: int, e: Entries):
        if k is None:
            return None
        if chat:
            return chat_logprobs(st.tokenizer, e, k)
        lp = completion_logprobs(st.tokenizer, e, k, offset[i])
        offset[i] += sum(len(t) for t in lp["tokens"])
        return lp

    # a choice's tool calls, read as the answer streams (plan.reads "text" or "array")
    reading = plan is not None and plan.reads != "none"
    readers = {j.index: StreamedCalls(None if plan.reads == "array" else plan.fmt, plan.names)
               for j in jobs} if reading and plan is not None else {}

    def chunk(i: int, delta: str, finish: str | None, lp=None, first: bool = False) -> bytes:
        if chat:
            calls: list[dict] = []
            if i in readers and not first:
                delta, calls = readers[i].feed(delta, finish is not None)
                if finish == "stop" and readers[i].calls:
                    finish = "tool_calls"
            d: dict[str, Any] = {"role": "assistant", "content": delta} if first else (
                {"content": delta} if delta or (finish is None and not calls) else {})
            if calls:
                d["tool_calls"] = calls
            c = {"index": i, "delta": d, "logprobs": lp, "finish_reason": finish}
        else:
            c = {"index": i, "text": delta, "logprobs": lp, "finish_reason": finish}
        extra = {"usage": _usage(jobs, progs)} if usage == "every" else {}
        return _sse({**head, "choices": [c], **extra})

    try:
        for job in jobs:
            if chat:
                yield chunk(job.index, "", None, first=True)
            elif job.echo:
                yield chunk(job.index, job.echo, None,
                            logprobs(job.index, echoed.get(job.index, Entries())))
        runs = [st.run(j.ids, j.params, None, interval) for j in jobs]
        async with aclosing(merge(runs)) as merged:
            async for i, prog in merged:
                progs[i] = prog
                # the cumulative text may shrink by a stop-string prefix at the very end;
                # what was sent stays sent
                delta = prog.text[sent[i]:]
                sent[i] = max(sent[i], len(prog.text))
                new = _output_entries(prog, sent_tokens[i])
                if delta or prog.finished or (k is not None and new.ids):
                    sent_tokens[i] += len(new.ids)
                    yield chunk(i, delta, _finish(prog), logprobs(i, new))
        if usage is not None:
            yield _sse({**head, "choices": [], "usage": _usage(jobs, progs)})
    except (APIError, EngineFailure) as e:
        code = e.status if isinstance(e, APIError) else 503 if isinstance(e, EngineDeadError) else 500
        yield _sse({"error": {"message": str(e), "type": type(e).__name__, "code": code}})
    yield b"data: [DONE]\n\n"
