"""Images on the transformers families beyond LLaVA, each a tiny random-weight model built from
its config class: the Qwen-VL class (3-D RoPE positions: qwen2_vl, qwen2_5_vl, qwen3_vl,
qwen3_vl_moe, qwen3_5, qwen3_5_moe, and GLM-4V's glm4v, glm4v_moe) and Gemma 3 (bidirectional attention among an image's
tokens), and the causal families whose processor lays an image out as more than one token
repeated (Mistral 3 row breaks, LLaVA-NeXT / OneVision anyres tiles, Idefics3, Aya Vision,
InternVL). Against the model's own uncached forward and ``generate`` (its own image path and
positions), and cached vs --no-cache over image turns and an edited history."""

import inspect

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("PIL")

from promptcache.core.images import image_from_pixels  # noqa: E402
from promptcache.engines.base import SamplingParams  # noqa: E402
from promptcache.engines.torch.engine import TorchEngine  # noqa: E402
from promptcache.serving.request import Request  # noqa: E402
from promptcache.serving.vision import VisionChunk  # noqa: E402
from promptcache.testing.tiny_vlm_expanded import (  # noqa: E402
    EXPANDED_FAMILIES,
    tiny_expanded_family,
)
from promptcache.testing.tiny_vlm_families import (  # noqa: E402
    MROPE_FAMILIES,
    VISION_FAMILIES,
    tiny_vision_family,
)

pytestmark = pytest.mark.torch
BLOCK, CHUNK = 16, 32
SIZES = [(40, 50), (64, 40), (30, 90)]  # Qwen grids 6x6, 8x6, 4x12 (9, 12, 12 tokens)
ALL_FAMILIES = (*VISION_FAMILIES, *EXPANDED_FAMILIES)


def pixels(seed, size=(40, 50)):
    return np.random.default_rng(seed).integers(0, 256, (*size, 3), dtype=np.uint8)


def image(seed, k=0):
    return image_from_pixels(pixels(seed, SIZES[k % len(SIZES)]))


@pytest.fixture(scope="module")
def families():
    built = {}

    def get(name, **kw):
        key = (name, tuple(sorted(kw.items())))
        if key not in built and name in EXPANDED_FAMILIES:
            try:
                built[key] = tiny_expanded_family(name, **kw)
            except ImportError as exc:  # its processor needs torchvision
                pytest.skip(str(exc))
        if key not in built:
            built[key] = tiny_vision_family(name, **kw)
        return built[key]

    return get


def engine(parts, **options):
    model, images, tokenizer = parts
    opts = dict(block_size=BLOCK, ram_budget=10**8, prefill_chunk=CHUNK)
    return TorchEngine(model, tokenizer, images, **{**opts, **options})


def model_inputs(name, parts, ids, images):
    """What the model's own forward takes for the whole prompt (its image path)."""
    model, proc, _ = parts
    x = torch.tensor([ids])
    if not images:
        return {"input_ids": x}
    if name in EXPANDED_FAMILIES:  # the processor's pixels (its input_ids are ours)
        pils = [im.to_pil() for im in images]
        if hasattr(proc, "tokenizer"):
            out = proc(text=[proc.image_token * len(images)], images=pils, return_tensors="pt")
        else:  # an image processor alone (Mistral 3's at the merged patch size, InternVL's tiles)
            merged = model.config.vision_config.patch_size * getattr(
                model.config, "spatial_merge_size", 1
            )
            kw = {"mistral3": {"patch_size": {"height": merged, "width": merged}},
                  "llava_pixtral": {"patch_size": {"height": merged, "width": merged}},
                  "internvl": {"crop_to_patches": True}}.get(name, {})  # fmt: skip
            out = proc(images=pils, return_tensors="pt", **kw)
        takes = inspect.signature(model.forward).parameters
        pixels = {k: v for k, v in out.items() if k in takes and k != "input_ids"}
        return {"input_ids": x, **{k: v for k, v in pixels.items() if k != "attention_mask"}}
    out = proc(images=[im.to_pil() for im in images], return_tensors="pt")
    types = (x == model.config.image_token_id).long()
    if name == "gemma3":
        return {"input_ids": x, "pixel_values": out["pixel_values"], "token_type_ids": types}
    return {"input_ids": x, "pixel_values": out["pixel_values"],
            "image_grid_thw": out["image_grid_thw"], "mm_token_type_ids": types}  # fmt: skip


def reference(name, parts, ids, images):
    model = parts[0]
    with torch.inference_mode():
        logits = model(**model_inputs(name, parts, ids, images)).logits[0, -1]
    if hasattr(model.model, "rope_deltas"):
        model.model.rope_deltas = None  # the model's shared state: our path never reads it
    return logits


def close(a, b):
    return (a - b).abs().max().item() <= 1e-4 * max(1.0, b.abs().max().item())


def ask(before, n_images=1, after="What is in it?"):
    parts = [{"type": "text", "text": before}] + [{"type": "image"}] * n_images
    return [{"role": "system", "content": "You describe pictures."},
            {"role": "user", "content": [*parts, {"type": "text", "text": after}]}]  # fmt: skip


def prefill(eng, messages, images):
    ids, spans = eng.encode_chat_images(messages, None, images)
    _, logits, lease, _ = eng.prefill(ids, images=spans)
    cached = lease.num_tokens if lease is not None else 0
    if lease is not None:
        lease.release()
    return ids, spans, logits, cached


@pytest.mark.parametrize("name", ALL_FAMILIES)
def test_prompt_logits_and_greedy_reply_match_the_model(families, name):
    """Chunked prefill (images split across chunks where attention is causal), a restore that
    ends after an image, and decode: the model's own forward and ``generate`` agree."""
    parts = families(name)
    eng = engine(parts)
    a, b = image(1, 0), image(2, 1)
    ids, spans, logits, cached = prefill(eng, ask("Two of them: ", 2), [a, b])
    assert cached == 0 and len(spans) == 2 and spans[1].end > CHUNK
    assert close(logits, reference(name, parts, ids, [a, b]))
    # other text after the images: the hit reaches past both, the text is shifted by them
    ids2, spans2, logits2, cached2 = prefill(eng, ask("Two of them: ", 2, "And now?"), [a, b])
    if eng.layout.requires_checkpoint:  # recurrent / sliding layers: hits at checkpoints
        assert cached2 > 0
    else:
        assert cached2 >= spans2[1].end
    assert close(logits2, reference(name, parts, ids2, [a, b]))
    # decode continues from the prompt's position offset: greedy tokens equal generate()'s
    events = list(eng.generate(ids2, SamplingParams(max_tokens=6), images=spans2))
    model = parts[0]
    with torch.inference_mode():
        out = model.generate(**model_inputs(name, parts, ids2, [a, b]), max_new_tokens=6,
                             do_sample=False, eos_token_id=None)  # fmt: skip
    if hasattr(model.model, "rope_deltas"):
        model.model.rope_deltas = None
    got = events[-1].completion_ids
    assert got == out[0, len(ids2) : len(ids2) + len(got)].tolist()
    if name == "gemma3":  # an image's tokens attend to each other: no chunk ends inside one
        fresh = engine(parts, cache_enabled=False, prefill_chunk=BLOCK)
        req = Request(list(ids), SamplingParams())
        req.images = tuple(spans)
        ends = []
        with fresh.scheduler.turns.step():
            fresh.steps.begin(req)
            while req.pos < req.num_prompt:
                fresh.steps.prefill_chunk_of(req)
                ends.append(req.pos)
        assert not any(s.start < e < s.end for s in spans for e in ends), (ends, spans)
        assert any(s.start % BLOCK for s in spans), spans  # one straddles a chunk boundary
        assert close(req.logits, reference(name, parts, ids, [a, b]))


@pytest.mark.parametrize("name", ALL_FAMILIES)
def test_image_turns_and_an_edited_history_equal_uncached(families, name, capsys):
    parts = families(name)
    cached, plain = engine(parts), engine(parts, cache_enabled=False)
    a, b = image(3, 0), image(4, 2)
    turns = [
        (ask("First picture: "), [a]),
        ([{"type": "text", "text": "A second one:"}, {"type": "image"}], [b]),
        ("Compare the two in one line.", []),
        ([{"type": "image"}, {"type": "text", "text": "The first one again, here."}], [a]),
    ]
    messages, images, rows = [], [], []
    history = []  # (messages, images) before each user turn
    for turn, (content, new) in enumerate(turns):
        messages = content if turn == 0 else [*messages, {"role": "user", "content": content}]
        images = images + new
        history.append((list(messages), list(images)))
        runs_before = cached.feeder.num_encoder_runs
        outs = []
        for eng in (cached, plain):
            ids, spans = eng.encode_chat_images(messages, None, images)
            evs = list(eng.generate(ids, SamplingParams(max_tokens=6), images=spans))
            outs.append(evs[-1].completion_ids)
            if eng is cached:
                rows.append((evs[0].cached_tokens, len(ids), spans))
        assert outs[0] == outs[1], f"{name} turn {turn}"
        messages = [*messages, {"role": "assistant", "content": cached.decode(outs[0])}]
        if turn == 3:  # the same image at a new place: the embedding cache, not the encoder
            assert cached.feeder.num_encoder_runs == runs_before
    # an edited history: turn 2's reply rewritten, then the last user turn again
    edited_msgs, edited_imgs = history[3]
    edited_msgs = [dict(m) for m in edited_msgs]
    assistant = [i for i, m in enumerate(edited_msgs) if m["role"] == "assistant"]
    edited_msgs[assistant[1]]["content"] = "An edited reply about the second picture."
    outs = []
    for eng in (cached, plain):
        ids, spans = eng.encode_chat_images(edited_msgs, None, edited_imgs)
        evs = list(eng.generate(ids, SamplingParams(max_tokens=6), images=spans))
        outs.append(evs[-1].completion_ids)
        if eng is cached:
            rows.append((evs[0].cached_tokens, len(ids), spans))
    assert outs[0] == outs[1], f"{name} edited turn"
    report = ", ".join(f"{c}/{n}" for c, n, _ in rows)
    with capsys.disabled():
        print(f"\n{name}: cached/prompt per turn {report} (4 turns + edited: equal 5/5)")
    assert rows[0][0] == 0 and all(c > 0 for c, _, _ in rows[1:]), rows
    snapshot = cached.layout.requires_checkpoint  # a recurrent layer: hits at checkpoints only
    for c, _, spans in rows[1:]:
        # the image turns hit past the first image (a restore that ends after an image)
        assert c >= spans[0].end or (snapshot and c > 0), (name, rows)
    assert cached.feeder.num_encoder_runs == 2  # a and b, once each
    stats = cached.feeder.stats()
    assert stats["cache_hits"] >= 1 and stats["images_fed"] >= 3, stats
    cached.cache.check_integrity()


@pytest.mark.parametrize("name", ["qwen2_vl", "gemma3"])
def test_a_hit_ending_inside_an_image(families, name):
    """Qwen (causal): a prefill stopped inside an image resumes there with the rest of its rows
    and the right positions. Gemma 3 (full attention only, so blocks could restore anywhere):
    the stopped prefill's chunk still held the whole image and was saved at its end, so the
    restore resumes after it (a restore inside one: the test below)."""
    parts = families(name, **({"sliding": False} if name == "gemma3" else {}))
    eng = engine(parts, prefill_chunk=BLOCK)
    img = image(5, 1)
    ids, spans = eng.encode_chat_images(ask("Cut short: "), None, [img])
    span = spans[0]
    req = Request(list(ids), SamplingParams())
    req.images = tuple(spans)
    with eng.scheduler.turns.step():
        eng.steps.begin(req)
        while req.pos <= span.start:
            eng.steps.prefill_chunk_of(req)
    req.release()
    eng.steps.live = None  # restore from the blocks
    if name == "gemma3":
        assert req.pos >= span.end  # never cut inside the image
    else:
        assert span.start < req.pos < span.end
    _, logits, lease, _ = eng.prefill(ids, images=spans)
    n = lease.num_tokens
    lease.release()
    assert n > span.start
    assert eng.feeder.num_encoder_runs == 1
    assert close(logits, reference(name, parts, ids, [img]))


def test_text_only_requests_after_image_requests_keep_plain_positions(families):
    """The model keeps one ``rope_deltas`` for everyone; an image request must not shift the
    positions of a text-only request that follows (nor of one that reuses its live state)."""
    name = "qwen3_vl"
    parts = families(name)
    eng = engine(parts)
    prefill(eng, ask("An image first: "), [image(6)])
    text = [{"role": "user", "content": "Only words this time, no picture at all."}]
    ids, _, logits, _ = prefill(eng, text, [])
    assert close(logits, reference(name, parts, ids, []))
    events = list(eng.generate(ids, SamplingParams(max_tokens=5)))
    plain = list(engine(parts, cache_enabled=False).generate(ids, SamplingParams(max_tokens=5)))
    assert events[-1].completion_ids == plain[-1].completion_ids


def test_the_family_table_covers_the_qwen_class():
    from promptcache.engines.torch.vision_select import image_families

    families = image_families()
    assert set(MROPE_FAMILIES) <= set(families) and families["gemma3"].startswith("bidirectional")
    assert families["qwen3_5_moe"] == "3-D RoPE positions" and "llava" in families
    expanded = {"llava" if n == "llava_pixtral" else n for n in EXPANDED_FAMILIES}
    assert expanded <= set(families) and families["mistral3"].startswith("causal")


def test_concurrent_image_requests_batch_decode_with_their_own_offsets(families):
    """Qwen3-VL decode steps batch (full attention): each row continues from its own position
    offset (images of other grids shift differently), a text-only request among them too."""
    import threading

    parts = families("qwen3_vl")
    prompts = [(ask(f"Question {i}. "), [image(30 + i, i)]) for i in range(3)]
    prompts.append(([{"role": "user", "content": "No picture in this one, only words."}], []))

    def reply(eng, i):
        messages, images = prompts[i]
        ids, spans = eng.encode_chat_images(messages, None, images)
        return list(eng.generate(ids, SamplingParams(max_tokens=10), images=spans))[-1]

    alone = [reply(engine(parts), i).completion_ids for i in range(len(prompts))]
    shared, out = engine(parts), {}
    threads = [threading.Thread(target=lambda i=i: out.update({i: reply(shared, i)}))
               for i in range(len(prompts))]  # fmt: skip
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [out[i].completion_ids for i in range(len(prompts))] == alone
    assert shared.cache_stats()["num_batched_forwards"] > 0


def test_start_up_says_which_images_are_served(families, tmp_path, caplog):
    """A family outside the images column serves text (image parts get a 400), said at start-up;
    a supported one says images are on, from its image processor alone (no torchvision)."""
    import logging

    from transformers import AutoConfig

    from promptcache.engines.torch.loading import load_torch_processor

    AutoConfig.for_model("mllama").save_pretrained(tmp_path / "mllama")  # cross-attention
    with caplog.at_level(logging.INFO, logger="promptcache"):
        assert load_torch_processor(tmp_path / "mllama") is None
        folder = tmp_path / "gemma3"
        for part in families("gemma3"):  # model, image processor, tokenizer: a user's folder
            part.save_pretrained(folder)
        processor = load_torch_processor(folder)
    assert "images are not supported for mllama on the torch engine" in caplog.text
    assert "images on (gemma3: bidirectional image attention)" in caplog.text
    assert processor is not None


def test_gemma_resumes_exactly_from_a_restore_inside_an_image(families):
    """Why a hit inside a Gemma 3 image needs no cut back: every stored row of an image was
    computed with the whole image present (whole_images), and the rest of the image attends to
    the restored part and to itself (token_type_ids from the start). Restoring blocks up to the
    middle of an image and prefilling the rest gives the model's logits; prefilling the first
    half alone (a chunk cut inside the image) would not."""
    name = "gemma3"
    parts = families(name, sliding=False)  # full attention: blocks restore at any position
    eng = engine(parts)
    runner, vision = eng.runner, eng.vision
    img = image(7)
    ids, spans = eng.encode_chat_images(ask("Halves: "), None, [img])
    span = spans[0]
    rows = vision.encode(img)
    expected = reference(name, parts, ids, [img])
    whole = runner.new_state()
    assert close(vision.forward(whole, VisionChunk(ids, [(span.start, rows)], 0, spans)), expected)
    k = span.start + span.length // 2
    restored = runner.restore([(runner.slice_block(whole, 0, k), k)], None)
    rest = vision.forward(restored, VisionChunk(ids[k:], [(0, rows[k - span.start :])], k, spans))
    assert close(rest, expected)
    split = runner.new_state()  # the image cut across two forwards: its first half is wrong
    vision.forward(split, VisionChunk(ids[:k], [(span.start, rows[: k - span.start])], 0, spans))
    wrong = vision.forward(split, VisionChunk(ids[k:], [(0, rows[k - span.start :])], k, spans))
    assert not close(wrong, expected)
