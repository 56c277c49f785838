"""``--model`` sources: HF hub ids through a real HF cache (written by huggingface_hub's own client
from a loopback hub, then read offline), revisions, LM Studio folders, the clear error for a
model that is nowhere, ``promptcache models --json``, and a real ``serve --model org/name``."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("huggingface_hub")

from fake_hub import FakeHub  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
REPO = "tiny-org/tiny-llama"
DEAD_HUB = "http://127.0.0.1:9"  # nothing listens: any request offline code makes would fail


def run_py(code: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    full = {**os.environ, "PYTHONPATH": str(ROOT), **env}
    return subprocess.run(
        [sys.executable, "-c", code], env=full, capture_output=True, text=True, timeout=300
    )


LOCATE = (
    "import json, sys\n"
    "from promptcache.models.sources import locate_model\n"
    "out = []\n"
    "for model, rev in json.loads(sys.argv[1] if len(sys.argv) > 1 else '{cases}'):\n"
    "    try:\n"
    "        f = locate_model(model, rev)\n"
    "        out.append([str(f.path), f.source, f.name, f.revision])\n"
    "    except Exception as exc:\n"
    "        out.append(['error', type(exc).__name__, str(exc)])\n"
    "print(json.dumps(out))\n"
)


def locate(cases: list[tuple[str, str | None]], env: dict[str, str]) -> list[list]:
    done = run_py(LOCATE.replace("{cases}", json.dumps(cases)), env)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def hub_cache(tmp_path_factory):
    """An HF_HOME whose cache huggingface_hub itself downloaded: REPO at main (seed 0) and at
    the tag v1 (seed 1), through ``locate_model``'s download path."""
    from promptcache.testing.tiny_models import save_tiny_model

    base = tmp_path_factory.mktemp("hub")
    hub = FakeHub()
    try:
        main = hub.add(REPO, Path(save_tiny_model("llama", str(base / "main"), seed=0)), ["main"])
        v1 = hub.add(REPO, Path(save_tiny_model("llama", str(base / "v1"), seed=1)), ["v1"])
        env = {"HF_HOME": str(base / "hf"), "HF_ENDPOINT": hub.url, "HF_HUB_OFFLINE": "0"}
        got = locate([(REPO, None), (REPO, "v1")], env)
    finally:
        hub.close()
    return {"home": base / "hf", "main": main, "v1": v1, "downloaded": got, "base": base}


def offline(hub_cache, **extra: str) -> dict[str, str]:
    return {"HF_HOME": str(hub_cache["home"]), "HF_HUB_OFFLINE": "1", "HF_ENDPOINT": DEAD_HUB,
            **extra}  # fmt: skip


def test_download_writes_the_hf_cache_layout(hub_cache):
    repo_dir = hub_cache["home"] / "hub" / "models--tiny-org--tiny-llama"
    (main_path, source, name, rev), (v1_path, _, _, v1_rev) = hub_cache["downloaded"]
    assert (source, name, rev, v1_rev) == ("hf-download", REPO, hub_cache["main"], hub_cache["v1"])
    assert Path(main_path) == repo_dir / "snapshots" / hub_cache["main"]
    assert (repo_dir / "refs" / "main").read_text() == hub_cache["main"]
    assert (repo_dir / "refs" / "v1").read_text() == hub_cache["v1"]
    weights = Path(v1_path) / "model.safetensors"
    assert weights.is_symlink() and weights.resolve().parent == repo_dir / "blobs"
    import hashlib

    assert weights.resolve().name == hashlib.sha256(weights.read_bytes()).hexdigest()
    assert (Path(main_path) / "model.safetensors").read_bytes() != weights.read_bytes()


def test_offline_resolution_through_huggingface_hub(hub_cache):
    main, v1 = hub_cache["main"], hub_cache["v1"]
    got = locate([(REPO, None), (REPO, "main"), (REPO, "v1"), (REPO, v1), (REPO, "v2"),
                  ("nobody/nothing", None), ("ab/c..d", None)], offline(hub_cache))  # fmt: skip
    snap = hub_cache["home"] / "hub" / "models--tiny-org--tiny-llama" / "snapshots"
    assert got[0] == [str(snap / main), "hf-cache", REPO, main]
    assert got[1] == got[0]
    assert got[2] == [str(snap / v1), "hf-cache", REPO, v1]
    assert got[3] == got[2]  # a commit hash as the revision
    for err in got[4:6]:
        assert err[:2] == ["error", "ModelNotFoundError"]
        assert "not in the HF cache" in err[2] and "HF_HUB_OFFLINE" in err[2]
    assert got[6][:2] == ["error", "ModelNotFoundError"] and "no valid hub id" in got[6][2]
    # HF_HUB_CACHE wins over HF_HOME, as in huggingface_hub
    env = offline(hub_cache, HF_HOME=str(hub_cache["base"] / "empty"),
                  HF_HUB_CACHE=str(hub_cache["home"] / "hub"))  # fmt: skip
    assert locate([(REPO, None)], env)[0][:2] == [str(snap / main), "hf-cache"]


def test_missing_model_exits_2_with_what_to_do(hub_cache, tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PROMPTCACHE_HOME": str(tmp_path),
           **offline(hub_cache, HOME=str(tmp_path))}  # fmt: skip
    done = subprocess.run(
        [sys.executable, "-m", "promptcache.cli", "serve", "--model", "nobody/nothing"],
        env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 2, done.stderr
    assert "nobody/nothing is not in the HF cache" in done.stderr
    assert "hf download nobody/nothing" in done.stderr and "Traceback" not in done.stderr


@pytest.fixture(scope="module")
def studio_home(tmp_path_factory, hub_cache):
    """A HOME with LM Studio's models folder: an MLX model (saved by mlx-lm, 4-bit), a GGUF
    folder with two quants, an unservable model type, and REPO (also in the HF cache)."""
    pytest.importorskip("mlx_lm")
    import mlx.nn as nn
    from mlx_lm.utils import save_model
    from tiny_gguf import write_tiny_gguf

    from promptcache.testing.tiny_models import mlx_tiny_model, save_mlx_tiny_model

    home = tmp_path_factory.mktemp("home")
    models = home / ".lmstudio" / "models"
    mlx_dir = Path(save_mlx_tiny_model("llama", str(models / "mlx-community" / "tiny-4bit")))
    model = mlx_tiny_model("llama", vocab_size=json.loads((mlx_dir / "config.json").read_text())["vocab_size"])  # fmt: skip
    nn.quantize(model, group_size=32, bits=4)
    save_model(mlx_dir, model)
    config = json.loads((mlx_dir / "config.json").read_text())
    config["quantization"] = {"group_size": 32, "bits": 4}
    (mlx_dir / "config.json").write_text(json.dumps(config))
    gguf_dir = models / "lmstudio-community" / "tiny-GGUF"
    gguf_dir.mkdir(parents=True)
    write_tiny_gguf(gguf_dir / "tiny-F32.gguf")
    (gguf_dir / "tiny-copy-F32.gguf").write_bytes((gguf_dir / "tiny-F32.gguf").read_bytes())
    odd = models / "someone" / "odd-model"
    odd.mkdir(parents=True)
    (odd / "config.json").write_text(json.dumps({"model_type": "no_such_arch"}))
    (odd / "model.safetensors").write_bytes((mlx_dir / "model.safetensors").read_bytes())
    gptq = models / "someone" / "tiny-gptq"
    gptq.mkdir(parents=True)
    (gptq / "config.json").write_text(json.dumps({"model_type": "llama", "quantization_config": {"quant_method": "gptq", "bits": 4}}))  # fmt: skip
    (gptq / "model.safetensors").write_bytes((hub_cache["base"] / "main" / "model.safetensors").read_bytes())  # fmt: skip
    dup = models / REPO
    dup.mkdir(parents=True)
    (dup / "config.json").write_text("{}")
    return home


def test_lmstudio_models(studio_home, hub_cache):
    models = studio_home / ".lmstudio" / "models"
    env = offline(hub_cache, HOME=str(studio_home))
    got = locate([("mlx-community/tiny-4bit", None), ("lmstudio-community/tiny-GGUF/tiny-F32.gguf", None),
                  ("lmstudio-community/tiny-GGUF", None), (REPO, None),
                  ("mlx-community/tiny-4bit", "main")], env)  # fmt: skip
    assert got[0] == [str(models / "mlx-community" / "tiny-4bit"), "lmstudio", "mlx-community/tiny-4bit", None]  # fmt: skip
    assert got[1][:2] == [str(models / "lmstudio-community" / "tiny-GGUF" / "tiny-F32.gguf"), "lmstudio"]  # fmt: skip
    assert got[2][:2] == ["error", "ModelNotFoundError"] and "tiny-copy-F32.gguf" in got[2][2]
    assert got[3][1] == "hf-cache"  # in both: the HF cache wins (and the log says so)
    assert got[4][:2] == ["error", "ModelNotFoundError"]  # a revision: LM Studio has none
    # LM Studio moved elsewhere: its home pointer and its downloadsFolder setting are followed
    moved = studio_home / "elsewhere"
    moved.mkdir(exist_ok=True)
    (moved / "settings.json").write_text(json.dumps({"downloadsFolder": str(models)}))
    pointer_home = studio_home / "pointer-home"
    pointer_home.mkdir(exist_ok=True)
    (pointer_home / ".lmstudio-home-pointer").write_text(str(moved))
    got = locate([("mlx-community/tiny-4bit", None)], offline(hub_cache, HOME=str(pointer_home)))
    assert got[0][1] == "lmstudio"


def test_engine_follows_the_weights_format(studio_home):
    from promptcache.engines.factory import check_engine_reads, pick_engine
    from promptcache.errors import ConfigError
    from promptcache.models.sources import FoundModel

    mlx_dir = studio_home / ".lmstudio" / "models" / "mlx-community" / "tiny-4bit"
    found = FoundModel(mlx_dir, "lmstudio", "mlx-community/tiny-4bit")
    assert pick_engine("auto", found) == "mlx"
    assert pick_engine("torch", found) == "torch"
    with pytest.raises(ConfigError, match="only the mlx engine reads"):
        check_engine_reads("torch", found)


def test_models_command_lists_what_is_found(studio_home, hub_cache, tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PROMPTCACHE_HOME": str(tmp_path),
           **offline(hub_cache, HOME=str(studio_home))}  # fmt: skip
    both = "from promptcache.cli.main import main; main(['models', '--json']); print('=' * 8); main(['models'])"  # fmt: skip
    done = subprocess.run([sys.executable, "-c", both], env=env, capture_output=True, text=True,
                          timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr
    listing, table = done.stdout.split("=" * 8 + "\n")
    rows = {(r["model"], r["revision"], r["source"]): r for r in json.loads(listing)}
    main, v1 = rows[(REPO, None, "hf-cache")], rows[(REPO, "v1", "hf-cache")]
    assert main["commit"] == hub_cache["main"] and v1["commit"] == hub_cache["v1"]
    for row in (main, v1):
        assert (row["fmt"], row["model_type"], row["engine"], row["can_serve"]) == ("safetensors", "llama", "torch", True)  # fmt: skip
        assert row["size_bytes"] > 100_000
    mlx = rows[("mlx-community/tiny-4bit", None, "lmstudio")]
    assert (mlx["fmt"], mlx["engine"], mlx["can_serve"]) == ("mlx", "mlx", True)
    for name in ("tiny-F32.gguf", "tiny-copy-F32.gguf"):
        row = rows[(f"lmstudio-community/tiny-GGUF/{name}", None, "lmstudio")]
        assert (row["fmt"], row["model_type"], row["can_serve"]) == ("gguf", "llama", True)
    odd = rows[("someone/odd-model", None, "lmstudio")]
    assert odd["can_serve"] is False and "no_such_arch" in odd["reason"]
    assert rows[(REPO, None, "lmstudio")]["can_serve"] is False  # a config without a model
    gptq = rows[("someone/tiny-gptq", None, "lmstudio")]
    if importlib.util.find_spec("gptqmodel") is None:
        assert gptq["can_serve"] is False and "gptqmodel" in gptq["reason"]
    assert f"{REPO} --revision v1" in table and "no_such_arch" in table


@pytest.mark.server
def test_serve_a_hub_id_from_the_cache(hub_cache, server_factory):
    from openai import OpenAI

    srv = server_factory("--model", REPO, "--no-ssd", env=offline(hub_cache))
    client = OpenAI(base_url=srv.url + "/v1", api_key="none")
    assert [m.id for m in client.models.list().data] == [REPO]
    reply = client.chat.completions.create(
        model=REPO, messages=[{"role": "user", "content": "hello"}], max_tokens=8, temperature=0
    )
    assert reply.choices[0].message.content and reply.usage.completion_tokens > 0


def test_a_partial_download_is_not_served_offline(hub_cache, tmp_path):
    import shutil

    home = tmp_path / "hf"
    shutil.copytree(hub_cache["home"], home, symlinks=True)
    snap = home / "hub" / "models--tiny-org--tiny-llama" / "snapshots" / hub_cache["main"]
    (snap / "model.safetensors").unlink()  # as an interrupted download leaves it
    got = locate([(REPO, None)], {**offline(hub_cache), "HF_HOME": str(home)})
    assert got[0][:2] == ["error", "ModelNotFoundError"] and "partial download" in got[0][2]


@pytest.mark.server
@pytest.mark.mlx
def test_serve_an_lmstudio_mlx_model_on_mlx(studio_home, hub_cache, server_factory):
    """``--engine auto`` puts mlx-lm's (4-bit) weights on the mlx engine, even on Linux."""
    import httpx

    srv = server_factory("--model", "mlx-community/tiny-4bit", "--no-ssd",
                         env=offline(hub_cache, HOME=str(studio_home)))  # fmt: skip
    reply = httpx.post(srv.url + "/v1/chat/completions", timeout=120, json={
        "messages": [{"role": "user", "content": "hello"}], "max_tokens": 6, "temperature": 0})  # fmt: skip
    assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] > 0
    assert httpx.get(srv.url + "/v1/models").json()["data"][0]["id"] == "mlx-community/tiny-4bit"
    assert "(mlx) on http" in srv.log.read_text()


def test_an_interrupted_download_completes_later(tmp_path):
    """A download that stopped part-way keeps the files it got; the next start fetches only the
    rest (the partial snapshot is not served in between)."""
    from promptcache.testing.tiny_models import save_tiny_model

    hub = FakeHub()
    try:
        commit = hub.add(REPO, Path(save_tiny_model("llama", str(tmp_path / "m"))), ["main"])
        env = {"HF_HOME": str(tmp_path / "hf"), "HF_ENDPOINT": hub.url, "HF_HUB_OFFLINE": "0"}
        hub.missing = {"model.safetensors"}
        first = locate([(REPO, None)], env)[0]
        assert first[:2] == ["error", "ModelNotFoundError"] and "downloading it failed" in first[2]
        # the failed file cancels downloads still running, so which others were kept varies
        snapshot = tmp_path / "hf" / "hub" / "models--tiny-org--tiny-llama" / "snapshots" / commit
        kept = {p.name for p in snapshot.iterdir()} if snapshot.is_dir() else set()
        assert "model.safetensors" not in kept
        hub.missing, hub.requests[:] = set(), []
        assert locate([(REPO, None)], env)[0][1:4] == ["hf-download", REPO, commit]
        fetched = [r.rsplit("/", 1)[1] for r in hub.requests if r.startswith("GET") and "/resolve/" in r]  # fmt: skip
        assert "model.safetensors" in fetched and len(fetched) == len(set(fetched))
        assert not kept & set(fetched), "a file kept from the first attempt was fetched again"
    finally:
        hub.close()
