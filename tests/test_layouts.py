"""Weights stored transposed or packed where decode matmuls run faster (torch.layouts): the
same parameters under the same keys and the same fingerprint digest (transposed), the model's
logits, stack siblings still views of their stack; packed weights given back exactly."""

import copy
import json

import pytest

torch = pytest.importorskip("torch")

from promptcache.engines.torch.fused import StackedLinear, fuse_projections  # noqa: E402
from promptcache.engines.torch.layout_memo import VOTES  # noqa: E402
from promptcache.engines.torch.layouts import (  # noqa: E402
    can_pack,
    choose_weight_layouts,
    set_weight_format,
    unpack_weights,
    weight_format,
    weight_owners,
)
from promptcache.engines.torch.onednn import can_use_onednn, use_onednn_linears  # noqa: E402
from promptcache.serving.fingerprint import digest_weights  # noqa: E402
from promptcache.testing.tiny_families import build_family  # noqa: E402
from promptcache.testing.tiny_models import tiny_model  # noqa: E402

pytestmark = [
    pytest.mark.torch,
    pytest.mark.skipif(
        not can_use_onednn(tiny_model("llama")), reason="no oneDNN linear in this torch build"
    ),
]


def digest(model):
    return digest_weights(model.state_dict().items(), lambda t: t.detach().float().numpy())


def onednn_pair(family):
    """A tiny model of ``family`` on oneDNN with stacked siblings, and a copy to reformat."""
    plain, _ = build_family(family)
    use_onednn_linears(plain)
    fuse_projections(plain)
    return plain, copy.deepcopy(plain)


def both_logits(plain, model, seed, length):
    ids = torch.randint(3, 250, (1, length), generator=torch.Generator().manual_seed(seed))
    with torch.inference_mode():
        return plain(input_ids=ids).logits, model(input_ids=ids).logits


@pytest.mark.parametrize("family", ["llama", "qwen3_moe"])
def test_transposed_weights_keep_parameters_and_logits(family):
    plain, model = onednn_pair(family)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    owners = weight_owners(model)
    assert owners and not any(weight_format(o) == "transposed" for o in owners)
    set_weight_format(model, owners, "transposed")
    set_weight_format(model, owners, "transposed")  # idempotent
    assert all(weight_format(o) == "transposed" for o in owners)
    after = model.state_dict()
    assert after.keys() == before.keys()
    assert all(torch.equal(after[k], v) for k, v in before.items())
    assert digest(model) == digest(plain)
    for m in model.modules():  # siblings are views of the new storage, not copies
        if isinstance(m, StackedLinear):
            assert m.weight.data_ptr() == m.stack.weight[m.start].data_ptr()
    out = model.get_output_embeddings()  # untied here: an owner like the other weights
    assert out is not None and weight_format(out) == "transposed"
    want, got = both_logits(plain, model, 1, 29)
    assert (want - got).abs().max().item() < 1e-4
    assert torch.equal(want.argmax(-1), got.argmax(-1))


def test_a_machine_keeps_its_layouts_and_later_processes_take_the_majority_untimed(tmp_path):
    """Near-ties went either way from process to process (2 of 8 fresh processes decoded 1-2%
    slower): the first VOTES processes time each class and vote; later ones take the majority
    without timing, so one process timed at a busy moment does not decide for good."""
    memo = tmp_path / "weight_layouts.json"
    for num_timed in range(1, VOTES + 1):
        _, model = onednn_pair("llama")
        choose_weight_layouts(model, min_class_bytes=0, memo_file=memo)
        kept = json.loads(memo.read_text())
        assert len(kept) == 1  # one machine key: shape -> format -> votes
        votes = next(iter(kept.values()))
        assert all(sum(v.values()) == num_timed for v in votes.values())
    majority = {s: max(sorted(v), key=v.__getitem__) for s, v in votes.items()}

    def no_clock() -> float:
        raise AssertionError("a class voted on VOTES times was timed again")

    plain, again = onednn_pair("llama")
    choose_weight_layouts(again, min_class_bytes=0, memo_file=memo, clock=no_clock)
    chosen = again.__dict__["promptcache_layouts"]
    assert {"x".join(map(str, s)): f for s, f in chosen.items()} == majority
    assert json.loads(memo.read_text()) == kept  # an untimed start does not vote
    for owner in weight_owners(again):
        assert weight_format(owner) == chosen[tuple(owner.weight.shape)]
    want, got = both_logits(plain, again, 3, 21)
    assert (want - got).abs().max().item() < 1e-4


def test_a_layout_memo_of_other_formats_or_unreadable_is_timed_again(tmp_path):
    memo = tmp_path / "weight_layouts.json"
    _, model = onednn_pair("llama")
    choose_weight_layouts(model, min_class_bytes=0, memo_file=memo, formats=("stored",))
    num_clock = []

    def clock() -> float:
        num_clock.append(1)
        return float(len(num_clock))

    _, other = onednn_pair("llama")  # more formats allowed: another key, timed
    choose_weight_layouts(other, min_class_bytes=0, memo_file=memo, clock=clock)
    assert num_clock
    assert len(json.loads(memo.read_text())) == 2
    memo.write_text("{not json")
    num_clock.clear()
    _, third = onednn_pair("llama")
    choose_weight_layouts(third, min_class_bytes=0, memo_file=memo, clock=clock)
    assert num_clock  # timed again, and the file replaced by what it found
    assert len(json.loads(memo.read_text())) == 1


def test_choosing_layouts_times_each_class_and_keeps_the_logits():
    plain, model = onednn_pair("llama")
    assert choose_weight_layouts(model) == 0  # tiny weights: below the class size worth timing
    num = choose_weight_layouts(model, min_class_bytes=0)
    owners = weight_owners(model)
    assert num == sum(weight_format(o) != "stored" for o in owners)
    assert choose_weight_layouts(model, min_class_bytes=0) == 0  # decided: nothing left to do
    want, got = both_logits(plain, model, 2, 17)
    assert (want - got).abs().max().item() < 1e-4


@pytest.mark.skipif(not can_pack(), reason="this torch cannot pack weights for oneDNN")
@pytest.mark.parametrize("family", ["llama", "qwen3_moe"])
def test_packed_weights_keep_the_logits_and_unpack_to_the_same_values(family):
    plain, model = onednn_pair(family)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    owners = weight_owners(model)
    set_weight_format(model, owners, "packed")
    assert all(weight_format(o) == "packed" for o in owners)
    for m in model.modules():  # only the stack computes: its siblings hold no copy
        if isinstance(m, StackedLinear):
            assert m.weight.is_meta and m.weight.shape == (m.out_features, m.in_features)
    want, got = both_logits(plain, model, 3, 23)
    with torch.inference_mode():
        # one row and a few rows: the decode shapes (padded to a row bucket, torch.onednn)
        for rows in (1, 3):
            x = torch.randn(rows, 1, plain.config.hidden_size)
            for a, b in zip(weight_owners(plain), weight_owners(model), strict=True):
                if a.weight.shape[1] == x.shape[-1]:
                    assert torch.allclose(a(x), b(x), atol=1e-5)
    assert (want - got).abs().max().item() < 1e-4
    assert torch.equal(want.argmax(-1), got.argmax(-1))
    assert unpack_weights(model) == len(owners)
    assert unpack_weights(model) == 0  # nothing packed is left
    after = model.state_dict()
    assert all(torch.equal(after[k], v) for k, v in before.items())
    assert digest(model) == digest(plain)


def test_a_tied_output_embedding_keeps_its_plain_weight():
    """The input embedding's lookup reads a tied output embedding's weight: it is no owner (an
    untied one is: the test above)."""
    plain, _ = build_family("llama")
    plain.config.tie_word_embeddings = True
    plain.tie_weights()
    use_onednn_linears(plain)
    fuse_projections(plain)
    out = plain.get_output_embeddings()
    assert out.weight.data_ptr() == plain.get_input_embeddings().weight.data_ptr()
    assert all(o is not out for o in weight_owners(plain))
    set_weight_format(plain, weight_owners(plain), "transposed")
    assert weight_format(out) != "transposed"


def test_layouts_are_timed_at_the_most_threads_forwards_run_on(monkeypatch, tmp_path):
    """The loading thread holds one torch thread and the tuner may start on one (a busy
    machine), yet forwards run on every core once it is quiet: the bundled model's down
    projections timed alike stored and packed on one thread, and decoded 10% slower stored on
    two. Warm-up times the layouts at the tuner's most, then steps at its count."""
    import threading

    import promptcache.engines.torch.runner as runner_module
    from promptcache.engines.torch.runner import TorchRunner
    from promptcache.engines.torch.threads import ThreadTuner, hold_one_thread
    from promptcache.testing.tiny_models import ByteTokenizer

    seen: list[tuple[str, int]] = []
    choose = runner_module.choose_weight_layouts

    def spy(model, **kw):
        seen.append(("layouts", torch.get_num_threads()))
        return choose(model, min_class_bytes=0, **kw)

    monkeypatch.setattr(runner_module, "choose_weight_layouts", spy)
    tuner = ThreadTuner(None, cores=2, clock=lambda: 0.0)  # no re-check during the test
    tuner.threads = 1  # started beside another process's work
    runner = TorchRunner(tiny_model("llama"), ByteTokenizer(), threads=tuner)
    runner.layout_memo_file = tmp_path / "weight_layouts.json"  # not the user's cache folder
    assert seen == []  # not on the loading thread
    assert all(weight_format(o) == "stored" for o in weight_owners(runner.model))

    def warm() -> None:
        hold_one_thread()  # as every background thread starts
        runner.warm_up_steps(16, 32)
        seen.append(("after", torch.get_num_threads()))

    thread = threading.Thread(target=warm)
    thread.start()
    thread.join()
    assert seen == [("layouts", 2), ("after", 1)]
    assert runner.model.__dict__["promptcache_layouts"]  # every class decided
    assert "threads=2|" in next(iter(json.loads(runner.layout_memo_file.read_text())))
