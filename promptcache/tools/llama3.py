"""Llama 3.1 / 3.2 JSON tool calls: a bare JSON object, optionally after <|python_tag|>.

    <|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}

"arguments" is accepted in place of "parameters". Several calls in a row are separated by ";"
and/or whitespace. There is no closing marker, so any "{" may open a call: a JSON object that
is not call-shaped is skipped whole (a call nested inside it is not a call), and stays text.
"""

from __future__ import annotations

from typing import Any

from .base import (
    ParsedReply,
    ToolCall,
    cut_calls,
    decode_json,
    dump,
    make_call,
    skip_ws,
    tools_json_lines,
)
from .framing import JsonArgsFormat

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


class Llama3JsonParser(JsonArgsFormat):
    name: str = "llama3_json"
    start_markers: tuple[str, ...] = (TAG, "{")
    markers: tuple[str, ...] = ()
    call_sep: str = "; "

    def calls_at(
        self, text: str, pos: int, tools: list[dict] | None = None
    ) -> tuple[list[ToolCall], int] | None:
        """The calls in a row starting at pos and the index just past the last one, or None."""
        calls: list[ToolCall] = []
        end = pos
        while (decoded := decode_json(text, pos)) and (call := _as_call(decoded[0])):
            calls.append(call)
            end = decoded[1]
            pos = skip_ws(text, end)
            if text.startswith(";", pos):
                pos = skip_ws(text, pos + 1)
        return (calls, end) if calls else None

    def parse(self, text: str, tools: list[dict] | None = None) -> ParsedReply:
        # no closing marker: a call may start at the tag or at any "{"
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
            if run := self.calls_at(text, body):
                spans.append((start, run[1]))
                calls += run[0]
                pos = run[1]
            elif tagged:
                pos = start + len(TAG)
            else:
                decoded = decode_json(text, start)
                pos = decoded[1] if decoded else start + 1
        return ParsedReply(cut_calls(text, spans), calls)

    def around(self, name: str) -> tuple[str, str]:
        return f'{{"name": {dump(name)}, "parameters": ', "}"

    def system_prompt(self, tools: list[dict]) -> str:
        return (
            "You have access to the functions below. To call one, reply with only a JSON object "
            'of the form {"name": function name, "parameters": object of argument names and '
            'values}; separate several calls with "; ". Do not use variables.\n\n'
            f"{tools_json_lines(tools)}\n\nEach result comes back to you in a message from the "
            "ipython (tool) role."
        )
