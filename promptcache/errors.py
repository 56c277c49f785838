"""Who is to blame when a request fails: the client, the engine, or the configuration.

The server maps each family to its status once (``server/app.py``): a ``RequestError`` is the
client's to fix (400; ``EngineTimeoutError`` 503), an ``EngineFailure`` is a server-side fault
(500, logged), a ``ConfigError`` stops start-up with its message (the CLI exits non-zero, no
traceback). Plain ``ValueError`` from library code is none of these: the server treats it as a
server-side fault, so a bug or a full cache can never pass for a bad request.
"""

from __future__ import annotations


class RequestError(ValueError):
    """The request cannot be served as asked: bad input, too long, a bad grammar (400).

    A ``ValueError`` for callers that validate input with ``except ValueError``; the server
    never maps ``ValueError`` itself to a 400, only this type."""


# the name the engines and server used before the split; kept for callers and tests
EngineError = RequestError


class EngineTimeoutError(RequestError):
    """The request's time budget ran out before its first token (the server answers 503)."""


class PromptTooLongError(RequestError):
    """The prompt (or prompt + the requested output) does not fit the context."""

    def __init__(
        self, message: str, num_tokens: int = 0, max_context: int = 0, max_tokens: int = 0
    ) -> None:
        super().__init__(message)
        self.num_tokens = num_tokens
        self.max_context = max_context
        self.max_tokens = max_tokens  # the output asked for, when that is what does not fit


class EngineFailure(Exception):
    """The engine could not serve a valid request (the server answers 500 and logs it)."""


class CacheSaveError(EngineFailure):
    """The prompt cache refused a save the engine asked for (e.g. one block or checkpoint is
    larger than the whole RAM budget): a configuration the server runs with, not the client's."""


class ConfigError(Exception):
    """The engine cannot be built as configured: unknown engine, bad option, missing library.
    ``promptcache serve``/``bench`` exit with the message and a non-zero status."""
