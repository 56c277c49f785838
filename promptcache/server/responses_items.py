"""Responses API items <-> the API-neutral ``Chat``: input items to messages, tools, tool
choice and text format to the chat's, a reply to output items.

Function tools are the model's own; ``custom`` tools (Codex's freeform ``apply_patch``) become a
function taking one string ``input`` and come back as ``custom_tool_call`` items. Tools the
server cannot run itself (hosted ones: web search, file search, code interpreter, MCP,
computer use, image generation, local shell...) are left out of the prompt with a warning: a
client that offers them (Codex does by default) still works with the tools it runs itself.
"""

from __future__ import annotations

import json
import logging
import uuid
from dataclasses import dataclass, field
from typing import Any

from promptcache.engines.base import RequestError
from promptcache.server.chat import Chat
from promptcache.server.image_parts import TEXT_ONLY, ImagePolicy, image_part, openai_image
from promptcache.server.openai_api import apply_format
from promptcache.server.schemas import ResponsesRequest
from promptcache.server.state import Reply

log = logging.getLogger("promptcache.server")

# tool types the OpenAI platform runs itself (or a client-specific built-in): not ours to call
HOSTED_TOOLS = frozenset({
    "web_search", "web_search_preview", "web_search_2025_08_26", "web_search_preview_2025_03_11",
    "file_search", "code_interpreter", "image_generation", "computer_use_preview", "computer",
    "computer_use", "mcp", "local_shell", "shell", "apply_patch", "tool_search",
})  # fmt: skip
CUSTOM_PARAMS = {
    "type": "object",
    "properties": {"input": {"type": "string"}},
    "required": ["input"],
}
TEXT_PARTS = ("input_text", "output_text", "text", "refusal", "summary_text", "reasoning_text")
_warned: set[str] = set()


@dataclass(slots=True)
class ToolSet:
    """The request's tools as the chat sees them."""

    functions: list[dict[str, Any]] = field(default_factory=list)  # chat-shaped function tools
    custom: set[str] = field(default_factory=set)  # names of freeform (custom) tools
    ignored: list[str] = field(default_factory=list)  # hosted tool types left out
    namespaces: dict[str, str] = field(default_factory=dict)  # tool name -> its namespace


def new_id(prefix: str) -> str:
    return prefix + uuid.uuid4().hex[:24]


def read_tools(tools: list[dict[str, Any]] | None, out: ToolSet | None = None) -> ToolSet:
    out = out if out is not None else ToolSet()
    for i, tool in enumerate(tools or []):
        kind = tool.get("type")
        name = tool.get("name")
        if kind == "function":
            if not name or not isinstance(name, str):
                raise RequestError(f"tools[{i}]: a function tool needs a name")
            fn = {"name": name, "description": tool.get("description") or "",
                  "parameters": tool.get("parameters") or {"type": "object", "properties": {}}}  # fmt: skip
            out.functions.append({"type": "function", "function": fn})
        elif kind == "custom":
            if not name or not isinstance(name, str):
                raise RequestError(f"tools[{i}]: a custom tool needs a name")
            desc = str(tool.get("description") or "") + " (the whole input is one string)"
            fn = {"name": name, "description": desc.strip(), "parameters": CUSTOM_PARAMS}
            out.functions.append({"type": "function", "function": fn})
            out.custom.add(name)
        elif kind == "namespace":  # a group of tools (Codex's sub-agent tools): its members
            inner = tool.get("tools")
            if not name or not isinstance(inner, list):
                raise RequestError(f"tools[{i}]: a namespace tool needs a name and tools")
            known = {t["function"]["name"] for t in out.functions}
            read_tools(inner, out)
            for t in out.functions:
                if t["function"]["name"] not in known:
                    out.namespaces[t["function"]["name"]] = str(name)
        elif kind in HOSTED_TOOLS:
            out.ignored.append(str(kind))
            if kind not in _warned:
                _warned.add(str(kind))
                log.warning("responses: %r tools are run by OpenAI's servers, not here: ignored",
                            kind)  # fmt: skip
        else:
            raise RequestError(
                f"tools[{i}]: type {kind!r} is not supported (function, custom and namespace "
                "tools are; hosted ones such as web_search are ignored)"
            )
    return out


def to_chat(
    req: ResponsesRequest,
    history: list[dict[str, Any]],
    tools: ToolSet,
    images: ImagePolicy = TEXT_ONLY,
) -> tuple[Chat, list[dict[str, Any]]]:
    """The chat to render and the conversation messages it adds to ``history`` (what a stored
    response keeps; the instructions are not part of it, as in OpenAI's API)."""
    added = input_messages(req.input, tools, images)
    messages = list(history) + added
    if req.instructions:
        messages = [{"role": "system", "content": req.instructions}, *messages]
    if not messages:
        raise RequestError("input: give text or at least one input item")
    chat = Chat(messages, tools.functions)
    chat.parallel_tool_calls = True if req.parallel_tool_calls is None else req.parallel_tool_calls
    _apply_tool_choice(chat, req.tool_choice)
    fmt = (req.text or {}).get("format") or {"type": "text"}
    apply_format(chat, fmt.get("type"), fmt.get("schema"), "text.format", "text.format.schema")
    return chat, added


def input_messages(
    items: str | list[dict[str, Any]], tools: ToolSet, images: ImagePolicy = TEXT_ONLY
) -> list[dict[str, Any]]:
    if isinstance(items, str):
        return [{"role": "user", "content": items}] if items else []
    out: list[dict[str, Any]] = []
    thought = ""  # a reasoning item's text, for the assistant turn it precedes
    for i, item in enumerate(items):
        kind = item.get("type") or ("message" if "role" in item else None)
        if kind == "reasoning":
            parts = item.get("content") or item.get("summary") or []
            thought += "".join(str(p.get("text") or "") for p in parts if isinstance(p, dict))
            continue
        if thought and kind in ("message", "function_call", "custom_tool_call"):
            if item.get("role", "assistant") == "assistant":
                _start_assistant(out)["reasoning_content"] = thought
            thought = ""
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise RequestError(f"input[{i}]: role must be user, system, developer or assistant")
            content = _content(item.get("content"), role == "user", images, i)
            role = "system" if role == "developer" else role
            if role == "assistant" and out and out[-1].get("role") == "assistant":
                prev = out[-1]  # several output items of one turn: one assistant message
                if prev.get("tool_calls"):  # text after a call is a turn of its own
                    out.append({"role": "assistant", "content": content})
                else:
                    prev["content"] = f"{prev.get('content') or ''}{content}"
                continue
            out.append({"role": role, "content": content})
        elif kind in ("function_call", "custom_tool_call"):
            name = item.get("name")
            if kind == "function_call":
                args = item.get("arguments") or "{}"
            else:
                args = json.dumps({"input": str(item.get("input") or "")})
            call = {"id": item.get("call_id") or item.get("id"), "type": "function",
                    "function": {"name": name, "arguments": args}}  # fmt: skip
            if not name:
                raise RequestError(f"input[{i}]: a {kind} needs a name")
            last = out[-1] if out else None
            if last is not None and last.get("role") == "assistant":
                last.setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind in ("function_call_output", "custom_tool_call_output"):
            output = item.get("output")
            text = output if isinstance(output, str) else _content(output, False, images, i)
            out.append({"role": "tool", "content": text, "tool_call_id": item.get("call_id")})
        elif kind == "item_reference":
            raise RequestError(
                f"input[{i}]: item_reference is not supported; send the item itself or use "
                "previous_response_id"
            )
        else:
            raise RequestError(
                f"input[{i}]: items of type {kind!r} are not supported (message, function_call, "
                "function_call_output, custom_tool_call(_output), reasoning)"
            )
    return out


def _start_assistant(out: list[dict[str, Any]]) -> dict[str, Any]:
    """The assistant message a reasoning item belongs to: a new one (reasoning opens a turn)."""
    out.append({"role": "assistant", "content": ""})
    return out[-1]


def _content(content: Any, is_user: bool, images: ImagePolicy, index: int) -> Any:
    if content is None or isinstance(content, str):
        return content or ""
    if not isinstance(content, list):
        raise RequestError(f"input[{index}]: content must be text or a list of parts")
    parts: list[dict[str, Any]] = []
    for part in content:
        kind = part.get("type")
        if kind in TEXT_PARTS:
            parts.append(
                {"type": "text", "text": str(part.get("text") or part.get("refusal") or "")}
            )
        elif kind == "input_image" and is_user:
            url = part.get("image_url")
            if not isinstance(url, str):
                raise RequestError(f"input[{index}]: input_image needs image_url (a data URL)")
            parts.append(image_part(openai_image({"image_url": {"url": url}}, images)))
        else:
            raise RequestError(
                f"input[{index}]: content parts of type {kind!r} are not supported here (text; "
                "input_image data URLs in user messages on vision models)"
            )
    if any(p["type"] == "image" for p in parts):
        return parts
    return "".join(p["text"] for p in parts)


def _apply_tool_choice(chat: Chat, choice: Any) -> None:
    if choice is None:
        choice = "auto"
    if isinstance(choice, dict):
        kind = choice.get("type")
        if kind in ("function", "custom"):
            if not choice.get("name"):
                raise RequestError("tool_choice: a named choice needs a name")
            chat.tool_choice, chat.tool_name = "named", str(choice["name"])
            return
        if kind == "allowed_tools":  # a subset of tools, in a mode
            allowed = {t.get("name") for t in choice.get("tools") or []}
            chat.tools = [t for t in chat.tools if t["function"]["name"] in allowed]
            choice = choice.get("mode") or "auto"
        else:
            raise RequestError(f"tool_choice: type {kind!r} is not supported (function, custom)")
    if choice not in ("auto", "none", "required"):
        raise RequestError(
            f"tool_choice must be none, auto, required or a named tool, not {choice!r}"
        )
    chat.tool_choice = choice


# -- output ------------------------------------------------------------------------------------


def message_item(item_id: str, text: str, status: str = "completed") -> dict[str, Any]:
    content = [] if status == "in_progress" else [output_text(text)]
    return {"id": item_id, "type": "message", "role": "assistant", "status": status,
            "content": content}  # fmt: skip


def output_text(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def call_item(
    item_id: str, call_id: str, name: str, arguments: str, tools: ToolSet, status: str = "completed"
) -> dict[str, Any]:
    if name in tools.custom:
        value = json.loads(arguments).get("input", "") if status == "completed" else ""
        return {"id": item_id, "type": "custom_tool_call", "call_id": call_id, "name": name,
                "input": str(value), "status": status}  # fmt: skip
    item = {"id": item_id, "type": "function_call", "call_id": call_id, "name": name,
            "arguments": arguments, "status": status}  # fmt: skip
    if name in tools.namespaces:
        item["namespace"] = tools.namespaces[name]
    return item


def reasoning_item(item_id: str, text: str, status: str = "completed") -> dict[str, Any]:
    content = [] if status == "in_progress" else [{"type": "reasoning_text", "text": text}]
    return {"id": item_id, "type": "reasoning", "summary": [], "content": content,
            "status": status}  # fmt: skip


def output_items(reply: Reply, tools: ToolSet, status: str = "completed") -> list[dict[str, Any]]:
    items = []
    if reply.reasoning:
        items.append(reasoning_item(new_id("rs_"), reply.reasoning))
    if reply.content or not reply.calls:
        items.append(message_item(new_id("msg_"), reply.content, status))
    for cid, call in reply.calls:
        items.append(call_item(new_id("fc_"), cid, call.name, call.arguments, tools))
    return items


def reply_message(reply: Reply) -> dict[str, Any]:
    """The assistant turn as a chat message (what a continuation renders)."""
    msg: dict[str, Any] = {"role": "assistant", "content": reply.content}
    if reply.reasoning:
        msg["reasoning_content"] = reply.reasoning
    if reply.calls:
        msg["tool_calls"] = [
            {"id": cid, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
            for cid, c in reply.calls
        ]
    return msg
