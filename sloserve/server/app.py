"""The FastAPI application: SGLang's native API, the OpenAI-compatible API and /metrics over
one engine."""

from __future__ import annotations

import logging
from contextlib import asynccontextmanager

from fastapi import FastAPI
from starlette.middleware.cors import CORSMiddleware

from sloserve.runtime.engine import Engine
from sloserve.server import load_api, native_api, openai_api
from sloserve.server.errors import install_error_handlers
from sloserve.server.http_guards import GuardMiddleware
from sloserve.server.http_options import HTTPOptions
from sloserve.server.serving import ServingState

log = logging.getLogger(__name__)


def create_app(engine: Engine, served_model_name: str | None = None,
               options: HTTPOptions | None = None) -> FastAPI:
    """An app serving `engine`. Starts the engine thread now; the app's shutdown (lifespan)
    aborts what is still running and stops the thread. `app.state.serving` is the
    ServingState. Serve it with uvicorn.Config(http=with_header_timeout(...)) so that the
    header deadline of `options` holds too."""
    options = options or HTTPOptions()
    state = ServingState(engine, served_model_name, options)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        try:
            yield
        finally:
            try:
                n = await state.abort_all()
                if n:
                    log.info("aborted %d running requests at shutdown", n)
            except Exception:  # the engine thread may be dead already
                log.exception("abort at shutdown failed")
            state.shutdown()

    app = FastAPI(title="sloserve", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.serving = state
    install_error_handlers(app)
    app.include_router(native_api.router)
    app.include_router(openai_api.router)
    app.include_router(load_api.router)
    if options.allowed_origins:  # CORS is off unless origins are named
        app.add_middleware(CORSMiddleware, allow_origins=list(options.allowed_origins),
                           allow_methods=["GET", "POST"], allow_headers=["*"])
    app.add_middleware(GuardMiddleware, options=options)  # the outermost: before CORS
    app.state.http_options = options
    return app
