"""The FastAPI application: routes and error shapes (the front door is ``guard.py``)."""

from __future__ import annotations

import inspect
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
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
from promptcache.server.errors import describe_validation, error_response, is_anthropic_path
from promptcache.server.guard import BodyTooLarge, CatchAll, Guard
from promptcache.server.schemas import (
    ChatCompletionRequest,
    CompletionRequest,
    CountTokensRequest,
    MessagesRequest,
    OllamaChatRequest,
    OllamaGenerateRequest,
    OllamaShowRequest,
    ResponsesRequest,
)
from promptcache.server.state import QueueFullError, ServerState
from promptcache.server.streaming import cancel_all

log = logging.getLogger("promptcache.server")

ENDPOINTS = (
    "/v1/chat/completions",
    "/v1/completions",
    "/v1/messages",
    "/v1/messages/count_tokens",
    "/v1/responses",
    "/v1/models",
    "/api/chat",
    "/api/generate",
    "/api/tags",
    "/api/show",
    "/api/version",
    "/api/ps",
    "/v1/cache/stats",
    "/v1/cache/requests",
    "/dashboard",
    "/health",
    "/metrics",
)


STREAMING_PATHS = ("/v1/chat/completions", "/v1/completions", "/v1/messages", "/v1/responses")
NDJSON_PATHS = ("/api/chat", "/api/generate")  # Ollama streams: one JSON object a line
DASHBOARD_ASSETS = {"dashboard.js": "text/javascript", "dashboard.css": "text/css"}


def dashboard_file(name: str) -> str:
    return (resources.files("promptcache.server") / "dashboard" / name).read_text("utf-8")


def body_route(
    state: ServerState, handler: Callable[..., Awaitable[Any]], body_model: type
) -> Callable[..., Awaitable[Any]]:
    """An endpoint taking ``body_model`` as its JSON body (FastAPI validates it: a 4xx with the
    field otherwise) that returns ``handler(state, request, body)``."""

    async def endpoint(request: Request, body: Any) -> Any:
        return await handler(state, request, body)

    # FastAPI reads the body's model from the signature: this route's model, not Any
    params = inspect.signature(endpoint).parameters
    endpoint.__signature__ = inspect.Signature(  # type: ignore[attr-defined]
        [
            params["request"].replace(annotation=Request),
            params["body"].replace(annotation=body_model),
        ]
    )
    endpoint.__name__ = endpoint.__qualname__ = handler.__name__
    return endpoint


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
    app.add_middleware(CatchAll)  # inside Guard: its 500s are counted like any response
    app.add_middleware(
        Guard,
        count=count,
        max_body_bytes=limits.max_body_bytes,
        api_keys=limits.api_keys,
        loopback_only=limits.loopback_only,
    )

    def reject(request: Request, status: int, message: str, **extra: Any) -> JSONResponse:
        log.warning("%s %s -> %d: %s", request.method, request.url.path, status, message)
        return error_response(request.url.path, status, message, **extra)

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
        if is_anthropic_path(request.url.path):
            message = f"prompt is too long: {exc.num_tokens} tokens > {exc.max_context} maximum"
            if exc.max_tokens:  # --strict-max-tokens: the prompt fits, the output does not
                message = (
                    f"input length and `max_tokens` exceed context limit: {exc.num_tokens} + "
                    f"{exc.max_tokens} > {exc.max_context}, decrease input length or "
                    "`max_tokens` and try again"
                )
            return reject(request, 400, message)
        message = str(exc)
        if not message.startswith("This model's"):
            message = (
                f"This model's maximum context length is {exc.max_context} tokens. However, your "
                f"messages resulted in {exc.num_tokens} tokens. Please reduce the length of the "
                "messages."
            )
        return reject(request, 400, message, param="messages", code="context_length_exceeded")

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
        return error_response(request.url.path, 500, message)

    @app.api_route("/", methods=["GET", "HEAD"])
    async def root() -> Any:  # Claude Code probes the base URL with HEAD / before each run
        return {"status": "ok", "model": state.model_id}

    # the generation APIs: a validated body, handed to its API module with the request; the
    # Ollama API serves Open WebUI, Continue and IDE plugins
    for path, handler, body_model in (
        ("/v1/chat/completions", openai_api.chat_completions, ChatCompletionRequest),
        ("/v1/completions", openai_api.completions, CompletionRequest),
        ("/v1/messages", anthropic_api.messages, MessagesRequest),
        ("/v1/messages/count_tokens", anthropic_api.count_tokens, CountTokensRequest),
        ("/v1/responses", responses_api.create, ResponsesRequest),
        ("/api/chat", ollama_api.chat, OllamaChatRequest),
        ("/api/generate", ollama_api.generate, OllamaGenerateRequest),
    ):
        app.post(path)(body_route(state, handler, body_model))

    # one route for both methods, so a 405 names both in Allow
    @app.api_route(
        "/v1/responses/{response_id}",
        methods=["GET", "DELETE"],
        responses={404: {"description": "No such stored response for this tenant"}},
    )
    async def stored_response(request: Request, response_id: str) -> Any:
        """A stored response (``store`` was not false) of the caller's tenant: GET returns it,
        DELETE removes it."""
        if request.method == "DELETE":
            return await responses_api.delete(state, request, response_id)
        return await responses_api.get(state, request, response_id)

    @app.get("/v1/models")
    async def models(request: Request) -> Any:
        """The served model with its context length, engine and capabilities (OpenAI's list
        and Anthropic's page in one body)."""
        return models_api.list_models(state, "anthropic-version" in request.headers)

    @app.get("/v1/models/{model_id:path}")
    async def model(request: Request, model_id: str) -> Any:
        """Any id names the served model (requests are served whatever ``model`` says)."""
        return models_api.model_card(state, model_id, "anthropic-version" in request.headers)

    @app.get("/api/tags")
    async def ollama_tags() -> Any:
        return ollama_api.tags(state)

    @app.post("/api/show")
    async def ollama_show(body: OllamaShowRequest) -> Any:
        return ollama_api.show(state, body)

    @app.get("/api/ps")
    async def ollama_ps() -> Any:
        return ollama_api.ps(state)

    @app.get("/api/version")
    async def ollama_version() -> Any:
        return ollama_api.version()

    @app.get("/health")
    async def health() -> Any:
        return {
            "status": "ok",
            "model": state.model_id,
            "engine": state.engine.name,
            "cache": bool(state.cache_stats()),
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
            state.metrics.render(state.cache_stats(), state.records),
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
                if path in STREAMING_PATHS:  # "stream": true answers with server-sent events
                    ok["text/event-stream"] = {}
                elif path in NDJSON_PATHS:  # streamed by default
                    ok["application/x-ndjson"] = {}
                elif path == "/metrics":
                    ok.clear()
                    ok["text/plain"] = text
        app.openapi_schema = schema
    return app.openapi_schema
