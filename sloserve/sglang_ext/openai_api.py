"""OpenAI-compatible API: /v1/models, /v1/completions, /v1/chat/completions (streaming with
server-sent events ending `data: [DONE]`, `stream_options.include_usage`)."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import aclosing

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse

from sloserve.runtime.async_engine import EngineDeadError, EngineFailure
from sloserve.runtime.request import SamplingParams
from sloserve.sglang_ext.errors import APIError, parse_body
from sloserve.sglang_ext.openai_protocol import ChatCompletionRequest, CompletionRequest
from sloserve.sglang_ext.serving import Progress, ServingState, merge, until_disconnect

router = APIRouter(prefix="/v1")
Job = tuple[list[int], SamplingParams]


def serving(request: Request) -> ServingState:
    return request.app.state.serving


@router.get("/models")
async def models(request: Request):
    st = serving(request)
    card = {"id": st.model_name, "object": "model", "created": int(st.started),
            "owned_by": "sloserve", "root": st.model_path, "max_model_len": st.max_context}
    return {"object": "list", "data": [card]}


async def _jobs(st: ServingState, body, prompts: list, max_new: int | None, field: str,
                max_field: str = "max_tokens") -> list[Job]:
    if max_new is not None and max_new < 1:
        raise APIError.bad("max_tokens", f"must be >= 1, got {max_new}")
    names = [field if len(prompts) == 1 else f"{field}[{i}]" for i in range(len(prompts))]
    for p, name in zip(prompts, names):  # every text measured before any is tokenized
        if isinstance(p, str):
            st.check_text_size(len(p), name)
    jobs = []
    for p, name in zip(prompts, names):
        ids = await st.prompt_ids(p, name)
        n = max_new if max_new is not None else st.default_max_tokens(len(ids))
        st.check_fits(len(ids), n, name, max_field)
        jobs.append((ids, body.engine_params(n)))
    return jobs


@router.post("/completions")
async def completions(request: Request):
    st = serving(request)
    body = await parse_body(request, CompletionRequest)
    body.check()
    jobs = await _jobs(st, body, body.prompts(), body.max_tokens, "prompt")
    return await _respond(request, st, body, jobs, chat=False)


@router.post("/chat/completions")
async def chat_completions(request: Request):
    st = serving(request)
    body = await parse_body(request, ChatCompletionRequest)
    body.check()
    if not getattr(st.tokenizer, "chat_template", None):
        raise APIError.bad("messages", "this model's tokenizer has no chat template; use "
                           "/v1/completions")
    msgs = [{"role": m.role, "content": m.text()} for m in body.messages]
    st.check_text_size(sum(len(m["content"]) for m in msgs), "messages")
    try:
        text = await asyncio.to_thread(st.tokenizer.apply_chat_template, msgs, tokenize=False,
                                       add_generation_prompt=True)
    except Exception as e:  # jinja raises for conversations a template forbids
        raise APIError.bad("messages", f"the chat template rejected them: {e}") from None
    max_field = "max_tokens" if body.max_completion_tokens is None else "max_completion_tokens"
    jobs = await _jobs(st, body, [text], body.max_new, "messages", max_field)
    return await _respond(request, st, body, jobs, chat=True)


def _finish(prog: Progress) -> str | None:
    return prog.last.finish_reason if prog.last is not None and prog.finished else None


def _usage(progs: list[Progress | None]) -> dict:
    p = sum(x.prompt_tokens for x in progs if x)
    c = sum(x.last.completion_tokens for x in progs if x and x.last)
    return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}


async def _respond(request: Request, st: ServingState, body, jobs: list[Job], chat: bool):
    rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
    head = {"id": rid, "object": "chat.completion" if chat else "text_completion",
            "created": int(time.time()), "model": st.model_name}
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        events = _stream(st, jobs, head, chat, include_usage)
        return StreamingResponse(events, media_type="text/event-stream")
    progs: list[Progress | None] = [None] * len(jobs)

    async def collect():
        async with aclosing(merge([st.run(ids, sp, None) for ids, sp in jobs])) as merged:
            async for i, prog in merged:
                progs[i] = prog
        return progs

    await until_disconnect(request, collect())
    choices = []
    for i, prog in enumerate(progs):
        c = {"index": i, "logprobs": None, "finish_reason": _finish(prog)}
        if chat:
            c["message"] = {"role": "assistant", "content": prog.text}
        else:
            c["text"] = prog.text
        choices.append(c)
    return JSONResponse({**head, "choices": choices, "usage": _usage(progs)})


def _sse(obj) -> bytes:
    return b"data: " + json.dumps(obj, ensure_ascii=False).encode() + b"\n\n"


async def _stream(st: ServingState, jobs: list[Job], head: dict, chat: bool, include_usage: bool
                  ) -> AsyncIterator[bytes]:
    head = {**head, "object": "chat.completion.chunk" if chat else "text_completion"}
    progs: list[Progress | None] = [None] * len(jobs)
    sent = [0] * len(jobs)  # characters of each choice's text already sent

    def chunk(i: int, delta: str, finish: str | None, first: bool = False) -> bytes:
        if chat:
            d = {"role": "assistant", "content": delta} if first else (
                {"content": delta} if delta or finish is None else {})
            c = {"index": i, "delta": d, "logprobs": None, "finish_reason": finish}
        else:
            c = {"index": i, "text": delta, "logprobs": None, "finish_reason": finish}
        return _sse({**head, "choices": [c]})

    try:
        if chat:
            for i in range(len(jobs)):
                yield chunk(i, "", None, first=True)
        async with aclosing(merge([st.run(ids, sp, None) for ids, sp in jobs])) as merged:
            async for i, prog in merged:
                progs[i] = prog
                # the cumulative text may shrink by a stop-string prefix at the very end;
                # what was sent stays sent
                delta = prog.text[sent[i]:]
                sent[i] = max(sent[i], len(prog.text))
                if delta or prog.finished:
                    yield chunk(i, delta, _finish(prog))
        if include_usage:
            yield _sse({**head, "choices": [], "usage": _usage(progs)})
    except (APIError, EngineFailure) as e:
        code = e.status if isinstance(e, APIError) else 503 if isinstance(e, EngineDeadError) else 500
        yield _sse({"error": {"message": str(e), "type": type(e).__name__, "code": code}})
    yield b"data: [DONE]\n\n"
