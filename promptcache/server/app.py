"""The FastAPI application: routes and error shapes (the front door is ``guard.py``)."""

from __future__ import annotations

import logging
import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from importlib import resources
from typing import Any

from fastapi import FastAPI, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, PlainTextResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from promptcache.engines.base import (
    EngineFailure,
    EngineTimeoutError,
    PromptTooLongError,
    RequestError,
)
from promptcache.server import (
    anthropic_api,
    models_api,
    ollama_api,
    openai_api,
    responses_api,
    sessions,
)
from promptcache.server.errors import ErrorShapes, describe_validation
from promptcache.server.guard import BodyTooLarge, CatchAll, Guard
from promptcache.server.routes import ApiRoute, endpoint
from promptcache.server.state import QueueFullError, ServerState
from promptcache.server.streaming import cancel_all

log = logging.getLogger("promptcache.server")

# the APIs: each module's ROUTES (a new API is its module and one entry here); the Ollama API
# serves Open WebUI, Continue and IDE plugins
API_MODULES = (openai_api, anthropic_api, responses_api, models_api, ollama_api)
API_ROUTES: tuple[ApiRoute, ...] = tuple(r for m in API_MODULES for r in m.ROUTES)
# the paths counted by name in the metrics (any other: "other")
OWN_ENDPOINTS = ("/v1/cache/stats", "/v1/cache/requests", "/dashboard", "/health", "/metrics")
ENDPOINTS = tuple(r.path for r in API_ROUTES if not r.path_params) + OWN_ENDPOINTS
STREAM_TYPES = {r.path: r.streams for r in API_ROUTES if r.streams}  # path -> media type
DASHBOARD_ASSETS = {"dashboard.js": "text/javascript", "dashboard.css": "text/css"}


def dashboard_file(name: str) -> str:
    return (resources.files("promptcache.server") / "dashboard" / name).read_text("utf-8")


def create_app(state: ServerState) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        yield
        cancel_all()  # on shutdown nobody waits for a generation: stop them at the next step

    app = FastAPI(title="promptcache", version="0.1.0", lifespan=lifespan)
    app.state.pc = state
    app.openapi = lambda: openapi_schema(app)  # type: ignore[method-assign]

    def count(path: str, status: int) -> None:
        state.metrics.count_request(path if path in ENDPOINTS else "other", status)

    limits = state.limits
    errors = ErrorShapes(m.ERRORS for m in API_MODULES if hasattr(m, "ERRORS"))
    app.add_middleware(CatchAll, errors=errors)  # inside Guard: its 500s are counted too
    app.add_middleware(
        Guard,
        errors=errors,
        count=count,
        max_body_bytes=limits.max_body_bytes,
        api_keys=limits.api_keys,
        loopback_only=limits.loopback_only,
    )

    def reject(request: Request, status: int, message: str, **extra: Any) -> JSONResponse:
        log.warning("%s %s -> %d: %s", request.method, request.url.path, status, message)
        return errors.response(request.url.path, status, message, **extra)

    @app.exception_handler(RequestValidationError)
    async def on_validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = describe_validation(list(exc.errors()))
        return reject(request, 400, message, param=param)

    @app.exception_handler(StarletteHTTPException)
    async def on_http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        response = reject(request, exc.status_code, str(exc.detail))
        response.headers.update(exc.headers or {})  # e.g. Allow on a 405
        return response

    @app.exception_handler(PromptTooLongError)
    async def on_too_long(request: Request, exc: PromptTooLongError) -> JSONResponse:
        # each API's own wording: clients parse it (Claude Code compacts on Anthropic's)
        message, extra = errors.of(request.url.path).too_long(exc)
        return reject(request, 400, message, **extra)

    @app.exception_handler(BodyTooLarge)
    async def on_body(request: Request, exc: BodyTooLarge) -> JSONResponse:
        return reject(request, 413, str(exc))

    @app.exception_handler(EngineTimeoutError)
    async def on_timeout(request: Request, exc: EngineTimeoutError) -> JSONResponse:
        response = reject(request, 503, str(exc))
        response.headers["retry-after"] = "5"
        return response

    @app.exception_handler(QueueFullError)
    async def on_queue_full(request: Request, exc: QueueFullError) -> JSONResponse:
        response = reject(request, 429, str(exc))
        response.headers["retry-after"] = str(exc.retry_after_s)
        return response

    @app.exception_handler(RequestError)
    async def on_request_error(request: Request, exc: RequestError) -> JSONResponse:
        return reject(request, 400, str(exc))

    # the server's faults, never the client's: a plain ValueError from library code (a bug, a
    # cache refusing a save) is one too. Logged with the traceback; the client gets a 500.
    @app.exception_handler(EngineFailure)
    @app.exception_handler(ValueError)
    async def on_failure(request: Request, exc: Exception) -> JSONResponse:
        log.error("%s %s failed: %s", request.method, request.url.path, exc, exc_info=exc)
        message = f"the server failed to serve this request ({type(exc).__name__}); see its log"
        return errors.response(request.url.path, 500, message)

    @app.api_route("/", methods=["GET", "HEAD"])
    async def root() -> Any:  # Claude Code probes the base URL with HEAD / before each run
        return {"status": "ok", "model": state.model_id}

    for route in API_ROUTES:
        app.api_route(route.path, methods=list(route.methods), responses=route.errors)(
            endpoint(state, route)
        )

    @app.get("/health")
    async def health() -> Any:
        return {
            "status": "ok",
            "model": state.model_id,
            "engine": state.engine.name,
            "cache": bool(state.cache_stats()),
            "pid": os.getpid(),  # lets a launcher tell its own server from another on the port
        }

    @app.get("/v1/cache/stats")
    async def cache_stats() -> Any:
        stats = state.cache_stats()
        return {"enabled": bool(stats), **stats, "continuity": state.continuity_stats()}

    @app.get("/v1/cache/requests")
    async def cache_requests(
        request: Request,
        limit: int = Query(100, ge=1, le=1000),
        tenant: str | None = None,
    ) -> Any:
        """Recent cache records, newest first. A tenant key sees its own requests only."""
        grant = request.scope.get("state", {}).get("grant")
        if grant is not None and not grant.is_admin:
            tenant = str(grant.tenant)
        records = state.records
        return {
            "model": state.model_id,
            "requests": [r.to_dict() for r in records.recent(limit, tenant)],
            "alert": records.alert(tenant),
            "misses_by_reason": records.reasons(tenant),
        }

    # documented: a tenant deletion without an admin key, a server with the cache off
    deletion_errors: dict[int | str, dict[str, Any]] = {
        403: {"description": "Needs an admin key"},
        404: {"description": "The prompt cache is off"},
    }

    @app.delete("/v1/cache/sessions/{session_id}", responses=deletion_errors)
    async def delete_session(request: Request, session_id: str, force: bool = False) -> Any:
        """Remove every cached block only this session (of the caller's tenant) uses, in every
        tier; with ``force=true`` shared ones too. Pinned blocks stay (reported)."""
        return await sessions.delete_session(state, request, session_id, force)

    @app.delete("/v1/cache/tenants/{tenant}", responses=deletion_errors)
    async def delete_tenant(request: Request, tenant: str) -> Any:
        """Remove every cached block of a tenant, in every tier (an admin key, with API keys)."""
        return await sessions.delete_tenant(state, request, tenant)

    # the page and its files are UI, not API: kept out of the OpenAPI schema
    @app.get("/dashboard", response_class=HTMLResponse, include_in_schema=False)
    async def dashboard() -> HTMLResponse:
        return HTMLResponse(dashboard_file("index.html"))

    @app.get("/dashboard/{name}", include_in_schema=False)
    async def dashboard_asset(name: str) -> Response:
        if name not in DASHBOARD_ASSETS:
            raise StarletteHTTPException(404, f"no dashboard file {name!r}")
        return Response(dashboard_file(name), media_type=DASHBOARD_ASSETS[name])

    @app.get("/metrics")
    async def metrics() -> PlainTextResponse:
        return PlainTextResponse(
            state.metrics.render(state.cache_series(), state.records),
            media_type="text/plain; version=0.0.4",
        )

    return app


def openapi_schema(app: FastAPI) -> dict[str, Any]:
    """FastAPI's schema, saying what the server does: request errors are 400, not 422."""
    if app.openapi_schema is None:
        from fastapi.openapi.utils import get_openapi

        schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
        text = {"schema": {"type": "string"}}
        for path, item in schema.get("paths", {}).items():
            for op in item.values():
                responses = op.get("responses", {})
                if "422" in responses:
                    bad = responses.pop("422")
                    bad["description"] = "Invalid request"
                    responses["400"] = bad
                ok = responses.get("200", {}).setdefault("content", {})
                if path in STREAM_TYPES:  # server-sent events, or NDJSON (Ollama's default)
                    ok[STREAM_TYPES[path]] = {}
                elif path == "/metrics":
                    ok.clear()
                    ok["text/plain"] = text
        app.openapi_schema = schema
    return app.openapi_schema
