"""Encryption at rest of the SSD tier: real files, real SQLite, restarts with the right key,
a wrong key and none."""

import os
import sqlite3

import pytest
from core_helpers import assert_restores, make_slicer

from promptcache.core.cache import PromptCache
from promptcache.core.cipher import BlockCipher, load_key_file
from promptcache.core.tiers.ssd.tier import SsdTier

BLOCK = 4
TOKENS = [0x5A17_0000 + 7919 * i for i in range(30)]  # ids whose bytes stand out in a grep


def make_cache(tmp_path, key):
    cipher = BlockCipher(key) if key is not None else None
    tier = SsdTier(tmp_path / "cache", "model-a", cipher=cipher)
    return PromptCache("model-a", block_size=BLOCK, ram_budget=10**6, next_tier=tier), tier


def at_rest(tier):
    """Every byte the tier keeps on disk: block files and the index (with its WAL)."""
    out = b""
    for p in sorted(tier.root_dir.rglob("*")):
        if p.is_file() and p.name != "lock":
            out += p.read_bytes()
    return out


def token_runs(tokens):
    """Each pair of neighbouring ids as stored (uint32 little-endian): 8 bytes to find."""
    raw = b"".join(t.to_bytes(4, "little") for t in tokens)
    return [raw[i : i + 8] for i in range(0, len(raw) - 4, 4)]


def hit(cache, tokens):
    query = tokens + [1]
    with cache.lookup(cache.sequence(query)) as h:
        assert_restores(h, query)
        return h.num_tokens


def test_files_and_index_hold_no_token_ids_and_a_restart_with_the_key_hits(tmp_path):
    key = os.urandom(32)
    cache, tier = make_cache(tmp_path / "plain", None)
    cache.save(cache.sequence(TOKENS, session="s"), None, make_slicer(TOKENS))
    cache.close()
    assert any(run in at_rest(tier) for run in token_runs(TOKENS))  # the grep works

    cache, tier = make_cache(tmp_path, key)
    cache.save(cache.sequence(TOKENS, session="alice@example.com"), None, make_slicer(TOKENS))
    tier.flush()
    cache.check_integrity()
    cache.close()
    data = at_rest(tier)
    assert not any(run in data for run in token_runs(TOKENS))
    assert b"alice@example.com" not in data
    db = sqlite3.connect(tier.root_dir / "index.sqlite")
    firsts = {r[0] for r in db.execute("SELECT first_token FROM blocks")}
    db.close()
    assert len(firsts) == len(TOKENS) // BLOCK + 1 and not firsts & set(TOKENS)

    cache, tier = make_cache(tmp_path, key)
    assert hit(cache, TOKENS) == len(TOKENS)
    assert cache.stats().tiers["ssd"]["num_quarantined"] == 0
    # sessions still work under the key (the index keeps keyed digests of their ids)
    assert cache.delete_session("alice@example.com").to_dict()["removed"]["ssd"]["blocks"] > 0
    cache.check_integrity()
    cache.close()


@pytest.mark.parametrize("other", ["wrong", "none"])
def test_a_wrong_key_or_none_serves_nothing(tmp_path, other):
    cache, tier = make_cache(tmp_path, os.urandom(32))
    cache.save(cache.sequence(TOKENS), None, make_slicer(TOKENS))
    cache.close()
    key2 = os.urandom(32) if other == "wrong" else None
    cache, tier = make_cache(tmp_path, key2)
    assert hit(cache, TOKENS) == 0
    st = cache.stats().tiers["ssd"]
    assert st["num_quarantined"] == len(TOKENS) // BLOCK + 1 and st["num_blocks"] == 0
    cache.check_integrity()
    # recomputed and saved again under this key: served from then on
    cache.save(cache.sequence(TOKENS), None, make_slicer(TOKENS))
    cache.close()
    cache, tier = make_cache(tmp_path, key2)
    assert hit(cache, TOKENS) == len(TOKENS)
    cache.close()


def test_key_files(tmp_path):
    key = os.urandom(32)
    for name, content in (("raw", key), ("hex", key.hex().encode() + b"\n")):
        (tmp_path / name).write_bytes(content)
        assert load_key_file(tmp_path / name) == key
    (tmp_path / "short").write_bytes(b"abc")
    with pytest.raises(ValueError, match="not an encryption key"):
        load_key_file(tmp_path / "short")


def test_cache_commands_on_an_encrypted_folder(tmp_path, capsys):
    import argparse

    from promptcache.cli.cache import run_cache_command

    key = os.urandom(32)
    (tmp_path / "key").write_bytes(key.hex().encode())
    (tmp_path / "wrong").write_bytes(os.urandom(32))
    cache, tier = make_cache(tmp_path, key)
    cache.save(cache.sequence(TOKENS, session="alice"), None, make_slicer(TOKENS))
    cache.close()
    n = len(TOKENS) // BLOCK + 1

    def run(action, key_file=None, session=None):
        args = argparse.Namespace(
            action=action, cache_dir=str(tmp_path / "cache"), limit=10, session=session,
            tenant=None, force=False, encrypt_key_file=key_file,
        )  # fmt: skip
        return run_cache_command(args)

    assert run("verify") == 0  # without the key: not verified, and nothing quarantined
    assert (
        "not verified" in capsys.readouterr().out
        and len(list(tier.root_dir.rglob("*.safetensors"))) == n
    )
    assert run("verify", str(tmp_path / "wrong")) == 2  # refused: nothing would decrypt
    assert run("verify", str(tmp_path / "key")) == 0
    assert f"{n} blocks checked, 0 bad" in capsys.readouterr().out
    assert run("delete") == 2  # neither --session nor --tenant
    assert run("delete", None, "alice") == 2  # session ids are keyed digests: the key is needed
    capsys.readouterr()
    assert run("delete", str(tmp_path / "key"), "alice") == 0
    assert f"deleted {n} blocks" in capsys.readouterr().out
    assert list(tier.root_dir.rglob("*.safetensors")) == []
