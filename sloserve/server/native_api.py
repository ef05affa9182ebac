"""SGLang's native HTTP API (what `sglang.RuntimeEndpoint` and SGLang's benchmark client
use), plus GET /metrics."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
from contextlib import aclosing
from pathlib import Path

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse, PlainTextResponse
from prometheus_client import CONTENT_TYPE_LATEST

import sloserve
from sloserve.runtime.request import SamplingParams
from sloserve.server.errors import APIError, parse_body
from sloserve.server.generate import generate
from sloserve.server.protocol import AbortRequest
from sloserve.server.serving import ServingState

router = APIRouter()
HEALTH_TIMEOUT_S = 20.0


def serving(request: Request) -> ServingState:
    return request.app.state.serving


@router.api_route("/generate", methods=["POST", "PUT"])
async def generate_route(request: Request):
    return await generate(request, serving(request))


def _hf_config(path: str) -> dict:
    try:
        return json.loads((Path(path) / "config.json").read_text())
    except (OSError, ValueError):
        return {}


@router.get("/get_model_info")
@router.get("/model_info")
async def model_info(request: Request):
    st = serving(request)
    hf = _hf_config(st.model_path)
    return {
        "model_path": st.model_path,
        "tokenizer_path": st.tokenizer_path,
        "served_model_name": st.model_name,
        "draft_model_path": st.engine.parts.draft_path,
        "is_generation": True,
        "preferred_sampling_params": None,
        "weight_version": "default",
        "has_image_understanding": False,
        "has_audio_understanding": False,
        "model_type": hf.get("model_type"),
        "architectures": hf.get("architectures"),
        "max_context_length": st.max_context,
        "spec_policy": st.cfg.spec_policy,
    }


@router.get("/get_server_info")
@router.get("/server_info")
async def server_info(request: Request):
    st = serving(request)
    snap = await st.snapshot()
    return {
        "version": getattr(sloserve, "__version__", "0.1.0"),
        "model_path": st.model_path,
        "draft_model_path": st.engine.parts.draft_path,
        "served_model_name": st.model_name,
        "engine_config": dataclasses.asdict(st.cfg),
        "uptime_s": time.time() - st.started,
        "num_requests_running": snap.running,
        "num_requests_waiting": snap.waiting,
        "kv_pool": {"free_blocks": snap.kv_free, "used_blocks": snap.kv_used,
                    "total_blocks": snap.kv_total, "block_size": snap.block_size},
        "engine_stats": snap.stats,
        # the field SGLang's benchmark client reads
        "internal_states": [{"avg_spec_accept_length": snap.stats.get("mean_accepted_length")}],
    }


@router.get("/health")
async def health(request: Request):
    st = serving(request)
    if not st.aengine.alive:
        raise APIError(503, "engine is not running")
    return Response(status_code=200)


@router.get("/health_generate")
async def health_generate(request: Request):
    """Healthy when the engine generates one token within HEALTH_TIMEOUT_S."""
    st = serving(request)
    params = SamplingParams(max_new_tokens=1, temperature=0.0, ignore_eos=True)

    async def one():
        async with aclosing(st.run(st.encode("ok") or [0], params, None)) as stream:
            async for prog in stream:
                if prog.output_ids:
                    return True
        return False

    try:
        ok = await asyncio.wait_for(one(), HEALTH_TIMEOUT_S)
    except (asyncio.TimeoutError, RuntimeError, APIError) as e:
        raise APIError(503, f"health generation failed: {e or 'timed out'}") from None
    if not ok:
        raise APIError(503, "health generation produced no token")
    return Response(status_code=200)


@router.api_route("/flush_cache", methods=["GET", "POST"])
async def flush_cache():
    """SGLang flushes its radix (prefix) cache here. This server keeps no prefix cache (a
    request's KV blocks are freed when it finishes), so there is nothing to flush."""
    return PlainTextResponse("Cache flushed (this server keeps no prefix cache).\n")


@router.post("/abort_request")
async def abort_request(request: Request):
    body = await parse_body(request, AbortRequest)
    st = serving(request)
    if body.abort_all:
        return {"success": True, "aborted": await st.abort_all()}
    if not body.rid:
        raise APIError.bad("rid", "give the id of the request to abort (or abort_all: true)")
    return {"success": True, "aborted": int(await st.abort(body.rid))}


@router.get("/metrics")
async def metrics(request: Request):
    st = serving(request)
    snap = await st.snapshot()
    return Response(st.metrics.render(snap), media_type=CONTENT_TYPE_LATEST)


@router.get("/")
async def root(request: Request):
    return JSONResponse({"server": "sloserve", "model": serving(request).model_name})
