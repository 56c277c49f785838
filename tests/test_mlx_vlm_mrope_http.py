"""Images over HTTP on the MLX engine for Qwen3.5 MoE (the family of Qwen3.6-35B-A3B): a real
``promptcache serve --engine mlx`` on a saved tiny mlx-vlm checkpoint, driven by the official
openai client through a multi-turn image chat with an edited turn (cache on vs --no-cache)."""

import base64
import io
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

pytest.importorskip("mlx_vlm")
openai = pytest.importorskip("openai")

from conftest import ServerProcess  # noqa: E402

from promptcache.testing.mlx_tiny_mrope import save_mrope  # noqa: E402

pytestmark = [pytest.mark.mlx, pytest.mark.server]


def png(seed, size=(64, 80)):
    from PIL import Image

    pixels = np.random.RandomState(seed).randint(0, 256, (*size, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    home = tmp_path_factory.mktemp("mlx-qwen35moe-server")
    folder = save_mrope("qwen3_5_moe", home / "model", seed=1)
    args = ["--engine", "mlx", "--model", str(folder), "--block-size", "8",
            "--prefill-chunk", "16"]  # fmt: skip
    env = {"PROMPTCACHE_HOME": str(home / "home")}
    on = ServerProcess(args, env=env, log=home / "on.log")
    off = ServerProcess([*args, "--no-cache"], env=env, log=home / "off.log")
    with ThreadPoolExecutor(2) as pool:  # the two start-ups overlap
        list(pool.map(lambda srv: srv.start(), (on, off)))
    yield on, off, home
    on.stop()
    off.stop()


def test_an_image_chat_with_an_edited_turn_equals_no_cache(servers):
    on, off, home = servers
    turns = [
        [{"type": "text", "text": "what is in "}, {"type": "image_url", "image_url": {"url": png(1)}}],
        [{"type": "text", "text": "and here? "}, {"type": "image_url", "image_url": {"url": png(2, (32, 48))}}],
        [{"type": "text", "text": "say it shorter"}],
    ]  # fmt: skip

    def chat(srv):
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="x")
        history, out = [], []
        for i, content in enumerate(turns):
            history.append({"role": "user", "content": content})
            if i == len(turns) - 1:  # the edited turn: the previous reply rewritten
                history[-2] = {"role": "assistant", "content": "an edited answer"}
            r = client.chat.completions.create(
                model="m", messages=history, max_tokens=8, temperature=0
            )
            reply = r.choices[0].message.content
            out.append((reply, r.usage.prompt_tokens, r.usage.prompt_tokens_details.cached_tokens))
            history.append({"role": "assistant", "content": reply})
        return out

    got, want = chat(on), chat(off)
    assert [g[0] for g in got] == [w[0] for w in want]
    assert [g[1] for g in got] == [w[1] for w in want]
    assert got[0][2] == 0 and all(g[2] > 0 for g in got[1:])  # reuse from the second turn
    assert all(w[2] == 0 for w in want)
    assert "qwen3_5_moe takes images on the mlx engine" in (home / "on.log").read_text()
