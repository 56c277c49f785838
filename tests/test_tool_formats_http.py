"""Every tool-call format through real HTTP: a scripted tiny model emits a recorded reply in the
format (reasoning, then text, then two calls with arguments of every JSON type), and the official
`openai` (chat.completions) and `anthropic` (messages) clients, whole and streamed, get back
structured calls with the right names and typed arguments, and no markup in text or thinking.

The reply is scripted as plain content (no "tool_calls"), so the server emits the recorded text
verbatim and only ``--tool-parser`` turns it into calls: our own renderer is not in the loop.
"""

from __future__ import annotations

import json

import pytest
from test_tool_formats import (
    DB,
    DE,
    KE,
    KS,
    PARIS,
    TOOLS,
    TYPES,
    ds3,
    ds31,
    glm_block,
    harmony_call,
    kimi,
    qwen_block,
)

pytest.importorskip("torch")
openai = pytest.importorskip("openai")
anthropic = pytest.importorskip("anthropic")

pytestmark = pytest.mark.server

W, T = ("get_weather", PARIS), ("all_types", TYPES)
CALLS = [W, T]


def _json_call(name, args, key="arguments"):
    return json.dumps({"name": name, key: args})


# tool format -> (reasoning format, recorded reply, reasoning, content); the calls are CALLS
RECORDED = {
    "hermes": ("think", "<think>Two lookups.</think>\nLet me check.\n<tool_call>\n"
               + _json_call(*W) + "\n</tool_call>\n<tool_call>\n" + _json_call(*T)
               + "\n</tool_call>", "Two lookups.", "Let me check."),
    "llama3_json": ("none", "Let me check.\n<|python_tag|>" + _json_call(*W, key="parameters")
                    + "; " + _json_call(*T, key="parameters"), "", "Let me check."),
    "mistral": ("none", "Let me check.[TOOL_CALLS][" + _json_call(*W) + ", " + _json_call(*T)
                + "]", "", "Let me check."),
    "mistral_args": ("none", "Let me check.[TOOL_CALLS]get_weather[ARGS]" + json.dumps(PARIS)
                     + "[TOOL_CALLS]all_types[ARGS]" + json.dumps(TYPES), "", "Let me check."),
    "qwen3_xml": ("think", "<think>Two calls.</think>\n\nSure.\n\n" + qwen_block(*W) + "\n"
                  + qwen_block(*T), "Two calls.", "Sure."),
    "harmony": ("harmony", "<|channel|>analysis<|message|>Two.<|end|>" + harmony_call(*W)
                + harmony_call(*T), "Two.", ""),
    "deepseek_v3": ("think", "<think>Weather first.</think>" + DB + ds3(*W) + "\n" + ds3(*T) + DE,
                    "Weather first.", ""),
    "deepseek_v31": ("think", "<think>hm</think>Sure." + DB + ds31(*W) + ds31(*T) + DE, "hm",
                     "Sure."),
    "glm45": ("think", "<think>Look it up.</think>\nOk.\n" + glm_block(*W) + glm_block(*T),
              "Look it up.", "Ok."),
    "kimi_k2": ("think", "<think>call it</think>Checking. " + KS + kimi(*W, 0) + kimi(*T, 1) + KE,
                "call it", "Checking."),
}  # fmt: skip
MARKUP = ("<tool_call>", "</tool_call>", "<function=", "<|python_tag|>", "[TOOL_CALLS]", "[ARGS]",
          "<|channel|>", "<|message|>", "<|call|>", "<think>", "</think>", DB, "<｜tool▁sep｜>",
          KS, "<|tool_call_begin|>", "<arg_key>", '"name"')  # fmt: skip
A_TOOLS = [
    {"name": t["function"]["name"], "input_schema": t["function"]["parameters"]} for t in TOOLS
]
MESSAGES = [{"role": "user", "content": "Weather in Paris, and try every type."}]
MAX_TOKENS = 400


@pytest.fixture(scope="module", params=list(RECORDED))
def fmt_server(request, scripted_model_dir, tmp_path_factory):
    from conftest import ServerProcess

    fmt = request.param
    reasoning, reply, thought, content = RECORDED[fmt]
    home = tmp_path_factory.mktemp(fmt)
    (home / "script.json").write_text(json.dumps({"replies": [{"content": reply}]}))
    srv = ServerProcess(
        ["--engine", "torch", "--model", scripted_model_dir, "--max-context", "4096", "--no-ssd",
         "--scripted-replies", str(home / "script.json"), "--tool-parser", fmt,
         "--reasoning-parser", reasoning],
        env={"PROMPTCACHE_HOME": str(home)}, log=home / "server.log",
    ).start()  # fmt: skip
    yield fmt, srv, thought, content
    srv.stop()


def assert_clean(*texts: str) -> None:
    for text in texts:
        leaked = [m for m in MARKUP if m in text]
        assert not leaked, (leaked, text)


def assert_calls(got: list[tuple[str, object]]) -> None:
    assert got == CALLS
    args = dict(got)["all_types"]
    assert isinstance(args, dict)
    # exact JSON types, not just equal values (True == 1, 1.5 vs "1.5", "0042" vs 42)
    assert {k: type(v) for k, v in args.items()} == {k: type(v) for k, v in TYPES.items()}


def test_openai_chat_whole_and_streamed(fmt_server):
    fmt, srv, thought, content = fmt_server
    client = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0)
    kw = dict(model="m", messages=MESSAGES, tools=TOOLS, max_tokens=MAX_TOKENS)
    r = client.chat.completions.create(**kw)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls", (fmt, choice)
    reasoning = choice.message.model_dump().get("reasoning_content") or ""
    text = choice.message.content or ""
    assert (reasoning.strip(), text.strip()) == (thought, content), fmt
    assert_clean(reasoning, text)
    assert_calls([(c.function.name, json.loads(c.function.arguments))
                  for c in choice.message.tool_calls])  # fmt: skip
    assert len({c.id for c in choice.message.tool_calls}) == 2

    chunks = list(client.chat.completions.create(**kw, stream=True))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    s_text = "".join(d.content or "" for d in deltas)
    s_reasoning = "".join(d.model_dump().get("reasoning_content") or "" for d in deltas)
    calls: dict[int, list[str]] = {}
    for d in deltas:
        for t in d.tool_calls or []:
            name, args = calls.setdefault(t.index, ["", ""])
            calls[t.index] = [name + (t.function.name or ""), args + (t.function.arguments or "")]
    assert (s_reasoning.strip(), s_text.strip()) == (thought, content), fmt
    assert_clean(s_reasoning, s_text)
    assert_calls([(n, json.loads(a)) for _, (n, a) in sorted(calls.items())])
    finish = [
        c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason
    ]
    assert finish == ["tool_calls"]


def test_anthropic_messages_whole_and_streamed(fmt_server):
    fmt, srv, thought, content = fmt_server
    client = anthropic.Anthropic(base_url=srv.url, api_key="x", max_retries=0)
    kw = dict(model="m", max_tokens=MAX_TOKENS, messages=MESSAGES, tools=A_TOOLS)

    def check(message) -> None:
        assert message.stop_reason == "tool_use", (fmt, message)
        texts = [b.text for b in message.content if b.type == "text"]
        thinking = [b.thinking for b in message.content if b.type == "thinking"]
        assert "".join(texts).strip() == content, (fmt, message.content)
        assert "".join(thinking).strip() == thought, (fmt, message.content)
        assert_clean(*texts, *thinking)
        uses = [b for b in message.content if b.type == "tool_use"]
        assert_calls([(b.name, b.input) for b in uses])
        assert message.content[-1].type == "tool_use"  # the calls come after the text

    check(client.messages.create(**kw))
    with client.messages.stream(**kw) as stream:
        starts = [ev.content_block.type for ev in stream if ev.type == "content_block_start"]
        final = stream.get_final_message()
    check(final)
    assert starts == [b.type for b in final.content]
    assert starts.count("tool_use") == 2 and ("text" in starts) == bool(content)
