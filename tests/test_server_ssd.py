"""The SSD tier through real server processes: warm restarts and kill -9 crash loops."""

import random
import subprocess
import sys
import time

import httpx
import pytest

pytest.importorskip("torch")
openai = pytest.importorskip("openai")

from conftest import ServerProcess  # noqa: E402
from exposition import read_exposition  # noqa: E402

pytestmark = [pytest.mark.server, pytest.mark.slow]
SYSTEM = (
    "You are an airline agent. Follow the policy: confirm every change, one tool call at a time. "
    * 4
)


def reply(url, messages, max_tokens=8):
    client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
    r = client.chat.completions.create(
        model="m", messages=messages, max_tokens=max_tokens, temperature=0
    )
    return r.choices[0].message.content, r.usage


@pytest.fixture(scope="module")
def reference(tiny_llama_dir, tmp_path_factory):
    home = tmp_path_factory.mktemp("ref")
    srv = ServerProcess(
        ["--model", tiny_llama_dir, "--no-cache"], env={"PROMPTCACHE_HOME": str(home)}
    ).start()
    yield srv
    srv.stop()


def common_args(model_dir, cache_dir):
    return [
        "--model",
        model_dir,
        "--block-size",
        "16",
        "--prefill-chunk",
        "64",
        "--cache-dir",
        str(cache_dir),
    ]


def test_restart_is_warm_and_replies_equal_uncached(tiny_llama_dir, tmp_path, reference):
    env = {"PROMPTCACHE_HOME": str(tmp_path / "home")}
    args = common_args(tiny_llama_dir, tmp_path / "cache")
    srv = ServerProcess(args, env=env).start()
    messages = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": "I want to move my flight."},
    ]
    for turn in range(4):
        text, usage = reply(srv.url, messages)
        assert text == reply(reference.url, messages)[0]
        messages += [
            {"role": "assistant", "content": text},
            {"role": "user", "content": f"Turn {turn}: and my bags?"},
        ]
    history_tokens = usage.prompt_tokens  # the last turn's whole prompt, saved with its reply
    srv.stop()  # graceful: pending writes are flushed
    srv = ServerProcess(args, env=env).start()
    try:
        # an unrelated request first: the only one the restarted server remembers
        reply(srv.url, [{"role": "user", "content": "Quick one: what is a layover?"}])
        ssd_hits = httpx.get(srv.url + "/v1/cache/stats").json()["tiers"]["ssd"]["num_hits"]
        text, usage = reply(srv.url, messages)
        assert text == reply(reference.url, messages)[0]
        assert usage.prompt_tokens_details.cached_tokens >= history_tokens
        # the hit came from the SSD tier, not from the unrelated request: the miss record
        # compares with what supplied it (no divergence at the chat template's first tokens)
        rec = httpx.get(srv.url + "/v1/cache/requests", params={"limit": 1}).json()["requests"][0]
        assert rec["tokens_by_tier"].get("ssd", 0) >= history_tokens - 16, rec
        assert rec["reason"] == "cold", rec
        assert rec["detail"]["supplied_by"] == rec["tokens_by_tier"]
        assert not rec["detail"]["first_seen"]
        stats = httpx.get(srv.url + "/v1/cache/stats").json()
        assert (
            stats["tiers"]["ssd"]["num_hits"] == ssd_hits + 1
            and stats["tiers"]["ssd"]["num_quarantined"] == 0
        )
        metrics = httpx.get(srv.url + "/metrics").text
        assert read_exposition(metrics)["promptcache_cache_ssd_used_bytes"]["kind"] == "gauge"
        assert f"promptcache_cache_ssd_num_hits {ssd_hits + 1}" in metrics
    finally:
        srv.stop()


def test_kill_9_while_writing_ten_times(tiny_llama_dir, tmp_path, reference):
    env = {"PROMPTCACHE_HOME": str(tmp_path / "home")}
    cache_dir = tmp_path / "cache"
    args = common_args(tiny_llama_dir, cache_dir)
    rng = random.Random(0)
    convs = [
        [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": f"Question {i} " * (5 + 7 * i)},
        ]
        for i in range(3)
    ]
    expected = [reply(reference.url, c)[0] for c in convs]
    for round_ in range(10):
        srv = ServerProcess(args, env=env).start()
        k = round_ % len(convs)
        text, usage = reply(srv.url, convs[k])
        assert text == expected[k], f"round {round_}: served a wrong state"
        # start a long streaming generation (the writer is busy with its blocks) and kill -9 mid-way
        body = {"model": "m", "stream": True, "max_tokens": 200, "temperature": 0,
                "messages": convs[(k + 1) % len(convs)] + [{"role": "user", "content": f"round {round_} " * 40}]}  # fmt: skip
        with httpx.stream("POST", srv.url + "/v1/chat/completions", json=body, timeout=30) as r:
            deadline = time.time() + rng.uniform(0.0, 0.4)
            for _ in r.iter_lines():
                if time.time() > deadline:
                    break
            srv.stop(kill=True)
    srv = ServerProcess(args, env=env).start()
    try:
        assert not list(cache_dir.rglob(".tmp-*")), "stray temp files survived a restart"
        for c, want in zip(convs, expected, strict=True):
            assert reply(srv.url, c)[0] == want
        assert httpx.get(srv.url + "/v1/cache/stats").json()["tiers"]["ssd"]["num_blocks"] > 0
    finally:
        srv.stop()
    out = subprocess.run([sys.executable, "-m", "promptcache.cli", "cache", "verify", "--cache-dir", str(cache_dir)],
                         capture_output=True, text=True)  # fmt: skip
    assert out.returncode == 0, out.stdout
