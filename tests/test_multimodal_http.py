"""Images over real HTTP with the official openai and anthropic clients, on a server running a
tiny random-weight LLaVA: hits and misses by pixels, greedy replies equal to a cache-off server,
the "image differs at token i" record, vision stats, clear 400s."""

import base64
import io

import httpx
import numpy as np
import pytest

pytest.importorskip("torch")
openai = pytest.importorskip("openai")
anthropic = pytest.importorskip("anthropic")

from PIL import Image  # noqa: E402

pytestmark = pytest.mark.server
MAX_IMAGE_BYTES = 200_000


def pixels(seed, h=40, w=50):
    return np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8)


def b64(rgb, fmt="PNG", **kw):
    buf = io.BytesIO()
    Image.fromarray(rgb).save(buf, format=fmt, **kw)
    return base64.b64encode(buf.getvalue()).decode()


def data_url(rgb, fmt="PNG", **kw):
    return f"data:image/{fmt.lower()};base64,{b64(rgb, fmt, **kw)}"


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    from conftest import ServerProcess

    from promptcache.testing.tiny_vlm import save_tiny_llava

    home = tmp_path_factory.mktemp("vlm")
    folder = save_tiny_llava(str(home / "tiny-llava"))
    args = ["--engine", "torch", "--model", folder, "--block-size", "16", "--prefill-chunk", "32",
            "--max-image-bytes", str(MAX_IMAGE_BYTES)]  # fmt: skip
    env = {"PROMPTCACHE_HOME": str(home)}
    on = ServerProcess(args, env=env, log=home / "on.log").start()
    off = ServerProcess([*args, "--no-cache"], env=env, log=home / "off.log").start()
    yield on, off
    on.stop()
    off.stop()


def oa(srv):
    return openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0)


def an(srv):
    return anthropic.Anthropic(base_url=srv.url, api_key="x", max_retries=0)


def openai_ask(srv, url, text="What is in this picture?"):
    return oa(srv).chat.completions.create(
        model="m", max_tokens=6, temperature=0,
        messages=[{"role": "system", "content": "You describe pictures."},
                  {"role": "user", "content": [{"type": "text", "text": "Look at this: "},
                                               {"type": "image_url", "image_url": {"url": url}},
                                               {"type": "text", "text": text}]}],
    )  # fmt: skip


def test_openai_images_hit_by_pixels_and_match_cache_off(servers):
    on, off = servers
    rgb = pixels(1)
    first = openai_ask(on, data_url(rgb))
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    # the same pixels as lossless WebP: a hit through the image to the prompt's last token
    webp = openai_ask(on, data_url(rgb, "WEBP", lossless=True))
    assert webp.usage.prompt_tokens_details.cached_tokens == webp.usage.prompt_tokens - 1
    assert webp.choices[0].message.content == first.choices[0].message.content
    assert (
        openai_ask(off, data_url(rgb)).choices[0].message.content
        == first.choices[0].message.content
    )
    # another image: the hit ends at the image's first token
    other = openai_ask(on, data_url(pixels(2)))
    cached = other.usage.prompt_tokens_details.cached_tokens
    assert 0 < cached < other.usage.prompt_tokens - 64
    assert (
        other.choices[0].message.content
        == openai_ask(off, data_url(pixels(2))).choices[0].message.content
    )
    record = httpx.get(on.url + "/v1/cache/requests?limit=1").json()["requests"][0]
    assert record["reason"] == "image", record
    at = record["detail"]["token_index"]
    assert at == cached
    assert record["detail"]["message"] == f"image differs at token {at}"
    stats = on.stats()["vision"]
    assert stats["encoder_runs"] == 2 and stats["cache_entries"] == 2
    metrics = httpx.get(on.url + "/metrics").text
    assert "promptcache_vision_encoder_runs 2" in metrics
    assert "promptcache_vision_cache_hits" in metrics


def test_anthropic_image_blocks_hit(servers):
    on, off = servers
    source = {"type": "base64", "media_type": "image/png", "data": b64(pixels(3))}

    def ask(srv, stream=False):
        kwargs = dict(model="m", max_tokens=6, extra_body={"temperature": 0},
                      system="You describe pictures.",
                      messages=[{"role": "user", "content": [
                          {"type": "image", "source": source},
                          {"type": "text", "text": "What is this?"}]}])  # fmt: skip
        if not stream:
            return an(srv).messages.create(**kwargs)
        with an(srv).messages.stream(**kwargs) as s:
            return s.get_final_message()

    first, again = ask(on), ask(on, stream=True)
    # the first shares the system prompt with earlier requests at most; the second hits past
    # the image's 64 tokens
    assert again.usage.cache_read_input_tokens >= first.usage.cache_read_input_tokens + 64
    assert first.content[0].text == again.content[0].text == ask(off).content[0].text
    count = an(on).messages.count_tokens(
        model="m", system="You describe pictures.",
        messages=[{"role": "user", "content": [{"type": "image", "source": source},
                                               {"type": "text", "text": "What is this?"}]}],
    )  # fmt: skip
    assert count.input_tokens == first.usage.input_tokens + first.usage.cache_read_input_tokens


@pytest.mark.parametrize(
    "url, message",
    [("data:image/png;base64,!!!notbase64", "base64"),
     ("data:image/png;base64," + base64.b64encode(b"garbage bytes").decode(), "cannot decode"),
     ("data:image/tiff;base64,AAAA", "media type"),
     ("https://example.com/cat.png", "--allow-image-urls"),
     ("data:image/png;base64," + "A" * (MAX_IMAGE_BYTES * 2), "over")],
)  # fmt: skip
def test_bad_images_get_a_clear_400(servers, url, message):
    on, _ = servers
    with pytest.raises(openai.BadRequestError) as exc:
        openai_ask(on, url)
    assert message in str(exc.value)
    assert openai_ask(on, data_url(pixels(1))).choices  # still up


def test_images_outside_user_turns_are_refused(servers):
    on, _ = servers
    with pytest.raises(openai.BadRequestError, match="user messages"):
        oa(on).chat.completions.create(model="m", max_tokens=2, messages=[
            {"role": "system", "content": [
                {"type": "image_url", "image_url": {"url": data_url(pixels(4))}}]},
            {"role": "user", "content": "hi"}])  # fmt: skip


def test_url_images_are_fetched_only_when_allowed(tmp_path):
    import functools
    import http.server
    import threading

    from promptcache.engines.base import RequestError
    from promptcache.server.image_parts import ImagePolicy, anthropic_image, openai_image

    rgb = pixels(5)
    Image.fromarray(rgb).save(tmp_path / "cat.png")
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(tmp_path))
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{httpd.server_address[1]}/cat.png"
    try:
        part = {"type": "image_url", "image_url": {"url": url}}
        block = {"type": "image", "source": {"type": "url", "url": url}}
        default = ImagePolicy(enabled=True)  # a vision model, URLs not allowed
        with pytest.raises(RequestError, match="--allow-image-urls"):
            openai_image(part, default)
        with pytest.raises(RequestError, match="--allow-image-urls"):
            anthropic_image(block, default)
        allowed = ImagePolicy(enabled=True, allow_urls=True)
        assert np.array_equal(openai_image(part, allowed).pixels, rgb)
        assert anthropic_image(block, allowed).digest == openai_image(part, allowed).digest
        with pytest.raises(RequestError, match="over"):
            openai_image(part, ImagePolicy(enabled=True, allow_urls=True, max_image_bytes=100))
        with pytest.raises(RequestError, match="cannot fetch"):
            openai_image({"image_url": {"url": url + ".missing"}}, allowed)
        with pytest.raises(RequestError, match="text only"):
            openai_image(part, ImagePolicy())
    finally:
        httpd.shutdown()


def test_deleting_a_session_removes_its_images_encoder_outputs(servers):
    """A session's deletion (issue 18) reaches the vision-embedding cache: the next request with
    the same image runs the encoder again, and replies stay equal to the cache-off server's."""
    on, off = servers
    url = data_url(pixels(7))

    def ask(srv, session):
        client = oa(srv).with_options(default_headers={"x-promptcache-session": session})
        return client.chat.completions.create(
            model="m", max_tokens=6, temperature=0,
            messages=[{"role": "user", "content": [
                {"type": "text", "text": "Name the colours: "},
                {"type": "image_url", "image_url": {"url": url}}]}],
        )  # fmt: skip

    first = ask(on, "pat")
    runs = on.stats()["vision"]["encoder_runs"]
    out = httpx.delete(on.url + "/v1/cache/sessions/pat").json()
    assert out["forgotten"]["image_embeddings"] == 1, out
    assert out["removed_blocks"] > 0, out
    again = ask(on, "sam")
    assert on.stats()["vision"]["encoder_runs"] == runs + 1
    assert again.usage.prompt_tokens_details.cached_tokens < again.usage.prompt_tokens - 64
    want = ask(off, "pat").choices[0].message.content
    assert first.choices[0].message.content == again.choices[0].message.content == want
