"""Qwen3-Coder / Qwen3.5 / Qwen3.6 / Qwen3-Next tool calls: XML with one element per parameter.

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    <parameter=days>
    3
    </parameter>
    </function>
    </tool_call>

Values are text: a string parameter is taken verbatim (one newline trimmed on each side), other
types are parsed by the tool's JSON schema (numbers, booleans, null, objects and arrays as JSON).
Parallel calls are several blocks in a row.
"""

from __future__ import annotations

import json
import re

from .base import ToolCall, read_params, skip_ws, tools_json_lines
from .framing import TextArgsFormat
from .text_values import param_schema, typed_value

OPEN, CLOSE = "<tool_call>", "</tool_call>"
P_CLOSE = "</parameter>"
_FUNC = re.compile(r"<function=([^>\n]+)>")
_PARAM = re.compile(r"<parameter=([^>\n]+)>")


def _value(raw: str) -> str:
    """The text between a parameter's tags, less the newline the format writes on each side."""
    raw = raw[1:] if raw.startswith("\n") else raw
    return raw[:-1] if raw.endswith("\n") else raw


class QwenXmlParser(TextArgsFormat):
    name: str = "qwen3_xml"
    start_markers: tuple[str, ...] = (OPEN,)
    markers: tuple[str, ...] = (OPEN, CLOSE)
    tail: str = f"</function>\n{CLOSE}"

    def calls_at(self, text: str, pos: int, tools: list[dict] | None) -> tuple[list[ToolCall], int]:
        """The call (as [call]) whose body starts at pos (just past OPEN), the index past its CLOSE;
        raises ValueError when it is not well formed."""
        func = _FUNC.match(text, skip_ws(text, pos))
        if func is None:
            raise ValueError("no <function=...>")
        name = func.group(1).strip()
        args, pos = read_params(
            text, func.end(), _PARAM, P_CLOSE,
            lambda key, raw: typed_value(_value(raw), param_schema(tools, name, key)),
        )  # fmt: skip
        pos = skip_ws(text, pos)
        if not text.startswith("</function>", pos):
            raise ValueError("no </function>")
        pos = skip_ws(text, pos + len("</function>"))
        if not text.startswith(CLOSE, pos) or not name:
            raise ValueError("no </tool_call>")
        return [ToolCall(name, json.dumps(args))], pos + len(CLOSE)

    def head(self, name: str) -> str:
        return f"{OPEN}\n<function={name}>\n"

    def param(self, key: str) -> tuple[str, str, str]:
        return f"<parameter={key}>\n", "\n" + P_CLOSE, "\n"

    def system_prompt(self, tools: list[dict]) -> str:
        return (
            "# Tools\n\nYou have access to the following functions:\n\n<tools>\n"
            f"{tools_json_lines(tools)}\n</tools>\n\nTo call a function, reply in this format:\n"
            f"{OPEN}\n<function=example_function_name>\n<parameter=example_parameter>\nvalue\n"
            f"{P_CLOSE}\n...\n</function>\n{CLOSE}\n\nEach result comes back to you inside "
            "<tool_response></tool_response> tags."
        )
