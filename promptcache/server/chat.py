"""From an API request to prompt tokens and back: tools, tool calls, structured output.

Both APIs convert their request into a ``Chat`` (OpenAI-shaped messages). ``ChatFormatter``
renders it with the model's chat template so that every turn re-renders the history to the same
tokens the previous turn saw (the prefix the cache holds), and parses tool calls out of replies
in the format that template teaches.
"""

from __future__ import annotations

import json
import logging
import uuid
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np

from promptcache.core.images import ImageSpan
from promptcache.engines.base import RequestError
from promptcache.server.chat_messages import (
    as_parts,
    has_late_system,
    late_system_as_user,
    results_as_user,
    with_system_text,
)
from promptcache.server.continuity import ReplyMemory, text_prefix
from promptcache.serving.grammar import (
    check_grammar,
    hf_tokenizer_of,
    json_schema_grammar,
    styled_schema,
)
from promptcache.tools import ParsedReply, ToolCall, detect_formats, make_parser
from promptcache.tools.base import lark_text
from promptcache.tools.reasoning import make_reasoning

log = logging.getLogger("promptcache.server")


@dataclass(slots=True)
class Chat:
    """One request, API-neutral. ``messages``: role, content (str; in user turns with images a
    list of ``{"type": "text", "text"}`` and ``{"type": "image", "image": ImageInput}`` parts),
    and for assistant turns
    ``tool_calls`` ([{id, type, function: {name, arguments (JSON text)}}]); tool results have
    role "tool" and ``tool_call_id``."""

    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] = field(default_factory=list)  # OpenAI function tools
    tool_choice: str = "auto"  # "auto" | "none" | "required" | "named"
    tool_name: str | None = None  # the forced tool when tool_choice is "named"
    parallel_tool_calls: bool = True
    response_schema: dict[str, Any] | None = None  # the reply must be JSON valid for it
    # chat-template variables: enable_thinking (OpenAI extra body / chat_template_kwargs,
    # Anthropic thinking: {type: disabled}) and the client's other chat_template_kwargs
    template_kwargs: dict[str, Any] = field(default_factory=dict)
    reasoning_open: bool = False  # set by the formatter: the prompt ends inside a think block
    ignored_tools: list[str] = field(default_factory=list)  # tool kinds set aside (tool_kinds)

    @property
    def can_call_tools(self) -> bool:
        return bool(self.tools) and self.tool_choice != "none"


class Rendered(NamedTuple):
    ids: list[int]
    images: tuple[ImageSpan, ...] = ()  # where the prompt's images sit


class ChatFormatter:
    """The model's chat template, its tool-call format, and the memory of recent replies."""

    def __init__(
        self, engine: Any, tool_parser: str | None = None, reasoning_parser: str | None = None
    ) -> None:
        """tool_parser / reasoning_parser: format names overriding detection (--tool-parser,
        --reasoning-parser); ValueError for an unknown name."""
        self.engine = engine
        hf = hf_tokenizer_of(engine.tokenizer)
        template = getattr(hf, "chat_template", None)
        template = template if isinstance(template, str) else None
        added = getattr(hf, "get_added_vocab", dict)()
        found = detect_formats(template, added, engine.model_type)
        self.tool_format, self.native_tools = found.tool_format, found.native_tools
        self.tool_format = tool_parser or found.tool_format
        self.parser = make_parser(self.tool_format)
        self.reasoning = make_reasoning(reasoning_parser or found.reasoning)
        log.info(
            "tool calls of %s read in the %s format (%s), reasoning in the %s format (%s)",
            engine.model_id,
            self.tool_format,
            "--tool-parser" if tool_parser else found.why,
            self.reasoning.name,
            "--reasoning-parser" if reasoning_parser else "detected",
        )
        self.replies = ReplyMemory()
        self._warned = False
        self._leads: dict[str, str | None] = {}  # template kwargs -> _reply_lead
        markers = set(self.parser.markers) | set(self.reasoning.markers)
        if hasattr(engine, "show_special_tokens"):  # a format's special-token markers: visible
            engine.show_special_tokens(markers)
        # markers the tokenizer holds as one added token: grammars must name them by id
        self._marker_tokens = {m: added[m] for m in markers if m in added}

    # -- prompt --------------------------------------------------------------------------------

    def render(self, chat: Chat, tenant: str = "") -> list[int]:
        """Prompt token ids for ``chat`` (generation prompt added)."""
        return self.render_prompt(chat, tenant).ids

    def render_prompt(self, chat: Chat, tenant: str = "") -> Rendered:
        """Prompt token ids and image spans for ``chat`` (generation prompt added)."""
        messages = [self._message(m, tenant) for m in chat.messages]
        tools: list[dict[str, Any]] | None = chat.tools or None
        if tools and not self.native_tools:
            if not self._warned:
                self._warned = True
                log.info(
                    "the chat template of %s has no tools section: tools are described in the "
                    "system prompt and calls are read in the %s format",
                    self.engine.model_id,
                    self.tool_format,
                )
            messages = with_system_text(messages, self.parser.system_prompt(tools))
            tools = None
        if not self.native_tools:
            messages = results_as_user(messages)
        try:
            out = self._encode(messages, tools, chat.template_kwargs)
        except RequestError:
            if not has_late_system(messages):
                raise
            # templates that allow a system message only first: later ones become user turns
            out = self._encode(late_system_as_user(messages), tools, chat.template_kwargs)
        tail = self.engine.decode(out.ids[-8:]) if self.reasoning.name != "none" else ""
        chat.reasoning_open = self.reasoning.is_open(tail)
        if not out.images:
            out = Rendered(self._as_generated(chat, tenant, out.ids))
        return out

    def _as_generated(self, chat: Chat, tenant: str, ids: list[int]) -> list[int]:
        """``ids`` with an earlier turn's tokens where the text is the same: a reply the model
        wrote in tokens other than the tokenizer's own split of that text (sampled pieces,
        grammar-forced text) re-renders to the same text but other ids, which would end the
        cached prefix inside the reply. The latest remembered reply whose turn's text still
        starts the prompt is used (a client that edits the last reply keeps the ones before).
        Applied with and without the cache alike."""
        hf = hf_tokenizer_of(self.engine.tokenizer)
        if not hasattr(hf, "decode"):
            return ids
        new: str | None = None
        prompt = np.asarray(ids, dtype=np.uint32)
        replies = [m for m in chat.messages if m.get("role") == "assistant"]
        for m in reversed(replies[-8:]):
            if isinstance(m.get("content"), list):
                continue
            try:
                calls = [_call_of(c) for c in m.get("tool_calls") or []]
            except RequestError:
                continue
            before = self.replies.tokens_of(tenant, str(m.get("content") or ""), calls)
            if before is None or not len(before) or len(before) > len(ids):
                continue
            if np.array_equal(prompt[: len(before)], before):
                return ids
            new = hf.decode(ids, skip_special_tokens=False) if new is None else new
            old = hf.decode(before.tolist(), skip_special_tokens=False)
            if new.startswith(old):  # same text: the turn's own tokens, then the rest
                return before.tolist() + self.engine.encode_text(new[len(old) :], special=False)
            # the turn ran past what the client got back (a stop string, another end token):
            # the most of its tokens whose text still starts the prompt
            k = text_prefix(lambda t: hf.decode(t, skip_special_tokens=False), before, new)
            if k:
                head = hf.decode(before[:k].tolist(), skip_special_tokens=False)
                rest = self.engine.encode_text(new[len(head) :], special=False)
                return before[:k].tolist() + rest
        return ids

    def _encode(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None,
        template_kwargs: dict[str, Any] | None = None,
    ) -> Rendered:
        images = [
            p["image"] for m in messages if isinstance(m.get("content"), list)
            for p in m["content"] if p.get("type") == "image"
        ]  # fmt: skip
        if not images:
            if template_kwargs:
                return Rendered(self.engine.encode_chat(messages, tools, **template_kwargs))
            return Rendered(self.engine.encode_chat(messages, tools))
        # vision templates iterate content parts: every message in parts, images as bare parts
        plain = [{**m, "content": as_parts(m.get("content"))} for m in messages]
        ids, spans = self.engine.encode_chat_images(plain, tools, images)
        return Rendered(ids, tuple(spans))

    def _message(self, m: dict[str, Any], tenant: str) -> dict[str, Any]:
        calls = m.get("tool_calls")
        if m.get("role") != "assistant":
            return m
        parsed = [_call_of(c) for c in calls or []]
        content = str(m.get("content") or "") if not isinstance(m.get("content"), list) else ""
        if self.native_tools or not calls:
            out = {k: v for k, v in m.items() if k != "reasoning_content"}
            reasoning = m.get("reasoning_content")
            if reasoning is None and self.reasoning.name != "none":
                # the client dropped the reasoning: the template sees what the model wrote
                reasoning = self.replies.reasoning(tenant, content, parsed)
            if reasoning:  # Qwen3-style templates read reasoning_content, gpt-oss' thinking
                out["reasoning_content"] = out["thinking"] = reasoning
            if calls and self.native_tools:
                as_text = self.parser.template_args == "text"  # DeepSeek concatenates JSON text
                out["tool_calls"] = [
                    {"type": "function", "id": c.get("id"),
                     "function": {"name": p.name,
                                  "arguments": p.arguments if as_text else json.loads(p.arguments)}}
                    for c, p in zip(calls, parsed, strict=True)
                ]  # fmt: skip
            return out
        raw = self.replies.raw_text(tenant, content, parsed)
        text = raw if raw is not None else self.parser.render(content, parsed)
        return {"role": "assistant", "content": text}

    def grammar(self, chat: Chat) -> str | None:
        """The grammar the reply must follow, or None; raises RequestError (400) when invalid."""
        grammar = None
        for_calls = bool(chat.tools) and chat.tool_choice in ("required", "named")
        if for_calls:
            try:
                grammar = self.parser.call_grammar(
                    [_styled(t) for t in chat.tools],
                    chat.tool_name,
                    chat.parallel_tool_calls,
                    special_tokens=self._marker_tokens,
                )
            except ValueError as exc:
                raise RequestError(f"tool_choice: {exc}") from exc
        elif chat.response_schema is not None:
            grammar = json_schema_grammar(chat.response_schema)
        if grammar is None:
            return None
        # the family's own frame around the constrained part: close an open think block
        # (the forced reply skips reasoning), harmony's final channel for a JSON answer
        prefix = self.reasoning.grammar_prefix(chat.reasoning_open, for_calls)
        if self.reasoning.name == "think":
            lead = self._reply_lead(chat)
            prefix = lead if lead is not None and "</think>" in lead else prefix
        if prefix:
            if not for_calls:
                schema = styled_schema(chat.response_schema or {})
                grammar = f"start: answer\nanswer: %json {json.dumps(schema)}\n"
            body = grammar.replace("start:", "answer_body:", 1)
            grammar = f"start: {lark_text(prefix, self._marker_tokens)} answer_body\n{body}"
        check_grammar(grammar)
        return grammar

    def _reply_lead(self, chat: Chat) -> str | None:
        """What the template writes between the generation prompt and an earlier reply's
        content (GLM: ``\n<think></think>\n``; Qwen3.5 after its ``<think>\n``:
        ``\n</think>\n\n``): a forced reply that starts with it re-renders to its own tokens.
        None when the template does not render that way (or at all)."""
        key = json.dumps(chat.template_kwargs, sort_keys=True, default=str)
        if key in self._leads:
            return self._leads[key]
        hf = hf_tokenizer_of(self.engine.tokenizer)
        user = {"role": "user", "content": "Hi."}
        reply = {"role": "assistant", "content": "X7q"}
        lead = None
        try:
            kw = dict(tokenize=False, **chat.template_kwargs)
            gen = hf.apply_chat_template([user], add_generation_prompt=True, **kw)
            past = hf.apply_chat_template([user, reply], add_generation_prompt=False, **kw)
            if isinstance(gen, str) and isinstance(past, str) and past.startswith(gen):
                at = past.find("X7q", len(gen))
                lead = past[len(gen) : at] if at >= 0 else None
        except Exception:  # a template that cannot render the probe: the parser's default
            lead = None
        if len(self._leads) < 64:
            self._leads[key] = lead
        return lead

    # -- reply ---------------------------------------------------------------------------------

    def parse(self, chat: Chat, text: str) -> ParsedReply:
        """The reply as the client sees it: ``content``, ``calls`` and ``reasoning`` (the
        model's reasoning, never in content) of the generated ``text`` of a request rendered
        by this formatter (render_prompt sets ``chat.reasoning_open``). The one place other
        APIs (Responses, Ollama) get reasoning and tool calls out of a reply."""
        reasoning, rest = self.reasoning.split(text, chat.reasoning_open)
        if not chat.can_call_tools:
            return ParsedReply(rest, [], reasoning)
        reply = self.parser.parse(rest, chat.tools)
        known = {t["function"]["name"] for t in chat.tools}
        if any(c.name not in known for c in reply.calls):  # a made-up tool is no call
            return ParsedReply(rest, [], reasoning)
        # under a forced call any text left is a call cut short by max_tokens (the grammar
        # writes nothing else): after whole calls it is dropped, never shown as text (the raw
        # reply is remembered whole); with no whole call it is returned as generated
        # (finish_reason length), so a client that sends it back keeps the prefix
        forced = chat.tool_choice in ("required", "named")
        return ParsedReply("" if forced and reply.calls else reply.content, reply.calls, reasoning)

    def remember(
        self, tenant: str, reply: ParsedReply, raw: str, tokens: list[int], session: str = ""
    ) -> None:
        """Keep the raw reply and the sequence it ended (for the next turn's continuity)."""
        self.replies.add(tenant, reply.content, reply.calls, raw, tokens, session, reply.reasoning)

    def check_continuity(
        self, chat: Chat, tenant: str, prompt: list[int], session: str = ""
    ) -> None:
        """Does ``prompt`` still hold the tokens of the turn that produced its last assistant
        message? A gap is counted, kept for /v1/cache/stats and logged."""
        last = next((m for m in reversed(chat.messages) if m.get("role") == "assistant"), None)
        if last is None:
            return
        calls = [_call_of(c) for c in last.get("tool_calls") or []]

        gap = self.replies.check(
            tenant,
            str(last.get("content") or ""),
            calls,
            prompt,
            self.engine.decode,
            lambda token: self.message_at(chat, tenant, token),
            session,
        )
        if gap is not None:
            log.info(
                "history re-rendered differently from the tokens of the turn before: message %d "
                "(%s), token %d: expected %r, found %r",
                gap.message_index, gap.role, gap.token_index, gap.expected, gap.found,
            )  # fmt: skip

    def message_at(self, chat: Chat, tenant: str, token: int) -> tuple[int, str]:
        """(index, role) of the message holding prompt token ``token``: the first k messages
        whose rendering reaches past it (binary search: renderings grow with k)."""
        lo, hi = 1, len(chat.messages)
        while lo < hi:
            k = (lo + hi) // 2
            part = Chat(chat.messages[:k], chat.tools, chat.tool_choice)
            if len(self.render(part, tenant)) > token:
                hi = k
            else:
                lo = k + 1
        return lo - 1, str(chat.messages[lo - 1].get("role"))


def new_call_id(prefix: str) -> str:
    return prefix + uuid.uuid4().hex[:24]


def _call_of(call: dict[str, Any]) -> ToolCall:
    fn = call.get("function") or {}
    args = fn.get("arguments")
    if isinstance(args, dict):
        args = json.dumps(args)
    try:
        value = json.loads(args or "{}")
    except (TypeError, ValueError):
        raise RequestError(
            f"tool_calls: arguments of {fn.get('name')!r} are not a JSON object"
        ) from None
    if not isinstance(value, dict) or not fn.get("name"):
        raise RequestError("tool_calls: each call needs a function name and object arguments")
    return ToolCall(str(fn["name"]), json.dumps(value))


def _styled(tool: dict[str, Any]) -> dict[str, Any]:
    fn = tool.get("function") or {}
    params = _closed(fn.get("parameters") or {"type": "object"})
    return {**tool, "function": {**fn, "parameters": styled_schema(params)}}


def _closed(schema: Any) -> Any:
    """Objects with declared properties take no others unless they say so (as OpenAI's strict
    mode does): a forced call names real arguments, and a weak model cannot wander into
    invented nested ones, which also makes each grammar step slower."""
    if isinstance(schema, list):
        return [_closed(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: _closed(v) for k, v in schema.items()}
    if "properties" in out and "additionalProperties" not in out:
        out["additionalProperties"] = False
    return out
