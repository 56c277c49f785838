"""Responses API items <-> the API-neutral ``Chat``: input items to messages, tool choice and
text format to the chat's, a reply to output items. The tools themselves: ``responses_tools``.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

from promptcache.engines.base import RequestError
from promptcache.server.chat import Chat
from promptcache.server.image_parts import TEXT_ONLY, ImagePolicy, image_part, openai_image
from promptcache.server.openai_api import apply_format
from promptcache.server.pipeline import Reply
from promptcache.server.responses_tools import ToolSet, call_item, read_tools
from promptcache.server.schemas.responses import ResponsesRequest

TEXT_PARTS = ("input_text", "output_text", "text", "refusal", "summary_text", "reasoning_text")


def new_id(prefix: str) -> str:
    return prefix + uuid.uuid4().hex[:24]


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
    chat.ignored_tools = tools.ignored
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
        if kind == "additional_tools":  # tools offered from here on: the chat offers them all
            read_tools(item.get("tools"), tools)
            continue
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
            if name:  # as the model saw it: a namespace member may be offered qualified
                name = tools.offered(str(name), item.get("namespace"))
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
