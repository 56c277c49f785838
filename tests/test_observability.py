"""Per-request cache records: every miss reason produced on purpose through a real server, the
records endpoint with tenants and keys, the hit-rate alert, and the units behind them."""

import random
import time

import httpx
import numpy as np
import pytest

from promptcache.core.evictions import EvictionLog
from promptcache.core.stats import LookupReport
from promptcache.server.diagnosis import PromptMemory, diagnose
from promptcache.server.records import CacheRecord, PrefillRate, RequestRecords

SYSTEM = "You are a careful travel agent; confirm each booking change with the customer. " * 3


def _args(model, *extra):
    return ["--engine", "torch", "--model", model, "--block-size", "16", "--prefill-chunk", "64",
            "--max-context", "2048", *extra]  # fmt: skip


def ids(seed, n, vocab=300):
    rng = random.Random(seed)
    return [rng.randrange(3, vocab) for _ in range(n)]


def complete(srv, prompt, tenant="", key=None, max_tokens=4):
    headers = {"x-promptcache-tenant": tenant} if tenant else {}
    if key:
        headers["authorization"] = f"Bearer {key}"
    r = httpx.post(
        srv.url + "/v1/completions",
        json={"model": "m", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0},
        headers=headers,
        timeout=120,
    )
    assert r.status_code == 200, r.text
    return r.json()


def chat(srv, system, user="Is my flight on time?"):
    r = httpx.post(
        srv.url + "/v1/chat/completions",
        json={"model": "m", "max_tokens": 4, "temperature": 0,
              "messages": [{"role": "system", "content": system}, {"role": "user", "content": user}]},
        timeout=120,
    )  # fmt: skip
    assert r.status_code == 200, r.text
    return r.json()


def last_record(srv, key=None, **params):
    headers = {"authorization": f"Bearer {key}"} if key else {}
    r = httpx.get(srv.url + "/v1/cache/requests", params={"limit": 1, **params}, headers=headers)
    assert r.status_code == 200, r.text
    return r.json()["requests"][0]


@pytest.fixture(scope="module")
def main_server(tiny_llama_dir, tmp_path_factory):
    pytest.importorskip("torch")
    from conftest import ServerProcess

    home = tmp_path_factory.mktemp("obs")
    srv = ServerProcess(
        _args(tiny_llama_dir, "--no-ssd"), env={"PROMPTCACHE_HOME": str(home)}, log=home / "s.log"
    ).start()
    yield srv
    srv.stop()


# -- each reason through a real server ----------------------------------------------------------


@pytest.mark.server
def test_cold_then_full_hit_then_divergence_at_a_header(main_server):
    srv = main_server
    first = SYSTEM.replace("travel", "x-billing: cch=aaaa; travel", 1)
    chat(srv, first)
    rec = last_record(srv)
    assert rec["reason"] == "cold" and rec["detail"]["first_seen"] and rec["cached_tokens"] == 0
    chat(srv, first)
    again = last_record(srv)
    assert again["reason"] == "none"
    assert again["cached_tokens"] == again["prompt_tokens"] - 1
    assert again["tokens_by_tier"] == {"ram": again["cached_tokens"]}
    assert again["ttft_uncached_s"] >= again["ttft_s"] and again["saved_s"] > 0
    # where the TTFT went: a full hit prefills its last token in one forward, from the live state
    ph, cold = again["phases"], rec["phases"]
    assert ph["num_forwards"] == 1 and cold["num_forwards"] >= 1 and cold["restore_ms"] == 0
    assert 0 < ph["prefill_ms"] <= again["ttft_s"] * 1e3
    assert sum(v for k, v in ph.items() if k.endswith("_ms")) <= again["ttft_s"] * 1e3 + 1
    # the header changes, as a per-session billing header does: the prefix breaks inside it
    chat(srv, SYSTEM.replace("travel", "x-billing: cch=bbbb; travel", 1))
    rec = last_record(srv)
    d = rec["detail"]
    assert rec["reason"] == "diverged", rec
    assert d["message_index"] == 0 and d["role"] == "system"
    assert d["earlier_request"] == again["id"]  # the closest earlier request, newest on ties
    assert "b" in d["found"] and "a" in d["expected"] and d["found"] != d["expected"]
    assert rec["cached_tokens"] <= d["token_index"] < rec["cached_tokens"] + 2
    assert 0 < d["token_index"] < 40


@pytest.mark.server
def test_another_tenant_holds_the_prefix(main_server):
    prompt = ids(1, 120)
    complete(main_server, prompt, tenant="ns-one")
    assert last_record(main_server)["reason"] == "cold"
    complete(main_server, prompt, tenant="ns-two")
    rec = last_record(main_server)
    assert rec["reason"] == "namespace" and rec["cached_tokens"] == 0
    assert rec["detail"]["namespace"] == "ns-one" and rec["detail"]["shared_tokens"] >= 120
    # the tenant's own view filters by tenant
    mine = last_record(main_server, tenant="ns-one")
    assert mine["tenant"] == "ns-one"


@pytest.mark.server
def test_disabled_cache_says_so(tiny_llama_dir, server_factory):
    srv = server_factory(*_args(tiny_llama_dir, "--no-cache"))
    complete(srv, ids(2, 50))
    complete(srv, ids(2, 50))
    rec = last_record(srv)
    assert rec["reason"] == "disabled" and rec["cached_tokens"] == 0


@pytest.mark.server
def test_evicted_from_ram(tiny_llama_dir, server_factory):
    # ~512 bytes of KV per token: 300 KB hold ~580 tokens, so two other prompts push A out
    srv = server_factory(*_args(tiny_llama_dir, "--no-ssd", "--ram-budget", "300KB"))
    a = ids(3, 300)
    complete(srv, a)
    for seed in (4, 5, 6):
        complete(srv, ids(seed, 300))
    complete(srv, a)
    rec = last_record(srv)
    assert rec["reason"] == "evicted", rec
    assert rec["detail"]["tier"] == "ram" and rec["detail"]["seconds_ago"] >= 0
    assert rec["detail"]["earlier_tokens"] >= 300 > rec["cached_tokens"]


@pytest.mark.server
def test_snapshot_layers_resume_at_a_checkpoint(tmp_path_factory, server_factory):
    pytest.importorskip("torch")
    from promptcache.testing.tiny_models import save_tiny_model

    model = save_tiny_model("gemma3", str(tmp_path_factory.mktemp("gemma3")))
    srv = server_factory(*_args(model, "--no-ssd"))
    p = ids(7, 200)
    complete(srv, p)
    complete(srv, p[:150] + ids(8, 40))  # shares 150 tokens; checkpoints every 64 and at the end
    rec = last_record(srv)
    assert rec["reason"] == "snapshot", rec
    assert rec["cached_tokens"] == 128 and rec["detail"]["checkpoint_at"] == 128
    assert rec["detail"]["cached_tokens"] >= 150


@pytest.mark.server
def test_records_respect_api_keys(tiny_llama_dir, server_factory, tmp_path):
    keys = tmp_path / "keys"
    keys.write_text("key-a alpha\nkey-b beta\nkey-root ops admin\n")
    srv = server_factory(*_args(tiny_llama_dir, "--no-ssd", "--api-keys", str(keys)))
    complete(srv, ids(9, 60), key="key-a")
    complete(srv, ids(9, 60), key="key-b")  # same prompt, other tenant: never named to it
    rec_b = last_record(srv, key="key-b")
    assert rec_b["tenant"] == "beta" and rec_b["reason"] == "cold"
    seen_by_a = httpx.get(srv.url + "/v1/cache/requests", headers={"x-api-key": "key-a"}).json()
    assert {r["tenant"] for r in seen_by_a["requests"]} == {"alpha"}
    # asking for another tenant's records with a tenant key still shows only its own
    other = httpx.get(
        srv.url + "/v1/cache/requests", params={"tenant": "beta"}, headers={"x-api-key": "key-a"}
    ).json()
    assert {r["tenant"] for r in other["requests"]} == {"alpha"}
    admin = httpx.get(srv.url + "/v1/cache/requests", headers={"x-api-key": "key-root"}).json()
    assert {r["tenant"] for r in admin["requests"]} == {"alpha", "beta"}
    assert httpx.get(srv.url + "/v1/cache/requests").status_code == 401
    assert httpx.get(srv.url + "/dashboard").status_code == 200  # static page: no data in it
    bad = httpx.get(
        srv.url + "/v1/cache/requests", params={"limit": 0}, headers={"x-api-key": "key-root"}
    )
    assert bad.status_code == 400


# -- units -----------------------------------------------------------------------------------------


def _report(hit, matched=None, evicted=None, damaged=0, ckpt=False):
    return LookupReport(hit, "prefix" if hit else "miss", hit if matched is None else matched,
                        {"ram": hit}, damaged, ckpt, evicted)  # fmt: skip


def _decode(t):
    return " ".join(map(str, t))


def test_diagnose_reasons_in_order():
    mem = PromptMemory()
    a = np.arange(100, dtype=np.uint32)
    kw = dict(may_name_namespaces=True, decode=_decode)
    assert diagnose(a, None, mem, "", **kw).reason == "disabled"
    assert diagnose(a, _report(0), mem, "", **kw) == (
        "cold",
        {"missed_tokens": 100, "first_seen": True},
    )
    mem.add("", 1, a)
    assert diagnose(a, _report(99), mem, "", **kw).reason == "none"
    assert diagnose(a, _report(10, damaged=1), mem, "", **kw).reason == "damaged"
    snap = diagnose(a, _report(64, matched=90, ckpt=True), mem, "", **kw)
    assert snap.reason == "snapshot" and snap.detail["checkpoint_at"] == 64
    lost = diagnose(a, _report(32), mem, "", **kw)
    assert lost.reason == "unsaved" and lost.detail["earlier_request"] == 1
    # the earlier request was remembered (finished) after this one started: it was in flight
    racing = diagnose(a, _report(32), mem, "", started_s=-1.0, **kw)
    assert racing.reason == "in_flight" and racing.detail["earlier_request"] == 1
    log = EvictionLog()
    log.note(b"h" * 16, b"p" * 16, "ssd", now=100.0)
    ev = diagnose(
        a, _report(32, evicted=log.find(b"x" * 16, b"p" * 16)), mem, "", now_s=130.0, **kw
    )
    assert ev.reason == "evicted" and ev.detail["tier"] == "ssd" and ev.detail["seconds_ago"] == 30
    b = a.copy()
    b[40:] += 1
    div = diagnose(b, _report(40), mem, "", locate=lambda i: (2, "user"), **kw)
    assert div.reason == "diverged" and div.detail["token_index"] == 40
    assert (div.detail["message_index"], div.detail["role"]) == (2, "user")
    assert div.detail["found"].startswith("41") and div.detail["expected"].startswith("40")
    assert diagnose(a, _report(0), mem, "other", **kw).reason == "namespace"
    no_names = dict(kw, may_name_namespaces=False)
    assert diagnose(a, _report(0), mem, "other", **no_names).reason == "cold"
    longer = np.concatenate([a, np.arange(500, 520, dtype=np.uint32)])
    assert diagnose(longer, _report(99), mem, "", **kw).detail == {
        "missed_tokens": 21,
        "first_seen": False,
    }


def test_diagnosis_compares_with_what_supplied_the_hit():
    """After a restart the SSD tier supplies a hit that no remembered request made: an unrelated
    request sharing a few header tokens is not the one the prompt diverged from."""
    mem = PromptMemory()
    kw = dict(may_name_namespaces=True, decode=_decode)
    unrelated = np.concatenate([np.arange(5), np.arange(900, 950)]).astype(np.uint32)
    mem.add("", 7, unrelated)
    resumed = np.arange(200, dtype=np.uint32)  # the hit: 160 tokens from the SSD tier
    report = LookupReport(160, "prefix", 160, {"ssd": 160}, 0, False, None)
    miss = diagnose(resumed, report, mem, "", **kw)
    assert miss == ("cold", {"missed_tokens": 40, "first_seen": False,
                             "supplied_by": {"ssd": 160}})  # fmt: skip
    # the cache once held the continuation: evicted, though no remembered request covered it
    log = EvictionLog()
    log.note(b"h" * 16, b"p" * 16, "ram", now=10.0)
    gone = report._replace(evicted=log.find(b"x" * 16, b"p" * 16))
    ev = diagnose(resumed, gone, mem, "", now_s=12.0, **kw)
    assert ev.reason == "evicted" and ev.detail["supplied_by"] == {"ssd": 160}
    assert "earlier_request" not in ev.detail
    # a remembered request that covers the hit and differs after it is still the one named
    mem.add("", 8, np.concatenate([resumed[:160], np.arange(700, 760)]).astype(np.uint32))
    div = diagnose(resumed, report, mem, "", **kw)
    assert div.reason == "diverged" and div.detail["token_index"] == 160
    assert div.detail["earlier_request"] == 8


def test_prompt_memory_is_bounded():
    mem = PromptMemory(per_namespace=3, max_tokens=1000, max_namespaces=2)
    for i in range(5):
        mem.add("a", i, np.full(100, i, dtype=np.uint32))
    assert len(mem) == 3 and mem.num_tokens == 300
    assert mem.closest("a", np.zeros(10, dtype=np.uint32))[0] == 0  # request 0 was dropped
    mem.add("b", 10, np.full(750, 7, dtype=np.uint32))
    assert mem.num_tokens == 950 and len(mem) == 3  # the oldest went for the token budget
    mem.add("c", 11, np.ones(10, dtype=np.uint32))
    assert mem.closest("a", np.full(5, 4, dtype=np.uint32))[0] == 0  # "a" was least recent
    assert mem.closest("c", np.ones(5, dtype=np.uint32))[0] == 5


def _rec(i, prompt, cached, tenant="", finish="stop", ttft=0.1):
    return CacheRecord(i, 0.0, tenant, "/v1/completions", finish, prompt, cached, 1, "prefix",
                       {"ram": cached}, ttft, 0.0, "cold")  # fmt: skip


def test_alert_needs_a_window_and_recovers(caplog):
    recs = RequestRecords(alert_below=0.8, window=5)
    for i in range(4):
        recs.add(_rec(i, 100, 10))
    assert recs.alert()["window_hit_rate"] is None and not recs.is_alerting
    with caplog.at_level("WARNING", logger="promptcache.cache"):
        recs.add(_rec(5, 100, 10))
    assert recs.is_alerting and "under the alert threshold" in caplog.text
    recs.add(_rec(6, 100, 10, finish="cancelled", ttft=None))  # left while queued: not counted
    assert recs.alert()["requests_in_window"] == 5
    for i in range(5):
        recs.add(_rec(10 + i, 100, 99))
    assert not recs.is_alerting and recs.alert()["window_hit_rate"] == pytest.approx(0.99)
    assert recs.alert("nobody")["window_hit_rate"] is None
    assert [r.request_id for r in recs.recent(3)] == [14, 13, 12]
    with pytest.raises(ValueError):
        RequestRecords(alert_below=1.5)


def test_eviction_log_is_bounded():
    log = EvictionLog(capacity=2)
    for i in range(3):
        log.note(bytes([i]) * 16, b"p" * 16, "ram", now=float(i))
    assert len(log) == 2 and log.find(bytes([0]) * 16, b"q" * 16) is None
    assert log.find(bytes([2]) * 16, b"q" * 16).time_s == 2.0


def test_prefill_rate_is_a_median_of_measurable_requests():
    rate = PrefillRate()
    assert rate.saved(1000) == 0.0  # nothing measured yet: no claim
    rate.observe(10.0, 100)  # a first request paying the warm-up
    rate.observe(None, 500)
    rate.observe(1.0, 10)  # too few computed tokens to measure
    for _ in range(4):
        rate.observe(0.1, 100)
    assert rate.s_per_token == pytest.approx(0.001)
    assert rate.saved(1000) == pytest.approx(1.0)


@pytest.mark.server
def test_damaged_block_on_disk(tiny_llama_dir, server_factory, tmp_path):
    cache_dir = tmp_path / "blocks"
    srv = server_factory(
        *_args(tiny_llama_dir, "--ram-budget", "300KB", "--cache-dir", str(cache_dir))
    )
    a = ids(11, 300)
    complete(srv, a)
    for seed in (12, 13, 14, 15, 16):  # push A out of RAM; it stays on disk
        complete(srv, ids(seed, 300))
    stats = httpx.get(srv.url + "/v1/cache/stats").json()
    assert stats["num_evictions"] > 0
    deadline = time.time() + 30
    while httpx.get(srv.url + "/v1/cache/stats").json()["tiers"]["ssd"]["queued_writes"]:
        assert time.time() < deadline
        time.sleep(0.1)
    # damage every block file of A's first block (found by its first 16 token ids)
    first = np.asarray(a[:16], dtype="<u4").tobytes().hex()
    damaged = 0
    for path in cache_dir.rglob("*.safetensors"):
        data = path.read_bytes()
        if first.encode() in data:
            path.write_bytes(data[:-64] + bytes(64))
            damaged += 1
    assert damaged == 1
    complete(srv, a)
    rec = last_record(srv)
    assert rec["reason"] == "damaged", rec
    assert rec["detail"]["damaged_blocks"] == 1 and rec["cached_tokens"] == 0
    complete(srv, a)  # recomputed and saved again: the next request hits
    assert last_record(srv)["reason"] == "none"
