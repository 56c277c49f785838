"""The OpenAI Responses API through a real server and the official openai client: create,
stream (typed events validated against the client's own types), function calls round trip,
previous_response_id continuation hitting the cache, GET/DELETE, and clear 400s."""

import json

import httpx
import pytest

pytest.importorskip("torch")
openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")
from openai.types.responses import Response, ResponseStreamEvent  # noqa: E402
from pydantic import TypeAdapter  # noqa: E402

pytestmark = pytest.mark.server

EVENTS = TypeAdapter(ResponseStreamEvent)
INSTRUCTIONS = "You are a travel agent. Use the tools to answer questions about trips. " * 4
WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "enum": ["Paris", "Tokyo", "Lima"]}},
    "required": ["city"],
    "additionalProperties": False,
}
TOOLS = [{"type": "function", "name": "get_weather", "description": "Forecast for a city",
          "parameters": WEATHER}]  # fmt: skip
CHOICE = {"type": "object", "properties": {"pick": {"type": "string", "enum": ["yes", "no"]}},
          "required": ["pick"], "additionalProperties": False}  # fmt: skip
JSON_FORMAT = {"format": {"type": "json_schema", "name": "pick", "schema": CHOICE, "strict": True}}


@pytest.fixture(scope="module")
def servers(tiny_llama_dir, tmp_path_factory):
    from conftest import ServerProcess

    home = tmp_path_factory.mktemp("responses")
    args = ["--engine", "torch", "--model", tiny_llama_dir, "--block-size", "16",
            "--prefill-chunk", "64", "--max-context", "2048"]  # fmt: skip
    env = {"PROMPTCACHE_HOME": str(home)}
    on = ServerProcess(args, env=env, log=home / "on.log").start()
    off = ServerProcess([*args, "--no-cache"], env=env, log=home / "off.log").start()
    yield on, off
    on.stop()
    off.stop()


def oa(srv, **headers):
    return openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0,
                         default_headers=headers or None)  # fmt: skip


def raw(srv, body, **headers):
    return httpx.post(srv.url + "/v1/responses", json=body, headers=headers, timeout=120)


def sse_events(text):
    out = []
    for block in text.split("\n\n"):
        data = [line[6:] for line in block.splitlines() if line.startswith("data: ")]
        if data:
            out.append(json.loads(data[0]))
    return out


def test_create_matches_the_client_types_and_the_uncached_server(servers):
    on, off = servers
    body = {"model": "m", "input": "Plan a trip to Lima", "instructions": INSTRUCTIONS,
            "max_output_tokens": 12, "temperature": 0}  # fmt: skip
    got = [raw(srv, body).json() for srv in (on, off)]
    for r in got:
        Response.model_validate(r)  # every required field, every literal
        assert r["object"] == "response" and r["status"] == "incomplete"
        assert r["incomplete_details"] == {"reason": "max_output_tokens"}
        assert r["usage"]["output_tokens"] == 12
    texts = [r["output"][0]["content"][0]["text"] for r in got]
    assert texts[0] == texts[1]
    # the official client: a plain string input and output_text
    r = oa(on).responses.create(model="m", input="Plan a trip to Lima", instructions=INSTRUCTIONS,
                                max_output_tokens=12, temperature=0)  # fmt: skip
    assert r.output_text == texts[0]
    assert r.usage.input_tokens_details.cached_tokens > 0  # the same prompt twice


def test_stream_events_are_typed_and_ordered(servers):
    on, off = servers
    body = {"model": "m", "input": [{"role": "user", "content": [
        {"type": "input_text", "text": "Pick one"}]}], "instructions": INSTRUCTIONS,
        "max_output_tokens": 40, "temperature": 0, "text": JSON_FORMAT, "stream": True}  # fmt: skip
    r = raw(on, body)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = sse_events(r.text)
    for ev in events:
        EVENTS.validate_python(ev)
    kinds = [ev["type"] for ev in events]
    assert kinds[:4] == ["response.created", "response.in_progress",
                         "response.output_item.added", "response.content_part.added"]  # fmt: skip
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done",
                          "response.output_item.done", "response.completed"]  # fmt: skip
    assert [ev["sequence_number"] for ev in events] == list(range(len(events)))
    deltas = "".join(ev["delta"] for ev in events if ev["type"] == "response.output_text.delta")
    final = events[-1]["response"]
    assert final["output"][0]["content"][0]["text"] == deltas
    jsonschema.validate(json.loads(deltas), CHOICE)
    plain = raw(off, {**body, "stream": False}).json()  # equal to the uncached, unstreamed one
    assert plain["output"][0]["content"][0]["text"] == deltas
    # the client's stream helper assembles the same response
    with oa(on).responses.stream(model="m", input="Pick one", instructions=INSTRUCTIONS,
                                 max_output_tokens=40, temperature=0, text=JSON_FORMAT) as s:  # fmt: skip
        seen = [ev.type for ev in s]
        final = s.get_final_response()
    assert "response.output_text.delta" in seen and final.status == "completed"
    assert final.output_text == deltas


@pytest.mark.parametrize("stream", [False, True])
def test_function_call_round_trip_continues_from_the_stored_response(servers, stream):
    """A forced call, then only its output with previous_response_id: the second prompt reuses
    the first prompt and reply from the cache, and equals the full-input request (uncached)."""
    on, off = servers
    client = oa(on)
    kw = dict(model="m", instructions=INSTRUCTIONS, tools=TOOLS, tool_choice="required",
              parallel_tool_calls=False, max_output_tokens=150, temperature=0)  # fmt: skip
    first_input = [{"role": "user", "content": "Weather in Paris?"}]
    if stream:
        with client.responses.stream(input=first_input, **kw) as s:
            kinds = [ev.type for ev in s]
            first = s.get_final_response()
        assert "response.function_call_arguments.delta" in kinds
        assert "response.function_call_arguments.done" in kinds
    else:
        first = client.responses.create(input=first_input, **kw)
    calls = [item for item in first.output if item.type == "function_call"]
    assert first.status == "completed" and len(calls) == 1
    call = calls[0]
    assert call.name == "get_weather" and call.call_id.startswith("call_")
    jsonschema.validate(json.loads(call.arguments), WEATHER)
    result = {"type": "function_call_output", "call_id": call.call_id, "output": '{"sun": true}'}
    kw2 = {**kw, "tool_choice": "auto", "max_output_tokens": 8}
    second = client.responses.create(input=[result], previous_response_id=first.id, **kw2)
    before = first.usage.input_tokens + first.usage.output_tokens
    assert second.usage.input_tokens_details.cached_tokens >= 0.9 * before
    # the same conversation sent whole (what Codex does with store: false), uncached
    whole = [*first_input, call.model_dump(exclude_none=True), result]
    full = oa(off).responses.create(input=whole, store=False, **kw2)
    assert full.usage.input_tokens == second.usage.input_tokens
    assert full.output_text == second.output_text


def test_get_delete_and_tenants(servers):
    on, _ = servers
    body = {"model": "m", "input": "hi", "max_output_tokens": 2, "temperature": 0}
    r = raw(on, body, **{"x-promptcache-tenant": "t1"}).json()
    got = httpx.get(f"{on.url}/v1/responses/{r['id']}", headers={"x-promptcache-tenant": "t1"})
    assert got.status_code == 200 and got.json() == r
    other = httpx.get(f"{on.url}/v1/responses/{r['id']}", headers={"x-promptcache-tenant": "t2"})
    assert other.status_code == 404 and other.json()["error"]["message"]
    client = oa(on, **{"x-promptcache-tenant": "t1"})
    assert client.responses.retrieve(r["id"]).id == r["id"]
    client.responses.delete(r["id"])
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(r["id"])
    unstored = raw(on, {**body, "store": False}, **{"x-promptcache-tenant": "t1"}).json()
    assert httpx.get(f"{on.url}/v1/responses/{unstored['id']}",
                     headers={"x-promptcache-tenant": "t1"}).status_code == 404  # fmt: skip
    cont = raw(on, {**body, "previous_response_id": r["id"]}, **{"x-promptcache-tenant": "t1"})
    assert cont.status_code == 400 and "previous_response_id" in cont.json()["error"]["message"]


def test_session_deletion_removes_stored_responses(servers):
    on, _ = servers
    body = {"model": "m", "input": "hi", "max_output_tokens": 2, "temperature": 0,
            "prompt_cache_key": "sess-r1"}  # fmt: skip
    r = raw(on, body).json()
    gone = httpx.delete(f"{on.url}/v1/cache/sessions/sess-r1").json()
    assert gone["forgotten"]["responses"] == 1
    assert httpx.get(f"{on.url}/v1/responses/{r['id']}").status_code == 404


def test_hosted_and_unknown_tools_are_set_aside_and_said(servers):
    """Tools the server cannot run (hosted ones, a kind nobody has seen) are left out of the
    prompt, named in a header; the prompt is the one without them."""
    on, _ = servers
    body = {"model": "m", "input": "hi", "max_output_tokens": 2, "temperature": 0}
    plain = raw(on, {**body, "tools": TOOLS})
    assert "x-promptcache-ignored-tools" not in plain.headers
    odd = [
        {"type": "web_search"},
        {"type": "local_shell"},
        {"type": "teleport", "x": 1},
        {"type": "namespace", "name": "ops", "tools": [{"type": "mcp", "server_label": "s"}]},
    ]
    r = raw(on, {**body, "tools": [*odd, *TOOLS]})
    assert r.status_code == 200, r.text
    assert r.headers["x-promptcache-ignored-tools"] == "local_shell,mcp,teleport,web_search"
    Response.model_validate({**r.json(), "tools": TOOLS})  # the echo holds the odd ones as sent
    usage = r.json()["usage"]
    assert usage["input_tokens"] == plain.json()["usage"]["input_tokens"]
    assert usage["input_tokens_details"]["cached_tokens"] > 0


def test_custom_tools_map_to_a_string_function_and_back(servers):
    """A freeform (custom) tool, as Codex's apply_patch: offered to the model as a function of
    one string ``input``; its calls come back as custom_tool_call items and are sent back so."""
    from openai.types.responses import ResponseCustomToolCall

    from promptcache.server.responses_tools import call_item, read_tools

    on, _ = servers
    tool = {"type": "custom", "name": "apply_patch", "description": "Apply a patch"}
    tools = read_tools([tool])
    assert tools.functions[0]["function"]["parameters"]["required"] == ["input"]
    item = call_item("ctc_1", "call_1", "apply_patch", json.dumps({"input": "*** Begin"}), tools)
    assert ResponseCustomToolCall.model_validate(item).input == "*** Begin"
    history = [{"role": "user", "content": "Fix the bug"}, item,
               {"type": "custom_tool_call_output", "call_id": "call_1", "output": "done"}]  # fmt: skip
    body = {"model": "m", "input": history, "tools": [tool], "max_output_tokens": 4,
            "temperature": 0}  # fmt: skip
    first = raw(on, body)
    assert first.status_code == 200, first.text
    again = raw(on, body).json()
    assert again["usage"]["input_tokens_details"]["cached_tokens"] > 0


def test_namespace_tools_are_their_member_functions(servers):
    """Codex groups its sub-agent tools in a namespace tool: the members are offered, and a
    call to one names its namespace."""
    from openai.types.responses import ResponseFunctionToolCall

    from promptcache.server.responses_tools import call_item, read_tools

    on, _ = servers
    group = {"type": "namespace", "name": "agents", "description": "Sub-agents",
             "tools": [{"type": "function", "name": "spawn", "parameters": WEATHER}]}  # fmt: skip
    tools = read_tools([group, *TOOLS])
    assert [t["function"]["name"] for t in tools.functions] == ["spawn", "get_weather"]
    item = call_item("fc_1", "call_1", "spawn", '{"city": "Lima"}', tools)
    assert ResponseFunctionToolCall.model_validate(item).namespace == "agents"
    assert "namespace" not in call_item("fc_2", "call_2", "get_weather", "{}", tools)
    r = raw(on, {"model": "m", "input": "hi", "tools": [group], "max_output_tokens": 2})
    assert r.status_code == 200, r.text
    Response.model_validate(r.json())
    # a member named like another tool is offered qualified, and still routes to its own name
    clash = {"type": "namespace", "name": "ops",
             "tools": [{"type": "function", "name": "get_weather", "parameters": WEATHER}]}  # fmt: skip
    tools = read_tools([*TOOLS, clash])
    assert [t["function"]["name"] for t in tools.functions] == ["get_weather", "ops.get_weather"]
    item = call_item("fc_3", "call_3", "ops.get_weather", "{}", tools)
    assert (item["namespace"], item["name"]) == ("ops", "get_weather")
    assert tools.offered("get_weather", "ops") == "ops.get_weather"


def test_additional_tools_items_as_codex_sends_them(servers):
    """Codex's default request for its own models (code mode) carries its tools in an
    ``additional_tools`` input item: a namespace ``functions`` holding the freeform ``exec``.
    Offered as tools; a call comes back as a custom_tool_call naming the namespace, and the
    history holding it renders the prompt before it again (the cache holds it)."""
    from openai.types.responses import ResponseCustomToolCall

    from promptcache.server.responses_tools import call_item, read_tools

    on, _ = servers
    exec_tool = {
        "type": "custom",
        "name": "exec",
        "description": "Run JavaScript",
        "format": {"type": "grammar", "syntax": "lark", "definition": "start: /.+/"},
    }
    extra = {"type": "additional_tools", "id": "at_1", "role": "developer",
             "tools": [{"type": "namespace", "name": "functions", "description": "",
                        "tools": [exec_tool]}, {"type": "image_generation"}]}  # fmt: skip
    tools = read_tools(extra["tools"])
    item = call_item("ctc_1", "call_1", "exec", json.dumps({"input": "text(1)"}), tools)
    assert ResponseCustomToolCall.model_validate(item).namespace == "functions"
    user = {"role": "user", "content": [{"type": "input_text", "text": "List the files"}]}
    body = {"model": "m", "input": [extra, user], "max_output_tokens": 2, "temperature": 0}
    first = raw(on, body)
    assert first.status_code == 200, first.text
    assert first.headers["x-promptcache-ignored-tools"] == "image_generation"
    bare = raw(on, {**body, "input": [user]}).json()["usage"]["input_tokens"]
    assert first.json()["usage"]["input_tokens"] > bare + 5  # exec reached the prompt
    result = {"type": "custom_tool_call_output", "call_id": "call_1", "output": "notes.txt"}
    again = raw(on, {**body, "input": [extra, user, item, result]})
    assert again.status_code == 200, again.text
    prompt = first.json()["usage"]["input_tokens"]
    assert again.json()["usage"]["input_tokens_details"]["cached_tokens"] >= 0.9 * prompt


@pytest.mark.parametrize(
    "extra",
    [
        {"tools": [{"type": "custom"}]},
        {"tools": [{"type": "function"}]},
        {"tools": [{"type": "namespace", "name": "x"}]},
        {"input": [{"type": "computer_call_output", "call_id": "c", "output": {}}]},
        {"input": [{"role": "wizard", "content": "x"}]},
        {"text": {"format": {"type": "json_schema", "name": "x", "schema": 3}}},
        {"tool_choice": "sometimes"},
        {"previous_response_id": "resp_nope"},
        {"input": []},
        {"max_output_tokens": 0},
    ],
)
def test_bad_requests_get_a_clear_400(servers, extra):
    on, _ = servers
    r = raw(on, {"model": "m", "input": "hi", "max_output_tokens": 2, **extra})
    assert r.status_code == 400, (extra, r.text)
    assert r.json()["error"]["message"]


SCRIPT = {"replies": [
    {"match": "ponder", "content": "<think>I should greet.</think>Hello!"},
    {"turn": 0, "match": "weather", "content": "<think>Call it.</think>",
     "tool_calls": [{"name": "get_weather", "arguments": {"city": "Lima"}}]},
    {"turn": 1, "content": "<think>Sunny.</think>It is sunny in Lima."},
]}  # fmt: skip


@pytest.fixture(scope="module")
def scripted(tiny_llama_dir, tmp_path_factory):
    """Replies from a script (reasoning and calls the tiny model would never write), read by
    the think reasoning parser."""
    from conftest import ServerProcess

    home = tmp_path_factory.mktemp("scripted")
    (home / "script.json").write_text(json.dumps(SCRIPT))
    srv = ServerProcess(["--engine", "torch", "--model", tiny_llama_dir, "--block-size", "16",
                         "--max-context", "2048", "--reasoning-parser", "think",
                         "--scripted-replies", str(home / "script.json")],
                        env={"PROMPTCACHE_HOME": str(home)}, log=home / "srv.log").start()  # fmt: skip
    yield srv
    srv.stop()


@pytest.mark.parametrize("stream", [False, True])
def test_reasoning_comes_back_as_a_reasoning_item(scripted, stream):
    client = oa(scripted)
    kw = dict(model="m", input="please ponder", max_output_tokens=60, reasoning={"effort": "low"})
    if stream:
        with client.responses.stream(**kw) as s:
            kinds = [ev.type for ev in s]
            r = s.get_final_response()
        assert "response.reasoning_text.delta" in kinds
        assert kinds.index("response.reasoning_text.done") < kinds.index(
            "response.output_text.delta"
        )
    else:
        r = client.responses.create(**kw)
    assert [item.type for item in r.output] == ["reasoning", "message"]
    assert r.output[0].content[0].text == "I should greet."
    assert r.output_text == "Hello!"  # never the reasoning


def test_tool_loop_with_reasoning_sent_back_or_stored(scripted):
    """A call with reasoning, then its result: continued by previous_response_id, or the whole
    conversation sent back (reasoning item included, as Codex does with store: false). Both
    render the same prompt, which reuses the first turn from the cache."""
    client = oa(scripted)
    kw = dict(model="m", instructions=INSTRUCTIONS, tools=TOOLS, max_output_tokens=300)
    first = client.responses.create(input="weather in Lima?", **kw)
    assert [i.type for i in first.output] == ["reasoning", "function_call"], first.output
    call = first.output[1]
    assert json.loads(call.arguments) == {"city": "Lima"}
    result = {"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}
    second = client.responses.create(input=[result], previous_response_id=first.id, **kw)
    assert second.output_text == "It is sunny in Lima."
    before = first.usage.input_tokens + first.usage.output_tokens
    assert second.usage.input_tokens_details.cached_tokens >= 0.9 * before
    whole = [{"role": "user", "content": "weather in Lima?"},
             *[i.model_dump(exclude_none=True) for i in first.output], result]  # fmt: skip
    replay = client.responses.create(input=whole, store=False, **kw)
    assert replay.usage.input_tokens == second.usage.input_tokens
    assert replay.usage.input_tokens_details.cached_tokens >= 0.9 * before
    assert replay.output_text == second.output_text


def test_model_metadata_for_openai_and_anthropic_clients(scripted):
    anthropic = pytest.importorskip("anthropic")
    from anthropic.types import ModelInfo
    from openai.types import Model

    card = oa(scripted).models.list().data[0]
    raw_list = httpx.get(scripted.url + "/v1/models").json()
    entry = raw_list["data"][0]
    Model.model_validate(entry)
    assert entry["context_length"] == entry["max_model_len"] == 2048
    assert entry["engine"] == "torch"
    assert entry["capabilities"] == {"completion": True, "tools": True, "vision": False,
                                     "reasoning": True, "json_schema": True}  # fmt: skip
    one = httpx.get(scripted.url + "/v1/models/my-alias").json()
    assert one["id"] == "my-alias" and one["max_model_len"] == 2048 and one["root"] == card.id
    client = anthropic.Anthropic(base_url=scripted.url, api_key="x", max_retries=0)
    page = client.models.list()
    info = page.data[0]
    ModelInfo.model_validate(info.model_dump())
    assert info.max_input_tokens == 2048 and info.capabilities.thinking.supported
    assert client.models.retrieve("claude-x").id == "claude-x"


def test_response_store_bounds_ages_and_forgets(monkeypatch):
    from promptcache.server import response_store
    from promptcache.server.response_store import ResponseStore

    clock = [1000.0]
    monkeypatch.setattr(response_store.time, "time", lambda: clock[0])
    store = ResponseStore(max_per_tenant=2, ttl_s=60)
    for rid, session in (("a", "s1"), ("b", "s2"), ("c", "s1")):
        store.put("t", {"id": rid}, [{"role": "user", "content": rid}], session)
    assert store.get("t", "a") is None and store.get("t", "b") is not None  # oldest went
    assert store.get("u", "b") is None  # another tenant's
    assert store.forget("t", "s1") == 1 and store.get("t", "c") is None
    clock[0] += 61
    assert store.get("t", "b") is None and len(store) == 0  # aged out
    store.put("t", {"id": "d"}, [], "")
    assert store.delete("t", "d") and not store.delete("t", "d")
    store.put("t", {"id": "e"}, [], "x")
    assert store.forget("t", None) == 1 and len(store) == 0
