"""Agents end to end: tool calls, structured output and the request shapes agent clients send,
through a real server and the official openai and anthropic clients."""

import json
import re

import httpx
import pytest

pytest.importorskip("torch")
openai = pytest.importorskip("openai")
anthropic = pytest.importorskip("anthropic")
jsonschema = pytest.importorskip("jsonschema")

pytestmark = pytest.mark.server

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "enum": ["Paris", "Tokyo", "Lima"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}
LOOKUP = {
    "type": "object",
    "properties": {"code": {"type": "string", "pattern": "^[A-Z]{3}$"}},
    "required": ["code"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Forecast for a city",
                                      "parameters": WEATHER}},
    {"type": "function", "function": {"name": "lookup_airport", "description": "Airport by code",
                                      "parameters": LOOKUP}},
]  # fmt: skip
SCHEMAS = {"get_weather": WEATHER, "lookup_airport": LOOKUP}
A_TOOLS = [
    {"name": t["function"]["name"], "description": t["function"]["description"],
     "input_schema": t["function"]["parameters"]}
    for t in TOOLS
]  # fmt: skip
SYSTEM = "You are a travel agent. Use the tools to answer questions about trips. " * 4
MAX_CONTEXT = 2048


def _args(home, *extra):
    return ["--engine", "torch", "--model", home, "--block-size", "16", "--prefill-chunk", "64",
            "--max-context", str(MAX_CONTEXT), *extra]  # fmt: skip


@pytest.fixture(scope="module")
def servers(tiny_llama_dir, tmp_path_factory):
    from conftest import ServerProcess

    home = tmp_path_factory.mktemp("agents")
    env = {"PROMPTCACHE_HOME": str(home)}
    on = ServerProcess(_args(tiny_llama_dir), env=env, log=home / "on.log").start()
    off = ServerProcess(_args(tiny_llama_dir, "--no-cache"), env=env, log=home / "off.log").start()
    yield on, off, home
    on.stop()
    off.stop()


def oa(srv):
    return openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0)


def an(srv):
    return anthropic.Anthropic(base_url=srv.url, api_key="x", max_retries=0)


def check_call(name, arguments):
    jsonschema.validate(json.loads(arguments), SCHEMAS[name])


# -- tool calls as output -------------------------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("choice", ["required", "named"])
def test_openai_forced_tool_calls_are_valid(servers, stream, choice):
    on, _, _ = servers
    tool_choice = (
        "required" if choice == "required"
        else {"type": "function", "function": {"name": "lookup_airport"}}
    )  # fmt: skip
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Paris?"}]
    kw = dict(model="m", messages=messages, tools=TOOLS, tool_choice=tool_choice,
              parallel_tool_calls=False, max_tokens=150, temperature=0)  # fmt: skip
    if not stream:
        r = oa(on).chat.completions.create(**kw)
        assert r.choices[0].finish_reason == "tool_calls"
        calls = [
            (c.id, c.function.name, c.function.arguments) for c in r.choices[0].message.tool_calls
        ]
    else:
        calls, reasons = {}, []
        for chunk in oa(on).chat.completions.create(**kw, stream=True):
            reasons.append(chunk.choices[0].finish_reason)
            for d in chunk.choices[0].delta.tool_calls or []:
                cur = calls.setdefault(d.index, ["", "", ""])
                cur[0] = d.id or cur[0]
                cur[1] += (d.function.name or "") if d.function else ""
                cur[2] += (d.function.arguments or "") if d.function else ""
        assert reasons[-1] == "tool_calls"
        calls = [tuple(v) for _, v in sorted(calls.items())]
    assert len(calls) == 1
    cid, name, arguments = calls[0]
    assert cid.startswith("call_")
    if choice == "named":
        assert name == "lookup_airport"
    check_call(name, arguments)


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("choice", [{"type": "any"}, {"type": "tool", "name": "get_weather"}])
def test_anthropic_forced_tool_use_is_valid(servers, stream, choice):
    on, _, _ = servers
    # greedy: sampled, a random model's arguments can run past max_tokens (a call cut short)
    kw = dict(model="m", max_tokens=150, system=SYSTEM, tools=A_TOOLS,
              tool_choice={**choice, "disable_parallel_tool_use": True},
              messages=[{"role": "user", "content": "Weather in Lima?"}],
              extra_body={"temperature": 0})  # fmt: skip
    if stream:
        with an(on).messages.stream(**kw) as s:
            kinds = [ev.type for ev in s]
            m = s.get_final_message()
        assert "content_block_start" in kinds
    else:
        m = an(on).messages.create(**kw)
    assert m.stop_reason == "tool_use"
    uses = [b for b in m.content if b.type == "tool_use"]
    assert len(uses) == 1 and uses[0].id.startswith("toolu_")
    if choice["type"] == "tool":
        assert uses[0].name == "get_weather"
    check_call(uses[0].name, json.dumps(uses[0].input))


def test_agent_loop_reuses_previous_prompt_and_reply(servers):
    """Four tool turns: each request (the call rendered back, plus the tool result) reuses at
    least 95% of the previous prompt + reply, and every reply equals the uncached server's."""
    on, off, _ = servers
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Plan a trip"}]
    before = None
    for turn in range(4):
        kw = dict(model="m", messages=messages, tools=TOOLS, tool_choice="required",
                  parallel_tool_calls=False, max_tokens=150, temperature=0)  # fmt: skip
        r = oa(on).chat.completions.create(**kw)
        r_off = oa(off).chat.completions.create(**kw)
        call = r.choices[0].message.tool_calls[0]
        call_off = r_off.choices[0].message.tool_calls[0]
        assert (call.function.name, call.function.arguments) == (
            call_off.function.name,
            call_off.function.arguments,
        )
        if before is not None:
            assert r.usage.prompt_tokens_details.cached_tokens >= 0.95 * before, (turn, before)
        before = r.usage.prompt_tokens + r.usage.completion_tokens
        messages.append(r.choices[0].message.model_dump(exclude_none=True))
        messages.append(
            {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"ok": turn})}
        )
    stats = httpx.get(on.url + "/v1/cache/stats").json()["continuity"]
    assert stats["checked_turns"] >= 3 and stats["exact_turns"] >= 3, stats


def test_anthropic_agent_loop_reuses_previous_turn(servers):
    on, _, _ = servers
    messages = [{"role": "user", "content": "Check Tokyo, then Paris."}]
    before = None
    for turn in range(3):
        m = an(on).messages.create(model="m", max_tokens=150, system=SYSTEM, tools=A_TOOLS,
                                   tool_choice={"type": "any", "disable_parallel_tool_use": True},
                                   messages=messages, extra_body={"temperature": 0})  # fmt: skip
        if before is not None:
            assert m.usage.cache_read_input_tokens >= 0.95 * before
        before = m.usage.input_tokens + m.usage.cache_read_input_tokens + m.usage.output_tokens
        use = next(b for b in m.content if b.type == "tool_use")
        messages.append({"role": "assistant", "content": [b.model_dump() for b in m.content]})
        messages.append(
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": use.id, "content": f"result {turn}"}]}
        )  # fmt: skip


def test_tool_choice_none_and_auto_give_text_on_a_plain_reply(servers):
    on, off, _ = servers
    messages = [{"role": "user", "content": "Hello"}]
    for choice in ("none", "auto"):
        r = oa(on).chat.completions.create(
            model="m", messages=messages, tools=TOOLS, tool_choice=choice, max_tokens=8,
            temperature=0,
        )  # fmt: skip
        r_off = oa(off).chat.completions.create(
            model="m", messages=messages, tools=TOOLS, tool_choice=choice, max_tokens=8,
            temperature=0,
        )  # fmt: skip
        assert r.choices[0].message.content == r_off.choices[0].message.content
        assert r.choices[0].finish_reason in ("stop", "length")


@pytest.mark.parametrize("stream", [False, True])
def test_response_format_json_schema(servers, stream):
    on, off, _ = servers
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"},
              "n": {"type": "integer", "minimum": 0, "maximum": 99}},
              "required": ["ok", "n"], "additionalProperties": False}  # fmt: skip
    kw = dict(model="m", messages=[{"role": "user", "content": "Answer in JSON"}], max_tokens=40,
              temperature=0,
              response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": schema}})  # fmt: skip
    if stream:
        text = "".join(
            c.choices[0].delta.content or ""
            for c in oa(on).chat.completions.create(**kw, stream=True)
        )
    else:
        text = oa(on).chat.completions.create(**kw).choices[0].message.content
    jsonschema.validate(json.loads(text), schema)
    assert text == oa(off).chat.completions.create(**kw).choices[0].message.content


def test_anthropic_output_config_json_schema(servers):
    on, _, _ = servers
    schema = {"type": "object", "properties": {"title": {"type": "string", "maxLength": 12}},
              "required": ["title"], "additionalProperties": False}  # fmt: skip
    m = an(on).messages.create(
        model="m", max_tokens=40, messages=[{"role": "user", "content": "Title?"}],
        extra_body={"output_config": {"format": {"type": "json_schema", "schema": schema}}},
    )  # fmt: skip
    jsonschema.validate(json.loads(m.content[0].text), schema)


# -- the request shapes agent clients send --------------------------------------------------------


def post(srv, path, body, headers=None):
    return httpx.post(srv.url + path, json=body, headers=headers or {}, timeout=60)


def test_system_message_inside_messages(servers):
    on, _, _ = servers
    body = {"model": "m", "max_tokens": 4, "system": "You help.", "messages": [
        {"role": "user", "content": "hi"},
        {"role": "system", "content": "Available agent types: none"},
    ]}  # fmt: skip
    r = post(on, "/v1/messages", body)
    assert r.status_code == 200, r.text
    assert r.json()["content"][0]["type"] == "text"


def test_thinking_blocks_are_accepted_and_render_like_their_absence(servers):
    on, _, _ = servers
    plain = [{"role": "user", "content": "hi"},
             {"role": "assistant", "content": [{"type": "text", "text": "Hello!"}]},
             {"role": "user", "content": "more"}]  # fmt: skip
    thinking = [plain[0],
                {"role": "assistant", "content": [
                    {"type": "thinking", "thinking": "Let me think.", "signature": "sig"},
                    {"type": "redacted_thinking", "data": "abc"},
                    {"type": "text", "text": "Hello!"}]},
                plain[2]]  # fmt: skip
    counts = []
    for messages in (plain, thinking):
        r = post(on, "/v1/messages/count_tokens", {"model": "m", "messages": messages})
        assert r.status_code == 200, r.text
        counts.append(r.json()["input_tokens"])
    assert counts[0] == counts[1] > 0
    r = post(on, "/v1/messages", {"model": "m", "max_tokens": 4, "messages": thinking})
    assert r.status_code == 200, r.text


def test_agent_fields_and_beta_headers_are_accepted(servers):
    on, _, _ = servers
    body = {
        "model": "claude-opus-4-8", "max_tokens": 4, "stream": False,
        "system": [{"type": "text", "text": "x-anthropic-billing-header: cc_version=2.1.197.1ab; cc_entrypoint=sdk-cli;"},
                   {"type": "text", "text": "You help.", "cache_control": {"type": "ephemeral"}}],
        "messages": [{"role": "user", "content": [
            {"type": "text", "text": "hi", "cache_control": {"type": "ephemeral"}}]}],
        "metadata": {"user_id": json.dumps({"session_id": "s"})},
        "thinking": {"type": "adaptive"},
        "context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
        "output_config": {"effort": "high"},
        "tools": A_TOOLS, "tool_choice": {"type": "auto"},
    }  # fmt: skip
    headers = {"anthropic-beta": "claude-code-20250219,interleaved-thinking-2025-05-14,"
               "mid-conversation-system-2026-04-07", "anthropic-version": "2023-06-01"}  # fmt: skip
    r = post(on, "/v1/messages", body, headers)
    assert r.status_code == 200, r.text
    assert httpx.head(on.url + "/").status_code == 200


def test_count_tokens_matches_the_prompt_served(servers):
    on, _, _ = servers
    body = {"model": "m", "system": SYSTEM, "tools": A_TOOLS,
            "messages": [{"role": "user", "content": "How many tokens?"}]}  # fmt: skip
    counted = post(on, "/v1/messages/count_tokens", body).json()["input_tokens"]
    m = post(on, "/v1/messages", {**body, "max_tokens": 2}).json()
    assert counted == m["usage"]["input_tokens"] + m["usage"]["cache_read_input_tokens"]


def test_billing_header_does_not_break_the_shared_prefix(servers):
    on, _, _ = servers
    cached = []
    for suffix, prompt in (("123", "First session prompt"), ("8a5", "Another first prompt")):
        system = [{"type": "text", "text": f"x-anthropic-billing-header: cc_version=2.1.197.{suffix}; cc_entrypoint=sdk-cli;"},
                  {"type": "text", "text": SYSTEM + " Billing test."}]  # fmt: skip
        m = an(on).messages.create(model="m", max_tokens=2, system=system,
                                   messages=[{"role": "user", "content": prompt}])  # fmt: skip
        cached.append(m.usage.cache_read_input_tokens)
        total = m.usage.input_tokens + m.usage.cache_read_input_tokens
    assert cached[1] >= 0.8 * total, (cached, total)


@pytest.mark.parametrize(
    "block",
    [{"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBOR"}},
     {"type": "document", "source": {"type": "text", "media_type": "text/plain", "data": "x"}}],
)  # fmt: skip
def test_media_blocks_get_a_clear_4xx(servers, block):
    on, _, home = servers
    body = {"model": "m", "max_tokens": 4,
            "messages": [{"role": "user", "content": [block, {"type": "text", "text": "what?"}]}]}  # fmt: skip
    r = post(on, "/v1/messages", body)
    assert r.status_code == 400
    err = r.json()
    assert err["type"] == "error" and block["type"] in err["error"]["message"]
    assert "vision" in err["error"]["message"]
    assert post(on, "/v1/messages", {**body, "messages": body["messages"][:0] + [
        {"role": "user", "content": "still up?"}]}).status_code == 200  # fmt: skip
    assert block["type"] in (home / "on.log").read_text()  # the 4xx is logged with its reason


def test_openai_image_part_gets_a_clear_4xx(servers):
    on, _, _ = servers
    with pytest.raises(openai.BadRequestError) as exc:
        oa(on).chat.completions.create(model="m", max_tokens=2, messages=[{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}])  # fmt: skip
    assert "image" in str(exc.value)


def test_anthropic_prompt_too_long_uses_anthropics_wording(servers):
    on, _, _ = servers
    with pytest.raises(anthropic.BadRequestError) as exc:
        an(on).messages.create(model="m", max_tokens=4,
                               messages=[{"role": "user", "content": "word " * MAX_CONTEXT}])  # fmt: skip
    found = re.search(r"prompt is too long: (\d+) tokens > (\d+) maximum", str(exc.value))
    assert found and int(found.group(1)) > int(found.group(2)) == MAX_CONTEXT


def test_openai_prompt_too_long_is_context_length_exceeded(servers):
    on, _, _ = servers
    with pytest.raises(openai.BadRequestError) as exc:
        oa(on).chat.completions.create(model="m", max_tokens=4,
                                       messages=[{"role": "user", "content": "word " * MAX_CONTEXT}])  # fmt: skip
    assert exc.value.code == "context_length_exceeded"
    assert f"maximum context length is {MAX_CONTEXT} tokens" in str(exc.value)


def test_max_tokens_beyond_the_room_left_is_clamped(servers):
    """A max_tokens larger than the room the prompt leaves is clamped to the room, as local
    servers do (the header says to what); Anthropic's stop_reason says the context ran out."""
    on, off, _ = servers
    long = "ab " * 900
    count = post(on, "/v1/messages/count_tokens",
                 {"model": "m", "messages": [{"role": "user", "content": long}]}).json()  # fmt: skip
    room = MAX_CONTEXT - count["input_tokens"]
    body = {"model": "m", "max_tokens": room + 500, "messages": [{"role": "user", "content": long}]}
    r = post(on, "/v1/messages", body)
    assert r.headers["x-promptcache-max-tokens-clamped"] == str(room)
    assert r.json()["stop_reason"] in ("model_context_window_exceeded", "end_turn")
    assert r.json()["usage"]["output_tokens"] <= room
    replies = []
    for srv in (on, off):
        raw = oa(srv).chat.completions.with_raw_response.create(
            model="m", max_tokens=32000, temperature=0,
            messages=[{"role": "user", "content": long}])  # fmt: skip
        assert raw.headers["x-promptcache-max-tokens-clamped"] == str(room)
        replies.append(raw.parse())
    assert replies[0].choices[0].message.content == replies[1].choices[0].message.content
    assert replies[0].usage.completion_tokens <= room
    unclamped = post(on, "/v1/chat/completions",
                     {"model": "m", "max_tokens": 2, "messages": [{"role": "user", "content": long}]})  # fmt: skip
    assert "x-promptcache-max-tokens-clamped" not in unclamped.headers


def test_strict_max_tokens_keeps_the_400(tiny_llama_dir, server_factory):
    srv = server_factory(*_args(tiny_llama_dir, "--strict-max-tokens"))
    long = "ab " * 600
    with pytest.raises(openai.BadRequestError) as exc:
        oa(srv).chat.completions.create(model="m", max_tokens=MAX_CONTEXT,
                                        messages=[{"role": "user", "content": long}])  # fmt: skip
    assert exc.value.code == "context_length_exceeded"
    assert f"maximum context length is {MAX_CONTEXT} tokens" in str(exc.value)
    with pytest.raises(anthropic.BadRequestError) as aexc:
        an(srv).messages.create(model="m", max_tokens=MAX_CONTEXT,
                                messages=[{"role": "user", "content": long}])  # fmt: skip
    assert "exceed context limit" in str(aexc.value)
    r = httpx.post(srv.url + "/v1/responses", timeout=60, json={
        "model": "m", "input": long, "max_output_tokens": MAX_CONTEXT})  # fmt: skip
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    # without an explicit max_tokens the reply may fill the context: nothing to refuse
    ok = post(srv, "/v1/chat/completions",
              {"model": "m", "messages": [{"role": "user", "content": "ab " * 900}]})  # fmt: skip
    assert ok.status_code == 200 and "x-promptcache-max-tokens-clamped" not in ok.headers


def test_no_output_limit_generates_until_the_context_is_full(servers):
    """A request naming no limit may generate until the context is full (as llama.cpp, Ollama
    and OpenAI's API do), ending as each API ends a reply cut short; no clamp is reported."""
    on, _, _ = servers
    long = "ab " * 600
    count = post(on, "/v1/messages/count_tokens",
                 {"model": "m", "messages": [{"role": "user", "content": long}]}).json()  # fmt: skip
    room = MAX_CONTEXT - count["input_tokens"]
    assert room > 512  # past the old 512-token default
    msgs = [{"role": "user", "content": long}]
    r = post(on, "/v1/chat/completions", {"model": "m", "temperature": 0, "messages": msgs})
    assert "x-promptcache-max-tokens-clamped" not in r.headers
    body = r.json()
    assert body["usage"]["completion_tokens"] == room, body["usage"]  # a random model: no EOS
    assert body["choices"][0]["finish_reason"] == "length"
    r = httpx.post(on.url + "/v1/responses", timeout=120,
                   json={"model": "m", "input": msgs, "temperature": 0}).json()  # fmt: skip
    assert r["usage"]["output_tokens"] == room
    assert (r["status"], r["incomplete_details"]) == ("incomplete", {"reason": "max_output_tokens"})
    r = httpx.post(on.url + "/api/chat", timeout=120, json={
        "model": "m", "messages": msgs, "stream": False, "options": {"temperature": 0}}).json()  # fmt: skip
    assert r["eval_count"] == room and r["done_reason"] == "length"


def test_default_max_tokens_caps_a_request_naming_none(tiny_llama_dir, server_factory):
    srv = server_factory(*_args(tiny_llama_dir, "--default-max-tokens", "5"))
    msgs = [{"role": "user", "content": "Weather in Lima?"}]
    r = oa(srv).chat.completions.create(model="m", messages=msgs, temperature=0)
    assert (r.usage.completion_tokens, r.choices[0].finish_reason) == (5, "length")
    r = oa(srv).chat.completions.create(model="m", messages=msgs, temperature=0, max_tokens=7)
    assert r.usage.completion_tokens == 7  # the client's own limit wins
    r = oa(srv).responses.create(model="m", input="Weather in Lima?", temperature=0)
    assert (r.usage.output_tokens, r.status) == (5, "incomplete")
    assert r.incomplete_details.reason == "max_output_tokens"


def test_tools_the_server_cannot_run_are_set_aside(servers):
    """Chat completions tools of other kinds (custom, hosted) and Anthropic's server tools
    (web search, code execution, MCP toolsets) are left out of the prompt, named in a header;
    the request is served as without them."""
    on, _, _ = servers
    msgs = [{"role": "user", "content": "Weather in Lima?"}]
    base = {"model": "m", "max_tokens": 2, "temperature": 0, "messages": msgs}
    odd = [{"type": "custom", "custom": {"name": "patch"}}, {"type": "web_search_preview"}]
    plain = post(on, "/v1/chat/completions", {**base, "tools": TOOLS})
    r = post(on, "/v1/chat/completions", {**base, "tools": [*odd, *TOOLS]})
    assert r.status_code == 200, r.text
    assert r.headers["x-promptcache-ignored-tools"] == "custom,web_search_preview"
    assert r.json()["usage"]["prompt_tokens"] == plain.json()["usage"]["prompt_tokens"]
    assert "x-promptcache-ignored-tools" not in plain.headers
    # a kind no header can carry (outside Latin-1, a CR/LF) is set aside too, not a 500
    weird = [{"type": "r\u00e9sum\u00e9\u2603"}, {"type": "a\r\nx-evil: 1"}]
    r = post(on, "/v1/chat/completions", {**base, "tools": [*weird, *odd, *TOOLS]})
    assert r.status_code == 200, r.text
    assert r.headers["x-promptcache-ignored-tools"] == "custom,web_search_preview"
    assert "x-evil" not in r.headers
    server = [{"type": "web_search_20250305", "name": "web_search", "max_uses": 5},
              {"type": "code_execution_20250522", "name": "code_execution"},
              {"type": "mcp_toolset", "mcp_server_name": "docs"}]  # fmt: skip
    plain = post(on, "/v1/messages", {**base, "tools": A_TOOLS})
    r = post(on, "/v1/messages", {**base, "tools": [*server, *A_TOOLS]})
    assert r.status_code == 200, r.text
    said = "code_execution_20250522,mcp_toolset,web_search_20250305"
    assert r.headers["x-promptcache-ignored-tools"] == said
    assert r.json()["usage"]["input_tokens"] == plain.json()["usage"]["input_tokens"]
    kw = {"model": "m", "max_tokens": 2, "messages": msgs, "tools": [*server, *A_TOOLS]}
    with an(on).messages.stream(**kw) as s:
        assert s.response.headers["x-promptcache-ignored-tools"] == said
        assert s.get_final_message().stop_reason
    bad = post(on, "/v1/messages", {**base, "tools": [{"input_schema": {"type": "object"}}]})
    assert bad.status_code == 400 and "name" in bad.json()["error"]["message"]


def test_bad_tool_requests_get_4xx(servers):
    on, _, _ = servers
    bad = [
        {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
        {"tools": TOOLS, "tool_choice": "sometimes"},
        {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": 3}}},
        {"messages": [{"role": "assistant", "content": None, "tool_calls": [
            {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{bad"}}]}]},
    ]  # fmt: skip
    for extra in bad:
        body = {
            "model": "m",
            "max_tokens": 2,
            "messages": [{"role": "user", "content": "x"}],
            **extra,
        }
        r = post(on, "/v1/chat/completions", body)
        assert r.status_code == 400, (extra, r.text)
        assert r.json()["error"]["message"]
    assert httpx.get(on.url + "/health").status_code == 200
