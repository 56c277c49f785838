"""Error bodies in the shape each API's clients expect. An API module whose clients read another
shape than OpenAI's declares ``ERRORS`` (an ``ApiErrors``: its path prefix, its body, its
wording of a too-long prompt); ``app.py`` gathers them into one ``ErrorShapes``."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from fastapi.responses import JSONResponse

from promptcache.errors import PromptTooLongError

KINDS = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    421: "invalid_request_error",
    429: "rate_limit_error",
    503: "overloaded_error",
}


def error_kind(status: int) -> str:
    return KINDS.get(status, "api_error")


def openai_body(status: int, message: str, param: str | None, code: str | None) -> dict[str, Any]:
    return {"error": {"message": message, "type": error_kind(status), "param": param, "code": code}}


def openai_too_long(exc: PromptTooLongError) -> tuple[str, dict[str, str]]:
    message = str(exc)
    if not message.startswith("This model's"):
        message = (
            f"This model's maximum context length is {exc.max_context} tokens. However, your "
            f"messages resulted in {exc.num_tokens} tokens. Please reduce the length of the "
            "messages."
        )
    return message, {"param": "messages", "code": "context_length_exceeded"}


@dataclass(frozen=True, slots=True)
class ApiErrors:
    """The error shape of every path under ``prefix``. ``body(status, message, param, code)``:
    the JSON body; ``too_long``: a too-long prompt's message and extra fields, in the wording
    its clients parse (Claude Code compacts on Anthropic's)."""

    prefix: str
    body: Callable[[int, str, str | None, str | None], dict[str, Any]]
    too_long: Callable[[PromptTooLongError], tuple[str, dict[str, str]]] = openai_too_long


OPENAI = ApiErrors("/", openai_body, openai_too_long)


class ErrorShapes:
    """The APIs' error shapes by path prefix (the longest wins; OpenAI's otherwise)."""

    def __init__(self, apis: Iterable[ApiErrors] = ()) -> None:
        self.apis = sorted([*apis, OPENAI], key=lambda a: -len(a.prefix))

    def of(self, path: str) -> ApiErrors:
        return next(a for a in self.apis if path.startswith(a.prefix))

    def response(
        self,
        path: str,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
    ) -> JSONResponse:
        return JSONResponse(self.of(path).body(status, message, param, code), status_code=status)


def describe_validation(errors: list[dict[str, Any]]) -> tuple[str, str | None]:
    """One readable line from pydantic errors, plus the first offending field."""
    parts = []
    first = None
    for err in errors[:5]:
        loc = ".".join(str(x) for x in err.get("loc", ()) if x != "body")
        first = first or loc or None
        parts.append(f"{loc or 'body'}: {err.get('msg', 'invalid')}")
    return "; ".join(parts), first
