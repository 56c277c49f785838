"""Split a streamed reply into content that is safe to show now and tool calls at the end.

Contract, for a reply streamed as deltas d1..dn with full = d1 + ... + dn:

    shown = "".join(splitter.push(d) for d in deltas)
    reply = splitter.finish()            # == parser.parse(full)
    shown + splitter.rest == reply.content

push() never returns text that parse() could later cut out or re-join: it holds back everything
from the first start marker on, any suffix that could be the start of a marker, and trailing
whitespace (which is cut when a call follows). So `shown` is always a prefix of the final content
and `rest` is the remainder, shown once after finish(). Text after a start marker is not shown
until finish(), even if the marker turns out not to open a well-formed call.
"""

from __future__ import annotations

from .base import ParsedReply, ToolCallParser
from .reasoning import ReasoningParser


def _held_from(text: str, markers: tuple[str, ...]) -> int:
    """Where the text that must be held back starts: the first marker, else a marker prefix."""
    found = [i for i in (text.find(m) for m in markers) if i >= 0]
    if found:
        return min(found)
    for cut in range(max(len(text) - max(map(len, markers)) + 1, 0), len(text)):
        tail = text[cut:]
        if any(m.startswith(tail) for m in markers):
            return cut
    return len(text)


class ToolStreamSplitter:
    def __init__(self, parser: ToolCallParser) -> None:
        self.parser = parser
        self._text: list[str] = []
        self._scan = 0  # the buffer is scanned for markers from here; before it nothing is held
        self._marker_at: int | None = None
        self.shown = ""  # all content returned by push() so far
        self.reply: ParsedReply | None = None  # set by finish()

    def push(self, delta: str) -> str:
        """Append a delta; return the content newly safe to show (maybe "")."""
        if self.reply is not None:
            raise RuntimeError("push() after finish()")
        self._text.append(delta)
        if self._marker_at is not None:
            return ""
        text = "".join(self._text)
        self._text = [text]
        held = self._scan + _held_from(text[self._scan :], self.parser.start_markers)
        if held < len(text) and any(text.startswith(m, held) for m in self.parser.start_markers):
            self._marker_at = held
        self._scan = held
        safe = text[:held].rstrip()
        new, self.shown = safe[len(self.shown) :], safe
        return new

    def finish(self) -> ParsedReply:
        """Parse the whole reply; afterwards `rest` is the content not yet shown."""
        if self.reply is None:
            self.reply = self.parser.parse("".join(self._text))
        return self.reply

    @property
    def rest(self) -> str:
        """The content still to show after finish(): reply.content minus what push() returned."""
        if self.reply is None:
            raise RuntimeError("rest before finish()")
        return self.reply.content[len(self.shown) :]


class ReplyStreamer:
    """A streamed reply split three ways: reasoning, content safe to show, calls at the end.

    push(delta) -> (reasoning, content) newly safe to show. The reasoning parser's partial split
    gives prefixes of the whole reply's split; its rest goes through a ToolStreamSplitter when
    tools can be called. After the reply is parsed (ChatFormatter.parse on the whole text),
    ``left(reply)`` gives what is still to show of each side.
    """

    def __init__(
        self, reasoning: ReasoningParser, parser: ToolCallParser | None, is_open: bool = False
    ) -> None:
        self._reasoning = reasoning
        self._is_open = is_open
        self._splitter = ToolStreamSplitter(parser) if parser is not None else None
        self._text = ""
        self._fed = ""  # the rest given to the splitter so far
        self.shown_reasoning = ""
        self.shown = ""

    def push(self, delta: str) -> tuple[str, str]:
        self._text += delta
        split = self._reasoning.split(self._text, self._is_open, partial=True)
        reasoning = ""
        if split.reasoning.startswith(self.shown_reasoning):
            reasoning = split.reasoning[len(self.shown_reasoning) :]
            self.shown_reasoning = split.reasoning
        content = ""
        if split.rest.startswith(self._fed):
            new = split.rest[len(self._fed) :]
            self._fed = split.rest
            content = self._splitter.push(new) if self._splitter is not None else new
            self.shown += content
        return reasoning, content

    def left(self, reply: ParsedReply) -> tuple[str, str]:
        """(reasoning, content) of the parsed reply not shown yet."""
        reasoning = reply.reasoning
        r = (
            reasoning[len(self.shown_reasoning) :]
            if reasoning.startswith(self.shown_reasoning)
            else ""
        )
        c = reply.content
        return r, (c[len(self.shown) :] if c.startswith(self.shown) else "")
