"""gpt-oss's harmony format: a reply is messages on channels, each header then body.

    <|channel|>analysis<|message|>The user wants the weather.<|end|>
    <|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}<|call|>
    <|start|>assistant<|channel|>final<|message|>It is sunny.<|return|>

(the generation prompt ends with ``<|start|>assistant``, so the first message has no start).
The recipient may also stand before the channel (``<|start|>assistant to=functions.x<|channel|>
commentary json<|message|>``). ``<|call|>`` and ``<|return|>`` end the generation, so the last
message may lack its end marker. The analysis channel is reasoning (tools/reasoning.py takes it
out); a message to ``functions.NAME`` is a call; final and other commentary bodies are content.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import NamedTuple

from .base import (
    ParsedReply,
    ToolCall,
    canonical,
    cut_calls,
    decode_json,
    grammar_of_calls,
    make_call,
    skip_ws,
    tools_json_lines,
)
from .framing import CallFormat

START, CHANNEL, MESSAGE = "<|start|>", "<|channel|>", "<|message|>"
ENDS = ("<|end|>", "<|call|>", "<|return|>")
CONSTRAIN = "<|constrain|>"
MARKERS = (START, CHANNEL, MESSAGE, CONSTRAIN, *ENDS)
_RECIPIENT = re.compile(r"\bto=([^\s<]+)")


class Message(NamedTuple):
    start: int  # where its header begins in the text
    end: int  # just past its end marker (or the text's end)
    channel: str
    recipient: str  # "" when none ("functions.get_weather" for a call)
    body: str
    is_closed: bool  # an end marker was found


def header_at(text: str) -> int:
    """Where the first message header starts (a start or channel marker), or -1."""
    found = [i for i in (text.find(START), text.find(CHANNEL)) if i >= 0]
    return min(found) if found else -1


def scan(text: str) -> tuple[list[Message], int]:
    """The messages of a reply and where the text they explain ends: text from there on (a
    header without its message marker) is not a message. Text before the first header and
    between messages is not in any Message."""
    out: list[Message] = []
    pos = 0
    while (rel := header_at(text[pos:])) >= 0:
        start = pos + rel
        body_at = text.find(MESSAGE, start)
        if body_at < 0:
            return out, start
        header = text[start:body_at]
        if CHANNEL not in header or header.count(START) > 1 or ENDS[0] in header:
            return out, start
        channel = header.split(CHANNEL, 1)[1].strip().split(" ", 1)[0].split("<|", 1)[0]
        recipient = m.group(1) if (m := _RECIPIENT.search(header)) else ""
        body_at += len(MESSAGE)
        ends = [(i, e) for e in ENDS if (i := text.find(e, body_at)) >= 0]
        nxt = header_at(text[body_at:])
        if nxt >= 0:  # a new header before any end marker: this message ended unclosed
            ends.append((body_at + nxt, ""))
        stop, marker = min(ends) if ends else (len(text), "")
        decoded = decode_json(text, skip_ws(text, body_at)) if recipient else None
        if decoded is not None and decoded[1] > stop:  # a marker inside a JSON string: not one
            after = skip_ws(text, decoded[1])
            marker = next((e for e in ENDS if text.startswith(e, after)), "")
            if marker or after == len(text) or header_at(text[after:]) == 0:
                stop = after
        out.append(Message(start, stop + len(marker), channel, recipient, text[body_at:stop],
                           bool(marker)))  # fmt: skip
        pos = stop + len(marker)
    return out, len(text)


class HarmonyParser(CallFormat):
    name: str = "harmony"
    start_markers: tuple[str, ...] = (START, CHANNEL)
    markers: tuple[str, ...] = MARKERS

    def parse(self, text: str, tools: list[dict] | None = None) -> ParsedReply:
        messages, _ = scan(text)
        spans: list[tuple[int, int]] = []
        calls: list[ToolCall] = []
        for m in messages:
            if not m.recipient.startswith("functions."):
                continue
            decoded = decode_json(m.body.strip(), 0)
            call = (
                make_call(m.recipient.removeprefix("functions."), decoded[0]) if decoded else None
            )
            if call is None or decoded is None or decoded[1] != len(m.body.strip()):
                continue
            spans.append((m.start, m.end))
            calls.append(call)
        return ParsedReply(cut_calls(text, spans), calls)

    def render(self, content: str, calls: list[ToolCall]) -> str:
        blocks = "".join(
            f"{START}assistant{_head(c.name)}{canonical(c.arguments)}<|call|>" for c in calls
        )
        if content and blocks:
            return f"{content}{blocks}"
        return (blocks or content).removeprefix(START + "assistant")

    def grammar_for(
        self, funcs: list[dict], parallel: bool, special: Mapping[str, int] | None
    ) -> str:
        # calls, each a message of its own (``<|call|>`` ends the generation: a model calls one
        # tool per turn, the rest of the grammar is never reached)
        def around(name: str) -> tuple[str, str]:
            return _head(name), "<|call|>"

        return grammar_of_calls(funcs, around, START + "assistant", parallel, special)

    def system_prompt(self, tools: list[dict]) -> str:
        return (
            f"# Tools\n\n## functions\n\n{tools_json_lines(tools)}\n\nTo call a function, write "
            f"{CHANNEL}commentary to=functions.<name> {CONSTRAIN}json{MESSAGE}<arguments JSON>"
            "<|call|>"
        )


def _head(name: str) -> str:
    return f"{CHANNEL}commentary to=functions.{name} {CONSTRAIN}json{MESSAGE}"
