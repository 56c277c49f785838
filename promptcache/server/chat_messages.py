"""Message-list rewrites the chat formatter applies before a template renders them: the
fallback tools prompt in the system message, tool results as user turns, late system messages
for strict templates, and content as template parts."""

from __future__ import annotations

from typing import Any


def with_system_text(messages: list[dict[str, Any]], text: str) -> list[dict[str, Any]]:
    if messages and messages[0].get("role") == "system":
        first = dict(messages[0])
        first["content"] = f"{first.get('content') or ''}\n\n{text}".lstrip()
        return [first, *messages[1:]]
    return [{"role": "system", "content": text}, *messages]


def results_as_user(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Tool results as user turns in <tool_response> tags (what the fallback prompt teaches);
    results in a row, and the user text right after them, share one turn."""
    out: list[dict[str, Any]] = []
    for m in messages:
        if m.get("role") != "tool":
            if m.get("role") == "user" and out and out[-1].get("_results"):
                out[-1]["content"] = concat(out[-1]["content"], m.get("content"), "\n")
                out[-1].pop("_results")
                continue
            out.append(m)
            continue
        block = f"<tool_response>\n{m.get('content') or ''}\n</tool_response>"
        if out and out[-1].get("_results"):
            out[-1]["content"] += "\n" + block
        else:
            out.append({"role": "user", "content": block, "_results": True})
    for m in out:
        m.pop("_results", None)
    return out


def has_late_system(messages: list[dict[str, Any]]) -> bool:
    return any(m.get("role") == "system" for m in messages[1:])


def late_system_as_user(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for i, m in enumerate(messages):
        if i and m.get("role") == "system":
            m = {"role": "user", "content": f"<system>\n{m.get('content') or ''}\n</system>"}
        if out and m["role"] == "user" and out[-1]["role"] == "user":
            out[-1] = {"role": "user", "content": concat(out[-1]["content"], m["content"], "\n\n")}
        else:
            out.append(m)
    return out


def as_parts(content: Any) -> list[dict[str, Any]]:
    """Content as template parts: text as is, images as bare ``{"type": "image"}``."""
    if not isinstance(content, list):
        return [{"type": "text", "text": str(content or "")}]
    return [{"type": "image"} if p.get("type") == "image" else p for p in content]


def concat(a: Any, b: Any, sep: str) -> Any:
    """Two message contents joined by ``sep``: a string, or parts when either has images."""
    if not isinstance(a, list) and not isinstance(b, list):
        return f"{a or ''}{sep}{b or ''}"
    left = a if isinstance(a, list) else [{"type": "text", "text": str(a or "")}]
    right = b if isinstance(b, list) else [{"type": "text", "text": str(b or "")}]
    return [*left, {"type": "text", "text": sep}, *right]
