"""Driving a real agent CLI through a tool loop against a real server with scripted replies.

The model is a tiny llama with the bundled tokenizer (``scripted_model_dir``); the server emits
a script (``serve --scripted-replies``): turn 0 a first tool call, turn 1 (only once the first
result names the file) a second one, turn 2 (only once the second result holds the file's
secret) the final answer. So a CLI that did not run both tools gets no reply and fails.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

SECRET = "PINEAPPLE-42"
NOTE = "notes.txt"
CLI_TIMEOUT_S = 240  # one CLI run: start-up, three requests on the tiny model, the tools
MIN_REUSE = 0.9  # of the previous request's prompt, for every request after the first


def cli_path(env_var: str, installed: str) -> str | None:
    """The CLI from its ``PROMPTCACHE_*`` variable (set by ``make test``), else ``.tools/``."""
    path = os.environ.get(env_var) or str(Path(__file__).parent.parent / ".tools" / installed)
    return path if os.path.exists(path) else None


def skip_reason(name: str, target: str) -> str:
    how = f"`make {target}` installs it" if shutil.which("npm") else "npm is missing"
    return f"{name} is not installed ({how})"


@dataclass(frozen=True, slots=True)
class Workspace:
    work: Path  # the folder the CLI runs in, holding NOTE
    home: Path  # the CLI's HOME (config, sessions, logs): nothing of the user's

    @property
    def note(self) -> Path:
        return self.work / NOTE


def make_workspace(tmp: Path) -> Workspace:
    ws = Workspace(tmp / "work", tmp / "home")
    ws.work.mkdir()
    ws.home.mkdir()
    ws.note.write_text(f"The secret is {SECRET}.\n")
    return ws


def write_loop_script(
    path: Path, first: dict[str, Any], second: dict[str, Any], first_result: str | None = None
) -> Path:
    """Two tool calls, then the answer; ``first``/``second``: {"name", "arguments"}.
    ``first_result``: a regex the first tool's result must match (default: the note's name,
    which the first call lists)."""
    first_result = NOTE.replace(".", r"\.") if first_result is None else first_result
    replies = [
        {"turn": 0, "tool_calls": [first]},
        {"turn": 1, "match": first_result, "tool_calls": [second]},
        {"turn": 2, "match": SECRET, "content": f"{NOTE} says {SECRET}."},
        {"turn": 0, "content": "Tool loop test"},  # side requests without tools (titles)
    ]
    path.write_text(json.dumps({"replies": replies}))
    return path


def start_scripted_server(server_factory: Any, model_dir: str, script: Path) -> Any:
    # as a user starts it: a max_tokens past the context (Claude Code asks 64000) is clamped
    return server_factory("--model", model_dir, "--no-ssd", "--scripted-replies", str(script))


def base_env(ws: Workspace, **extra: str) -> dict[str, str]:
    """A bare environment: PATH, a throwaway HOME, no proxies, no update checks."""
    return {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "HOME": str(ws.home),
        "XDG_CONFIG_HOME": str(ws.home / ".config"),
        "XDG_DATA_HOME": str(ws.home / ".local" / "share"),
        "XDG_CACHE_HOME": str(ws.home / ".cache"),
        "NO_UPDATE_NOTIFIER": "1",
        "NO_COLOR": "1",
        **extra,
    }


def run_cli(cmd: list[str], ws: Workspace, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run(
        cmd, cwd=ws.work, env=env, capture_output=True, text=True, timeout=CLI_TIMEOUT_S,
        stdin=subprocess.DEVNULL, check=False,
    )  # fmt: skip


def cache_records(url: str) -> list[dict[str, Any]]:
    """The server's own per-request cache records, oldest first."""
    body = httpx.get(url + "/v1/cache/requests", timeout=10).json()
    records = body.get("requests", body) if isinstance(body, dict) else body
    return sorted(records, key=lambda r: r["id"])


def error_statuses(url: str) -> dict[str, int]:
    """Requests the server answered with a 4xx/5xx, by endpoint and status (its own counters)."""
    text = httpx.get(url + "/metrics", timeout=10).text
    found = re.findall(r'^promptcache_requests_total\{endpoint="([^"]*)",status="(\d+)"\} (\d+)',
                       text, re.M)  # fmt: skip
    return {f"{e} {s}": int(n) for e, s, n in found if int(s) >= 400 and int(n)}


def assert_tool_loop(
    url: str, proc: subprocess.CompletedProcess, min_requests: int = 3
) -> list[dict[str, Any]]:
    """The CLI exited 0 with the answer, the server answered no request with a 4xx/5xx, its
    requests ran the loop, and every request of the agent's conversation after the first reused
    at least MIN_REUSE of the prompt before it. Side requests (a title, far shorter than the
    agent's prompt with its tools) are left out of that chain. Returns the conversation's
    records."""
    assert proc.returncode == 0, (proc.returncode, proc.stdout[-3000:], proc.stderr[-3000:])
    assert SECRET in proc.stdout, (proc.stdout[-3000:], proc.stderr[-3000:])
    assert not error_statuses(url), error_statuses(url)
    records = cache_records(url)
    for r in records:  # shown with -s: the measured loop
        print(
            r["endpoint"], r["finish"], "prompt", r["prompt_tokens"], "cached", r["cached_tokens"]
        )
    failed = [r for r in records if r["finish"] not in ("stop", "tool_calls", "length")]
    assert not failed, failed
    longest = max(r["prompt_tokens"] for r in records)
    chain = [r for r in records if r["prompt_tokens"] >= longest / 2]
    assert len(chain) >= min_requests, records
    for before, after in zip(chain, chain[1:], strict=False):
        reuse = after["cached_tokens"] / before["prompt_tokens"]
        assert reuse >= MIN_REUSE, (before, after)
    return chain
