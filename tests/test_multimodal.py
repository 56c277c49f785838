"""Images in the prompt on a tiny random-weight LLaVA (transformers): image-aware block keys,
the vision-embedding cache, the "image differs" miss reason. Engine level: every cached run's
logits against the model's own uncached forward (input_ids + pixel_values)."""

import io

import numpy as np
import pytest

torch = pytest.importorskip("torch")
PIL = pytest.importorskip("PIL")

from PIL import Image  # noqa: E402

from promptcache.core.images import (  # noqa: E402
    ImageError,
    decode_image,
    image_extras,
    image_from_pixels,
)
from promptcache.core.vision_cache import VisionCache, VisionKey  # noqa: E402
from promptcache.core.vision_tags import tenant_folder  # noqa: E402
from promptcache.engines.base import RequestError, SamplingParams  # noqa: E402
from promptcache.engines.torch.codec import TorchCodec  # noqa: E402
from promptcache.engines.torch.engine import TorchEngine  # noqa: E402
from promptcache.server.diagnosis import PromptMemory, diagnose  # noqa: E402
from promptcache.testing.tiny_vlm import tiny_llava  # noqa: E402

pytestmark = pytest.mark.torch
BLOCK, CHUNK = 16, 32
TOL = 1e-4  # chunked prefill vs one forward: float reduction order only


def pixels(seed, h=40, w=50):
    return np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8)


def encoded(rgb, fmt, **kw):
    buf = io.BytesIO()
    Image.fromarray(rgb).save(buf, format=fmt, **kw)
    return buf.getvalue()


def ask(text_before, text_after="What is in the picture?"):
    return [
        {"role": "system", "content": "You describe pictures."},
        {"role": "user", "content": [{"type": "text", "text": text_before}, {"type": "image"},
                                     {"type": "text", "text": text_after}]},
    ]  # fmt: skip


@pytest.fixture(scope="module")
def vlm():
    return tiny_llava("tiny", seed=0)


def engine(vlm, **options):
    model, proc = vlm
    opts = dict(block_size=BLOCK, ram_budget=10**8, prefill_chunk=CHUNK)
    return TorchEngine(model, proc.tokenizer, proc, **{**opts, **options})


def reference(vlm, ids, images):
    """The model's own forward on the whole prompt: no cache, no chunks, its own image path."""
    model, proc = vlm
    pil = [im.to_pil() for im in images]
    pv = proc.image_processor(images=pil, return_tensors="pt")["pixel_values"]
    with torch.inference_mode():
        return model(input_ids=torch.tensor([ids]), pixel_values=pv).logits[0, -1]


def run(eng, messages, images):
    ids, spans = eng.encode_chat_images(messages, None, images)
    _, logits, lease, _ = eng.prefill(ids, images=spans)
    num_cached = lease.num_tokens if lease is not None else 0
    if lease is not None:
        lease.release()
    return ids, spans, logits, num_cached


# -- pixels and keys ----------------------------------------------------------------------------


def test_digest_is_of_pixels_not_encoding():
    rgb = pixels(1)
    png = decode_image(encoded(rgb, "PNG"))
    webp = decode_image(encoded(rgb, "WEBP", lossless=True))
    assert png.digest == webp.digest and np.array_equal(png.pixels, rgb)
    rgba = np.concatenate([rgb, np.full((*rgb.shape[:2], 1), 255, np.uint8)], axis=2)
    assert decode_image(encoded(rgba, "PNG")).digest == png.digest  # opaque alpha: same picture
    changed = rgb.copy()
    changed[7, 9, 1] ^= 1  # one pixel, one bit
    assert decode_image(encoded(changed, "PNG")).digest != png.digest
    assert image_from_pixels(rgb[:, :25]).digest != image_from_pixels(rgb[:, 25:]).digest


def test_bad_images_are_refused():
    with pytest.raises(ImageError):
        decode_image(b"not an image at all")
    with pytest.raises(ImageError):
        decode_image(encoded(pixels(2), "PNG")[:60])  # truncated
    with pytest.raises(ImageError, match="at most"):
        decode_image(encoded(pixels(3, 100, 100), "PNG"), max_pixels=5000)


def test_extras_cover_every_block_of_the_image():
    img = image_from_pixels(pixels(4))
    from promptcache.core.images import ImageSpan

    extras = image_extras([ImageSpan(20, 40, img)], 16)  # tokens 20..59: blocks 1, 2, 3
    assert sorted(extras) == [20, 32, 48]
    assert all(img.digest in key for key in extras.values())


# -- the engine ---------------------------------------------------------------------------------


def test_same_image_hits_with_logits_equal_to_uncached(vlm):
    eng = engine(vlm)
    img = image_from_pixels(pixels(5))
    ids, spans, logits, cached = run(eng, ask("Look: "), [img])
    assert cached == 0 and len(spans) == 1 and spans[0].length == 64
    assert (logits - reference(vlm, ids, [img])).abs().max().item() < TOL
    # the same pixels again, decoded from another encoding: a hit past the image, no encoder
    again = decode_image(encoded(pixels(5), "WEBP", lossless=True))
    runs = eng.feeder.num_encoder_runs
    ids2, spans2, logits2, cached2 = run(eng, ask("Look: "), [again])
    assert ids2 == ids and cached2 == len(ids) - 1
    assert (logits2 - reference(vlm, ids, [img])).abs().max().item() < TOL
    assert eng.feeder.num_encoder_runs == runs
    # a longer conversation on top: the image's blocks are reused, the encoder is not asked
    longer = [*ask("Look: "), {"role": "assistant", "content": "A picture."},
              {"role": "user", "content": "And its colours?"}]  # fmt: skip
    lookups = eng.feeder.cache.stats()["hits"] + eng.feeder.cache.stats()["misses"]
    ids3, _, logits3, cached3 = run(eng, longer, [img])
    assert cached3 >= spans[0].end
    assert (logits3 - reference(vlm, ids3, [img])).abs().max().item() < TOL
    stats = eng.feeder.cache.stats()
    assert stats["hits"] + stats["misses"] == lookups  # a hit past the image never looks it up
    eng.cache.check_integrity()


def test_another_image_misses_from_its_first_token(vlm):
    eng = engine(vlm)
    a, b = image_from_pixels(pixels(6)), image_from_pixels(pixels(7))
    ids, spans, _, _ = run(eng, ask("Here it is: "), [a])
    ids_b, spans_b, logits_b, cached_b = run(eng, ask("Here it is: "), [b])
    start = spans_b[0].start
    assert ids_b == ids and start % BLOCK  # same tokens: only the pixels differ
    assert cached_b == start  # the hit ends at the image's first token
    assert (logits_b - reference(vlm, ids, [b])).abs().max().item() < TOL
    # back to the first image: its blocks still hit, and the live state (image b) is not reused
    _, _, logits_a, cached_a = run(eng, ask("Here it is: "), [a])
    assert cached_a == len(ids) - 1
    assert (logits_a - reference(vlm, ids, [a])).abs().max().item() < TOL


def test_two_images_greedy_turns_equal_uncached(vlm):
    cached, plain = engine(vlm), engine(vlm, cache_enabled=False)
    a, b = image_from_pixels(pixels(8)), image_from_pixels(pixels(9, 30, 60))
    messages = ask("First: ")
    images = [a]
    for turn, (text, new_image) in enumerate([("Second: ", b), ("Third, no image.", None)]):
        outs = []
        for eng in (cached, plain):
            ids, spans = eng.encode_chat_images(messages, None, images)
            evs = list(eng.generate(ids, SamplingParams(max_tokens=8), images=spans))
            outs.append((evs[-1].completion_ids, evs[0].cached_tokens))
        assert outs[0][0] == outs[1][0], f"turn {turn}"
        if turn:
            assert outs[0][1] > 0
        reply = cached.decode(outs[0][0])
        content = [{"type": "text", "text": text}] + ([{"type": "image"}] if new_image else [])
        messages = [*messages, {"role": "assistant", "content": reply},
                    {"role": "user", "content": content}]  # fmt: skip
        images = images + ([new_image] if new_image else [])


def test_embedding_cache_skips_the_encoder(vlm):
    img = image_from_pixels(pixels(10))
    counts = {}
    for name, opts in (("on", {}), ("off", {"vision_cache_bytes": 0})):
        eng = engine(vlm, **opts)
        # other text before the image each time: the prompt cache misses before the image
        for i in range(3):
            ids, spans, logits, cached = run(eng, ask(f"Variant {i} of the question. "), [img])
            assert cached < spans[0].start
            assert (logits - reference(vlm, ids, [img])).abs().max().item() < TOL
        counts[name] = eng.feeder.num_encoder_runs
        assert eng.feeder.num_images_fed == 3
    assert counts == {"on": 1, "off": 3}
    # another tenant never shares the encoder's output (nor its timing)
    eng = engine(vlm)
    for tenant in ("alice", "bob", "alice"):
        ids, spans = eng.encode_chat_images(ask("Tenants. "), None, [img])
        _, _, lease, _ = eng.prefill(ids, tenant=tenant, images=spans)
        lease.release()
    assert eng.feeder.num_encoder_runs == 2


def test_text_only_engine_refuses_images(vlm):
    from promptcache.testing.tiny_models import ByteTokenizer, tiny_model

    eng = TorchEngine(tiny_model("llama"), ByteTokenizer(), block_size=BLOCK)
    assert not eng.supports_images
    with pytest.raises(RequestError, match="no image input"):
        eng.encode_chat_images(ask("x"), None, [image_from_pixels(pixels(1))])


def test_placeholder_count_must_match_images(vlm):
    eng = engine(vlm)
    with pytest.raises(RequestError, match="placeholders"):
        eng.encode_chat_images(ask("x"), None, [])


# -- the vision-embedding cache -----------------------------------------------------------------


def test_vision_cache_budget_ssd_and_damage(tmp_path):
    codec = TorchCodec(torch.device("cpu"))
    rows = [torch.randn(64, 32) for _ in range(3)]  # 8 KiB each
    keys = [VisionKey("fp", "settings", bytes([i]) * 16) for i in range(3)]
    cache = VisionCache(20_000, ssd_dir=tmp_path, codec=codec)
    for k, r in zip(keys, rows, strict=True):
        cache.put(k, r)
    assert cache.stats()["entries"] == 2 and cache.stats()["evictions"] == 1
    assert torch.equal(cache.get(keys[2]), rows[2])
    assert torch.equal(cache.get(keys[0]), rows[0])  # evicted from RAM, read back from SSD
    assert cache.stats()["ssd_hits"] == 1
    assert cache.get(VisionKey("fp", "other settings", keys[0].digest)) is None
    cache.check_integrity()
    # a new process finds the files; a damaged one is removed and counted, never served
    again = VisionCache(20_000, ssd_dir=tmp_path, codec=codec)
    path = again.folder / tenant_folder("") / f"{keys[1].name}.safetensors"
    data = bytearray(path.read_bytes())
    data[-3] ^= 0xFF
    path.write_bytes(bytes(data))
    assert again.get(keys[1]) is None and not path.exists()
    assert again.stats()["bad_files"] == 1
    assert torch.equal(again.get(keys[2]), rows[2])
    again.check_integrity()


def test_vision_cache_forgets_sessions_and_tenants_on_disk_too(tmp_path):
    """Deleting a session removes the encoder outputs only it used, in RAM and on disk (also in
    a new process); shared ones stay unless forced; a tenant goes whole; tags hold no raw ids."""
    codec = TorchCodec(torch.device("cpu"))

    def key(i, tenant="acme"):
        return VisionKey("fp", "settings", bytes([i]) * 16, tenant)

    rows = {i: torch.randn(8, 4) for i in range(4)}
    cache = VisionCache(10**6, ssd_dir=tmp_path, codec=codec)
    cache.put(key(0), rows[0], "alice")  # alice's own image
    cache.put(key(1), rows[1], "alice")
    assert torch.equal(cache.get(key(1), "bob"), rows[1])  # ...that bob sent too
    cache.put(key(2), rows[2], "bob")
    cache.put(key(3, "globex"), rows[3], "alice")  # another tenant's alice
    files = list(tmp_path.rglob("*"))
    assert not any(b"alice" in f.read_bytes() for f in files if f.is_file())
    cache.check_integrity()
    # a new process: the tags come from the files
    again = VisionCache(10**6, ssd_dir=tmp_path, codec=codec)
    assert again.forget_session("acme", "alice") == 1
    assert again.get(key(0)) is None and torch.equal(again.get(key(1)), rows[1])
    assert torch.equal(again.get(key(3, "globex")), rows[3])
    # the RAM copy read back before the deletion goes too
    assert torch.equal(again.get(key(2), "bob"), rows[2])
    assert again.forget_session("acme", "bob", force=False) == 2  # key(1): alice's tag is gone
    assert again.get(key(1)) is None and again.get(key(2)) is None
    again.check_integrity()
    # force removes shared entries; a tenant goes whole
    cache = VisionCache(10**6, ssd_dir=tmp_path, codec=codec)
    cache.put(key(0), rows[0], "alice")
    cache.get(key(0), "bob")
    assert cache.forget_session("acme", "alice") == 0 and cache.get(key(0)) is not None
    assert cache.forget_session("acme", "alice", force=True) == 0  # alice's tag already went
    cache.get(key(0), "carol")
    assert cache.forget_session("acme", "carol", force=True) == 1
    assert cache.get(key(0)) is None
    assert cache.forget_tenant("globex") == 1 and cache.get(key(3, "globex")) is None
    assert not (tmp_path / "vision-embeddings" / tenant_folder("globex")).exists()
    cache.check_integrity()


# -- miss diagnosis -----------------------------------------------------------------------------


def test_diagnosis_names_the_image_that_differs(vlm):
    eng = engine(vlm)
    a, b = image_from_pixels(pixels(11)), image_from_pixels(pixels(12))
    memory = PromptMemory()
    ids, spans = eng.encode_chat_images(ask("Here it is: "), None, [a])
    memory.add("", 1, np.asarray(ids, np.uint32), 0.0, ((spans[0].start, a.digest),))
    ids_b, spans_b = eng.encode_chat_images(ask("Here it is: "), None, [b])
    # the lookup of the same tokens with image b (after a's blocks were saved)
    run(eng, ask("Here it is: "), [a])
    seq = eng.cache.sequence(ids_b, extras=image_extras(spans_b, BLOCK))
    with eng.cache.lookup(seq) as lease:
        report = lease.report
    marks = ((spans_b[0].start, b.digest),)
    miss = diagnose(np.asarray(ids_b, np.uint32), report, memory, "", may_name_namespaces=True,
                    decode=eng.decode, images=marks)  # fmt: skip
    assert miss.reason == "image", miss
    assert miss.detail["token_index"] == spans_b[0].start
    assert miss.detail["message"] == f"image differs at token {spans_b[0].start}"
    same = diagnose(np.asarray(ids, np.uint32), report, memory, "", may_name_namespaces=True,
                    decode=eng.decode, images=((spans[0].start, a.digest),))  # fmt: skip
    assert same.reason != "image"


def test_ssd_tier_after_restart_keys_by_image(vlm, tmp_path):
    a, b = image_from_pixels(pixels(13)), image_from_pixels(pixels(14))
    first = engine(vlm, ssd_dir=tmp_path)
    ids, spans, _, _ = run(first, ask("On disk: "), [a])
    first.close()  # flushes the SSD writes
    second = engine(vlm, ssd_dir=tmp_path)  # empty RAM: every hit comes from the SSD tier
    ids_b, spans_b, logits_b, cached_b = run(second, ask("On disk: "), [b])
    assert cached_b == spans_b[0].start  # promoted up to the other image's first token only
    assert (logits_b - reference(vlm, ids_b, [b])).abs().max().item() < TOL
    _, _, logits_a, cached_a = run(second, ask("On disk: "), [a])
    assert cached_a == len(ids) - 1
    assert (logits_a - reference(vlm, ids, [a])).abs().max().item() < TOL
    second.close()
    # the encoder's output survived too: another question about image a runs no encoder
    third = engine(vlm, ssd_dir=tmp_path)
    ids_c, _, logits_c, _ = run(third, ask("A different opening line. "), [a])
    assert third.feeder.num_encoder_runs == 0
    assert third.feeder.cache.stats()["ssd_hits"] == 1
    assert (logits_c - reference(vlm, ids_c, [a])).abs().max().item() < TOL
    third.feeder.cache.check_integrity()
    third.close()


def test_a_hit_ending_inside_an_image_takes_the_rest_of_its_rows(vlm):
    from promptcache.serving.request import Request

    eng = engine(vlm)
    img = image_from_pixels(pixels(15))
    ids, spans = eng.encode_chat_images(ask("Cut short: "), None, [img])
    span = spans[0]
    # a request that stopped after the chunk ending inside the image (a cancelled prefill)
    req = Request(list(ids), SamplingParams())
    req.images = tuple(spans)
    with eng.scheduler.turns.step():
        eng.steps.begin(req)
        while req.pos <= span.start:
            eng.steps.prefill_chunk_of(req)
    req.release()
    assert span.start < req.pos < span.end
    eng.steps.live = None  # force a restore from the blocks, not the live state
    _, logits, lease, _ = eng.prefill(ids, images=spans)
    assert span.start < lease.num_tokens < span.end  # resumes mid-image
    lease.release()
    assert eng.feeder.num_encoder_runs == 1  # the rest of the rows came from the vision cache
    assert (logits - reference(vlm, ids, [img])).abs().max().item() < TOL


def test_concurrent_image_requests_batch_and_match_alone(vlm):
    import threading

    images = [image_from_pixels(pixels(20 + i)) for i in range(3)]

    def reply(eng, i):
        ids, spans = eng.encode_chat_images(ask(f"Question {i}. "), None, [images[i]])
        return list(eng.generate(ids, SamplingParams(max_tokens=12), images=spans))[-1]

    alone = [reply(engine(vlm), i).completion_ids for i in range(3)]
    shared, out = engine(vlm), {}
    threads = [threading.Thread(target=lambda i=i: out.update({i: reply(shared, i)}))
               for i in range(3)]  # fmt: skip
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [out[i].completion_ids for i in range(3)] == alone
    assert shared.cache_stats()["num_batched_forwards"] > 0
