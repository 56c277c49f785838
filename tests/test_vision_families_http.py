"""Images over real HTTP with the official openai client on a tiny random Qwen3.5 MoE
vision-language checkpoint (the Qwen3.6-35B-A3B family: 3-D RoPE positions, linear + full
attention), saved as a user's folder (model, image processor, tokenizer; no torchvision needed):
greedy replies equal to a --no-cache server over image turns, reuse per turn, the start-up
line saying which images are served."""

import base64
import io

import numpy as np
import pytest

pytest.importorskip("torch")
openai = pytest.importorskip("openai")

from PIL import Image  # noqa: E402

pytestmark = pytest.mark.server
FAMILY = "qwen3_5_moe"


def data_url(seed, h, w):
    rgb = np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(rgb).save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    from conftest import ServerProcess

    from promptcache.testing.tiny_vlm_families import save_tiny_vision_family

    home = tmp_path_factory.mktemp("vl-images")
    folder = save_tiny_vision_family(FAMILY, str(home / "tiny-qwen3_5_moe-vl"))
    args = ["--engine", "torch", "--model", folder, "--block-size", "16", "--prefill-chunk", "32"]
    env = {"PROMPTCACHE_HOME": str(home / "home")}
    on = ServerProcess(args, env=env, log=home / "on.log", log_level="info").start()
    off = ServerProcess([*args, "--no-cache"], env=env, log=home / "off.log").start()
    yield on, off, home / "on.log"
    on.stop()
    off.stop()


def chat(srv, messages):
    client = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0)
    return client.chat.completions.create(model="m", messages=messages, max_tokens=8, temperature=0)


def test_image_turns_over_http_equal_uncached(servers, capsys):
    on, off, log = servers
    assert f"images on ({FAMILY}: 3-D RoPE positions)" in log.read_text()
    a, b = data_url(1, 40, 50), data_url(2, 64, 40)
    turns = [
        [{"type": "text", "text": "Look at this:"}, {"type": "image_url", "image_url": {"url": a}}],
        [{"type": "image_url", "image_url": {"url": b}}, {"type": "text", "text": "And this?"}],
        "Which one is brighter?",
        [
            {"type": "text", "text": "The first again:"},
            {"type": "image_url", "image_url": {"url": a}},
        ],
    ]
    messages, rows = [], []
    for turn, content in enumerate(turns):
        messages.append({"role": "user", "content": content})
        r_on, r_off = chat(on, messages), chat(off, messages)
        text = r_on.choices[0].message.content
        assert text == r_off.choices[0].message.content, turn
        rows.append((r_on.usage.prompt_tokens_details.cached_tokens, r_on.usage.prompt_tokens))
        messages.append({"role": "assistant", "content": text})
    with capsys.disabled():
        print(f"\n{FAMILY} over HTTP: cached/prompt per turn {rows} (equal 4/4)")
    assert rows[0][0] == 0 and all(c > 0 for c, _ in rows[1:]), rows
