"""--weights int8|int4 (engines.torch.weights), the in-place one-row decode and the threads default."""

import copy
import os
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")

from engine_checks import greedy_turns, hit_results, token_ids  # noqa: E402

from promptcache.engines.base import SamplingParams  # noqa: E402
from promptcache.engines.factory import build_engine  # noqa: E402
from promptcache.engines.torch.batch import gather  # noqa: E402
from promptcache.engines.torch.engine import TorchEngine  # noqa: E402
from promptcache.engines.torch.growing import GrowingLayer  # noqa: E402
from promptcache.engines.torch.layouts import can_pack, set_weight_format, weight_owners  # noqa: E402
from promptcache.engines.torch.runner import TorchRunner  # noqa: E402
from promptcache.engines.torch.threads import ThreadTuner, make_thread_tuner, threads_for  # noqa: E402
from promptcache.engines.torch.weights import (  # noqa: E402
    Int4Linear,
    Int8Linear,
    quantize_linears,
    weights_bytes,
    weights_mode,
)
from promptcache.errors import ConfigError  # noqa: E402
from promptcache.testing.tiny_models import ByteTokenizer, tiny_model  # noqa: E402

pytestmark = pytest.mark.torch
CHUNK, BLOCK = 16, 8


@pytest.fixture(scope="module")
def models():
    """The tiny llama as float32, and quantized copies of it (its tied LM head included)."""
    base = tiny_model("llama")
    out = {"model": base}
    for mode in ("int8", "int4"):
        out[mode] = copy.deepcopy(base)
        assert quantize_linears(out[mode], mode) == 15  # 2 x (4 attention + 3 MLP) + LM head
    return out


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_quantized_layers_replace_every_linear_and_stay_close(models, mode):
    model, base = models[mode], models["model"]
    cls = {"int8": Int8Linear, "int4": Int4Linear}[mode]
    assert weights_mode(model) == mode and weights_mode(base) == "model"
    assert not any(type(m) is torch.nn.Linear for m in model.modules())
    assert sum(isinstance(m, cls) for m in model.modules()) == 15
    assert weights_bytes(model) < weights_bytes(base) * (0.6 if mode == "int8" else 0.5)
    ids = torch.tensor([list(range(3, 60))])
    with torch.inference_mode():
        want, got = base(input_ids=ids).logits, model(input_ids=ids).logits
    rel = ((got - want).norm() / want.norm()).item()
    assert rel < (0.02 if mode == "int8" else 0.12), rel  # int4: 16 levels per group of 32
    assert rel > 0  # the weights really changed


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_quantized_engines_cache_on_equals_cache_off(models, mode):
    model = models[mode]
    cached = TorchEngine(
        model, ByteTokenizer(), block_size=BLOCK, ram_budget=10**8, prefill_chunk=CHUNK
    )
    plain = TorchEngine(model, ByteTokenizer(), cache_enabled=False, prefill_chunk=CHUNK)
    for turn, a, b, prev_len in greedy_turns(cached, plain, SamplingParams(max_tokens=10)):
        assert token_ids(a) == token_ids(b), f"{mode} turn {turn}"
        assert turn == 0 or a[0].cached_tokens >= prev_len
    results = hit_results(cached, plain, _logits_of, lambda x, y: (x - y).abs().max().item())
    for name, num_cached, _, diff, same_argmax in results:
        assert num_cached > 0 and bool(same_argmax), name
        # a hit splits the prefill elsewhere; the kernels round activations to bfloat16
        assert diff < 0.05, (name, diff)
    cached.cache.check_integrity()
    assert cached.cache.stats().num_pinned_blocks == 0


def _logits_of(engine, prompt):
    _, logits, lease, _ = engine.prefill(prompt)
    cached = (lease.num_tokens, lease.kind) if lease is not None else (0, "off")
    if lease is not None:
        lease.release()
    return logits, cached


def test_fingerprints_differ_per_weights_mode(models):
    prints = {mode: TorchRunner(m, ByteTokenizer()).fingerprint for mode, m in models.items()}
    assert len(set(prints.values())) == 3
    assert TorchRunner(models["int8"], ByteTokenizer()).fingerprint == prints["int8"]  # stable


def test_one_row_decode_in_place_equals_a_full_recompute(monkeypatch):
    """A lone request decodes through a DecodeBatch of one row (appends in place, a regrow every
    ROOM positions): its greedy tokens equal recomputing the whole sequence each step."""
    monkeypatch.setattr(GrowingLayer, "ROOM", 8)  # regrown twice in 20 tokens
    model = tiny_model("llama")
    engine = TorchEngine(model, ByteTokenizer(), cache_enabled=False, prefill_chunk=CHUNK)
    prompt = list(range(3, 33))
    got = list(engine.generate(prompt, SamplingParams(max_tokens=20)))[-1].completion_ids
    seq = list(prompt)
    with torch.inference_mode():
        for _ in range(len(got)):
            seq.append(int(model(input_ids=torch.tensor([seq])).logits[0, -1].argmax()))
    assert len(got) == 20 and got == seq[len(prompt) :]


def test_bad_weights_value_is_a_config_error_and_exit_2(tmp_path):
    with pytest.raises(ConfigError, match="use int8 or int4"):
        build_engine("torch", None, weights="int3")
    with pytest.raises(ConfigError, match="needs --engine torch"):
        build_engine("mlx", None, weights="int8")
    with pytest.raises(ConfigError, match="CPU kernels"):
        build_engine("torch", None, weights="int4", device="cuda")
    cmd = [sys.executable, "-m", "promptcache.cli", "serve", "--weights", "fp3", "--no-ssd"]
    env = {**os.environ, "PROMPTCACHE_HOME": str(tmp_path)}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "--weights 'fp3': use int8 or int4" in proc.stderr and "Traceback" not in proc.stderr


def test_threads_default_follows_the_other_processes_load():
    assert threads_for(2, 0.0) == 2 and threads_for(2, 0.2) == 2  # a quiet machine: every core
    assert threads_for(2, 0.35) == 2  # a client streaming beside it: still both
    assert threads_for(2, 0.5) == 1 and threads_for(2, 0.9) == 1 and threads_for(2, 5.0) == 1
    assert threads_for(16, 3.1) == 13 and threads_for(16, 3.5) == 12
    calls = []
    now = [0.0]
    tuner = ThreadTuner(None, cores=2, set_threads=calls.append, clock=lambda: now[0])
    first = tuner.apply()
    assert calls == [first] and 1 <= first <= 2
    tuner.apply()
    assert calls == [first]  # set again only when it changes
    now[0] += 10.0  # a re-check is due: it reads the machine and applies its answer
    assert 1 <= tuner.apply() <= 2 and calls[-1] == tuner.threads
    fixed = ThreadTuner(3, cores=2, set_threads=calls.append, clock=lambda: now[0])
    now[0] += 10.0
    assert fixed.apply() == 3 and fixed.apply() == 3 and calls[-1] == 3
    assert dict(fixed.stats()) == {"torch_threads": 3, "thread_changes": 0}
    assert {s.name: s.kind for s in tuner.stats().series()} == {
        "torch_threads": "gauge", "thread_changes": "counter"}  # fmt: skip
    assert make_thread_tuner(0) is None
    with pytest.raises(ConfigError, match="--threads -1"):
        make_thread_tuner(-1)


def test_threads_are_given_up_only_to_lasting_load_and_taken_back_at_once():
    tuner = ThreadTuner(None, cores=2, set_threads=lambda n: None)
    tuner.threads, tuner.num_changes = 2, 0
    assert tuner.decide(0.6) == 2  # one busy window (a client composing its next turns): kept
    assert tuner.decide(0.1) == 2 and tuner.decide(0.6) == 2  # not in a row: still kept
    assert [tuner.decide(0.1), tuner.decide(0.6), tuner.decide(0.1)] == [2, 2, 2]
    assert tuner.decide(0.6) == 2 and tuner.decide(0.7) == 1  # two in a row: given up
    assert tuner.num_changes == 1
    assert tuner.decide(0.1) == 2 and tuner.num_changes == 2  # room again: taken back at once
    assert tuner.decide(2.0) == 2 and tuner.decide(2.0) == 1


@pytest.mark.parametrize("kind", ["gemma3", "jamba", "bamba"])
def test_lone_decode_on_sliding_and_ssm_layouts_appends_in_place(monkeypatch, kind):
    """A lone request on a layout with a sliding ring or SSM layers appends its
    full-attention keys in place (a regrow every ROOM positions, not a copy per token) and gets
    the logits of the plain concatenating forward."""
    monkeypatch.setattr(GrowingLayer, "ROOM", 8)
    runner = TorchRunner(tiny_model(kind), ByteTokenizer())
    assert runner._grown and runner._batches
    j = runner._grown[0]
    fast, plain = runner.new_state(), runner.new_state()
    prompt = list(range(3, 30))
    a, b = runner.forward([fast], [prompt])[0], runner._forward_one(plain, prompt)
    buffers = set()
    for _ in range(20):  # past gemma3's 16-token window
        token = int(a.argmax())
        assert token == int(b.argmax())
        a, b = runner.forward([fast], [[token]])[0], runner._forward_one(plain, [token])
        assert (a - b).abs().max().item() <= 1e-4
        buffers.add(fast.layers[j].keys.untyped_storage().data_ptr())
        assert fast.layers[j].keys.shape == plain.layers[j].keys.shape
    assert len(buffers) <= 4  # 20 tokens in steps of ROOM = 8: the first buffer + 2-3 regrows


def test_decode_buffers_room_ahead_is_finite_whatever_memory_held_before(monkeypatch):
    """A compiled step reads a decode buffer whole, its unwritten room under a -inf mask: that
    room is zeroed, never left as whatever the allocator held (NaN there made every logit NaN,
    as 0 * NaN is NaN). The allocator is handed NaN-filled blocks of the buffers' size first."""
    monkeypatch.setattr(GrowingLayer, "ROOM", 8)
    runner = TorchRunner(tiny_model("llama"), ByteTokenizer())
    states = [runner.new_state() for _ in range(2)]
    for state, prompt in zip(states, ([3, 4, 5, 6, 7], [8, 9]), strict=True):
        runner.forward([state], [prompt])
    k0 = states[0].layers[0].keys
    for _ in range(3):  # batches and regrows get blocks that just held NaN
        for rows, room in ((2, 5 + 8), (2, 5 + 1 + 8), (1, 5 + 8)):
            poison = torch.full((rows, k0.shape[1], room, k0.shape[3]), float("nan"))
            del poison
        batch = gather(runner.model, states, tuple(range(len(states[0].layers))))
        for layer in batch.cache.layers:
            kbuf, vbuf = layer._bufs
            assert torch.isfinite(kbuf).all() and torch.isfinite(vbuf).all()
            layer.reserve(kbuf.shape[-2] + 1)  # a regrow: its new room too
            kbuf, vbuf = layer._bufs
            assert torch.isfinite(kbuf).all() and torch.isfinite(vbuf).all()


@pytest.mark.slow  # one inductor compile (about a minute on 2 cores)
def test_compiled_decode_equals_eager(models, monkeypatch):
    """--compile: a lone request's decode steps through inductor (static buffers, a prepared 4-D
    mask) give eager's greedy tokens across buffer regrows (one compile: dynamic lengths), with
    logits within float noise; a batch of two runs eager on the same runner."""
    monkeypatch.setattr(GrowingLayer, "ROOM", 8)  # regrown twice in 20 tokens
    eager = TorchRunner(models["model"], ByteTokenizer())
    fast = TorchRunner(copy.deepcopy(models["model"]), ByteTokenizer())
    if can_pack():  # packed weights (torch.layouts) are given back plain for inductor
        set_weight_format(fast.model, weight_owners(fast.model), "packed")
    assert fast.enable_compile() > 0 and fast._step is not None
    twin, eager_mlp = fast._step._orig_mod, fast.model.model.layers[0].mlp
    assert twin.model.layers[0].mlp.up_proj.weight is eager_mlp.up_proj.weight  # no copy
    assert type(twin.model.layers[0].mlp.up_proj) is torch.nn.Linear  # inductor's to lower
    prompts = [list(range(3, 40)), list(range(50, 61))]
    for rows in (1, 2):
        a_states = [fast.new_state() for _ in range(rows)]
        b_states = [eager.new_state() for _ in range(rows)]
        a = [fast.forward([s], [p])[0] for s, p in zip(a_states, prompts, strict=False)]
        b = [eager.forward([s], [p])[0] for s, p in zip(b_states, prompts, strict=False)]
        for _ in range(20):
            tokens = [[int(x.argmax())] for x in b]
            assert tokens == [[int(x.argmax())] for x in a]
            a, b = fast.forward(a_states, tokens), eager.forward(b_states, tokens)
            for x, y in zip(a, b, strict=True):
                assert (x - y).abs().max().item() <= 1e-3
        for s, t in zip(a_states, b_states, strict=True):  # the requests' own states agree too
            assert s.get_seq_length() == t.get_seq_length()
            assert (s.layers[1].keys - t.layers[1].keys).abs().max().item() <= 1e-3


def test_runner_forwards_never_build_an_autograd_graph():
    """The runner's model holds no trainable parameters: a forward called outside inference
    mode (a benchmark, a helper) keeps no graph, and so no copy of the cache per decode step
    (a 1,400-token prompt's concatenating decode grew by 70 MB per token that way)."""
    runner = TorchRunner(tiny_model("llama"), ByteTokenizer())
    assert not any(p.requires_grad for p in runner.model.parameters())
    state = runner.new_state()
    out = runner.model(input_ids=torch.tensor([[3, 4, 5]]), cache=state, use_cache=True)
    assert out.logits.grad_fn is None and state.layers[0].keys.grad_fn is None
    logits = runner._forward_one(state, [6])
    assert logits.grad_fn is None and state.get_seq_length() == 4
