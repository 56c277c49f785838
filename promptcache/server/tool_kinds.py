"""Tools a request offers that this server cannot run: set aside, never a 400.

Hosted tools (the API vendor runs them: web search, code interpreter, MCP connectors, Claude's
server tools...) and tool kinds nobody has seen before are left out of the prompt; the client's
session goes on with the tools it runs itself. Each kind is named once in the log (per API) and
in every response that set it aside, in the ``x-promptcache-ignored-tools`` header.
"""

from __future__ import annotations

import logging
import re
from typing import Any

from promptcache.engines.base import RequestError

log = logging.getLogger("promptcache.server")

IGNORED_TOOLS_HEADER = "x-promptcache-ignored-tools"
_HEADER_SAFE = re.compile(r"[A-Za-z0-9_.:-]{1,64}")
_logged: set[tuple[str, str]] = set()


def set_aside(api: str, kind: str, ignored: list[str]) -> None:
    """Record that a tool of ``kind`` was left out of the prompt (logged once per api and kind)."""
    ignored.append(kind)
    if (api, kind) not in _logged:
        _logged.add((api, kind))
        log.warning(
            "%s: %r tools are not run by this server: left out of the prompt (said in the %s "
            "header)",
            api, kind, IGNORED_TOOLS_HEADER,
        )  # fmt: skip


def ignored_header(ignored: list[str] | tuple[str, ...]) -> dict[str, str]:
    """The response header naming the kinds set aside (none when nothing was)."""
    return names_header(IGNORED_TOOLS_HEADER, ignored)


def names_header(header: str, names: list[str] | tuple[str, ...]) -> dict[str, str]:
    """``header`` listing ``names`` (sorted, once each) that can go in a header: a client's name
    outside Latin-1 or with a CR/LF would fail the response; those are left out (logged by the
    caller). Empty when none is left."""
    safe = sorted({n for n in names if _HEADER_SAFE.fullmatch(n)})
    return {header: ",".join(safe)} if safe else {}


def function_tools(tools: list[Any] | None, api: str) -> tuple[list[dict[str, Any]], list[str]]:
    """The function tools of an OpenAI-shaped ``tools`` list, and the kinds set aside (hosted
    ones, ``custom``, kinds nobody has seen); a nameless function tool is a 400."""
    out: list[dict[str, Any]] = []
    ignored: list[str] = []
    for tool in tools or []:
        kind = tool.get("type", "function") if isinstance(tool, dict) else None
        if kind != "function":
            set_aside(api, str(kind or "untyped"), ignored)
        elif not isinstance(tool.get("function"), dict) or not tool["function"].get("name"):
            raise RequestError("tools: a function tool is {type: function, function: {name, ...}}")
        else:
            out.append(tool)
    return out, ignored
