"""Load reporting for routers and monitors, in SGLang's shapes: GET /get_load (what
sglang-router's load-aware policies read: a list with one entry per data-parallel rank, whose
`num_tokens` it sums), GET /v1/loads (SGLang's newer, fuller report) and GET /version.

This server is one engine, so there is one rank (dp_rank 0). Token counts are read on the
engine thread: `num_used_tokens` are the tokens of the running requests (their KV),
`num_total_tokens` add the waiting requests' tokens (prefill still to do), as SGLang counts.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from datetime import datetime, timezone

from fastapi import APIRouter, Request

import sloserve
from sloserve.runtime.engine import Engine
from sloserve.server.serving import ServingState

router = APIRouter()
VERSION = getattr(sloserve, "__version__", "0.1.0")


@dataclass(frozen=True)
class Load:
    running: int
    waiting: int
    used_tokens: int  # tokens of the running requests
    total_tokens: int  # + tokens of the waiting requests
    capacity: int  # KV pool, tokens
    max_running: int


def read_load(engine: Engine) -> Load:
    """Run on the engine thread (ServingState.call)."""
    sched = engine.scheduler
    used = sum(r.num_tokens for r in sched.running)
    pending = sum(r.num_tokens for r in sched.waiting)
    alloc = sched.alloc
    return Load(running=len(sched.running), waiting=len(sched.waiting), used_tokens=used,
                total_tokens=used + pending, capacity=alloc.num_blocks * alloc.block_size,
                max_running=sched.cfg.max_running_requests)


def _serving(request: Request) -> ServingState:
    return request.app.state.serving


def _throughput(request: Request, st: ServingState, generated: int) -> float:
    """Output tokens per second since the previous /v1/loads (the first: since start)."""
    now = time.time()
    then, before = getattr(request.app.state, "loads_mark", (st.started, 0))
    request.app.state.loads_mark = (now, generated)
    return (generated - before) / (now - then) if now > then else 0.0


@router.get("/get_load")
async def get_load(request: Request):
    load = await _serving(request).call(read_load)
    return [{"dp_rank": 0, "num_reqs": load.running + load.waiting,
             "num_waiting_reqs": load.waiting, "num_tokens": load.total_tokens,
             "num_pending_tokens": load.total_tokens - load.used_tokens,
             "ts_tic": time.perf_counter()}]


@router.get("/v1/loads")
async def loads(request: Request):
    st = _serving(request)
    load = await st.call(read_load)
    snap = await st.snapshot()
    usage = load.used_tokens / load.capacity if load.capacity else 0.0
    rank = {
        "dp_rank": 0, "timestamp": time.time(),
        "num_running_reqs": load.running, "num_waiting_reqs": load.waiting,
        "num_total_reqs": load.running + load.waiting,
        "num_used_tokens": load.used_tokens, "num_total_tokens": load.total_tokens,
        "max_total_num_tokens": load.capacity, "token_usage": usage,
        "gen_throughput": _throughput(request, st, snap.stats.get("generated_tokens", 0)),
        "cache_hit_rate": 0.0,  # no prefix cache
        "utilization": load.running / load.max_running if load.max_running else 0.0,
        "max_running_requests": load.max_running,
    }
    return {
        "timestamp": datetime.now(timezone.utc).isoformat(), "version": VERSION,
        "dp_rank_count": 1, "loads": [rank],
        "aggregate": {
            "total_running_reqs": load.running, "total_waiting_reqs": load.waiting,
            "total_reqs": load.running + load.waiting, "total_used_tokens": load.used_tokens,
            "total_tokens": load.total_tokens, "avg_token_usage": usage,
            "avg_throughput": rank["gen_throughput"], "avg_utilization": rank["utilization"],
        },
    }


@router.get("/version")
async def version():
    return {"version": VERSION}
