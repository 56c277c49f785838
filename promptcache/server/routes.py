"""How an API module declares its routes: a ``ROUTES`` tuple of ``ApiRoute``s, which ``app.py``
adds from its one list of API modules (with the metrics' endpoint labels and the OpenAPI
stream types read from the same routes). A new API is its module and one entry in that list."""

from __future__ import annotations

import inspect
import re
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from fastapi import Request

from promptcache.server.state import ServerState

SSE = "text/event-stream"
NDJSON = "application/x-ndjson"  # Ollama streams: one JSON object a line


@dataclass(frozen=True, slots=True)
class ApiRoute:
    """``handler(state, request[, body], **path_params)``: ``body`` is the validated JSON body
    (FastAPI: a 4xx naming the field otherwise), the path's ``{name}`` parameters are strings."""

    path: str
    handler: Callable[..., Awaitable[Any]]
    body: type | None = None
    methods: tuple[str, ...] = ("POST",)
    streams: str | None = None  # the media type of its streamed answer (OpenAPI)
    errors: dict[int | str, dict[str, Any]] | None = None  # documented error statuses
    doc: str | None = None  # its description in the OpenAPI schema

    @property
    def path_params(self) -> list[str]:
        return re.findall(r"{(\w+)(?::\w+)?}", self.path)


def endpoint(state: ServerState, route: ApiRoute) -> Callable[..., Awaitable[Any]]:
    """The FastAPI endpoint of a route: its signature names the request, the path parameters
    and the body's model (FastAPI reads them from it), and it calls the handler with ``state``."""

    async def call(request: Request, **kwargs: Any) -> Any:
        body = (kwargs.pop("body"),) if route.body is not None else ()
        return await route.handler(state, request, *body, **kwargs)

    kw = inspect.Parameter.KEYWORD_ONLY
    params = [inspect.Parameter("request", kw, annotation=Request)]
    params += [inspect.Parameter(name, kw, annotation=str) for name in route.path_params]
    if route.body is not None:
        params.append(inspect.Parameter("body", kw, annotation=route.body))
    call.__signature__ = inspect.Signature(params)  # type: ignore[attr-defined]
    call.__name__ = call.__qualname__ = route.handler.__name__
    call.__doc__ = route.doc
    return call
