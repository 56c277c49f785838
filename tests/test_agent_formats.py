"""Agent families end to end: tiny Qwen3.5 (hybrid, XML calls, <think> in the prompt), gpt-oss
(harmony) and DeepSeek V3.1-format (attention only; arguments concatenated by the template)
models with their own templates, through a real server and the official clients.

Forced tool calls come out in the family's format (the grammar writes it), reasoning never
reaches content, streamed Anthropic calls open no text block, and a 4-turn tool loop reuses the
previous turn (>= 95% of prompt + reply on the attention models, >= the previous prompt on the
Qwen3.5 hybrid) with replies equal to an uncached server's.
"""

import json

import httpx
import pytest

pytest.importorskip("torch")
openai = pytest.importorskip("openai")
anthropic = pytest.importorskip("anthropic")

pytestmark = pytest.mark.server

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "enum": ["Paris", "Tokyo", "Lima"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "days"],
}
AIRPORT = {
    "type": "object",
    "properties": {
        "code": {"type": "string", "pattern": "^[A-Z]{3}$"},
        "near": {"type": "boolean"},
    },
    "required": ["code", "near"],
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Forecast",
                                      "parameters": WEATHER}},
    {"type": "function", "function": {"name": "find_airport", "description": "Airport by code",
                                      "parameters": AIRPORT}},
]  # fmt: skip
A_TOOLS = [
    {"name": t["function"]["name"], "description": t["function"]["description"],
     "input_schema": t["function"]["parameters"]}
    for t in TOOLS
]  # fmt: skip
SYSTEM = "You are a travel agent. Use the tools to answer questions about trips. " * 3
KINDS = ("qwen3_5", "gpt_oss", "deepseek_v31")
MARKUP = (
    "<tool_call>",
    "<function=",
    "<|channel|>",
    "<|message|>",
    "<think>",
    "</think>",
    "<｜tool▁calls▁begin｜>",
    "<｜tool▁sep｜>",
)


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    from agent_models import save_agent_model
    from conftest import ServerProcess

    out = {}
    for kind in KINDS:
        home = tmp_path_factory.mktemp(kind)
        model = save_agent_model(kind, str(home / "model"))
        args = ["--engine", "torch", "--model", model, "--block-size", "16",
                "--prefill-chunk", "64", "--max-context", "4096"]  # fmt: skip
        env = {"PROMPTCACHE_HOME": str(home)}
        on = ServerProcess(args, env=env, log=home / "on.log").start()
        off = ServerProcess([*args, "--no-cache"], env=env, log=home / "off.log").start()
        out[kind] = (on, off)
    yield out
    for on, off in out.values():
        on.stop()
        off.stop()


def oa(srv):
    return openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0)


def an(srv):
    return anthropic.Anthropic(base_url=srv.url, api_key="x", max_retries=0)


def last_record(srv) -> dict:
    return max(httpx.get(srv.url + "/v1/cache/requests").json()["requests"], key=lambda r: r["id"])


@pytest.mark.parametrize("kind", KINDS)
def test_forced_agent_loop_reuses_every_turn_and_matches_no_cache(servers, kind):
    on, off = servers[kind]
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Plan a trip"}]
    before = None
    reuse = []
    for turn in range(4):
        kw = dict(model="m", messages=messages, tools=TOOLS, tool_choice="required",
                  parallel_tool_calls=False, max_tokens=120, temperature=0)  # fmt: skip
        r = oa(on).chat.completions.create(**kw)
        r_off = oa(off).chat.completions.create(**kw)
        msg, msg_off = r.choices[0].message, r_off.choices[0].message
        assert r.choices[0].finish_reason == "tool_calls", msg
        assert [(c.function.name, c.function.arguments) for c in msg.tool_calls] == [
            (c.function.name, c.function.arguments) for c in msg_off.tool_calls
        ]
        assert not any(m in (msg.content or "") for m in MARKUP)
        cached = r.usage.prompt_tokens_details.cached_tokens
        if before is not None:
            prompt, reply = before
            need = prompt if kind == "qwen3_5" else 0.95 * (prompt + reply)
            reuse.append((cached, prompt, reply))
            assert cached >= need, (turn, reuse, last_record(on))
        before = (r.usage.prompt_tokens, r.usage.completion_tokens)
        messages.append(msg.model_dump(exclude_none=True))
        for call in msg.tool_calls:
            json.loads(call.function.arguments)
            messages.append({"role": "tool", "tool_call_id": call.id, "content": f"ok {turn}"})
    print(kind, "reuse per turn (cached, previous prompt, previous reply):", reuse)
    # a client that edits the last call: the miss names the assistant message where it differs
    edited = [dict(m) for m in messages]
    k = max(i for i, m in enumerate(edited) if m["role"] == "assistant")
    call = edited[k]["tool_calls"][0]
    edited[k]["tool_calls"] = [
        {**call, "function": {"name": "find_airport", "arguments": '{"code": "ZZZ", "near": true}'}}
    ]
    r = oa(on).chat.completions.create(model="m", messages=edited, tools=TOOLS, max_tokens=2,
                                       temperature=0)  # fmt: skip
    rec = last_record(on)
    print(kind, "edited call:", rec["reason"], rec["detail"])
    assert rec["reason"] in ("diverged", "snapshot"), rec  # both have snapshot layers
    assert (rec["detail"]["message_index"], rec["detail"]["role"]) == (k, "assistant"), rec
    assert r.usage.prompt_tokens_details.cached_tokens > 0.5 * r.usage.prompt_tokens


@pytest.mark.parametrize("kind", KINDS)
def test_anthropic_forced_stream_has_no_text_block(servers, kind):
    on, _ = servers[kind]
    # greedy: sampled at the default temperature a random model's arguments sometimes run past
    # max_tokens, and a call cut short is returned as text (finish_reason length), by design
    with an(on).messages.stream(
        model="m", max_tokens=120, system=SYSTEM, tools=A_TOOLS, tool_choice={"type": "any"},
        messages=[{"role": "user", "content": "Weather in Lima?"}], extra_body={"temperature": 0},
    ) as stream:  # fmt: skip
        kinds = [ev.content_block.type for ev in stream if ev.type == "content_block_start"]
        final = stream.get_final_message()
    assert kinds and set(kinds) == {"tool_use"}, kinds
    assert final.stop_reason == "tool_use"
    assert final.content[0].name in ("get_weather", "find_airport")


def test_qwen_reasoning_never_reaches_content(servers):
    """Qwen3.5's prompt opens <think>: an unforced reply cut by max_tokens is all reasoning."""
    on, _ = servers["qwen3_5"]
    kw = dict(model="m", messages=[{"role": "user", "content": "Hello"}], max_tokens=24,
              temperature=0)  # fmt: skip
    r = oa(on).chat.completions.create(**kw)
    reasoning = r.model_dump()["choices"][0]["message"].get("reasoning_content")
    assert reasoning and not r.choices[0].message.content
    chunks = list(oa(on).chat.completions.create(**kw, stream=True))
    streamed = "".join(c.model_dump()["choices"][0]["delta"].get("reasoning_content") or ""
                       for c in chunks if c.choices)  # fmt: skip
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == reasoning and text == ""
    m = an(on).messages.create(
        model="m", max_tokens=24, messages=kw["messages"], extra_body={"temperature": 0}
    )
    assert m.content[0].type == "thinking" and m.content[0].thinking == reasoning
    assert m.content[0].signature
    # thinking blocks come back in history and reach the template as the turn's reasoning
    # (Qwen3.5 keeps it for the turns after the last user message: here, a tool loop)
    use = {"type": "tool_use", "id": "toolu_1", "name": "get_weather",
           "input": {"city": "Lima", "days": 2}}  # fmt: skip
    thought = {"type": "thinking", "thinking": "Lima, two days.", "signature": "abc"}
    result = {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1",
                                           "content": "sunny"}]}  # fmt: skip

    def count(blocks):
        history = [*kw["messages"], {"role": "assistant", "content": blocks}, result]
        return an(on).messages.count_tokens(model="m", messages=history, tools=A_TOOLS).input_tokens

    assert count([thought, use]) > count([use])


def test_thinking_disabled_reaches_the_template(servers):
    on, _ = servers["qwen3_5"]
    messages = [{"role": "user", "content": "Hello"}]
    r = oa(on).chat.completions.create(model="m", messages=messages, max_tokens=16, temperature=0,
                                       extra_body={"enable_thinking": False})  # fmt: skip
    assert not r.model_dump()["choices"][0]["message"].get("reasoning_content")
    count = an(on).messages.count_tokens(model="m", messages=messages)
    off = an(on).messages.count_tokens(model="m", messages=messages, thinking={"type": "disabled"})
    assert off.input_tokens > count.input_tokens  # <think>\n\n</think>\n\n vs <think>\n


def test_harmony_json_answer_on_the_final_channel(servers):
    on, off = servers["gpt_oss"]
    schema = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Lima"]}},
              "additionalProperties": False,
              "required": ["city"]}  # fmt: skip
    kw = dict(model="m", messages=[{"role": "user", "content": "City?"}], max_tokens=40,
              temperature=0, response_format={"type": "json_schema",
                                              "json_schema": {"name": "c", "schema": schema}})  # fmt: skip
    r = oa(on).chat.completions.create(**kw)
    assert json.loads(r.choices[0].message.content) == {"city": "Lima"}


@pytest.mark.parametrize("kind", KINDS)
def test_streamed_forced_call_equals_the_whole_reply(servers, kind):
    on, _ = servers[kind]
    kw = dict(model="m", messages=[{"role": "user", "content": "Airport of Lima?"}], tools=TOOLS,
              tool_choice={"type": "function", "function": {"name": "find_airport"}},
              parallel_tool_calls=False, max_tokens=200, temperature=0)  # fmt: skip
    whole = oa(on).chat.completions.create(**kw).choices[0].message
    chunks = list(oa(on).chat.completions.create(**kw, stream=True))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    text = "".join(d.content or "" for d in deltas)
    calls = [tc for d in deltas for tc in d.tool_calls or []]
    args = "".join(tc.function.arguments or "" for tc in calls if tc.index == 0)
    assert text == (whole.content or "") and not any(m in text for m in MARKUP)
    assert calls[0].function.name == whole.tool_calls[0].function.name == "find_airport"
    assert json.loads(args) == json.loads(whole.tool_calls[0].function.arguments)
    assert set(json.loads(args)) == {"code", "near"}
