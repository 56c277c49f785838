"""Images on the MLX engine for Gemma 3: a tiny random-weight mlx-vlm Gemma 3 (a SigLIP tower
pooled to 16 soft tokens; a sliding-window ring layer + a full-attention layer, and an
all-full-attention variant) saved as an mlx-vlm folder. An image's soft tokens attend to each
other: chunked, cached prefill equals one whole-prompt pass with that mask, and differs from
causal attention; a conversation of image turns plus an edited turn equals --no-cache."""

import mlx.core as mx
import numpy as np
import pytest

pytest.importorskip("mlx_vlm")

from vlm_chat import check_conversation, picture, user  # noqa: E402

from promptcache.engines.mlx.vlm_engine import MlxVlmEngine  # noqa: E402
from promptcache.engines.mlx.vlm_gemma3 import Gemma3Runner  # noqa: E402
from promptcache.engines.mlx.vlm_load import load_mlx_vlm  # noqa: E402
from promptcache.testing.mlx_tiny_gemma3 import save_gemma3  # noqa: E402

pytestmark = pytest.mark.mlx
BLOCK, CHUNK = 8, 16
SEEDS = {"sliding": 3, "full": 3}


@pytest.fixture(scope="module", params=["sliding", "full"])
def tiny(request, tmp_path_factory):
    folder = save_gemma3(tmp_path_factory.mktemp(request.param), seed=SEEDS[request.param],
                         sliding=request.param == "sliding")  # fmt: skip
    return load_mlx_vlm(folder)


def make_engine(tiny, **options):
    model, processor = tiny
    options.setdefault("cache_enabled", True)
    return MlxVlmEngine(model, processor, block_size=BLOCK, prefill_chunk=CHUNK, **options)


def test_the_prompt_expands_as_mlx_vlms_processor_expands_it(tiny):
    model, processor = tiny
    engine = make_engine(tiny, cache_enabled=False)
    assert isinstance(engine.runner, Gemma3Runner)
    messages = [user("look at ", None, " then ", None, " which?")]
    ids, spans = engine.encode_chat_images(messages, None, [picture(0), picture(1, (40, 30))])
    text = processor.tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True, chat_template=processor.chat_template
    )
    want = processor(images=[picture(0).to_pil(), picture(1).to_pil()], text=text)["input_ids"]
    assert ids == np.asarray(want)[0].tolist()
    assert [s.length for s in spans] == [16, 16]
    assert all(ids[s.start - 1] == processor.tokenizer.convert_tokens_to_ids("<start_of_image>")
               for s in spans)  # fmt: skip


def test_cached_chunked_prefill_equals_one_pass_with_image_tokens_attending_to_each_other(tiny):
    model, _ = tiny
    cached, plain = make_engine(tiny), make_engine(tiny, cache_enabled=False)
    messages = [user("first ", None, " and a longer text between the two images ", None, " end")]
    ids, spans = plain.encode_chat_images(messages, None, [picture(2), picture(3)])
    assert any(s.start // CHUNK != (s.end - 1) // CHUNK for s in spans)  # a chunk would cut one
    vision = plain.runner.vision
    rows = [vision.encode(s.image) for s in spans]

    def one_pass(bidirectional):
        # the whole prompt in one forward on a fresh cache (no chunk, no ring wrap, no restore),
        # the image block on or off
        embeds = model.language_model.model.embed_tokens(mx.array(ids))
        group = np.full(len(ids), -1)
        for i, (s, r) in enumerate(zip(spans, rows, strict=True)):
            embeds[s.start : s.end] = r
            group[s.start : s.end] = i
        block = (group[:, None] == group[None]) & (group[:, None] >= 0) & bidirectional
        state = plain.runner.new_state()
        return np.asarray(vision._with_image_masks(state, embeds[None], mx.array(block)))

    want = one_pass(True)
    _, logits, _, _ = plain.prefill(ids, images=spans)
    np.testing.assert_allclose(plain.to_numpy(logits), want, rtol=1e-4, atol=1e-4)
    assert not np.allclose(want, one_pass(False), atol=1e-3)  # the image block matters
    cached.prefill(ids, images=spans)[2].release()  # then a hit past both images
    _, again, lease, _ = cached.prefill(ids, images=spans)
    assert lease.num_tokens > spans[-1].end
    lease.release()
    np.testing.assert_allclose(cached.to_numpy(again), want, rtol=1e-4, atol=1e-4)


def test_the_image_mask_path_with_no_image_block_is_mlx_vlms_own_forward(tiny):
    model, _ = tiny
    engine = make_engine(tiny, cache_enabled=False)
    ids = engine.tokenizer.encode("plain text through both paths, long enough for the window",
                                  add_special_tokens=False)  # fmt: skip
    embeds = model.language_model.model.embed_tokens(mx.array([ids]))
    ours = engine.runner.vision._with_image_masks(
        engine.runner.new_state(), embeds, mx.zeros((len(ids), len(ids)), dtype=mx.bool_)
    )
    state = engine.runner.new_state()
    theirs = model.language_model(mx.array([ids]), inputs_embeds=embeds, cache=state).logits
    np.testing.assert_allclose(np.asarray(ours), np.asarray(theirs[0, -1]), rtol=1e-5, atol=1e-5)


def test_conversation_equals_no_cache_with_reuse_every_turn(tiny):
    check_conversation(make_engine(tiny), make_engine(tiny, cache_enabled=False))
