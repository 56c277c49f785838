"""Ollama requests -> the API-neutral ``Chat`` and ``SamplingParams``; the model's descriptors
(``/api/tags``, ``/api/show``, ``/api/ps``).

Ollama's tool calls carry arguments as objects and no ids: a call gets an id from its place in
the conversation (the same on every turn, so history re-renders to the same tokens) and a tool
result is matched to the earliest unanswered call of its ``tool_name`` (else the earliest).
"""

from __future__ import annotations

import hashlib
import json
import logging
from typing import Any, NamedTuple

from promptcache.engines.base import RequestError, SamplingParams
from promptcache.server.chat import Chat
from promptcache.server.image_parts import TEXT_ONLY, ImagePolicy, image_part, openai_image
from promptcache.server.schemas.ollama import OllamaBase, OllamaChatRequest, OllamaMessage
from promptcache.server.state import ServerState
from promptcache.server.tool_kinds import function_tools

log = logging.getLogger("promptcache.server")

VERSION = "0.12.6"  # the Ollama API version answered at /api/version (clients gate features)
SAMPLING_OPTIONS = ("num_predict", "temperature", "top_p", "top_k", "seed", "stop")
# Ollama's defaults where a request leaves an option out (its Modelfile defaults)
DEFAULTS = {"temperature": 0.8, "top_p": 0.9, "top_k": 40}
_noted: set[str] = set()


class Options(NamedTuple):
    params: SamplingParams
    explicit_max: bool  # num_predict > 0 given: --strict-max-tokens may refuse it
    ignored: list[str]  # options taken but not applied (num_ctx: the server's context rules)


def read_options(req: OllamaBase, state: ServerState) -> Options:
    opts = dict(req.options or {})
    for key in ("temperature", "top_p"):
        if key in opts and not isinstance(opts[key], int | float):
            raise RequestError(f"options.{key} must be a number")
    for key in ("num_predict", "top_k", "seed"):
        if key in opts and opts[key] is not None and not isinstance(opts[key], int):
            raise RequestError(f"options.{key} must be an integer")
    num_predict = opts.get("num_predict")
    explicit = isinstance(num_predict, int) and num_predict > 0
    if explicit:
        max_tokens = int(num_predict)
    elif num_predict in (-1, -2):  # until the context is full: the room left (clamped)
        max_tokens = state.engine_limits.max_context
    else:
        max_tokens = state.output_budget(None)
    stop = opts.get("stop") or []
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
        raise RequestError("options.stop must be a string or a list of strings")
    top_p = float(opts.get("top_p", DEFAULTS["top_p"]))
    params = SamplingParams(
        max_tokens,
        float(opts.get("temperature", DEFAULTS["temperature"])),
        top_p if top_p > 0 else 1.0,
        max(0, int(opts.get("top_k", DEFAULTS["top_k"]))),
        opts.get("seed"),
        list(stop),
    )
    ignored = sorted(k for k in opts if k not in SAMPLING_OPTIONS)
    for key in ignored:
        if key not in _noted:
            _noted.add(key)
            note = " (the context is the server's --max-context)" if key == "num_ctx" else ""
            log.info("ollama: option %r is accepted and ignored%s", key, note)
    return Options(params, explicit, ignored)


def chat_of(req: OllamaChatRequest, images: ImagePolicy = TEXT_ONLY) -> Chat:
    messages = to_messages(req.messages, images)
    if not messages:
        raise RequestError("messages: at least one message is needed")
    tools, ignored = function_tools(req.tools, "ollama")
    chat = Chat(messages, tools)
    chat.ignored_tools = ignored
    apply_format(chat, req.format)
    apply_think(chat, req.think)
    return chat


def apply_format(chat: Chat, fmt: str | dict[str, Any] | None) -> None:
    if fmt in (None, ""):
        return
    if fmt == "json":
        chat.response_schema = {"type": "object"}
    elif isinstance(fmt, dict):
        chat.response_schema = fmt
    else:
        raise RequestError('format must be "json" or a JSON schema object')


def apply_think(chat: Chat, think: bool | str | None) -> None:
    if isinstance(think, bool):
        chat.template_kwargs["enable_thinking"] = think
    elif isinstance(think, str):  # gpt-oss levels: low, medium, high
        chat.template_kwargs["reasoning_effort"] = think


def to_messages(items: list[OllamaMessage], images: ImagePolicy) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    unanswered: list[tuple[str, str]] = []  # (call id, name), oldest first
    for i, m in enumerate(items):
        content: Any = m.content or ""
        if m.images:
            if m.role != "user":
                raise RequestError(f"messages[{i}]: images go in user messages")
            parts = [image_part(ollama_image(b64, images)) for b64 in m.images]
            content = [*parts, {"type": "text", "text": content}] if content else parts
        msg: dict[str, Any] = {"role": m.role, "content": content}
        if m.role == "assistant" and m.tool_calls:
            msg["tool_calls"] = []
            for j, call in enumerate(m.tool_calls):
                fn = call.get("function") or {}
                name, args = fn.get("name"), fn.get("arguments", {})
                if not name:
                    raise RequestError(f"messages[{i}].tool_calls[{j}]: a call needs a name")
                text = args if isinstance(args, str) else json.dumps(args)
                cid = str(call.get("id") or f"call_{i}_{j}")
                msg["tool_calls"].append(
                    {"id": cid, "type": "function", "function": {"name": name, "arguments": text}}
                )
                unanswered.append((cid, str(name)))
        if m.role == "assistant" and m.thinking:
            msg["reasoning_content"] = m.thinking
        if m.role == "tool":
            match = next((c for c in unanswered if c[1] == m.tool_name), None)
            match = match or (unanswered[0] if unanswered else None)
            if match is not None:
                unanswered.remove(match)
                msg["tool_call_id"] = match[0]
        out.append(msg)
    return out


def ollama_image(data: str, images: ImagePolicy) -> Any:
    head = "" if data.startswith("data:") else "data:image/png;base64,"
    if head and data[:4] == "/9j/":  # base64 of a JPEG's first bytes
        head = "data:image/jpeg;base64,"
    return openai_image({"image_url": {"url": head + data}}, images)


# -- the model's descriptors -------------------------------------------------------------------


def family(state: ServerState) -> str:
    """The architecture name (model_type) when the engine's model config says it."""
    return state.engine.model_type or "unknown"


def details(state: ServerState) -> dict[str, Any]:
    name = family(state)
    return {"parent_model": "", "format": "safetensors", "family": name, "families": [name],
            "parameter_size": "", "quantization_level": ""}  # fmt: skip


def digest(state: ServerState) -> str:
    key = state.engine.fingerprint or state.model_id
    return hashlib.sha256(key.encode()).hexdigest()


def capabilities(state: ServerState) -> list[str]:
    caps = ["completion", "tools"]
    if state.image_policy.enabled:
        caps.append("vision")
    if state.formatter.reasoning.name != "none":
        caps.append("thinking")
    return caps
