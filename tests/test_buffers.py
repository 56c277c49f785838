"""The KV buffer pool (engines/torch/buffers.py): mappings reused by size, released exactly, and
the engine's replies with pooled buffers equal to those of an uncached run."""

from __future__ import annotations

import gc
import random
import threading

import pytest
import torch

from promptcache.engines.torch.buffers import MIN_POOLED_BYTES, BufferPool, size_class
from promptcache.serving import memory

pytestmark = pytest.mark.torch


def test_size_classes_cover_the_bytes_with_at_most_an_eighth_more() -> None:
    sizes = [1, 4096, 4097, 65536, 100_000, 491_520, 3 << 20, (3 << 20) + 1, 10**9]
    for n in sizes:
        c = size_class(n)
        assert c >= n and c % 4096 == 0
        assert c <= max(4096, n + n // 8 + 4096)
    assert size_class(100_000) == size_class(99_000)  # near sizes share a class: reuse


def test_a_freed_buffer_is_reused_by_the_next_of_its_class_and_views_keep_it() -> None:
    pool = BufferPool(max_free_bytes=64 << 20)
    a = pool.empty((1, 3, 600, 64), torch.float32)
    a.fill_(1.0)
    ptr, size = a.data_ptr(), a.untyped_storage().nbytes()
    assert size == size_class(a.nbytes) and pool.num_lent_bytes == size
    view = a[:, :, :10]
    del a
    assert pool.num_free_bytes == 0  # a view still holds it
    del view
    assert pool.num_free_bytes == size and pool.num_lent_bytes == 0
    b = pool.empty((1, 3, 599, 64), torch.float32)  # another shape, the same class
    assert b.data_ptr() == ptr and pool.num_maps == 1 and pool.num_free_bytes == 0
    c = pool.empty((2, 3, 599, 64), torch.float32)  # a bigger class: a new mapping
    assert c.data_ptr() != ptr and pool.num_maps == 2
    pool.check_integrity()
    del b, c
    pool.check_integrity()


def test_small_buffers_come_from_the_heap_and_bfloat16_is_pooled() -> None:
    pool = BufferPool()
    small = pool.empty((MIN_POOLED_BYTES // 4 - 1,), torch.float32)
    assert pool.num_maps == 0 and small.numel() == MIN_POOLED_BYTES // 4 - 1
    half = pool.empty((4, 64 << 10), torch.bfloat16)
    want = torch.randn(4, 64 << 10).to(torch.bfloat16)
    half.copy_(want)
    assert pool.num_maps == 1 and half.dtype == torch.bfloat16 and half.is_contiguous()
    assert torch.equal(half, want)
    assert half.data_ptr() % 4096 == 0  # page-aligned: the kernels' vector loads


def test_free_buffers_are_bounded_and_released_exactly() -> None:
    pool = BufferPool(max_free_bytes=3 * size_class(1 << 20), share_floor_bytes=0)
    bufs = [pool.empty((1 << 18,), torch.float32) for _ in range(5)]
    one = size_class(1 << 20)
    assert pool.num_lent_bytes == 5 * one
    del bufs
    assert pool.num_free_bytes == 3 * one and pool.num_lent_bytes == 0  # two unmapped
    pool.check_integrity()
    assert pool.release_free() == 3 * one
    assert pool.release_free() == 0  # safe twice
    assert pool.num_mapped_bytes == 0
    pool.check_integrity()


def test_past_the_mapping_limit_buffers_come_from_the_heap() -> None:
    pool = BufferPool(max_maps=2)
    held = [pool.empty((1 << 18,), torch.float32) for _ in range(4)]
    assert pool.num_maps == 2 and all(t.numel() == 1 << 18 for t in held)
    pool.check_integrity()
    del held
    pool.check_integrity()


def test_the_heap_trim_releases_the_pools_free_buffers() -> None:
    pool = BufferPool()
    memory.add_pool(pool)
    memory.add_pool(pool)  # safe twice
    t = pool.empty((1 << 18,), torch.float32)
    del t
    assert pool.num_free_bytes > 0 and memory.pooled_free_bytes() >= pool.num_free_bytes
    memory.trim_heap()
    assert pool.num_free_bytes == 0 and pool.num_mapped_bytes == 0


def test_many_threads_taking_and_dropping_keep_the_books() -> None:
    pool = BufferPool(max_free_bytes=8 << 20, share_floor_bytes=0)
    errors: list[BaseException] = []

    def churn(seed: int) -> None:
        rng = random.Random(seed)
        held: list[torch.Tensor] = []
        try:
            for _ in range(300):
                if held and rng.random() < 0.5:
                    held.pop(rng.randrange(len(held)))
                else:
                    t = pool.empty((rng.randrange(20_000, 400_000),), torch.float32)
                    t[-1] = seed  # every byte of it is ours
                    held.append(t)
                if rng.random() < 0.05:
                    pool.release_free()
            assert all(t[-1].item() == seed for t in held)
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=churn, args=(k,)) for k in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    gc.collect()
    assert not errors
    pool.check_integrity()
    assert pool.num_lent_bytes == 0 and pool.num_free_bytes <= 8 << 20


def test_free_buffers_are_an_eighth_of_those_lent_within_the_spare_budget() -> None:
    pool = BufferPool(max_free_bytes=0, share_floor_bytes=0)
    one = size_class(1 << 20)
    t = pool.empty((1 << 18,), torch.float32)
    del t
    assert pool.num_free_bytes == 0  # nothing else lent: unmapped at once

    class Engine:
        spare_bytes = 2 * one

        def spare(self) -> int:
            return self.spare_bytes

    engine = Engine()
    memory.add_pool(pool)
    memory.share_spare(engine.spare)
    assert pool.spare is not None
    bufs = [pool.empty((1 << 18,), torch.float32) for _ in range(40)]
    del bufs[:4]
    assert pool.num_free_bytes == 2 * one  # an eighth of 36 lent is more: the spare budget
    engine.spare_bytes = 100 * one
    del bufs[:8]
    assert pool.num_free_bytes == 3 * one  # now the eighth of those lent (28 / 8, whole ones)
    pool.check_integrity()
    del engine
    gc.collect()
    assert pool.spare() == 0  # the engine is gone: no spare, and it was not kept alive
    memory.trim_heap()
    assert pool.num_free_bytes == 0
    del bufs
    pool.check_integrity()


def test_a_free_buffer_grows_or_shrinks_for_a_size_it_does_not_fit() -> None:
    pool = BufferPool(max_free_bytes=64 << 20)
    a = pool.empty((1 << 18,), torch.float32)
    a.fill_(7.0)
    del a
    b = pool.empty((3 << 18,), torch.float32)  # a session's next turn: a bigger buffer
    assert pool.num_maps == 1 and b.untyped_storage().nbytes() == size_class(3 << 20)
    assert torch.all(b[: 1 << 18] == 7.0)  # the same pages, moved, not faulted anew
    b.fill_(1.0)
    del b
    c = pool.empty((1 << 16,), torch.float32)  # far smaller: the big one cut down
    assert pool.num_maps == 1 and c.untyped_storage().nbytes() == size_class(1 << 18)
    assert pool.num_free_bytes == 0
    pool.check_integrity()
    del c
    pool.check_integrity()


def test_with_few_bytes_lent_a_request_s_worth_stays_free_within_the_spare_budget() -> None:
    one = size_class(1 << 20)
    for spare, kept in ((1 << 30, 5), (2 * one, 2)):
        pool = BufferPool(max_free_bytes=0)  # the default floor of the share: FREE_BYTES
        pool.spare = lambda spare=spare: spare
        bufs = [pool.empty((1 << 18,), torch.float32) for _ in range(5)]
        del bufs
        assert pool.num_free_bytes == kept * one
        pool.check_integrity()


def test_a_reserve_is_faulted_in_kept_through_an_idle_trim_and_serves_bigger_buffers() -> None:
    pool = BufferPool(max_free_bytes=0, share_floor_bytes=8 << 20)
    memory.add_pool(pool)  # (it lends the pool the engines' spare budget: replaced below)
    try:
        pool.spare = lambda: 4 << 20  # the RAM budget's unused part bounds the reserve
        assert pool.reserve(64 << 20) == 4 << 20
        assert pool.num_free_bytes == pool.reserve_bytes == 4 << 20 and pool.num_lent_bytes == 0
        assert pool.reserve(64 << 20) == 0  # safe twice: nothing more mapped
        pool.check_integrity()
        maps = pool.num_maps
        t = pool.empty((3 << 18,), torch.float32)  # 3 MiB: a reserved mapping grown in place
        assert pool.num_maps == maps and pool.num_free_bytes < 4 << 20
        t.fill_(2.0)
        assert bool((t == 2.0).all())
        del t
        pool.check_integrity()
        memory.trim_heap(keep_reserve=True)  # an idle trim: the reserve stays
        assert 0 < pool.num_free_bytes <= pool.reserve_bytes
        memory.trim_heap()  # under load, past the allowance: everything goes
        assert pool.num_free_bytes == 0 and pool.num_mapped_bytes == 0
        pool.check_integrity()
    finally:
        memory._pools.remove(pool)
    empty = BufferPool(max_free_bytes=32 << 20)
    empty.spare = lambda: 0  # a full RAM tier: nothing reserved, not even the free floor
    assert empty.reserve(64 << 20) == 0 and empty.num_free_bytes == 0
    assert empty.release_free() == 0
    empty.check_integrity()


def test_an_engine_reserves_within_its_budget_and_replies_as_an_uncached_one() -> None:
    from promptcache.engines.base import SamplingParams
    from promptcache.engines.torch.buffers import POOL
    from promptcache.engines.torch.engine import TorchEngine
    from promptcache.testing.tiny_models import ByteTokenizer, tiny_model

    POOL.release_free()
    cached = TorchEngine(tiny_model("llama"), ByteTokenizer(), block_size=8, ram_budget="2MB")
    assert 0 < POOL.reserve_bytes <= cached.cache.ram.budget_bytes
    assert POOL.num_free_bytes > 0  # faulted in before any request
    plain = TorchEngine(tiny_model("llama"), ByteTokenizer(), cache_enabled=False)
    params = SamplingParams(max_tokens=12)
    history = [3 + (5 * i) % 200 for i in range(90)]
    for _ in range(3):  # later turns restore their history into pooled (reserved) buffers
        want = list(plain.generate(history, params))[-1].completion_ids
        got = list(cached.generate(history, params))[-1].completion_ids
        assert got == want
        history = history + got + [7, 8, 9]
    POOL.check_integrity()
