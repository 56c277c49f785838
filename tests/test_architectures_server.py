"""The vision-language checkpoint layout (text_config + vision_config, decoder weights under
model.language_model) served over real HTTP on both engines: text chat equal to --no-cache with
the history reused, images refused with a 400 where the family's image path is unsupported
(said at start-up), and a checkpoint that cannot serve refused at start-up with exit 2."""

import base64
import io
import os
import subprocess
import sys

import numpy as np
import openai
import pytest
from conftest import ServerProcess

from promptcache.testing.tiny_families import save_family

pytestmark = pytest.mark.server
ENGINES = {"torch": "qwen3_5_moe-vl", "mlx": "qwen3_5-vl"}


@pytest.fixture(scope="module", params=list(ENGINES))
def servers(request, tmp_path_factory):
    engine = request.param
    if engine == "mlx":
        pytest.importorskip("mlx_lm")
    home = tmp_path_factory.mktemp(f"vl-{engine}")
    folder = save_family(ENGINES[engine], home / "model")
    args = ["--engine", engine, "--model", str(folder), "--block-size", "8"]
    env = {"PROMPTCACHE_HOME": str(home / "home")}
    on = ServerProcess(args, env=env, log=home / "on.log", log_level="info").start()
    off = ServerProcess([*args, "--no-cache"], env=env, log=home / "off.log").start()
    yield engine, on, off, home / "on.log"
    on.stop()
    off.stop()


def chat(srv, messages):
    client = openai.OpenAI(base_url=srv.url + "/v1", api_key="x")
    return client.chat.completions.create(model="m", messages=messages, max_tokens=8, temperature=0)


def test_text_chat_on_a_vision_checkpoint_equals_uncached(servers):
    engine, on, off, log = servers
    messages = [{"role": "user", "content": "The quick brown fox jumps over the lazy dog."}]
    cached = []
    for turn in range(3):
        r_on, r_off = chat(on, messages), chat(off, messages)
        assert r_on.choices[0].message.content == r_off.choices[0].message.content, turn
        cached.append(r_on.usage.prompt_tokens_details.cached_tokens)
        messages += [
            {"role": "assistant", "content": r_on.choices[0].message.content},
            {"role": "user", "content": f"A prompt cache keeps the state it computed ({turn})."},
        ]
    assert cached[0] == 0 and all(c > 0 for c in cached[1:]), cached
    # torch has images for this family, not without the checkpoint's image processor
    assert "images are not supported for" in log.read_text()


def test_image_parts_get_a_clear_400_and_the_server_stays_up(servers):
    from PIL import Image

    _, on, _, _ = servers
    buf = io.BytesIO()
    Image.fromarray(np.zeros((8, 8, 3), dtype=np.uint8)).save(buf, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
    content = [
        {"type": "text", "text": "what is it"},
        {"type": "image_url", "image_url": {"url": url}},
    ]
    with pytest.raises(openai.BadRequestError, match="image"):
        chat(on, [{"role": "user", "content": content}])
    assert chat(on, [{"role": "user", "content": "still there?"}]).choices


def test_a_checkpoint_mlx_lm_cannot_read_is_refused_at_start_up(tmp_path):
    pytest.importorskip("mlx_lm")
    folder = save_family("gpt_oss", tmp_path / "model")  # experts as transformers 5 writes them
    cmd = [
        sys.executable,
        "-m",
        "promptcache.cli",
        "serve",
        "--engine",
        "mlx",
        "--model",
        str(folder),
    ]
    env = {**os.environ, "PROMPTCACHE_HOME": str(tmp_path / "home")}
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 2, out.stderr[-2000:]
    assert "--engine torch" in out.stderr and "Traceback" not in out.stderr
