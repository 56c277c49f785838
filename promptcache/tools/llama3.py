"""Llama 3.1 / 3.2 JSON tool calls: a bare JSON object, optionally after <|python_tag|>.

    <|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}

"arguments" is accepted in place of "parameters". Several calls in a row are separated by ";"
and/or whitespace. There is no closing marker, so any "{" may open a call: a JSON object that
is not call-shaped is skipped whole (a call nested inside it is not a call), and stays text.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from .base import (
    ParsedReply,
    ToolCall,
    canonical,
    cut_calls,
    decode_json,
    dump,
    grammar_of_calls,
    join_content,
    make_call,
    skip_ws,
    tool_functions,
    tools_json_lines,
)

TAG = "<|python_tag|>"
_KEYS = {"name", "parameters", "arguments", "type", "id"}


def _as_call(value: Any) -> ToolCall | None:
    # Strict shape: with no closing marker, an answer that happens to be JSON must stay text.
    if not isinstance(value, dict) or not value.keys() <= _KEYS or "name" not in value:
        return None
    if ("parameters" in value) == ("arguments" in value) or value.get(
        "type", "function"
    ) != "function":
        return None
    return make_call(value["name"], value.get("parameters", value.get("arguments")))


class Llama3JsonParser:
    name: str = "llama3_json"
    start_markers: tuple[str, ...] = (TAG, "{")
    template_args: str = "mapping"
    markers: tuple[str, ...] = ()

    def _run(self, text: str, pos: int) -> tuple[list[ToolCall], int]:
        """The calls in a row starting at pos and the index just past the last one."""
        calls: list[ToolCall] = []
        end = pos
        while (decoded := decode_json(text, pos)) and (call := _as_call(decoded[0])):
            calls.append(call)
            end = decoded[1]
            pos = skip_ws(text, end)
            if text.startswith(";", pos):
                pos = skip_ws(text, pos + 1)
        return calls, end

    def parse(self, text: str, tools: list[dict] | None = None) -> ParsedReply:
        spans: list[tuple[int, int]] = []
        calls: list[ToolCall] = []
        pos = 0
        while True:
            starts = [i for i in (text.find(TAG, pos), text.find("{", pos)) if i >= 0]
            if not starts:
                break
            start = min(starts)
            tagged = text.startswith(TAG, start)
            body = skip_ws(text, start + len(TAG)) if tagged else start
            run, end = self._run(text, body)
            if run:
                spans.append((start, end))
                calls += run
                pos = end
            elif tagged:
                pos = start + len(TAG)
            else:
                decoded = decode_json(text, start)
                pos = decoded[1] if decoded else start + 1
        return ParsedReply(cut_calls(text, spans), calls)

    def render(self, content: str, calls: list[ToolCall]) -> str:
        body = "; ".join(
            f'{{"name": {dump(c.name)}, "parameters": {canonical(c.arguments)}}}' for c in calls
        )
        return join_content((content, body))

    def call_grammar(
        self,
        tools: list[dict],
        name: str | None = None,
        parallel: bool = True,
        special_tokens: Mapping[str, int] | None = None,
    ) -> str:
        def around(fname: str) -> tuple[str, str]:
            return f'{{"name": {dump(fname)}, "parameters": ', "}"

        return grammar_of_calls(tool_functions(tools, name), around, "; ", parallel, special_tokens)

    def system_prompt(self, tools: list[dict]) -> str:
        return (
            "You have access to the functions below. To call one, reply with only a JSON object "
            'of the form {"name": function name, "parameters": object of argument names and '
            'values}; separate several calls with "; ". Do not use variables.\n\n'
            f"{tools_json_lines(tools)}\n\nEach result comes back to you in a message from the "
            "ipython (tool) role."
        )
