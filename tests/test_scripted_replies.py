"""The scripted model (``serve --scripted-replies``): forced token ids through the engine's
constraint seam, the reply picked per request, tool calls in the model's format, and the next
turn finding the reply's tokens in the cache (official `openai` client, both engines)."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from promptcache.engines.base import ConfigError, RequestError
from promptcache.server.script import ReplyScript
from promptcache.serving.forced import ForcedTokens

TOOLS = [
    {"type": "function", "function": {"name": name, "description": f"{name} a path",
     "parameters": {"type": "object", "properties": {"path": {"type": "string"}},
                    "required": ["path"]}}}
    for name in ("list_dir", "read_file")
]  # fmt: skip
SCRIPT = {
    "replies": [
        {"turn": 0, "tool_calls": [{"name": "list_dir", "arguments": {"path": "/srv"}}]},
        {
            "turn": 1,
            "match": r"a\.txt",
            "tool_calls": [{"name": "read_file", "arguments": {"path": "/srv/a.txt"}}],
        },
        {"turn": 2, "match": "BANANA", "content": "a.txt holds BANANA."},
        {"turn": 0, "content": "no tools here"},
    ]
}


def test_forced_tokens_allow_one_id_per_step_then_stop():
    forced = ForcedTokens([5, 7, 2])
    for want in (5, 7, 2):
        assert not forced.is_stopped
        masked = forced.mask(np.zeros(10, dtype=np.float32))
        assert int(np.argmax(masked)) == want and np.isinf(masked).sum() == 9
        forced.accept(want)
    assert forced.is_stopped
    with pytest.raises(ValueError):
        ForcedTokens([])


def test_script_picks_by_turn_match_and_offered_tools(tmp_path):
    path = tmp_path / "s.json"
    path.write_text(json.dumps(SCRIPT))
    script = ReplyScript.load(path)
    names = {"list_dir", "read_file"}
    user = [{"role": "user", "content": "go"}]
    assert script.pick(user, names).calls[0].name == "list_dir"
    assert script.pick(user, set()).content == "no tools here"  # a side request without tools
    call = {"role": "assistant", "content": "", "tool_calls": [{}]}
    turn1 = [*user, call, {"role": "tool", "content": "a.txt b.txt"}]
    assert script.pick(turn1, names).calls[0].arguments == '{"path": "/srv/a.txt"}'
    turn2 = [*turn1, call, {"role": "tool", "content": "BANANA"}]
    assert script.pick(turn2, names).content == "a.txt holds BANANA."
    turn2[-1] = {"role": "tool", "content": "no such file"}  # the tool did not run: no reply
    with pytest.raises(RequestError, match="turn 2"):
        script.pick(turn2, names)


@pytest.mark.parametrize(
    "body", ["not json", '{"replies": [{"turn": -1, "content": "x"}]}', '{"replies": [{}]}',
             '{"replies": [{"match": "(", "content": "x"}]}', '{"other": []}'],
)  # fmt: skip
def test_bad_script_files_are_config_errors(tmp_path, body):
    path = tmp_path / "s.json"
    path.write_text(body)
    with pytest.raises(ConfigError, match="--scripted-replies"):
        ReplyScript.load(path)


def test_serve_with_a_bad_script_exits_2_with_the_reason(tmp_path):
    path = tmp_path / "s.json"
    path.write_text('{"replies": [{}]}')
    out = subprocess.run(
        [sys.executable, "-m", "promptcache.cli", "serve", "--scripted-replies", str(path)],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert out.returncode == 2, out
    assert "a reply needs content or tool_calls" in out.stdout + out.stderr
    assert "Traceback" not in out.stdout + out.stderr


@pytest.fixture(scope="module", params=["torch", "mlx"])
def scripted(request, tiny_llama_dir, tmp_path_factory):
    from conftest import ServerProcess

    pytest.importorskip("mlx_lm" if request.param == "mlx" else "torch")
    home = tmp_path_factory.mktemp("scripted")
    (home / "script.json").write_text(json.dumps(SCRIPT))
    srv = ServerProcess(
        ["--engine", request.param, "--model", tiny_llama_dir, "--block-size", "16",
         "--max-context", "2048", "--no-ssd", "--scripted-replies", str(home / "script.json")],
        env={"PROMPTCACHE_HOME": str(home)}, log=home / "server.log",
    ).start()  # fmt: skip
    yield srv
    srv.stop()


@pytest.mark.server
def test_a_tool_loop_through_the_openai_client_reuses_each_prompt(scripted):
    from openai import BadRequestError, OpenAI

    client = OpenAI(base_url=scripted.url + "/v1", api_key="x", max_retries=0)
    messages: list = [{"role": "user", "content": "What is in /srv/a.txt?"}]
    prompts = []

    def turn(result: str, stream: bool = False) -> tuple[str, list]:
        if stream:
            chunks = list(client.chat.completions.create(
                model="m", messages=messages, tools=TOOLS, stream=True,
                stream_options={"include_usage": True}))  # fmt: skip
            text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            calls = [t for c in chunks if c.choices for t in c.choices[0].delta.tool_calls or []]
            usage = chunks[-1].usage
            calls = [{"id": calls[0].id, "type": "function", "function": {
                "name": calls[0].function.name,
                "arguments": "".join(t.function.arguments or "" for t in calls)}}] if calls else []  # fmt: skip
        else:
            r = client.chat.completions.create(model="m", messages=messages, tools=TOOLS)
            text, usage = r.choices[0].message.content or "", r.usage
            calls = [c.model_dump() for c in r.choices[0].message.tool_calls or []]
        prompts.append((usage.prompt_tokens, usage.prompt_tokens_details.cached_tokens))
        messages.append({"role": "assistant", "content": text or None, "tool_calls": calls or None})
        if result:
            messages.append({"role": "tool", "tool_call_id": calls[0]["id"], "content": result})
        return text, calls

    _, calls = turn("a.txt\nb.txt")
    assert calls[0]["function"]["name"] == "list_dir"
    assert json.loads(calls[0]["function"]["arguments"]) == {"path": "/srv"}
    _, calls = turn("BANANA", stream=True)
    assert calls[0]["function"]["name"] == "read_file"
    assert json.loads(calls[0]["function"]["arguments"]) == {"path": "/srv/a.txt"}
    text, calls = turn("")
    assert text == "a.txt holds BANANA." and not calls
    for (before, _), (_, cached) in zip(prompts, prompts[1:], strict=False):
        assert cached >= 0.9 * before, prompts  # the forced reply's tokens were found again
    with pytest.raises(BadRequestError, match="no scripted reply"):
        client.chat.completions.create(
            model="m", messages=[*messages[:-1], {"role": "tool", "tool_call_id": "x",
                                                  "content": "gone"}], tools=TOOLS[:1],
        )  # fmt: skip
