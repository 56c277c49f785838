"""The step shapes run once at start (torch.warm): every padded decode count and the step
budgets, on throwaway states; the cache untouched, and the answers those of an engine that
never warmed up."""

import logging

import pytest

torch = pytest.importorskip("torch")

from engine_checks import greedy_turns, token_ids  # noqa: E402

from promptcache.engines.base import SamplingParams  # noqa: E402
from promptcache.engines.torch.buffers import POOL  # noqa: E402
from promptcache.engines.torch.engine import TorchEngine  # noqa: E402
from promptcache.engines.torch.onednn import SMALL_ROWS, padded_rows  # noqa: E402
from promptcache.engines.torch.warm import warm_row_counts  # noqa: E402
from promptcache.serving.runner import WarmsUp  # noqa: E402
from promptcache.testing.tiny_models import ByteTokenizer, tiny_model  # noqa: E402

pytestmark = pytest.mark.torch


def test_the_counts_cover_every_padded_decode_count_and_the_step_budgets():
    counts = warm_row_counts(128, 512)
    assert counts[:3] == [512, 320, 128]  # the largest first: the heap's peak
    assert {padded_rows(n) for n in range(1, SMALL_ROWS + 1)} <= set(counts)
    assert len(counts) == len(set(counts))
    assert warm_row_counts(64, 64)[0] == 64 and warm_row_counts(64, 64).count(64) == 1


def test_an_engine_warms_up_at_start_and_leaves_no_state_behind(caplog):
    with caplog.at_level(logging.INFO, logger="promptcache"):
        engine = TorchEngine(tiny_model("llama"), ByteTokenizer(), block_size=8, ram_budget="4MB")
    assert any("warmed up" in r.getMessage() for r in caplog.records)
    assert engine.cache.ram.held_bytes == 0  # no block stored
    assert engine.runner._last_batch is None
    free_before = POOL.num_free_bytes
    ran = engine.runner.warm_up_steps(16, 48)
    limit = engine.runner.model_limit
    assert ran == len([n for n in warm_row_counts(16, 48) if n <= limit])
    assert POOL.num_free_bytes <= free_before  # its states' buffers went back to the system
    assert engine.cache.ram.held_bytes == 0
    engine.cache.check_integrity()


def test_a_warmed_engine_answers_as_one_that_never_warmed(caplog):
    cached = TorchEngine(tiny_model("llama"), ByteTokenizer(), block_size=8, ram_budget="4MB")
    with caplog.at_level(logging.INFO, logger="promptcache"):
        plain = TorchEngine(tiny_model("llama"), ByteTokenizer(), cache_enabled=False,
                            warm_up=False)  # fmt: skip
    assert not any("warmed up" in r.getMessage() for r in caplog.records)
    assert isinstance(cached.runner, WarmsUp)
    for turn, a, b, _ in greedy_turns(cached, plain, SamplingParams(max_tokens=10)):
        assert token_ids(a) == token_ids(b), turn
