"""The real Claude Code CLI (installed by `make test` from npm).

With the default model: two `claude -p` sessions with different first prompts, in a throwaway
git repo, as a user runs them: both must finish without an API error, and the second must reuse
at least 80% of its prompt tokens from the first (the server's own usage counters, over every
request it sent). With scripted replies: a loop through its Bash and Read tools
(``agent_helpers``), every request reusing at least 90% of the prompt before it.
"""

import os
import re
import shutil
import subprocess
from pathlib import Path

import httpx
import pytest
from agent_helpers import (
    assert_tool_loop,
    base_env,
    cli_path,
    make_workspace,
    run_cli,
    start_scripted_server,
    write_loop_script,
)

pytest.importorskip("torch")
pytestmark = [pytest.mark.server, pytest.mark.slow]

CLAUDE = cli_path(
    "PROMPTCACHE_CLAUDE", "claude-code-2.1.197/node_modules/.bin/claude"
) or shutil.which("claude")


def counters(url: str) -> tuple[int, int]:
    text = httpx.get(url + "/metrics").text
    prompt = re.search(r"^promptcache_prompt_tokens_total (\d+)", text, re.M)
    cached = re.search(r"^promptcache_cached_prompt_tokens_total (\d+)", text, re.M)
    assert prompt and cached
    return int(prompt.group(1)), int(cached.group(1))


def run_claude(url: str, repo: Path, home: Path, prompt: str) -> subprocess.CompletedProcess:
    env = {
        "PATH": os.environ.get("PATH", ""),
        "HOME": str(home),
        "ANTHROPIC_BASE_URL": url,
        "ANTHROPIC_API_KEY": "sk-any",
        "DISABLE_AUTOUPDATER": "1",
    }
    # one built-in tool keeps the cold prefill of a 135M model on 2 CPU cores near a minute
    cmd = [CLAUDE, "-p", prompt, "--tools", "Bash", "--max-turns", "2"]
    return subprocess.run(
        cmd, cwd=repo, env=env, capture_output=True, text=True, timeout=600, check=False
    )


@pytest.mark.skipif(
    not CLAUDE or not os.path.exists(CLAUDE), reason="Claude Code CLI not installed"
)
def test_two_claude_code_sessions_finish_and_share_their_prefix(server_factory, tmp_path):
    srv = server_factory("--max-output-tokens", "24")
    repo = tmp_path / "repo"
    repo.mkdir()
    (repo / "hello.py").write_text("print('hello')\n")
    subprocess.run(["git", "init", "-q"], cwd=repo, check=True)
    home = tmp_path / "claude-home"
    home.mkdir()

    first = run_claude(srv.url, repo, home, "List the files in this repository.")
    assert first.returncode == 0, (first.stdout, first.stderr)
    assert "API Error" not in first.stdout + first.stderr
    prompt_before, cached_before = counters(srv.url)
    assert prompt_before > 1000  # the system prompt and the Bash tool reached the model

    second = run_claude(srv.url, repo, home, "What does hello.py print?")
    assert second.returncode == 0, (second.stdout, second.stderr)
    assert "API Error" not in second.stdout + second.stderr
    prompt_after, cached_after = counters(srv.url)
    prompt, cached = prompt_after - prompt_before, cached_after - cached_before
    assert cached >= 0.8 * prompt, (cached, prompt)


@pytest.mark.skipif(
    not CLAUDE or not os.path.exists(CLAUDE), reason="Claude Code CLI not installed"
)
def test_claude_code_runs_a_tool_loop(server_factory, scripted_model_dir, tmp_path):
    ws = make_workspace(tmp_path)
    subprocess.run(["git", "init", "-q"], cwd=ws.work, check=True)
    script = write_loop_script(
        tmp_path / "script.json",
        {"name": "Bash", "arguments": {"command": "ls", "description": "List files"}},
        {"name": "Read", "arguments": {"file_path": str(ws.note)}},
    )
    srv = start_scripted_server(server_factory, scripted_model_dir, script)
    # only the provider: Claude Code's default tools and side requests (no self-update of the
    # pinned CLI, which changes nothing it sends)
    env = base_env(
        ws, ANTHROPIC_BASE_URL=srv.url, ANTHROPIC_API_KEY="sk-any", DISABLE_AUTOUPDATER="1"
    )
    prompt = "List the files here, then tell me what notes.txt says."
    cmd = [str(CLAUDE), "-p", prompt]
    records = assert_tool_loop(srv.url, run_cli(cmd, ws, env))
    assert all(r["endpoint"] == "/v1/messages" for r in records)
