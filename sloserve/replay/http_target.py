"""HTTP target for SGLang's native `/generate` streaming protocol, measured on the client.

Request:  POST {base_url}/generate
          {"text" | "input_ids": ..., "sampling_params": {"max_new_tokens", "temperature",
           "ignore_eos", ...}, "stream": true, "rid": request_id}
Response: server-sent events, one `data: {json}` line per chunk, where `text` is the
          cumulative output and `meta_info.completion_tokens` the cumulative token count
          (`meta_info.prompt_tokens` the prompt length), ending with `data: [DONE]`.
          A `{"error": ...}` chunk or a non-200 status fails the request.

A chunk is recorded (time, cumulative count) when completion_tokens grows. Arrivals are
honoured by sleeping until run start + arrival_s, then sending (open loop); the connection
pool is unbounded so a slow server cannot delay later sends (max_concurrency can cap it).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import httpx

from sloserve.replay.records import Progress, ReplayRequest, RequestRecord, SpecStats

DEFAULT_TIMEOUT_S = 6 * 3600.0  # per request, like vllm bench serve's aiohttp timeout


@dataclass
class SSEStream:
    """Accumulates one response; times are seconds since the run start."""

    chunk_s: list[float] = field(default_factory=list)
    chunk_tokens: list[int] = field(default_factory=list)
    prompt_tokens: int = 0
    done: bool = False
    last: dict[str, Any] = field(default_factory=dict)  # the latest chunk: whole output, meta_info


class SGLangHTTPTarget:
    """Replays requests against an SGLang-compatible `/generate` endpoint."""

    def __init__(
        self,
        base_url: str,
        *,
        temperature: float = 0.0,
        sampling_params: Mapping[str, Any] | None = None,
        timeout_s: float | None = None,
        max_concurrency: int | None = None,
        path: str = "/generate",
        send_slos: bool = False,
    ):
        self.base_url = base_url.rstrip("/")
        self.temperature = temperature
        self.sampling_params = dict(sampling_params or {})
        self.timeout_s = timeout_s if timeout_s is not None else DEFAULT_TIMEOUT_S
        self.max_concurrency = max_concurrency
        self.path = path
        # each request's own SLOs in SGLang's spelling, sampling_params.custom_params
        # {"tpot_slo", "ttft_slo"} in seconds (sloserve/slo.py; plain SGLang ignores them)
        self.send_slos = send_slos

    def spec_stats(self) -> SpecStats | None:
        return None  # the native API does not expose per-run speculation counters

    async def run(
        self, requests: list[ReplayRequest], progress: Progress | None = None
    ) -> list[RequestRecord]:
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
        sem = asyncio.Semaphore(self.max_concurrency) if self.max_concurrency else None
        async with httpx.AsyncClient(
            base_url=self.base_url, timeout=httpx.Timeout(self.timeout_s), limits=limits
        ) as client:
            t0 = time.perf_counter()
            tasks = [
                asyncio.create_task(self._replay_one(client, r, t0, sem, progress))
                for r in requests
            ]
            return list(await asyncio.gather(*tasks))

    def payload(self, req: ReplayRequest) -> dict[str, Any]:
        """The JSON body of one `/generate` call."""
        params = {
            "max_new_tokens": req.max_new_tokens,
            "temperature": self.temperature,
            "ignore_eos": req.ignore_eos,
            **self.sampling_params,
        }
        if self.send_slos:
            slos = {k: v for k, v in (("tpot_slo", req.tpot_slo_s), ("ttft_slo", req.ttft_slo_s))
                    if v is not None}
            if slos:
                params["custom_params"] = {**params.get("custom_params", {}), **slos}
        body: dict[str, Any] = {"sampling_params": params, "stream": True, "rid": req.request_id}
        if req.input_ids is not None:
            body["input_ids"] = list(req.input_ids)
        else:
            body["text"] = req.text
        return body

    async def _replay_one(
        self,
        client: httpx.AsyncClient,
        req: ReplayRequest,
        t0: float,
        sem: asyncio.Semaphore | None,
        progress: Progress | None,
    ) -> RequestRecord:
        delay = t0 + req.arrival_s - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        if sem is not None:
            async with sem:
                record = await self._send(client, req, t0)
        else:
            record = await self._send(client, req, t0)
        if progress is not None:
            progress(record)
        return record

    async def _send(self, client: httpx.AsyncClient, req: ReplayRequest, t0: float
                    ) -> RequestRecord:
        stream = SSEStream(prompt_tokens=req.prompt_tokens or 0)
        send_s = time.perf_counter() - t0
        error: str | None = None
        try:
            async with client.stream("POST", self.path, json=self.payload(req)) as resp:
                if resp.status_code != 200:
                    body = (await resp.aread()).decode("utf-8", errors="replace")
                    error = f"HTTP {resp.status_code}: {body[:300]}"
                else:
                    async for line in resp.aiter_lines():
                        error = consume_sse_line(line, time.perf_counter() - t0, stream)
                        if error is not None or stream.done:
                            break
        except (httpx.HTTPError, OSError) as e:
            error = f"{type(e).__name__}: {e}"
        if error is None and not stream.chunk_s:
            error = "the stream ended without any token"
        return RequestRecord(
            request_id=req.request_id, scheduled_s=req.arrival_s, send_s=send_s,
            end_s=time.perf_counter() - t0, chunk_s=tuple(stream.chunk_s),
            chunk_tokens=tuple(stream.chunk_tokens), prompt_tokens=stream.prompt_tokens,
            output_tokens=stream.chunk_tokens[-1] if stream.chunk_tokens else 0,
            success=error is None, error=error, category=req.category,
            ttft_slo_s=req.ttft_slo_s, tpot_slo_s=req.tpot_slo_s,
        )


def consume_sse_line(line: str, now_s: float, stream: SSEStream) -> str | None:
    """Apply one SSE line to `stream`; returns an error message or None."""
    line = line.strip()
    if not line.startswith("data:"):
        return None  # blank separators, comments (":...") and other SSE fields
    data = line[len("data:"):].strip()
    if data == "[DONE]":
        stream.done = True
        return None
    try:
        obj = json.loads(data)
    except json.JSONDecodeError:
        return f"invalid JSON in stream: {data[:200]!r}"
    if not isinstance(obj, dict):
        return f"unexpected stream chunk: {data[:200]!r}"
    if "error" in obj:
        return f"server error: {obj['error']}"
    meta = obj.get("meta_info") or {}
    count = meta.get("completion_tokens")
    if not isinstance(count, int):
        return f"chunk without meta_info.completion_tokens: {data[:200]!r}"
    stream.last = obj
    if isinstance(meta.get("prompt_tokens"), int):
        stream.prompt_tokens = meta["prompt_tokens"]
    if count > (stream.chunk_tokens[-1] if stream.chunk_tokens else 0):
        stream.chunk_s.append(now_s)
        stream.chunk_tokens.append(count)
    return None
