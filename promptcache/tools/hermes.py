"""Hermes / Qwen2.5 / Qwen3 tool calls: one JSON object per <tool_call> block.

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

Parallel calls are several blocks in a row. The closing tag is found after the JSON object, not
by searching, so a string argument that contains "</tool_call>" does not cut the call short.
"""

from __future__ import annotations

from collections.abc import Mapping

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

OPEN, CLOSE = "<tool_call>", "</tool_call>"


class HermesParser:
    name: str = "hermes"
    start_markers: tuple[str, ...] = (OPEN,)
    template_args: str = "mapping"
    markers: tuple[str, ...] = (OPEN, CLOSE)

    def _call_at(self, text: str, pos: int) -> tuple[list[ToolCall], int] | None:
        decoded = decode_json(text, skip_ws(text, pos))
        if decoded is None or not isinstance(decoded[0], dict):
            return None
        obj, end = decoded
        args = obj.get("arguments", obj.get("parameters", {}))  # a no-argument call may omit them
        call = make_call(obj.get("name"), args)
        end = skip_ws(text, end)
        if call is None or not text.startswith(CLOSE, end):
            return None
        return [call], end + len(CLOSE)

    def parse(self, text: str, tools: list[dict] | None = None) -> ParsedReply:
        # if a block is malformed, the tag stays as text
        return parse_blocks(text, OPEN, self._call_at)

    def render(self, content: str, calls: list[ToolCall]) -> str:
        blocks = "\n".join(
            f'{OPEN}\n{{"name": {dump(c.name)}, "arguments": {canonical(c.arguments)}}}\n{CLOSE}'
            for c in calls
        )
        return join_content((content, blocks))

    def call_grammar(
        self,
        tools: list[dict],
        name: str | None = None,
        parallel: bool = True,
        special_tokens: Mapping[str, int] | None = None,
    ) -> str:
        def around(fname: str) -> tuple[str, str]:
            return f'{OPEN}\n{{"name": {dump(fname)}, "arguments": ', f"}}\n{CLOSE}"

        return grammar_of_calls(tool_functions(tools, name), around, "\n", parallel, special_tokens)

    def system_prompt(self, tools: list[dict]) -> str:
        return (
            "# Tools\n\nYou can call the functions below to help answer the user. Their JSON "
            f"signatures are inside <tools></tools> tags:\n<tools>\n{tools_json_lines(tools)}\n"
            "</tools>\n\nTo call a function, write a JSON object with its name and arguments "
            f"inside {OPEN}{CLOSE} tags, one block per call:\n{OPEN}\n"
            '{"name": <function-name>, "arguments": <args-json-object>}\n'
            f"{CLOSE}\n\nEach result comes back to you inside <tool_response></tool_response> tags."
        )
