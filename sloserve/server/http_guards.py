"""What a request must pass before any route sees it, as one ASGI middleware: the Host
header (DNS rebinding), the API key, a JSON Content-Type on everything that sends a body or
changes state (a web page cannot send one cross-site without a CORS preflight, which this
server does not answer unless origins are allowed), the body size and the time the body may
take to arrive. Every refusal is a JSON error in the route's API shape.

The time the request headers may take is enforced below ASGI, by the connection protocol
(`http_protocol.py`).
"""

from __future__ import annotations

import asyncio
import hmac
import time
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from starlette.responses import JSONResponse

from sloserve.server.errors import APIError, error_body
from sloserve.server.http_options import HTTPOptions

Scope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]

# open without the API key, as in SGLang: liveness probes and Prometheus scrapers
OPEN_PATHS = ("/health", "/health_generate", "/metrics")
# routes that change server state: a JSON Content-Type on every method (GET included)
STATE_CHANGING = ("/abort_request", "/flush_cache")
_BODY_METHODS = ("POST", "PUT", "PATCH", "DELETE")
CLOSE = {"Connection": "close"}


def host_name(header: str) -> str:
    """The name part of a Host header: 'a.b:80' -> 'a.b', '[::1]:80' -> '::1'."""
    header = header.strip().lower()
    if header.startswith("["):
        return header[1:].split("]", 1)[0]
    return header.rsplit(":", 1)[0] if header.count(":") == 1 else header


def _is_json(content_type: str) -> bool:
    media = content_type.split(";", 1)[0].strip().lower()
    return media == "application/json" or (media.startswith("application/")
                                            and media.endswith("+json"))


class GuardMiddleware:
    def __init__(self, app, options: HTTPOptions):
        self.app = app
        self.opts = options
        self.hosts = options.host_names()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        refusal = self._refusal(scope)
        if refusal is not None:
            status, message, param, headers = refusal
            body = error_body(scope["path"], status, message, param)
            await JSONResponse(body, status_code=status, headers=headers)(scope, receive, send)
            return
        await self.app(scope, self._limited(receive), send)

    def _refusal(self, scope: Scope) -> tuple[int, str, str | None, dict | None] | None:
        headers = {k.decode("latin-1").lower(): v.decode("latin-1")
                   for k, v in scope["headers"]}
        path, method = scope["path"], scope["method"]
        if self.hosts is not None:
            name = host_name(headers.get("host", ""))
            if name not in self.hosts:
                return (400, f"Host {name!r:.100} is not served here (allowed: "
                        f"{', '.join(self.hosts)}; see --allowed-hosts)", "Host", CLOSE)
        if method == "OPTIONS":
            return None  # CORS preflight: answered by the CORS middleware, or 405
        if self.opts.api_key is not None and not path.startswith(OPEN_PATHS):
            auth = headers.get("authorization", "")
            scheme, _, token = auth.partition(" ")
            if scheme.lower() != "bearer" or not hmac.compare_digest(
                    token.strip().encode(), self.opts.api_key.encode()):
                return (401, "missing or wrong API key: send 'Authorization: Bearer <key>'",
                        "Authorization", {"WWW-Authenticate": "Bearer"})
        if method in _BODY_METHODS or path in STATE_CHANGING:
            if not _is_json(headers.get("content-type", "")):
                got = headers.get("content-type")
                return (415, f"Content-Type must be application/json (got {got!r:.60})",
                        "Content-Type", None)
        length = headers.get("content-length")
        if length is not None:
            if not length.isdigit():
                return 400, f"bad Content-Length {length!r:.30}", "Content-Length", CLOSE
            if int(length) > self.opts.max_body_bytes:
                return (413, f"request body of {int(length)} bytes is over the limit of "
                        f"{self.opts.max_body_bytes} (--max-request-body-bytes)", "body", CLOSE)
        return None

    def _limited(self, receive: Receive) -> Receive:
        """receive() for the app: the body may hold at most max_body_bytes and must arrive
        within body_timeout_s (APIError 413 / 408, closing the connection)."""
        limit, timeout = self.opts.max_body_bytes, self.opts.body_timeout_s
        deadline = time.monotonic() + timeout
        state = {"size": 0, "done": False}

        async def limited() -> MutableMapping[str, Any]:
            if state["done"]:
                return await receive()
            try:
                message = await asyncio.wait_for(receive(), deadline - time.monotonic())
            except asyncio.TimeoutError:
                raise APIError(408, f"the request body did not arrive within {timeout:g} s",
                               "body", CLOSE) from None
            if message["type"] == "http.request":
                state["size"] += len(message.get("body", b""))
                if state["size"] > limit:
                    raise APIError(413, f"request body over the limit of {limit} bytes "
                                   "(--max-request-body-bytes)", "body", CLOSE)
                state["done"] = not message.get("more_body", False)
            return message

        return limited
