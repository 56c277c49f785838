"""Responses API tools as the chat sees them, and a call as the output item the client expects.

Function tools are the model's own; ``custom`` tools (Codex's freeform ``apply_patch`` and
code-mode ``exec``) become a function taking one string ``input`` and come back as
``custom_tool_call`` items. A ``namespace`` tool (a named group: Codex's sub-agent tools, its
code-mode ``functions``) offers its members, and a call to one names its namespace, as Codex
routes it. Tools also arrive in ``additional_tools`` input items (Codex's default request for
its own models), read the same way. Hosted tools and unknown kinds are set aside
(``tool_kinds``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from promptcache.engines.base import RequestError
from promptcache.server.tool_kinds import set_aside

CUSTOM_PARAMS = {
    "type": "object",
    "properties": {"input": {"type": "string"}},
    "required": ["input"],
}


@dataclass(slots=True)
class ToolSet:
    """The request's tools as the chat sees them."""

    functions: list[dict[str, Any]] = field(default_factory=list)  # chat-shaped function tools
    custom: set[str] = field(default_factory=set)  # offered names of freeform (custom) tools
    ignored: list[str] = field(default_factory=list)  # tool kinds left out of the prompt
    # offered name -> (namespace, the member's own name); a member whose name another tool
    # already has is offered as "namespace.name", so a call always routes to one tool
    namespaces: dict[str, tuple[str, str]] = field(default_factory=dict)

    def offered(self, name: str, namespace: str | None) -> str:
        """The name the model sees for a member ``name`` of ``namespace`` (or a plain tool)."""
        if namespace:
            for offered, (ns, own) in self.namespaces.items():
                if ns == namespace and own == name:
                    return offered
        return name


def read_tools(
    tools: list[dict[str, Any]] | None, out: ToolSet | None = None, namespace: str = ""
) -> ToolSet:
    """Adds ``tools`` (a request's ``tools`` or an ``additional_tools`` item's) to ``out``."""
    out = out if out is not None else ToolSet()
    for i, tool in enumerate(tools or []):
        if not isinstance(tool, dict):
            raise RequestError(f"tools[{i}]: a tool is an object")
        kind, name = tool.get("type"), tool.get("name")
        if kind in ("function", "custom"):
            if not name or not isinstance(name, str):
                raise RequestError(f"tools[{i}]: a {kind} tool needs a name")
            desc = str(tool.get("description") or "")
            params = tool.get("parameters") or {"type": "object", "properties": {}}
            if kind == "custom":
                desc, params = (desc + " (the whole input is one string)").strip(), CUSTOM_PARAMS
            offered = _offer(out, name, namespace)
            fn = {"name": offered, "description": desc, "parameters": params}
            out.functions.append({"type": "function", "function": fn})
            if kind == "custom":
                out.custom.add(offered)
        elif kind == "namespace":
            inner = tool.get("tools")
            if not name or not isinstance(name, str) or not isinstance(inner, list):
                raise RequestError(f"tools[{i}]: a namespace tool needs a name and tools")
            read_tools(inner, out, name)
        else:  # hosted (web_search, mcp, ...) or a kind nobody has seen before
            set_aside("responses", str(kind or "untyped"), out.ignored)
    return out


def _offer(out: ToolSet, name: str, namespace: str) -> str:
    taken = {t["function"]["name"] for t in out.functions}
    offered = f"{namespace}.{name}" if namespace and name in taken else name
    if namespace:
        out.namespaces[offered] = (namespace, name)
    return offered


def call_item(
    item_id: str, call_id: str, name: str, arguments: str, tools: ToolSet, status: str = "completed"
) -> dict[str, Any]:
    """A call the model made (``name`` as offered) as a function_call / custom_tool_call item."""
    namespace, own = tools.namespaces.get(name, ("", name))
    if name in tools.custom:
        value = json.loads(arguments).get("input", "") if status == "completed" else ""
        item = {"id": item_id, "type": "custom_tool_call", "call_id": call_id, "name": own,
                "input": str(value), "status": status}  # fmt: skip
    else:
        item = {"id": item_id, "type": "function_call", "call_id": call_id, "name": own,
                "arguments": arguments, "status": status}  # fmt: skip
    if namespace:
        item["namespace"] = namespace
    return item
