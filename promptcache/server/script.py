"""Scripted replies (``serve --scripted-replies FILE``): a real engine whose replies come from a
script, so agent clients can be driven through tool loops by a tiny test model.

The file is JSON: ``{"replies": [{"turn": N, "match": REGEX, "content": TEXT, "tool_calls":
[{"name", "arguments": {...}}]}, ...]}``. A request gets the first reply that fits it: ``turn``
(if given) is the number of assistant messages in its conversation (0: the first reply, 1: the
one after the first tool round...), ``match`` (if given, a regular expression) is found in the
text of its last message, and every tool it calls is one the request offers (so a client's side
requests without tools, such as title generation, fall through to a text reply). The reply is written in the model's own tool-call format
and tokenized the way the next turn's prompt will hold it; the engine then emits exactly those
ids (``serving.forced.ForcedTokens``) followed by end-of-sequence, so the cache, streaming and
call parsing run as they do for a model's own reply.
"""

from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from promptcache.engines.base import ConfigError, RequestError
from promptcache.serving.grammar import hf_tokenizer_of
from promptcache.tools import ToolCall

log = logging.getLogger("promptcache.server")


@dataclass(frozen=True, slots=True)
class ScriptedReply:
    turn: int | None
    pattern: re.Pattern[str] | None
    content: str
    calls: tuple[ToolCall, ...]

    def fits(self, num_assistant: int, last_text: str, tool_names: set[str]) -> bool:
        if any(c.name not in tool_names for c in self.calls):
            return False
        if self.turn is not None and self.turn != num_assistant:
            return False
        return self.pattern is None or self.pattern.search(last_text) is not None


class ReplyScript:
    """The replies of a script file, in order; ``forced_ids`` picks and tokenizes one."""

    def __init__(self, replies: list[ScriptedReply], source: str = "") -> None:
        self.replies = replies
        self.source = source

    @classmethod
    def load(cls, path: str | Path) -> ReplyScript:
        """Reads and checks a script file; raises ConfigError naming what is wrong."""
        try:
            data = json.loads(Path(path).read_text())
        except (OSError, ValueError) as exc:
            raise ConfigError(f"--scripted-replies {path}: {exc}") from None
        try:
            return cls([_reply(r) for r in data["replies"]], str(path))
        except (KeyError, TypeError, ValueError, re.error) as exc:
            raise ConfigError(
                f'--scripted-replies {path}: expected {{"replies": [{{"turn", "match", "content", '
                f'"tool_calls": [{{"name", "arguments"}}]}}]}}: {exc!r}'
            ) from None

    def pick(self, messages: list[dict[str, Any]], tool_names: set[str]) -> ScriptedReply:
        last = _text(messages[-1].get("content")) if messages else ""
        turn = sum(m.get("role") == "assistant" for m in messages)
        for reply in self.replies:
            if reply.fits(turn, last, tool_names):
                return reply
        raise RequestError(
            f"no scripted reply in {self.source or 'the script'} fits this request (turn {turn}, "
            f"last message {last[:80]!r}, tools: {', '.join(sorted(tool_names)) or 'none'})"
        )

    def forced_ids(self, chat: Any, parser: Any, engine: Any) -> tuple[int, ...]:
        """The token ids of the reply ``chat`` gets: its text in ``parser``'s format, then the
        end-of-turn token."""
        names = {t["function"]["name"] for t in chat.tools} if chat.can_call_tools else set()
        reply = self.pick(chat.messages, names)
        text = parser.render(reply.content, list(reply.calls)) if reply.calls else reply.content
        tokenizer = hf_tokenizer_of(engine.tokenizer)
        ids = list(tokenizer.encode(text, add_special_tokens=False))
        if engine.decode(ids) != text:  # the next turn would not find this reply's tokens
            log.warning("scripted reply %r does not survive tokenization", text[:80])
        eos = getattr(tokenizer, "eos_token_id", None)
        return (*ids, eos if eos in engine.eos_ids else min(engine.eos_ids))


def _reply(raw: dict[str, Any]) -> ScriptedReply:
    calls = tuple(
        ToolCall(str(c["name"]), json.dumps(c.get("arguments") or {}, ensure_ascii=False))
        for c in raw.get("tool_calls") or []
    )
    content = str(raw.get("content") or "")
    if not calls and not content:
        raise ValueError("a reply needs content or tool_calls")
    match, turn = raw.get("match"), raw.get("turn")
    if turn is not None and (not isinstance(turn, int) or turn < 0):
        raise ValueError(f"turn must be a count of assistant messages, not {turn!r}")
    return ScriptedReply(turn, re.compile(match) if match else None, content, calls)


def _text(content: Any) -> str:
    if isinstance(content, list):
        return "\n".join(str(p.get("text") or "") for p in content if isinstance(p, dict))
    return str(content or "")
