"""Turn-to-turn continuity: the next request should re-render the last reply to the same tokens.

A model's reply is saved in the cache as the tokens it generated. A client sends the reply back
as content and tool calls, which the template (or our fallback format) renders again; where that
text differs (whitespace, key order inside a call), the prefix breaks. ``ReplyMemory`` keeps the
raw text of recent replies, keyed by what the client sees, so the history renders to the exact
text; and records, per request, whether the history still matches the tokens of the turn before
(a gap says which message and which token differ).
"""

from __future__ import annotations

import threading
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from promptcache.tools import ToolCall


@dataclass(frozen=True, slots=True)
class Gap:
    message_index: int  # the first message whose tokens differ from the previous turn's
    role: str
    token_index: int  # position in the prompt where the tokens first differ
    expected: str  # text of the previous turn's tokens from there (a few tokens)
    found: str  # text of this prompt's tokens from there
    tenant: str = ""  # whose text it is (not shown): deleting a session forgets its gaps
    session: str = ""

    def to_dict(self) -> dict[str, Any]:
        return {
            "message_index": self.message_index,
            "role": self.role,
            "token_index": self.token_index,
            "expected": self.expected,
            "found": self.found,
        }


@dataclass(slots=True)
class _Reply:
    raw: str
    tokens: np.ndarray  # prompt + generated ids of the turn that produced this reply
    sessions: set[str]  # every session that produced or was sent this reply ("": none)
    reasoning: str = ""  # the reasoning the reply's parser took out of raw


def _key(tenant: str, content: str, calls: list[ToolCall]) -> tuple[Any, ...]:
    return (tenant, content.strip(), tuple((c.name, c.arguments) for c in calls))


class ReplyMemory:
    """Bounded (``capacity`` replies, LRU) and per tenant: one tenant never gets another's text."""

    name = "replies"  # a SessionHolder (server/session_registry.py)

    def __init__(self, capacity: int = 128, num_gaps: int = 20) -> None:
        self._replies: OrderedDict[tuple[Any, ...], _Reply] = OrderedDict()
        self._capacity = capacity
        self._lock = threading.Lock()
        self.num_checked = 0
        self.num_exact = 0
        self.gaps: deque[Gap] = deque(maxlen=num_gaps)

    def add(
        self,
        tenant: str,
        content: str,
        calls: list[ToolCall],
        raw: str,
        tokens: list[int],
        session: str = "",
        reasoning: str = "",
    ) -> None:
        with self._lock:
            key = _key(tenant, content, calls)
            old = self._replies.get(key)
            sessions = ({session} | old.sessions) if old is not None else {session}
            ids = np.asarray(tokens, dtype=np.uint32)
            self._replies[key] = _Reply(raw, ids, sessions, reasoning)
            self._replies.move_to_end(key)
            while len(self._replies) > self._capacity:
                self._replies.popitem(last=False)

    def forget(self, tenant: str, session: str | None = None, force: bool = False) -> int:
        """Drop the tenant's replies (and gaps) of ``session`` (None: all). A reply another
        session also produced stays, as shared blocks do, unless ``force``; returns how many went."""
        with self._lock:
            gone = [
                k
                for k, r in self._replies.items()
                if k[0] == tenant
                and (session is None or (session in r.sessions and (force or len(r.sessions) == 1)))
            ]
            for k in gone:
                del self._replies[k]
            for k, r in self._replies.items():
                if k[0] == tenant and session is not None:
                    r.sessions.discard(session)
            kept = [
                g
                for g in self.gaps
                if not (g.tenant == tenant and (session is None or g.session == session))
            ]
            self.gaps.clear()
            self.gaps.extend(kept)
            return len(gone)

    def _get(self, tenant: str, content: str, calls: list[ToolCall]) -> _Reply | None:
        with self._lock:
            return self._replies.get(_key(tenant, content, calls))

    def raw_text(self, tenant: str, content: str, calls: list[ToolCall]) -> str | None:
        """The text the model generated for a reply the client now sends back, if remembered."""
        reply = self._get(tenant, content, calls)
        return reply.raw if reply is not None else None

    def tokens_of(self, tenant: str, content: str, calls: list[ToolCall]) -> np.ndarray | None:
        """The prompt + generated ids (uint32) of the turn that produced a remembered reply."""
        reply = self._get(tenant, content, calls)
        return reply.tokens if reply is not None else None

    def reasoning(self, tenant: str, content: str, calls: list[ToolCall]) -> str | None:
        """The reasoning of a remembered reply the client sends back without it, or None."""
        reply = self._get(tenant, content, calls)
        return reply.reasoning if reply is not None and reply.reasoning else None

    def check(
        self,
        tenant: str,
        content: str,
        calls: list[ToolCall],
        prompt: list[int],
        decode: Callable[[list[int]], str],
        locate: Callable[[int], tuple[int, str]],
        session: str = "",
    ) -> Gap | None:
        """Compare ``prompt`` with the tokens of the turn that produced the reply (``content``,
        ``calls``) it sends back; record and return the gap if they differ. ``locate(i)`` gives
        (message index, role) of the message holding prompt token i."""
        reply = self._get(tenant, content, calls)
        if reply is None:
            return None
        before = reply.tokens
        n = min(len(before), len(prompt))
        diff = np.flatnonzero(before[:n] != np.asarray(prompt[:n], dtype=np.uint32))
        with self._lock:
            self.num_checked += 1
            if not diff.size and len(prompt) >= len(before):
                self.num_exact += 1
                return None
        at = int(diff[0]) if diff.size else n
        index, role = locate(at)
        gap = Gap(
            index,
            role,
            at,
            decode([int(t) for t in before[at : at + 8]]),
            decode(prompt[at : at + 8]),
            tenant,
            session,
        )
        with self._lock:
            self.gaps.append(gap)
        return gap

    def stats(self) -> dict[str, Any]:
        with self._lock:
            return {
                "checked_turns": self.num_checked,
                "exact_turns": self.num_exact,
                "recent_gaps": [g.to_dict() for g in self.gaps],
            }


def text_prefix(
    decode: Callable[[list[int]], str], ids: np.ndarray, text: str, max_back: int = 64
) -> int:
    """The most of ``ids`` (dropping at most ``max_back`` from the end) whose text starts
    ``text``; 0 when none. Tails are decoded alone, then the one chosen is checked whole."""
    h = max(len(ids) - max_back, 0)
    head = decode(ids[:h].tolist())
    if not text.startswith(head):
        return 0
    for k in range(len(ids) - 1, h, -1):
        if text.startswith(head + decode(ids[h:k].tolist())):
            return k if text.startswith(decode(ids[:k].tolist())) else 0
    return 0
