"""Sessions at the HTTP edge: which session a request belongs to, its TTL hint, and the
deletion endpoints.

The session id comes from, first match wins: the ``x-promptcache-session`` header; OpenAI's
``prompt_cache_key``, then ``user``; Anthropic's ``metadata.user_id``. It lives inside the
request's tenant (with API keys: the key's tenant), so a tenant can only ever name, and delete,
its own sessions. TTL hints: Anthropic ``cache_control: {"type": "ephemeral", "ttl": "5m"|"1h"}``
on system, message and tool blocks; the longest of the request applies to every block it touches.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import Request

from promptcache.core.sessions import TTL_HINTS, longer_ttl
from promptcache.engines.base import RequestError
from promptcache.server.schemas.anthropic import MessagesRequest
from promptcache.server.state import ServerState

SESSION_HEADER = "x-promptcache-session"


def session_of(request: Request, *fields: Any) -> str:
    """The request's session id (``""``: none): the header, else the first non-empty field."""
    values = request.headers.getlist(SESSION_HEADER)
    if len(values) > 1:
        raise RequestError(f"{SESSION_HEADER} given more than once")
    candidates = [*values, *fields]
    # any length is accepted (a long id is tagged by its digest, ``core.sessions.session_key``)
    return next((str(v) for v in candidates if isinstance(v, str | int) and str(v)), "")


def _ttl_of(block: Any) -> float | None:
    control = block.get("cache_control") if isinstance(block, dict) else None
    if not isinstance(control, dict):
        return None
    if control.get("type") != "ephemeral":
        return None  # unknown kinds were always accepted and ignored: still no 400
    # Anthropic's default lifetime is 5 minutes; an unknown TTL is no hint either
    return TTL_HINTS.get(str(control.get("ttl", "5m")))


def ttl_hint(req: MessagesRequest) -> float | None:
    """The longest ``cache_control`` TTL of the request's blocks (None: no hint)."""
    blocks: list[Any] = []
    if isinstance(req.system, list):
        blocks += [b.model_dump() for b in req.system]
    for m in req.messages:
        if isinstance(m.content, list):
            blocks += m.content
            for b in m.content:  # tool results hold blocks of their own
                inner = b.get("content")
                if isinstance(inner, list):
                    blocks += inner
    blocks += [t.model_dump() for t in req.tools or ()]
    return _longest(_ttl_of(b) for b in blocks)


def _longest(ttls: Iterable[float | None]) -> float | None:
    out: float | None = None
    for t in ttls:
        out = longer_ttl(out, t)
    return out


def _check_cache(state: ServerState) -> None:
    if state.sessions.blocks is None:
        raise StarletteHTTPException(404, "the prompt cache is off on this server")


async def delete_session(
    state: ServerState, request: Request, session_id: str, force: bool
) -> dict[str, Any]:
    """Every block only this session (of the caller's tenant) uses, in every tier."""
    if not session_id:
        raise RequestError("a session id is needed")
    tenant = state.tenant_of(request)
    _check_cache(state)
    deletion = await run_in_threadpool(state.sessions.delete, tenant, session_id, force)
    return {"session": session_id, "tenant": tenant, "force": force, **deletion.to_dict()}


async def delete_tenant(state: ServerState, request: Request, tenant: str) -> dict[str, Any]:
    """Every block of a tenant, in every tier: with API keys, for an admin key only."""
    grant = request.scope.get("state", {}).get("grant")
    if grant is not None and not grant.is_admin:
        raise StarletteHTTPException(403, "deleting a tenant's cache needs an admin key")
    _check_cache(state)
    deletion = await run_in_threadpool(state.sessions.delete, tenant, None, True)
    return {"tenant": tenant, **deletion.to_dict()}
