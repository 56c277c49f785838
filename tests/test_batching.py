"""Continuous batching: concurrent requests give the tokens they give alone, on every cache kind
of both engines; requests join mid-batch and leave (cancel) without disturbing the others; a
prefix being prefilled by one request is not computed again by another fired alongside it.

Tolerance: a batched decode runs padded/merged attention, so its logits may differ from a lone
forward's in the last float bits (measured: <= 3e-6 on these models); greedy tokens must match
exactly on these prompts, and the runners' batched logits stay within ``LOGIT_TOL``.
"""

import copy
import random
import threading
import time

import numpy as np
import pytest

from promptcache.engines.base import Finished, PrefillDone, SamplingParams, TextDelta
from promptcache.testing.tiny_models import ByteTokenizer

CHUNK, BLOCK = 16, 8
LOGIT_TOL = 1e-4
TORCH_KINDS = ("llama", "gemma3", "mamba", "jamba")
MLX_KINDS = ("llama", "gemma3", "mamba2", "falcon_h1")


def torch_engine(kind, **options):
    pytest.importorskip("torch")
    from promptcache.engines.torch.engine import TorchEngine
    from promptcache.testing.tiny_models import tiny_model

    return TorchEngine(
        tiny_model(kind), ByteTokenizer(), block_size=BLOCK, ram_budget=10**8,
        prefill_chunk=CHUNK, **options,
    )  # fmt: skip


def mlx_engine(kind, **options):
    pytest.importorskip("mlx_lm")
    from promptcache.engines.mlx.engine import MlxEngine
    from promptcache.testing.tiny_models import mlx_tiny_model

    return MlxEngine(
        mlx_tiny_model(kind), ByteTokenizer(), block_size=BLOCK, ram_budget=10**8,
        prefill_chunk=CHUNK, **options,
    )  # fmt: skip


ENGINES = [("torch", k) for k in TORCH_KINDS] + [("mlx", k) for k in MLX_KINDS]


def build(lib, kind, **options):
    return (torch_engine if lib == "torch" else mlx_engine)(kind, **options)


def prompts(n, seed=3):
    rng = random.Random(seed)
    return [[rng.randrange(3, 256) for _ in range(rng.randrange(5, 60))] for _ in range(n)]


def reply(engine, prompt, params, cancel=None, on_event=None):
    out = []
    for ev in engine.generate(prompt, params, cancel=cancel):
        out.append(ev)
        if on_event is not None:
            on_event(ev)
    assert isinstance(out[-1], Finished)
    return out[-1]


def concurrently(jobs):
    """Run the callables on threads started together; their results in order."""
    results = [None] * len(jobs)
    errors = []
    gate = threading.Barrier(len(jobs))

    def run(i, job):
        gate.wait()
        try:
            results[i] = job()
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i, j)) for i, j in enumerate(jobs)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors
    return results


def check_clean(engine):
    engine.cache.check_integrity()
    stats = engine.cache_stats()
    assert stats["num_pinned_blocks"] == 0
    assert stats["batched_rows"] >= 2 * stats["num_batched_forwards"]
    return stats


@pytest.mark.parametrize("lib,kind", ENGINES)
def test_concurrent_greedy_equals_one_by_one(lib, kind):
    alone, together = build(lib, kind), build(lib, kind)
    ps = prompts(4)
    params = [SamplingParams(max_tokens=12) for _ in ps]
    params[1] = SamplingParams(max_tokens=12, temperature=0.8, top_k=20, seed=7)  # per request
    want = [reply(alone, p, sp).completion_ids for p, sp in zip(ps, params, strict=True)]
    got = concurrently(
        [lambda p=p, sp=sp: reply(together, p, sp) for p, sp in zip(ps, params, strict=True)]
    )
    assert [f.completion_ids for f in got] == want
    stats = check_clean(together)
    assert stats["max_batch_rows"] >= 2, stats  # the decodes really shared forwards


@pytest.mark.parametrize(
    "lib,kind",
    [("torch", k) for k in ("llama", "gemma3", "mamba", "jamba", "bamba")]
    + [("mlx", "llama"), ("mlx", "gemma3")],
)
def test_runner_batched_decode_logits_match_lone_forwards(lib, kind):
    runner = build(lib, kind, cache_enabled=False).runner
    ps = prompts(3, seed=5)
    batched, lone = [runner.new_state() for _ in ps], [runner.new_state() for _ in ps]
    a, b = runner.forward(batched, ps), runner.forward(lone, ps)
    for _ in range(20):  # past gemma3's 16-token window
        tokens = [int(np.argmax(runner.to_numpy(x))) for x in a]
        a = runner.forward(batched, [[t] for t in tokens])
        if lib == "torch" and not runner._ragged:  # one padded batch, not a forward per row
            assert len(runner._last_batch.states) == len(ps)
        b = [runner.forward([s], [[t]])[0] for s, t in zip(lone, tokens, strict=True)]
        for x, y in zip(a, b, strict=True):
            x, y = runner.to_numpy(x), runner.to_numpy(y)
            assert np.abs(x - y).max() <= LOGIT_TOL and x.argmax() == y.argmax()


@pytest.mark.parametrize(
    "lib,kind", [("torch", "llama"), ("mlx", "llama"), ("torch", "jamba"), ("torch", "mamba")]
)
def test_request_joining_mid_batch_and_a_cancelled_member(lib, kind):
    alone, together = build(lib, kind), build(lib, kind)
    ps = prompts(3, seed=9)
    params = SamplingParams(max_tokens=40)
    want = [reply(alone, p, params).completion_ids for p in ps[:2]]
    joined = threading.Event()
    cancel = threading.Event()
    late: list = []

    def first(ev):  # the third request joins once the first one is decoding
        if isinstance(ev, TextDelta) and not joined.is_set():
            joined.set()
            t = threading.Thread(target=lambda: late.append(reply(together, ps[1], params)))
            t.start()
            late.append(t)

    def cancelled(ev):
        if isinstance(ev, TextDelta) and len(ev.token_ids) and not cancel.is_set():
            cancel.set()  # after its first token: it leaves the batch mid-decode

    got = concurrently(
        [
            lambda: reply(together, ps[0], params, on_event=first),
            lambda: reply(together, ps[2], params, cancel=cancel, on_event=cancelled),
        ]
    )
    late[0].join(60)
    assert got[0].completion_ids == want[0]
    assert late[1].completion_ids == want[1]
    assert got[1].reason == "cancelled"
    check_clean(together)


@pytest.mark.parametrize("lib,kind", [("torch", "llama"), ("mlx", "llama"), ("torch", "mamba")])
def test_identical_prompts_fired_together_compute_the_prefix_once(lib, kind):
    # a small budget: the first prompt is still prefilling the shared part when the others
    # arrive (a step's budget grows with the requests in it)
    engine = build(lib, kind, step_tokens=16)
    runner = engine.runner
    forward = runner.forward
    prefill_tokens = []

    def counting(run):
        def counted(states, ids):
            prefill_tokens.extend(len(x) for x in ids if len(x) > 1)
            return run(states, ids)

        return counted

    runner.forward = counting(forward)  # the scheduler's steps call it through the runner
    if hasattr(runner, "forward_packed"):  # several prefill pieces in one forward (torch)
        runner.forward_packed = counting(runner.forward_packed)
    rng = random.Random(11)
    shared = [rng.randrange(3, 256) for _ in range(200)]
    ps = [shared + [5, 6, 7], shared + [5, 6, 7], shared + [9, 9]]
    params = SamplingParams(max_tokens=6)
    got = concurrently([lambda p=p: reply(engine, p, params) for p in ps])
    assert got[0].completion_ids == got[1].completion_ids
    assert sum(prefill_tokens) < 1.3 * len(shared), sum(prefill_tokens)  # not 3x
    stats = check_clean(engine)
    assert stats["num_inflight_waits"] == 2, stats
    assert stats["inflight_dedup_tokens"] >= 2 * (len(shared) - 2 * CHUNK), stats
    assert sum(f.cached_tokens for f in got) >= stats["inflight_dedup_tokens"]


@pytest.mark.parametrize("lib", ["torch", "mlx"])
def test_prompts_parting_just_past_a_saved_prefix_do_not_wait_for_each_other(lib):
    # "Task 1: ..." and "Task 12: ...": after the shared system prompt (saved) they share a
    # token or two more. Waiting for the other's prefill would save those tokens and cost a
    # step or more of time to first token (32 agent sessions: seconds).
    engine = build(lib, "llama", step_tokens=16)
    plain = build(lib, "llama", cache_enabled=False)
    rng = random.Random(5)
    shared = [rng.randrange(3, 256) for _ in range(200)]
    params = SamplingParams(max_tokens=6)
    reply(engine, shared + [1, 2], params)  # the shared prefix saved, as an earlier session's
    tails = [[5, 6] + [rng.randrange(3, 256) for _ in range(30)] for _ in range(2)]
    tails[1][1] = 7  # both share one token past the saved prefix
    ps = [shared + t for t in tails]
    want = [reply(plain, p, params).completion_ids for p in ps]
    got = concurrently([lambda p=p: reply(engine, p, params) for p in ps])
    assert [f.completion_ids for f in got] == want
    assert all(f.cached_tokens >= len(shared) for f in got)
    stats = check_clean(engine)
    assert stats["num_inflight_waits"] == 0, stats


def test_stats_add_up_and_the_token_budget_is_an_option():
    engine = torch_engine("llama", step_tokens=4)  # below the chunk: still one chunk per step
    ps = prompts(6, seed=13)
    got = concurrently([lambda p=p: reply(engine, p, SamplingParams(max_tokens=8)) for p in ps])
    stats = check_clean(engine)
    assert stats["num_lookups"] == len(ps) and stats["num_hits"] <= len(ps)
    assert (
        sum(f.completion_tokens for f in got) <= stats["batched_rows"] + stats["num_engine_steps"]
    )
    assert engine.scheduler.num_active == 0


def test_budget_pieces_keep_outputs_and_chunk_aligned_saves():
    """A budget below the chunk runs the prefill in pieces (attention-only layouts): the same
    tokens as a lone run, the saves still at chunk boundaries, and a short request that arrives
    meanwhile gets its first token before the long prompt's."""
    alone, pieces = torch_engine("llama"), torch_engine("llama", step_tokens=5)
    rng = random.Random(17)
    long_prompt = [rng.randrange(3, 256) for _ in range(150)]
    short = [7, 8, 9, 10]
    params = SamplingParams(max_tokens=6)
    want = [reply(alone, p, params).completion_ids for p in (long_prompt, short)]
    first_token_at = {}
    saved_at = []
    save = pieces.steps.save

    def recorded(seq, state, num_tokens):
        if seq.num_tokens == len(long_prompt):  # the long prompt's saves (not the replies')
            saved_at.append(num_tokens)
        save(seq, state, num_tokens)

    pieces.steps.save = recorded  # looked up per save

    def stamp(name):
        return lambda ev: first_token_at.setdefault(name, len(first_token_at))

    got = concurrently(
        [
            lambda: reply(pieces, long_prompt, params, on_event=stamp("long")),
            lambda: reply(pieces, short, params, on_event=stamp("short")),
        ]
    )
    assert [f.completion_ids for f in got] == want
    assert first_token_at["short"] < first_token_at["long"]
    assert saved_at == [*range(CHUNK, len(long_prompt), CHUNK), len(long_prompt)]
    again = reply(pieces, long_prompt + [42], params)
    assert again.cached_tokens >= len(long_prompt) - 1  # the prompt's end was saved
    check_clean(pieces)


def test_a_request_alone_prefills_whole_chunks_and_reports_its_phases():
    """Alone in the engine, a prompt runs in whole chunks whatever the budget (nobody waits
    behind it); its PrefillDone says where the TTFT went (the phases the records show)."""
    engine = torch_engine("llama", step_tokens=5)
    prompt = list(range(3, 3 + 3 * CHUNK + 7))
    events = list(engine.generate(prompt, SamplingParams(max_tokens=3)))
    done = next(ev for ev in events if isinstance(ev, PrefillDone))
    phases = done.phases.to_dict()
    assert phases["num_forwards"] == 4  # 3 chunks and the rest, not 5-token pieces
    assert done.ttft_s * 1e3 >= phases["prefill_ms"] > 0
    assert all(phases[k] >= 0 for k in ("queued_ms", "lookup_ms", "restore_ms", "save_ms"))
    assert phases["first_token_ms"] > 0
    again = list(engine.generate(prompt + [9, 9], SamplingParams(max_tokens=3)))
    hit = next(ev for ev in again if isinstance(ev, PrefillDone))
    assert hit.cached_tokens >= len(prompt) and hit.phases.num_forwards == 1
    # a new turn whose few tokens cross a chunk boundary runs them in one forward; the save at
    # its end still covers the boundary (the next turn reuses past it)
    turn = prompt + [9, 9] + again[-1].completion_ids + list(range(40, 49))  # 60 + 9: past 64
    got = list(engine.generate(turn, SamplingParams(max_tokens=3)))
    done = next(ev for ev in got if isinstance(ev, PrefillDone))
    assert done.cached_tokens // CHUNK < len(turn) // CHUNK and done.phases.num_forwards == 1
    want = reply(torch_engine("llama"), turn, SamplingParams(max_tokens=3)).completion_ids
    assert got[-1].completion_ids == want
    last = list(engine.generate(turn + [5], SamplingParams(max_tokens=1)))
    assert last[-1].cached_tokens >= len(turn) // BLOCK * BLOCK
    check_clean(engine)


def test_torch_kept_batch_notices_a_member_changed_outside_it():
    runner = torch_engine("llama", cache_enabled=False).runner
    ps = prompts(2, seed=21)
    batched, lone = [runner.new_state() for _ in ps], [runner.new_state() for _ in ps]
    runner.forward(batched, ps), runner.forward(lone, ps)
    feeds = [[[5], [6]], [[7], [8]], "a alone", [[9], [10]], [[11], [12]]]
    for feed in feeds:
        if feed == "a alone":  # a lone forward on a member (a prefill piece, a final save)
            got, want = runner.forward(batched[:1], [[4, 4]]), runner.forward(lone[:1], [[4, 4]])
        else:
            got = runner.forward(batched, feed)
            want = [runner.forward([s], [f])[0] for s, f in zip(lone, feed, strict=True)]
        for x, y in zip(got, want, strict=True):
            assert (x - y).abs().max().item() <= LOGIT_TOL
    assert [s.get_seq_length() for s in batched] == [s.get_seq_length() for s in lone]


@pytest.mark.parametrize("packed", [False, True])
def test_a_newcomer_is_prefilled_and_woken_before_the_steps_decode_forward(packed):
    """Prefill priority: in the step where a newly arrived prompt completes, its consumer is
    woken (first token ready) before the batched decode forward of the requests already
    decoding, or, where the runner packs them (``PackedRunner``), with the one forward that
    prefills it and decodes them; and every reply is still the one it gives alone."""
    engine, alone = torch_engine("llama"), torch_engine("llama")
    if not packed:  # the steps as on a runner that cannot pack
        engine.steps.packs = lambda reqs: False
    short = [9, 8, 7, 6, 5]
    params, short_params = SamplingParams(max_tokens=40), SamplingParams(max_tokens=4)
    runs = [(p, reply(alone, p, params).completion_ids) for p in prompts(8, seed=29)]
    longs, want = zip(*[(p, ids) for p, ids in runs if len(ids) == 40][:2], strict=True)
    want_short = reply(alone, short, short_params).completion_ids
    log: list[tuple] = []
    forward, wake = engine.runner.forward, engine.batcher.on_events
    forward_packed = engine.runner.forward_packed

    def logged_forward(states, ids):
        log.append(("forward", tuple(len(x) for x in ids)))
        return forward(states, ids)

    def logged_packed(states, ids):
        log.append(("packed", tuple(len(x) for x in ids)))
        return forward_packed(states, ids)

    def logged_wake(ready):  # the scheduler's deliver: the step's early events, then a wake
        log.append(("wake",))
        return wake(ready)

    engine.runner.forward = logged_forward  # looked up per forward
    engine.runner.forward_packed = logged_packed
    engine.batcher.on_events = logged_wake
    got: list = [None, None]
    threads = [
        threading.Thread(target=lambda i=i: got.__setitem__(i, reply(engine, longs[i], params)))
        for i in range(2)
    ]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 120
    while ("forward", (1, 1)) not in log:  # both are decoding, batched
        assert time.monotonic() < deadline and any(t.is_alive() for t in threads), log[-6:]
        threading.Event().wait(0.001)
    short_reply = reply(engine, short, short_params)
    for t in threads:
        t.join(120)
    assert [g.completion_ids for g in got] == list(want)
    assert short_reply.completion_ids == want_short
    if packed:  # the newcomer's prefill and the decode rows (a save perhaps) in one forward
        at = next(i for i, e in enumerate(log) if e[0] == "packed" and e[1][0] == len(short))
        assert set(log[at][1][1:]) == {1} and len(log[at][1]) >= 3, log[at - 2 : at + 3]
        assert log[at + 1] == ("wake",), log[at - 2 : at + 3]
        assert not any(e[0] == "forward" and len(short) in e[1] for e in log)
        assert engine.cache_stats()["num_packed_forwards"] >= 1
    else:
        at = log.index(("forward", (len(short),)))  # the newcomer's prefill (it fits the budget)
        assert log[at + 1] == ("wake",), log[at - 2 : at + 3]
        # then the step's one-token forward (the decode rows; a reply that ended adds its save)
        assert log[at + 2][0] == "forward" and set(log[at + 2][1]) == {1}, log[at - 2 : at + 3]
        assert engine.cache_stats()["num_packed_forwards"] == 0
    check_clean(engine)


def test_ignore_eos_decodes_past_an_end_of_turn_and_keeps_it_out_of_the_text():
    engine = torch_engine("llama")
    h, i = (b + 3 for b in b"hi")
    forced = (h, i, ByteTokenizer.eos_token_id, h, i)  # an end-of-turn in the middle
    prompt = prompts(1, seed=9)[0]
    stops = reply(engine, prompt, SamplingParams(max_tokens=8, forced_ids=forced))
    assert stops.completion_ids == list(forced[:3]) and stops.reason == "stop"
    goes_on = SamplingParams(max_tokens=8, forced_ids=forced, ignore_eos=True)
    events = []
    fin = reply(engine, prompt, goes_on, on_event=events.append)
    assert fin.completion_ids == list(forced)  # past it, to the reply's end
    assert "".join(e.text for e in events if isinstance(e, TextDelta)) == "hihi"
    fin = reply(engine, prompt, SamplingParams(max_tokens=4, forced_ids=forced, ignore_eos=True))
    assert len(fin.completion_ids) == 4 and fin.reason == "length"
    check_clean(engine)


def test_a_long_prompt_is_not_starved_by_a_stream_of_short_ones(monkeypatch):
    """Many sessions at once: short prompts keep arriving while a long one prefills. The budget
    goes to the prompt passed over most often, so the long one finishes within a bounded number
    of steps (shortest-remaining-first alone would leave it waiting while shorts keep coming)."""
    from promptcache.serving.batching import Batcher
    from promptcache.serving.request import Moved, Phase, Request

    class Steps:  # the batcher's view of the engine: chunk ends and prefill pieces, no model
        can_split_chunks, prefill_chunk, has_cache = True, 64, False

        def chunk_end(self, req):
            return min(req.num_prompt, (req.pos // self.prefill_chunk + 1) * self.prefill_chunk)

        def prefill_step(self, req, end):
            req.pos = end
            return Moved(Phase.PREFILL if end < req.num_prompt else Phase.DECODE)

        def packs(self, reqs):  # each piece through prefill_step
            return False

    from promptcache.serving import batching

    monkeypatch.setattr(batching, "ROW_SHARE", 0)  # a fixed budget: the one they compete for
    batcher = Batcher(Steps(), step_tokens=96, min_shared=10**9)
    params = SamplingParams(max_tokens=1)

    def arrive(n):
        req = Request(list(range(n)), params)
        req.phase = Phase.PREFILL
        return req

    long = arrive(2000)
    active = [long]
    num_steps = 0
    while long.phase is Phase.PREFILL and num_steps < 400:
        active += [arrive(40), arrive(40)]  # nearly the whole budget in short prompts
        moved = batcher.advance_batch(active)
        for req, m in moved.items():
            req.phase = m.outcome
        active = [r for r in active if r.phase is Phase.PREFILL]
        num_steps += 1
    assert long.phase is Phase.DECODE, f"the long prompt got {long.pos} of 2000 in 400 steps"
    assert num_steps < 350  # 2000 tokens at what the shorts leave of the budget (~16 a step)


def test_the_step_budget_grows_with_the_requests_in_a_step():
    from promptcache.serving.batching import MAX_STEP_TOKENS, Batcher

    batcher = Batcher(torch_engine("llama").steps, step_tokens=128, min_shared=32)
    assert [batcher.step_budget(n) for n in (1, 2)] == [192, 384]
    assert batcher.step_budget(1000) == MAX_STEP_TOKENS
    capped = Batcher(
        torch_engine("llama").steps, step_tokens=128, min_shared=32, max_step_tokens=500
    )
    assert [capped.step_budget(n) for n in (1, 2, 4, 1000)] == [192, 384, 500, 500]
    engine = torch_engine("llama", max_step_tokens=700)  # the option reaches the engine's batcher
    assert engine.batcher.step_budget(1000) == 700
    assert Batcher(engine.steps, 128, 32, max_step_tokens=64).step_budget(1000) == 128


@pytest.mark.parametrize("kind", ["gemma3", "llama", "jamba", "mamba"])
def test_restored_hits_decode_batched_as_uncached(kind):
    """Follow-up turns restored from the cache (a sliding ring or SSM state from its
    checkpoint, full attention from blocks) decode together in one batch, replying as
    uncached runs do."""
    engine, plain = build("torch", kind), build("torch", kind, cache_enabled=False)
    params = SamplingParams(max_tokens=24)
    firsts = prompts(4, seed=11)
    replies = [reply(engine, p, params).completion_ids for p in firsts]  # saved: turn 2 hits
    follow = [p + r + [5, 6, 7, 8, 9, 10, 11, 12, 13] for p, r in zip(firsts, replies, strict=True)]
    want = [reply(plain, p, params).completion_ids for p in follow]
    hits_before = engine.cache_stats()["num_hits"]
    got = concurrently([lambda p=p: reply(engine, p, params) for p in follow])
    assert [g.completion_ids for g in got] == want
    stats = check_clean(engine)
    assert stats["num_hits"] - hits_before == len(follow)
    assert stats["max_batch_rows"] >= 2


@pytest.mark.parametrize("kind", ["mamba", "jamba"])
def test_a_batched_ssm_state_counts_its_batch_and_compacts_to_its_own(kind):
    """After a batched step each request's conv/recurrent states are views of the batch's rows:
    its held bytes count the whole batch (the memory it keeps alive); compacted (a finished
    request) it keeps copies of its own row only, and decodes on as an uncompacted twin."""
    runner = build("torch", kind, cache_enabled=False).runner
    ps = prompts(3, seed=13)
    states = [runner.new_state() for _ in ps]
    out = runner.forward(states, ps)
    alone = runner.held_bytes([states[0]])
    runner.reset_decode()
    out = runner.forward(states, [[int(x.argmax())] for x in out])
    batched = runner.held_bytes([states[0]])
    assert batched >= 2 * alone  # the row views keep the three-row batch alive
    twin = copy.deepcopy(states[0])  # views copied whole: the batch's rows, same values
    runner.compact(states[0])
    runner.reset_decode()
    from promptcache.engines.torch.state import layer_tensors

    own = sum(t.nbytes for x in states[0].layers for t in layer_tensors(x))
    assert alone <= runner.held_bytes([states[0]]) == own < batched  # no view left
    token = [[int(out[0].argmax())]]
    a, b = runner.forward([states[0]], token)[0], runner.forward([twin], token)[0]
    assert np.array_equal(runner.to_numpy(a), runner.to_numpy(b))


def test_a_layout_of_sliding_windows_only_decodes_batched_as_alone():
    """Mistral 7B v0.1's layout: every layer a sliding window (16 here), no full attention.
    Rows of different lengths, past their windows, decode in one padded batch with the logits
    of lone forwards; a one-token prompt on a fresh state beside them is a prefill, not a row."""
    pytest.importorskip("torch")
    import torch
    from transformers import AutoModelForCausalLM, MistralConfig

    from promptcache.engines.torch.runner import TorchRunner

    torch.manual_seed(0)
    config = MistralConfig(vocab_size=256, hidden_size=64, intermediate_size=128,
                           num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                           initializer_range=0.2, sliding_window=16)  # fmt: skip
    runner = TorchRunner(AutoModelForCausalLM.from_config(config).eval(), ByteTokenizer())
    assert set(runner.layout.kinds) == {"DynamicSlidingWindowLayer"} and runner._batches
    ps = prompts(3, seed=5)
    batched, lone = [runner.new_state() for _ in ps], [runner.new_state() for _ in ps]
    a, b = runner.forward(batched, ps), runner.forward(lone, ps)
    for _ in range(25):
        tokens = [int(x.argmax()) for x in a]
        a = runner.forward(batched, [[t] for t in tokens])
        assert len(runner._last_batch.states) == len(ps)
        b = [runner.forward([s], [[t]])[0] for s, t in zip(lone, tokens, strict=True)]
        for x, y in zip(a, b, strict=True):
            assert (x - y).abs().max().item() <= LOGIT_TOL and x.argmax() == y.argmax()
    fresh = runner.new_state()
    out = runner.forward([fresh, *batched], [[7], *[[int(x.argmax())] for x in a]])
    assert fresh.get_seq_length() == 1 and len(out) == len(ps) + 1
