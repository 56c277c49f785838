"""The server's front door, as pure ASGI middleware: request counting, body size, Host, API keys.

Pure ASGI (not Starlette's BaseHTTPMiddleware, which wraps the app in a task and hides client
disconnects): ``request.is_disconnected()`` keeps working for every request kind, so a client
that gives up stops its generation.
"""

from __future__ import annotations

import hashlib
import logging
import os
from collections.abc import Awaitable, Callable, MutableMapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from promptcache.errors import ConfigError
from promptcache.server.errors import ErrorShapes

log = logging.getLogger("promptcache.server")

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

LOOPBACK_HOSTS = frozenset({"127.0.0.1", "localhost", "::1", "[::1]"})
# no key needed: liveness, and the dashboard's static files (its data calls present a key)
OPEN_PATHS = frozenset({"/", "/health"})
OPEN_PREFIXES = ("/dashboard",)


@dataclass(frozen=True, slots=True)
class KeyGrant:
    tenant: str
    is_admin: bool


def digest_key(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def load_api_keys(path: str | None, env: str | None = None) -> dict[str, KeyGrant]:
    """Key digests -> grants from ``--api-keys FILE`` (lines ``KEY TENANT [admin]``, # comments)
    and/or ``PROMPTCACHE_API_KEYS`` (``KEY=TENANT[:admin],...``). Keys are kept only as digests."""
    grants: dict[str, KeyGrant] = {}
    lines: list[list[str]] = []
    if path:
        for raw in Path(path).read_text().splitlines():
            raw = raw.split("#", 1)[0].strip()
            if raw:
                lines.append(raw.split())
    for item in (env if env is not None else os.environ.get("PROMPTCACHE_API_KEYS", "")).split(","):
        if item.strip():
            key, _, rest = item.strip().partition("=")
            tenant, _, flag = rest.partition(":")
            lines.append([key, tenant, flag] if flag else [key, tenant])
    for parts in lines:
        if len(parts) not in (2, 3) or (len(parts) == 3 and parts[2] != "admin") or not parts[1]:
            raise ConfigError(
                "api keys: each entry is KEY TENANT [admin] (file) or KEY=TENANT[:admin]"
            )
        grants[digest_key(parts[0])] = KeyGrant(parts[1], len(parts) == 3)
    return grants


def host_name(host: str) -> str:
    """The name part of a Host header: ``[::1]:8000`` -> ``[::1]``, ``a:80`` -> ``a``."""
    if host.startswith("["):
        return host.split("]", 1)[0] + "]"
    return host.rsplit(":", 1)[0] if host.count(":") == 1 else host


def presented_key(headers: dict[str, str]) -> str | None:
    auth = headers.get("authorization", "")
    if auth.lower().startswith("bearer "):
        return auth[7:].strip()
    return headers.get("x-api-key")


class Guard:
    """Counts every response, refuses oversized bodies (413), foreign Host headers on a loopback
    server (DNS rebinding), and, with API keys, requests without a valid key (401) or reaching
    cross-tenant endpoints without an admin key (403). Sets ``scope["state"]["grant"]``."""

    def __init__(
        self,
        app: Any,
        *,
        count: Callable[[str, int], None],
        max_body_bytes: int,
        api_keys: dict[str, KeyGrant],
        loopback_only: bool,
        errors: ErrorShapes,
        admin_paths: frozenset[str] = frozenset({"/v1/cache/stats", "/metrics"}),
    ) -> None:
        self.app = app
        self.errors = errors
        self.count = count
        self.max_body_bytes = max_body_bytes
        self.api_keys = api_keys
        self.loopback_only = loopback_only
        self.admin_paths = admin_paths

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope["path"]
        status = 500

        async def counted_send(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            refusal = self._refusal(scope)
            if refusal is not None:
                code, message, headers = refusal
                log.warning("%s %s -> %d: %s", scope["method"], path, code, message)
                response = self.errors.response(path, code, message)
                response.headers.update(headers)
                await response(scope, receive, counted_send)
                return
            await self.app(scope, self._limited(receive), counted_send)
        finally:
            self.count(path, status)

    def _refusal(self, scope: Scope) -> tuple[int, str, dict[str, str]] | None:
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        if self.loopback_only:
            host = host_name(headers.get("host", ""))
            if host and host not in LOOPBACK_HOSTS:
                return (
                    421,
                    f"Host {host!r} is not served here (this server listens on loopback only)",
                    {},
                )
        length = headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > self.max_body_bytes:
            return (
                413,
                f"the request body has {int(length)} bytes; the limit is {self.max_body_bytes} (--max-body-bytes)",
                {},
            )
        tenants = [v for k, v in scope["headers"] if k.lower() == b"x-promptcache-tenant"]
        if len(tenants) > 1:
            return 400, "x-promptcache-tenant given more than once", {}
        path = scope["path"]
        if not self.api_keys or path in OPEN_PATHS or path.startswith(OPEN_PREFIXES):
            return None
        key = presented_key(headers)
        grant = self.api_keys.get(digest_key(key)) if key else None
        if grant is None:
            why = "a valid API key is required" if key is None else "invalid API key"
            return (
                401,
                f"{why} (Authorization: Bearer KEY or x-api-key)",
                {"www-authenticate": "Bearer"},
            )
        if scope["path"] in self.admin_paths and not grant.is_admin:
            return 403, "this endpoint shows every tenant's figures: it needs an admin key", {}
        scope.setdefault("state", {})["grant"] = grant
        return None

    def _limited(self, receive: Receive) -> Receive:
        """Bodies without a Content-Length (chunked) are counted as they arrive."""
        seen = 0

        async def wrapped() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_body_bytes:
                    raise BodyTooLarge(self.max_body_bytes)
            return message

        return wrapped


class BodyTooLarge(Exception):
    def __init__(self, limit: int) -> None:
        super().__init__(f"the request body is over the limit of {limit} bytes (--max-body-bytes)")


class CatchAll:
    """Any exception no handler answered becomes a 500 in the API's error shape (never
    Starlette's bare text), logged once with its traceback. A response already started (a
    stream) cannot change its status: the stream ends, and its own code reports the error."""

    def __init__(self, app: Any, *, errors: ErrorShapes) -> None:
        self.app = app
        self.errors = errors

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        is_started = False

        async def watched_send(message: Message) -> None:
            nonlocal is_started
            is_started = is_started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, watched_send)
        except Exception as exc:
            path = scope["path"]
            log.error("%s %s failed: %r", scope.get("method", ""), path, exc, exc_info=exc)
            if is_started:
                return
            message = f"the server failed to serve this request ({type(exc).__name__}); see its log"
            await self.errors.response(path, 500, message)(scope, receive, send)
