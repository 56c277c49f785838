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
from typing import Literal

from .base import ToolCall, decode_json, make_call, skip_ws, tools_json_lines
from .framing import JsonArgsFormat, read_section

BEGIN, END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
CALL, SEP, CALL_END = "<｜tool▁call▁begin｜>", "<｜tool▁sep｜>", "<｜tool▁call▁end｜>"
_V3 = re.compile(r"\s*function\s*" + re.escape(SEP) + r"\s*([^\s`<]+)\s*```(?:json)?\s*")
_V31 = re.compile(r"\s*([^\s<]+?)\s*" + re.escape(SEP) + r"\s*")


class DeepSeekParser(JsonArgsFormat):
    start_markers: tuple[str, ...] = (BEGIN,)
    markers: tuple[str, ...] = (BEGIN, END, CALL, SEP, CALL_END)
    template_args: str = "text"
    prefix, suffix, content_sep = BEGIN, END, ""  # the block follows the content directly

    def __init__(self, style: Literal["v3", "v31"] = "v31") -> None:
        self.style = style
        self.name = "deepseek_v3" if style == "v3" else "deepseek_v31"
        self.call_sep = "\n" if style == "v3" else ""

    def _call_at(self, text: str, pos: int) -> tuple[ToolCall, int]:
        fenced = _V3.match(text, pos)
        head = fenced or _V31.match(text, pos)
        decoded = decode_json(text, head.end()) if head else None
        if head is None or decoded is None:
            raise ValueError("no call head or arguments")
        call = make_call(head.group(1), decoded[0])
        end = skip_ws(text, decoded[1])
        if fenced:
            if not text.startswith("```", end):
                raise ValueError("no closing fence")
            end = skip_ws(text, end + 3)
        if call is None or not text.startswith(CALL_END, end):
            raise ValueError("no call end")
        return call, end + len(CALL_END)

    def calls_at(
        self, text: str, pos: int, tools: list[dict] | None
    ) -> tuple[list[ToolCall], int] | None:
        return read_section(text, pos, CALL, END, self._call_at)

    def around(self, name: str) -> tuple[str, str]:
        if self.style == "v3":
            return f"{CALL}function{SEP}{name}\n```json\n", f"\n```{CALL_END}"
        return f"{CALL}{name}{SEP}", CALL_END

    def system_prompt(self, tools: list[dict]) -> str:
        head, tail = self.around("<function-name>")
        return (
            f"## Tools\n\nYou have access to these tools:\n{tools_json_lines(tools)}\n\n"
            f"To call tools, write {BEGIN}, then per call {head}<arguments JSON>{tail}, then "
            f"{END}."
        )
