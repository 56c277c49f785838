"""Turn 2 reuses the whole of turn 1 (prompt + reply) on every chat API path.

A tiny random model with the bundled (SmolLM2) tokenizer writes replies in token splits the
tokenizer would never produce from their text (odd runs of spaces, pieces of words); clients send
the text back, and the server must render it to the generated tokens, not re-tokenize it. Each
path is checked against /v1/cache/requests and against a --no-cache server (same replies).
"""

from __future__ import annotations

import json
from typing import Any

import anthropic
import httpx
import openai
import pytest

MAX_TOKENS = 24
QUESTION = "Write a short indented python snippet."
GREEDY = {"temperature": 0}  # (this anthropic client takes no temperature argument)


@pytest.fixture(scope="module")
def pair(scripted_model_dir, tmp_path_factory):
    from conftest import ServerProcess

    home = tmp_path_factory.mktemp("home")
    common = ["--engine", "torch", "--model", scripted_model_dir, "--block-size", "16",
              "--max-context", "2048"]  # fmt: skip
    env = {"PROMPTCACHE_HOME": str(home)}
    on = ServerProcess(common, env=env, log=home / "on.log").start()
    off = ServerProcess([*common, "--no-cache"], env=env, log=home / "off.log").start()
    yield on, off
    on.stop()
    off.stop()


def last_record(url: str) -> dict[str, Any]:
    return dict(httpx.get(url + "/v1/cache/requests?limit=1", timeout=10).json()["requests"][0])


def chat_plain(url: str, history: list[dict[str, Any]]) -> str:
    c = openai.OpenAI(base_url=url + "/v1", api_key="x")
    r = c.chat.completions.create(
        model="m",
        messages=history,
        max_tokens=MAX_TOKENS,
        temperature=0,  # type: ignore[arg-type]
    )
    return r.choices[0].message.content or ""


def chat_stream(url: str, history: list[dict[str, Any]]) -> str:
    c = openai.OpenAI(base_url=url + "/v1", api_key="x")
    parts = c.chat.completions.create(
        model="m", messages=history, max_tokens=MAX_TOKENS, temperature=0, stream=True,  # type: ignore[arg-type]
        stream_options={"include_usage": True},
    )  # fmt: skip
    return "".join(p.choices[0].delta.content or "" for p in parts if p.choices)


def messages_plain(url: str, history: list[dict[str, Any]]) -> str:
    c = anthropic.Anthropic(base_url=url, api_key="x")
    r = c.messages.create(
        model="m",
        max_tokens=MAX_TOKENS,
        messages=history,
        extra_body=GREEDY,  # type: ignore[arg-type]
    )
    return "".join(b.text for b in r.content if b.type == "text")


def messages_stream(url: str, history: list[dict[str, Any]]) -> str:
    c = anthropic.Anthropic(base_url=url, api_key="x")
    with c.messages.stream(
        model="m",
        max_tokens=MAX_TOKENS,
        messages=history,
        extra_body=GREEDY,  # type: ignore[arg-type]
    ) as s:
        return "".join(s.text_stream)


def responses_plain(url: str, history: list[dict[str, Any]]) -> str:
    c = openai.OpenAI(base_url=url + "/v1", api_key="x")
    r = c.responses.create(
        model="m",
        input=history,
        max_output_tokens=MAX_TOKENS,
        temperature=0,
        store=False,  # type: ignore[arg-type]
    )
    return r.output_text


def ollama_chat(url: str, history: list[dict[str, Any]], stream: bool) -> str:
    body = {"model": "m", "messages": history, "stream": stream,
            "options": {"num_predict": MAX_TOKENS, "temperature": 0}}  # fmt: skip
    with httpx.stream("POST", url + "/api/chat", json=body, timeout=120) as resp:
        lines = [json.loads(x) for x in resp.iter_lines() if x.strip()]
    return "".join(x.get("message", {}).get("content", "") for x in lines)


def as_parts(text: str, kind: str) -> Any:
    """The reply as the content-part list some clients send back instead of a string."""
    return [{"type": kind, "text": text}] if kind else text


PATHS = {
    "chat": (chat_plain, ""),
    "chat-stream": (chat_stream, ""),
    "chat-parts": (chat_plain, "text"),
    "messages": (messages_plain, ""),
    "messages-stream": (messages_stream, ""),
    "messages-blocks": (messages_plain, "text"),
    "responses": (responses_plain, ""),
    "responses-parts": (responses_plain, "output_text"),
    "ollama": (lambda u, h: ollama_chat(u, h, False), ""),
    "ollama-stream": (lambda u, h: ollama_chat(u, h, True), ""),
}


@pytest.mark.parametrize("path", list(PATHS))
def test_turn_two_reuses_prompt_and_reply(pair, path):
    on, off = pair
    send, parts = PATHS[path]
    history: list[dict[str, Any]] = [{"role": "user", "content": f"{QUESTION} ({path})"}]
    records = []
    for _turn in range(2):
        reply = send(on.url, history)
        assert reply == send(off.url, history), "cached and uncached replies differ"
        records.append(last_record(on.url))
        history += [{"role": "assistant", "content": as_parts(reply, parts)},
                    {"role": "user", "content": "And then?"}]  # fmt: skip
    first, second = records
    assert first["completion_tokens"] == MAX_TOKENS  # a reply long enough to have odd splits
    # all but the new user message: the whole previous prompt and the reply's own tokens
    assert second["cached_tokens"] == first["prompt_tokens"] + first["completion_tokens"]
