"""Helpers of the server tests: an in-process server (uvicorn in a thread on a free loopback
port) and the tiny-pair engine configuration."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

import httpx
import uvicorn

from sloserve.runtime.config import EngineConfig
from sloserve.runtime.engine import Engine
from sloserve.runtime.scheduler import SchedulerConfig
from sloserve.server.app import create_app
from sloserve.server.http_options import HTTPOptions
from sloserve.server.http_protocol import with_header_timeout
from sloserve.server.serving import ServingState

TIMEOUT = httpx.Timeout(60.0)


def tiny_config(tiny_pair, **kw) -> EngineConfig:
    """The tiny pair with fixed speculation; keyword arguments override EngineConfig fields
    (and max_running_requests / max_queued_requests the scheduler's)."""
    sched = {"max_running_requests": 64, "max_step_tokens": 512}
    sched.update({k: kw.pop(k) for k in ("max_running_requests", "max_queued_requests")
                  if k in kw})
    base = dict(model_path=tiny_pair[0], draft_model_path=tiny_pair[1], spec_policy="fixed:3",
                kv_cache_tokens=16384, block_size=8, dtype="float32")
    return EngineConfig(**{**base, **kw}, scheduler=SchedulerConfig(**sched))


@dataclass
class LiveServer:
    url: str
    engine: Engine
    state: ServingState
    server: uvicorn.Server
    thread: threading.Thread

    def client(self, headers: dict | None = None) -> httpx.Client:
        return httpx.Client(base_url=self.url, timeout=TIMEOUT, headers=headers)

    def wait_idle(self, timeout: float = 20.0, headers: dict | None = None) -> dict:
        """/server_info once nothing runs and the KV pool is all free (fails after timeout)."""
        deadline = time.monotonic() + timeout
        with self.client(headers) as c:
            while True:
                info = c.get("/server_info").json()
                idle = (info["num_requests_running"] == 0 and info["num_requests_waiting"] == 0
                        and info["kv_pool"]["used_blocks"] == 0)
                if idle or time.monotonic() > deadline:
                    return info
                time.sleep(0.05)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(30)


def start_server(engine: Engine, **options) -> LiveServer:
    """The app on uvicorn as launch serves it; options are HTTPOptions fields."""
    opts = HTTPOptions(**options)
    app = create_app(engine, options=opts)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning",
                                           lifespan="on",
                                           http=with_header_timeout(opts.header_timeout_s)))
    thread = threading.Thread(target=server.run, name="uvicorn-test", daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "server did not start"
        time.sleep(0.02)
    port = server.servers[0].sockets[0].getsockname()[1]
    return LiveServer(f"http://127.0.0.1:{port}", engine, app.state.serving, server, thread)
