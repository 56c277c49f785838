"""Images on the MLX engine: a tiny random-weight mlx-vlm llava (2 layers, hidden 64; 16 image
tokens per image). Cached runs equal uncached runs and mlx-vlm's own whole-prompt forward; image
pixels key the blocks; the vision-embedding cache skips the encoder."""

import io

import numpy as np
import pytest

pytest.importorskip("mlx_vlm")

from promptcache.core.images import decode_image, image_from_pixels  # noqa: E402
from promptcache.engines.base import SamplingParams  # noqa: E402
from promptcache.engines.mlx.vlm_engine import MlxVlmEngine  # noqa: E402
from promptcache.testing.mlx_tiny_vlm import mlx_tiny_vlm, save_mlx_tiny_vlm  # noqa: E402

pytestmark = pytest.mark.mlx
BLOCK, CHUNK = 8, 16


@pytest.fixture(scope="module")
def tiny():
    return mlx_tiny_vlm(seed=0)


def make_engine(tiny, **options):
    model, processor = tiny
    options.setdefault("cache_enabled", True)
    return MlxVlmEngine(model, processor, block_size=BLOCK, prefill_chunk=CHUNK, **options)


def picture(seed, size=(40, 48)):
    rng = np.random.RandomState(seed)
    return image_from_pixels(rng.randint(0, 256, (*size, 3), dtype=np.uint8))


def chat(*parts):
    content = [{"type": "image"} if p is None else {"type": "text", "text": p} for p in parts]
    return [{"role": "user", "content": content}]


def prefill(engine, ids, spans):
    _, logits, lease, _ = engine.prefill(ids, images=spans)
    hit = lease.num_tokens if lease is not None else 0
    if lease is not None:
        lease.release()
    return engine.to_numpy(logits), hit


def reference_logits(tiny, messages, images):
    """mlx-vlm's own path: its processor on the whole prompt, one forward of the merged
    embeddings (one image: llava merges one per call)."""
    model, processor = tiny
    text = processor.tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True
    )
    out = processor(images=[im.to_pil() for im in images], text=text)
    embeds = model.get_input_embeddings(out["input_ids"], out["pixel_values"]).inputs_embeds
    logits = model.language_model(out["input_ids"], inputs_embeds=embeds).logits[0, -1]
    return np.asarray(out["input_ids"])[0].tolist(), np.asarray(logits)


def test_same_text_same_image_hits_with_uncached_logits(tiny):
    cached, plain = make_engine(tiny), make_engine(tiny, cache_enabled=False)
    messages, image = chat("look at this ", None, " and say what it is"), picture(0)
    ids, spans = cached.encode_chat_images(messages, None, [image])
    want_ids, want = reference_logits(tiny, messages, [image])
    assert ids == want_ids  # the placeholder expanded as mlx-vlm's processor expands it
    assert spans[0].start > CHUNK - spans[0].length  # the image straddles a chunk boundary
    uncached, _ = prefill(plain, ids, spans)
    first, hit0 = prefill(cached, ids, spans)
    again, hit1 = prefill(cached, ids, spans)
    assert (hit0, hit1) == (0, len(ids) - 1)
    np.testing.assert_array_equal(uncached, want)
    np.testing.assert_array_equal(first, uncached)
    np.testing.assert_array_equal(again, uncached)
    assert cached.cache_stats()["vision"]["encoder_runs"] == 1  # the hit needed no encoder


def test_another_image_misses_from_its_first_token(tiny):
    cached, plain = make_engine(tiny), make_engine(tiny, cache_enabled=False)
    messages = chat("look at this ", None, " and say what it is")
    ids, spans = cached.encode_chat_images(messages, None, [picture(0)])
    prefill(cached, ids, spans)
    ids2, spans2 = cached.encode_chat_images(messages, None, [picture(1)])
    assert ids2 == ids  # the same placeholder tokens: only the pixels differ
    got, hit = prefill(cached, ids2, spans2)
    assert spans2[0].start % BLOCK  # mid-block: the partial block before it is reused too
    assert hit == spans2[0].start  # exactly up to the image's first token
    np.testing.assert_array_equal(got, prefill(plain, ids2, spans2)[0])
    assert not np.array_equal(got, prefill(plain, ids, spans)[0])  # the image matters


def test_same_pixels_as_png_and_lossless_webp_hit(tiny):
    cached, plain = make_engine(tiny), make_engine(tiny, cache_enabled=False)
    pil = picture(2).to_pil()
    encoded = {}
    for fmt, kwargs in (("PNG", {}), ("WEBP", {"lossless": True}), ("JPEG", {"quality": 70})):
        buf = io.BytesIO()
        pil.save(buf, format=fmt, **kwargs)
        encoded[fmt] = decode_image(buf.getvalue())
    assert encoded["PNG"].digest == encoded["WEBP"].digest != encoded["JPEG"].digest
    messages = chat("describe ", None)
    ids, spans = cached.encode_chat_images(messages, None, [encoded["PNG"]])
    prefill(cached, ids, spans)
    ids_w, spans_w = cached.encode_chat_images(messages, None, [encoded["WEBP"]])
    got, hit = prefill(cached, ids_w, spans_w)
    assert hit == len(ids_w) - 1
    np.testing.assert_array_equal(got, prefill(plain, ids_w, spans_w)[0])
    ids_j, spans_j = cached.encode_chat_images(messages, None, [encoded["JPEG"]])
    assert prefill(cached, ids_j, spans_j)[1] == spans_j[0].start  # other pixels: a miss there


def test_vision_cache_skips_the_encoder(tiny):
    cached, plain = make_engine(tiny), make_engine(tiny, cache_enabled=False)
    image = picture(3)
    ids, spans = cached.encode_chat_images(chat("first question: ", None), None, [image])
    prefill(cached, ids, spans)
    # other text before the image: the blocks miss from token 0, the image's rows do not
    ids2, spans2 = cached.encode_chat_images(chat("Second one? ", None, " more"), None, [image])
    got, hit = prefill(cached, ids2, spans2)
    assert hit < spans2[0].start
    stats = cached.cache_stats()["vision"]
    assert (stats["encoder_runs"], stats["images_fed"], stats["cache_hits"]) == (1, 2, 1)
    np.testing.assert_array_equal(got, prefill(plain, ids2, spans2)[0])


def test_two_images_in_one_prompt(tiny):
    # llava merges one image per call: the runner encodes them one by one
    cached, plain = make_engine(tiny), make_engine(tiny, cache_enabled=False)
    messages = chat("a ", None, " b ", None, " which is brighter?")
    ids, spans = cached.encode_chat_images(messages, None, [picture(4), picture(5)])
    assert len(spans) == 2 and spans[0].end < spans[1].start
    want, _ = prefill(plain, ids, spans)
    np.testing.assert_array_equal(prefill(cached, ids, spans)[0], want)
    np.testing.assert_array_equal(prefill(cached, ids, spans)[0], want)
    ids2, spans2 = cached.encode_chat_images(messages, None, [picture(4), picture(6)])
    got, hit = prefill(cached, ids2, spans2)
    assert hit == spans2[1].start
    np.testing.assert_array_equal(got, prefill(plain, ids2, spans2)[0])


def test_greedy_generation_equals_uncached(tiny):
    cached, plain = make_engine(tiny), make_engine(tiny, cache_enabled=False)
    ids, spans = cached.encode_chat_images(chat("hi ", None, " go"), None, [picture(7)])

    def run(engine):
        events = list(engine.generate(ids, SamplingParams(max_tokens=12), images=spans))
        return events[-1].completion_ids, events[0].cached_tokens

    want, _ = run(plain)
    assert run(cached) == (want, 0)
    assert run(cached) == (want, len(ids) - 1)


def test_saved_folder_loads_through_the_factory_and_hits_from_ssd_after_a_restart(tmp_path, tiny):
    from promptcache.engines.factory import build_engine

    folder = save_mlx_tiny_vlm(str(tmp_path / "vlm"), seed=0)
    opts = dict(block_size=BLOCK, prefill_chunk=CHUNK, ssd_dir=str(tmp_path / "cache"))
    first = build_engine("mlx", folder, **opts)
    assert isinstance(first, MlxVlmEngine)
    assert first.fingerprint == make_engine(tiny).fingerprint  # same config, same weights
    ids, spans = first.encode_chat_images(chat("remember ", None), None, [picture(8)])
    want, _ = prefill(first, ids, spans)
    first.close()
    second = build_engine("mlx", folder, **opts)  # a restart: RAM empty, SSD blocks verified
    got, hit = prefill(second, ids, spans)
    assert hit == len(ids) - 1
    np.testing.assert_array_equal(got, want)
    # other text first: the blocks miss, the image's rows come from the SSD embedding cache
    ids2, spans2 = second.encode_chat_images(chat("Recall ", None), None, [picture(8)])
    got2, _ = prefill(second, ids2, spans2)
    stats = second.cache_stats()["vision"]
    second.close()
    assert (stats["encoder_runs"], stats["cache_ssd_hits"]) == (0, 1)
    plain = make_engine(tiny, cache_enabled=False)
    np.testing.assert_array_equal(got2, prefill(plain, ids2, spans2)[0])


def test_importing_mlx_vlm_leaves_transformers_auto_processor_alone(tiny):
    # mlx-vlm's model packages replace it on import; a torch engine in the same process would
    # get mlx-vlm's processor for its own llava folder
    from transformers import AutoProcessor

    from promptcache.engines.mlx.vlm_load import model_package, transformers_as_is

    model_package("llava")
    before = AutoProcessor.__dict__["from_pretrained"]
    assert before.__func__.__module__ == "transformers.models.auto.processing_auto"
    with transformers_as_is():  # and whatever mlx-vlm installs inside is undone
        AutoProcessor.from_pretrained = classmethod(lambda cls, *a, **k: None)
    assert AutoProcessor.__dict__["from_pretrained"] is before


def test_unusable_folders_are_config_errors(tmp_path):
    import json

    from promptcache.engines.mlx.vlm_load import load_mlx_vlm
    from promptcache.errors import ConfigError

    folder = tmp_path / "no-weights"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "llava", "vision_config": {}}))
    with pytest.raises(ConfigError, match="does not load as an mlx-vlm llava model"):
        load_mlx_vlm(folder)
    (folder / "config.json").write_text(json.dumps({"model_type": "idefics3", "vision_config": {}}))
    with pytest.raises(ConfigError, match="supports llava, qwen2_vl.* models, not 'idefics3'"):
        load_mlx_vlm(folder)


def test_concurrent_image_requests_decode_batched_with_their_lone_tokens(tiny):
    from vlm_chat import replies_alone_and_together

    alone, together = make_engine(tiny), make_engine(tiny)
    asks = [(chat("what is ", None), 9), (chat("Describe ", None, " briefly please"), 10),
            (chat("no image at all"), None)]  # fmt: skip
    prompts = []
    for messages, seed in asks:
        images = [picture(seed)] if seed is not None else []
        prompts.append(together.encode_chat_images(messages, None, images))
    params = SamplingParams(max_tokens=16)

    want, got = replies_alone_and_together(alone, together, prompts, params)
    assert got == want
    stats = together.cache_stats()
    assert stats["max_batch_rows"] >= 2 and stats["num_pinned_blocks"] == 0  # shared forwards
    together.cache.check_integrity()
