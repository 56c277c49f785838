"""Hermes / Qwen2.5 / Qwen3 tool calls: one JSON object per <tool_call> block.

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

Parallel calls are several blocks in a row. The closing tag is found after the JSON object, not
by searching, so a string argument that contains "</tool_call>" does not cut the call short.
"""

from __future__ import annotations

from .base import ToolCall, decode_json, dump, make_call, skip_ws, tools_json_lines
from .framing import JsonArgsFormat

OPEN, CLOSE = "<tool_call>", "</tool_call>"


class HermesParser(JsonArgsFormat):
    name: str = "hermes"
    start_markers: tuple[str, ...] = (OPEN,)
    markers: tuple[str, ...] = (OPEN, CLOSE)

    def calls_at(
        self, text: str, pos: int, tools: list[dict] | None
    ) -> tuple[list[ToolCall], int] | None:
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

    def around(self, name: str) -> tuple[str, str]:
        return f'{OPEN}\n{{"name": {dump(name)}, "arguments": ', f"}}\n{CLOSE}"

    def system_prompt(self, tools: list[dict]) -> str:
        return (
            "# Tools\n\nYou can call the functions below to help answer the user. Their JSON "
            f"signatures are inside <tools></tools> tags:\n<tools>\n{tools_json_lines(tools)}\n"
            "</tools>\n\nTo call a function, write a JSON object with its name and arguments "
            f"inside {OPEN}{CLOSE} tags, one block per call:\n{OPEN}\n"
            '{"name": <function-name>, "arguments": <args-json-object>}\n'
            f"{CLOSE}\n\nEach result comes back to you inside <tool_response></tool_response> tags."
        )
