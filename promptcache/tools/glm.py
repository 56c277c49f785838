"""GLM-4.5 / 4.6 / 4.7 tool calls: the name, then key/value pairs in tags, one block per call.

    <tool_call>get_weather
    <arg_key>city</arg_key>
    <arg_value>Paris</arg_value>
    <arg_key>days</arg_key>
    <arg_value>3</arg_value>
    </tool_call>

As GLM's template writes them, string values are verbatim and other values JSON; values are
typed back by the tool's JSON schema. Whitespace between the tags is free (GLM-4.7 writes none).
"""

from __future__ import annotations

import json
import re

from .base import ToolCall, read_params, skip_ws, tools_json_lines
from .framing import TextArgsFormat
from .text_values import param_schema, typed_value

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_NAME = re.compile(r"[^\s<]+")
_PAIR = re.compile(r"<arg_key>(.*?)</arg_key>\s*<arg_value>", re.S)
V_CLOSE = "</arg_value>"


class GlmParser(TextArgsFormat):
    name: str = "glm45"
    start_markers: tuple[str, ...] = (OPEN,)
    markers: tuple[str, ...] = (OPEN, CLOSE, "<arg_key>", "</arg_key>", "<arg_value>", V_CLOSE)
    tail: str = CLOSE

    def calls_at(self, text: str, pos: int, tools: list[dict] | None) -> tuple[list[ToolCall], int]:
        name = _NAME.match(text, skip_ws(text, pos))
        if name is None:
            raise ValueError("no function name")
        args, pos = read_params(
            text, name.end(), _PAIR, V_CLOSE,
            lambda key, raw: typed_value(raw, param_schema(tools, name.group(), key)),
        )  # fmt: skip
        pos = skip_ws(text, pos)
        if not text.startswith(CLOSE, pos):
            raise ValueError("no </tool_call>")
        return [ToolCall(name.group(), json.dumps(args))], pos + len(CLOSE)

    def head(self, name: str) -> str:
        return f"{OPEN}{name}\n"

    def param(self, key: str) -> tuple[str, str, str]:
        return f"<arg_key>{key}</arg_key>\n<arg_value>", V_CLOSE, "\n"

    def system_prompt(self, tools: list[dict]) -> str:
        return (
            "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
            f"<tools>\n{tools_json_lines(tools)}\n</tools>\n\nFor each function call, output the "
            f"function name and arguments within the following XML format:\n{OPEN}"
            "{function-name}\n<arg_key>{arg-key-1}</arg_key>\n<arg_value>{arg-value-1}"
            f"</arg_value>\n...\n{CLOSE}\n\nEach result comes back to you inside "
            "<tool_response></tool_response> tags."
        )
