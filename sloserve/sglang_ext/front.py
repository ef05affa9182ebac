"""A thin HTTP front of SGLang's server (`--engine sglang`): it listens where the user asked,
checks each generation request's body (request_guard.py) and forwards everything to SGLang's
server on a loopback port, streaming the answers back unchanged.

SGLang's server is a child process; when it exits, the front exits with its status (so that
a supervisor restarts both), and when the front stops, it stops the child. Until SGLang
answers, forwarded requests (/health included) are a 503.
"""

from __future__ import annotations

import asyncio
import json
import logging
import subprocess
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager

import httpx
from starlette.applications import Starlette
from starlette.background import BackgroundTask
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from sloserve.sglang_ext.request_guard import GUARDED, GuardLimits, Refused, check_body

log = logging.getLogger(__name__)
MAX_BODY_BYTES = 32 << 20  # as the built-in server's default --max-request-body-bytes
# SGLang's uvicorn closes idle connections after SGLANG_TIMEOUT_KEEP_ALIVE seconds (0.5.23)
KEEP_ALIVE_ENV, DEFAULT_KEEP_ALIVE = "SGLANG_TIMEOUT_KEEP_ALIVE", 5.0
# hop-by-hop headers, and those httpx sets itself
_DROP = {"host", "content-length", "connection", "keep-alive", "transfer-encoding", "te",
         "upgrade", "proxy-connection", "accept-encoding"}


def _error(path: str, status: int, message: str, param: str | None) -> JSONResponse:
    """SGLang's error shape: OpenAI's on /v1 routes, its own elsewhere."""
    kind = "BadRequestError" if status == 400 else "ServiceUnavailable"
    body: dict[str, object]
    if path.startswith("/v1/"):
        body = {"error": {"message": message, "type": kind, "param": param, "code": status}}
    else:
        body = {"object": "error", "message": message, "type": kind, "param": param,
                "code": status}
    return JSONResponse(body, status_code=status)


def create_front(upstream: str, limits: GuardLimits,
                 upstream_keep_alive: float = DEFAULT_KEEP_ALIVE) -> Starlette:
    """The front's app, forwarding to `upstream` (SGLang's server, http://host:port), whose
    HTTP server closes a connection idle for `upstream_keep_alive` seconds."""
    # an idle pooled connection is dropped at half SGLang's keep-alive: at httpx's default
    # (5 s, equal to SGLang's) a request written just as SGLang closes the connection fails
    # with a ReadError, which the client would see as a 503
    client = httpx.AsyncClient(base_url=upstream, timeout=httpx.Timeout(None, connect=5.0),
                               limits=httpx.Limits(keepalive_expiry=upstream_keep_alive / 2))

    async def forward(request: Request) -> Response:
        path = request.url.path
        raw = await request.body()
        if request.method == "POST" and path in GUARDED:
            if len(raw) > MAX_BODY_BYTES:
                return _error(path, 413, f"request body over {MAX_BODY_BYTES} bytes", "body")
            try:  # off the event loop: a 32 MB body or a deep schema takes a while to check,
                # and every other stream waits on the loop meanwhile
                raw = await asyncio.to_thread(_guarded, path, raw, limits)
            except Refused as e:
                return _error(path, 400, str(e), e.param)
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _DROP}
        # the client's own Accept-Encoding (none: identity), not httpx's gzip: the body is
        # passed through as SGLang sent it, Content-Encoding included
        headers["accept-encoding"] = request.headers.get("accept-encoding", "identity")
        req = client.build_request(request.method, path, params=request.query_params,
                                   headers=headers, content=raw)
        try:
            resp = await client.send(req, stream=True)
        except httpx.TransportError as e:
            return _error(path, 503, f"SGLang's server is not answering ({type(e).__name__})",
                          None)
        out_headers = {k: v for k, v in resp.headers.items() if k.lower() not in _DROP}
        return StreamingResponse(_chunks(resp), status_code=resp.status_code,
                                 headers=out_headers, background=BackgroundTask(resp.aclose))

    @asynccontextmanager
    async def lifespan(app):
        try:
            yield
        finally:
            await client.aclose()

    methods = ["GET", "POST", "PUT", "DELETE", "PATCH", "OPTIONS", "HEAD"]
    return Starlette(routes=[Route("/{path:path}", forward, methods=methods)],
                     lifespan=lifespan)


async def _chunks(resp: httpx.Response) -> AsyncIterator[bytes]:
    async for chunk in resp.aiter_raw():
        yield chunk


def _guarded(path: str, raw: bytes, limits: GuardLimits) -> bytes:
    """The body to forward; raises Refused. A body that is not JSON goes on unchanged
    (SGLang answers it)."""
    try:
        body = json.loads(raw)
    except RecursionError:
        raise Refused("body", "JSON nested too deeply") from None
    except ValueError as e:
        if "digits" in str(e):  # a number literal of over 4300 digits
            raise Refused("body", f"malformed JSON: {str(e)[:120]}") from None
        return raw
    if check_body(path, body, limits):
        return json.dumps(body).encode()
    return raw


def upstream_keep_alive(env: Mapping[str, str]) -> float:
    """SGLang's keep-alive in seconds, from the environment its server starts with."""
    try:
        return max(float(env.get(KEEP_ALIVE_ENV, DEFAULT_KEEP_ALIVE)), 0.0)
    except ValueError:  # SGLang itself fails on it at start, and the front stops with it
        return DEFAULT_KEEP_ALIVE


async def serve(host: str, port: int, upstream: str, limits: GuardLimits,
                child: subprocess.Popen, keep_alive: float = DEFAULT_KEEP_ALIVE) -> int:
    """Serve the front until SGLang's child exits (its status is returned) or the front is
    stopped (the child is then terminated). `keep_alive`: SGLang's (upstream_keep_alive)."""
    import uvicorn

    logging.getLogger("httpx").setLevel(logging.WARNING)  # not a line per forwarded request
    server = uvicorn.Server(uvicorn.Config(create_front(upstream, limits, keep_alive), host=host,
                                           port=port, log_level="warning", lifespan="on"))
    task = asyncio.create_task(server.serve())
    status = 0
    try:
        while not task.done():
            if child.poll() is not None:
                status = child.returncode or 1
                log.error("SGLang's server exited with status %s; the front stops",
                          child.returncode)
                server.should_exit = True
                break
            await asyncio.sleep(0.5)
        await task
    finally:
        if child.poll() is None:
            child.terminate()
            try:
                child.wait(30)
            except subprocess.TimeoutExpired:
                child.kill()
    return status
