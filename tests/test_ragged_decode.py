"""Ragged decode (torch.ragged): rows that join, leave, and get prefilled or cropped between
steps decode exactly as each request alone through the model's own forward; a request's
layers (``RowLayer``) grow in place, copy only when changed outside, and never write a position
they handed out."""

import pytest

torch = pytest.importorskip("torch")

from transformers import DynamicCache  # noqa: E402

from promptcache.engines.torch.lean import LeanDecoder  # noqa: E402
from promptcache.engines.torch.ragged import RowLayer, ragged_decode  # noqa: E402
from promptcache.engines.torch.runner import TorchRunner  # noqa: E402

pytestmark = pytest.mark.torch
TOL = 1e-4


def lean_runner(tmp_path_factory, name):
    from promptcache.engines.torch.engine import TorchEngine
    from promptcache.testing.tiny_families import save_family

    path = save_family(name, tmp_path_factory.mktemp(name) / "m")
    model, tokenizer = TorchEngine.load_weights(path)
    out = TorchRunner(model, tokenizer)
    assert isinstance(out._decoder, LeanDecoder)
    return out


@pytest.fixture(scope="module")
def runner(tmp_path_factory):
    return lean_runner(tmp_path_factory, "qwen3")  # per-head q/k norms


@pytest.fixture(scope="module", params=["qwen3", "gemma3"])
def any_runner(request, tmp_path_factory, runner):
    """qwen3's, and gemma3's: (1 + w) norms around attention and MLP, sliding rings (window
    16) beside its full-attention layers."""
    return runner if request.param == "qwen3" else lean_runner(tmp_path_factory, "gemma3")


def alone(runner, prompt, tokens):
    """Logits after each of ``tokens`` for one request through the model's forward."""
    state = DynamicCache(config=runner.model.config)  # plain layers: the model's own path
    runner._forward_one(state, prompt)
    return [runner._forward_one(state, [t]) for t in tokens]


def test_rows_joining_leaving_and_changed_outside_decode_as_alone(any_runner):
    runner = any_runner
    prompts = {
        "a": [5, 17, 99, 3, 42, 7, 120, 64, 11],
        "b": [8, 30, 2],
        "c": list(range(40, 90)),
        "d": [7] * 20,
    }
    states = {k: runner.new_state() for k in prompts}
    for k, p in prompts.items():
        runner._forward_one(states[k], p)
    fed: dict[str, list[int]] = {k: [] for k in prompts}
    got: dict[str, list[torch.Tensor]] = {k: [] for k in prompts}
    # who decodes in each step: joins, leaves, a lone forward on a member in between
    schedule = [
        "ab", "ab", "abc", "abc", "bc", "bc", "abcd", "abcd", "prefill a", "abcd", "acd",
        "crop c", "acd", "d", "abcd",
    ]  # fmt: skip
    with torch.inference_mode():
        for step, who in enumerate(schedule):
            if who == "prefill a":  # a prefill piece outside the rows: a's state changes
                piece = [3, 1, 4, 1, 5]
                fed["a"] += piece
                got["a"] += [runner._forward_one(states["a"], [t]) for t in piece]
                continue
            if who == "crop c" and runner.layout.snapshot:
                continue  # a sliding ring is not cut back (a checkpoint is restored instead)
            if who == "crop c":  # cut back (a stop string's rewind): its tail is recomputed
                n = states["c"].get_seq_length() - 3
                runner.crop(states["c"], n)
                fed["c"], got["c"] = fed["c"][:-3], got["c"][:-3]
                continue
            tokens = [(step * 31 + ord(k)) % 200 for k in who]
            logits = ragged_decode(runner._decoder, [states[k] for k in who], tokens)
            for k, t, x in zip(who, tokens, logits, strict=True):
                fed[k].append(t)
                got[k].append(x.clone())
    for k, p in prompts.items():
        want = alone(runner, p, fed[k])
        assert len(want) == len(got[k]) > 0
        worst = max(float((a - b).abs().max()) for a, b in zip(want, got[k], strict=True))
        assert worst < TOL, (k, worst)
        assert states[k].get_seq_length() == len(p) + len(fed[k])


def test_a_row_layer_grows_in_place_and_never_rewrites_what_it_handed_out():
    layer = RowLayer()
    k, v = torch.randn(1, 2, 5, 8), torch.randn(1, 2, 5, 8)
    keys, _ = layer.update(k, v)
    buffer = keys.untyped_storage().data_ptr()
    for _ in range(20):  # decode tokens and a prefill piece: appended where they are
        keys, values = layer.update(torch.randn(1, 2, 1, 8), torch.randn(1, 2, 1, 8))
    keys, values = layer.update(torch.randn(1, 2, 7, 8), torch.randn(1, 2, 7, 8))
    assert keys.untyped_storage().data_ptr() == buffer and keys.shape[2] == 32
    assert torch.equal(keys[:, :, :5], k) and torch.equal(values[:, :, :5], v)
    held = keys.clone()
    layer.crop(-4)  # cut back (a stop string's rewind): the cut positions are someone's view
    again, _ = layer.update(torch.zeros(1, 2, 3, 8), torch.zeros(1, 2, 3, 8))
    assert torch.equal(keys, held)  # the old view is untouched: the layer moved to a new buffer
    assert again.shape[2] == 31 and torch.equal(again[:, :, :28], held[:, :, :28])
    assert not again[:, :, 28:].any()
    for _ in range(200):  # past the room: it grows, the context kept
        again, _ = layer.update(torch.ones(1, 2, 1, 8), torch.ones(1, 2, 1, 8))
    assert again.shape[2] == 231 and torch.equal(again[:, :, :28], held[:, :, :28])


def test_runner_states_grow_in_place_through_prefill_and_decode(runner):
    a, b = runner.new_state(), runner.new_state()
    assert all(isinstance(layer, RowLayer) for layer in a.layers)
    runner.forward([a], [[1, 2, 3, 4]]), runner.forward([b], [[9, 8]])
    buffers = [s.layers[0].keys.untyped_storage().data_ptr() for s in (a, b)]
    runner.forward([a, b], [[5], [6]])
    runner.forward([a], [[7, 7, 7]])  # a prefill piece on a decoding request
    runner.forward([a, b], [[5], [6]])
    assert [s.layers[0].keys.untyped_storage().data_ptr() for s in (a, b)] == buffers
    assert [s.get_seq_length() for s in (a, b)] == [9, 4]
    # the buffers (room ahead included) are what the states keep alive
    assert runner.held_bytes([a, b]) >= 2 * a.layers[0].keys.untyped_storage().nbytes()


def test_a_restored_hit_lands_in_buffers_with_room_and_decodes_as_alone(runner):
    prompt, tokens = list(range(3, 70)), [5, 9, 200, 17]
    first = runner.new_state()
    runner.forward([first], [prompt])
    segments = [(runner.slice_block(first, a, a + 16), min(16, 60 - a)) for a in (0, 16, 32, 48)]
    got = runner.restore(segments, None)  # the first 60 positions, from four blocks
    layer = got.layers[0]
    assert isinstance(layer, RowLayer) and got.get_seq_length() == 60
    buffer = layer.keys.untyped_storage().data_ptr()
    logits = runner.forward([got], [prompt[60:]])  # the rest of the prompt, appended in place
    assert layer.keys.untyped_storage().data_ptr() == buffer
    logits += [runner.forward([got], [[t]])[0] for t in tokens[:-1]]
    want = alone(runner, prompt, tokens[:-1])
    assert torch.allclose(logits[0], alone(runner, prompt[:-1], [prompt[-1]])[0], atol=TOL)
    for g, w in zip(logits[1:], want, strict=True):
        assert torch.allclose(g, w, atol=TOL)


def test_a_state_sized_for_its_prompt_takes_every_piece_in_place(runner):
    prompt = [(7 * i + 3) % 200 for i in range(300)]
    first = runner.new_state()
    runner.forward([first], [prompt[:48]])
    segments = [(runner.slice_block(first, a, a + 16), 16) for a in (0, 16, 32)]
    pieces = [(48, 148), (148, 248), (248, 300)]  # past ROOM (128) beyond the hit
    for hint in (0, len(prompt)):
        fresh = runner.new_state(hint)
        restored = runner.restore(segments, None, hint)
        runner.forward([fresh], [prompt[:48]])
        buffers = [s.layers[0].keys.untyped_storage().data_ptr() for s in (fresh, restored)]
        for a, b in pieces:
            logits = runner.forward([fresh, restored], [prompt[a:b], prompt[a:b]])
        moved = [s.layers[0].keys.untyped_storage().data_ptr() for s in (fresh, restored)]
        # without the hint the prompt outgrows the first buffer; with it nothing moves
        assert (moved == buffers) == (hint > 0), hint
        want = alone(runner, prompt[:-1], [prompt[-1]])[0]
        for got in logits:
            assert torch.allclose(got, want, atol=TOL)
        assert [s.get_seq_length() for s in (fresh, restored)] == [300, 300]


def test_a_kept_state_stays_in_its_own_buffers_and_goes_on_as_alone(runner):
    prompt, reply = [(5 * i + 1) % 200 for i in range(40)], [9, 33, 120]
    state = runner.new_state(len(prompt))
    runner.forward([state], [prompt])
    for t in reply:
        runner.forward([state], [[t]])
    buffer = state.layers[0].keys.untyped_storage().data_ptr()
    kept = runner.compact(state)  # a finished request's state, kept for the next turn
    assert kept.layers[0].keys.untyped_storage().data_ptr() == buffer  # not copied
    runner.crop(kept, len(prompt) + 2)  # the next turn shares all but the last reply token
    logits = runner.forward([kept], [[77, 78]])[0]
    want = alone(runner, prompt + reply[:2] + [77], [78])[0]
    assert torch.allclose(logits, want, atol=TOL)
