"""The shared (Valkey) tier through real server processes and a real valkey-server: a
conversation moving to another server, tenants, Valkey going away and coming back, a corrupted
value, the start-up warm-up."""

from __future__ import annotations

import time

import httpx
import pytest
from valkey_helpers import ValkeyProcess, server_binary

pytest.importorskip("torch")
openai = pytest.importorskip("openai")

from conftest import ServerProcess  # noqa: E402
from exposition import read_exposition  # noqa: E402

pytestmark = [
    pytest.mark.server,
    pytest.mark.valkey,
    pytest.mark.skipif(server_binary() is None, reason="no valkey-server binary"),
]
SYSTEM = (
    "You are an airline agent. Follow the policy: confirm every change, one tool call at a time. "
    * 4
)
TENANT = "x-promptcache-tenant"


def reply(url, messages, tenant="alice", max_tokens=8):
    client = openai.OpenAI(
        base_url=url + "/v1", api_key="x", max_retries=0, default_headers={TENANT: tenant}
    )
    r = client.chat.completions.create(
        model="m", messages=messages, max_tokens=max_tokens, temperature=0
    )
    return r.choices[0].message.content, r.usage


def stats(srv):
    return httpx.get(srv.url + "/v1/cache/stats").json()


def shared(srv):
    return stats(srv)["tiers"]["shared"]


def wait_for(cond, timeout=20.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.05)
    return False


def flushed(srv):
    return wait_for(lambda: (d := shared(srv))["queued_writes"] == 0 and d["num_writes"] > 0)


@pytest.fixture(scope="module")
def reference(tiny_llama_dir, tmp_path_factory):
    home = tmp_path_factory.mktemp("ref")
    srv = ServerProcess(
        ["--model", tiny_llama_dir, "--no-cache"], env={"PROMPTCACHE_HOME": str(home)}
    ).start()
    yield srv
    srv.stop()


@pytest.fixture
def valkey(tmp_path):
    proc = ValkeyProcess(tmp_path / "valkey").start()
    yield proc
    proc.stop()


@pytest.fixture
def server(tiny_llama_dir, tmp_path, valkey):
    """server(name, *flags): a promptcache server on the shared tier with its own SSD folder."""
    started: list[ServerProcess] = []

    def make(name: str, *flags: str) -> ServerProcess:
        args = ["--model", tiny_llama_dir, "--block-size", "16", "--prefill-chunk", "64",
                "--cache-dir", str(tmp_path / f"ssd-{name}"), "--shared-tier", valkey.url,
                *flags]  # fmt: skip
        srv = ServerProcess(
            args, env={"PROMPTCACHE_HOME": str(tmp_path / f"home-{name}")},
            log=tmp_path / f"server-{name}.log",
        ).start()  # fmt: skip
        started.append(srv)
        return srv

    yield make
    for srv in started:
        srv.stop()


def chat(url, reference_url, turns):
    """``turns`` turns of a conversation on ``url``, each reply equal to the uncached one's;
    returns the messages for the next turn and the last turn's prompt tokens."""
    messages = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": "I want to move my flight."},
    ]
    usage = None
    for turn in range(turns):
        text, usage = reply(url, messages)
        assert text == reply(reference_url, messages)[0]
        messages += [
            {"role": "assistant", "content": text},
            {"role": "user", "content": f"Turn {turn}: and my bags?"},
        ]
    assert usage is not None
    return messages, usage.prompt_tokens


def test_conversation_moves_to_another_server_then_warm_up(server, reference):
    a = server("a", "--warmup-seconds", "0")
    messages, history = chat(a.url, reference.url, 4)
    assert flushed(a)
    assert shared(a)["state"] == "connected" and shared(a)["up"] == 1

    b = server("b", "--warmup-seconds", "0")  # fresh RAM, its own empty SSD folder
    expected = reply(reference.url, messages)[0]
    # another tenant sees nothing of alice's blocks in the shared tier
    text, usage = reply(b.url, messages, tenant="bob")
    assert text == expected and usage.prompt_tokens_details.cached_tokens == 0
    text, usage = reply(b.url, messages)
    assert text == expected
    assert usage.prompt_tokens_details.cached_tokens >= 0.95 * history
    d = shared(b)
    assert d["num_hits"] == 1 and d["num_promoted_blocks"] >= history // 16 - 1
    assert d["num_corrupt"] == 0 and d["errors"] == 0
    record = httpx.get(b.url + "/v1/cache/requests").json()["requests"][0]
    assert record["tokens_by_tier"].get("shared", 0) >= 0.9 * history
    metrics = httpx.get(b.url + "/metrics").text
    assert read_exposition(metrics)["promptcache_cache_shared_rtt_seconds"]["kind"] == "histogram"
    assert "promptcache_cache_shared_num_hits 1" in metrics
    assert 'promptcache_cache_shared_rtt_seconds_bucket{le="' in metrics
    assert "promptcache_cache_shared_up 1" in metrics

    # a new server warms up from the shared tier: its first request hits from RAM
    c = server("c", "--warmup-bytes", "50MB")
    d = shared(c)
    assert d["num_warmed_blocks"] >= history // 16
    text, usage = reply(c.url, messages)
    assert text == expected
    assert usage.prompt_tokens_details.cached_tokens >= 0.95 * history
    record = httpx.get(c.url + "/v1/cache/requests").json()["requests"][0]
    assert record["tokens_by_tier"].get("ram", 0) >= 0.95 * history
    assert shared(c)["num_hits"] == 0  # nothing needed promoting
    log = c.log.read_text() if c.log else ""  # the progress line
    assert "warm-up:" in log


def test_valkey_killed_mid_run_then_restarted(server, reference, valkey):
    a = server("a", "--warmup-seconds", "0", "--shared-ttl", "600")
    assert shared(a)["ttl_s"] == 600
    messages, _ = chat(a.url, reference.url, 2)
    valkey.stop(kill=True)
    # still served, from RAM (and SSD), replies unchanged
    more = [*messages[:-1], {"role": "user", "content": "Something else entirely, please."}]
    text, _ = reply(a.url, more)
    assert text == reply(reference.url, more)[0]
    assert wait_for(lambda: shared(a)["state"] == "down")
    assert "promptcache_cache_shared_up 0" in httpx.get(a.url + "/metrics").text
    valkey.start()
    assert wait_for(lambda: shared(a)["state"] == "connected")
    assert shared(a)["num_reconnects"] >= 1
    messages, _ = chat(a.url, reference.url, 1)
    assert flushed(a)


def test_corrupted_value_detected_and_recomputed_never_served(server, reference, valkey):
    a = server("a", "--warmup-seconds", "0")
    messages, history = chat(a.url, reference.url, 2)
    assert flushed(a)
    raw = valkey.client()
    keys = [k for k in raw.scan_iter(match="pc:*:d") if raw.strlen(k) > 1000]
    assert keys
    for k in keys:  # every value: a flipped byte near the end (tensor data)
        value = bytearray(raw.get(k))
        value[-3] ^= 0xFF
        raw.set(k, bytes(value))
    b = server("b", "--warmup-seconds", "0")
    text, usage = reply(b.url, messages)
    assert text == reply(reference.url, messages)[0]
    assert usage.prompt_tokens_details.cached_tokens == 0  # nothing damaged was used
    d = shared(b)
    assert d["num_corrupt"] >= 1 and d["num_hits"] == 0
    # the bad value was deleted; B's own (good) copy now serves a third server
    assert flushed(b)
    c = server("c", "--warmup-seconds", "0")
    text, usage = reply(c.url, messages)
    assert usage.prompt_tokens_details.cached_tokens >= 0.95 * history


def turn(url, messages, tenant, session):
    """One request of ``session`` (of ``tenant``): (reply, cached tokens)."""
    r = httpx.post(
        url + "/v1/chat/completions",
        json={"model": "m", "messages": messages, "max_tokens": 8, "temperature": 0},
        headers={TENANT: tenant, "x-promptcache-session": session},
        timeout=120,
    )
    assert r.status_code == 200, r.text
    body = r.json()
    return body["choices"][0]["message"]["content"], body["usage"]["prompt_tokens_details"][
        "cached_tokens"
    ]


def test_session_deleted_through_a_server_that_never_saw_it(server, reference):
    """Server A tags two sessions sharing a system prompt (and a namesake in another tenant);
    server B, fresh, deletes one: its own blocks leave the shared tier, the shared prompt stays
    for the other session (unless forced), the other tenant keeps everything; replies always
    equal the uncached server's."""
    a = server("a", "--warmup-seconds", "0")
    system = {"role": "system", "content": SYSTEM}
    alice = [system, {"role": "user", "content": "Move my flight to Friday, keep my seat."}]
    bob = [system, {"role": "user", "content": "What is the baggage allowance today?"}]
    for msgs, tenant, session in ((alice, "acme", "s1"), (bob, "acme", "s2"),
                                  (alice, "globex", "s1")):  # fmt: skip
        text, _ = turn(a.url, msgs, tenant, session)
        assert text == reply(reference.url, msgs)[0]
    assert flushed(a)
    a.stop()

    b = server("b", "--warmup-seconds", "0")  # its RAM and SSD never saw these sessions
    r = httpx.delete(b.url + "/v1/cache/sessions/s1", headers={TENANT: "acme"}, timeout=60)
    assert r.status_code == 200, r.text
    report = r.json()
    assert report["removed"]["shared"]["blocks"] >= 1 and report["shared_blocks_kept"] >= 1
    c = server("c", "--warmup-seconds", "0")  # fresh again: what it reuses is the shared tier's
    expected = {id(m): reply(reference.url, m)[0] for m in (alice, bob)}
    text, alice_cached = turn(c.url, alice, "acme", "s1")
    assert text == expected[id(alice)]
    text, bob_cached = turn(c.url, bob, "acme", "s2")
    assert text == expected[id(bob)]
    text, globex_cached = turn(c.url, alice, "globex", "s1")
    assert text == expected[id(alice)]
    # alice reuses only the system prompt she shared with bob; bob and globex all they had
    assert 0 < alice_cached < globex_cached and bob_cached > alice_cached
    assert globex_cached >= bob_cached - 16

    # forced: bob's blocks go, the shared prompt with them (and what hangs below it)
    assert flushed(c)
    url = b.url + "/v1/cache/sessions/s2?force=true"
    r = httpx.delete(url, headers={TENANT: "acme"}, timeout=60)
    assert r.status_code == 200 and r.json()["removed"]["shared"]["blocks"] >= 1
    d = server("d", "--warmup-seconds", "0")
    text, cached = turn(d.url, bob, "acme", "s2")
    assert text == expected[id(bob)] and cached == 0
    text, cached = turn(d.url, alice, "globex", "s1")
    assert text == expected[id(alice)] and cached == globex_cached
