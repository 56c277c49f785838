"""The two ways a tool-call format frames a call, written once: render and call_grammar follow
from the same literal pieces, so the text a parser writes and the text its grammar forces can
never drift apart.

- ``JsonArgsFormat``: literal text around one JSON arguments object per call (Hermes, Mistral,
  Llama 3, DeepSeek): ``prefix``, the calls joined by ``call_sep``, ``suffix``.
- ``TextArgsFormat``: a head, then one element per parameter with its value written as text,
  then a tail (Qwen XML, GLM).

Both parse by cutting out what follows each ``start_markers[0]`` (``calls_at`` reads it).
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping

from .base import (
    ParsedReply,
    ToolCall,
    canonical,
    grammar_of_calls,
    join_content,
    parse_blocks,
    skip_ws,
    tool_functions,
)
from .text_values import grammar_of_values, text_value


class CallFormat(ABC):
    """The base of every parser (the ToolCallParser contract): call_grammar picks the tools,
    grammar_for writes the format's grammar for them."""

    name: str
    start_markers: tuple[str, ...]
    markers: tuple[str, ...]
    template_args: str = "mapping"

    def call_grammar(
        self,
        tools: list[dict],
        name: str | None = None,
        parallel: bool = True,
        special_tokens: Mapping[str, int] | None = None,
    ) -> str:
        return self.grammar_for(tool_functions(tools, name), parallel, special_tokens)

    @abstractmethod
    def grammar_for(
        self, funcs: list[dict], parallel: bool, special: Mapping[str, int] | None
    ) -> str:
        """The grammar of ToolCallParser.call_grammar for the "function" dicts ``funcs``."""


class MarkedFormat(CallFormat):
    """A format whose calls follow an opening marker, ``start_markers[0]``."""

    @abstractmethod
    def calls_at(
        self, text: str, pos: int, tools: list[dict] | None
    ) -> tuple[list[ToolCall], int] | None:
        """The calls written just past a marker that ends at pos and the index past them; None
        (or ValueError) when what follows is malformed."""

    def parse(self, text: str, tools: list[dict] | None = None) -> ParsedReply:
        # if what follows a marker is malformed, the marker stays as text
        return parse_blocks(text, self.start_markers[0], lambda t, p: self.calls_at(t, p, tools))


class JsonArgsFormat(MarkedFormat):
    """Calls as around(name)[0] + arguments JSON + around(name)[1], joined by call_sep, between
    prefix and suffix (written only when there are calls), after the content and content_sep."""

    call_sep: str = "\n"
    prefix: str = ""
    suffix: str = ""
    content_sep: str = "\n"

    @abstractmethod
    def around(self, name: str) -> tuple[str, str]:
        """The literal text before and after the arguments object of a call to ``name``."""

    def render(self, content: str, calls: list[ToolCall]) -> str:
        body = self.call_sep.join(canonical(c.arguments).join(self.around(c.name)) for c in calls)
        block = f"{self.prefix}{body}{self.suffix}" if calls else ""
        return self.content_sep.join(x for x in (content, block) if x)

    def grammar_for(
        self, funcs: list[dict], parallel: bool, special: Mapping[str, int] | None
    ) -> str:
        return grammar_of_calls(
            funcs, self.around, self.call_sep, parallel, special, self.prefix, self.suffix
        )


class TextArgsFormat(MarkedFormat):
    """Calls as head(name), then per parameter open + value as text + close + after where
    param(key) = (open, close, after), then tail; calls joined by call_sep."""

    call_sep: str = "\n"
    tail: str

    @abstractmethod
    def head(self, name: str) -> str:
        """The literal text that opens a call to ``name``."""

    @abstractmethod
    def param(self, key: str) -> tuple[str, str, str]:
        """(open, close, after): the literal text around the value of parameter ``key``."""

    def block(self, name: str, args: dict) -> str:
        parts = [self.head(name)]
        for key, value in args.items():
            opening, close, after = self.param(key)
            parts.append(f"{opening}{text_value(value)}{close}{after}")
        return "".join(parts) + self.tail

    def render(self, content: str, calls: list[ToolCall]) -> str:
        blocks = self.call_sep.join(self.block(c.name, json.loads(c.arguments)) for c in calls)
        return join_content((content, blocks))

    def grammar_for(
        self, funcs: list[dict], parallel: bool, special: Mapping[str, int] | None
    ) -> str:
        return grammar_of_values(
            funcs, self.head, self.param, self.tail, self.call_sep, parallel, special
        )


def read_section(
    text: str, pos: int, call: str, end: str, read_call: Callable[[str, int], tuple[ToolCall, int]]
) -> tuple[list[ToolCall], int] | None:
    """Calls in a section: each ``call`` marker then read_call(text, pos past it) (raises
    ValueError when malformed), until the section's ``end`` marker; None when malformed."""
    calls: list[ToolCall] = []
    try:
        while text.startswith(call, pos := skip_ws(text, pos)):
            found, pos = read_call(text, pos + len(call))
            calls.append(found)
    except ValueError:
        return None
    if not calls or not text.startswith(end, pos):
        return None
    return calls, pos + len(end)
