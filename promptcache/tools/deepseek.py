"""DeepSeek V3 / R1 and V3.1 / V3.2-Exp tool calls: calls between special markers.

    V3:   <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather
          ```json
          {"city": "Paris"}
          ```<｜tool▁call▁end｜><｜tool▁calls▁end｜>
    V3.1: <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city": "Paris"}<｜tool▁call▁end｜><｜tool▁calls▁end｜>

Both styles are read; render and call_grammar write the constructor's. V3 separates calls with a
newline, V3.1 writes them back to back. DeepSeek's templates concatenate the arguments string,
so history passes arguments as JSON text (template_args "text").
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Literal

from .base import (
    ParsedReply,
    ToolCall,
    canonical,
    decode_json,
    grammar_of_calls,
    make_call,
    parse_blocks,
    skip_ws,
    tool_functions,
    tools_json_lines,
)

BEGIN, END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
CALL, SEP, CALL_END = "<｜tool▁call▁begin｜>", "<｜tool▁sep｜>", "<｜tool▁call▁end｜>"
_V3 = re.compile(r"\s*function\s*" + re.escape(SEP) + r"\s*([^\s`<]+)\s*```(?:json)?\s*")
_V31 = re.compile(r"\s*([^\s<]+?)\s*" + re.escape(SEP) + r"\s*")


class DeepSeekParser:
    start_markers: tuple[str, ...] = (BEGIN,)
    markers: tuple[str, ...] = (BEGIN, END, CALL, SEP, CALL_END)
    template_args: str = "text"

    def __init__(self, style: Literal["v3", "v31"] = "v31") -> None:
        self.style = style
        self.name = "deepseek_v3" if style == "v3" else "deepseek_v31"

    def _call_at(self, text: str, pos: int) -> tuple[ToolCall, int] | None:
        fenced = _V3.match(text, pos)
        head = fenced or _V31.match(text, pos)
        decoded = decode_json(text, head.end()) if head else None
        if head is None or decoded is None:
            return None
        call = make_call(head.group(1), decoded[0])
        end = skip_ws(text, decoded[1])
        if fenced:
            if not text.startswith("```", end):
                return None
            end = skip_ws(text, end + 3)
        if call is None or not text.startswith(CALL_END, end):
            return None
        return call, end + len(CALL_END)

    def _calls_at(self, text: str, pos: int) -> tuple[list[ToolCall], int] | None:
        calls: list[ToolCall] = []
        while text.startswith(CALL, pos := skip_ws(text, pos)):
            found = self._call_at(text, pos + len(CALL))
            if found is None:
                return None
            calls.append(found[0])
            pos = found[1]
        if not calls or not text.startswith(END, pos):
            return None
        return calls, pos + len(END)

    def parse(self, text: str, tools: list[dict] | None = None) -> ParsedReply:
        # if what follows a marker is malformed, the marker stays as text
        return parse_blocks(text, BEGIN, self._calls_at)

    def _around(self, name: str) -> tuple[str, str]:
        if self.style == "v3":
            return f"{CALL}function{SEP}{name}\n```json\n", f"\n```{CALL_END}"
        return f"{CALL}{name}{SEP}", CALL_END

    def render(self, content: str, calls: list[ToolCall]) -> str:
        sep = "\n" if self.style == "v3" else ""
        body = sep.join(
            f"{self._around(c.name)[0]}{canonical(c.arguments)}{self._around(c.name)[1]}"
            for c in calls
        )
        block = f"{BEGIN}{body}{END}" if calls else ""
        return "".join(x for x in (content, block) if x)

    def call_grammar(
        self,
        tools: list[dict],
        name: str | None = None,
        parallel: bool = True,
        special_tokens: Mapping[str, int] | None = None,
    ) -> str:
        sep = "\n" if self.style == "v3" else ""
        return grammar_of_calls(
            tool_functions(tools, name), self._around, sep, parallel, special_tokens,
            prefix=BEGIN, suffix=END,
        )  # fmt: skip

    def system_prompt(self, tools: list[dict]) -> str:
        head, tail = self._around("<function-name>")
        return (
            f"## Tools\n\nYou have access to these tools:\n{tools_json_lines(tools)}\n\n"
            f"To call tools, write {BEGIN}, then per call {head}<arguments JSON>{tail}, then "
            f"{END}."
        )
