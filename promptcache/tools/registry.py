"""Parsers by name, and which format a chat template teaches."""

from __future__ import annotations

import re
from collections.abc import Callable

from .base import ToolCallParser
from .hermes import HermesParser
from .llama3 import Llama3JsonParser
from .mistral import MistralParser

_PARSERS: dict[str, Callable[[], ToolCallParser]] = {
    "hermes": HermesParser,
    "llama3_json": Llama3JsonParser,
    "mistral": MistralParser,
    "mistral_args": lambda: MistralParser(style="args"),
}
_USES_TOOLS = re.compile(r"\btools\b")


def parser_names() -> list[str]:
    return list(_PARSERS)


def make_parser(name: str) -> ToolCallParser:
    try:
        return _PARSERS[name]()
    except KeyError:
        raise ValueError(
            f"unknown tool-call format {name!r}; known: {', '.join(_PARSERS)}"
        ) from None


def detect_format(chat_template: str | None) -> tuple[str, bool]:
    """(format name, whether the template has a native tools section) for a Jinja chat template.

    A template that does not mention `tools`, or teaches a format not known here, gives
    ("hermes", False): the server then puts hermes' system_prompt(tools) in the system message.
    """
    t = chat_template or ""
    if not _USES_TOOLS.search(t):
        return "hermes", False
    if "[TOOL_CALLS]" in t or "[AVAILABLE_TOOLS]" in t:
        return ("mistral_args" if "[ARGS]" in t else "mistral"), True
    if "<tool_call>" in t:
        return "hermes", True
    if "<|python_tag|>" in t or "ipython" in t or '"parameters"' in t:
        return "llama3_json", True
    return "hermes", False
