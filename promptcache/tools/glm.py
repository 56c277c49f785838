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
from collections.abc import Mapping

from .base import (
    ParsedReply,
    ToolCall,
    grammar_of_values,
    join_content,
    param_schema,
    parse_blocks,
    read_params,
    skip_ws,
    text_value,
    tool_functions,
    tools_json_lines,
    typed_value,
)

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_NAME = re.compile(r"[^\s<]+")
_PAIR = re.compile(r"<arg_key>(.*?)</arg_key>\s*<arg_value>", re.S)
V_CLOSE = "</arg_value>"


class GlmParser:
    name: str = "glm45"
    start_markers: tuple[str, ...] = (OPEN,)
    markers: tuple[str, ...] = (OPEN, CLOSE, "<arg_key>", "</arg_key>", "<arg_value>", V_CLOSE)
    template_args: str = "mapping"

    def _call_at(self, text: str, pos: int, tools: list[dict] | None) -> tuple[list[ToolCall], int]:
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

    def parse(self, text: str, tools: list[dict] | None = None) -> ParsedReply:
        return parse_blocks(text, OPEN, lambda t, p: self._call_at(t, p, tools))

    def render(self, content: str, calls: list[ToolCall]) -> str:
        blocks = "\n".join(_block(c.name, json.loads(c.arguments)) for c in calls)
        return join_content((content, blocks))

    def call_grammar(
        self,
        tools: list[dict],
        name: str | None = None,
        parallel: bool = True,
        special_tokens: Mapping[str, int] | None = None,
    ) -> str:
        return grammar_of_values(
            tool_functions(tools, name),
            head=lambda n: f"{OPEN}{n}\n",
            param=lambda k: (f"<arg_key>{k}</arg_key>\n<arg_value>", V_CLOSE, "\n"),
            tail=CLOSE,
            sep="\n",
            parallel=parallel,
            special=special_tokens,
        )

    def system_prompt(self, tools: list[dict]) -> str:
        return (
            "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
            f"<tools>\n{tools_json_lines(tools)}\n</tools>\n\nFor each function call, output the "
            f"function name and arguments within the following XML format:\n{OPEN}"
            "{function-name}\n<arg_key>{arg-key-1}</arg_key>\n<arg_value>{arg-value-1}"
            f"</arg_value>\n...\n{CLOSE}\n\nEach result comes back to you inside "
            "<tool_response></tool_response> tags."
        )


def _block(name: str, args: dict) -> str:
    pairs = "".join(
        f"<arg_key>{k}</arg_key>\n<arg_value>{text_value(v)}{V_CLOSE}\n" for k, v in args.items()
    )
    return f"{OPEN}{name}\n{pairs}{CLOSE}"
