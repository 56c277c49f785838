"""Images over HTTP on the MLX engine: a real ``promptcache serve --engine mlx`` on a saved tiny
mlx-vlm llava, driven by the official openai and anthropic clients (cache on vs --no-cache)."""

import base64
import io

import httpx
import numpy as np
import pytest

pytest.importorskip("mlx_vlm")
openai = pytest.importorskip("openai")
anthropic = pytest.importorskip("anthropic")

from conftest import ServerProcess  # noqa: E402

from promptcache.testing.mlx_tiny_vlm import save_mlx_tiny_vlm  # noqa: E402

pytestmark = [pytest.mark.mlx, pytest.mark.server]
BLOCK = 8


def encoded(seed, fmt="PNG", **kwargs):
    from PIL import Image

    pixels = np.random.RandomState(seed).randint(0, 256, (40, 48, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format=fmt, **kwargs)
    return base64.b64encode(buf.getvalue()).decode()


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    home = tmp_path_factory.mktemp("mlx-vlm-server")
    folder = save_mlx_tiny_vlm(str(home / "model"))
    args = [
        "--engine",
        "mlx",
        "--model",
        folder,
        "--block-size",
        str(BLOCK),
        "--prefill-chunk",
        "16",
    ]
    env = {"PROMPTCACHE_HOME": str(home / "home")}
    on = ServerProcess(args, env=env, log=home / "on.log").start()
    off = ServerProcess([*args, "--no-cache"], env=env, log=home / "off.log").start()
    yield on, off
    on.stop()
    off.stop()


def openai_chat(srv, data, media="image/png"):
    client = openai.OpenAI(base_url=srv.url + "/v1", api_key="x")
    url = f"data:{media};base64,{data}"
    content = [
        {"type": "text", "text": "what is in "},
        {"type": "image_url", "image_url": {"url": url}},
    ]
    return client.chat.completions.create(
        model="m", messages=[{"role": "user", "content": content}], max_tokens=8, temperature=0
    )


def test_openai_png_then_lossless_webp_hits_with_uncached_reply(servers):
    on, off = servers
    png, webp = encoded(0), encoded(0, "WEBP", lossless=True)
    first = openai_chat(on, png)
    second = openai_chat(on, webp, "image/webp")
    ref = openai_chat(off, png)
    n = ref.usage.prompt_tokens
    assert first.usage.prompt_tokens == second.usage.prompt_tokens == n
    assert second.usage.prompt_tokens_details.cached_tokens == n - 1
    assert first.choices[0].message.content == second.choices[0].message.content
    assert second.choices[0].message.content == ref.choices[0].message.content


def test_anthropic_other_image_misses_from_its_first_token_and_says_why(servers):
    on, off = servers

    def ask(srv, data):
        client = anthropic.Anthropic(base_url=srv.url, api_key="x")
        image = {"type": "base64", "media_type": "image/png", "data": data}
        content = [{"type": "text", "text": "compare "}, {"type": "image", "source": image}]
        return client.messages.create(
            model="m", max_tokens=8, messages=[{"role": "user", "content": content}],
            extra_body={"temperature": 0},
        )  # fmt: skip

    ask(on, encoded(1))
    other = ask(on, encoded(2))
    ref = ask(off, encoded(2))
    assert other.content[0].text == ref.content[0].text
    read = other.usage.cache_read_input_tokens
    assert 0 < read < ref.usage.input_tokens - 1
    record = httpx.get(on.url + "/v1/cache/requests", params={"limit": 1}).json()["requests"][0]
    assert record["reason"] == "image"
    assert record["detail"]["message"] == f"image differs at token {read}"
    stats = httpx.get(on.url + "/v1/cache/stats").json()
    assert stats["vision"]["encoder_runs"] >= 2
