"""float32 CPU linears through oneDNN: the same parameters, the same numbers as F.linear up to
summation order, and a cached prefill still equal to an uncached one."""

import copy

import pytest

torch = pytest.importorskip("torch")

from promptcache.engines.base import SamplingParams  # noqa: E402
from promptcache.engines.torch.engine import TorchEngine  # noqa: E402
from promptcache.engines.torch.onednn import (  # noqa: E402
    OneDnnLinear,
    can_use_onednn,
    use_onednn_linears,
)
from promptcache.testing.tiny_models import ByteTokenizer, tiny_model  # noqa: E402

pytestmark = pytest.mark.torch
needs_onednn = pytest.mark.skipif(
    not can_use_onednn(tiny_model("llama")), reason="no oneDNN linear in this torch build"
)


@pytest.fixture(scope="module")
def models():
    plain = tiny_model("llama")
    return plain, copy.deepcopy(plain)


@needs_onednn
def test_swap_keeps_the_parameters_and_the_logits(models):
    plain, model = models
    before = {k: v.data_ptr() for k, v in model.state_dict().items()}
    n = sum(type(m) is torch.nn.Linear for m in model.modules())
    assert use_onednn_linears(model) == n > 0
    assert use_onednn_linears(model) == 0  # idempotent: nothing plain is left
    assert not any(type(m) is torch.nn.Linear for m in model.modules())
    assert all(
        isinstance(m, OneDnnLinear) for m in model.modules() if isinstance(m, torch.nn.Linear)
    )
    # the same tensors under the same keys: state_dict, tied embeddings and fingerprint unchanged
    assert {k: v.data_ptr() for k, v in model.state_dict().items()} == before
    ids = torch.randint(3, 256, (1, 37), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        want, got = plain(input_ids=ids).logits, model(input_ids=ids).logits
    assert (want - got).abs().max().item() < 1e-4
    assert torch.equal(want.argmax(-1), got.argmax(-1))


def test_other_dtypes_and_quantized_layers_are_left_alone():
    model = tiny_model("llama", dtype="bfloat16")
    assert not can_use_onednn(model)
    assert use_onednn_linears(model) == 0
    assert any(type(m) is torch.nn.Linear for m in model.modules())


@needs_onednn
def test_cached_turns_equal_uncached_on_onednn(models):
    """The engine swaps on its own; a hit in the middle of a chunk then a new turn give the
    uncached engine's greedy tokens."""
    _, model = models
    cached = TorchEngine(model, ByteTokenizer(), block_size=8, ram_budget=10**8, prefill_chunk=16)
    plain = TorchEngine(model, ByteTokenizer(), cache_enabled=False, prefill_chunk=16)
    assert not any(type(m) is torch.nn.Linear for m in model.modules())
    params = SamplingParams(max_tokens=8)
    prompt = list(range(3, 44))
    for turn in range(3):
        a, b = list(cached.generate(prompt, params)), list(plain.generate(prompt, params))
        assert a[-1].completion_ids == b[-1].completion_ids, turn
        if turn:
            assert a[-1].cached_tokens >= len(prompt) - 11, turn
        prompt = prompt + a[-1].completion_ids + list(range(50 + turn, 61 + turn))


PRIMITIVES_PROBE = """
import ctypes, sys, torch
from promptcache.engines.torch.onednn import use_onednn_linears
from promptcache.testing.tiny_models import tiny_model
model = tiny_model("llama")
assert use_onednn_linears(model)
class Info(ctypes.Structure):  # glibc's struct mallinfo2: ten size_t fields
    _fields_ = [(f"f{i}", ctypes.c_size_t) for i in range(10)]
libc = ctypes.CDLL("libc.so.6")
libc.mallinfo2.restype = Info
def in_use():
    return libc.mallinfo2().f7  # uordblks: bytes malloc has handed out and not had back
layer = model.model.layers[0].mlp.up_proj
with torch.inference_mode():
    for rows in range(1, 40):
        layer(torch.randn(rows, layer.in_features))
    before = in_use()
    for rows in range(40, 1040):  # a distinct row count each: a new primitive each
        layer(torch.randn(rows, layer.in_features))
print(in_use() - before)
"""


def has_mallinfo2():
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    try:
        return name is not None and hasattr(ctypes.CDLL(name), "mallinfo2")
    except OSError:
        return False


@needs_onednn
@pytest.mark.skipif(not has_mallinfo2(), reason="reads glibc's mallinfo2")
def test_onednn_keeps_a_bounded_number_of_primitives_unless_the_user_sets_it():
    """Each row count builds and keeps a primitive: a server's varied traffic held ~170 MB of
    them at oneDNN's default capacity; ours is bounded, and a user's setting still wins."""
    import os
    import subprocess
    import sys

    names = ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY")

    def growth(capacity):
        env = {k: v for k, v in os.environ.items() if k not in names}
        if capacity is not None:
            env.update(dict.fromkeys(names, str(capacity)))
        out = subprocess.run([sys.executable, "-c", PRIMITIVES_PROBE], env=env, check=True,
                             capture_output=True, text=True).stdout  # fmt: skip
        return int(out.split()[-1])

    ours, theirs = growth(None), growth(1024)
    assert theirs > 4 * max(ours, 1 << 20), (ours, theirs)


@needs_onednn
def test_few_rows_run_at_a_padded_row_count_with_each_rows_own_result():
    """Up to SMALL_ROWS rows a matmul runs at a few row counts (one primitive each kept
    built), with F.linear's results; more rows run as they are."""
    from promptcache.engines.torch.onednn import SMALL_ROWS, onednn_linear, padded_rows

    counts = {padded_rows(n) for n in range(1, SMALL_ROWS + 1)}
    assert len(counts) <= 12 and all(padded_rows(n) >= n for n in range(1, 200))
    assert padded_rows(1) == 1 and padded_rows(SMALL_ROWS + 3) == SMALL_ROWS + 3
    gen = torch.Generator().manual_seed(4)
    w, b = torch.randn(48, 40, generator=gen), torch.randn(48, generator=gen)
    with torch.inference_mode():
        for rows in (1, 3, 5, 13, SMALL_ROWS + 3):
            x = torch.randn(rows, 1, 40, generator=gen)
            got = onednn_linear(x, w, b)
            assert got.shape == (rows, 1, 48)
            want = torch.nn.functional.linear(x, w, b)
            assert torch.allclose(got, want, rtol=1e-5, atol=1e-5)
        # within a padded count the rows beside a row change none of its bits
        x = torch.randn(8, 40, generator=gen)
        firsts = [onednn_linear(x[:rows], w, b)[0] for rows in (5, 6, 7, 8)]
        assert all(torch.equal(firsts[0], f) for f in firsts[1:])
