"""Sessions through real server processes: delete a session (shared system prompt kept),
tenants, the CLI on the folder after a restart, TTL hints and session ids at the HTTP edge."""

import subprocess
import sys

import httpx
import pytest

pytest.importorskip("torch")

from conftest import ServerProcess  # noqa: E402

pytestmark = [pytest.mark.server, pytest.mark.slow]
SYSTEM = "You are a travel agent. Confirm every change and keep answers short. " * 4
KEYS = "ka acme\nkb globex\nkadm ops admin\n"


def chat(url, key, user, session=None, body_extra=None):
    headers = {"authorization": f"Bearer {key}"}
    if session is not None:
        headers["x-promptcache-session"] = session
    body = {
        "model": "m",
        "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": user}],
        "max_tokens": 6,
        "temperature": 0,
        **(body_extra or {}),
    }
    r = httpx.post(url + "/v1/chat/completions", json=body, headers=headers, timeout=120)
    assert r.status_code == 200, r.text
    data = r.json()
    return data["choices"][0]["message"]["content"], data["usage"]


def delete(url, key, path):
    return httpx.delete(url + path, headers={"authorization": f"Bearer {key}"}, timeout=60)


def test_delete_session_tenants_and_the_cli(tiny_llama_dir, tmp_path):
    env = {"PROMPTCACHE_HOME": str(tmp_path / "home")}
    keys = tmp_path / "keys.txt"
    keys.write_text(KEYS)
    cache_dir = tmp_path / "cache"
    args = ["--model", tiny_llama_dir, "--block-size", "16", "--cache-dir", str(cache_dir),
            "--api-keys", str(keys)]  # fmt: skip
    ref = ServerProcess(
        ["--model", tiny_llama_dir, "--no-cache", "--api-keys", str(keys)], env=env
    ).start()
    srv = ServerProcess(args, env=env).start()
    try:
        a_user = "Move my flight to Friday, please, and keep the aisle seat I paid for."
        b_user = "What is the baggage allowance on a domestic economy ticket today?"
        a_text, _ = chat(srv.url, "ka", a_user, session="alice")
        # bob's session id from the body (the header would win over it)
        b_text, _ = chat(srv.url, "ka", b_user, body_extra={"prompt_cache_key": "bob"})
        _, a_usage = chat(srv.url, "ka", a_user, session="alice")
        a_full = a_usage["prompt_tokens_details"]["cached_tokens"]
        # another tenant names the same session: nothing of acme's goes
        r = delete(srv.url, "kb", "/v1/cache/sessions/alice")
        assert r.status_code == 200 and r.json()["removed_blocks"] == 0
        r = delete(srv.url, "ka", "/v1/cache/sessions/alice")
        out = r.json()
        assert r.status_code == 200 and out["tenant"] == "acme", out
        assert out["removed"]["ram"]["blocks"] > 0 and out["shared_blocks_kept"] > 0
        # alice misses her own blocks now; bob still hits his whole prompt; replies unchanged
        text, usage = chat(srv.url, "ka", a_user, session="alice2")
        assert usage["prompt_tokens_details"]["cached_tokens"] < a_full
        assert text == a_text == chat(ref.url, "ka", a_user)[0]
        text, usage = chat(srv.url, "ka", b_user, session="bob")
        assert usage["prompt_tokens_details"]["cached_tokens"] >= a_full - 32
        assert text == b_text == chat(ref.url, "ka", b_user)[0]
        # a whole tenant: admin only
        assert delete(srv.url, "ka", "/v1/cache/tenants/acme").status_code == 403
        chat(srv.url, "kb", b_user, session="carol")
        r = delete(srv.url, "kadm", "/v1/cache/tenants/acme")
        assert r.status_code == 200 and r.json()["removed"]["ssd"]["blocks"] > 0
        _, usage = chat(srv.url, "ka", b_user, session="bob")
        assert usage["prompt_tokens_details"]["cached_tokens"] == 0
        stats = httpx.get(srv.url + "/v1/cache/stats", headers={"x-api-key": "kadm"}).json()
        assert stats["num_deleted"] > 0 and stats["tiers"]["ssd"]["num_deleted"] > 0
    finally:
        srv.stop()
        ref.stop()
    # the folder without a server: globex's session carol goes through the CLI
    cli = [sys.executable, "-m", "promptcache.cli", "cache"]
    out = subprocess.run(
        [*cli, "delete", "--cache-dir", str(cache_dir), "--session", "carol", "--tenant", "globex"],
        capture_output=True, text=True, env=env, check=True,
    ).stdout  # fmt: skip
    assert "deleted" in out and "deleted 0 blocks" not in out, out
    srv = ServerProcess(args, env=env).start()
    try:
        _, usage = chat(srv.url, "kb", b_user, session="carol")
        assert usage["prompt_tokens_details"]["cached_tokens"] == 0
    finally:
        srv.stop()


def test_session_ids_and_ttl_hints_at_the_edge():
    from starlette.requests import Request

    from promptcache.core.sessions import session_key
    from promptcache.server.schemas.anthropic import MessagesRequest
    from promptcache.server.sessions import session_of, ttl_hint

    def request(headers):
        raw = [(k.encode(), v.encode()) for k, v in headers.items()]
        return Request({"type": "http", "headers": raw})

    assert session_of(request({}), None, "u1") == "u1"
    assert session_of(request({"x-promptcache-session": "h"}), "key", "u1") == "h"
    assert session_of(request({}), "key", "u1") == "key"
    long_id = "user_" + "x" * 1000  # e.g. a client's composite user id: accepted, tagged by digest
    assert session_of(request({}), None, long_id) == long_id
    assert len(session_key("t", long_id)) < 100 and session_key("t", long_id) != session_key(
        "t", long_id + "y"
    )
    body = {
        "model": "m",
        "max_tokens": 4,
        "system": [{"type": "text", "text": "s", "cache_control": {"type": "ephemeral"}}],
        "messages": [
            {"role": "user", "content": [
                {"type": "text", "text": "hi", "cache_control": {"type": "ephemeral", "ttl": "1h"}},
            ]},
        ],
    }  # fmt: skip
    assert ttl_hint(MessagesRequest.model_validate(body)) == 3600.0
    body["messages"] = [{"role": "user", "content": "hi"}]
    assert ttl_hint(MessagesRequest.model_validate(body)) == 300.0
    body["system"] = "plain"
    assert ttl_hint(MessagesRequest.model_validate(body)) is None


def test_encrypted_cache_through_the_server(tiny_llama_dir, tmp_path):
    import os

    env = {"PROMPTCACHE_HOME": str(tmp_path / "home")}
    keys = tmp_path / "keys.txt"
    keys.write_text(KEYS)
    (tmp_path / "key").write_bytes(os.urandom(32))
    (tmp_path / "wrong").write_bytes(os.urandom(32))
    cache_dir = tmp_path / "cache"

    def start(key_file):
        args = ["--model", tiny_llama_dir, "--block-size", "16", "--cache-dir", str(cache_dir),
                "--api-keys", str(keys), "--encrypt-key-file", str(tmp_path / key_file)]  # fmt: skip
        return ServerProcess(args, env=env).start()

    user = "Move my flight to Friday, please, and keep the aisle seat I paid for."
    srv = start("key")
    try:
        text, _ = chat(srv.url, "ka", user)
    finally:
        srv.stop()
    for key_file, hits in (("key", True), ("wrong", False)):
        srv = start(key_file)
        try:
            again, usage = chat(srv.url, "ka", user)
            cached = usage["prompt_tokens_details"]["cached_tokens"]
            assert again == text and (cached > 0) == hits, (key_file, cached)
            ssd = httpx.get(srv.url + "/v1/cache/stats", headers={"x-api-key": "kadm"}).json()
            assert ssd["tiers"]["ssd"]["encrypted"] is True
            assert (ssd["tiers"]["ssd"]["num_quarantined"] > 0) == (not hits)
        finally:
            srv.stop()


def test_force_delete_and_what_the_server_forgets(tiny_llama_dir, tmp_path):
    """``?force=true`` removes the blocks a session shares too; the server's own memory of the
    session (prompts for miss diagnosis, replies for continuity, request records) goes with it."""
    env = {"PROMPTCACHE_HOME": str(tmp_path / "home")}
    keys = tmp_path / "keys.txt"
    keys.write_text(KEYS)
    args = ["--model", tiny_llama_dir, "--block-size", "16", "--cache-dir", str(tmp_path / "c"),
            "--api-keys", str(keys)]  # fmt: skip
    srv = ServerProcess(args, env=env).start()
    try:
        a_user = "Cancel the hotel in Lisbon and refund the deposit to my card, thank you."
        b_user = "Which lounges can I use with a silver card when flying economy on Monday?"
        chat(srv.url, "ka", a_user, session="alice")
        chat(srv.url, "ka", b_user, session="bob")
        chat(srv.url, "kb", a_user, session="alice")  # the same id in another tenant
        _, b_usage = chat(srv.url, "ka", b_user, session="bob")
        b_full = b_usage["prompt_tokens_details"]["cached_tokens"]
        recent = httpx.get(srv.url + "/v1/cache/requests", headers={"x-api-key": "ka"}).json()
        num_before = len(recent["requests"])
        out = delete(srv.url, "ka", "/v1/cache/sessions/alice?force=true").json()
        assert out["force"] is True and out["removed_blocks"] > 0, out
        assert out["shared_blocks_kept"] == 0  # force: shared blocks go too
        assert out["forgotten"]["prompts"] == 1 and out["forgotten"]["records"] == 1, out
        assert out["forgotten"]["replies"] == 1, out
        recent = httpx.get(srv.url + "/v1/cache/requests", headers={"x-api-key": "ka"}).json()
        assert len(recent["requests"]) == num_before - 1
        # the system prompt bob shares went too: his next turn reuses less than before
        _, usage = chat(srv.url, "ka", b_user, session="bob")
        assert usage["prompt_tokens_details"]["cached_tokens"] < b_full
        # globex's alice is another session: untouched
        _, usage = chat(srv.url, "kb", a_user, session="alice")
        assert usage["prompt_tokens_details"]["cached_tokens"] > 0
        # a whole tenant forgets everything the server remembered of it
        out = delete(srv.url, "kadm", "/v1/cache/tenants/globex").json()
        assert out["forgotten"]["records"] == 2 and out["forgotten"]["prompts"] == 2, out
    finally:
        srv.stop()


def test_ram_ttl_expires_blocks_in_a_running_server(tiny_llama_dir, tmp_path):
    """``--ram-ttl``: a prompt unused for longer misses (stats count the expiry) and the reply
    is the uncached server's."""
    env = {"PROMPTCACHE_HOME": str(tmp_path / "home")}
    keys = tmp_path / "keys.txt"
    keys.write_text(KEYS)
    base = ["--model", tiny_llama_dir, "--api-keys", str(keys)]
    ref = ServerProcess([*base, "--no-cache"], env=env).start()
    srv = ServerProcess(
        [*base, "--block-size", "16", "--no-ssd", "--ram-ttl", "2"], env=env
    ).start()
    try:
        import time

        user = "Book two seats next to each other on the morning train to Porto tomorrow."
        text, _ = chat(srv.url, "ka", user)
        again, usage = chat(srv.url, "ka", user)
        assert again == text and usage["prompt_tokens_details"]["cached_tokens"] > 0
        time.sleep(3.5)
        late, usage = chat(srv.url, "ka", user)
        assert usage["prompt_tokens_details"]["cached_tokens"] == 0
        assert late == text == chat(ref.url, "ka", user)[0]
        stats = httpx.get(srv.url + "/v1/cache/stats", headers={"x-api-key": "kadm"}).json()
        assert stats["num_expired"] > 0 and stats["ram_ttl_s"] == 2.0, stats
    finally:
        srv.stop()
        ref.stop()
