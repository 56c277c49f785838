"""What stress_bench.py sends: multi-turn conversations through the official `openai` client
(half streamed, greedy), and bad requests that must each be answered 4xx, with every outcome
counted (200, 4xx, 5xx, an error inside a stream, a cut connection)."""

from __future__ import annotations

import json
import random
import threading
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import httpx
import openai

_WORD_TEXT = (
    "river stone garden window market letter engine winter silver forest harbor lantern "
    "orchard bridge copper meadow signal valley candle anchor mirror thunder ribbon pebble "
    "castle needle shadow island basket feather compass marble canyon violet tunnel ember "
    "glacier saddle falcon quarry velvet beacon spindle walnut cobalt prairie kettle summit"
)
WORDS = _WORD_TEXT.split()
SYSTEM = (
    "You are a careful assistant for a travel office. Answer in two or three short sentences, "
    "name the places you mention, and never invent prices. " + " ".join(WORDS[:60])
)


@dataclass(slots=True)
class Conversation:
    """One conversation's user turns; the assistant turns come from the server."""

    key: str
    user_turns: list[str]
    is_streamed: bool


def make_conversations(num: int, turns: int, variant: int = 0) -> list[Conversation]:
    """``num`` conversations of ``turns`` user messages: a ~230-token first message (~350 with
    the shared system prompt), ~30 tokens a follow-up. A ``variant`` keeps each first message
    and changes the follow-ups (new blocks to write beside cached ones)."""
    out = []
    for k in range(num):
        first = random.Random(f"conv{k}")
        text = " ".join(first.choice(WORDS) for _ in range(230))
        msgs = [f"Here are my notes: {text}. Which three places should I visit first?"]
        follow = random.Random(f"conv{k}/v{variant}")
        for t in range(1, turns):
            words = " ".join(follow.choice(WORDS) for _ in range(14))
            msgs.append(f"Thanks. Now about {words}: what else, turn {t}?")
        out.append(Conversation(f"c{k}v{variant}", msgs, is_streamed=k % 2 == 1))
    return out


@dataclass(slots=True)
class Outcomes:
    """Counts by outcome, the first bodies of each server error, and the transcripts."""

    counts: Counter[str] = field(default_factory=Counter)
    errors: list[str] = field(default_factory=list)
    replies: dict[str, list[str]] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, outcome: str, detail: str = "") -> None:
        with self.lock:
            self.counts[outcome] += 1
            if detail and len(self.errors) < 20:
                self.errors.append(detail)


def ask(
    client: openai.OpenAI, messages: list[dict[str, str]], stream: bool, max_tokens: int
) -> str:
    kw: dict[str, Any] = {"model": "any", "messages": messages, "max_tokens": max_tokens,
                          "temperature": 0}  # fmt: skip
    if not stream:
        return client.chat.completions.create(**kw).choices[0].message.content or ""
    parts = []
    for chunk in client.chat.completions.create(stream=True, **kw):
        if chunk.choices and chunk.choices[0].delta.content:
            parts.append(chunk.choices[0].delta.content)
    return "".join(parts)


def run_conversation(url: str, conv: Conversation, max_tokens: int, out: Outcomes) -> None:
    """The turns one after another, each on the whole history; a failed turn ends it."""
    client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=600)
    messages = [{"role": "system", "content": SYSTEM}]
    replies: list[str] = []
    for user in conv.user_turns:
        messages.append({"role": "user", "content": user})
        try:
            reply = ask(client, messages, conv.is_streamed, max_tokens)
        except openai.APIStatusError as exc:
            kind = "5xx" if exc.status_code >= 500 else f"{exc.status_code}"
            out.add(kind, f"{exc.status_code} {conv.key}: {str(exc.body)[:300]}")
            break
        except (openai.APIConnectionError, httpx.TransportError):
            out.add("cut")  # the server was killed under it
            break
        except openai.APIError as exc:  # an error event inside a stream: the server's fault
            out.add("stream_error", f"stream {conv.key}: {exc}"[:300])
            break
        out.add("ok")
        replies.append(reply)
        messages.append({"role": "assistant", "content": reply})
    with out.lock:
        out.replies[conv.key] = replies


def run_conversations(url: str, convs: list[Conversation], max_tokens: int, out: Outcomes) -> list[threading.Thread]:  # fmt: skip
    threads = [threading.Thread(target=run_conversation, args=(url, c, max_tokens, out), daemon=True)
               for c in convs]  # fmt: skip
    for t in threads:
        t.start()
    return threads


def _chat(**fields: Any) -> dict[str, Any]:
    return {
        "model": "any",
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 4,
        **fields,
    }


def bad_requests() -> list[tuple[str, str, bytes]]:
    """(name, path, body): each one invalid by the API (with --strict-max-tokens for the huge
    max_tokens: by default it is clamped to the room left and answered 200)."""
    chat, msgs, comp, resp = (
        "/v1/chat/completions",
        "/v1/messages",
        "/v1/completions",
        "/v1/responses",
    )
    cases: list[tuple[str, str, Any]] = [
        ("json_truncated", chat, b'{"model":"x","messages":[{"role":"user","content":"hi"}'),
        ("json_garbage", chat, b"\x00\xffnot json at all"),
        ("body_array", chat, [1, 2, 3]),
        ("messages_string", chat, _chat(messages="hi")),
        ("messages_empty", chat, _chat(messages=[])),
        ("role_unknown", chat, _chat(messages=[{"role": "wizard", "content": "hi"}])),
        ("content_number", chat, _chat(messages=[{"role": "user", "content": 5}])),
        (
            "part_unknown",
            chat,
            _chat(messages=[{"role": "user", "content": [{"type": "hologram"}]}]),
        ),
        ("model_number", chat, _chat(model=123)),
        ("max_tokens_string", chat, _chat(max_tokens="ten")),
        ("max_tokens_negative", chat, _chat(max_tokens=-5)),
        ("max_tokens_zero", chat, _chat(max_tokens=0)),
        ("max_tokens_float", chat, _chat(max_tokens=1.5)),
        ("max_tokens_huge", chat, _chat(max_tokens=10**12)),
        ("max_tokens_over_int64", chat, _chat(max_tokens=10**30)),
        ("temperature_string", chat, _chat(temperature="hot")),
        ("n_five", chat, _chat(n=5)),
        ("stream_string", chat, _chat(stream="yes")),
        ("stop_too_many", chat, _chat(stop=[str(i) for i in range(40)])),
        ("response_format_bogus", chat, _chat(response_format={"type": "bogus"})),
        ("tools_malformed", chat, _chat(tools=[{"type": "function"}])),
        (
            "prompt_over_context",
            chat,
            _chat(messages=[{"role": "user", "content": "river " * 12000}]),
        ),
        ("anthropic_no_messages", msgs, {"model": "x", "max_tokens": 5}),
        (
            "anthropic_no_max_tokens",
            msgs,
            {"model": "x", "messages": [{"role": "user", "content": "hi"}]},
        ),
        ("anthropic_empty_messages", msgs, {"model": "x", "max_tokens": 5, "messages": []}),
        ("completions_prompt_number", comp, {"model": "x", "prompt": 5, "max_tokens": 2}),
        ("responses_input_number", resp, {"model": "x", "input": 5}),
    ]
    return [(n, p, b if isinstance(b, bytes) else json.dumps(b).encode()) for n, p, b in cases]


def send_bad(url: str, stop: threading.Event, out: Outcomes, pause_s: float = 0.3) -> None:
    """The bad requests round after round until ``stop``; each not answered 4xx is counted."""
    cases = bad_requests()
    with httpx.Client(timeout=120) as client:
        while not stop.is_set():
            for name, path, body in cases:
                if stop.is_set():
                    return
                try:
                    r = client.post(
                        url + path, content=body, headers={"content-type": "application/json"}
                    )
                except httpx.TransportError:
                    out.add("bad_cut")
                    stop.wait(pause_s)
                    continue
                if 400 <= r.status_code < 500:
                    out.add("bad_4xx")
                else:
                    out.add("bad_not_4xx", f"{name}: {r.status_code} {r.text[:200]}")
                stop.wait(pause_s)
