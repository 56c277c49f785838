"""MLX engine on tiny random mlx-lm models of every cache type: cached runs equal uncached runs."""

import random

import numpy as np
import pytest

pytest.importorskip("mlx_lm")

from engine_checks import check_hit_lengths, greedy_turns, hit_results, token_ids  # noqa: E402

from promptcache.engines.base import SamplingParams  # noqa: E402
from promptcache.engines.mlx.engine import MlxEngine  # noqa: E402
from promptcache.testing.tiny_models import MLX_TINY_KINDS, ByteTokenizer, mlx_tiny_model  # noqa: E402

pytestmark = pytest.mark.mlx
CHUNK, BLOCK = 16, 8
TOL = 1e-4  # max |cached - uncached| logit difference; splits coincide, so this is float noise


def make_engines(kind, model_args=None, **kwargs):
    model = mlx_tiny_model(kind, **(model_args or {}))
    cached = MlxEngine(
        model, ByteTokenizer(), block_size=BLOCK, ram_budget=10**8, prefill_chunk=CHUNK, **kwargs
    )
    plain = MlxEngine(model, ByteTokenizer(), cache_enabled=False, prefill_chunk=CHUNK, **kwargs)
    return cached, plain


@pytest.fixture(scope="module", params=[*MLX_TINY_KINDS, "llama-kv8"])
def engines(request):
    if request.param == "llama-kv8":  # QuantizedKVCache blocks
        return request.param, *make_engines(
            "llama",
            {"num_attention_heads": 2, "num_key_value_heads": 1},
            kv_bits=8,
            kv_group_size=32,
        )
    return request.param, *make_engines(request.param)


def logits_of(engine, prompt):
    _, logits, lease, _ = engine.prefill(prompt)
    cached = (lease.num_tokens, lease.kind) if lease is not None else (0, "off")
    if lease is not None:
        lease.release()
    return engine.to_numpy(logits), cached


def test_layouts_classify_every_cache_kind(engines):
    kind, cached, _ = engines
    want = {
        "llama": ("KVCache", "KVCache"),
        "llama-kv8": ("QuantizedKVCache", "QuantizedKVCache"),
        "gemma3": ("RotatingKVCache", "KVCache"),
        "mamba2": ("ArraysCache", "ArraysCache"),
        "falcon_h1": ("ArraysCache", "KVCache", "ArraysCache", "KVCache"),  # 2 CacheLists
    }[kind]
    assert cached.layout.kinds == want
    assert cached.layout.requires_checkpoint == (kind in ("gemma3", "mamba2", "falcon_h1"))


def test_hits_of_every_kind_match_uncached_logits(engines):
    kind, cached, plain = engines
    results = hit_results(cached, plain, logits_of, lambda a, b: float(np.abs(a - b).max()))
    for name, num_cached, hit_kind, diff, same_argmax in results:
        check_hit_lengths(name, num_cached, hit_kind, cached.layout.requires_checkpoint)
        assert diff <= TOL, f"{kind} {name}: cached {num_cached}, max diff {diff}"
        assert same_argmax
    cached.cache.check_integrity()


def test_greedy_multi_turn_identical_to_uncached(engines):
    kind, cached, plain = engines
    for turn, a, b, prev_len in greedy_turns(cached, plain, SamplingParams(max_tokens=10)):
        assert token_ids(a) == token_ids(b), f"{kind} turn {turn}"
        if turn:
            # the previous prompt and its reply are cached (a checkpoint ends the reply)
            assert a[0].cached_tokens >= prev_len, f"{kind}: turn {turn} should reuse the last turn"
    cached.cache.check_integrity()


def test_hybrid_with_an_edited_reply_reuses_up_to_the_nearest_checkpoint():
    cached, plain = make_engines("falcon_h1")
    rng = random.Random(3)
    turn1 = [rng.randrange(3, 256) for _ in range(40)]
    reply = list(cached.generate(turn1, SamplingParams(max_tokens=12)))[-1].completion_ids
    # the client rewrote the assistant's reply: everything from position 40 on differs
    edited = [(t % 200) + 10 for t in reply[::-1]] + [rng.randrange(3, 256) for _ in range(9)]
    turn2 = turn1 + edited
    a = list(cached.generate(turn2, SamplingParams(max_tokens=8)))
    b = list(plain.generate(turn2, SamplingParams(max_tokens=8)))
    # checkpoints were taken at chunk boundaries 16, 32 and at the end of the prompt (40)
    assert a[0].cached_tokens == 40
    assert token_ids(a) == token_ids(b)
    cached.cache.check_integrity()


def test_payloads_stay_mlx_arrays_and_sizes_come_from_shapes():
    import mlx.core as mx

    from promptcache.core.block import payload_nbytes

    cached, _ = make_engines("falcon_h1")
    list(cached.generate(list(range(3, 60)), SamplingParams(max_tokens=2)))
    blocks = [b for b in cached.cache.ram.tree.index.values() if b.payload is not None]
    assert blocks
    for block in blocks:
        assert isinstance(block.payload, mx.array)
        assert block.payload.shape[0] == 4  # keys and values of 2 positional slots, stacked
        want = block.payload.size * block.payload.itemsize
        assert payload_nbytes(block.payload) == want
    lazy = mx.zeros((4, 1, 2, 8, 16)) + 1  # never evaluated: sizing reads the shape only
    assert payload_nbytes(lazy) == 4 * 2 * 8 * 16 * 4
    cached.cache.check_integrity()


def test_ssd_tier_restart_serves_mlx_blocks_that_equal_uncached(tmp_path):
    import mlx.core as mx

    model = mlx_tiny_model("gemma3")
    kwargs = dict(block_size=BLOCK, prefill_chunk=CHUNK, ssd_dir=tmp_path / "ssd")
    rng = random.Random(4)
    prompt = [rng.randrange(3, 256) for _ in range(50)]
    first = MlxEngine(model, ByteTokenizer(), ram_budget=10**8, **kwargs)
    list(first.generate(prompt, SamplingParams(max_tokens=4)))
    first.close()
    files = list((tmp_path / "ssd").rglob("*.safetensors"))
    assert files
    arrays = mx.load(str(files[0]))  # standard safetensors: MLX reads our block files as is
    assert arrays and all(isinstance(a, mx.array) for a in arrays.values())

    second = MlxEngine(model, ByteTokenizer(), ram_budget=10**8, **kwargs)  # a restart
    plain = MlxEngine(model, ByteTokenizer(), cache_enabled=False, prefill_chunk=CHUNK)
    query = prompt + [7, 8, 9]
    got, (num_cached, _) = logits_of(second, query)
    want, _ = logits_of(plain, query)
    assert num_cached == 50  # the checkpoint at the end of the first prompt
    assert float(np.abs(got - want).max()) <= TOL
    assert second.cache.stats().tiers["ssd"]["num_promoted_blocks"] > 0
    second.cache.check_integrity()
    second.close()


@pytest.mark.parametrize("kind", ["llama", "gemma3"])
def test_state_restored_on_one_thread_runs_on_another(kind):
    # a request's lookup + restore and its next prefill chunk may be driven by different
    # consumers' threads; MLX streams are per thread, so the restored state must be evaluated
    import threading

    model = mlx_tiny_model(kind)
    cached = MlxEngine(model, ByteTokenizer(), block_size=BLOCK, prefill_chunk=CHUNK)
    plain = MlxEngine(model, ByteTokenizer(), cache_enabled=False, prefill_chunk=CHUNK)
    prompt = [random.Random(6).randrange(3, 256) for _ in range(40)]
    logits_of(cached, prompt)
    _, _, lease, _ = cached.prefill(prompt)
    segments, checkpoint = lease.segments(), lease.checkpoint
    restored: list = []
    worker = threading.Thread(
        target=lambda: restored.append(cached.runner.restore(segments, checkpoint))
    )
    worker.start()
    worker.join()
    lease.release()
    got = cached.to_numpy(cached.forward(restored[0], [9, 10]))
    want, _ = logits_of(plain, prompt[: lease.num_tokens] + [9, 10])
    assert float(np.abs(got - want).max()) <= TOL


@pytest.mark.parametrize("kind", ["mamba2", "falcon_h1", "llama"])
def test_admission_counts_ssm_arrays_once_per_request(kind):
    """The ``ArraysCache`` state (SSM, conv) is the same at any length: counted per request,
    the growing KV caches per token (``admission.probe_rate``)."""
    from mlx.utils import tree_flatten
    from mlx_lm.models.cache import ArraysCache, CacheList

    cached, _ = make_engines(kind, max_live_bytes="1GB")
    runner, admission = cached.runner, cached.admission
    state = runner.new_state()
    runner.forward([state], [list(range(3, 40))])
    parts = [p for c in state for p in (c.caches if isinstance(c, CacheList) else (c,))]
    arrays = [v for p in parts if isinstance(p, ArraysCache) for _, v in tree_flatten(p.state)]
    assert admission.bytes_per_request == sum(a.nbytes for a in arrays if a is not None)
    assert (admission.bytes_per_request > 0) == (kind != "llama")
    assert (admission.bytes_per_token > 0) == (kind != "mamba2")
