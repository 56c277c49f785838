"""Packed forwards (torch.ragged ``packed_forward``, ``PackedRunner``): several requests' prefill
pieces and decode tokens in one forward give each sequence what it gets alone through the model's
forward (logits within 1e-4 of the largest, float32), and under the batcher every request's
greedy reply is the one it gives alone with the cache off: requests of different prompt lengths,
cache hits and misses, one joining while the others decode, a second turn on blocks saved from
packed forwards."""

import random
import threading

import pytest

torch = pytest.importorskip("torch")

from transformers import DynamicCache  # noqa: E402
from transformers.cache_utils import DynamicSlidingWindowLayer  # noqa: E402

from promptcache.engines.base import Finished, SamplingParams  # noqa: E402
from promptcache.engines.torch.engine import TorchEngine  # noqa: E402
from promptcache.engines.torch.lean import LeanDecoder  # noqa: E402
from promptcache.engines.torch.ragged import RowLayer  # noqa: E402
from promptcache.engines.torch.runner import TorchRunner  # noqa: E402
from promptcache.serving.request import Phase, Request  # noqa: E402
from promptcache.serving.runner import PackedRunner  # noqa: E402
from promptcache.testing.tiny_families import build_family  # noqa: E402

pytestmark = pytest.mark.torch
TOL = 1e-4  # of the largest logit
CHUNK, BLOCK = 16, 8


@pytest.fixture(scope="module", params=["llama", "qwen3", "qwen3_moe", "gemma3"])
def family(request):
    return request.param, build_family(request.param)


def close(got, want):
    scale = float(want.abs().max().clamp(min=1.0))
    return float((got - want).abs().max()) <= TOL * scale


def test_a_packed_forward_equals_each_sequence_alone(family):
    name, (model, tokenizer) = family
    runner = TorchRunner(model, tokenizer)
    assert isinstance(runner._decoder, LeanDecoder) and isinstance(runner, PackedRunner)
    rng = random.Random(1)
    vocab = runner.vocab_size

    def ids(n):
        return [rng.randrange(3, vocab) for _ in range(n)]

    # rounds of new tokens per sequence: first pieces of several lengths, then pieces after
    # cached positions beside one-token (decode) rows; sequence 3 starts from a prefix computed
    # by the model's own forward (a restored or live state)
    rounds = [
        [ids(9), ids(1), ids(40), ids(5)],
        [ids(1), ids(7), ids(1), ids(23)],
        [ids(16), ids(1), ids(3), ids(1)],
    ]
    packed = [runner.new_state() for _ in rounds[0]]
    alone = [DynamicCache(config=model.config) for _ in rounds[0]]  # the model's own layers
    head = ids(12)
    runner._forward_one(packed[3], head), runner._forward_one(alone[3], head)
    for feed in rounds:
        got = runner.forward_packed(packed, feed)
        for r, x in enumerate(feed):
            want = runner._forward_one(alone[r], x)
            assert close(got[r], want), (name, r, float((got[r] - want).abs().max()))
            assert int(got[r].argmax()) == int(want.argmax())
    assert [s.get_seq_length() for s in packed] == [s.get_seq_length() for s in alone]
    # full-attention layers grow in place; gemma3's sliding rings (window 16, passed by the
    # 40- and 23-token pieces) stay the model's own
    assert all(
        isinstance(layer, RowLayer) or type(layer) is DynamicSlidingWindowLayer
        for s in packed
        for layer in s.layers
    )
    assert any(isinstance(layer, RowLayer) for layer in packed[0].layers)


def test_a_runner_without_the_lean_step_does_not_pack():
    model, tokenizer = build_family("gpt_oss")  # attention sinks, MoE biases: the model's forward
    runner = TorchRunner(model, tokenizer)
    assert not runner.packs([runner.new_state(), runner.new_state()])


def engine(model, tokenizer, **options):
    return TorchEngine(
        model, tokenizer, block_size=BLOCK, ram_budget=10**8, prefill_chunk=CHUNK, **options
    )


def drive(eng, arrivals, max_steps=400):
    """Step the engine's batcher by hand as the scheduler does: ``arrivals`` maps a step index
    to the requests arriving then. Each request's events, in order."""
    events = {}
    active: list[Request] = []
    for step in range(max_steps):
        for req in arrivals.get(step, ()):
            events[req] = []
            active.append(req)
        if not active and step > max(arrivals):
            return events
        for req, moved in eng.batcher.advance_batch(active).items():
            events[req] += moved.events
            assert not isinstance(moved.outcome, BaseException), moved.outcome
            req.phase = moved.outcome
        for req in active:
            if req.phase is Phase.DONE:
                req.release()
        active = [r for r in active if r.phase is not Phase.DONE]
    raise AssertionError("requests still running")


def completion(events):
    done = [e for e in events if isinstance(e, Finished)]
    assert len(done) == 1
    return done[0].completion_ids


def test_concurrent_requests_packed_reply_as_alone_with_the_cache_off():
    model, tokenizer = build_family("qwen3")
    on = engine(model, tokenizer, step_tokens=16)  # pieces of several prompts in one step
    off = engine(model, tokenizer, cache_enabled=False)
    rng = random.Random(7)
    vocab = on.runner.vocab_size

    def ids(n):
        return [rng.randrange(3, vocab) for _ in range(n)]

    params = SamplingParams(max_tokens=10)
    # earlier turns in the cache: two of the new prompts extend them (hits), the rest miss
    first_turns = [ids(70), ids(45)]
    replies = [list(on.generate(p, params))[-1].completion_ids for p in first_turns]
    prompts = [
        first_turns[0] + replies[0] + ids(30),  # a hit, then a 30-token rest
        ids(5),
        ids(90),
        first_turns[1] + replies[1] + ids(3),  # a hit, a few tokens left
        ids(37),
        ids(150),  # joins while the others decode
    ]
    want = [completion(off.generate(p, params)) for p in prompts]
    reqs = [Request(list(p), params) for p in prompts]
    got = drive(on, {0: reqs[:4], 1: reqs[4:5], 12: reqs[5:]})
    assert [completion(got[r]) for r in reqs] == want
    assert reqs[0].cached >= 64 and reqs[3].cached >= 40  # the hits were hits
    stats = on.cache_stats()
    assert stats["num_packed_forwards"] > 0, stats
    assert stats["packed_pieces"] > stats["num_packed_forwards"], stats  # pieces packed together
    assert stats["num_pinned_blocks"] == 0
    on.cache.check_integrity()
    # a second turn of each, fired together: they hit blocks saved from packed forwards
    nexts = [p + w + ids(6) for p, w in zip(prompts, want, strict=True)]
    want2 = [completion(off.generate(p, params)) for p in nexts]
    reqs2 = [Request(list(p), params) for p in nexts]
    got2 = drive(on, {0: reqs2})
    assert [completion(got2[r]) for r in reqs2] == want2
    assert all(r.cached >= len(p) - 6 - BLOCK for r, p in zip(reqs2, prompts, strict=True))
    on.cache.check_integrity()


def test_threads_through_the_scheduler_reply_as_alone():
    model, tokenizer = build_family("llama")
    on = engine(model, tokenizer, step_tokens=16)
    off = engine(model, tokenizer, cache_enabled=False)
    rng = random.Random(11)
    prompts = [[rng.randrange(3, 200) for _ in range(n)] for n in (12, 64, 33, 120, 7)]
    params = SamplingParams(max_tokens=12)
    want = [completion(off.generate(p, params)) for p in prompts]
    got = [None] * len(prompts)
    gate = threading.Barrier(len(prompts))

    def run(i):
        gate.wait()
        got[i] = completion(on.generate(prompts[i], params))

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert got == want
    stats = on.cache_stats()
    assert stats["num_packed_forwards"] >= 1, stats  # arrivals a step apart pack with decodes
    assert stats["num_pinned_blocks"] == 0


def test_a_failed_packed_forward_fails_its_requests_and_the_rest_go_on():
    model, tokenizer = build_family("llama")
    on = engine(model, tokenizer, step_tokens=16)
    off = engine(model, tokenizer, cache_enabled=False)
    runner = on.runner
    real = runner.forward_packed
    calls = []

    def fails_once(states, ids):
        calls.append(len(ids))
        if len(calls) == 1:
            raise RuntimeError("out of memory")
        return real(states, ids)

    runner.forward_packed = fails_once
    params = SamplingParams(max_tokens=6)
    a, b, c = [5, 6, 7, 8, 9] * 8, [11, 12, 13] * 9, [21, 22, 23, 24] * 5
    reqs = [Request(list(p), params) for p in (a, b)]
    events = {}
    active = list(reqs)
    for req in reqs:
        events[req] = []
    outcomes = {}
    while active:  # by hand: the failed ones end with their error
        for req, moved in on.batcher.advance_batch(active).items():
            events[req] += moved.events
            if isinstance(moved.outcome, BaseException):
                outcomes[req] = moved.outcome
                req.phase = Phase.DONE
            else:
                req.phase = moved.outcome
        for req in active:
            if req.phase is Phase.DONE:
                req.release()
        active = [r for r in active if r.phase is not Phase.DONE]
    assert calls[0] == 2 and all(isinstance(outcomes.get(r), RuntimeError) for r in reqs)
    assert on.cache_stats()["num_pinned_blocks"] == 0
    on.cache.check_integrity()
    later = [Request(list(p), params) for p in (a, c)]
    got = drive(on, {0: later})
    assert [completion(got[r]) for r in later] == [
        completion(off.generate(p, params)) for p in (a, c)
    ]
