"""The agent families' formats: recorded replies (single call, several, a call after reasoning,
arguments of every JSON type, malformed output that stays text), whole and streamed in 1-char
and random chunks through the reasoning and tool-call parsers together; detection."""

from __future__ import annotations

import json
import random

import pytest

from promptcache.tools import (
    ParsedReply,
    ReplyStreamer,
    ToolCall,
    detect_formats,
    make_parser,
    make_reasoning,
)

ANY = {"type": "object", "properties": {
    "s": {"type": "string"}, "i": {"type": "integer"}, "n": {"type": "number"},
    "b": {"type": "boolean"}, "z": {"type": "null"}, "o": {"type": "object"},
    "a": {"type": "array"}, "num_text": {"type": "string"}}}  # fmt: skip
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}}},
    {"type": "function", "function": {"name": "all_types", "parameters": ANY}},
]  # fmt: skip
PARIS = {"city": "Paris", "days": 3}
TYPES = {"s": "a <b> \"c\"\n d", "i": -4, "n": 1.5, "b": True, "z": None, "o": {"k": [1, {"x": None}]},
         "a": [1, "two", False], "num_text": "0042"}  # fmt: skip


def qwen_block(name, args):
    body = "".join(
        f"<parameter={k}>\n{v if isinstance(v, str) else json.dumps(v)}\n</parameter>\n"
        for k, v in args.items()
    )
    return f"<tool_call>\n<function={name}>\n{body}</function>\n</tool_call>"


def glm_block(name, args, nl="\n"):
    pairs = "".join(
        f"<arg_key>{k}</arg_key>{nl}<arg_value>{v if isinstance(v, str) else json.dumps(v)}"
        f"</arg_value>{nl}"
        for k, v in args.items()
    )
    return f"<tool_call>{name}{nl}{pairs}</tool_call>"


def harmony_call(name, args, lead="<|start|>assistant", end="<|call|>"):
    return (f"{lead}<|channel|>commentary to=functions.{name} <|constrain|>json<|message|>"
            f"{json.dumps(args)}{end}")  # fmt: skip


def ds3(name, args):
    return (f"<｜tool▁call▁begin｜>function<｜tool▁sep｜>{name}\n```json\n{json.dumps(args)}\n```"
            "<｜tool▁call▁end｜>")  # fmt: skip


def ds31(name, args):
    return f"<｜tool▁call▁begin｜>{name}<｜tool▁sep｜>{json.dumps(args)}<｜tool▁call▁end｜>"


def kimi(name, args, i):
    return (f"<|tool_call_begin|>functions.{name}:{i}<|tool_call_argument_begin|>"
            f"{json.dumps(args)}<|tool_call_end|>")  # fmt: skip


KS, KE = "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"
DB, DE = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
W, T = ("get_weather", PARIS), ("all_types", TYPES)

# (tool format, reasoning format, prompt opens reasoning, reply, reasoning, content, calls)
RECORDED = [
    ("qwen3_xml", "think", True, "\n</think>\n\n" + qwen_block(*W), "", "", [W]),
    ("qwen3_xml", "think", True, "Two calls.\n</think>\n\nSure.\n\n" + qwen_block(*W) + "\n"
     + qwen_block(*T), "Two calls.", "Sure.", [W, T]),
    ("qwen3_xml", "think", False, qwen_block(*T), "", "", [T]),
    ("harmony", "harmony", False, harmony_call(*W, lead="", end=""), "", "", [W]),
    ("harmony", "harmony", False, "<|channel|>analysis<|message|>Need the weather.<|end|>"
     + harmony_call(*W), "Need the weather.", "", [W]),
    ("harmony", "harmony", False, "<|channel|>analysis<|message|>Two.<|end|>" + harmony_call(*W)
     + harmony_call(*T, end=""), "Two.", "", [W, T]),
    ("harmony", "harmony", False, '<|start|>assistant to=functions.get_weather<|channel|>commentary'
     ' json<|message|>{"city": "Paris", "days": 3}<|call|>', "", "", [W]),
    ("harmony", "harmony", False, "<|channel|>analysis<|message|>Easy.<|end|><|start|>assistant"
     "<|channel|>final<|message|>It is sunny.<|return|>", "Easy.", "It is sunny.", []),
    ("deepseek_v3", "think", True, "Weather first.</think>" + DB + ds3(*W) + "\n" + ds3(*T) + DE,
     "Weather first.", "", [W, T]),
    ("deepseek_v31", "think", False, "Sure." + DB + ds31(*W) + ds31(*T) + DE, "", "Sure.", [W, T]),
    ("deepseek_v31", "think", True, "hm</think>" + DB + ds31(*W) + DE, "hm", "", [W]),
    ("glm45", "think", False, "<think>Look it up.</think>\n" + glm_block(*W), "Look it up.", "", [W]),
    ("glm45", "think", False, glm_block(*W, nl="") + glm_block(*T, nl=""), "", "", [W, T]),
    ("glm45", "think", False, "Ok.\n" + glm_block(*T), "", "Ok.", [T]),
    ("kimi_k2", "think", False, "<think>call it</think>" + KS + kimi(*W, 0) + kimi(*T, 1) + KE,
     "call it", "", [W, T]),
    ("kimi_k2", "think", False, "Checking. " + KS + kimi(*W, 7) + KE, "", "Checking.", [W]),
]  # fmt: skip
MALFORMED = [
    ("qwen3_xml", "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</function>\n</tool_call>"),
    ("qwen3_xml", "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"),
    ("qwen3_xml", "<tool_call>\n{\"name\": \"get_weather\"}\n</tool_call>"),
    ("harmony", "<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{\"city\": "),
    ("harmony", "<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>[1]<|call|>"),
    ("deepseek_v31", DB + "<｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{\"city\"<｜tool▁call▁end｜>" + DE),
    ("deepseek_v3", DB + ds3(*W)),
    ("glm45", "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris\n</tool_call>"),
    ("glm45", "<tool_call>\n</tool_call>"),
    ("kimi_k2", KS + "<|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>{}" + KE),
    ("kimi_k2", KS + KE),
]  # fmt: skip


def parse(fmt: str, reasoning: str, text: str, is_open: bool = False) -> ParsedReply:
    """What ChatFormatter.parse does: reasoning out first, then calls from the rest."""
    r = make_reasoning(reasoning).split(text, is_open)
    reply = make_parser(fmt).parse(r.rest, TOOLS)
    return ParsedReply(reply.content, reply.calls, r.reasoning)


def chunkings(text: str) -> list[list[str]]:
    rng = random.Random(len(text))
    out = [list(text)]
    for _ in range(6):
        cuts = sorted(rng.sample(range(len(text) + 1), min(5, len(text) + 1)))
        out.append([text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)])
    return out


def assert_streams(fmt: str, reasoning: str, text: str, is_open: bool) -> None:
    whole = parse(fmt, reasoning, text, is_open)
    for chunks in chunkings(text):
        s = ReplyStreamer(make_reasoning(reasoning), make_parser(fmt), is_open)
        thought = shown = ""
        for c in chunks:
            r, t = s.push(c)
            thought, shown = thought + r, shown + t
        left_r, left_c = s.left(whole)
        assert thought + left_r == whole.reasoning, chunks
        assert shown + left_c == whole.content, chunks
        for m in ("<tool_call>", "<|channel|>", "<function=", DB, KS, "</think>"):
            assert m not in thought and m not in shown  # markup is never shown


@pytest.mark.parametrize(("fmt", "reasoning", "is_open", "text", "thought", "content", "calls"),
                         RECORDED)  # fmt: skip
def test_recorded_replies(fmt, reasoning, is_open, text, thought, content, calls):
    reply = parse(fmt, reasoning, text, is_open)
    assert (reply.reasoning, reply.content) == (thought, content)
    assert [(c.name, json.loads(c.arguments)) for c in reply.calls] == calls
    assert_streams(fmt, reasoning, text, is_open)


@pytest.mark.parametrize(("fmt", "text"), MALFORMED)
def test_malformed_comes_back_as_text(fmt, text):
    reasoning = "harmony" if fmt == "harmony" else "think"
    reply = parse(fmt, reasoning, text)
    assert reply.calls == [] and reply.content.strip()
    assert_streams(fmt, reasoning, text, False)


def test_every_json_type_keeps_its_type():
    for fmt, text in (("qwen3_xml", qwen_block(*T)), ("glm45", glm_block(*T))):
        (call,) = make_parser(fmt).parse(text, TOOLS).calls
        assert json.loads(call.arguments) == TYPES  # "0042" stays a string: its schema says so
    (call,) = make_parser("qwen3_xml").parse(qwen_block("unknown", {"x": 5, "y": "hi"})).calls
    assert json.loads(call.arguments) == {"x": 5, "y": "hi"}  # no schema: JSON when it is JSON


def test_kimi_keeps_the_models_call_ids():
    calls = make_parser("kimi_k2").parse(KS + kimi(*W, 4) + kimi(*T, 5) + KE).calls
    assert [c.id for c in calls] == ["functions.get_weather:4", "functions.all_types:5"]
    assert make_parser("kimi_k2").render("", calls) == KS + kimi(*W, 4) + kimi(*T, 5) + KE


def test_reasoning_cut_by_max_tokens_is_all_reasoning():
    think = make_reasoning("think")
    assert think.split("still thinking about it", is_open=True) == ("still thinking about it", "")
    assert think.split("<think>half", is_open=False) == ("half", "")
    assert think.split("plain answer", is_open=False) == ("", "plain answer")
    assert think.is_open("<|im_start|>assistant\n<think>\n") and not think.is_open("a</think>\n")
    harmony = make_reasoning("harmony")
    assert harmony.split("<|channel|>analysis<|message|>so far") == ("so far", "")


@pytest.mark.parametrize(
    ("template", "vocab", "model_type", "tool", "reasoning"),
    [
        ("{% if tools %}<tool_call>\n<function=x>\n<parameter=y>{% endif %}<think>", (), "", "qwen3_xml", "think"),
        ("{% if tools %}<tool_call>\n{\"name\": }{% endif %}", ("<tool_call>",), "qwen2", "hermes", "none"),
        ("{{ tools }}<tool_call>{{ name }}<arg_key>k</arg_key><think>", (), "", "glm45", "think"),
        ("{{ tools }}<|start|>assistant<|channel|>analysis<|message|>", (), "", "harmony", "harmony"),
        ("{{ tools }}<｜tool▁calls▁begin｜>function<｜tool▁sep｜>```json", (), "", "deepseek_v3", "none"),
        ("{{ tools }}<｜tool▁calls▁begin｜><｜tool▁sep｜><think>", (), "", "deepseek_v31", "think"),
        ("{{ tools }}<|tool_calls_section_begin|>", (), "", "kimi_k2", "none"),
        ("{{ messages }}", ("<|channel|>", "<|constrain|>"), "", "harmony", "harmony"),
        ("{{ messages }}", (), "gpt_oss", "harmony", "harmony"),
        ("{{ messages }}", ("</think>",), "qwen3_5_text", "qwen3_xml", "think"),
        ("{{ messages }}", (), "llama", "hermes", "none"),
    ],
)  # fmt: skip
def test_detect_formats(template, vocab, model_type, tool, reasoning):
    found = detect_formats(template, vocab, model_type)
    assert (found.tool_format, found.reasoning) == (tool, reasoning), found.why


def test_xml_grammars_write_what_the_parser_reads():
    import llguidance
    from test_tool_parsers import accepts

    for fmt in ("qwen3_xml", "glm45"):
        p = make_parser(fmt)
        grammar = p.call_grammar(TOOLS)
        assert llguidance.LLMatcher.validate_grammar(grammar, None) == ""
        calls = [
            ToolCall("all_types", json.dumps(TYPES)),
            ToolCall("get_weather", json.dumps(PARIS)),
        ]
        text = p.render("", calls)
        assert accepts(grammar, text) and p.parse(text, TOOLS).calls == calls
        assert not accepts(grammar, text.replace('"two"', "two"))  # arrays are JSON


class _Engine:
    """Just what ChatFormatter reads at start-up: a tokenizer with the template, a model type."""

    model_id = "tiny"

    def __init__(self, tokenizer, model_type=""):
        self.tokenizer, self.model_type = tokenizer, model_type

    def decode(self, ids):
        return self.tokenizer.decode(ids)

    def encode_chat(self, messages, tools=None, **kw):
        text = self.tokenizer.apply_chat_template(messages, tools=tools, tokenize=False,
                                                  add_generation_prompt=True, **kw)  # fmt: skip
        return self.tokenizer.encode(text, add_special_tokens=False)

    def encode_text(self, text, special=True):
        return self.tokenizer.encode(text, add_special_tokens=special)


def test_formats_detected_from_the_model_overridden_by_flags_and_logged(caplog):
    pytest.importorskip("transformers")
    import logging

    from agent_models import QWEN35_SPECIALS, QWEN35_TEMPLATE

    from promptcache.server.chat import ChatFormatter
    from promptcache.testing.tiny_models import train_tiny_tokenizer

    tok = train_tiny_tokenizer(QWEN35_SPECIALS, QWEN35_TEMPLATE)
    with caplog.at_level(logging.INFO, logger="promptcache.server"):
        found = ChatFormatter(_Engine(tok, "qwen3_5_text"))
    assert (found.tool_format, found.reasoning.name, found.native_tools) == (
        "qwen3_xml", "think", True)  # fmt: skip
    assert "qwen3_xml format (chat template markers <function=, <parameter=)" in caplog.text
    named = ChatFormatter(_Engine(tok), tool_parser="hermes", reasoning_parser="none")
    assert (named.tool_format, named.reasoning.name) == ("hermes", "none")


@pytest.mark.parametrize("flag", ["--tool-parser", "--reasoning-parser"])
def test_unknown_parser_flag_is_exit_status_2(flag):
    import subprocess
    import sys

    run = subprocess.run([sys.executable, "-m", "promptcache.cli", "serve", flag, "nope"],
                         capture_output=True, text=True, timeout=60)  # fmt: skip
    assert run.returncode == 2 and "unknown" in run.stderr and "Traceback" not in run.stderr


GLM_LIKE = (
    "[gMASK]<sop>{% for m in messages %}{% if m.role == 'user' %}<|user|>\n{{ m.content }}"
    "{% elif m.role == 'assistant' %}<|assistant|>\n<think>{{ m.reasoning_content or '' }}</think>\n"
    "{{ m.content }}{% endif %}{% endfor %}{% if add_generation_prompt %}<|assistant|>"
    "{% if enable_thinking is defined and not enable_thinking %}{{ '\\n<think></think>\\n' }}"
    "{% endif %}"
    "{% endif %}"
)


def test_forced_reply_starts_as_the_template_renders_a_past_reply():
    """GLM renders past replies with an empty think block: a forced call writes it first, so the
    next turn re-renders the reply to its own tokens; Qwen3.5's closes the prompt's <think>."""
    pytest.importorskip("transformers")
    from agent_models import QWEN35_SPECIALS, QWEN35_TEMPLATE

    from promptcache.server.chat import Chat, ChatFormatter
    from promptcache.testing.tiny_models import train_tiny_tokenizer

    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    glm = ChatFormatter(_Engine(train_tiny_tokenizer(("<think>", "</think>"), GLM_LIKE)),
                        tool_parser="glm45", reasoning_parser="think")  # fmt: skip
    chat = Chat([{"role": "user", "content": "hi"}], tools, "required")
    assert glm._reply_lead(chat) == "\n<think></think>\n"
    ids = glm._marker_tokens  # <think> and </think> are single tokens: written by id
    first = glm.grammar(chat).splitlines()[0]
    assert first == f'start: "\\n" <[{ids["<think>"]}]> <[{ids["</think>"]}]> "\\n" answer_body'
    off = Chat([{"role": "user", "content": "hi"}], tools, "required",
               template_kwargs={"enable_thinking": False})  # fmt: skip
    assert glm._reply_lead(off) == "" and glm.grammar(off).startswith("start: call")
    qwen = ChatFormatter(_Engine(train_tiny_tokenizer(QWEN35_SPECIALS, QWEN35_TEMPLATE)))
    chat = Chat([{"role": "user", "content": "hi"}], tools, "required")
    qwen.render(chat)
    assert chat.reasoning_open and qwen._reply_lead(chat) == "\n</think>\n\n"
