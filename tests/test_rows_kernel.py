"""The many-rows decode attention kernel (torch.rows_kernel): the same sums as one SDPA call per
row, for rows of different lengths read where they are (views of buffers with room ahead), every
grouped-query shape, and head sizes with and without a specialised loop; bad input is refused."""

import os
import shutil

import pytest

torch = pytest.importorskip("torch")

import torch.nn.functional as F  # noqa: E402

from promptcache.engines.torch import rows_kernel  # noqa: E402
from promptcache.engines.torch.lean import attend_one  # noqa: E402

pytestmark = pytest.mark.torch


@pytest.fixture(scope="module")
def op():
    if shutil.which("c++") is None and shutil.which("g++") is None:
        pytest.skip("no C++ compiler: the serving path keeps one SDPA call per row")
    built = rows_kernel.kernel()
    assert built is not None, "a compiler is here, yet the kernel was not built"
    return built


@pytest.mark.parametrize(
    ("heads", "kv_heads", "dim"), [(9, 3, 64), (4, 4, 128), (8, 2, 32), (6, 1, 48)]
)
def test_rows_of_any_length_match_sdpa_per_row(op, heads, kv_heads, dim):
    gen = torch.Generator().manual_seed(heads * 100 + dim)
    lengths = [1, 2, 17, 300, 1025, 64]
    q = torch.randn(len(lengths), heads, dim, generator=gen)
    keys, values = [], []
    for n in lengths:  # views of longer buffers, as a RowLayer hands them out
        kbuf = torch.randn(1, kv_heads, n + 40, dim, generator=gen)
        vbuf = torch.randn(1, kv_heads, n + 40, dim, generator=gen)
        keys.append(kbuf[:, :, :n])
        values.append(vbuf[:, :, :n])
    scale = dim**-0.5
    got = op(q, keys, values, scale)
    assert got.shape == q.shape
    for r in range(len(lengths)):
        want = F.scaled_dot_product_attention(
            q[r].view(1, heads, 1, dim), keys[r], values[r], scale=scale,
            enable_gqa=heads != kv_heads,
        )  # fmt: skip
        assert torch.allclose(got[r], want.view(heads, dim), atol=2e-5, rtol=1e-4), r
        same_path = attend_one(q[r].view(1, heads, 1, dim), keys[r], values[r], scale, True)
        assert torch.allclose(got[r], same_path.view(heads, dim), atol=2e-5, rtol=1e-4), r


def test_large_scores_stay_finite(op):
    # scores far from zero: the softmax subtracts each head's maximum before exp
    q = torch.full((2, 4, 64), 30.0)
    keys = [torch.full((1, 2, n, 64), 2.0) for n in (3, 50)]
    values = [torch.randn(1, 2, n, 64) for n in (3, 50)]
    got = op(q, keys, values, 1.0)
    assert torch.isfinite(got).all()
    # every key scores alike: the output is each head's mean value row
    want = values[1].mean(2).repeat_interleave(2, 1).view(4, 64)
    assert torch.allclose(got[1], want, atol=1e-5)


def test_bad_input_is_refused(op):
    q = torch.randn(2, 4, 64)
    kv = [torch.randn(1, 2, 5, 64), torch.randn(1, 2, 7, 64)]
    with pytest.raises(RuntimeError, match="one K/V per row"):
        op(q, kv[:1], kv[:1], 1.0)
    with pytest.raises(RuntimeError, match="float32"):
        op(q, [t.double() for t in kv], kv, 1.0)
    with pytest.raises(RuntimeError, match="multiple of kv_heads"):
        op(torch.randn(2, 3, 64), kv, kv, 1.0)
    with pytest.raises(RuntimeError, match="contiguous"):
        op(q.transpose(0, 1).contiguous().transpose(0, 1), kv, kv, 1.0)
    with pytest.raises(RuntimeError, match="differ in length"):
        op(q, kv, [kv[1], kv[0]], 1.0)


def test_a_call_runs_on_the_threads_torch_set_in_the_calling_thread(op):
    # the server's stepping thread sets 2; a background thread then sets 1 (torch remembers the
    # last count any thread set); the stepping thread's kernel calls must still run on 2
    import threading

    if (os.cpu_count() or 1) < 2:
        pytest.skip("one core: nothing to spread over")
    before = torch.get_num_threads()
    stepping_set, other_set = threading.Event(), threading.Event()
    seen: list[int] = []

    def stepping() -> None:
        torch.get_num_threads()  # as threads._torch_set_threads settles torch's own first call
        torch.set_num_threads(2)
        stepping_set.set()
        other_set.wait(10)
        seen.append(rows_kernel.region_threads())
        seen.append(rows_kernel.region_threads())

    try:
        worker = threading.Thread(target=stepping)
        worker.start()
        stepping_set.wait(10)
        torch.set_num_threads(1)
        other_set.set()
        worker.join()
        seen.append(rows_kernel.region_threads())  # this thread: 1
    finally:
        torch.set_num_threads(before)
    assert seen == [2, 2, 1]
