"""Ragged decode (torch.ragged): rows that join, leave, and get prefilled or cropped between
steps decode exactly as each request alone through the model's own forward; a row is copied
only when it joins or changed outside, and nothing it handed out is written again."""

import pytest

torch = pytest.importorskip("torch")

from transformers import DynamicCache  # noqa: E402

from promptcache.engines.torch.lean import LeanDecoder  # noqa: E402
from promptcache.engines.torch.ragged import RaggedRows, ragged_decode  # noqa: E402
from promptcache.engines.torch.runner import TorchRunner  # noqa: E402

pytestmark = pytest.mark.torch
TOL = 1e-4


@pytest.fixture(scope="module")
def runner(tmp_path_factory):
    from promptcache.engines.torch.engine import TorchEngine
    from promptcache.testing.tiny_families import save_family

    path = save_family("qwen3", tmp_path_factory.mktemp("qwen3") / "m")  # per-head q/k norms
    model, tokenizer = TorchEngine.load_weights(path)
    out = TorchRunner(model, tokenizer)
    assert isinstance(out._decoder, LeanDecoder)
    return out


def alone(runner, prompt, tokens):
    """Logits after each of ``tokens`` for one request through the model's forward."""
    state = runner.new_state()
    runner._forward_one(state, prompt)
    return [runner._forward_one(state, [t]) for t in tokens]


def test_rows_joining_leaving_and_changed_outside_decode_as_alone(runner):
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
    rows = RaggedRows()
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
            if who == "crop c":  # cut back (a stop string's rewind): its tail is recomputed
                n = states["c"].get_seq_length() - 3
                runner.crop(states["c"], n)
                fed["c"], got["c"] = fed["c"][:-3], got["c"][:-3]
                continue
            tokens = [(step * 31 + ord(k)) % 200 for k in who]
            logits = ragged_decode(runner._decoder, rows, [states[k] for k in who], tokens)
            for k, t, x in zip(who, tokens, logits, strict=True):
                fed[k].append(t)
                got[k].append(x.clone())
    for k, p in prompts.items():
        want = alone(runner, p, fed[k])
        assert len(want) == len(got[k]) > 0
        worst = max(float((a - b).abs().max()) for a, b in zip(want, got[k], strict=True))
        assert worst < TOL, (k, worst)
        assert states[k].get_seq_length() == len(p) + len(fed[k])


def test_a_row_is_copied_only_when_it_joins_or_changed():
    state = DynamicCache()
    for i in range(2):
        state.update(torch.randn(1, 2, 5, 8), torch.randn(1, 2, 5, 8), i)
    rows = RaggedRows()
    (first,) = rows.rows_for([state])
    first.length += 1  # as a step does
    first.hand_out()
    held = state.layers[0].keys
    (again,) = rows.rows_for([state])
    assert again is first  # current: kept, no copy
    assert held.untyped_storage().data_ptr() == first.keys[0].untyped_storage().data_ptr()
    state.layers[0].keys = state.layers[0].keys[:, :, :3].clone()  # changed outside
    state.layers[0].values = state.layers[0].values[:, :, :3].clone()
    (moved,) = rows.rows_for([state])
    assert moved is not first  # adopted again from what the state now holds
    assert rows.rows_for([]) == [] and rows.held() == []  # left: dropped


def test_runner_uses_ragged_rows_and_counts_their_bytes(runner):
    a, b = runner.new_state(), runner.new_state()
    runner.forward([a], [[1, 2, 3, 4]]), runner.forward([b], [[9, 8]])
    runner.forward([a, b], [[5], [6]])
    assert len(runner._rows.held()) == 2
    # the rows' buffers (room ahead included) are what the states keep alive
    assert runner.held_bytes([a, b]) >= sum(
        t.untyped_storage().nbytes() for s in (a, b) for t in (s.layers[0].keys,)
    )
    runner.reset_decode()
    assert runner._rows.held() == []
