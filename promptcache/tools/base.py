"""The tool-call parser interface: one small parser per chat-template format.

A parser turns a generated assistant reply into (content, calls), renders calls back into the
same text, and builds an llguidance grammar that forces a well-formed call. Every format shares
the same content rule: a well-formed call is cut out together with the whitespace on both sides
of it, and the text pieces left over are joined with one newline.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Protocol

from .finite_json import finite_numbers

_DECODER = json.JSONDecoder()


@dataclass(frozen=True, slots=True)
class ToolCall:
    name: str
    arguments: str  # JSON text of the arguments object: json.dumps of the parsed value
    # the id the model wrote (Kimi K2's "functions.NAME:0"), returned to the client as is so the
    # template renders the history back to the same tokens; "" where the format has none
    id: str = field(default="", compare=False)


class ParsedReply(NamedTuple):
    content: str  # the reply with the well-formed calls (and the whitespace around them) cut out
    calls: list[ToolCall]
    reasoning: str = ""  # the reply's reasoning (a reasoning parser's part), never in content


class ToolCallParser(Protocol):
    name: str  # "hermes", "llama3_json", "mistral", "qwen3_xml", "harmony", ...
    start_markers: tuple[str, ...]  # text that opens a call; a streamer holds back from here on
    markers: tuple[str, ...]  # all marker text call_grammar writes (for special_tokens)
    # how the family's template wants an assistant turn's call arguments: "mapping" (most
    # templates iterate or tojson them) or "text" (DeepSeek's concatenate the JSON string)
    template_args: str

    def parse(self, text: str, tools: list[dict] | None = None) -> ParsedReply:
        """Split a whole reply into content and calls. Never raises: a malformed call (bad JSON,
        unclosed marker, unknown structure) stays in content as the text it was. ``tools``
        (OpenAI style) types the values of formats that write arguments as text (Qwen XML,
        GLM): by each parameter's JSON schema; formats of JSON arguments ignore it."""
        ...

    def render(self, content: str, calls: list[ToolCall]) -> str:
        """The assistant reply as this format writes it, calls after the content.
        JSON is written as chat templates write it (non-ASCII as is). parse(render(c, calls)) ==
        (c, calls) for c without surrounding whitespace and arguments that are JSON objects
        in canonical form (json.dumps)."""
        ...

    def call_grammar(
        self,
        tools: list[dict],
        name: str | None = None,
        parallel: bool = True,
        special_tokens: Mapping[str, int] | None = None,
    ) -> str:
        """An llguidance Lark grammar accepting exactly render("", calls) for one call (or, with
        parallel, one or more), each call's arguments valid for that tool's JSON schema
        (`%json {schema}`, or per value for formats that write values as text:
        ``text_values``; a tool without "parameters" takes any object). name: only that tool.
        special_tokens: marker text -> token id for the `markers` the tokenizer has as single
        added/special tokens; llguidance never matches such a token against literal text, so
        they are written as <[id]>. Raises ValueError for no tools or an unknown name."""
        ...

    def system_prompt(self, tools: list[dict]) -> str:
        """Prompt text that teaches this format to a model whose chat template has no tools
        section: the tools as JSON, how to call them, how results come back."""
        ...


def make_call(name: Any, args: Any) -> ToolCall | None:
    """A ToolCall from a decoded name and arguments, or None when they do not make one.
    Arguments may be an object or (OpenAI style) a JSON string holding an object."""
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(name, str) or not name or not isinstance(args, dict):
        return None
    return ToolCall(name, json.dumps(args))


def decode_json(text: str, pos: int) -> tuple[Any, int] | None:
    """The JSON value starting at text[pos] and the index just past it, or None."""
    try:
        return _DECODER.raw_decode(text, pos)
    except ValueError:
        return None


def skip_ws(text: str, pos: int) -> int:
    while pos < len(text) and text[pos].isspace():
        pos += 1
    return pos


def join_content(pieces: Iterable[str]) -> str:
    """Content from the text between calls: pieces already have their call-side whitespace cut."""
    return "\n".join(p for p in pieces if p)


def cut_calls(text: str, spans: list[tuple[int, int]]) -> str:
    """text without the [start, end) call spans and the whitespace next to each span."""
    pieces, pos = [], 0
    for start, end in spans:
        piece = text[pos:start]
        pieces.append(piece.rstrip() if pos == 0 else piece.strip())
        pos = end
    if not spans:
        return text
    pieces.append(text[pos:].lstrip())
    return join_content(pieces)


def parse_blocks(
    text: str, marker: str, read: Callable[[str, int], tuple[list[ToolCall], int] | None]
) -> ParsedReply:
    """Split text at each `marker`: read(text, pos just past it) gives the calls written there and
    the index past them, or None (or raises ValueError) when malformed; then the marker stays text."""
    spans: list[tuple[int, int]] = []
    calls: list[ToolCall] = []
    pos = 0
    while (start := text.find(marker, pos)) >= 0:
        pos = start + len(marker)
        try:
            found = read(text, pos)
        except ValueError:
            found = None
        if found is not None:
            calls += found[0]
            pos = found[1]
            spans.append((start, pos))
    return ParsedReply(cut_calls(text, spans), calls)


def read_params(
    text: str,
    pos: int,
    opener: re.Pattern[str],
    close: str,
    typed: Callable[[str, str], Any],
) -> tuple[dict, int]:
    """Key/value elements in a row from pos: `opener` matches up to a value (group 1 the key),
    `close` ends it; typed(key, raw text) gives the value. Raises ValueError on an unclosed one."""
    args: dict = {}
    while (opened := opener.match(text, skip_ws(text, pos))) is not None:
        end = text.find(close, opened.end())
        if end < 0:
            raise ValueError("unclosed value")
        key = opened.group(1).strip()
        args[key] = typed(key, text[opened.end() : end])
        pos = end + len(close)
    return args, pos


def tool_functions(tools: list[dict], name: str | None = None) -> list[dict]:
    """The "function" dicts of OpenAI-style tools (bare function dicts are accepted too),
    only `name` when given."""
    funcs = [t.get("function", t) for t in tools]
    if name is not None:
        funcs = [f for f in funcs if f.get("name") == name]
    if not funcs:
        raise ValueError(f"no tool named {name!r}" if name else "no tools")
    return funcs


def lark_str(s: str) -> str:
    """A Lark string literal for s."""
    return json.dumps(s, ensure_ascii=False)


def lark_text(s: str, special: Mapping[str, int] | None) -> str:
    """Lark for the literal text s, with each marker in `special` as its token (<[id]>)."""
    if not special:
        return lark_str(s)
    parts, pos = [], 0
    for m in re.finditer("|".join(map(re.escape, sorted(special, key=len, reverse=True))), s):
        parts += [lark_str(s[pos : m.start()])] if m.start() > pos else []
        parts.append(f"<[{special[m.group()]}]>")
        pos = m.end()
    return " ".join(parts + ([lark_str(s[pos:])] if pos < len(s) else []))


def json_rule(schema: dict) -> str:
    """The Lark right-hand side for a JSON value under ``schema`` (%json), its numbers held to
    finite text (``finite_json``)."""
    return "%json " + json.dumps(finite_numbers(schema))


def args_rule(func: dict) -> str:
    """The Lark right-hand side for a tool's arguments: its JSON schema as %json."""
    return json_rule(func.get("parameters") or {"type": "object"})


def tools_json_lines(tools: list[dict]) -> str:
    return "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)


def dump(value: Any) -> str:
    """JSON as chat templates write it (transformers' tojson): non-ASCII kept as is."""
    return json.dumps(value, ensure_ascii=False)


def canonical(arguments: str) -> str:
    """Arguments JSON as chat templates write it, or unchanged when it is not JSON."""
    try:
        return dump(json.loads(arguments))
    except ValueError:
        return arguments


def grammar_of_calls(
    funcs: list[dict],
    around: Any,
    sep: str,
    parallel: bool,
    special: Mapping[str, int] | None = None,
    prefix: str = "",
    suffix: str = "",
) -> str:
    """A Lark grammar: prefix, one call (or, parallel, calls separated by sep), suffix.
    around(name) gives the literal text before and after a call's arguments object."""

    def text(s: str) -> str:
        return lark_text(s, special) if s else ""

    alts, rules = [], []
    for i, func in enumerate(funcs):
        before, after = around(func["name"])
        body = " ".join(x for x in (text(before), f"args_{i}", text(after)) if x)
        rules += [f"call_{i}: {body}", f"args_{i}: {args_rule(func)}"]
        alts.append(f"call_{i}")
    more = f" ({text(sep)} call)*" if sep else " call*"
    calls = "call" + (more if parallel else "")
    start = " ".join(x for x in (text(prefix), calls, text(suffix)) if x)
    return "\n".join([f"start: {start}", "call: " + " | ".join(alts), *rules]) + "\n"
