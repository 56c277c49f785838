"""End to end: a real server process driven by the official openai and anthropic clients."""

import json
import threading
import time

import httpx
import pytest
from exposition import read_exposition

pytest.importorskip("torch")
openai = pytest.importorskip("openai")
anthropic = pytest.importorskip("anthropic")

pytestmark = pytest.mark.server

SYSTEM = (
    "You are a helpful assistant. Answer the user's question about flights, bookings and refunds. "
    * 3
)


def chat(client, messages, **kw):
    kw.setdefault("max_tokens", 12)
    kw.setdefault("temperature", 0)
    return client.chat.completions.create(model="any-name", messages=messages, **kw)


@pytest.fixture(scope="module", params=["torch", "mlx"])
def servers(request, tiny_llama_dir, tmp_path_factory):
    """A cached and an uncached server on the same tiny model, for each engine: every test in
    this module runs against both."""
    from conftest import ServerProcess

    if request.param == "mlx":
        pytest.importorskip("mlx_lm")
    home = tmp_path_factory.mktemp("home")
    common = [
        "--engine",
        request.param,
        "--model",
        tiny_llama_dir,
        "--block-size",
        "16",
        "--prefill-chunk",
        "64",
        "--max-context",
        "1024",
    ]
    on = ServerProcess(common, env={"PROMPTCACHE_HOME": str(home)}, log=home / "on.log").start()
    off = ServerProcess(
        [*common, "--no-cache"], env={"PROMPTCACHE_HOME": str(home)}, log=home / "off.log"
    ).start()
    yield on, off
    on.stop()
    off.stop()


def test_multi_turn_chat_hits_cache_and_equals_uncached(servers):
    on, off = servers
    c_on = openai.OpenAI(base_url=on.url + "/v1", api_key="x")
    c_off = openai.OpenAI(base_url=off.url + "/v1", api_key="x")
    messages = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": "Can I change my flight?"},
    ]
    cached = []
    for turn in range(4):
        r_on = chat(c_on, messages)
        r_off = chat(c_off, messages)
        assert r_on.choices[0].message.content == r_off.choices[0].message.content
        assert r_on.usage.prompt_tokens == r_off.usage.prompt_tokens
        assert r_off.usage.prompt_tokens_details.cached_tokens == 0
        cached.append(r_on.usage.prompt_tokens_details.cached_tokens)
        messages += [
            {"role": "assistant", "content": r_on.choices[0].message.content},
            {"role": "user", "content": f"And what about refund number {turn}?"},
        ]
    assert cached[0] == 0 or cached[0] < cached[1]
    for turn in range(1, 4):  # every later turn reuses at least the previous prompt
        assert cached[turn] >= 0.6 * (len(SYSTEM) // 10), cached
    stats = httpx.get(on.url + "/v1/cache/stats").json()
    assert stats["enabled"] and stats["num_hits"] >= 3 and stats["hit_tokens"] >= sum(cached)


def test_streaming_chat_with_usage(servers):
    on, off = servers
    client = openai.OpenAI(base_url=on.url + "/v1", api_key="x")
    messages = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": "Stream please."},
    ]
    plain = chat(client, messages).choices[0].message.content
    stream = chat(client, messages, stream=True, stream_options={"include_usage": True})
    text, usage, reasons = "", None, []
    for chunk in stream:
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
            reasons.append(chunk.choices[0].finish_reason)
        if chunk.usage:
            usage = chunk.usage
    assert text == plain
    assert reasons[-1] in ("stop", "length")
    assert usage is not None and usage.prompt_tokens_details.cached_tokens > 0


def test_completions_endpoint(servers):
    on, off = servers
    c_on = openai.OpenAI(base_url=on.url + "/v1", api_key="x")
    c_off = openai.OpenAI(base_url=off.url + "/v1", api_key="x")
    prompt = "The quick brown fox jumps over the lazy dog. " * 5
    a = c_on.completions.create(model="m", prompt=prompt, max_tokens=8, temperature=0)
    b = c_on.completions.create(model="m", prompt=prompt, max_tokens=8, temperature=0)
    c = c_off.completions.create(model="m", prompt=prompt, max_tokens=8, temperature=0)
    assert a.choices[0].text == b.choices[0].text == c.choices[0].text
    assert b.usage.prompt_tokens_details.cached_tokens == b.usage.prompt_tokens - 1


def test_anthropic_messages_plain_and_streaming(servers):
    on, off = servers
    a_on = anthropic.Anthropic(base_url=on.url, api_key="x")
    a_off = anthropic.Anthropic(base_url=off.url, api_key="x")
    kw = dict(model="claude-any", max_tokens=10, system=SYSTEM, extra_body={"temperature": 0},
              messages=[{"role": "user", "content": "Hello, where is my bag?"}])  # fmt: skip
    first = a_on.messages.create(**kw)
    second = a_on.messages.create(**kw)
    ref = a_off.messages.create(**kw)
    assert first.content[0].text == second.content[0].text == ref.content[0].text
    assert second.usage.cache_read_input_tokens > 0
    assert (
        second.usage.input_tokens + second.usage.cache_read_input_tokens == ref.usage.input_tokens
    )
    assert ref.usage.cache_read_input_tokens == 0
    with a_on.messages.stream(**kw) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == ref.content[0].text
    assert final.stop_reason in ("end_turn", "max_tokens")
    tools = [
        {
            "name": "get_weather",
            "description": "Weather",
            "input_schema": {"type": "object", "properties": {}},
        }
    ]
    with_tools = a_on.messages.create(**kw, tools=tools)
    assert (
        with_tools.usage.input_tokens + with_tools.usage.cache_read_input_tokens
        > ref.usage.input_tokens
    )


def test_tenants_never_share(servers):
    on, _ = servers
    body = {"model": "m", "max_tokens": 4, "temperature": 0,
            "messages": [{"role": "user", "content": "tenant secret " * 20}]}  # fmt: skip
    r1 = httpx.post(
        on.url + "/v1/chat/completions", json=body, headers={"x-promptcache-tenant": "alice"}
    ).json()
    r2 = httpx.post(
        on.url + "/v1/chat/completions", json=body, headers={"x-promptcache-tenant": "bob"}
    ).json()
    r3 = httpx.post(
        on.url + "/v1/chat/completions", json=body, headers={"x-promptcache-tenant": "alice"}
    ).json()
    assert r1["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert r2["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert r3["usage"]["prompt_tokens_details"]["cached_tokens"] > 0


@pytest.mark.parametrize(
    ("path", "body", "needle"),
    [
        ("/v1/chat/completions", b"{not json", "json"),
        ("/v1/chat/completions", {"messages": "hi"}, "messages"),
        ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}, "role"),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "x"}], "max_tokens": -3},
            "max_tokens",
        ),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "x"}], "temperature": "hot"},
            "temperature",
        ),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "word " * 2000}]},
            "context",
        ),
        ("/v1/completions", {"prompt": ["a", "b"]}, "one prompt"),
        ("/v1/messages", {"messages": [{"role": "user", "content": "x"}]}, "max_tokens"),
        (
            "/v1/messages",
            {"max_tokens": 5, "messages": [{"role": "user", "content": [{"type": "image"}]}]},
            "image",
        ),
    ],
)
def test_bad_input_gets_4xx_and_server_stays_up(servers, path, body, needle):
    on, _ = servers
    if isinstance(body, bytes):
        r = httpx.post(on.url + path, content=body, headers={"content-type": "application/json"})
    else:
        r = httpx.post(on.url + path, json=body)
    assert 400 <= r.status_code < 500, r.text
    err = r.json()
    if path == "/v1/messages":
        assert err["type"] == "error" and needle in err["error"]["message"].lower()
    else:
        assert needle in err["error"]["message"].lower(), err
    assert httpx.get(on.url + "/health").status_code == 200


def test_models_health_metrics(servers, request):
    on, _ = servers
    models = openai.OpenAI(base_url=on.url + "/v1", api_key="x").models.list()
    assert len(models.data) == 1
    assert httpx.get(on.url + "/health").json()["status"] == "ok"
    text = httpx.get(on.url + "/metrics").text
    families = read_exposition(text)  # a scraper reads all of it
    assert families["promptcache_cache_num_lookups"]["kind"] == "counter"
    for name in (
        "promptcache_requests_total",
        "promptcache_ttft_seconds_bucket",
        "promptcache_cache_hit_rate",
        'promptcache_cache_bytes_by_tier{tier="ram"}',
    ):
        assert name in text
    if request.node.callspec.params["servers"] == "torch":  # the threads its forwards run on
        threads = families["promptcache_compute_torch_threads"]
        assert threads["kind"] == "gauge"
        assert list(threads["samples"].values())[0] >= 1
        compute = httpx.get(on.url + "/v1/cache/stats").json()["compute"]
        assert compute["torch_threads"] >= 1 and compute["thread_changes"] >= 0
        assert compute["lean_decode"] == 1  # a llama: the lean step, not the model's forward
        assert list(families["promptcache_compute_lean_decode"]["samples"].values()) == [1]


def test_concurrent_clients_all_served_correctly(servers):
    on, off = servers
    questions = [f"Question {i}: what is my seat?" for i in range(5)]
    expected = {}
    c_off = openai.OpenAI(base_url=off.url + "/v1", api_key="x")
    for q in questions:
        expected[q] = chat(c_off, [{"role": "user", "content": q}]).choices[0].message.content
    results, errors = {}, []

    def worker(q):
        try:
            client = openai.OpenAI(base_url=on.url + "/v1", api_key="x")
            results[q] = chat(client, [{"role": "user", "content": q}]).choices[0].message.content
        except Exception as exc:
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(q,)) for q in questions]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and results == expected


def test_disconnect_cancels_and_unpins(servers):
    on, _ = servers
    body = {
        "model": "m",
        "max_tokens": 400,
        "temperature": 0,
        "stream": True,
        "messages": [{"role": "user", "content": "long " * 30}],
    }
    httpx.post(on.url + "/v1/chat/completions", json={**body, "stream": False, "max_tokens": 1})
    with httpx.stream("POST", on.url + "/v1/chat/completions", json=body) as r:
        for line in r.iter_lines():
            if line.startswith("data:") and "content" in line:
                break
    deadline = time.time() + 20
    while time.time() < deadline:
        stats = httpx.get(on.url + "/v1/cache/stats").json()
        if stats["num_pinned_blocks"] == 0:
            break
        time.sleep(0.2)
    assert stats["num_pinned_blocks"] == 0
    r = httpx.post(on.url + "/v1/chat/completions", json={**body, "stream": False, "max_tokens": 2})
    assert r.status_code == 200 and json.loads(r.text)["usage"]["completion_tokens"] <= 2
