"""Images on the MLX engine for the M-RoPE family (3-D positions): tiny random-weight Qwen2-VL,
Qwen2.5-VL, Qwen3-VL and Qwen3-VL-MoE (deepstack), Qwen3.5 and Qwen3.5-MoE (linear attention +
full attention), GLM-4V and GLM-4V-MoE checkpoints, saved as mlx-vlm folders and loaded as a
user's. Per family: positions equal mlx-vlm's own ``get_rope_index``, logits equal mlx-vlm's
whole-prompt forward, and a conversation of image turns plus an edited-history turn replies
exactly as --no-cache does, with reuse on every turn, image hits after a restore and the
vision-embedding cache counted."""

import mlx.core as mx
import numpy as np
import pytest

pytest.importorskip("mlx_vlm")

from vlm_chat import check_conversation, picture, replies_alone_and_together, user  # noqa: E402

from promptcache.engines.base import SamplingParams  # noqa: E402
from promptcache.engines.mlx.vlm_engine import MlxVlmEngine  # noqa: E402
from promptcache.engines.mlx.vlm_load import load_mlx_vlm  # noqa: E402
from promptcache.engines.mlx.vlm_mrope import MropeState, mrope_positions  # noqa: E402
from promptcache.testing.mlx_tiny_mrope import TINY_MROPE_FAMILIES, save_mrope  # noqa: E402

pytestmark = pytest.mark.mlx
BLOCK, CHUNK = 8, 16


@pytest.fixture(scope="module", params=TINY_MROPE_FAMILIES)
def tiny(request, tmp_path_factory):
    folder = save_mrope(request.param, tmp_path_factory.mktemp(request.param), seed=1)
    model, processor = load_mlx_vlm(folder)
    return request.param, model, processor


def make_engine(tiny, **options):
    _, model, processor = tiny
    options.setdefault("cache_enabled", True)
    return MlxVlmEngine(model, processor, block_size=BLOCK, prefill_chunk=CHUNK, **options)


def library_forward(tiny, messages, images):
    """mlx-vlm's own path on the whole prompt: its processor, its rope index, one forward."""
    _, model, processor = tiny
    text = processor.tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True, chat_template=processor.chat_template
    )
    out = processor(images=[im.to_pil() for im in images], text=text)
    ids, pixels, grid = (mx.array(np.asarray(out[k])) for k in
                         ("input_ids", "pixel_values", "image_grid_thw"))  # fmt: skip
    positions, _ = model.language_model.get_rope_index(ids, grid)
    logits = model(ids, pixels, image_grid_thw=grid).logits[0, -1]
    return np.asarray(ids)[0].tolist(), np.asarray(positions)[:, 0], np.asarray(logits)


def test_positions_and_logits_equal_mlx_vlms_own_path(tiny):
    plain = make_engine(tiny, cache_enabled=False)
    images = [picture(0), picture(1, (32, 48))]
    messages = [user("look at ", None, " and then ", None, " which one?")]
    ids, spans = plain.encode_chat_images(messages, None, images)
    want_ids, want_positions, want_logits = library_forward(tiny, messages, images)
    assert ids == want_ids  # each placeholder expanded as mlx-vlm's processor expands it
    state = MropeState()
    plain.runner.vision.place(state, spans)
    got = mrope_positions(state.places, 0, len(ids))
    np.testing.assert_array_equal(got, want_positions)
    assert got[:, -1].max() < len(ids) - 1  # the text after the images is shifted back
    assert any(s.start // CHUNK != (s.end - 1) // CHUNK for s in spans)  # an image is split
    _, logits, _, _ = plain.prefill(ids, images=spans)
    np.testing.assert_allclose(plain.to_numpy(logits), want_logits, rtol=1e-4, atol=1e-4)


def test_conversation_equals_no_cache_with_reuse_every_turn(tiny):
    cached, plain = make_engine(tiny), make_engine(tiny, cache_enabled=False)
    check_conversation(cached, plain)


def test_other_pixels_miss_from_the_image_and_match_no_cache(tiny):
    cached, plain = make_engine(tiny), make_engine(tiny, cache_enabled=False)
    messages = [user("describe ", None, " in a word")]
    ids, spans = cached.encode_chat_images(messages, None, [picture(5)])
    cached.prefill(ids, images=spans)[2].release()
    ids2, spans2 = cached.encode_chat_images(messages, None, [picture(6)])
    assert ids2 == ids
    _, logits, lease, _ = cached.prefill(ids2, images=spans2)
    assert lease.num_tokens <= spans2[0].start
    lease.release()
    want = plain.to_numpy(plain.prefill(ids2, images=spans2)[1])
    if cached.runner.layout.requires_checkpoint:  # the last token alone: a GDN scan's float noise
        np.testing.assert_allclose(cached.to_numpy(logits), want, rtol=1e-3, atol=1e-4)
    else:
        np.testing.assert_array_equal(cached.to_numpy(logits), want)
    assert not np.allclose(want, plain.to_numpy(plain.prefill(ids, images=spans)[1]), atol=1e-3)


def test_batched_decode_equals_one_by_one(tiny):
    engine = make_engine(tiny, cache_enabled=False)
    runner = engine.runner
    prompts = [
        engine.encode_chat_images([user("a ", None, " b")], None, [picture(7)]),
        engine.encode_chat_images([user("no image, longer text here")], None, []),
    ]
    states = [engine.prefill(ids, images=spans)[0] for ids, spans in prompts]
    twins = [engine.prefill(ids, images=spans)[0] for ids, spans in prompts]
    assert runner.batches_decode(states)  # linear-attention state merges too
    together = runner.forward(states, [[5], [6]])
    alone = [runner.forward([s], [[t]])[0] for s, t in zip(twins, [5, 6], strict=True)]
    for a, b in zip(together, alone, strict=True):
        np.testing.assert_allclose(runner.to_numpy(a), runner.to_numpy(b), rtol=1e-4, atol=1e-5)


def test_a_saved_folder_serves_images_through_the_factory_and_hits_from_ssd_after_a_restart(
    tmp_path, caplog
):
    from promptcache.engines.factory import build_engine
    from promptcache.engines.mlx.vlm_mrope import MropeRunner

    folder = save_mrope("qwen3_vl", tmp_path / "qwen3-vl", seed=2)
    opts = dict(block_size=BLOCK, prefill_chunk=CHUNK, ssd_dir=str(tmp_path / "cache"))
    with caplog.at_level("INFO", logger="promptcache"):
        first = build_engine("mlx", str(folder), **opts)
    assert isinstance(first.runner, MropeRunner)
    assert "qwen3_vl takes images on the mlx engine" in caplog.text
    messages = [user("remember ", None, " and this text after it")]
    ids, spans = first.encode_chat_images(messages, None, [picture(8)])
    params = SamplingParams(max_tokens=8)
    want = list(first.generate(ids, params, images=spans))[-1].completion_ids
    first.close()
    second = build_engine("mlx", str(folder), **opts)  # a restart: RAM empty, SSD blocks verified
    events = list(second.generate(ids, params, images=spans))
    second.close()
    assert events[0].cached_tokens > spans[0].end  # restored past the image, from disk
    assert events[-1].completion_ids == want


def test_a_vision_folder_whose_image_path_cannot_load_serves_text(tmp_path, caplog):
    from promptcache.engines.factory import build_engine
    from promptcache.engines.mlx.engine import MlxEngine
    from promptcache.testing.tiny_models import train_tiny_tokenizer

    folder = save_mrope("qwen3_5", tmp_path / "qwen3.5", seed=3)
    train_tiny_tokenizer().save_pretrained(folder)  # a tokenizer without Qwen's image token
    with caplog.at_level("WARNING", logger="promptcache"):
        engine = build_engine("mlx", str(folder), block_size=BLOCK, prefill_chunk=CHUNK)
    try:
        assert isinstance(engine, MlxEngine) and not engine.supports_images
        assert "images are not supported for qwen3_5 on the mlx engine here" in caplog.text
        ids = engine.tokenizer.encode("hello there", add_special_tokens=False)
        assert len(list(engine.generate(ids, SamplingParams(max_tokens=4)))[-1].completion_ids)
    finally:
        engine.close()


def test_a_config_mlx_vlm_cannot_read_is_a_clean_refusal_not_a_traceback(tmp_path):
    """A Qwen3-VL folder saved by transformers 5 (rope_parameters, no rope_theta): mlx-vlm
    0.7.10's config class and mlx-lm both refuse it; start-up says both reasons (exit 2)."""
    from promptcache.engines.factory import build_engine
    from promptcache.errors import ConfigError
    from promptcache.testing.tiny_vlm_families import save_tiny_vision_family

    folder = save_tiny_vision_family("qwen3_vl", str(tmp_path / "hf-qwen3-vl"))
    with pytest.raises(ConfigError, match="does not load as an mlx-vlm qwen3_vl model.*mlx-lm"):
        build_engine("mlx", folder, block_size=BLOCK, prefill_chunk=CHUNK)


def test_concurrent_image_requests_decode_batched_with_their_own_positions(tiny):

    if tiny[0] not in ("qwen3_vl", "qwen3_5"):  # the batched step itself: every family above
        pytest.skip("served concurrently: one full-attention and one hybrid family")

    alone, together = make_engine(tiny), make_engine(tiny)
    asks = [([user("what is ", None)], [picture(10)]),
            ([user("Describe ", None, " and ", None, " briefly please")], [picture(11), picture(12, (32, 48))]),
            ([user("no image at all")], [])]  # fmt: skip
    prompts = [together.encode_chat_images(m, None, ims) for m, ims in asks]
    params = SamplingParams(max_tokens=12)

    want, got = replies_alone_and_together(alone, together, prompts, params)
    assert got == want  # each row decodes at its own rope-shifted position
    stats = together.cache_stats()
    assert stats["max_batch_rows"] >= 2
    assert stats["num_pinned_blocks"] == 0
    together.cache.check_integrity()


def test_a_moe_checkpoint_in_bfloat16_is_cast_to_float32_at_load_on_the_cpu(tmp_path, caplog):
    """mlx's CPU backend has GatherMM for float32 only: the one-token forward at load finds it
    (instead of a 500 on every request) and the model is cast, said in the log."""
    from mlx.utils import tree_flatten

    if mx.default_device() != mx.cpu:
        pytest.skip("GatherMM is float32-only on mlx's CPU backend")
    folder = save_mrope("qwen3_5_moe", tmp_path / "moe", seed=4)
    with caplog.at_level("WARNING", logger="promptcache"):
        model, _ = load_mlx_vlm(folder, dtype="bfloat16")
    assert {v.dtype for _, v in tree_flatten(model.parameters())} == {mx.float32}
    assert "casting the model to float32" in caplog.text


def test_a_4bit_mlx_vlm_conversion_of_qwen3_5_moe_serves_the_image_chat_as_no_cache(tmp_path):
    """The layout of mlx-community's Qwen3.6-35B-A3B-4bit: mlx_vlm.convert -q (experts 4-bit,
    bfloat16 scales) of the MoE checkpoint, images through mlx-vlm."""
    from promptcache.engines.mlx.vlm_load import processor_class, transformers_as_is

    source = save_mrope("qwen3_5_moe", tmp_path / "source", seed=1)
    with transformers_as_is():  # mlx-vlm's own processor hook while it converts, undone after
        from mlx_vlm.convert import convert
        from mlx_vlm.models.base import install_auto_processor_patch

        install_auto_processor_patch("qwen3_5_moe", processor_class("qwen3_5_moe"))
        convert(str(source), mlx_path=str(tmp_path / "q4"), quantize=True, q_group_size=32,
                q_bits=4, dtype="bfloat16")  # fmt: skip
    model, processor = load_mlx_vlm(tmp_path / "q4")
    kinds = {type(m).__name__ for _, m in model.named_modules()}
    assert "QuantizedSwitchLinear" in kinds, kinds  # the experts are 4-bit
    tiny = ("qwen3_5_moe", model, processor)
    check_conversation(make_engine(tiny), make_engine(tiny, cache_enabled=False))
