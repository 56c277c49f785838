"""Error bodies in the shape each API's clients expect."""

from __future__ import annotations

from typing import Any

from fastapi.responses import JSONResponse


def is_anthropic_path(path: str) -> bool:
    return path.startswith("/v1/messages")


def error_response(
    path: str, status: int, message: str, param: str | None = None, code: str | None = None
) -> JSONResponse:
    kind = {
        400: "invalid_request_error",
        401: "authentication_error",
        403: "permission_error",
        404: "not_found_error",
        413: "request_too_large",
        421: "invalid_request_error",
        429: "rate_limit_error",
        503: "overloaded_error",
    }.get(status, "api_error")
    body: dict[str, Any]
    if path.startswith("/api/"):  # Ollama's clients read {"error": message}
        body = {"error": message}
    elif is_anthropic_path(path):
        body = {"type": "error", "error": {"type": kind, "message": message}}
    else:
        body = {"error": {"message": message, "type": kind, "param": param, "code": code}}
    return JSONResponse(body, status_code=status)


def describe_validation(errors: list[dict[str, Any]]) -> tuple[str, str | None]:
    """One readable line from pydantic errors, plus the first offending field."""
    parts = []
    first = None
    for err in errors[:5]:
        loc = ".".join(str(x) for x in err.get("loc", ()) if x != "body")
        first = first or loc or None
        parts.append(f"{loc or 'body'}: {err.get('msg', 'invalid')}")
    return "; ".join(parts), first
