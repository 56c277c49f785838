"""The Ollama API through a real server, with real HTTP (httpx) and the official ``ollama``
client: chat and generate (NDJSON streams and stream: false), the cache across turns (equal
to the uncached server), tools and thinking (scripted replies), the model endpoints, errors."""

import json

import httpx
import pytest

pytest.importorskip("torch")
ollama = pytest.importorskip("ollama")

pytestmark = pytest.mark.server

SYSTEM = "You are a travel agent. Answer questions about trips, flights and hotels. " * 4
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Forecast for a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}]  # fmt: skip
SCRIPT = {"replies": [
    {"turn": 0, "match": "weather", "content": "<think>Call it.</think>",
     "tool_calls": [{"name": "get_weather", "arguments": {"city": "Lima"}}]},
    {"turn": 1, "content": "<think>Sunny.</think>It is sunny in Lima."},
]}  # fmt: skip
GREEDY = {"temperature": 0, "num_predict": 10}


@pytest.fixture(scope="module")
def servers(tiny_llama_dir, tmp_path_factory):
    from conftest import ServerProcess

    home = tmp_path_factory.mktemp("ollama")
    (home / "script.json").write_text(json.dumps(SCRIPT))
    args = ["--engine", "torch", "--model", tiny_llama_dir, "--block-size", "16",
            "--prefill-chunk", "64", "--max-context", "2048"]  # fmt: skip
    env = {"PROMPTCACHE_HOME": str(home)}
    on = ServerProcess(args, env=env, log=home / "on.log").start()
    off = ServerProcess([*args, "--no-cache"], env=env, log=home / "off.log").start()
    scripted = ServerProcess(
        [*args, "--reasoning-parser", "think", "--scripted-replies", str(home / "script.json")],
        env={"PROMPTCACHE_HOME": str(home / "scripted")}, log=home / "scripted.log",
    ).start()  # fmt: skip
    yield on, off, scripted
    for srv in (on, off, scripted):
        srv.stop()


def client(srv, **headers):
    return ollama.Client(host=srv.url, headers=headers or None)


def ndjson(r):
    assert r.headers["content-type"].startswith("application/x-ndjson")
    return [json.loads(ln) for ln in r.text.splitlines() if ln.strip()]


def chat_raw(srv, **body):
    r = httpx.post(srv.url + "/api/chat", json={"model": "tiny", "stream": False, **body},
                   timeout=120)  # fmt: skip
    assert r.status_code == 200, r.text
    return r.json()


def test_chat_turns_hit_the_cache_and_equal_the_uncached_server(servers):
    on, off, _ = servers
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Lima?"}]
    before = 0
    for turn in range(2):
        got = chat_raw(on, messages=messages, options=GREEDY)
        ref = client(off).chat(model="tiny", messages=messages, options=GREEDY, stream=False)
        assert got["message"]["content"] == ref.message.content
        assert got["done"] and got["done_reason"] == "length" and got["eval_count"] == 10
        if turn:  # the history is cached: only the new tokens are evaluated
            assert got["cached_tokens"] > 0.8 * before
            assert got["prompt_eval_count"] < ref.prompt_eval_count
        before = got["prompt_eval_count"] + got["cached_tokens"] + got["eval_count"]
        messages += [{"role": "assistant", "content": got["message"]["content"]},
                     {"role": "user", "content": "And Tokyo?"}]  # fmt: skip


def test_chat_stream_is_ndjson_and_adds_up(servers):
    on, _, _ = servers
    body = {"model": "tiny", "messages": [{"role": "user", "content": "Paris?"}],
            "options": GREEDY}  # fmt: skip
    lines = ndjson(httpx.post(on.url + "/api/chat", json=body, timeout=60))  # streamed by default
    assert all(not x["done"] for x in lines[:-1]) and lines[-1]["done"]
    streamed = "".join(x["message"]["content"] for x in lines)
    plain = httpx.post(on.url + "/api/chat", json={**body, "stream": False}, timeout=60).json()
    assert streamed == plain["message"]["content"]
    parts = list(client(on).chat(model="tiny", messages=body["messages"], options=GREEDY,
                                 stream=True))  # fmt: skip
    assert "".join(p.message.content or "" for p in parts) == streamed
    assert parts[-1].done and parts[-1].eval_count == 10 and parts[-1].total_duration > 0


def test_generate_plain_raw_and_load(servers):
    on, off, _ = servers
    r = [client(s).generate(model="tiny", prompt="Once upon", system=SYSTEM, options=GREEDY)
         for s in (on, off)]  # fmt: skip
    assert r[0].response == r[1].response and r[0].done
    chunks = list(client(on).generate(model="tiny", prompt="Once upon", system=SYSTEM,
                                      options=GREEDY, stream=True))  # fmt: skip
    assert "".join(c.response for c in chunks) == r[0].response
    raw = client(on).generate(model="tiny", prompt="Once upon", raw=True, options=GREEDY)
    assert raw.eval_count == 10
    load = httpx.post(on.url + "/api/generate", json={"model": "tiny"}, timeout=30).json()
    assert load["done"] and load["done_reason"] == "load"


def test_tools_and_thinking_round_trip(servers):
    """A scripted call (Ollama's shape: object arguments), its result sent back by tool_name:
    the second turn reuses the first from the cache; thinking never leaks into content."""
    _, _, scripted = servers
    c = client(scripted)
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "weather?"}]
    first = c.chat(model="tiny", messages=messages, tools=TOOLS, options={"num_predict": 300})
    raw = chat_raw(scripted, messages=messages, tools=TOOLS, options={"num_predict": 300})
    calls = first.message.tool_calls
    assert [(t.function.name, dict(t.function.arguments)) for t in calls] == [
        ("get_weather", {"city": "Lima"})
    ]
    assert first.message.thinking == "Call it." and not first.message.content
    messages += [first.message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_name": "get_weather", "content": "sunny"}]  # fmt: skip
    parts = list(c.chat(model="tiny", messages=messages, tools=TOOLS, stream=True,
                        options={"num_predict": 300}))  # fmt: skip
    assert "".join(p.message.content or "" for p in parts) == "It is sunny in Lima."
    assert "".join(p.message.thinking or "" for p in parts) == "Sunny."
    again = chat_raw(scripted, messages=messages, tools=TOOLS, options={"num_predict": 300})
    assert again["message"]["content"] == "It is sunny in Lima."
    before = raw["prompt_eval_count"] + raw["cached_tokens"] + raw["eval_count"]
    # the second turn evaluated little more than what the first did not hold (prompt + call)
    second_prompt = again["prompt_eval_count"] + again["cached_tokens"]
    assert parts[-1].prompt_eval_count <= second_prompt - 0.9 * before
    assert again["cached_tokens"] >= 0.9 * before


def test_model_endpoints(servers):
    on, _, scripted = servers
    c = client(on)
    (model,) = c.list().models
    assert model.model and model.details.family == "llama"
    shown = client(scripted).show("anything:latest")
    assert shown.modelinfo["llama.context_length"] == 2048
    assert set(shown.capabilities) >= {"completion", "tools", "thinking"}
    assert c.ps().models[0].context_length == 2048
    assert httpx.get(on.url + "/api/version").json()["version"]


def test_options_tenants_and_errors(servers):
    on, _, _ = servers
    body = {"model": "tiny", "stream": False, "messages": [{"role": "user", "content": SYSTEM}],
            "options": {**GREEDY, "num_ctx": 65536, "repeat_penalty": 1.1, "num_predict": 3}}  # fmt: skip
    r = httpx.post(on.url + "/api/chat", json=body, timeout=60)
    assert r.status_code == 200 and r.json()["eval_count"] == 3
    assert r.headers["x-promptcache-ignored-options"] == "num_ctx,repeat_penalty"
    # option names that cannot go in a header (non-Latin-1, CR/LF) are ignored too, not a 500
    odd = {**body, "options": {**body["options"], "\u00ee\U0001f600": 1, "a\r\nx-evil: 1": 2}}
    r = httpx.post(on.url + "/api/chat", json=odd, timeout=60)
    assert r.status_code == 200 and "x-evil" not in r.headers
    assert r.headers["x-promptcache-ignored-options"] == "num_ctx,repeat_penalty"
    other = httpx.post(on.url + "/api/chat", json=body, timeout=60,
                       headers={"x-promptcache-tenant": "elsewhere"}).json()  # fmt: skip
    assert other["cached_tokens"] == 0  # tenants never share a cached block
    again = httpx.post(on.url + "/api/chat", json=body, timeout=60).json()
    assert again["cached_tokens"] > 0
    for bad in ({"messages": []}, {"messages": [{"role": "wizard", "content": "x"}]},
                {"options": {"temperature": "hot"}}, {"format": "yaml"}):  # fmt: skip
        r = httpx.post(on.url + "/api/chat", json={**body, **bad}, timeout=30)
        assert r.status_code == 400 and isinstance(r.json()["error"], str), (bad, r.text)
    with pytest.raises(ollama.ResponseError) as exc:
        client(on).chat(model="tiny", messages=[{"role": "user", "content": "word " * 3000}])
    assert exc.value.status_code == 400 and "context" in str(exc.value)
    # greedy: at Ollama's default temperature (0.8) a sampled end-of-turn may stop it early
    long = {"model": "tiny", "prompt": "ab " * 900, "stream": False,
            "options": {"num_predict": -1, "temperature": 0}}  # fmt: skip
    r = httpx.post(on.url + "/api/generate", json=long, timeout=120)
    # -1: until the context is full, as asked; nothing clamped to report
    assert r.status_code == 200 and "x-promptcache-max-tokens-clamped" not in r.headers
    out = r.json()
    prompt = out["prompt_eval_count"] + out["cached_tokens"]  # evaluated + served by the cache
    assert prompt + out["eval_count"] == 2048 and out["done_reason"] == "length"
