"""Client errors: one exception type, one JSON shape per API family, always a 4xx naming the
problem. FastAPI's 422 for validation errors becomes a 400 like every other bad input.

Native (SGLang) routes answer `{"object": "error", "message", "type", "param", "code"}` like
SGLang's server; OpenAI routes (`/v1/...`) answer `{"error": {"message", "type", "param",
"code"}}`, the shape the official client reads.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
from collections.abc import Mapping, Sequence
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from sloserve.runtime.async_engine import EngineDeadError, EngineFailure
from sloserve.runtime.request import InvalidRequest

log = logging.getLogger(__name__)
M = TypeVar("M", bound=BaseModel)
_TYPES = {400: "BadRequestError", 401: "AuthenticationError", 404: "NotFoundError",
          405: "MethodNotAllowed", 408: "RequestTimeout", 413: "RequestTooLarge",
          415: "UnsupportedMediaType", 503: "ServiceUnavailable", 500: "InternalServerError"}


class APIError(Exception):
    """An error answered to the client: HTTP status, a message naming the problem, and the
    offending parameter (or None)."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.headers = headers  # e.g. Retry-After, WWW-Authenticate, Connection: close

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


def validation_message(errors: Sequence[Mapping[str, Any]], prefix: str = "") -> tuple[str, str]:
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


OFF_LOOP_BYTES = 64 << 10  # bodies larger than this are parsed on a worker thread
# a JSON escape of a UTF-16 surrogate (backslash-u d800 to dfff): json.loads turns a lone one
# into a str that no tokenizer or encoder accepts
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


async def parse_body(request: Request, model: type[M]) -> M:
    """The request body as `model`; 400 naming the problem for anything malformed. A large
    body is parsed and validated on a worker thread, so the event loop keeps serving."""
    raw = await request.body()
    if len(raw) > OFF_LOOP_BYTES:
        return await asyncio.to_thread(parse_json_body, raw, model)
    return parse_json_body(raw, model)


def parse_json_body(raw: bytes, model: type[M]) -> M:
    if not raw.strip():
        raise APIError.bad("body", "empty request body; send a JSON object")
    try:
        data = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise APIError.bad("body", f"malformed JSON: {e}") from None
    except RecursionError:
        raise APIError.bad("body", "JSON nested too deeply") from None
    except ValueError as e:  # a number literal of over 4300 digits (Python's int limit)
        raise APIError.bad("body", f"malformed JSON: {str(e)[:200]}") from None
    if not isinstance(data, dict):
        raise APIError.bad("body", f"must be a JSON object, got {type(data).__name__}")
    if _SURROGATE_ESCAPE.search(raw):
        where = _lone_surrogate(data, "")
        if where is not None:
            raise APIError.bad(where or "body", "holds a lone UTF-16 surrogate escape "
                               "(\\ud800-\\udfff without its pair): not valid Unicode text")
    try:
        body = model.model_validate(data)
    except ValidationError as e:
        msg, param = validation_message(e.errors())
        raise APIError(400, msg, param) from None
    except RecursionError:  # pydantic recurses into Any-typed values
        raise APIError.bad("body", "JSON nested too deeply") from None
    ignored = ignored_keys(body)
    if ignored and log.isEnabledFor(logging.DEBUG):
        log.debug("ignoring unknown request keys: %s", ", ".join(ignored)[:500])
    return body


def ignored_keys(body: BaseModel, prefix: str = "") -> list[str]:
    """The unknown keys a lenient model (extra="allow") set aside, at any depth, as dotted
    paths. They are ignored, as SGLang ignores them; known options it cannot honour are
    checked by the models themselves (a 400 naming the key when not at their default)."""
    out = [prefix + k for k in (body.model_extra or {})]
    for name in type(body).model_fields:
        value = getattr(body, name)
        items = value if isinstance(value, list) else [value]
        for i, v in enumerate(items):
            if isinstance(v, BaseModel):
                where = f"{prefix}{name}[{i}]." if isinstance(value, list) else f"{prefix}{name}."
                out.extend(ignored_keys(v, where))
    return out


def _lone_surrogate(x: Any, path: str) -> str | None:
    """The path of the first string (or key) in x holding a lone surrogate, else None."""
    stack = [(x, path)]
    while stack:
        x, path = stack.pop()
        if isinstance(x, str):
            try:
                x.encode("utf-8")
            except UnicodeEncodeError:
                return path
        elif isinstance(x, dict):
            for k, v in x.items():
                name = k.encode("utf-8", "backslashreplace").decode()  # printable
                sub = f"{path}.{name}" if path else name
                if name != k:
                    return sub
                stack.append((v, sub))
        elif isinstance(x, list):
            stack.extend((v, f"{path}[{i}]") for i, v in enumerate(x))
    return None


def error_body(path: str, status: int, message: str, param: str | None) -> dict:
    """The error JSON of the API family `path` belongs to."""
    kind = _TYPES.get(status, "Error")
    if path.startswith("/v1/"):
        return {"error": {"message": message, "type": kind, "param": param, "code": status}}
    return {"object": "error", "message": message, "type": kind, "param": param, "code": status}


def error_response(request: Request, status: int, message: str, param: str | None = None,
                   headers: dict[str, str] | None = None):
    return JSONResponse(error_body(request.url.path, status, message, param),
                        status_code=status, headers=headers)


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api(request: Request, exc: APIError):
        return error_response(request, exc.status, exc.message, exc.param, exc.headers)

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

    @app.exception_handler(EngineFailure)  # StepFailed, RequestFailed (EngineDead: 503)
    async def _step(request: Request, exc: EngineFailure):
        return error_response(request, 500, str(exc), None)

    @app.exception_handler(Exception)
    async def _bug(request: Request, exc: Exception):  # still JSON; Starlette logs it
        return error_response(request, 500, f"internal error: {type(exc).__name__}", None)
