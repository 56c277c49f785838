"""Vision-language folders as users have them, through their processors: Gemma 3 whose
``Gemma3Processor`` loads fully (its ``full_image_sequence`` is the image text, ids equal to the
processor's own, through the factory), and a family laid out by its processor served as text
where only its image processor loads."""

import pytest

pytest.importorskip("torch")
pytest.importorskip("PIL")

from test_vision_families import BLOCK, CHUNK, ask, image  # noqa: E402

from promptcache.engines.base import SamplingParams  # noqa: E402
from promptcache.testing.tiny_vlm_expanded import tiny_expanded_family  # noqa: E402

pytestmark = pytest.mark.torch


def test_a_family_laid_out_by_its_processor_needs_it(tmp_path, caplog):
    """SmolVLM's layout comes from its processor: with its image processor alone (the processor
    cannot load without torchvision) it serves text, said at start-up; Mistral 3 with its image
    processor alone gets images (its layout is built from the image sizes)."""
    import importlib.util
    import logging

    from transformers import AutoConfig
    from transformers.models.smolvlm.image_processing_pil_smolvlm import SmolVLMImageProcessorPil

    from promptcache.engines.torch.loading import load_torch_processor

    if importlib.util.find_spec("torchvision") is not None:
        pytest.skip("with torchvision the processor may load")
    AutoConfig.for_model("smolvlm").save_pretrained(tmp_path / "smolvlm")
    SmolVLMImageProcessorPil().save_pretrained(tmp_path / "smolvlm")
    model, images, tokenizer = tiny_expanded_family("mistral3")
    for part in (model.config, images, tokenizer):
        part.save_pretrained(tmp_path / "m3")
    with caplog.at_level(logging.INFO, logger="promptcache"):
        assert load_torch_processor(tmp_path / "smolvlm") is None
        assert load_torch_processor(tmp_path / "m3") is not None
    assert "images for smolvlm need its processor, which cannot load" in caplog.text
    assert "images on (mistral3: causal positions" in caplog.text


def test_gemma3_through_its_own_processor_end_to_end(tmp_path, capsys):
    """A Gemma 3 folder whose ``Gemma3Processor`` loads fully, served through the factory: the
    prompt's image text is the processor's ``full_image_sequence`` (ids equal to the processor's
    own), greedy replies equal --no-cache over image turns and an edited history."""
    from transformers import AutoProcessor

    from promptcache.engines.factory import build_engine
    from promptcache.testing.tiny_vlm_families import save_tiny_gemma3_processor

    folder = save_tiny_gemma3_processor(str(tmp_path / "tiny-gemma3"))
    processor = AutoProcessor.from_pretrained(folder)
    assert type(processor).__name__ == "Gemma3Processor"
    opts = dict(block_size=BLOCK, ram_budget=10**8, prefill_chunk=CHUNK)
    cached = build_engine("torch", folder, **opts)
    plain = build_engine("torch", folder, cache_enabled=False, **opts)
    assert cached.vision.sequence == processor.full_image_sequence
    a, b = image(11, 0), image(12, 1)
    turns = [(ask("One: "), [a]), ([{"type": "image"}, {"type": "text", "text": "Two?"}], [b]),
             ("Which is darker?", [])]  # fmt: skip
    messages, images, rows = [], [], []
    for turn, (content, new) in enumerate([*turns, (None, [])]):
        if content is None:  # the edited history: the first reply rewritten, the last turn again
            messages = [dict(m) for m in messages[:-1]]
            first = next(i for i, m in enumerate(messages) if m["role"] == "assistant")
            messages[first]["content"] = "An edited reply."
        else:
            messages = content if turn == 0 else [*messages, {"role": "user", "content": content}]
            images = images + new
        text = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        own = processor(text=[text], images=[im.to_pil() for im in images] or None,
                        add_special_tokens=False)["input_ids"][0]  # fmt: skip
        outs = []
        for eng in (cached, plain):
            ids, spans = eng.encode_chat_images(messages, None, images)
            assert ids == list(own), turn
            evs = list(eng.generate(ids, SamplingParams(max_tokens=6), images=spans))
            outs.append(evs[-1].completion_ids)
            if eng is cached:
                rows.append((evs[0].cached_tokens, len(ids)))
        assert outs[0] == outs[1], turn
        if content is not None:
            messages = [*messages, {"role": "assistant", "content": cached.decode(outs[0])}]
    with capsys.disabled():
        report = ", ".join(f"{c}/{n}" for c, n in rows)
        print(f"\ngemma3 (Gemma3Processor folder): cached/prompt per turn {report} (equal 4/4)")
    assert rows[0][0] == 0 and all(c > 0 for c, _ in rows[1:]), rows
    assert cached.feeder.num_encoder_runs == 2
