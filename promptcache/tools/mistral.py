"""Mistral tool calls, in either of two styles after the [TOOL_CALLS] marker:

    [TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}, "id": "a1b2c3d4e"}]
    [TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}

The first (v3 tokenizer: Mistral-7B-Instruct-v0.3, Nemo) holds a JSON list of calls, ids ignored;
the second (v11+: Mistral Small 3.2, Magistral, Devstral) one call per marker, optionally with
[CALL_ID]id before [ARGS]. render and call_grammar write the style given to the constructor.
"""

from __future__ import annotations

import re
from typing import Any, Literal

from .base import ToolCall, decode_json, dump, make_call, skip_ws, tools_json_lines
from .framing import JsonArgsFormat

MARKER = "[TOOL_CALLS]"
_NAMED = re.compile(r"([A-Za-z0-9_.\-]+)(?:\[CALL_ID\][A-Za-z0-9_\-]*)?\[ARGS\]")


def _as_call(value: Any) -> ToolCall | None:
    if not isinstance(value, dict) or "arguments" not in value:
        return None
    return make_call(value.get("name"), value["arguments"])


class MistralParser(JsonArgsFormat):
    name: str = "mistral"
    start_markers: tuple[str, ...] = (MARKER,)
    markers: tuple[str, ...] = (MARKER, "[ARGS]")

    def __init__(self, style: Literal["list", "args"] = "list") -> None:
        self.style = style
        # list: one JSON list after one marker; args: a marker before each call
        self.call_sep, self.prefix, self.suffix = (
            (", ", MARKER + "[", "]") if style == "list" else ("", "", "")
        )

    def calls_at(
        self, text: str, pos: int, tools: list[dict] | None
    ) -> tuple[list[ToolCall], int] | None:
        """The calls written just after a marker that ends at pos, and where they end."""
        pos = skip_ws(text, pos)
        if text.startswith("[", pos):
            decoded = decode_json(text, pos)
            if decoded is None or not isinstance(decoded[0], list) or not decoded[0]:
                return None
            listed = [_as_call(v) for v in decoded[0]]
            valid = [c for c in listed if c is not None]
            return (valid, decoded[1]) if len(valid) == len(listed) else None
        calls: list[ToolCall] = []
        end = pos
        while match := _NAMED.match(text, end):  # name[ARGS]{...}, possibly several in a row
            args = decode_json(text, match.end())
            call = make_call(match.group(1), args[0]) if args else None
            if args is None or call is None:
                break
            calls.append(call)
            end = args[1]
        return (calls, end) if calls else None

    def around(self, name: str) -> tuple[str, str]:
        if self.style == "args":
            return f"{MARKER}{name}[ARGS]", ""
        return f'{{"name": {dump(name)}, "arguments": ', "}"

    def system_prompt(self, tools: list[dict]) -> str:
        example = (
            '[TOOL_CALLS][{"name": <function-name>, "arguments": <args-json-object>}, ...]'
            if self.style == "list"
            else "[TOOL_CALLS]<function-name>[ARGS]<args-json-object>"
        )
        return (
            "You can call the functions below (JSON signatures):\n"
            f"{tools_json_lines(tools)}\n\nTo call functions, reply with {example}\n"
            "Each result comes back to you between [TOOL_RESULTS] and [/TOOL_RESULTS]."
        )
