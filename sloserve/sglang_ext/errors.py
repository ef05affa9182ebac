"""Client errors: one exception type, one JSON shape per API family, always a 4xx naming the
problem. FastAPI's 422 for validation errors becomes a 400 like every other bad input.

Native (SGLang) routes answer `{"object": "error", "message", "type", "param", "code"}` like
SGLang's server; OpenAI routes (`/v1/...`) answer `{"error": {"message", "type", "param",
"code"}}`, the shape the official client reads.
"""

from __future__ import annotations

import json
import logging
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from sloserve.runtime.async_engine import EngineDeadError
from sloserve.runtime.request import InvalidRequest

log = logging.getLogger(__name__)
M = TypeVar("M", bound=BaseModel)
_TYPES = {400: "BadRequestError", 404: "NotFoundError", 405: "MethodNotAllowed",
          413: "RequestTooLarge", 503: "ServiceUnavailable", 500: "InternalServerError"}


class APIError(Exception):
    """An error answered to the client: HTTP status, a message naming the problem, and the
    offending parameter (or None)."""

    def __init__(self, status: int, message: str, param: str | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param

    @classmethod
    def bad(cls, param: str | None, message: str) -> APIError:
        return cls(400, f"{param}: {message}" if param else message, param)


def from_invalid(e: InvalidRequest, prefix: str = "") -> APIError:
    """An engine InvalidRequest ("field: message") as a 400; prefix locates the field."""
    field = f"{prefix}{e.field}" if prefix and e.field != "prompt" else e.field
    msg = str(e).split(": ", 1)[1] if ": " in str(e) else str(e)
    return APIError.bad(field, msg)


def _loc(loc: tuple) -> str:
    """A pydantic error location as a dotted path, without union-member tags like 'list[int]'."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif "[" in part or part[:1].isupper() or part in _TAGS:
            continue  # which member of a union failed: noise for the client
        else:
            out += ("." if out else "") + part
    return out or "body"


_TAGS = ("str", "int", "float", "bool", "dict", "list", "none")


def validation_message(errors: list[dict[str, Any]], prefix: str = "") -> tuple[str, str]:
    """(message, param) for pydantic/FastAPI errors: one line per field, unknown keys named."""
    seen: dict[str, str] = {}
    for err in errors:
        loc = tuple(err.get("loc", ()))
        if loc and loc[0] == "body":
            loc = loc[1:]
        path = prefix + _loc(loc)
        if err.get("type") == "extra_forbidden":
            msg = "unknown parameter (not supported by this server)"
        elif err.get("type") == "missing":
            msg = "is required"
        elif err.get("type") == "json_invalid":
            path, msg = "body", f"malformed JSON: {err.get('ctx', {}).get('error', err['msg'])}"
        else:
            got = err.get("input")
            msg = f"{err['msg']} (got {json.dumps(got)[:80]})" if _jsonable(got) else err["msg"]
        seen.setdefault(path, msg)
    # a union's other members fail at the parent path ("should be a valid list"): when a
    # deeper error explains the problem, drop the parent's
    seen = {p: m for p, m in seen.items()
            if not any(q != p and (q.startswith(p + ".") or q.startswith(p + "[")) for q in seen)}
    first = next(iter(seen), "body")
    return "; ".join(f"{p}: {m}" for p, m in seen.items()), first


def _jsonable(x: Any) -> bool:
    try:
        json.dumps(x)
        return True
    except (TypeError, ValueError):
        return False


async def parse_body(request: Request, model: type[M]) -> M:
    """The request body as `model`; 400 naming the problem for anything malformed."""
    raw = await request.body()
    if not raw.strip():
        raise APIError.bad("body", "empty request body; send a JSON object")
    try:
        data = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise APIError.bad("body", f"malformed JSON: {e}") from None
    if not isinstance(data, dict):
        raise APIError.bad("body", f"must be a JSON object, got {type(data).__name__}")
    try:
        return model.model_validate(data)
    except ValidationError as e:
        msg, param = validation_message(e.errors())
        raise APIError(400, msg, param) from None


def _body(request: Request, status: int, message: str, param: str | None) -> dict:
    kind = _TYPES.get(status, "Error")
    if request.url.path.startswith("/v1/"):
        return {"error": {"message": message, "type": kind, "param": param, "code": status}}
    return {"object": "error", "message": message, "type": kind, "param": param, "code": status}


def error_response(request: Request, status: int, message: str, param: str | None = None):
    return JSONResponse(_body(request, status, message, param), status_code=status)


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api(request: Request, exc: APIError):
        return error_response(request, exc.status, exc.message, exc.param)

    @app.exception_handler(InvalidRequest)
    async def _invalid(request: Request, exc: InvalidRequest):
        e = from_invalid(exc)
        return error_response(request, 400, e.message, e.param)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError):
        msg, param = validation_message(list(exc.errors()))
        return error_response(request, 400, msg, param)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException):
        msg = f"{exc.detail}: {request.method} {request.url.path}"
        return error_response(request, exc.status_code, msg, None)

    @app.exception_handler(EngineDeadError)
    async def _dead(request: Request, exc: EngineDeadError):
        return error_response(request, 503, str(exc), None)
