"""Mistral tool calls, in either of two styles after the [TOOL_CALLS] marker:

    [TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}, "id": "a1b2c3d4e"}]
    [TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}

The first (v3 tokenizer: Mistral-7B-Instruct-v0.3, Nemo) holds a JSON list of calls, ids ignored;
the second (v11+: Mistral Small 3.2, Magistral, Devstral) one call per marker, optionally with
[CALL_ID]id before [ARGS]. render and call_grammar write the style given to the constructor.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any, Literal

from .base import (
    ParsedReply,
    ToolCall,
    canonical,
    decode_json,
    dump,
    grammar_of_calls,
    join_content,
    make_call,
    parse_blocks,
    skip_ws,
    tool_functions,
    tools_json_lines,
)

MARKER = "[TOOL_CALLS]"
_NAMED = re.compile(r"([A-Za-z0-9_.\-]+)(?:\[CALL_ID\][A-Za-z0-9_\-]*)?\[ARGS\]")


def _as_call(value: Any) -> ToolCall | None:
    if not isinstance(value, dict) or "arguments" not in value:
        return None
    return make_call(value.get("name"), value["arguments"])


class MistralParser:
    name: str = "mistral"
    start_markers: tuple[str, ...] = (MARKER,)
    template_args: str = "mapping"
    markers: tuple[str, ...] = (MARKER, "[ARGS]")

    def __init__(self, style: Literal["list", "args"] = "list") -> None:
        self.style = style

    def _calls_at(self, text: str, pos: int) -> tuple[list[ToolCall], int] | None:
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

    def parse(self, text: str, tools: list[dict] | None = None) -> ParsedReply:
        # if what follows a marker is malformed, the marker stays as text
        return parse_blocks(text, MARKER, self._calls_at)

    def render(self, content: str, calls: list[ToolCall]) -> str:
        if not calls:
            body = ""
        elif self.style == "list":
            items = (
                f'{{"name": {dump(c.name)}, "arguments": {canonical(c.arguments)}}}' for c in calls
            )
            body = MARKER + "[" + ", ".join(items) + "]"
        else:
            body = "".join(f"{MARKER}{c.name}[ARGS]{canonical(c.arguments)}" for c in calls)
        return join_content((content, body))

    def call_grammar(
        self,
        tools: list[dict],
        name: str | None = None,
        parallel: bool = True,
        special_tokens: Mapping[str, int] | None = None,
    ) -> str:
        funcs = tool_functions(tools, name)
        if self.style == "args":
            return grammar_of_calls(
                funcs, lambda n: (f"{MARKER}{n}[ARGS]", ""), "", parallel, special_tokens
            )

        def around(fname: str) -> tuple[str, str]:
            return f'{{"name": {dump(fname)}, "arguments": ', "}"

        return grammar_of_calls(
            funcs, around, ", ", parallel, special_tokens, prefix=MARKER + "[", suffix="]"
        )

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
