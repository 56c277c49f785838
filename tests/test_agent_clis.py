"""Real agent CLIs (installed by `make test` from npm at pinned versions) through a two-tool loop
against a real server with scripted replies: opencode and Qwen Code over chat completions, the
Codex CLI over the Responses API. Each lists the folder with its shell tool, reads the file with
its read tool, prints the answer and exits 0; every request after the first reuses at least 90%
of the prompt before it (the server's own records). Claude Code's loop is in test_claude_code.py.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from agent_helpers import (
    assert_tool_loop,
    base_env,
    cli_path,
    make_workspace,
    run_cli,
    skip_reason,
    start_scripted_server,
    write_loop_script,
)

pytest.importorskip("torch")
pytestmark = [pytest.mark.server, pytest.mark.slow]

OPENCODE = cli_path("PROMPTCACHE_OPENCODE", "opencode-1.18.33/node_modules/.bin/opencode")
CODEX = cli_path("PROMPTCACHE_CODEX", "codex-0.171.0/node_modules/.bin/codex")
QWEN = cli_path("PROMPTCACHE_QWEN", "qwen-code-0.24.4/node_modules/.bin/qwen")
PROMPT = "List the files in this folder, then tell me what notes.txt says."


@pytest.mark.skipif(OPENCODE is None, reason=skip_reason("opencode", "agent-clis"))
def test_opencode_runs_a_tool_loop(server_factory, scripted_model_dir, tmp_path):
    ws = make_workspace(tmp_path)
    script = write_loop_script(
        tmp_path / "script.json",
        {"name": "bash", "arguments": {"command": "ls", "description": "List files"}},
        {"name": "read", "arguments": {"filePath": str(ws.note)}},
    )
    srv = start_scripted_server(server_factory, scripted_model_dir, script)
    config = {
        "$schema": "https://opencode.ai/config.json",
        "provider": {
            "promptcache": {
                "npm": "@ai-sdk/openai-compatible",  # bundled in the opencode binary
                "name": "promptcache",
                "options": {"baseURL": srv.url + "/v1", "apiKey": "sk-local"},
                "models": {"tiny": {}},
            }
        },
        "model": "promptcache/tiny",
    }
    (tmp_path / "opencode.json").write_text(json.dumps(config))
    env = base_env(
        ws,
        OPENCODE_CONFIG=str(tmp_path / "opencode.json"),
        OPENCODE_DISABLE_AUTOUPDATE="1",
        OPENCODE_DISABLE_MODELS_FETCH="1",  # no models.dev catalogue
        OPENCODE_DISABLE_LSP_DOWNLOAD="1",
        OPENCODE_DISABLE_DEFAULT_PLUGINS="1",
        OPENCODE_DISABLE_SHARE="1",
        OPENCODE_DISABLE_CLAUDE_CODE="1",  # ignore any ~/.claude of the machine
        OPENCODE_DISABLE_PROJECT_CONFIG="1",  # no opencode.json of a folder above the test's
    )
    proc = run_cli([str(OPENCODE), "run", PROMPT], ws, env)
    records = assert_tool_loop(srv.url, proc)
    assert all(r["endpoint"] == "/v1/chat/completions" for r in records)


@pytest.mark.skipif(QWEN is None, reason=skip_reason("Qwen Code", "agent-clis"))
def test_qwen_code_runs_a_tool_loop(server_factory, scripted_model_dir, tmp_path):
    ws = make_workspace(tmp_path)
    script = write_loop_script(
        tmp_path / "script.json",
        {"name": "run_shell_command", "arguments": {"command": "ls", "description": "List"}},
        {"name": "read_file", "arguments": {"file_path": str(ws.note)}},
        # the shell's result, not its output: under load Qwen Code once handed back an `ls`
        # of this one-file folder as "Output: (empty)" (its shell, not our server)
        first_result=r"Command: ls",
    )
    srv = start_scripted_server(server_factory, scripted_model_dir, script)
    settings = {
        "privacy": {"usageStatisticsEnabled": False},
        "telemetry": {"enabled": False},
        "security": {"auth": {"selectedType": "openai"}},
        "general": {"disableAutoUpdate": True, "disableUpdateNag": True},
    }
    (ws.home / ".qwen").mkdir()
    (ws.home / ".qwen" / "settings.json").write_text(json.dumps(settings))
    env = base_env(
        ws,
        OPENAI_BASE_URL=srv.url + "/v1",
        OPENAI_API_KEY="sk-local",
        OPENAI_MODEL="tiny",
        QWEN_CODE_SUPPRESS_YOLO_WARNING="1",
    )
    proc = run_cli([str(QWEN), "-p", PROMPT, "--approval-mode", "yolo"], ws, env)
    records = assert_tool_loop(srv.url, proc)
    assert records[0]["prompt_tokens"] > 10_000  # Qwen Code's whole system prompt and tools


# only the provider, as a user first sets it up: Codex then asks for its own default model, in
# code mode (its tools in an additional_tools item, run through one freeform `exec` tool in the
# `functions` namespace); with `model` named too, its tools come in `tools` (sub-agent tools as a
# `namespace` tool) and the shell tool is called directly
CODEX_CONFIG = """
{model}model_provider = "promptcache"

[model_providers.promptcache]
name = "promptcache"
base_url = "{url}/v1"
env_key = "PROMPTCACHE_API_KEY"
"""


def codex_shell(cmd: str, code_mode: bool) -> dict[str, Any]:
    """A call running ``cmd`` with Codex's shell tool: in code mode through JavaScript that
    returns the command's output."""
    if not code_mode:
        return {"name": "exec_command", "arguments": {"cmd": cmd}}
    code = f"text((await tools.exec_command({{cmd: {json.dumps(cmd)}}})).output)"
    return {"name": "exec", "arguments": {"input": code}}


@pytest.mark.skipif(CODEX is None, reason=skip_reason("Codex CLI", "agent-clis"))
@pytest.mark.parametrize("model", ["", 'model = "tiny"\n'], ids=["provider-only", "model-named"])
def test_codex_runs_a_tool_loop(server_factory, scripted_model_dir, tmp_path, model):
    ws = make_workspace(tmp_path)
    code_mode = not model
    script = write_loop_script(
        tmp_path / "script.json",
        codex_shell("ls", code_mode),
        codex_shell(f"cat {ws.note.name}", code_mode),
    )
    srv = start_scripted_server(server_factory, scripted_model_dir, script)
    codex_home = tmp_path / "codex-home"
    codex_home.mkdir()
    (codex_home / "config.toml").write_text(CODEX_CONFIG.format(url=srv.url, model=model))
    env = base_env(ws, CODEX_HOME=str(codex_home), PROMPTCACHE_API_KEY="sk-local")
    cmd = [str(CODEX), "exec", "--skip-git-repo-check",
           "--dangerously-bypass-approvals-and-sandbox", PROMPT]  # fmt: skip
    records = assert_tool_loop(srv.url, run_cli(cmd, ws, env))
    assert all(r["endpoint"] == "/v1/responses" for r in records)
