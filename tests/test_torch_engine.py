"""Torch engine on tiny random models of every cache type: cached runs equal uncached runs."""

import random
import threading

import pytest

torch = pytest.importorskip("torch")

from engine_checks import check_hit_lengths, greedy_turns, hit_results, token_ids  # noqa: E402

from promptcache.engines.base import EngineError, PromptTooLongError, SamplingParams  # noqa: E402
from promptcache.engines.torch.engine import TorchEngine  # noqa: E402
from promptcache.testing.tiny_models import ByteTokenizer, tiny_model  # noqa: E402

pytestmark = pytest.mark.torch
CHUNK, BLOCK = 16, 8
# max |cached - uncached| logit difference allowed when the hit splits the prefill where the
# uncached run does not. Bamba's own split-vs-full difference is ~2e-4; pure Mamba's is larger
# (a known limit, docs/operations.md), so Mamba is held to exactness only where the splits coincide.
# A hit that ends one token short of the prompt runs that token through Bamba's one-step SSM update
# (the decode path), ~1e-3 from its chunked scan over the whole prompt.
TOL = {"llama": 1e-4, "gemma3": 1e-4, "jamba": 1e-4, "bamba": 1e-4, "mamba": None}


@pytest.fixture(scope="module", params=list(TOL))
def engines(request):
    model = tiny_model(request.param)
    cached = TorchEngine(
        model, ByteTokenizer(), block_size=BLOCK, ram_budget=10**8, prefill_chunk=CHUNK
    )
    plain = TorchEngine(model, ByteTokenizer(), cache_enabled=False, prefill_chunk=CHUNK)
    return request.param, cached, plain


def logits_of(engine, prompt):
    _, logits, lease, _ = engine.prefill(prompt)
    cached = (lease.num_tokens, lease.kind) if lease is not None else (0, "off")
    if lease is not None:
        lease.release()
    return logits, cached


def test_hits_of_every_kind_match_uncached_logits(engines):
    kind, cached, plain = engines
    results = hit_results(cached, plain, logits_of, lambda a, b: (a - b).abs().max().item())
    for name, num_cached, hit_kind, diff, same_argmax in results:
        check_hit_lengths(name, num_cached, hit_kind, cached.layout.requires_checkpoint)
        aligned = num_cached % CHUNK == 0
        tol = TOL[kind] if TOL[kind] is not None else (1e-6 if aligned else float("inf"))
        assert diff <= max(tol, 1e-6), f"{kind} {name}: cached {num_cached}, max diff {diff}"
        assert bool(same_argmax) or not aligned and TOL[kind] is None
    cached.cache.check_integrity()


def test_greedy_multi_turn_identical_to_uncached(engines):
    kind, cached, plain = engines
    for turn, a, b, prev_len in greedy_turns(cached, plain, SamplingParams(max_tokens=10)):
        if TOL[kind] is not None or a[0].cached_tokens % CHUNK == 0:
            assert token_ids(a) == token_ids(b), f"{kind} turn {turn}"
        if turn:  # the previous prompt and its reply (a checkpoint ends the reply)
            assert a[0].cached_tokens >= prev_len, f"{kind}: turn {turn} should reuse the last turn"
    cached.cache.check_integrity()
    assert cached.cache.stats().num_pinned_blocks == 0


def test_a_repeat_and_the_next_turn_reuse_like_attention(engines):
    """A regenerate of the same (chunk-unaligned) prompt reuses all but its last token on every
    cache type, snapshot layers too (a checkpoint at the prompt's last computed position), and
    the next turn reuses the whole prompt + reply; greedy outputs equal the uncached engine's."""
    kind, cached, plain = engines
    rng = random.Random(7)
    prompt = [rng.randrange(3, 256) for _ in range(CHUNK * 2 + 13)]
    params = SamplingParams(max_tokens=6)
    want = list(plain.generate(prompt, params))
    first = list(cached.generate(prompt, params))
    again = list(cached.generate(prompt, params))
    assert again[-1].cached_tokens == len(prompt) - 1, (kind, again[-1])
    assert token_ids(first) == token_ids(want) == token_ids(again), kind
    turn = prompt + want[-1].completion_ids + [rng.randrange(3, 256) for _ in range(9)]
    got, plain_turn = list(cached.generate(turn, params)), list(plain.generate(turn, params))
    assert got[-1].cached_tokens == len(prompt) + len(want[-1].completion_ids), (kind, got[-1])
    if TOL[kind] is not None:
        assert token_ids(got) == token_ids(plain_turn), kind
    cached.cache.check_integrity()


def test_bad_requests_raise_engine_errors():
    model = tiny_model("llama")
    engine = TorchEngine(model, ByteTokenizer(), block_size=BLOCK, ram_budget=10**8, max_context=64)
    with pytest.raises(EngineError, match="empty"):
        list(engine.generate([], SamplingParams()))
    with pytest.raises(PromptTooLongError, match="context"):
        list(engine.generate(list(range(3, 80)), SamplingParams()))
    with pytest.raises(EngineError, match="max_tokens"):
        list(engine.generate([5, 6], SamplingParams(max_tokens=0)))
    with pytest.raises(EngineError, match="role"):
        engine.encode_chat([{"role": "wizard", "content": "x"}])
    engine.cache.check_integrity()


def test_a_one_token_prompt_decodes_like_uncached():
    """Its first forward has an empty state: no batched decode (nothing to gather) yet."""
    model = tiny_model("llama")
    cached = TorchEngine(model, ByteTokenizer(), block_size=BLOCK, ram_budget=10**8)
    plain = TorchEngine(model, ByteTokenizer(), cache_enabled=False)
    runs = [list(e.generate([5], SamplingParams(max_tokens=4))) for e in (cached, plain)]
    assert runs[0][-1].text == runs[1][-1].text and runs[0][-1].completion_tokens == 4


def test_sampling_is_seeded_and_stop_strings_cut():
    model = tiny_model("llama")
    engine = TorchEngine(model, ByteTokenizer(), block_size=BLOCK, ram_budget=10**8)
    prompt = engine.encode_text("hello there")
    p = SamplingParams(max_tokens=20, temperature=0.9, top_p=0.9, top_k=50, seed=7)
    t1 = list(engine.generate(prompt, p))[-1].text
    t2 = list(engine.generate(prompt, p))[-1].text
    assert t1 == t2
    greedy = list(engine.generate(prompt, SamplingParams(max_tokens=20)))[-1]
    if len(greedy.text) > 3:
        stop = greedy.text[2:4]
        cut = list(engine.generate(prompt, SamplingParams(max_tokens=20, stop=[stop])))[-1]
        assert cut.reason == "stop" and cut.text == greedy.text[: greedy.text.find(stop)]


def test_cancel_stops_and_unpins():
    import threading

    model = tiny_model("llama")
    engine = TorchEngine(model, ByteTokenizer(), block_size=BLOCK, ram_budget=10**8)
    prompt = list(range(3, 60))
    list(engine.generate(prompt, SamplingParams(max_tokens=2)))
    cancel = threading.Event()
    gen = engine.generate(prompt, SamplingParams(max_tokens=50), cancel=cancel)
    first = next(gen)
    assert first.cached_tokens > 0 and engine.cache.stats().num_pinned_blocks > 0
    cancel.set()
    events = list(gen)
    assert events[-1].reason == "cancelled"
    assert engine.cache.stats().num_pinned_blocks == 0
    # a consumer that walks away mid-stream also unpins
    gen = engine.generate(prompt, SamplingParams(max_tokens=50))
    next(gen)
    gen.close()
    assert engine.cache.stats().num_pinned_blocks == 0


@pytest.mark.parametrize("kind", ["gemma3", "jamba"])
def test_snapshot_models_restart_from_ssd_at_their_last_checkpoint(kind, tmp_path):
    """Checkpoints attached after a block's first write-through reach the SSD too, and a restart
    resumes at the prompt-end checkpoint, not at an earlier chunk boundary."""
    model = tiny_model(kind)
    kwargs = dict(block_size=BLOCK, prefill_chunk=CHUNK, ssd_dir=tmp_path / "ssd")
    rng = random.Random(4)
    prompt = [rng.randrange(3, 256) for _ in range(50)]
    first = TorchEngine(model, ByteTokenizer(), ram_budget=10**8, **kwargs)
    list(first.generate(prompt, SamplingParams(max_tokens=4)))
    first.close()
    second = TorchEngine(model, ByteTokenizer(), ram_budget=10**8, **kwargs)
    plain = TorchEngine(model, ByteTokenizer(), cache_enabled=False, prefill_chunk=CHUNK)
    query = prompt + [7, 8, 9]
    got, (num_cached, _) = logits_of(second, query)
    want, _ = logits_of(plain, query)
    assert num_cached == 50
    assert (got - want).abs().max().item() <= TOL[kind]
    second.cache.check_integrity()
    second.close()


def test_blocks_waiting_for_a_stalled_ssd_writer_stay_inside_the_ram_budget(tmp_path):
    """Blocks queued for the SSD are still in memory: RAM makes room for them, the queue keeps
    to the budget (drops past it are counted), and the replies stay those of no cache."""
    model = tiny_model("llama")
    cfg = model.config
    token_bytes = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * 4  # K and V, float32
    token_bytes *= cfg.hidden_size // cfg.num_attention_heads
    budget = 24 * BLOCK * token_bytes
    cached = TorchEngine(model, ByteTokenizer(), block_size=BLOCK, prefill_chunk=CHUNK,
                         ram_budget=budget, ssd_dir=tmp_path / "ssd")  # fmt: skip
    plain = TorchEngine(model, ByteTokenizer(), cache_enabled=False, prefill_chunk=CHUNK)
    ssd = cached.cache.tiers.find("ssd")
    rng = random.Random(7)
    prompts = [[rng.randrange(3, 256) for _ in range(60)] for _ in range(4)]
    gate, write = threading.Event(), ssd.writer._write
    ssd.writer._write = lambda record: (gate.wait(60), write(record))  # the writer stalls
    try:
        for turn in range(3):
            for k, prompt in enumerate(prompts):
                a = list(cached.generate(prompt, SamplingParams(max_tokens=6)))
                b = list(plain.generate(prompt, SamplingParams(max_tokens=6)))
                assert token_ids(a) == token_ids(b), f"turn {turn}, conversation {k}"
                prompts[k] = (
                    prompt + b[-1].completion_ids + [rng.randrange(3, 256) for _ in range(9)]
                )
                queued = cached.memory_stats()["queued_write_bytes"]
                assert queued == ssd.queued_bytes() <= budget
                # RAM and the queued blocks: inside the budget together
                assert cached.cache.ram.held_bytes + queued <= budget
        assert ssd.describe()["dropped_writes"] > 0
    finally:
        gate.set()
    assert ssd.flush(10) and ssd.queued_bytes() == 0
    cached.cache.check_integrity()
    for prompt in prompts:
        a = list(cached.generate(prompt, SamplingParams(max_tokens=6)))
        assert token_ids(a) == token_ids(list(plain.generate(prompt, SamplingParams(max_tokens=6))))
    cached.cache.check_integrity()
    cached.close()
