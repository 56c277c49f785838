"""Kimi K2 tool calls: a section of calls, each an id then its JSON arguments.

    <|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>{"city": "Paris"}<|tool_call_end|><|tool_calls_section_end|>

The id is ``functions.NAME:INDEX`` (INDEX counts the conversation's calls); Kimi's template writes
the id the client sends back, so the parsed call keeps it (ToolCall.id) and the server returns it.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

from .base import (
    ToolCall,
    args_rule,
    canonical,
    decode_json,
    join_content,
    lark_text,
    make_call,
    skip_ws,
    tools_json_lines,
)
from .framing import MarkedFormat, read_section

SECTION, SECTION_END = "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"
CALL, ARGS, CALL_END = "<|tool_call_begin|>", "<|tool_call_argument_begin|>", "<|tool_call_end|>"
_ID = re.compile(r"\s*((?:functions\.)?([A-Za-z0-9_.\-]+?)(?::\d+)?)\s*" + re.escape(ARGS))


class KimiParser(MarkedFormat):
    name: str = "kimi_k2"
    start_markers: tuple[str, ...] = (SECTION,)
    markers: tuple[str, ...] = (SECTION, SECTION_END, CALL, ARGS, CALL_END)

    def _call_at(self, text: str, pos: int) -> tuple[ToolCall, int]:
        head = _ID.match(text, pos)
        decoded = decode_json(text, skip_ws(text, head.end())) if head else None
        if head is None or decoded is None:
            raise ValueError("no call id or arguments")
        call = make_call(head.group(2), decoded[0])
        end = skip_ws(text, decoded[1])
        if call is None or not text.startswith(CALL_END, end):
            raise ValueError("no call end")
        return ToolCall(call.name, call.arguments, head.group(1)), end + len(CALL_END)

    def calls_at(
        self, text: str, pos: int, tools: list[dict] | None
    ) -> tuple[list[ToolCall], int] | None:
        return read_section(text, pos, CALL, SECTION_END, self._call_at)

    def render(self, content: str, calls: list[ToolCall]) -> str:
        body = "".join(
            f"{CALL}{c.id or f'functions.{c.name}:{i}'}{ARGS}{canonical(c.arguments)}{CALL_END}"
            for i, c in enumerate(calls)
        )
        section = f"{SECTION}{body}{SECTION_END}" if calls else ""
        return join_content((content, section))

    def grammar_for(
        self, funcs: list[dict], parallel: bool, special: Mapping[str, int] | None
    ) -> str:
        def text(s: str) -> str:
            return lark_text(s, special)

        alts, rules = [], []
        for i, func in enumerate(funcs):
            head = text(f"{CALL}functions.{func['name']}:")
            rules += [f"call_{i}: {head} INDEX {text(ARGS)} args_{i} {text(CALL_END)}",
                      f"args_{i}: {args_rule(func)}"]  # fmt: skip
            alts.append(f"call_{i}")
        calls = "call+" if parallel else "call"
        # a bounded index: a weak model must not loop on its digits until max_tokens
        return "\n".join(
            [f"start: {text(SECTION)} {calls} {text(SECTION_END)}", "call: " + " | ".join(alts),
             "INDEX: /[0-9]{1,6}/", *rules]
        ) + "\n"  # fmt: skip

    def system_prompt(self, tools: list[dict]) -> str:
        return (
            f"# Tools\n\n{tools_json_lines(tools)}\n\nTo call tools, write "
            f"{SECTION}, then for each call {CALL}functions.<name>:<index>{ARGS}"
            f"<arguments as a JSON object>{CALL_END}, then {SECTION_END}."
        )
