"""ChatFormatter and ReplyMemory: how requests become prompts, and turn-to-turn continuity."""

import json

import pytest

from promptcache.engines.base import EngineError
from promptcache.server.anthropic_api import to_chat
from promptcache.server.chat import Chat, ChatFormatter
from promptcache.server.continuity import ReplyMemory
from promptcache.server.schemas.anthropic import MessagesRequest
from promptcache.tools import ToolCall

TOOL = {"type": "function", "function": {"name": "ls", "description": "list",
                                         "parameters": {"type": "object"}}}  # fmt: skip


class FakeEngine:
    """Renders messages as JSON text, one token per byte; optionally rejects late system turns
    the way strict templates (Qwen, Mistral) do."""

    model_id = "fake"
    model_type = ""
    tokenizer = object()

    def __init__(self, strict: bool = False):
        self.strict = strict
        self.rendered: list[list[dict]] = []

    def encode_chat(self, messages, tools=None):
        if self.strict and any(m["role"] == "system" for m in messages[1:]):
            raise EngineError("System message must be at the beginning")
        self.rendered.append(messages)
        return list(json.dumps([messages, tools]).encode())

    def decode(self, ids):
        return bytes(ids).decode(errors="replace")


def test_tools_go_to_the_system_prompt_when_the_template_has_none():
    engine = FakeEngine()
    fmt = ChatFormatter(engine)
    assert (fmt.tool_format, fmt.native_tools) == ("hermes", False)
    fmt.render(Chat([{"role": "system", "content": "S"}, {"role": "user", "content": "u"}], [TOOL]))
    system = engine.rendered[-1][0]["content"]
    assert system.startswith("S\n\n") and '"name": "ls"' in system and "<tool_call>" in system


def test_tool_calls_and_results_render_in_the_fallback_format():
    engine = FakeEngine()
    fmt = ChatFormatter(engine)
    call = {"id": "c1", "type": "function", "function": {"name": "ls", "arguments": '{"a": 1}'}}
    chat = Chat(
        [{"role": "user", "content": "go"},
         {"role": "assistant", "content": "", "tool_calls": [call]},
         {"role": "tool", "tool_call_id": "c1", "content": "a.txt"},
         {"role": "tool", "tool_call_id": "c2", "content": "b.txt"},
         {"role": "user", "content": "next"}],
        [TOOL],
    )  # fmt: skip
    fmt.render(chat)
    msgs = engine.rendered[-1]
    assert [m["role"] for m in msgs] == ["system", "user", "assistant", "user"]
    assert msgs[2]["content"] == '<tool_call>\n{"name": "ls", "arguments": {"a": 1}}\n</tool_call>'
    assert msgs[3]["content"] == (
        "<tool_response>\na.txt\n</tool_response>\n<tool_response>\nb.txt\n</tool_response>\nnext"
    )


def test_a_remembered_reply_renders_to_its_raw_text():
    engine = FakeEngine()
    fmt = ChatFormatter(engine)
    raw = 'Sure.\n<tool_call>\n{"name":"ls","arguments":{}}\n</tool_call>'  # not canonical
    reply = fmt.parse(Chat([], [TOOL]), raw)
    assert reply.calls == [ToolCall("ls", "{}")] and reply.content == "Sure."
    fmt.remember("t", reply, raw, [1, 2, 3])
    call = {"id": "x", "type": "function", "function": {"name": "ls", "arguments": "{}"}}
    msg = {"role": "assistant", "content": "Sure.", "tool_calls": [call]}
    fmt.render(Chat([{"role": "user", "content": "u"}, msg], [TOOL]), tenant="t")
    assert engine.rendered[-1][-1]["content"] == raw
    fmt.render(Chat([{"role": "user", "content": "u"}, msg], [TOOL]), tenant="other")
    assert engine.rendered[-1][-1]["content"] != raw  # never another tenant's text


def test_late_system_messages_fall_back_to_user_turns_for_strict_templates():
    for strict in (False, True):
        engine = FakeEngine(strict)
        chat = Chat([{"role": "system", "content": "S"}, {"role": "user", "content": "hi"},
                     {"role": "system", "content": "agents"}])  # fmt: skip
        ChatFormatter(engine).render(chat)
        roles = [m["role"] for m in engine.rendered[-1]]
        assert roles == (["system", "user"] if strict else ["system", "user", "system"])
        if strict:
            assert engine.rendered[-1][-1]["content"] == "hi\n\n<system>\nagents\n</system>"


def test_gap_records_message_and_token():
    memory = ReplyMemory()
    memory.add("", "hello", [], "hello", [10, 11, 12, 13, 14])
    decode = lambda ids: ",".join(map(str, ids))  # noqa: E731
    assert (
        memory.check("", "hello", [], [10, 11, 12, 13, 14, 15], decode, lambda i: (0, "x")) is None
    )
    gap = memory.check(
        "", "hello", [], [10, 11, 99, 13, 14, 15], decode, lambda i: (1, "assistant")
    )
    assert (gap.token_index, gap.message_index, gap.role) == (2, 1, "assistant")
    assert gap.expected.startswith("12") and gap.found.startswith("99")
    stats = memory.stats()
    assert stats["checked_turns"] == 2 and stats["exact_turns"] == 1
    assert stats["recent_gaps"][0]["token_index"] == 2
    assert memory.check("", "unknown", [], [1], decode, lambda i: (0, "")) is None


def test_formatter_finds_the_message_of_a_gap():
    engine = FakeEngine()
    fmt = ChatFormatter(engine)
    first = Chat([{"role": "user", "content": "question"}])
    prompt = fmt.render(first)
    fmt.remember("", fmt.parse(first, "answer"), "answer", prompt + list(b"answer"))
    edited = Chat([{"role": "user", "content": "QUESTION"}, {"role": "assistant", "content": "answer"},
                   {"role": "user", "content": "more"}])  # fmt: skip
    fmt.check_continuity(edited, "", fmt.render(edited))
    gap = fmt.replies.stats()["recent_gaps"][-1]
    assert gap["message_index"] == 0 and gap["role"] == "user"


@pytest.mark.parametrize("keep", [False, True])
def test_billing_header_block_is_dropped_unless_kept(keep):
    req = MessagesRequest(
        max_tokens=1,
        system=[{"type": "text", "text": "x-anthropic-billing-header: cc_version=2.1.197.8a5; cc_entrypoint=cli;"},
                {"type": "text", "text": "You are Claude Code."}],
        messages=[{"role": "user", "content": "hi"}],
    )  # fmt: skip
    system = to_chat(req, keep_billing=keep).messages[0]["content"]
    assert ("billing" in system) is keep and system.endswith("You are Claude Code.")


def test_forced_calls_return_a_call_cut_short_as_text_and_close_their_schemas():
    from promptcache.server.chat import _closed

    fmt = ChatFormatter(FakeEngine())
    text = '<tool_call>\n{"name": "ls", "arguments": {}}\n</tool_call>\n<tool_call>\n{"name": "l'
    forced = fmt.parse(Chat([], [TOOL], tool_choice="required"), text)
    # after whole calls a call cut short is dropped (no text block of markup), before any it
    # comes back as generated text
    assert forced.content == "" and [c.name for c in forced.calls] == ["ls"]
    cut = fmt.parse(Chat([], [TOOL], tool_choice="required"), '<tool_call>\n{"name": "l')
    assert cut.content == '<tool_call>\n{"name": "l' and cut.calls == []
    schema = {"type": "object", "properties": {"a": {"type": "object", "properties": {}}},
              "anyOf": [{"properties": {"b": {}}}]}  # fmt: skip
    closed = _closed(schema)
    assert closed["additionalProperties"] is False
    assert closed["properties"]["a"]["additionalProperties"] is False
    assert closed["anyOf"][0]["additionalProperties"] is False
    assert _closed({"type": "object", "additionalProperties": True}) == {
        "type": "object", "additionalProperties": True}  # fmt: skip


def test_streams_send_keep_alives_during_a_long_prefill(monkeypatch):
    import asyncio

    from promptcache.server import streaming

    monkeypatch.setattr(streaming, "KEEPALIVE_S", 0.05)
    monkeypatch.setattr(streaming, "GRACE_S", 0.01)

    async def slow_events():
        await asyncio.sleep(0.3)
        yield "prefill done"

    async def run():
        first = await streaming.start_first(slow_events())
        lines = [line async for line in streaming.keep_alive(first, "ping")]
        return lines, first.result()

    lines, first = asyncio.run(run())
    assert first == "prefill done" and len(lines) >= 3 and set(lines) == {"ping"}

    async def failing():
        raise EngineError("bad request")
        yield  # pragma: no cover

    with pytest.raises(EngineError):  # an early error still raises before the response
        asyncio.run(streaming.start_first(failing()))
